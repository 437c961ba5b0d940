//! Avro binary encoding written and read straight from the Rust types, without walking a schema.
//!
//! Why: apache-avro's schema-aware serde path looks every field up by name, hashes a cache key per
//! field and resolves unions and named references per record; that held `HealthEvent` near 500,000
//! records/s/core each way, half the goal of issue 3 (figures in docs/events.md, Performance).
//!
//! The Rust types mirror the `.avsc` files field for field and symbol for symbol (field order,
//! enum symbol order, every union `["null", T]`), so the types alone say what the schema says:
//! a struct is its fields in order, an `Option` is union index 0 (null) or 1 followed by the value,
//! a unit enum variant is its symbol index, a sequence or map is one Avro block and the closing
//! empty block. `schemas/tests/binary.rs` proves the bytes identical to apache-avro's writer
//! with the schema files for every record and detail kind, and that both readers agree on mutated
//! input. Every value of the Rust types fits its schema, so nothing is lost by not validating
//! against the schema at run time.
//!
//! Only data written with this build's schema takes this path; a record written with another
//! version of its schema goes through apache-avro's schema resolution
//! ([`decode_body_with_writer_schema`](crate::framing::decode_body_with_writer_schema)).
//!
//! The reader never trusts a length or count from the input: it checks a length against the bytes
//! left before it takes them, and allocates nothing on the strength of a count (apache-avro
//! allocates a string's claimed length, up to 512 MiB, before it finds the input too short).
//! Errors are [`apache_avro::Error`]s, so the codec's public error types are unchanged.

use std::fmt::Display;

use apache_avro::Error;
use serde::de::{self, DeserializeSeed, IntoDeserializer, Visitor};
use serde::ser::{self, Impossible, Serialize};

/// Appends the Avro binary encoding of `value` to `out`.
///
/// # Errors
/// Only for a type that does not mirror an Avro schema (a defect of this crate, caught by tests).
pub(crate) fn write<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), Error> {
    value.serialize(&mut Encoder { out })
}

/// Reads one value of `T` from the front of `input` and advances `input` past it.
///
/// # Errors
/// Malformed or truncated input; never panics, whatever the bytes.
pub(crate) fn read<T: de::DeserializeOwned>(input: &mut &[u8]) -> Result<T, Error> {
    let mut decoder = Decoder { input };
    let value = T::deserialize(&mut decoder)?;
    *input = decoder.input;
    Ok(value)
}

fn unsupported<T>(what: &str) -> Result<T, Error> {
    Err(encoding(format!("{what} has no Avro mapping in gpumedic's records")))
}

fn encoding(message: impl Display) -> Error {
    ser::Error::custom(message)
}

fn malformed(message: impl Display) -> Error {
    de::Error::custom(message)
}

/// Zigzag and varint, as Avro encodes `int` and `long` (an `int` is the same bytes as its `long`).
fn write_long(out: &mut Vec<u8>, value: i64) {
    let mut zigzag = ((value << 1) ^ (value >> 63)) as u64;
    while zigzag > 0x7f {
        out.push((zigzag as u8 & 0x7f) | 0x80);
        zigzag >>= 7;
    }
    out.push(zigzag as u8);
}

fn write_len(out: &mut Vec<u8>, len: usize) -> Result<(), Error> {
    write_long(out, i64::try_from(len).map_err(|_| encoding(format!("length {len} exceeds a long")))?);
    Ok(())
}

struct Encoder<'o> {
    out: &'o mut Vec<u8>,
}

/// Writes the elements of an array or the entries of a map as a single block: the count, the
/// items, then the empty block that ends the value (an empty collection is the empty block alone).
struct Block<'e, 'o> {
    encoder: &'e mut Encoder<'o>,
    expected: usize,
    written: usize,
}

impl Block<'_, '_> {
    fn end(self) -> Result<(), Error> {
        // A Serialize impl that announced a wrong length would write a block that lies about its
        // count; refuse rather than write data no reader can read.
        if self.written != self.expected {
            return Err(encoding(format!("collection announced {} items and wrote {}", self.expected, self.written)));
        }
        self.encoder.out.push(0);
        Ok(())
    }
}

impl<'e, 'o> Encoder<'o> {
    fn block(&'e mut self, len: Option<usize>) -> Result<Block<'e, 'o>, Error> {
        let Some(len) = len else {
            return unsupported("a sequence or map of unknown length");
        };
        if len > 0 {
            write_len(self.out, len)?;
        }
        Ok(Block { encoder: self, expected: len, written: 0 })
    }
}

impl<'e, 'o> ser::Serializer for &'e mut Encoder<'o> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Block<'e, 'o>;
    type SerializeTuple = Impossible<(), Error>;
    type SerializeTupleStruct = Impossible<(), Error>;
    type SerializeTupleVariant = Impossible<(), Error>;
    type SerializeMap = Block<'e, 'o>;
    type SerializeStruct = Self;
    type SerializeStructVariant = Impossible<(), Error>;

    fn is_human_readable(&self) -> bool {
        // As the codec pins for apache-avro: the wire shape must not depend on a process-wide flag.
        false
    }

    fn serialize_bool(self, value: bool) -> Result<(), Error> {
        self.out.push(u8::from(value));
        Ok(())
    }

    fn serialize_i32(self, value: i32) -> Result<(), Error> {
        write_long(self.out, i64::from(value));
        Ok(())
    }

    fn serialize_i64(self, value: i64) -> Result<(), Error> {
        write_long(self.out, value);
        Ok(())
    }

    fn serialize_f64(self, value: f64) -> Result<(), Error> {
        self.out.extend_from_slice(&value.to_le_bytes());
        Ok(())
    }

    fn serialize_str(self, value: &str) -> Result<(), Error> {
        write_len(self.out, value.len())?;
        self.out.extend_from_slice(value.as_bytes());
        Ok(())
    }

    fn serialize_none(self) -> Result<(), Error> {
        // Union branch 0: every nullable field of the schemas is ["null", T].
        self.out.push(0);
        Ok(())
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Error> {
        // Union branch 1, zigzag-encoded.
        self.out.push(2);
        value.serialize(self)
    }

    fn serialize_unit_variant(self, _name: &'static str, index: u32, _variant: &'static str) -> Result<(), Error> {
        write_long(self.out, i64::from(index));
        Ok(())
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _name: &'static str, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }

    fn serialize_seq(self, len: Option<usize>) -> Result<Block<'e, 'o>, Error> {
        self.block(len)
    }

    fn serialize_map(self, len: Option<usize>) -> Result<Block<'e, 'o>, Error> {
        self.block(len)
    }

    fn serialize_struct(self, _name: &'static str, _len: usize) -> Result<Self, Error> {
        Ok(self)
    }

    fn serialize_i8(self, _: i8) -> Result<(), Error> {
        unsupported("i8")
    }
    fn serialize_i16(self, _: i16) -> Result<(), Error> {
        unsupported("i16")
    }
    fn serialize_u8(self, _: u8) -> Result<(), Error> {
        unsupported("u8")
    }
    fn serialize_u16(self, _: u16) -> Result<(), Error> {
        unsupported("u16")
    }
    fn serialize_u32(self, _: u32) -> Result<(), Error> {
        unsupported("u32")
    }
    fn serialize_u64(self, _: u64) -> Result<(), Error> {
        unsupported("u64")
    }
    fn serialize_f32(self, _: f32) -> Result<(), Error> {
        unsupported("f32")
    }
    fn serialize_char(self, _: char) -> Result<(), Error> {
        unsupported("char")
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<(), Error> {
        unsupported("bytes")
    }
    fn serialize_unit(self) -> Result<(), Error> {
        unsupported("unit")
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Error> {
        unsupported("a unit struct")
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), Error> {
        unsupported("a newtype variant")
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, Error> {
        unsupported("a tuple")
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeTupleStruct, Error> {
        unsupported("a tuple struct")
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Error> {
        unsupported("a tuple variant")
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Error> {
        unsupported("a struct variant")
    }
}

impl ser::SerializeStruct for &mut Encoder<'_> {
    type Ok = ();
    type Error = Error;

    fn serialize_field<T: Serialize + ?Sized>(&mut self, _key: &'static str, value: &T) -> Result<(), Error> {
        value.serialize(&mut **self)
    }

    fn skip_field(&mut self, key: &'static str) -> Result<(), Error> {
        // Every schema field is written; a skipped one would shift all that follow it.
        unsupported(&format!("skipping field {key}"))
    }

    fn end(self) -> Result<(), Error> {
        Ok(())
    }
}

impl ser::SerializeSeq for Block<'_, '_> {
    type Ok = ();
    type Error = Error;

    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.written += 1;
        value.serialize(&mut *self.encoder)
    }

    fn end(self) -> Result<(), Error> {
        Block::end(self)
    }
}

impl ser::SerializeMap for Block<'_, '_> {
    type Ok = ();
    type Error = Error;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        self.written += 1;
        key.serialize(&mut *self.encoder)
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        value.serialize(&mut *self.encoder)
    }

    fn end(self) -> Result<(), Error> {
        Block::end(self)
    }
}

struct Decoder<'de> {
    input: &'de [u8],
}

impl<'de> Decoder<'de> {
    fn byte(&mut self) -> Result<u8, Error> {
        let (&byte, rest) = self.input.split_first().ok_or_else(|| malformed("unexpected end of input"))?;
        self.input = rest;
        Ok(byte)
    }

    /// A varint of at most 10 bytes; bits past the 64th are dropped, as apache-avro does, so that
    /// both readers accept the same bytes.
    fn varint(&mut self) -> Result<u64, Error> {
        let mut value = 0u64;
        for shift in 0..10 {
            let byte = self.byte()?;
            value |= u64::from(byte & 0x7f) << (shift * 7);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(malformed("varint longer than 10 bytes"))
    }

    fn long(&mut self) -> Result<i64, Error> {
        let zigzag = self.varint()?;
        Ok((zigzag >> 1) as i64 ^ -((zigzag & 1) as i64))
    }

    fn int(&mut self) -> Result<i32, Error> {
        let value = self.long()?;
        i32::try_from(value).map_err(|_| malformed(format!("int out of range: {value}")))
    }

    fn str(&mut self) -> Result<&'de str, Error> {
        let len = self.long()?;
        let len = usize::try_from(len).map_err(|_| malformed(format!("negative string length {len}")))?;
        if len > self.input.len() {
            return Err(malformed(format!("string of {len} bytes, only {} left", self.input.len())));
        }
        let (bytes, rest) = self.input.split_at(len);
        self.input = rest;
        std::str::from_utf8(bytes).map_err(|e| malformed(format!("string is not UTF-8: {e}")))
    }

    /// The item count of the next block of an array or map, 0 at the end. A negative count is
    /// followed by the block's size in bytes, which this reader does not need.
    fn block_header(&mut self) -> Result<u64, Error> {
        let count = self.long()?;
        if count < 0 {
            self.long()?;
        }
        Ok(count.unsigned_abs())
    }

    fn not_self_describing<T>(what: &str) -> Result<T, Error> {
        Err(malformed(format!("{what}: Avro binary needs the type to read it")))
    }
}

impl<'de> de::Deserializer<'de> for &mut Decoder<'de> {
    type Error = Error;

    fn is_human_readable(&self) -> bool {
        false
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.byte()? {
            0 => visitor.visit_bool(false),
            1 => visitor.visit_bool(true),
            other => Err(malformed(format!("{other} is not a valid boolean"))),
        }
    }

    fn deserialize_i32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_i32(self.int()?)
    }

    fn deserialize_i64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_i64(self.long()?)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let Some((bytes, rest)) = self.input.split_first_chunk::<8>() else {
            return Err(malformed("unexpected end of input"));
        };
        self.input = rest;
        visitor.visit_f64(f64::from_le_bytes(*bytes))
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_borrowed_str(self.str()?)
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_borrowed_str(self.str()?)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.long()? {
            0 => visitor.visit_none(),
            1 => visitor.visit_some(self),
            other => Err(malformed(format!("union index {other} out of range for [null, T]"))),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _name: &'static str, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let remaining = self.block_header()?;
        visitor.visit_seq(Blocks { decoder: self, remaining })
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let remaining = self.block_header()?;
        visitor.visit_map(Blocks { decoder: self, remaining })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_seq(Fields { decoder: self, remaining: fields.len() })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        let index = self.long()?;
        match u32::try_from(index) {
            Ok(index) if (index as usize) < variants.len() => visitor.visit_enum(Symbol(index)),
            _ => Err(malformed(format!("symbol index {index} out of range for enum {name}"))),
        }
    }

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("any")
    }
    fn deserialize_ignored_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("an ignored value")
    }
    fn deserialize_identifier<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("an identifier")
    }
    fn deserialize_i8<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("i8")
    }
    fn deserialize_i16<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("i16")
    }
    fn deserialize_u8<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("u8")
    }
    fn deserialize_u16<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("u16")
    }
    fn deserialize_u32<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("u32")
    }
    fn deserialize_u64<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("u64")
    }
    fn deserialize_f32<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("f32")
    }
    fn deserialize_char<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("char")
    }
    fn deserialize_bytes<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("bytes")
    }
    fn deserialize_byte_buf<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("bytes")
    }
    fn deserialize_unit<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("unit")
    }
    fn deserialize_unit_struct<V: Visitor<'de>>(self, _: &'static str, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("a unit struct")
    }
    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("a tuple")
    }
    fn deserialize_tuple_struct<V: Visitor<'de>>(self, _: &'static str, _: usize, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("a tuple struct")
    }
}

/// The fields of a record, in schema order.
struct Fields<'d, 'de> {
    decoder: &'d mut Decoder<'de>,
    remaining: usize,
}

impl<'de> de::SeqAccess<'de> for Fields<'_, 'de> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, Error> {
        if self.remaining == 0 {
            return Ok(None);
        }
        self.remaining -= 1;
        seed.deserialize(&mut *self.decoder).map(Some)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.remaining)
    }
}

/// The items of an array or the entries of a map, block after block.
struct Blocks<'d, 'de> {
    decoder: &'d mut Decoder<'de>,
    /// Items left in the current block; 0 once the closing empty block is read.
    remaining: u64,
}

impl Blocks<'_, '_> {
    fn item_done(&mut self) -> Result<(), Error> {
        self.remaining -= 1;
        if self.remaining == 0 {
            self.remaining = self.decoder.block_header()?;
        }
        Ok(())
    }

    /// Every item takes at least one byte, so the bytes left bound the count a hostile block
    /// header can make a collection reserve.
    fn bounded_hint(&self) -> Option<usize> {
        Some(usize::try_from(self.remaining).unwrap_or(usize::MAX).min(self.decoder.input.len()))
    }
}

impl<'de> de::SeqAccess<'de> for Blocks<'_, 'de> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, Error> {
        if self.remaining == 0 {
            return Ok(None);
        }
        let value = seed.deserialize(&mut *self.decoder)?;
        self.item_done()?;
        Ok(Some(value))
    }

    fn size_hint(&self) -> Option<usize> {
        self.bounded_hint()
    }
}

impl<'de> de::MapAccess<'de> for Blocks<'_, 'de> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Error> {
        if self.remaining == 0 {
            return Ok(None);
        }
        seed.deserialize(&mut *self.decoder).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        if self.remaining == 0 {
            // Only a misbehaving Deserialize impl asks for a value after the last key.
            return Err(malformed("map value requested after the last entry"));
        }
        let value = seed.deserialize(&mut *self.decoder)?;
        self.item_done()?;
        Ok(value)
    }

    fn size_hint(&self) -> Option<usize> {
        self.bounded_hint()
    }
}

/// An enum symbol by its index; gpumedic's enums have unit variants only.
struct Symbol(u32);

impl<'de> de::EnumAccess<'de> for Symbol {
    type Error = Error;
    type Variant = Self;

    fn variant_seed<V: DeserializeSeed<'de>>(self, seed: V) -> Result<(V::Value, Self), Error> {
        let variant = seed.deserialize(IntoDeserializer::<Error>::into_deserializer(self.0))?;
        Ok((variant, self))
    }
}

impl<'de> de::VariantAccess<'de> for Symbol {
    type Error = Error;

    fn unit_variant(self) -> Result<(), Error> {
        Ok(())
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, _: T) -> Result<T::Value, Error> {
        Decoder::not_self_describing("a newtype variant")
    }

    fn tuple_variant<V: Visitor<'de>>(self, _: usize, _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("a tuple variant")
    }

    fn struct_variant<V: Visitor<'de>>(self, _: &'static [&'static str], _: V) -> Result<V::Value, Error> {
        Decoder::not_self_describing("a struct variant")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long_bytes(value: i64) -> Vec<u8> {
        let mut out = Vec::new();
        write_long(&mut out, value);
        out
    }

    #[test]
    fn longs_round_trip_at_the_edges() {
        for value in [0, 1, -1, 63, -64, 64, i64::from(i32::MAX), i64::from(i32::MIN), i64::MAX, i64::MIN] {
            let bytes = long_bytes(value);
            let mut input = bytes.as_slice();
            assert_eq!(read::<i64>(&mut input).expect("decodes"), value);
            assert!(input.is_empty());
        }
        // The Avro specification's examples.
        assert_eq!(long_bytes(0), [0x00]);
        assert_eq!(long_bytes(-1), [0x01]);
        assert_eq!(long_bytes(1), [0x02]);
        assert_eq!(long_bytes(-64), [0x7f]);
        assert_eq!(long_bytes(64), [0x80, 0x01]);
    }

    #[test]
    fn an_int_out_of_range_is_malformed() {
        let bytes = long_bytes(i64::from(i32::MAX) + 1);
        assert!(read::<i32>(&mut bytes.as_slice()).is_err());
    }

    #[test]
    fn a_varint_of_eleven_bytes_is_malformed() {
        let bytes = [0xff; 11];
        assert!(read::<i64>(&mut bytes.as_slice()).is_err());
    }

    #[test]
    fn a_string_longer_than_the_input_is_malformed_without_allocating_its_length() {
        // Claims i64::MAX / 2 bytes; the reader must compare with what is left, not allocate.
        let mut bytes = long_bytes(i64::MAX / 2);
        bytes.extend_from_slice(b"abc");
        assert!(read::<String>(&mut bytes.as_slice()).is_err());
        let negative = long_bytes(-3);
        assert!(read::<String>(&mut negative.as_slice()).is_err());
    }

    #[test]
    fn a_block_count_larger_than_the_input_is_malformed() {
        let mut bytes = long_bytes(i64::MIN);
        bytes.push(0);
        assert!(read::<Vec<String>>(&mut bytes.as_slice()).is_err());
    }

    #[test]
    fn negative_block_counts_with_byte_sizes_are_read() {
        // Two blocks, the first with a negative count and its byte size, then the end.
        let mut bytes = long_bytes(-1);
        bytes.extend(long_bytes(2));
        bytes.extend(long_bytes(1));
        bytes.push(b'a');
        bytes.extend(long_bytes(1));
        bytes.extend(long_bytes(1));
        bytes.push(b'b');
        bytes.push(0);
        let mut input = bytes.as_slice();
        assert_eq!(read::<Vec<String>>(&mut input).expect("decodes"), ["a", "b"]);
        assert!(input.is_empty());
    }

    #[test]
    fn a_sequence_of_unknown_length_is_refused() {
        struct Unsized;
        impl Serialize for Unsized {
            fn serialize<S: ser::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_seq(std::iter::from_fn(|| None::<i32>))
            }
        }
        assert!(write(&Unsized, &mut Vec::new()).is_err());
    }
}
