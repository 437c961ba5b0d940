//! The codec's framing and its typed errors, and that no input, however broken, makes it panic.

mod common;

use common::XorShift;
use gpumedic_schemas::framing::{self, DecodeError};
use gpumedic_schemas::{ActionOutcome, EnrichedHealthEvent, HealthEvent, Verdict};

fn sample_payloads() -> Vec<Vec<u8>> {
    let mut payloads: Vec<Vec<u8>> =
        common::all_details().into_iter().map(|d| framing::encode(&common::health_event(d)).unwrap()).collect();
    payloads.push(framing::encode(&common::enriched(common::all_details().remove(0))).unwrap());
    payloads.push(framing::encode(&common::verdict()).unwrap());
    payloads.push(framing::encode(&common::action_outcome()).unwrap());
    payloads
}

#[test]
fn the_frame_is_magic_byte_schema_id_body() {
    let payload = framing::encode(&common::verdict()).unwrap();
    assert_eq!(&payload[..5], &[0, 0, 0, 0, 7]);
    assert_eq!(framing::split_frame(&payload).unwrap().0, framing::VERDICT_V2);
}

#[test]
fn too_short_payloads_are_rejected() {
    for len in 0..5 {
        let err = framing::decode::<HealthEvent>(&vec![0; len]).unwrap_err();
        assert!(matches!(err, DecodeError::TooShort { len: l } if l == len), "{err}");
    }
}

#[test]
fn a_wrong_magic_byte_is_rejected() {
    let mut payload = framing::encode(&common::verdict()).unwrap();
    payload[0] = 0x7b; // a JSON payload starts with '{'
    let err = framing::decode::<Verdict>(&payload).unwrap_err();
    assert!(matches!(err, DecodeError::WrongMagicByte(0x7b)), "{err}");
    assert_eq!(err.reason(), "wrong_magic_byte");
}

#[test]
fn an_unknown_schema_id_is_rejected() {
    let mut payload = framing::encode(&common::verdict()).unwrap();
    payload[1..5].copy_from_slice(&999u32.to_be_bytes());
    let err = framing::decode::<Verdict>(&payload).unwrap_err();
    assert!(matches!(err, DecodeError::UnknownSchemaId(999)), "{err}");
}

#[test]
fn another_record_type_is_rejected() {
    let payload = framing::encode(&common::action_outcome()).unwrap();
    let err = framing::decode::<Verdict>(&payload).unwrap_err();
    match err {
        DecodeError::WrongRecordType { expected, found, id } => {
            assert_eq!(expected, "io.gpumedic.events.Verdict");
            assert_eq!(found, "io.gpumedic.events.ActionOutcome");
            assert_eq!(id, framing::ACTION_OUTCOME_V2);
        }
        other => panic!("expected WrongRecordType, got {other}"),
    }
}

#[test]
fn a_truncated_body_is_malformed() {
    let payload = framing::encode(&common::health_event(common::all_details().remove(0))).unwrap();
    for cut in 5..payload.len() {
        let err = framing::decode::<HealthEvent>(&payload[..cut]).unwrap_err();
        assert!(matches!(err, DecodeError::Malformed(_)), "cut at {cut}: {err}");
    }
}

#[test]
fn trailing_bytes_are_rejected() {
    let mut payload = framing::encode(&common::action_outcome()).unwrap();
    payload.extend_from_slice(&[1, 2, 3]);
    let err = framing::decode::<ActionOutcome>(&payload).unwrap_err();
    assert!(matches!(err, DecodeError::TrailingBytes(3)), "{err}");
}

/// Mutates valid payloads (bit flips, byte overwrites with boundary values, truncation,
/// insertion, splicing of two payloads, random tails) and decodes the result as every record type.
/// Decoding must return, Ok or a typed error, and never panic.
#[test]
fn decoding_mutated_payloads_never_panics() {
    let samples = sample_payloads();
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let interesting = [0x00, 0x01, 0x7f, 0x80, 0xff, 0xfe, 0x3f, 0x40];
    let mut outcomes = [0usize; 2];
    for iteration in 0..20_000 {
        let mut payload = samples[rng.below(samples.len())].clone();
        for _ in 0..1 + rng.below(4) {
            match rng.below(7) {
                0 if !payload.is_empty() => {
                    let i = rng.below(payload.len());
                    payload[i] ^= 1 << rng.below(8);
                }
                1 if !payload.is_empty() => {
                    let i = rng.below(payload.len());
                    payload[i] = interesting[rng.below(interesting.len())];
                }
                2 => payload.truncate(rng.below(payload.len() + 1)),
                3 => {
                    let i = rng.below(payload.len() + 1);
                    payload.insert(i, rng.next() as u8);
                }
                4 => {
                    let other = &samples[rng.below(samples.len())];
                    let cut = rng.below(payload.len() + 1);
                    payload.truncate(cut);
                    payload.extend_from_slice(&other[rng.below(other.len())..]);
                }
                5 => {
                    let n = rng.below(16);
                    payload.extend((0..n).map(|_| rng.next() as u8));
                }
                _ if payload.len() > 5 => {
                    // Keep the frame valid so the body parser gets the garbage.
                    let i = 5 + rng.below(payload.len() - 5);
                    payload[i] = rng.next() as u8;
                }
                _ => {}
            }
        }
        let result = std::panic::catch_unwind(|| {
            [
                framing::decode::<HealthEvent>(&payload).is_ok(),
                framing::decode::<EnrichedHealthEvent>(&payload).is_ok(),
                framing::decode::<Verdict>(&payload).is_ok(),
                framing::decode::<ActionOutcome>(&payload).is_ok(),
            ]
        });
        match result {
            Ok(oks) => outcomes[usize::from(oks.contains(&true))] += 1,
            Err(_) => panic!("decode panicked at iteration {iteration} on {payload:02x?}"),
        }
    }
    // The mutations must reach the body parser often enough to mean something.
    assert!(outcomes[0] > 1_000, "too few rejections: {outcomes:?}");
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = XorShift(42);
    for _ in 0..20_000 {
        let len = rng.below(64);
        let mut payload: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if payload.len() >= 5 && rng.below(2) == 0 {
            // A valid frame header pointing at a real schema, so the bytes reach Avro: the
            // current versions' fast path or an older version's schema resolution.
            payload[..5].copy_from_slice(&[0, 0, 0, 0, 1 + rng.below(framing::SCHEMA_TABLE.len()) as u8]);
        }
        let _ = framing::decode::<HealthEvent>(&payload);
        let _ = framing::decode::<EnrichedHealthEvent>(&payload);
        let _ = framing::decode::<Verdict>(&payload);
        let _ = framing::decode::<ActionOutcome>(&payload);
    }
}
