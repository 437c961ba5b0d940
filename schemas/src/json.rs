//! A record as JSON text without the fields it leaves empty.
//!
//! The Avro shapes carry one nullable field per detail kind and many optional fields, so a health
//! event written by `serde_json` is mostly `"field": null`: about 1,360 bytes for an event whose
//! set fields take about 860. Incident history stores every recorded event's record as JSON
//! (`health_events.record`), so the nulls were a third of each row, of its WAL and of the work
//! PostgreSQL does to check the text. [`to_string_without_nulls`] writes the same JSON with every
//! struct field that is `None` left out.
//!
//! Reading it back gives the same record: a missing `Option` field deserializes as `None` (serde's
//! rule for derived types; a field with a `with` adapter says `#[serde(default)]`, which the
//! test `json_without_nulls` proves for every optional field of every kind). In SQL, `->>` reads a
//! left-out field as `NULL`, as it read the `null`; `->` gives SQL `NULL` where it gave JSON
//! `null`. Map entries and array elements are written as they are, `null` included: only struct
//! fields are left out.

use std::fmt;

use serde::ser::{self, Impossible, Serialize, Serializer};

/// `value` as JSON text, its `None` struct fields left out.
pub fn to_string_without_nulls<T: Serialize + ?Sized>(value: &T) -> serde_json::Result<String> {
    serde_json::to_string(&SkipNulls(value))
}

/// A value serialized with its `None` struct fields left out, at any depth.
struct SkipNulls<'a, T: ?Sized>(&'a T);

impl<T: Serialize + ?Sized> Serialize for SkipNulls<'_, T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(Skipping(serializer))
    }
}

/// Whether `value` serializes as `None`, found without serializing anything else: the probe
/// answers at the value's first call.
fn is_none<T: Serialize + ?Sized>(value: &T) -> bool {
    value.serialize(NoneProbe).unwrap_or(false)
}

/// A serializer wrapping another, passing every value on through [`SkipNulls`].
struct Skipping<S>(S);

/// A compound serializer wrapping another, its elements passed on through [`SkipNulls`].
struct Compound<C>(C);

/// The serializer methods of one plain value each, handed to `$then` (both serializers here treat
/// them alike).
macro_rules! primitives {
    ($then:ident) => {
        $then!(
            serialize_bool(bool),
            serialize_i8(i8),
            serialize_i16(i16),
            serialize_i32(i32),
            serialize_i64(i64),
            serialize_i128(i128),
            serialize_u8(u8),
            serialize_u16(u16),
            serialize_u32(u32),
            serialize_u64(u64),
            serialize_u128(u128),
            serialize_f32(f32),
            serialize_f64(f64),
            serialize_char(char),
            serialize_str(&str),
            serialize_bytes(&[u8]),
            serialize_unit_struct(&'static str),
        );
    };
}

macro_rules! forward {
    ($($method:ident($t:ty)),+ $(,)?) => {
        $( fn $method(self, v: $t) -> Result<S::Ok, S::Error> { self.0.$method(v) } )+
    };
}

impl<S: Serializer> Serializer for Skipping<S> {
    type Ok = S::Ok;
    type Error = S::Error;
    type SerializeSeq = Compound<S::SerializeSeq>;
    type SerializeTuple = Compound<S::SerializeTuple>;
    type SerializeTupleStruct = Compound<S::SerializeTupleStruct>;
    type SerializeTupleVariant = Compound<S::SerializeTupleVariant>;
    type SerializeMap = Compound<S::SerializeMap>;
    type SerializeStruct = Compound<S::SerializeStruct>;
    type SerializeStructVariant = Compound<S::SerializeStructVariant>;

    primitives!(forward);

    fn serialize_none(self) -> Result<S::Ok, S::Error> {
        self.0.serialize_none()
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<S::Ok, S::Error> {
        self.0.serialize_some(&SkipNulls(value))
    }

    fn serialize_unit(self) -> Result<S::Ok, S::Error> {
        self.0.serialize_unit()
    }

    fn serialize_unit_variant(self, name: &'static str, index: u32, variant: &'static str) -> Result<S::Ok, S::Error> {
        self.0.serialize_unit_variant(name, index, variant)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, name: &'static str, value: &T) -> Result<S::Ok, S::Error> {
        self.0.serialize_newtype_struct(name, &SkipNulls(value))
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<S::Ok, S::Error> {
        self.0.serialize_newtype_variant(name, index, variant, &SkipNulls(value))
    }

    fn serialize_seq(self, len: Option<usize>) -> Result<Self::SerializeSeq, S::Error> {
        self.0.serialize_seq(len).map(Compound)
    }

    fn serialize_tuple(self, len: usize) -> Result<Self::SerializeTuple, S::Error> {
        self.0.serialize_tuple(len).map(Compound)
    }

    fn serialize_tuple_struct(self, name: &'static str, len: usize) -> Result<Self::SerializeTupleStruct, S::Error> {
        self.0.serialize_tuple_struct(name, len).map(Compound)
    }

    fn serialize_tuple_variant(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Self::SerializeTupleVariant, S::Error> {
        self.0.serialize_tuple_variant(name, index, variant, len).map(Compound)
    }

    fn serialize_map(self, len: Option<usize>) -> Result<Self::SerializeMap, S::Error> {
        self.0.serialize_map(len).map(Compound)
    }

    fn serialize_struct(self, name: &'static str, len: usize) -> Result<Self::SerializeStruct, S::Error> {
        self.0.serialize_struct(name, len).map(Compound)
    }

    fn serialize_struct_variant(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Self::SerializeStructVariant, S::Error> {
        self.0.serialize_struct_variant(name, index, variant, len).map(Compound)
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

/// The compound serializers: each element or field passed on through [`SkipNulls`], a struct's
/// `None` fields skipped.
macro_rules! compound {
    ($($kind:ident: $trait:ident::$method:ident),+ $(,)?) => {
        $( compound!(@$kind $trait $method); )+
    };
    (@element $trait:ident $method:ident) => {
        impl<C: ser::$trait> ser::$trait for Compound<C> {
            type Ok = C::Ok;
            type Error = C::Error;

            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), C::Error> {
                self.0.$method(&SkipNulls(value))
            }

            fn end(self) -> Result<C::Ok, C::Error> {
                self.0.end()
            }
        }
    };
    (@field $trait:ident $method:ident) => {
        impl<C: ser::$trait> ser::$trait for Compound<C> {
            type Ok = C::Ok;
            type Error = C::Error;

            fn $method<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<(), C::Error> {
                if is_none(value) { self.0.skip_field(key) } else { self.0.$method(key, &SkipNulls(value)) }
            }

            fn end(self) -> Result<C::Ok, C::Error> {
                self.0.end()
            }
        }
    };
}

compound!(
    element: SerializeSeq::serialize_element,
    element: SerializeTuple::serialize_element,
    element: SerializeTupleStruct::serialize_field,
    element: SerializeTupleVariant::serialize_field,
    field: SerializeStruct::serialize_field,
    field: SerializeStructVariant::serialize_field,
);

impl<C: ser::SerializeMap> ser::SerializeMap for Compound<C> {
    type Ok = C::Ok;
    type Error = C::Error;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), C::Error> {
        self.0.serialize_key(&SkipNulls(key))
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), C::Error> {
        self.0.serialize_value(&SkipNulls(value))
    }

    fn end(self) -> Result<C::Ok, C::Error> {
        self.0.end()
    }
}

/// Answers whether a value is `None` at its first serializer call, and stops there.
struct NoneProbe;

/// The probe's way to stop at a value that is not `None` and has parts.
#[derive(Debug)]
struct NotNone;

impl fmt::Display for NotNone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not none")
    }
}

impl std::error::Error for NotNone {}

impl ser::Error for NotNone {
    fn custom<M: fmt::Display>(_: M) -> Self {
        NotNone
    }
}

macro_rules! not_none {
    ($($method:ident($t:ty)),+ $(,)?) => {
        $( fn $method(self, _: $t) -> Result<bool, NotNone> { Ok(false) } )+
    };
}

impl Serializer for NoneProbe {
    type Ok = bool;
    type Error = NotNone;
    type SerializeSeq = Impossible<bool, NotNone>;
    type SerializeTuple = Impossible<bool, NotNone>;
    type SerializeTupleStruct = Impossible<bool, NotNone>;
    type SerializeTupleVariant = Impossible<bool, NotNone>;
    type SerializeMap = Impossible<bool, NotNone>;
    type SerializeStruct = Impossible<bool, NotNone>;
    type SerializeStructVariant = Impossible<bool, NotNone>;

    primitives!(not_none);

    fn serialize_none(self) -> Result<bool, NotNone> {
        Ok(true)
    }

    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<bool, NotNone> {
        Ok(false)
    }

    fn serialize_unit(self) -> Result<bool, NotNone> {
        Ok(false)
    }

    fn serialize_unit_variant(self, _: &'static str, _: u32, _: &'static str) -> Result<bool, NotNone> {
        Ok(false)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, value: &T) -> Result<bool, NotNone> {
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<bool, NotNone> {
        Ok(false)
    }

    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, NotNone> {
        Err(NotNone)
    }

    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, NotNone> {
        Err(NotNone)
    }

    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeTupleStruct, NotNone> {
        Err(NotNone)
    }

    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, NotNone> {
        Err(NotNone)
    }

    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, NotNone> {
        Err(NotNone)
    }

    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeStruct, NotNone> {
        Err(NotNone)
    }

    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, NotNone> {
        Err(NotNone)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::Serialize;

    use super::to_string_without_nulls;

    #[derive(Serialize)]
    struct Inner {
        a: Option<i32>,
        b: Option<Option<i32>>,
        c: Vec<Option<i32>>,
    }

    #[derive(Serialize)]
    struct Outer {
        first: Option<Inner>,
        second: Option<String>,
        map: BTreeMap<String, Option<i32>>,
        last: Inner,
    }

    #[test]
    fn none_struct_fields_are_left_out_at_any_depth_and_nothing_else_is() {
        let v = Outer {
            first: Some(Inner { a: None, b: Some(None), c: vec![None, Some(1)] }),
            second: None,
            map: BTreeMap::from([("k".to_owned(), None)]),
            last: Inner { a: Some(2), b: None, c: vec![] },
        };
        assert_eq!(
            to_string_without_nulls(&v).unwrap(),
            r#"{"first":{"b":null,"c":[null,1]},"map":{"k":null},"last":{"a":2,"c":[]}}"#
        );
    }

    #[test]
    fn a_struct_of_only_none_fields_is_an_empty_object() {
        let v = Inner { a: None, b: None, c: vec![] };
        assert_eq!(to_string_without_nulls(&v).unwrap(), r#"{"c":[]}"#);
        #[derive(Serialize)]
        struct Empty {
            x: Option<u8>,
        }
        assert_eq!(to_string_without_nulls(&Empty { x: None }).unwrap(), "{}");
    }
}
