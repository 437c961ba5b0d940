//! The engine with its outputs ([`Classifier`]): the partitions whose nodes it holds, kept in
//! line with the consumer's assignment; verdicts published; workload faults recorded. Shared by
//! the batch handler, the ticker and the rules watcher.

use std::sync::Arc;
use std::time::Duration;

use gpumedic_runtime::kafka::{self, Envelope, Producer};
use gpumedic_runtime::postgres;
use gpumedic_schemas::{Codec, Record as _, Verdict};

use crate::events::{InternalEvent as _, StateRebuilt, VerdictPublished, WorkloadFault, names};
use crate::rules::RuleSet;
use crate::rules::engine::{Decision, Engine};
use crate::{lemons, observe, persist, store, workload};

/// What stops the classifier.
#[derive(Debug, thiserror::Error)]
pub enum ClassifierError {
    /// The database is unreachable.
    #[error(transparent)]
    Database(#[from] postgres::PostgresError),
    /// A migration failed.
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A query failed.
    #[error("database query failed: {0}")]
    Query(#[from] sqlx::Error),
    /// Kafka failed.
    #[error(transparent)]
    Kafka(#[from] kafka::KafkaError),
    /// Which nodes this replica owns cannot be told (topic metadata unavailable).
    #[error("cannot tell which nodes this replica owns: {0}")]
    Ownership(String),
}

/// Which partitions' nodes the engine holds.
#[derive(Debug, Default)]
pub(crate) struct Owned {
    /// The assignment generation the engine was last reconciled with.
    generation: Option<u64>,
    /// The partitions of the enriched topic it holds the nodes of.
    partitions: std::collections::BTreeSet<i32>,
}

/// The engine with its outputs, shared by the batch handler, the ticker and the rules watcher.
pub struct Classifier {
    pub(crate) engine: Engine,
    /// The consumer's partitions, kept current by the rebalance callbacks.
    pub(crate) assignment: kafka::Assignment,
    pub(crate) owned: Owned,
    pub(crate) enriched_topic: String,
    pub(crate) rebuild_window: Duration,
    pub(crate) pool: sqlx::PgPool,
    pub(crate) producer: Producer,
    pub(crate) verdicts_topic: String,
    pub(crate) codec: Arc<Codec>,
    /// Statements each batch is written as, at once.
    pub(crate) write_parallelism: usize,
    /// When application Xids across nodes are a workload fault.
    pub(crate) workload_faults: workload::Settings,
    /// How far an event's observed_at may be after its record's Kafka timestamp.
    pub(crate) clock_skew_allowance: Duration,
    /// When a node or GPU is a lemon.
    pub(crate) lemons: lemons::Settings,
    /// Which events are recorded, and the rollups of the rest.
    pub(crate) keeper: persist::Keeper,
    /// Writes closed rollups beside the batches ([`crate::rollups`]).
    pub(crate) rollups: crate::rollups::RollupWriter,
}

impl Classifier {
    /// Brings the engine's nodes in line with the assignment: forgets the nodes of partitions
    /// this replica no longer owns and rebuilds those of partitions it gained.
    pub(crate) async fn reconcile(&mut self) -> Result<(), ClassifierError> {
        let (generation, owned) = self.assignment.of(&self.enriched_topic);
        if self.owned.generation == Some(generation) {
            return Ok(());
        }
        let count = partition_count(&self.producer, &self.enriched_topic).await?;
        let owns = |node: &str| owned.contains(&kafka::partition_for(node.as_bytes(), count));
        let forgotten = self.engine.retain_nodes(owns);
        self.keeper.retain_nodes(owns);
        let gained: std::collections::BTreeSet<i32> = owned.difference(&self.owned.partitions).copied().collect();
        if !gained.is_empty() {
            let started = std::time::Instant::now();
            let since = chrono::Utc::now() - chrono::Duration::from_std(self.rebuild_window).unwrap_or_default();
            let nodes: Vec<String> = store::nodes_since(&self.pool, since)
                .await?
                .into_iter()
                .filter(|n| gained.contains(&kafka::partition_for(n.as_bytes(), count)))
                .collect();
            let (mut rebuilt, events) =
                store::rebuild(&self.pool, self.engine.rules().clone(), since, &nodes, &mut self.keeper).await?;
            // The store's open incidents of these partitions stay followed, whatever the replay
            // made of them (a new rule version, an incident older than the window).
            let stored: Vec<_> = store::open_incidents(&self.pool)
                .await?
                .into_iter()
                .filter(|i| gained.contains(&kafka::partition_for(i.node.as_bytes(), count)))
                // Lemon incidents are not the engine's: they never recover on evidence.
                .filter(|i| i.rule_id != crate::lemons::GPU_RULE && i.rule_id != crate::lemons::NODE_RULE)
                .collect();
            let reattached = rebuilt.reattach(stored);
            if reattached.unknown_rule > 0 {
                tracing::warn!(
                    incidents = reattached.unknown_rule,
                    "Open incidents of rules the rule set no longer has are not followed; close them by hand (docs/rules.md)."
                );
            }
            let open = rebuilt.open_incidents().len();
            self.engine.adopt(rebuilt);
            StateRebuilt {
                partitions: &gained,
                nodes: nodes.len(),
                events,
                open_incidents: open,
                renamed: reattached.renamed,
                restored: reattached.restored,
                elapsed: started.elapsed(),
            }
            .emit();
        }
        if forgotten > 0 {
            tracing::info!(nodes = forgotten, "Forgot the nodes of partitions another replica now owns.");
        }
        metrics::gauge!(names::OWNED_NODES).set(self.engine.node_count() as f64);
        self.owned = Owned { generation: Some(generation), partitions: owned };
        Ok(())
    }

    /// Publishes the verdicts for `decisions` all at once (each continuing the trace of the record
    /// that caused it) and waits for every acknowledgement; returns them with their decisions.
    pub(crate) async fn publish(
        &self,
        decisions: &[(Decision, Option<&[u8]>)],
    ) -> Result<Vec<store::Published>, kafka::KafkaError> {
        let out: Vec<(Decision, Verdict)> = decisions.iter().map(|(d, _)| (d.clone(), observe::verdict(d))).collect();
        let encoded: Vec<(Vec<u8>, String)> = out
            .iter()
            .map(|(_, v)| {
                let bytes = self.codec.encode(v).expect("verdicts built from decisions always encode");
                (bytes, v.verdict_id.to_string())
            })
            .collect();
        // Futures are first polled in order, so the records are queued in decision order, and
        // librdkafka (idempotent producer) keeps that order within each partition.
        let sends = out.iter().zip(&encoded).zip(decisions).map(|(((_, v), (bytes, id)), (_, trace))| {
            let envelope = Envelope {
                topic: &self.verdicts_topic,
                key: &v.node,
                id,
                content_type: Verdict::CONTENT_TYPE,
                incoming_trace: *trace,
            };
            kafka::publish_record_traced(&self.producer, envelope, bytes)
        });
        let trace_ids = futures::future::try_join_all(sends).await?;
        lemons::announce(out.iter().map(|(d, _)| d));
        for (_, v) in &out {
            VerdictPublished {
                node: &v.node,
                rule: &v.rule_id,
                severity: &v.severity,
                action: &v.action,
                recovery: v.recovery,
                verdict_id: &v.verdict_id,
            }
            .emit();
        }
        Ok(out.into_iter().zip(trace_ids).map(|((d, v), t)| (d, v, t)).collect())
    }

    /// Records the batch's workload-fault sightings, one workload at a time, and publishes each
    /// fault they complete before committing it (see [`workload`]).
    pub(crate) async fn record_workload_faults(
        &self,
        sightings: Vec<workload::Sighting>,
    ) -> Result<(), ClassifierError> {
        for (name, sightings) in workload::by_workload(sightings) {
            let mut tx = self.pool.begin().await?;
            if let Some(fault) = workload::decide(&mut tx, &name, &sightings, &self.workload_faults).await? {
                let v = workload::verdict(&fault, chrono::Utc::now());
                let bytes = self.codec.encode(&v).expect("workload verdicts always encode");
                let id = v.verdict_id.to_string();
                let envelope = Envelope {
                    topic: &self.verdicts_topic,
                    key: &v.node,
                    id: &id,
                    content_type: Verdict::CONTENT_TYPE,
                    incoming_trace: None,
                };
                kafka::publish_record(&self.producer, envelope, &bytes).await?;
                WorkloadFault {
                    workload: &fault.workload,
                    nodes: fault.nodes.len(),
                    gpus: fault.gpus,
                    xids: &fault.xids,
                    verdict_id: &v.verdict_id,
                }
                .emit();
            }
            tx.commit().await?;
        }
        Ok(())
    }

    /// `decisions` (each with what it is tied to: the record behind it, for its trace) with the
    /// lemon decisions they call for, each tied to what its trigger is tied to. The hardware
    /// history of their nodes and GPUs comes from the incident store (see [`lemons`]).
    pub(crate) async fn judge_lemons<T: Clone>(
        &self,
        decisions: &[(Decision, T)],
    ) -> Result<Vec<(Decision, T)>, ClassifierError> {
        let mut ledger = lemons::Ledger::new(self.lemons);
        let plain: Vec<Decision> = decisions.iter().map(|(d, _)| d.clone()).collect();
        ledger.load(&self.pool, &plain).await?;
        let mut out = Vec::with_capacity(decisions.len());
        for (d, tie) in decisions {
            let judged = ledger.judge(vec![d.clone()]);
            out.extend(judged.into_iter().map(|d| (d, tie.clone())));
        }
        Ok(out)
    }

    /// The recoveries of open GPU lemons that the GPU inventories among `observations` (each
    /// with what it is tied to) prove replaced (see [`lemons::Ledger::replaced`]); the open
    /// lemons of their nodes come from the incident store.
    pub(crate) async fn close_replaced_lemons<T: Clone>(
        &self,
        observations: &[(&crate::rules::Observation, T)],
    ) -> Result<Vec<(Decision, T)>, ClassifierError> {
        let mut ledger = lemons::Ledger::new(self.lemons);
        ledger.load_open_for(&self.pool, observations.iter().map(|(o, _)| *o)).await?;
        let mut out = Vec::new();
        for (o, tie) in observations {
            out.extend(ledger.replaced(o).into_iter().map(|d| (d, tie.clone())));
        }
        Ok(out)
    }

    /// Replaces the engine's rules, for the rules watcher.
    pub(crate) fn replace_rules(&mut self, mut rules: RuleSet) {
        // The lead and the quiet cap are the service's settings, not the files': keep them.
        let current = self.engine.rules();
        rules.lead = current.lead;
        rules.max_quiet = current.max_quiet;
        self.engine.replace_rules(rules);
    }
}

/// How many partitions `topic` has, from the broker's metadata.
async fn partition_count(producer: &Producer, topic: &str) -> Result<i32, ClassifierError> {
    use rdkafka::producer::Producer as _;
    let producer = producer.clone();
    let topic = topic.to_owned();
    let count = tokio::task::spawn_blocking(move || {
        producer
            .client()
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .map(|m| m.topics().iter().find(|t| t.name() == topic).map_or(0, |t| t.partitions().len()))
    })
    .await
    .map_err(|e| ClassifierError::Ownership(e.to_string()))?
    .map_err(|e| ClassifierError::Ownership(e.to_string()))?;
    match i32::try_from(count) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(ClassifierError::Ownership("the enriched topic has no partitions yet".into())),
    }
}
