//! `gpumedic inject`: publish a synthetic health event on the raw topic, as a collector would.
//!
//! Injected events are marked `synthetic` (and come from source `synthetic`), so a classifier
//! configured to ignore synthetic events (production) does nothing with them. This is how the demo
//! and end-to-end tests cause a fault without a GPU.

use clap::Args;
use gpumedic_runtime::config::{Problems, Validate as _};
use gpumedic_runtime::kafka::{self, KafkaArgs};
use gpumedic_schemas::health::{
    Component, Detail, Entity, GpuLostDetail, MonitorHealthDetail, MonitorState, Source, XidDetail,
};
use gpumedic_schemas::{HealthEvent, topics};

/// Flags of `gpumedic inject`.
#[derive(Debug, Args)]
pub struct InjectArgs {
    #[command(flatten)]
    kafka: KafkaArgs,
    /// The node the event is about.
    #[arg(long)]
    node: String,
    /// An Xid code to inject (79: fallen off the bus, 13: graphics exception, ...).
    #[arg(long, conflicts_with_all = ["gpu_lost", "healthy"])]
    xid: Option<i32>,
    /// Inject "GPU has fallen off the bus" as text without an Xid.
    #[arg(long, conflicts_with = "healthy")]
    gpu_lost: bool,
    /// Inject healthy evidence (the GPU answers again), which lets incidents recover.
    #[arg(long)]
    healthy: bool,
    /// The affected GPU's UUID.
    #[arg(long)]
    gpu_uuid: Option<String>,
    /// The affected GPU's index.
    #[arg(long)]
    gpu_index: Option<i32>,
    /// The affected GPU's PCI bus id.
    #[arg(long)]
    pci_bus_id: Option<String>,
    /// How many copies to send (each a distinct event).
    #[arg(long, default_value_t = 1)]
    count: u32,
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
            p.push("--xid", "say what to inject: --xid N, --gpu-lost or --healthy");
            Detail::Absent
        }
    };
    if args.node.trim().is_empty() {
        p.push("--node", "must not be empty");
    }
    let entity = Entity {
        gpu_uuid: args.gpu_uuid.clone(),
        pci_bus_id: args.pci_bus_id.clone(),
        gpu_index: args.gpu_index,
        ..Default::default()
    };
    p.finish(|| {
        let mut e = HealthEvent::new(&args.node, Source::Synthetic, Component::Gpu, entity, detail);
        e.synthetic = true;
        e.healthy = args.healthy;
        e
    })
}

/// Runs `gpumedic inject`; prints the id of each event sent.
pub async fn run(args: InjectArgs) -> Result<(), String> {
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
    for _ in 0..args.count {
        let event = event(&args).map_err(|p| gpumedic_runtime::config::render_problems("gpumedic inject", &p))?;
        emitter.emit(&event).await.map_err(|e| e.to_string())?;
        println!("{}", event.event_id);
    }
    Ok(())
}
