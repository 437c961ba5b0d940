//! Feeds arbitrary bytes to the Kafka codec's frame splitter and to `decode::<T>` for each of the
//! four records, and checks what comes back:
//!
//! - nothing panics, whatever the bytes (a panic is the crash libFuzzer reports);
//! - for a frame with the record's own schema id, the codec's fast reader and apache-avro's reader
//!   with the schema file agree: the same record, or both an error (the fast path must accept
//!   exactly the Avro that the schema describes);
//! - a decoded record encodes and decodes again to the same bytes.
//!
//! Records are compared by their encodings, not with `==`: a fuzzed double may be NaN.

#![no_main]

use apache_avro::reader::datum::GenericDatumReader;
use gpumedic_schemas::framing::{self, Record};
use gpumedic_schemas::{ActionOutcome, EnrichedHealthEvent, HealthEvent, Verdict};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let frame = framing::split_frame(data);
    if let Ok((_, body)) = &frame {
        assert_eq!(body.len(), data.len() - framing::HEADER_LEN);
    }
    check::<HealthEvent>(data);
    check::<EnrichedHealthEvent>(data);
    check::<Verdict>(data);
    check::<ActionOutcome>(data);
});

fn check<T: Record>(data: &[u8]) {
    let decoded = framing::decode::<T>(data);
    let fast = decoded.as_ref().ok().map(|record| framing::encode(record).expect("a decoded record encodes"));

    if let Ok((id, body)) = framing::split_frame(data)
        && id == T::SCHEMA_ID
    {
        let apache = apache_read::<T>(id, body).map(|record| framing::encode(&record).expect("encodes"));
        assert_eq!(fast, apache, "{}: the fast reader and apache-avro disagree", T::NAME);
    }

    if let Some(encoded) = fast {
        let again = framing::decode::<T>(&encoded).expect("an encoded record decodes");
        assert_eq!(framing::encode(&again).expect("encodes"), encoded, "{}: round trip changed the bytes", T::NAME);
    }
}

fn apache_read<T: Record>(id: u32, body: &[u8]) -> Option<T> {
    let schema = framing::schema_for_id(id)?;
    let reader = GenericDatumReader::builder(schema).human_readable(false).build().ok()?;
    let mut rest = body;
    let record = reader.read_deser::<T>(&mut rest).ok()?;
    rest.is_empty().then_some(record)
}
