//! Serde adapters between the Rust types and the Avro logical types of the schemas.
//!
//! apache-avro serializes `uuid::Uuid` as 16 bytes unless the process-wide "human readable" flag
//! is set, and `chrono` as RFC 3339 text; the schemas say `string`/`uuid` and
//! `long`/`timestamp-micros`. These adapters pin the wire shape, whatever the process-wide flags.

/// `DateTime<Utc>` as microseconds since the epoch (`long`, logicalType `timestamp-micros`).
pub(crate) mod micros {
    use chrono::{DateTime, Utc};
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(value: &DateTime<Utc>, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_i64(value.timestamp_micros())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<DateTime<Utc>, D::Error> {
        from_micros(i64::deserialize(deserializer)?)
    }

    /// Every `i64` of microseconds is inside chrono's range; the check stays so that a change of
    /// chrono's range can never turn into a panic on decode.
    pub(crate) fn from_micros<E: serde::de::Error>(micros: i64) -> Result<DateTime<Utc>, E> {
        DateTime::from_timestamp_micros(micros).ok_or_else(|| E::custom(format!("timestamp out of range: {micros}")))
    }

    /// `Option<DateTime<Utc>>` as a nullable `timestamp-micros`.
    pub(crate) mod option {
        use chrono::{DateTime, Utc};
        use serde::{Deserialize, Deserializer, Serializer};

        pub(crate) fn serialize<S: Serializer>(
            value: &Option<DateTime<Utc>>,
            serializer: S,
        ) -> Result<S::Ok, S::Error> {
            match value {
                Some(value) => serializer.serialize_some(&value.timestamp_micros()),
                None => serializer.serialize_none(),
            }
        }

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
            deserializer: D,
        ) -> Result<Option<DateTime<Utc>>, D::Error> {
            Option::<i64>::deserialize(deserializer)?.map(super::from_micros).transpose()
        }
    }
}

/// `Uuid` as its hyphenated text (`string`, logicalType `uuid`).
pub(crate) mod uuid_str {
    use serde::{Deserializer, Serializer, de};
    use uuid::Uuid;

    pub(crate) fn serialize<S: Serializer>(value: &Uuid, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(value.hyphenated().encode_lower(&mut Uuid::encode_buffer()))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Uuid, D::Error> {
        deserializer.deserialize_str(UuidVisitor)
    }

    /// Accepts text, and 16 raw bytes from readers that hand the logical type over as bytes.
    pub(crate) struct UuidVisitor;

    impl de::Visitor<'_> for UuidVisitor {
        type Value = Uuid;

        fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
            formatter.write_str("a UUID as text")
        }

        fn visit_str<E: de::Error>(self, value: &str) -> Result<Uuid, E> {
            Uuid::parse_str(value).map_err(E::custom)
        }

        fn visit_bytes<E: de::Error>(self, value: &[u8]) -> Result<Uuid, E> {
            Uuid::from_slice(value).map_err(E::custom)
        }
    }

    /// `Vec<Uuid>` as an array of UUID strings.
    pub(crate) mod vec {
        use serde::{Deserialize, Deserializer, Serialize, Serializer};
        use uuid::Uuid;

        /// One element, borrowed for serializing and owned for deserializing.
        struct Item<'a>(&'a Uuid);

        impl Serialize for Item<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                super::serialize(self.0, serializer)
            }
        }

        struct Owned(Uuid);

        impl<'de> Deserialize<'de> for Owned {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                super::deserialize(deserializer).map(Owned)
            }
        }

        pub(crate) fn serialize<S: Serializer>(value: &[Uuid], serializer: S) -> Result<S::Ok, S::Error> {
            serializer.collect_seq(value.iter().map(Item))
        }

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<Uuid>, D::Error> {
            Ok(Vec::<Owned>::deserialize(deserializer)?.into_iter().map(|owned| owned.0).collect())
        }
    }
}
