//! Encode and decode throughput of the four records through the Kafka codec (framing plus Avro).
//!
//! Each record is fully populated, every optional field set: the fixtures of
//! `schemas/tests/common/mod.rs`. The HealthEvent carries the largest detail, an NVLink5 Xid, so
//! its figure is a floor for the other kinds.
//! Each benchmark processes one record per iteration; criterion reports it as elements per second.
//!
//! ```sh
//! cargo bench -p gpumedic-schemas --bench codec -- --warm-up-time 1 --measurement-time 3
//! ```

// The tests' fixtures, included by path so the bench measures the very records the tests check.
#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpumedic_schemas::framing::{self, Record};

/// Benchmarks `encode` and `decode` of one record under `name`.
fn bench_record<T: Record + PartialEq + std::fmt::Debug>(c: &mut Criterion, name: &str, record: &T) {
    let payload = framing::encode(record).expect("the record encodes");
    // A benchmark of a broken codec measures nothing: check the round trip first.
    assert_eq!(&framing::decode::<T>(&payload).expect("the record decodes"), record);

    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(1));
    group.bench_function("encode", |b| b.iter(|| framing::encode(black_box(record)).expect("encodes")));
    // What a producer that reuses its buffer pays.
    let mut buffer = Vec::with_capacity(payload.len());
    group.bench_function("encode_into", |b| {
        b.iter(|| {
            buffer.clear();
            framing::encode_into(black_box(record), &mut buffer).expect("encodes");
        })
    });
    group.bench_function("decode", |b| b.iter(|| framing::decode::<T>(black_box(&payload)).expect("decodes")));
    group.finish();
}

fn codec_benches(c: &mut Criterion) {
    // The first detail is the NVLink5 Xid, the largest.
    let xid = || common::all_details().remove(0);
    bench_record(c, "health_event", &common::health_event(xid()));
    bench_record(c, "enriched_health_event", &common::enriched(xid()));
    bench_record(c, "verdict", &common::verdict());
    bench_record(c, "action_outcome", &common::action_outcome());
}

criterion_group!(benches, codec_benches);
criterion_main!(benches);
