//! Throughput of the enrich step alone, on one core: what the enricher's record handler does
//! between Kafka's poll and Kafka's produce (decode the raw record, look the node up in the watch
//! cache, join the Xid catalog and the node's GPU workloads, encode the enriched record).
//! The issue's goal is at least 50,000 events per second per core.
//!
//! The cache holds 1,000 nodes with 8 GPU pods each (one pod per GPU, tied to it by the
//! `gpumedic.io/gpu-uuids` annotation), as the watchers would fill it, and each node's GPU
//! inventory, as the `gpu_inventory` events would; every event's GPU is resolved against it.
//! Events are a realistic mix: mostly per-GPU telemetry (temperature heartbeats, named by UUID),
//! some Xids (with catalog context, named by PCI bus id as the kernel log does), and a few for
//! nodes the cache does not know.
//!
//! `decode_verify_enrich_encode_1000_mixed` adds what `--node-auth=enforce` adds: each record
//! carries its node's token (a real token's size), the batch's tokens are looked up in the review
//! cache ([`Verifier::prepare`], every token reviewed already, as in steady state where a node's
//! token changes about hourly), and each record is checked against its node and key
//! ([`Verifier::check`]).
//!
//! `decode_verify_signed_enrich_encode_1000_mixed` is the same with signed records, the
//! collector's default (`--node-auth-proof signature`): each record carries its node's key id and
//! an HMAC of its key and value instead of the token; the handler finds each key id in the
//! node-token directory ([`NodeAuth::proofs`], the directory holding every node's token as read
//! from its topic), looks the directory's tokens up in the review cache, and checks each record's
//! node and signature ([`NodeAuth::check`]), as the service's handler does.
//!
//! ```sh
//! cargo bench -p gpumedic-enricher --bench enrich -- --warm-up-time 1 --measurement-time 5
//! ```

use std::collections::BTreeMap;
use std::hint::black_box;

use chrono::Utc;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpumedic_enricher::auth::{AuthError, Policy, Review, Reviewer, ServiceAccountRef, Verifier};
use gpumedic_enricher::cache::{ClusterCache, ContextSettings};
use gpumedic_enricher::catalog::XidCatalog;
use gpumedic_enricher::directory::{Directory, NodeAuth};
use gpumedic_enricher::enrich;
use gpumedic_enricher::inventory::InventoryCache;
use gpumedic_runtime::kafka::node_proof::NodeKey;
use gpumedic_runtime::kafka::{Record, record_headers};
use gpumedic_schemas::health::{
    Component, Detail, Entity, GpuIdentity, GpuInventoryDetail, Source, TemperatureDetail, XidDetail,
};
use gpumedic_schemas::{EnrichedHealthEvent, HealthEvent};
use k8s_openapi::api::core::v1::{Node, Pod};

const NODES: usize = 1_000;
const GPUS: usize = 8;

fn gpu_uuid(node: usize, gpu: usize) -> String {
    format!("GPU-{node:08x}-0000-0000-0000-{gpu:012x}")
}

fn node_name(node: usize) -> String {
    format!("gpu-node-{node:04}")
}

fn pci(gpu: usize) -> String {
    format!("00000000:{:02X}:00.0", 0x18 + gpu * 0x10)
}

/// Every node's inventory, PCI ids as NVML writes them (8-digit domain, upper case).
fn filled_inventory() -> InventoryCache {
    let mut inventory = InventoryCache::default();
    for n in 0..NODES {
        let gpus = (0..GPUS)
            .map(|g| GpuIdentity {
                index: Some(g as i32),
                uuid: Some(gpu_uuid(n, g)),
                pci_bus_id: Some(pci(g)),
                serial: Some(format!("1650{n:04}{g:04}")),
                product: Some("NVIDIA H100 80GB HBM3".into()),
                nvlink_domain: None,
            })
            .collect();
        let detail = GpuInventoryDetail { gpus, reason: GpuInventoryDetail::START.into(), expected: Some(GPUS as i32) };
        inventory.apply(&node_name(n), &detail, Utc::now());
    }
    inventory
}

fn filled_cache() -> ClusterCache {
    let cache = ClusterCache::default();
    let settings = ContextSettings {
        selected_labels: vec!["gpumedic.io/pool".into(), "topology.kubernetes.io/region".into()],
        cluster: Some("bench".into()),
    };
    for n in 0..NODES {
        let labels: BTreeMap<&str, &str> = BTreeMap::from([
            ("node.kubernetes.io/instance-type", "p5.48xlarge"),
            ("topology.kubernetes.io/zone", "us-east-1a"),
            ("topology.kubernetes.io/region", "us-east-1"),
            ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"),
            ("nvidia.com/cuda.driver-version.full", "570.86.15"),
            ("nvidia.com/gpu.present", "true"),
            ("gpumedic.io/pool", "training"),
        ]);
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": { "name": node_name(n), "labels": labels },
        }))
        .expect("node");
        cache.apply_node(&node, &settings);
        for g in 0..GPUS {
            let pod: Pod = serde_json::from_value(serde_json::json!({
                "metadata": {
                    "name": format!("train-{n}-{g}"),
                    "namespace": "ml",
                    "annotations": { "gpumedic.io/gpu-uuids": gpu_uuid(n, g) },
                    "ownerReferences": [{ "apiVersion": "batch/v1", "kind": "Job", "name": format!("train-{n}"),
                                          "uid": "00000000-0000-0000-0000-000000000000", "controller": true }],
                },
                "spec": {
                    "nodeName": node_name(n),
                    "containers": [{ "name": "main", "image": "trainer",
                                     "resources": { "limits": { "nvidia.com/gpu": "1" } } }],
                },
                "status": { "phase": "Running" },
            }))
            .expect("pod");
            cache.apply_pod(&pod);
        }
    }
    assert_eq!(cache.node_count(), NODES);
    cache
}

/// 1,000 framed raw events: 94% telemetry (by UUID and index, as NVML names GPUs), 5% Xids (by
/// PCI bus id only, as the kernel log names them), 1% for nodes the cache does not know.
fn raw_events() -> Vec<Vec<u8>> {
    (0..1_000)
        .map(|i| {
            let n = (i * 7) % NODES;
            let g = i % GPUS;
            let mut entity = Entity { gpu_uuid: Some(gpu_uuid(n, g)), gpu_index: Some(g as i32), ..Entity::default() };
            let (node, component, detail) = match i % 100 {
                0..5 => {
                    entity =
                        Entity { pci_bus_id: Some(pci(g).replacen("0000", "", 1).to_lowercase()), ..Entity::default() };
                    (
                        node_name(n),
                        Component::Gpu,
                        Detail::Xid(XidDetail {
                            code: [79, 48, 13, 94, 63][i % 5],
                            text: "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.".into(),
                            pid: Some(1234),
                            process: Some("python".into()),
                            nvlink5: None,
                            recovery_action: None,
                        }),
                    )
                }
                5 => (format!("unknown-{n}"), Component::Gpu, Detail::Temperature(temperature())),
                _ => (node_name(n), Component::Gpu, Detail::Temperature(temperature())),
            };
            let event = HealthEvent::new(node, Source::Nvml, component, entity, detail);
            gpumedic_schemas::encode(&event).expect("encodes")
        })
        .collect()
}

fn temperature() -> TemperatureDetail {
    TemperatureDetail { celsius: 61, slowdown_celsius: Some(87), shutdown_celsius: Some(92) }
}

/// The handler's work for one record, without Kafka.
fn enrich_step(
    cache: &ClusterCache,
    inventory: &InventoryCache,
    catalog: &XidCatalog,
    payload: &[u8],
    out: &mut Vec<u8>,
) {
    let event: HealthEvent = gpumedic_schemas::decode(payload).expect("decodes");
    let node = cache.node(&event.node);
    let gpu = inventory.resolve(&event.node, &event.entity, event.component, event.observed_at);
    let enriched: EnrichedHealthEvent = enrich::enrich(event, node.as_deref(), gpu, catalog, Utc::now());
    out.clear();
    gpumedic_schemas::framing::encode_into(&enriched, out).expect("encodes");
}

/// Answers every token as the collector's on the node it names, as the apiserver would for a
/// Pod-bound token; counts nothing (steady state asks it nothing).
struct Apiserver;

impl Reviewer for Apiserver {
    async fn review(&self, token: &str) -> Result<Review, AuthError> {
        let signature = token.split('.').nth(2).unwrap_or_default();
        let node = signature.split('~').next().unwrap_or_default().to_owned();
        Ok(Review::Authenticated {
            username: "system:serviceaccount:gpumedic:gpumedic-collector".into(),
            node: Some(node),
        })
    }
}

/// A token the size of a projected ServiceAccount token (about 1 KiB), for `node`; the fake
/// apiserver reads the node from its last part.
fn token(node: &str) -> Vec<u8> {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let claims = format!(
        r#"{{"aud":["gpumedic"],"exp":{},"iat":1764590000,"iss":"https://kubernetes.default.svc","kubernetes.io":{{"namespace":"gpumedic","node":{{"name":"{node}","uid":"5e5b9c1a-0000-4000-8000-000000000000"}},"pod":{{"name":"gpumedic-collector-x7k2p","uid":"9f1c2d3e-0000-4000-8000-000000000000"}},"serviceaccount":{{"name":"gpumedic-collector","uid":"0a1b2c3d-0000-4000-8000-000000000000"}}}},"nbf":1764590000,"sub":"system:serviceaccount:gpumedic:gpumedic-collector"}}"#,
        chrono::Utc::now().timestamp() + 3600
    );
    // The signature's place holds the node and RS256's 342 characters.
    format!("{}.{}.{node}~{}", b64(r#"{"alg":"RS256","kid":"k8s-signing-key-0001"}"#), b64(&claims), "x".repeat(342))
        .into_bytes()
}

fn bench(c: &mut Criterion) {
    let cache = filled_cache();
    let inventory = filled_inventory();
    let catalog = XidCatalog::embedded();
    let events = raw_events();
    let mut out = Vec::with_capacity(1024);

    // Check the step does what the service does before timing it.
    enrich_step(&cache, &inventory, &catalog, &events[0], &mut out);
    let enriched: EnrichedHealthEvent = gpumedic_schemas::decode(&out).expect("round trip");
    assert!(!enriched.node_unknown);
    assert!(enriched.xid_catalog.is_some(), "the first event is an Xid 79 with catalog context");
    assert_eq!(enriched.gpu.as_ref().and_then(|g| g.uuid.as_deref()), Some(gpu_uuid(0, 0).as_str()), "by PCI id");
    assert_eq!(enriched.workloads.len(), 1, "narrowed to the pod on the faulty GPU");
    enrich_step(&cache, &inventory, &catalog, &events[10], &mut out);
    let enriched: EnrichedHealthEvent = gpumedic_schemas::decode(&out).expect("round trip");
    assert!(enriched.gpu.is_some() && !enriched.gpu_unresolved, "telemetry resolved by UUID");

    let mut group = c.benchmark_group("enrich");
    group.throughput(Throughput::Elements(events.len() as u64));
    group.bench_function("decode_enrich_encode_1000_mixed", |b| {
        b.iter(|| {
            for payload in &events {
                enrich_step(&cache, &inventory, &catalog, black_box(payload), &mut out);
            }
        })
    });

    // With node authentication: every record with its node's token, the cache warm.
    let keyed: Vec<(Vec<u8>, Vec<u8>)> = events
        .iter()
        .map(|payload| {
            let node = gpumedic_schemas::decode::<HealthEvent>(payload).expect("decodes").node;
            let t = token(&node);
            (node.into_bytes(), t)
        })
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let policy = || Policy {
        collector: ServiceAccountRef::parse("gpumedic:gpumedic-collector").expect("valid"),
        operator: None,
    };
    let mut verifier = Verifier::new(Apiserver, policy(), 100_000);
    let now = Utc::now().timestamp();
    runtime.block_on(verifier.prepare(keyed.iter().map(|(k, t)| (&k[..], Some(&t[..]))), now)).expect("reviewed");
    assert!(verifier.len() > NODES / 2, "one review per node's token");
    assert!(keyed[0].1.len() > 900, "a token the size of a real one");
    group.bench_function("decode_verify_enrich_encode_1000_mixed", |b| {
        b.iter(|| {
            let reviews = runtime
                .block_on(verifier.prepare(keyed.iter().map(|(k, t)| (&k[..], Some(&t[..]))), now))
                .expect("cached");
            for ((payload, (key, token)), review) in events.iter().zip(&keyed).zip(&reviews) {
                let event: HealthEvent = gpumedic_schemas::decode(black_box(payload)).expect("decodes");
                let accepted = verifier.check_reviewed(review.as_deref(), Some(token), &event.node, Some(key), now);
                assert!(accepted.is_ok(), "{accepted:?}");
                let node = cache.node(&event.node);
                let gpu = inventory.resolve(&event.node, &event.entity, event.component, event.observed_at);
                let enriched = enrich::enrich(event, node.as_deref(), gpu, &catalog, Utc::now());
                out.clear();
                gpumedic_schemas::framing::encode_into(&enriched, &mut out).expect("encodes");
            }
        })
    });

    // Signed records: a key id and a signature per record, the tokens in the directory.
    let tokens: BTreeMap<&[u8], &[u8]> = keyed.iter().map(|(node, t)| (&node[..], &t[..])).collect();
    let signed: Vec<Record> = events
        .iter()
        .zip(&keyed)
        .enumerate()
        .map(|(offset, (payload, (node, t)))| {
            let key = NodeKey::of(t);
            Record {
                topic: "gpumedic.raw.v1".into(),
                partition: 0,
                offset: offset as i64,
                key: Some(node.clone()),
                payload: Some(payload.clone()),
                headers: vec![
                    (record_headers::NODE_KEY_ID.into(), key.id().as_bytes().to_vec()),
                    (record_headers::NODE_SIGNATURE.into(), key.sign(node, payload).to_vec()),
                ],
                timestamp_ms: None,
            }
        })
        .collect();
    let mut auth = NodeAuth {
        verifier: Verifier::new(Apiserver, policy(), 100_000),
        directory: Directory::of_tokens(tokens.values().copied(), 100_000),
    };
    let handle_signed = |auth: &mut NodeAuth<Apiserver>, out: &mut Vec<u8>| {
        let proofs = runtime.block_on(auth.proofs(black_box(&signed))).expect("every key id known");
        let tokens = signed.iter().zip(&proofs).map(|(r, p)| (r.key.as_deref().unwrap_or_default(), p.token(r)));
        let reviews = runtime.block_on(auth.verifier.prepare(tokens, now)).expect("reviewed");
        for ((record, proof), review) in signed.iter().zip(&proofs).zip(&reviews) {
            let payload = record.payload.as_deref().expect("a value");
            let event: HealthEvent = gpumedic_schemas::decode(payload).expect("decodes");
            let accepted = auth.check(review.as_deref(), proof, record, &event.node, now);
            assert!(accepted.is_ok(), "{accepted:?}");
            let node = cache.node(&event.node);
            let gpu = inventory.resolve(&event.node, &event.entity, event.component, event.observed_at);
            let enriched = enrich::enrich(event, node.as_deref(), gpu, &catalog, Utc::now());
            out.clear();
            gpumedic_schemas::framing::encode_into(&enriched, out).expect("encodes");
        }
    };
    // The first pass reviews each node's token once; the timed passes find them cached.
    handle_signed(&mut auth, &mut out);
    assert!(auth.verifier.len() > NODES / 2, "one review per node's token");
    // The check must be able to fail: a record whose signature lost a bit is refused.
    let mut forged = signed[0].clone();
    forged.headers[1].1[0] ^= 1;
    let proofs = runtime.block_on(auth.proofs(std::slice::from_ref(&forged))).expect("known");
    let node = std::str::from_utf8(forged.key.as_deref().expect("a key")).expect("a name");
    let review = runtime.block_on(auth.verifier.prepare([(node.as_bytes(), proofs[0].token(&forged))], now));
    let refused = auth.check(review.expect("cached")[0].as_deref(), &proofs[0], &forged, node, now);
    assert!(refused.is_err(), "a record with a bad signature is refused");
    group.bench_function("decode_verify_signed_enrich_encode_1000_mixed", |b| {
        b.iter(|| handle_signed(&mut auth, &mut out));
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
