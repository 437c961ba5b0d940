//! `latency`: fault to cordon, p50 / p99 / max, through the enricher, classifier and remediator
//! binaries, under a background load of healthy telemetry (goal: p50 under 20 ms and p99 under
//! 100 ms at 10,000 events per second), beside the apiserver's own latency for a plain node patch measured in the
//! same run.
//!
//! 1. `--nodes` GPU nodes are created in the apiserver, labelled for this run only.
//! 2. The three services start (release builds next to this program): the enricher and the
//!    classifier on the pipeline's topics with new consumer groups that start at the end, the
//!    classifier on a fresh database and a verdict topic of its own, the remediator in
//!    `cordon-drain` on that verdict topic and this run's nodes.
//! 3. A producer thread sends healthy temperature readings for every GPU of the fleet to the raw
//!    topic at `--background-rate` events per second for the whole run.
//! 4. After a warm-up, Xid 79 is produced on `--faults` distinct nodes, one every
//!    `--fault-interval`; each node's latency runs from its fault's produce call to the first
//!    time a watch sees it cordoned.
//!
//! Each fault's latency is also split at the records it causes (enriched, verdict), by
//! [`crate::stages`]. Besides the percentiles, the JSON result keeps every fault's latency in the order the faults
//! were sent and the background producer's progress each second, for the plots of
//! `load-tests/plot/`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::{StreamExt as _, TryStreamExt as _};
use gpumedic_runtime::kafka::{KafkaSettings, TopicSpec, stage_topics};
use gpumedic_schemas::health::{Component, Detail, Entity, Source, TemperatureDetail, XidDetail};
use gpumedic_schemas::{HealthEvent, topics};
use gpumedic_testkit as testkit;
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use rdkafka::producer::{BaseRecord, Producer as _};
use serde_json::json;

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// GPU nodes in the fleet (8 GPUs each in the background telemetry).
    #[arg(long, default_value_t = 200)]
    nodes: usize,
    /// Faults (Xid 79), each on its own node.
    #[arg(long, default_value_t = 100)]
    faults: usize,
    /// Background telemetry, events per second.
    #[arg(long, default_value_t = 10_000)]
    background_rate: u64,
    /// Time between two faults.
    #[arg(long, default_value = "200ms", value_parser = crate::duration)]
    fault_interval: Duration,
}

/// The JSON result.
#[derive(Debug, serde::Serialize)]
pub struct Result {
    scenario: &'static str,
    nodes: usize,
    faults: usize,
    cordoned: usize,
    background_rate_target: u64,
    background_rate_achieved: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    floor_patch_p50_ms: f64,
    floor_patch_p99_ms: f64,
    /// The same plain patch while the faults are timed, under the background load.
    loaded_patch_p50_ms: f64,
    loaded_patch_p99_ms: f64,
    /// Each fault's latency in the order the faults were sent; `null` for a node never seen
    /// cordoned.
    latencies_ms: Vec<Option<f64>>,
    /// `[seconds since the background producer started, events it had queued]`, about once a
    /// second: the achieved background rate over the run, not just its mean.
    background_timeline: Vec<[f64; 2]>,
    /// The latency split at the records each fault caused ([`crate::stages`]).
    stages: Vec<crate::stages::Stage>,
    /// Cores each process used while the faults were timed (the load-test process included: it
    /// sends the background load and reads the enriched topic).
    cores: std::collections::BTreeMap<&'static str, f64>,
    /// The remediator's means over every verdict: record timestamp to handling, and handling.
    remediator_delivered_mean_ms: f64,
    remediator_acted_mean_ms: f64,
}

/// The `p` quantile (0..=1) of `sorted` by the nearest-rank method; NaN when empty.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// When each Node matching `selector` was first seen cordoned by a watch, kept by a task that runs
/// until aborted.
pub(crate) fn watch_cordons(
    api: Api<Node>,
    selector: String,
) -> (tokio::task::JoinHandle<()>, Arc<std::sync::Mutex<HashMap<String, Instant>>>) {
    let cordoned_at: Arc<std::sync::Mutex<HashMap<String, Instant>>> = Arc::default();
    let seen = cordoned_at.clone();
    let task = tokio::spawn(async move {
        let stream = watcher(api, watcher::Config::default().labels(&selector));
        futures::pin_mut!(stream);
        while let Some(Ok(event)) = stream.next().await {
            let nodes: Vec<Node> = match event {
                watcher::Event::Apply(n) | watcher::Event::InitApply(n) => vec![n],
                _ => vec![],
            };
            for n in nodes {
                if n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)
                    && let Some(name) = n.metadata.name
                {
                    seen.lock().expect("lock").entry(name).or_insert_with(Instant::now);
                }
            }
        }
    });
    (task, cordoned_at)
}

/// Xid 79 (the GPU has fallen off the bus) on `node`, as its kernel log reports it: the fault the
/// latency scenarios time to a cordon.
pub(crate) fn fallen_off_the_bus(node: &str) -> HealthEvent {
    let detail = Detail::Xid(XidDetail {
        code: 79,
        text: "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.".into(),
        pid: None,
        process: None,
        nvlink5: None,
        recovery_action: None,
    });
    HealthEvent::new(node, Source::KernelLog, Component::Gpu, Entity::default(), detail)
}

/// Runs the scenario and prints one line per figure.
pub async fn run(o: Options) -> anyhow::Result<Result> {
    let bootstrap = testkit::require_kafka().await?;
    let client = testkit::require_kubernetes().await?;
    let admin_db = testkit::require_postgres().await?;
    let settings =
        KafkaSettings { bootstrap: bootstrap.clone(), options: vec![], schema_registry: None, topic_replication: None };
    let run = testkit::unique_name("bench-latency");
    let verdicts = format!("{run}.verdicts");
    let actions = format!("{run}.actions");
    settings
        .ensure_topics(&stage_topics(&[topics::HEALTH_RAW, topics::HEALTH_ENRICHED], &[], topics::DEFAULT_PARTITIONS))
        .await?;
    settings
        .ensure_topics(&[
            TopicSpec::new(&verdicts, topics::DEFAULT_PARTITIONS),
            TopicSpec::new(&actions, topics::DEFAULT_PARTITIONS),
        ])
        .await?;

    // The fleet and the floor.
    let nodes_api: Api<Node> = Api::all(client.clone());
    let names: Vec<String> = (0..o.nodes).map(|i| format!("{run}-{i:04}")).collect();
    futures::stream::iter(names.iter().map(|name| {
        let api = nodes_api.clone();
        let run = run.clone();
        async move {
            let node: Node = serde_json::from_value(json!({ "metadata": { "name": name,
                "labels": { "gpumedic-bench/latency": run, "nvidia.com/gpu.present": "true" } } }))?;
            api.create(&PostParams::default(), &node).await.with_context(|| format!("create node {name}"))?;
            Ok::<_, anyhow::Error>(())
        }
    }))
    .buffer_unordered(32)
    .try_collect::<Vec<()>>()
    .await?;
    let mut floor: Vec<f64> = Vec::new();
    for name in names.iter().take(100) {
        let t = Instant::now();
        let patch = json!({ "metadata": { "labels": { "gpumedic-bench/touched": "yes" } } });
        nodes_api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
        floor.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    floor.sort_by(f64::total_cmp);
    let ns = testkit::unique_name("bench-latency-ns");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces.create(&PostParams::default(), &serde_json::from_value(json!({ "metadata": { "name": ns } }))?).await?;

    // The services.
    let db = testkit::unique_name("bench_latency").replace('-', "_");
    let url = testkit::fresh_database(&admin_db, &db).await?;
    let common = async |group: &str| crate::service_env(&bootstrap, group).await;
    let mut enricher = testkit::ServiceProcess::start(
        &crate::release_binary("gpumedic-enricher")?,
        &[],
        &common("bench-enricher").await?,
    )?;
    let mut env = common("bench-classifier").await?;
    env.extend([
        ("GPUMEDIC_DATABASE_URL", url.clone()),
        ("GPUMEDIC_VERDICTS_TOPIC", verdicts.clone()),
        ("GPUMEDIC_ACTIONS_TOPIC", actions.clone()),
    ]);
    let mut classifier = testkit::ServiceProcess::start(&crate::release_binary("gpumedic-classifier")?, &[], &env)?;
    let mut env = common("bench-remediator").await?;
    env.extend([
        ("GPUMEDIC_VERDICTS_TOPIC", verdicts.clone()),
        ("GPUMEDIC_ACTIONS_TOPIC", actions.clone()),
        ("GPUMEDIC_LEASE_NAMESPACE", ns.clone()),
        ("GPUMEDIC_MODE", "cordon-drain".to_owned()),
        ("GPUMEDIC_GPU_NODE_SELECTOR", format!("gpumedic-bench/latency={run}")),
        ("GPUMEDIC_BREAKER_MAX_SHARE", "1.0".to_owned()),
        ("GPUMEDIC_BREAKER_MAX_COUNT", "100000".to_owned()),
        ("GPUMEDIC_QUARANTINES_PER_MINUTE", "100000".to_owned()),
    ]);
    let mut remediator = testkit::ServiceProcess::start(&crate::release_binary("gpumedic-remediator")?, &[], &env)?;
    for s in [&mut enricher, &mut classifier, &mut remediator] {
        s.wait_ready(Duration::from_secs(120)).await.map_err(anyhow::Error::msg)?;
    }

    // Cordons, as a watch sees them, and the records each fault causes on the way.
    let (watch, cordoned_at) = watch_cordons(nodes_api.clone(), format!("gpumedic-bench/latency={run}"));
    let mut stages = crate::stages::Stages::start(&bootstrap, &[topics::HEALTH_ENRICHED, &verdicts, &actions])?;

    // The background load, paced every 10 ms.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let background = {
        let (stop, sent, names, bootstrap) = (stop.clone(), sent.clone(), names.clone(), bootstrap.clone());
        let rate = o.background_rate;
        std::thread::spawn(move || -> anyhow::Result<(f64, Vec<[f64; 2]>)> {
            let producer = crate::scratch_producer(&bootstrap)?;
            let start = Instant::now();
            let mut buffer = Vec::with_capacity(512);
            let mut i = 0u64;
            let mut timeline = vec![[0.0, 0.0]];
            let mut next_sample = 1.0;
            while !stop.load(Ordering::Relaxed) {
                let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
                while i < due {
                    let node = &names[(i as usize) % names.len()];
                    let gpu = (i as usize / names.len()) % 8;
                    let entity = Entity {
                        gpu_uuid: Some(format!("GPU-{node}-{gpu}")),
                        gpu_index: Some(gpu as i32),
                        ..Default::default()
                    };
                    let detail = Detail::Temperature(TemperatureDetail {
                        celsius: 55 + (i % 20) as i32,
                        slowdown_celsius: Some(87),
                        shutdown_celsius: Some(92),
                    });
                    let mut e = HealthEvent::new(node.as_str(), Source::Nvml, Component::Gpu, entity, detail);
                    e.healthy = true;
                    buffer.clear();
                    gpumedic_schemas::framing::encode_into(&e, &mut buffer)?;
                    crate::send(
                        &producer,
                        BaseRecord::to(topics::HEALTH_RAW).key(node.as_str()).payload(buffer.as_slice()),
                    )?;
                    i += 1;
                }
                producer.poll(Duration::ZERO);
                // Sampled on the 10 ms pacing tick, not per record, so the timeline costs nothing
                // on the produce path.
                let now = start.elapsed().as_secs_f64();
                if now >= next_sample {
                    timeline.push([now, i as f64]);
                    next_sample = now.floor() + 1.0;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            producer.flush(Duration::from_secs(30))?;
            sent.store(i, Ordering::Relaxed);
            let elapsed = start.elapsed().as_secs_f64();
            timeline.push([elapsed, i as f64]);
            Ok((i as f64 / elapsed, timeline))
        })
    };
    // The faults' producer, connected during the warm-up as a collector's long-lived one is.
    let producer = settings.producer("bench-latency-faults")?;
    tokio::time::sleep(Duration::from_secs(5)).await;

    // The floor again while the faults are timed: a plain patch of a node no fault touches,
    // every 50 ms, under the same background load.
    let loaded_floor = {
        let (api, name, stop) = (nodes_api.clone(), names[names.len() - 1].clone(), stop.clone());
        tokio::spawn(async move {
            let mut ms = Vec::new();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let patch = json!({ "metadata": { "labels": { "gpumedic-bench/touched": i.to_string() } } });
                let t = Instant::now();
                if api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await.is_ok() {
                    ms.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            ms.sort_by(f64::total_cmp);
            ms
        })
    };

    // The CPU each process uses while the faults are timed.
    let mut watched = crate::scale::servers()?;
    for (name, s) in [("enricher", &enricher), ("classifier", &classifier), ("remediator", &remediator)] {
        watched.push((name, crate::procs::Watched { pid: s.pid(), with_children: false }));
    }
    let cpu_before: Vec<Option<crate::procs::Reading>> = watched.iter().map(|(_, w)| w.read()).collect();
    let timed_from = Instant::now();

    // The faults.
    let mut faulted_at: HashMap<String, Instant> = HashMap::new();
    let mut fault_order: Vec<String> = Vec::with_capacity(o.faults);
    for (index, name) in names.iter().take(o.faults).enumerate() {
        let event = fallen_off_the_bus(name);
        let bytes = gpumedic_schemas::encode(&event)?;
        let traceparent = stages.traceparent(index as u64);
        faulted_at.insert(name.clone(), Instant::now());
        fault_order.push(name.clone());
        let headers = [(gpumedic_runtime::kafka::record_headers::TRACEPARENT, traceparent.as_bytes())];
        gpumedic_runtime::kafka::publish(&producer, topics::HEALTH_RAW, name, &bytes, &headers).await?;
        tokio::time::sleep(o.fault_interval).await;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while cordoned_at.lock().expect("lock").len() < faulted_at.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let timed_for = timed_from.elapsed().as_secs_f64();
    let cores: std::collections::BTreeMap<&'static str, f64> = watched
        .iter()
        .zip(&cpu_before)
        .filter_map(|((name, w), before)| {
            Some((*name, (w.read()?.cpu_seconds - before.as_ref()?.cpu_seconds) / timed_for))
        })
        .collect();
    stop.store(true, Ordering::Relaxed);
    let loaded_floor = loaded_floor.await?;
    let (achieved, background_timeline) =
        background.join().map_err(|_| anyhow::anyhow!("the background producer panicked"))??;
    watch.abort();

    let seen = cordoned_at.lock().expect("lock").clone();
    let cordoned_ms: HashMap<u64, i64> = fault_order
        .iter()
        .enumerate()
        .filter_map(|(i, n)| Some((i as u64, crate::stages::instant_ms(*seen.get(n)?))))
        .collect();
    let stages = stages.finish(&cordoned_ms)?;
    let latencies_ms: Vec<Option<f64>> = fault_order
        .iter()
        .map(|n| seen.get(n).map(|c| c.saturating_duration_since(faulted_at[n]).as_secs_f64() * 1000.0))
        .collect();
    let mut latencies: Vec<f64> = latencies_ms.iter().flatten().copied().collect();
    latencies.sort_by(f64::total_cmp);
    let (_, metrics) = testkit::http_get(remediator.admin_addr(), "/metrics").await?;
    let [delivered, acted] = crate::stages::remediator_means(&metrics);
    for s in [&mut enricher, &mut classifier, &mut remediator] {
        let _ = s.terminate(Duration::from_secs(20)).await;
    }
    futures::stream::iter(names.iter().map(|n| {
        let api = nodes_api.clone();
        async move {
            let _ = api.delete(n, &DeleteParams::default()).await;
        }
    }))
    .buffer_unordered(32)
    .collect::<Vec<()>>()
    .await;

    let result = Result {
        scenario: "latency",
        nodes: o.nodes,
        faults: faulted_at.len(),
        cordoned: latencies.len(),
        background_rate_target: o.background_rate,
        background_rate_achieved: achieved,
        p50_ms: percentile(&latencies, 0.50),
        p99_ms: percentile(&latencies, 0.99),
        max_ms: latencies.last().copied().unwrap_or(f64::NAN),
        floor_patch_p50_ms: percentile(&floor, 0.50),
        floor_patch_p99_ms: percentile(&floor, 0.99),
        loaded_patch_p50_ms: percentile(&loaded_floor, 0.50),
        loaded_patch_p99_ms: percentile(&loaded_floor, 0.99),
        latencies_ms,
        background_timeline,
        stages,
        cores,
        remediator_delivered_mean_ms: delivered,
        remediator_acted_mean_ms: acted,
    };
    println!(
        "latency: fault to cordon over {} of {} faults under {:.0} background events/s: p50 {:.0} ms, p99 {:.0} ms, \
         max {:.0} ms (goal p50 < 20 ms, p99 < 100 ms) beside a plain node patch p50 {:.1} ms, p99 {:.1} ms",
        result.cordoned,
        result.faults,
        result.background_rate_achieved,
        result.p50_ms,
        result.p99_ms,
        result.max_ms,
        result.floor_patch_p50_ms,
        result.floor_patch_p99_ms
    );
    println!(
        "    the same plain patch under the background load, while the faults were timed: p50 {:.1} ms, p99 {:.1} ms",
        result.loaded_patch_p50_ms, result.loaded_patch_p99_ms
    );
    crate::stages::print(&result.stages);
    let cores: Vec<String> = result.cores.iter().map(|(n, c)| format!("{n} {c:.2}")).collect();
    println!("    cores used while the faults were timed: {}", cores.join(", "));
    println!(
        "    the remediator's own means: verdict record to handling {:.1} ms, handling {:.1} ms",
        result.remediator_delivered_mean_ms, result.remediator_acted_mean_ms
    );
    Ok(result)
}
