//! The evolution gate: a schema change must be both backward compatible (a reader with the new
//! schema reads data written with the released one) and forward compatible (a reader with the
//! released schema reads data written with the new one), so producers and consumers upgrade in
//! any order.

use std::error::Error as _;

use apache_avro::Schema;
use apache_avro::schema_compatibility::{Compatibility, SchemaCompatibility};

/// A schema change that the gate rejects.
#[derive(Debug, thiserror::Error)]
#[error("schema {schema} is not {direction} compatible with its released version: {detail}")]
pub struct IncompatibleSchema {
    /// Name of the schema checked (e.g. `HealthEvent`).
    pub schema: String,
    /// Which direction failed: `backward` (new reader, released writer) or `forward` (released
    /// reader, new writer).
    pub direction: &'static str,
    /// apache-avro's explanation, with the field that broke the rule and its cause.
    pub detail: String,
}

/// Checks that `current` and `released` can each read data written with the other, fully (not
/// only for some values).
///
/// # Errors
/// [`IncompatibleSchema`] naming the schema, the direction and the rule broken.
pub fn check_full(schema: &str, current: &Schema, released: &Schema) -> Result<(), IncompatibleSchema> {
    check(schema, "backward", released, current)?;
    check(schema, "forward", current, released)
}

fn check(schema: &str, direction: &'static str, writer: &Schema, reader: &Schema) -> Result<(), IncompatibleSchema> {
    let fail = |detail: String| IncompatibleSchema { schema: schema.to_owned(), direction, detail };
    match SchemaCompatibility::can_read(writer, reader) {
        Ok(Compatibility::Full) => Ok(()),
        Ok(Compatibility::Partial) => Err(fail(
            "only partially: some values cannot be read (an enum symbol without a reader default, or a union branch \
             the reader lacks)"
                .to_owned(),
        )),
        Err(error) => {
            // The chain holds the path: "Field 'detail' ... : Field 'xid' ... : must have a default".
            let mut detail = error.to_string();
            let mut source = error.source();
            while let Some(cause) = source {
                detail.push_str(": ");
                detail.push_str(&cause.to_string());
                source = cause.source();
            }
            Err(fail(detail))
        }
    }
}
