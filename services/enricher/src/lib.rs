//! The enricher: joins each raw health event with what the cluster knows (node labels, the GPU
//! workloads on the node, the Xid catalog) and republishes it on `gpumedic.health.enriched.v1`,
//! keyed by node name.
//!
//! Cluster knowledge comes from watch caches ([`cache`]), never from an API call per event. An
//! event for a node the cache does not know is still passed on, marked `node_unknown`, and
//! counted. The GPU an event names (by UUID, PCI bus id or index) is resolved to one canonical
//! identity from the node's latest `gpu_inventory` event ([`inventory`]); one that cannot be is
//! passed on marked `gpu_unresolved`, and counted. A record that cannot be decoded goes to
//! `gpumedic.health.raw.v1.dlq` with the reason.
//!
//! With `--node-auth=enforce`, a record is enriched only when it carries a token of the
//! collector of the node it claims ([`auth`]); any other goes to the dead-letter topic with the
//! reason, counted per claimed node, before it can touch a cache.

pub mod auth;
pub mod cache;
pub mod catalog;
pub mod directory;
pub mod enrich;
pub mod inventory;

mod events;

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use gpumedic_runtime::BoxError;
use gpumedic_runtime::config::{CommonArgs, CommonConfig, Problems, Validate};
use gpumedic_runtime::k8s;
use gpumedic_runtime::kafka::{
    self, BatchHandler, BatchSettings, Disposition, Producer, Record, node_proof, record_headers,
};
use gpumedic_runtime::service::RunError;
use gpumedic_runtime::service::Service;
use gpumedic_runtime::stage::{BatchArgs, Stage, StageArgs, StageDefaults, StageSettings};
use gpumedic_schemas::health::Detail;
use gpumedic_schemas::{Codec, EnrichedHealthEvent, HealthEvent, Record as _, topics};

use crate::auth::{Accepted, KubeReviewer, NodeAuthMode, Policy, ServiceAccountRef, Verifier};
use crate::cache::{ClusterCache, ContextSettings};
use crate::catalog::XidCatalog;
use crate::directory::{Directory, DirectoryError, NodeAuth};
use crate::events::{InternalEvent as _, OperatorRecord, RecordUnauthenticated, UnknownNodeEvent, names};
use crate::inventory::{InventoryCache, InventoryLimits, Resolution, Unresolved};

/// The service's name, as used in metric names and logs.
pub const NAME: &str = "enricher";

/// The defaults of the enricher's stage flags.
#[derive(Debug, Clone)]
pub struct Defaults;

impl StageDefaults for Defaults {
    const GROUP: &'static str = "gpumedic-enricher";
    const BATCH_MAX: &'static str = "1000";
    // As the classifier's: a batch is what has been fetched, so it grows with the load by itself.
    const BATCH_LINGER: &'static str = "0ms";
    const MAX_BATCH_LINGER: std::time::Duration = std::time::Duration::from_secs(1);
    const LINGER_DELAYS: &'static str = "every event";
}

/// Command-line flags and environment variables.
#[derive(Debug, Parser)]
#[command(
    name = "gpumedic-enricher",
    version,
    about = "Adds cluster and Xid-catalog context to raw GPU health events."
)]
pub struct Args {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    stage: StageArgs<Defaults>,
    #[command(flatten)]
    batch: BatchArgs<Defaults>,
    /// The topic of raw health events read (another name lets pipelines share one Kafka).
    #[arg(long, env = "GPUMEDIC_RAW_TOPIC", default_value = topics::HEALTH_RAW)]
    raw_topic: String,
    /// The topic enriched events are written to.
    #[arg(long, env = "GPUMEDIC_ENRICHED_TOPIC", default_value = topics::HEALTH_ENRICHED)]
    enriched_topic: String,
    /// The cluster's name, recorded in every event's node context.
    #[arg(long, env = "GPUMEDIC_CLUSTER_NAME")]
    cluster_name: Option<String>,
    /// Node labels copied into the node context, comma separated.
    #[arg(long, env = "GPUMEDIC_NODE_LABELS", value_delimiter = ',')]
    node_labels: Vec<String>,
    /// An Xid catalog file to use instead of the one built in (see catalog/xid-catalog.yaml).
    #[arg(long, env = "GPUMEDIC_XID_CATALOG")]
    xid_catalog: Option<PathBuf>,
    /// Most nodes whose GPU inventory is kept; past it the least recently updated is forgotten
    /// (its events pass marked unresolved until its next inventory).
    #[arg(long, env = "GPUMEDIC_INVENTORY_MAX_NODES", default_value_t = 200_000)]
    inventory_max_nodes: usize,
    /// Most GPUs kept from one node's inventory.
    #[arg(long, env = "GPUMEDIC_INVENTORY_MAX_GPUS", default_value_t = 64)]
    inventory_max_gpus: usize,
    /// An inventory observed longer than this before an event is not trusted to resolve it (the
    /// collector refreshes every 5 minutes); a GPU that left a node's inventory is still resolved
    /// by UUID or PCI bus id this long after the first inventory without it.
    #[arg(long, env = "GPUMEDIC_INVENTORY_MAX_AGE", default_value = "15m")]
    inventory_max_age: String,
    /// Whether raw records must carry a valid token of the collector of the node they claim:
    /// `enforce` (the Kustomize base) dead-letters every other record; `off` (the default, for
    /// pipelines whose collectors run outside Kubernetes: the demo, tests) checks nothing.
    #[arg(long, env = "GPUMEDIC_NODE_AUTH", default_value = "off")]
    node_auth: String,
    /// The collectors' ServiceAccount, `namespace:name`: only its Pod-bound tokens speak for a
    /// node.
    #[arg(long, env = "GPUMEDIC_COLLECTOR_SERVICE_ACCOUNT", default_value = "gpumedic:gpumedic-collector")]
    collector_service_account: String,
    /// A ServiceAccount, `namespace:name`, whose tokens may speak for any node (`gpumedic
    /// inject --token-file`); each such record is counted and logged. None when empty.
    #[arg(long, env = "GPUMEDIC_OPERATOR_SERVICE_ACCOUNT", default_value = "")]
    operator_service_account: String,
    /// Most token reviews cached (one per collector token: a node's token changes about hourly).
    #[arg(long, env = "GPUMEDIC_NODE_TOKEN_CACHE_SIZE", default_value_t = 100_000)]
    node_token_cache_size: usize,
    /// The node-token directory: collectors publish their token here once per rotation and sign
    /// each raw record instead of carrying the token (read only when node authentication is
    /// enforced).
    #[arg(long, env = "GPUMEDIC_NODE_TOKENS_TOPIC", default_value = topics::NODE_TOKENS)]
    node_tokens_topic: String,
}

/// How node tokens are checked, when they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAuthSettings {
    /// Whose tokens are accepted.
    pub policy: Policy,
    /// Most reviews cached (and most directory entries kept).
    pub cache_size: usize,
    /// The node-token directory topic.
    pub directory_topic: String,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Shared service settings.
    pub common: CommonConfig,
    /// Kafka settings and the consumer group.
    pub stage: StageSettings,
    /// The topic read.
    pub raw_topic: String,
    /// The topic written.
    pub enriched_topic: String,
    /// How node context is built.
    pub context: ContextSettings,
    /// The Xid catalog.
    pub catalog: XidCatalog,
    /// How records are batched.
    pub batch: BatchSettings,
    /// Bounds of the GPU inventory cache.
    pub inventory: InventoryLimits,
    /// Node authentication; `None` when `--node-auth=off`.
    pub node_auth: Option<NodeAuthSettings>,
}

impl Validate for Args {
    type Valid = Config;

    fn validate(self) -> Result<Config, Problems> {
        let mut p = Problems::default();
        let common = self.common.validate().map_err(|e| p.extend(e)).ok();
        let stage = self.stage.validate().map_err(|e| p.extend(e)).ok();
        let batch = self.batch.validate().map_err(|e| p.extend(e)).ok();
        for (flag, topic) in [("--raw-topic", &self.raw_topic), ("--enriched-topic", &self.enriched_topic)] {
            if topic.trim().is_empty() {
                p.push(flag, "the topic must not be empty");
            }
        }
        if self.raw_topic == self.enriched_topic {
            p.push("--enriched-topic", "must differ from --raw-topic (the enricher would read its own output)");
        }
        if !(1..=10_000_000).contains(&self.inventory_max_nodes) {
            p.push("--inventory-max-nodes", format!("{} is not from 1 to 10000000", self.inventory_max_nodes));
        }
        if !(1..=1024).contains(&self.inventory_max_gpus) {
            p.push("--inventory-max-gpus", format!("{} is not from 1 to 1024", self.inventory_max_gpus));
        }
        let max_age = p
            .check("--inventory-max-age", gpumedic_runtime::config::parse_duration(&self.inventory_max_age))
            .and_then(|d| match chrono::TimeDelta::from_std(d) {
                Ok(d) if d >= chrono::TimeDelta::minutes(5) => Some(d),
                _ => {
                    // Shorter than the collector's refresh would leave healthy nodes unresolved.
                    p.push("--inventory-max-age", "must be at least 5m (the collector refreshes every 5 minutes)");
                    None
                }
            });
        let mode = p.check("--node-auth", NodeAuthMode::parse(&self.node_auth));
        let collector =
            p.check("--collector-service-account", ServiceAccountRef::parse(&self.collector_service_account));
        let operator = match self.operator_service_account.as_str() {
            "" => None,
            raw => p.check("--operator-service-account", ServiceAccountRef::parse(raw)),
        };
        if operator.is_some() && operator == collector {
            p.push(
                "--operator-service-account",
                "must differ from --collector-service-account (it may speak for any node)",
            );
        }
        if !(1..=10_000_000).contains(&self.node_token_cache_size) {
            p.push("--node-token-cache-size", format!("{} is not from 1 to 10000000", self.node_token_cache_size));
        }
        let node_auth = match (mode, collector) {
            (Some(NodeAuthMode::Enforce), Some(collector)) => Some(NodeAuthSettings {
                policy: Policy { collector, operator },
                cache_size: self.node_token_cache_size,
                directory_topic: self.node_tokens_topic.clone(),
            }),
            _ => None,
        };
        let catalog = match &self.xid_catalog {
            None => Some(XidCatalog::embedded()),
            Some(path) => p.check("--xid-catalog", XidCatalog::load(path).map_err(|e| e.to_string())),
        };
        p.finish(|| Config {
            common: common.expect("checked"),
            stage: stage.expect("checked"),
            raw_topic: self.raw_topic,
            enriched_topic: self.enriched_topic,
            context: ContextSettings {
                selected_labels: self.node_labels.into_iter().filter(|l| !l.is_empty()).collect(),
                cluster: self.cluster_name,
            },
            catalog: catalog.expect("checked"),
            batch: batch.expect("checked"),
            inventory: InventoryLimits {
                max_nodes: self.inventory_max_nodes,
                max_gpus: self.inventory_max_gpus,
                max_age: max_age.expect("checked"),
            },
            node_auth,
        })
    }
}

/// Runs the enricher until SIGTERM/SIGINT or a failure.
pub async fn run(config: Config) -> Result<(), RunError> {
    let mut service = Service::start(NAME, &config.common);
    let synced = service.readiness.register("cluster-cache-synced");
    let token = service.shutdown.token();
    let cache = ClusterCache::default();
    let watch_cache = cache.clone();
    let context = config.context.clone();
    service.shutdown.spawn("cluster-cache", async move {
        let client = k8s::client().await?;
        cache::run_watchers(client, watch_cache, context, synced, token).await;
        Ok::<_, gpumedic_runtime::BoxError>(())
    });
    let producer = match config.stage.kafka.bulk_producer(NAME) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(error = %e, "Cannot create the Kafka producer.");
            return Err(RunError::setup("the producer", e));
        }
    };
    tracing::info!(catalog_version = %config.catalog.version, codes = config.catalog.len(), "Xid catalog loaded.");
    let codec = match config.stage.kafka.codec().await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "Cannot use the schema registry.");
            return Err(RunError::setup("the schema registry", e));
        }
    };
    let auth = match &config.node_auth {
        None => {
            tracing::warn!(
                "Node authentication is off (--node-auth=off): any holder of the Kafka credential can publish events for any node."
            );
            None
        }
        Some(settings) => {
            let client = match k8s::client().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %e, "Cannot build the Kubernetes client that reviews node tokens.");
                    return Err(RunError::setup("node authentication", e));
                }
            };
            tracing::info!(
                collector = %settings.policy.collector.username(),
                operator = settings.policy.operator.as_ref().map(ServiceAccountRef::username).unwrap_or_default(),
                "Node authentication is enforced: a raw record is enriched only with a token of the collector on the node it claims."
            );
            let spec = node_proof::directory_topic(&settings.directory_topic);
            let directory = match config.stage.kafka.ensure_topics(std::slice::from_ref(&spec)).await {
                Ok(()) => {
                    Directory::start(&config.stage.kafka, &spec.name, settings.cache_size, service.shutdown.token())
                        .await
                }
                Err(e) => Err(DirectoryError::Topic { topic: spec.name.clone(), reason: e.to_string() }),
            };
            let directory = match directory {
                Ok(d) => d,
                Err(e) => {
                    tracing::error!(error = %e, "Cannot read the node-token directory.");
                    return Err(RunError::setup("the node-token directory", e));
                }
            };
            Some(NodeAuth {
                verifier: Verifier::new(KubeReviewer::new(client), settings.policy.clone(), settings.cache_size),
                directory,
            })
        }
    };
    let handler = Enrich {
        auth,
        cache,
        inventory: InventoryCache::new(config.inventory),
        catalog: config.catalog,
        producer,
        codec,
        enriched_topic: config.enriched_topic.clone(),
    };
    let Config { stage, batch, raw_topic, enriched_topic, .. } = config;
    service.spawn_stage(Stage::new(stage, [raw_topic], [enriched_topic]), batch, handler);
    service.run().await
}

/// The consumer's batch handler: decode and enrich each record, produce every enriched record
/// together (in order, so each node's order holds) and return once all are acknowledged; only
/// then are the batch's offsets stored. A record that cannot be decoded is dead-lettered and the
/// rest go on; a failed produce or an unreachable schema registry retries the whole batch
/// (consumers deduplicate by event id).
pub struct Enrich {
    /// The node token check, when enforced.
    auth: Option<NodeAuth<KubeReviewer>>,
    cache: ClusterCache,
    /// Owned by the handler, which is one task: no lock on the hot path.
    inventory: InventoryCache,
    catalog: XidCatalog,
    producer: Producer,
    codec: Arc<Codec>,
    enriched_topic: String,
}

impl BatchHandler for Enrich {
    async fn handle_batch(&mut self, records: &[Record]) -> Result<Vec<Disposition>, BoxError> {
        let mut dispositions = vec![Disposition::Done; records.len()];
        let mut out: Vec<(usize, String, String, Vec<u8>)> = Vec::with_capacity(records.len());
        let now = chrono::Utc::now();
        // Counted once per batch rather than per event: a metrics lookup per event costs more
        // than the resolution itself.
        let mut unresolved = [0u64; Unresolved::ALL.len()];
        let now_s = now.timestamp();
        // Every token of the batch reviewed (or cached) first; an apiserver that does not answer
        // fails the batch, which is retried: no record is accepted unreviewed.
        let (reviews, proofs) = match &mut self.auth {
            Some(auth) => {
                let proofs = auth.proofs(records).await?;
                let tokens =
                    records.iter().zip(&proofs).map(|(r, p)| (r.key.as_deref().unwrap_or_default(), p.token(r)));
                (auth.verifier.prepare(tokens, now_s).await?, proofs)
            }
            None => (Vec::new(), Vec::new()),
        };
        for (i, record) in records.iter().enumerate() {
            let Some(payload) = record.payload.as_deref() else {
                dispositions[i] = Disposition::DeadLetter("empty record".into());
                continue;
            };
            let event: HealthEvent = match self.codec.decode(payload).await {
                Ok(e) => e,
                Err(e) if e.is_transient() => return Err(Box::new(e)),
                Err(e) => {
                    dispositions[i] = Disposition::DeadLetter(format!("{}: {e}", e.reason()));
                    continue;
                }
            };
            if let Some(auth) = &self.auth {
                let review = reviews.get(i).and_then(Option::as_deref);
                match auth.check(review, &proofs[i], record, &event.node, now_s) {
                    Ok(Accepted::Node) => {}
                    Ok(Accepted::Operator) => {
                        OperatorRecord { node: &event.node, event_id: &event.event_id }.emit();
                    }
                    Err(refusal) => {
                        // A node the cluster does not know is one label, whatever name it claims:
                        // the label set stays bounded by the cluster's nodes.
                        let label = if self.cache.node(&event.node).is_some() {
                            event.node.clone()
                        } else {
                            "unknown".to_owned()
                        };
                        RecordUnauthenticated {
                            claimed_node: &event.node,
                            label,
                            event_id: &event.event_id,
                            reason: &refusal,
                            reason_label: refusal.label(),
                        }
                        .emit();
                        dispositions[i] = Disposition::DeadLetter(refusal.to_string());
                        continue;
                    }
                }
            }
            let node = self.cache.node(&event.node);
            if node.is_none() {
                UnknownNodeEvent { node: &event.node }.emit();
            }
            if let Detail::GpuInventory(detail) = &event.detail {
                // Applied before the event is resolved and in partition order, so the node's events
                // after it resolve against it. A retried batch applies it again: the same result.
                inventory::report(&event.node, &self.inventory.apply(&event.node, detail, event.observed_at));
            }
            let gpu = self.inventory.resolve(&event.node, &event.entity, event.component, event.observed_at);
            if let Resolution::Unresolved(reason) = gpu {
                unresolved[reason as usize] += 1;
            }
            let event_id = event.event_id.to_string();
            let key = event.node.clone();
            let enriched = enrich::enrich(event, node.as_deref(), gpu, &self.catalog, now);
            match self.codec.encode(&enriched) {
                Ok(bytes) => out.push((i, key, event_id, bytes)),
                Err(e) => dispositions[i] = Disposition::DeadLetter(e.to_string()),
            }
        }
        // Futures are first polled in order, so the records are queued in batch order, and the
        // idempotent producer keeps that order within each partition.
        let sends = out.iter().map(|(i, key, id, bytes)| {
            let envelope = kafka::Envelope {
                topic: &self.enriched_topic,
                key,
                id,
                content_type: EnrichedHealthEvent::CONTENT_TYPE,
                incoming_trace: records[*i].header(record_headers::TRACEPARENT),
            };
            kafka::publish_record(&self.producer, envelope, bytes)
        });
        for result in futures::future::join_all(sends).await {
            result?;
        }
        metrics::counter!(names::EVENTS_TOTAL).increment(out.len() as u64);
        for (reason, n) in Unresolved::ALL.iter().zip(unresolved) {
            if n > 0 {
                metrics::counter!(names::GPU_UNRESOLVED_TOTAL, "reason" => reason.as_str()).increment(n);
            }
        }
        metrics::gauge!(names::INVENTORY_NODES).set(self.inventory.len() as f64);
        Ok(dispositions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Result<Config, Problems> {
        let mut argv = vec!["gpumedic-enricher", "--kafka-bootstrap", "127.0.0.1:1"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).expect("parses").validate()
    }

    #[test]
    fn node_auth_is_off_unless_enforced_and_names_valid_service_accounts() {
        assert_eq!(args(&[]).expect("valid").node_auth, None);
        let c = args(&["--node-auth", "enforce", "--operator-service-account", "gpumedic:ops"]).expect("valid");
        let auth = c.node_auth.expect("enforced");
        assert_eq!(auth.policy.collector.username(), "system:serviceaccount:gpumedic:gpumedic-collector");
        assert_eq!(
            auth.policy.operator.as_ref().map(ServiceAccountRef::username),
            Some("system:serviceaccount:gpumedic:ops")
        );
        let err = args(&[
            "--node-auth",
            "on",
            "--collector-service-account",
            "gpumedic",
            "--operator-service-account",
            "x:y:z",
            "--node-token-cache-size",
            "0",
        ])
        .expect_err("invalid");
        let fields: Vec<&str> = err.list().iter().map(|p| p.field.as_str()).collect();
        for f in ["--node-auth", "--collector-service-account", "--operator-service-account", "--node-token-cache-size"]
        {
            assert!(fields.contains(&f), "{f} in {fields:?}");
        }
        let same = args(&["--node-auth", "enforce", "--operator-service-account", "gpumedic:gpumedic-collector"]);
        assert!(same.is_err(), "the operator may not be the collector");
    }
}
