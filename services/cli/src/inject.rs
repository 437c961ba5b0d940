//! `gpumedic inject`: publish a synthetic health event on the raw topic, as a collector would.
//!
//! Injected events are marked `synthetic` (and come from source `synthetic`), so a classifier
//! configured to ignore synthetic events (production) does nothing with them. This is how the demo
//! and end-to-end tests cause a fault without a GPU.
//!
//! Two ways in: straight to Kafka (`--kafka-bootstrap`, `--node`), or through a collector's
//! fault-injection endpoint (`--collector`, its `--synthetic-addr`), which publishes for its own
//! node with its boot id. Only the second can act on a collector's simulated GPUs:
//! `--fall-off-bus --gpu N` (the GPU stops answering and the driver's Xid 79 line is published)
//! and `--reboot` (a new boot id, every GPU back); docs/collector.md describes both.
//!
//! Straight to Kafka, an enricher that enforces node authentication refuses an event without a
//! token of the node's collector. An operator authenticates with `--token-file`: a token of the
//! ServiceAccount the enricher names in `--operator-service-account` (audience `gpumedic`,
//! `kubectl create token gpumedic-operator -n gpumedic --audience gpumedic --duration 10m`),
//! which may speak for any node; the enricher counts and logs every such event.

use clap::Args;
use gpumedic_runtime::config::{Problems, Validate as _};
use gpumedic_runtime::kafka::{self, KafkaArgs};
use gpumedic_schemas::health::{
    Component, Detail, Entity, GpuLostDetail, MonitorHealthDetail, MonitorState, Source, XidDetail,
};
use gpumedic_schemas::{HealthEvent, topics};
use serde_json::json;

/// Flags of `gpumedic inject`.
#[derive(Debug, Args)]
// Kafka is not needed when a collector injects: its bootstrap is checked only when it is used.
#[command(mut_arg("kafka_bootstrap", |a| a.required(false).default_value("")))]
pub struct InjectArgs {
    #[command(flatten)]
    kafka: KafkaArgs,
    /// Inject through this collector's fault-injection endpoint (its `--synthetic-addr`, e.g.
    /// 127.0.0.1:9401) rather than straight to Kafka: the collector publishes for its own node,
    /// with its boot id. Required by `--fall-off-bus` and `--reboot`.
    // Not `conflicts_with = "node"`: clap then excuses a missing `--collector` that `--reboot`
    // requires whenever `--node` is given. `run` refuses the pair instead.
    #[arg(long, env = "GPUMEDIC_SYNTHETIC_ADDR")]
    collector: Option<String>,
    /// The node the event is about (straight to Kafka; a collector injects for its own node).
    #[arg(long, required_unless_present = "collector")]
    node: Option<String>,
    /// An Xid code to inject (79: fallen off the bus, 13: graphics exception, ...).
    #[arg(long, conflicts_with_all = ["gpu_lost", "healthy", "fall_off_bus", "reboot"])]
    xid: Option<i32>,
    /// Inject "GPU has fallen off the bus" as text without an Xid.
    #[arg(long, conflicts_with_all = ["healthy", "fall_off_bus", "reboot"])]
    gpu_lost: bool,
    /// Inject healthy evidence (the GPU answers again), which lets incidents recover.
    #[arg(long, conflicts_with_all = ["fall_off_bus", "reboot"])]
    healthy: bool,
    /// The collector's simulated GPU `--gpu N` falls off the bus: it stops answering (no
    /// readings, no heartbeats, missing from the next inventory) and the driver's Xid 79 line
    /// naming it by PCI bus id is published, until `--reboot`. Simulated backend only.
    #[arg(long, requires_all = ["collector", "gpu_index"], conflicts_with = "reboot")]
    fall_off_bus: bool,
    /// The collector's simulated node reboots: a new boot id on every later event, every GPU
    /// answering again with fresh counters. Simulated backend only (a real node's reboot is a
    /// real reboot). Prints the new boot id.
    #[arg(long, requires = "collector", conflicts_with_all = ["gpu_index", "gpu_uuid", "pci_bus_id"])]
    reboot: bool,
    /// The affected GPU's UUID.
    #[arg(long)]
    gpu_uuid: Option<String>,
    /// The affected GPU's index.
    #[arg(long, alias = "gpu")]
    gpu_index: Option<i32>,
    /// The affected GPU's PCI bus id.
    #[arg(long)]
    pci_bus_id: Option<String>,
    /// How many copies to send (each a distinct event).
    #[arg(long, default_value_t = 1)]
    count: u32,
    /// A file holding the operator's ServiceAccount token (audience `gpumedic`), sent with each
    /// event straight to Kafka so that an enricher enforcing node authentication accepts it (see
    /// docs/security.md). Not used with `--collector`, which sends its own node's token.
    #[arg(long, env = "GPUMEDIC_INJECT_TOKEN_FILE", conflicts_with = "collector")]
    token_file: Option<std::path::PathBuf>,
}

/// Builds the event the flags describe.
pub fn event(args: &InjectArgs) -> Result<HealthEvent, Problems> {
    let mut p = Problems::default();
    let detail = match (args.xid, args.gpu_lost, args.healthy) {
        (Some(code), _, _) if code > 0 => Detail::Xid(XidDetail {
            code,
            text: format!("synthetic Xid {code} injected by gpumedic inject"),
            pid: None,
            process: None,
            nvlink5: None,
            recovery_action: None,
        }),
        (Some(code), _, _) => {
            p.push("--xid", format!("{code} is not an Xid code"));
            Detail::Absent
        }
        (None, true, _) => Detail::GpuLost(GpuLostDetail { reason: "synthetic: GPU has fallen off the bus".into() }),
        (None, false, true) => Detail::MonitorHealth(MonitorHealthDetail {
            monitor: "synthetic".into(),
            state: MonitorState::Ok,
            message: Some("GPU answers normally".into()),
        }),
        (None, false, false) => {
            p.push("--xid", "say what to inject: --xid N, --gpu-lost, --healthy, --fall-off-bus or --reboot");
            Detail::Absent
        }
    };
    let node = args.node.clone().unwrap_or_default();
    if node.trim().is_empty() {
        p.push("--node", "name the node the event is about");
    }
    let entity = Entity {
        gpu_uuid: args.gpu_uuid.clone(),
        pci_bus_id: args.pci_bus_id.clone(),
        gpu_index: args.gpu_index,
        ..Default::default()
    };
    p.finish(|| {
        let mut e = HealthEvent::new(&node, Source::Synthetic, Component::Gpu, entity, detail);
        e.synthetic = true;
        e.healthy = args.healthy;
        e
    })
}

/// The body of the collector's `POST /v1/inject` the flags describe (see the collector's
/// `synthetic` module).
pub fn request(args: &InjectArgs) -> serde_json::Value {
    if args.reboot {
        return json!({ "reboot": true });
    }
    if args.fall_off_bus {
        return json!({ "fall_off_bus": true, "gpu_index": args.gpu_index });
    }
    let mut body = serde_json::Map::new();
    if let Some(code) = args.xid {
        body.insert("xid".into(), json!(code));
    }
    if args.gpu_lost {
        body.insert("gpu_lost".into(), json!(true));
    }
    if args.healthy {
        body.insert("healthy".into(), json!(true));
    }
    for (key, value) in [
        ("gpu_uuid", args.gpu_uuid.as_ref().map(|v| json!(v))),
        ("gpu_index", args.gpu_index.map(|v| json!(v))),
        ("pci_bus_id", args.pci_bus_id.as_ref().map(|v| json!(v))),
    ] {
        if let Some(value) = value {
            body.insert(key.into(), value);
        }
    }
    if args.count != 1 {
        body.insert("count".into(), json!(args.count));
    }
    serde_json::Value::Object(body)
}

/// Injects through the collector at `addr`; prints each event id, and the new boot id of a
/// reboot.
async fn through_collector(addr: &str, args: &InjectArgs) -> Result<(), String> {
    let url = format!("http://{addr}/v1/inject");
    let answer = reqwest::Client::new()
        .post(&url)
        .timeout(std::time::Duration::from_secs(30))
        .json(&request(args))
        .send()
        .await
        .map_err(|e| format!("the collector at {addr} does not answer (is --synthetic-addr set on it?): {e}"))?;
    let status = answer.status();
    let body: serde_json::Value = answer.json().await.map_err(|e| format!("the collector's answer: {e}"))?;
    if !status.is_success() {
        let why = body["error"].as_str().unwrap_or("no reason given");
        return Err(format!("the collector refused the injection ({status}): {why}"));
    }
    for id in body["event_ids"].as_array().into_iter().flatten() {
        println!("{}", id.as_str().unwrap_or_default());
    }
    if let Some(boot_id) = body["boot_id"].as_str() {
        println!("{boot_id}");
    }
    Ok(())
}

/// Runs `gpumedic inject`; prints the id of each event sent.
pub async fn run(args: InjectArgs) -> Result<(), String> {
    if let Some(addr) = &args.collector {
        if args.node.is_some() {
            return Err("--node: a collector injects for its own node; leave out --node with --collector".into());
        }
        return through_collector(addr, &args).await;
    }
    let settings =
        args.kafka.clone().validate().map_err(|p| gpumedic_runtime::config::render_problems("gpumedic inject", &p))?;
    let producer = settings.producer("gpumedic-inject").map_err(|e| e.to_string())?;
    if !kafka::topic_exists(&producer, topics::HEALTH_RAW).await.map_err(|e| e.to_string())? {
        return Err(format!(
            "topic {} does not exist on {}; create the pipeline's topics with `gpumedic topics create`",
            topics::HEALTH_RAW,
            settings.bootstrap
        ));
    }
    // Published exactly as a collector publishes its own events.
    let codec = settings.codec().await.map_err(|e| e.to_string())?;
    let emitter = gpumedic_collector::sources::Emitter { producer, codec };
    let token = match &args.token_file {
        None => None,
        Some(path) => Some(gpumedic_collector::node_token::read_token(path).map_err(|e| format!("--token-file: {e}"))?),
    };
    for _ in 0..args.count {
        let event = event(&args).map_err(|p| gpumedic_runtime::config::render_problems("gpumedic inject", &p))?;
        emitter.emit_with_token(&event, token.as_deref()).await.map_err(|e| e.to_string())?;
        println!("{}", event.event_id);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        inject: InjectArgs,
    }

    fn parse(args: &[&str]) -> Result<InjectArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("inject").chain(args.iter().copied())).map(|c| c.inject)
    }

    #[test]
    fn simulated_node_actions_go_through_a_collector() {
        let a = parse(&["--collector", "127.0.0.1:9401", "--fall-off-bus", "--gpu", "3"]).unwrap();
        assert_eq!(request(&a), json!({ "fall_off_bus": true, "gpu_index": 3 }));
        let a = parse(&["--collector", "127.0.0.1:9401", "--reboot"]).unwrap();
        assert_eq!(request(&a), json!({ "reboot": true }));
        let a = parse(&["--collector", "127.0.0.1:9401", "--xid", "79", "--gpu-index", "2", "--count", "2"]).unwrap();
        assert_eq!(request(&a), json!({ "xid": 79, "gpu_index": 2, "count": 2 }));
        for bad in [
            &["--kafka-bootstrap", "k:9092", "--node", "n", "--reboot"][..],
            &["--collector", "127.0.0.1:9401", "--fall-off-bus"],
            &["--collector", "127.0.0.1:9401", "--reboot", "--gpu", "1"],
            &["--collector", "127.0.0.1:9401", "--reboot", "--xid", "79"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused: {:?}", parse(bad));
        }
    }

    #[test]
    fn straight_to_kafka_needs_the_node() {
        assert!(parse(&["--kafka-bootstrap", "k:9092", "--xid", "79"]).is_err());
        let a = parse(&["--kafka-bootstrap", "k:9092", "--node", "n", "--xid", "79", "--gpu", "3"]).unwrap();
        let e = event(&a).unwrap();
        assert_eq!((e.node.as_str(), e.entity.gpu_index, e.synthetic), ("n", Some(3), true));
    }

    #[test]
    fn an_operator_token_is_for_injections_straight_to_kafka() {
        let a = parse(&["--kafka-bootstrap", "k:9092", "--node", "n", "--xid", "79", "--token-file", "/t"]).unwrap();
        assert_eq!(a.token_file.as_deref(), Some(std::path::Path::new("/t")));
        // A collector sends its own node's token.
        assert!(parse(&["--collector", "127.0.0.1:9401", "--xid", "79", "--token-file", "/t"]).is_err());
    }
}
