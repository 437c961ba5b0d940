//! A consuming stage: the flags every consuming service shares ([`StageArgs`], and [`BatchArgs`]
//! for a stage that handles records a batch at a time), validated into [`StageSettings`] and
//! [`BatchSettings`], and the [`Stage`] that creates its topics and joins its consumer group.
//!
//! A service flattens the arguments into its own, naming its defaults with a [`StageDefaults`]
//! type, so the flags, their environment variables and their defaults are the same in every
//! service while each keeps its own group name and batch sizes. [`Service::spawn_stage`] runs a
//! batch stage; a stage that consumes only at times (the remediator, while it leads) uses
//! [`Stage::wait_for_topics`] and [`Stage::join`] itself.
//!
//! [`Service::spawn_stage`]: crate::service::Service::spawn_stage

use std::marker::PhantomData;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::admin::ReadyFlag;
use crate::config::{Problems, Validate, parse_duration};
use crate::kafka::{
    self, Assignment, BatchLimitArgs, BatchSettings, Consumer, KafkaArgs, KafkaError, KafkaSettings, Producer,
    TopicSpec,
};

/// The defaults of one service's stage flags. A unit type per service implements it.
pub trait StageDefaults {
    /// The default of `--group`: the consumer group shared by the service's replicas.
    const GROUP: &'static str;
    /// The default of `--batch-max`, as text (clap parses it).
    const BATCH_MAX: &'static str = "1000";
    /// The default of `--batch-linger`.
    const BATCH_LINGER: &'static str = "5ms";
    /// The longest `--batch-linger` accepted: it delays every record when the stage is quiet.
    const MAX_BATCH_LINGER: Duration = Duration::from_secs(10);
    /// What a long linger delays, in the problem shown when `--batch-linger` is too long.
    const LINGER_DELAYS: &'static str = "every record";
}

/// Flags every consuming stage shares: Kafka and the consumer group. Flattened into a service's
/// arguments (`#[command(flatten)]`).
#[derive(Debug, Clone, clap::Args)]
pub struct StageArgs<D: StageDefaults + Send + Sync + 'static> {
    /// Kafka flags.
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Kafka consumer group shared by all replicas of the service.
    #[arg(long, env = "GPUMEDIC_GROUP", default_value = D::GROUP)]
    pub group: String,
    #[arg(skip)]
    defaults: PhantomData<D>,
}

/// [`StageArgs`] validated.
#[derive(Debug, Clone)]
pub struct StageSettings {
    /// Kafka settings.
    pub kafka: KafkaSettings,
    /// The consumer group.
    pub group: String,
}

impl<D: StageDefaults + Send + Sync + 'static> Validate for StageArgs<D> {
    type Valid = StageSettings;

    fn validate(self) -> Result<StageSettings, Problems> {
        let mut p = Problems::default();
        let kafka = self.kafka.validate().map_err(|e| p.extend(e)).ok();
        if self.group.trim().is_empty() {
            p.push("--group", "the consumer group must not be empty");
        }
        p.finish(|| StageSettings { kafka: kafka.expect("checked"), group: self.group })
    }
}

/// Flags of a stage that handles records a batch at a time: how many, how long to wait for them,
/// and the byte and poison-record limits. Flattened into a service's arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct BatchArgs<D: StageDefaults + Send + Sync + 'static> {
    /// Most records handled together: their effects are made durable together and the offsets
    /// stored once every one is (a batch fills only under backlog, see --batch-linger); larger
    /// batches cost fewer round trips per record (docs/benchmarks.md).
    #[arg(long, env = "GPUMEDIC_BATCH_MAX", default_value = D::BATCH_MAX)]
    pub batch_max: usize,
    /// How long a batch waits for more records after its first one (a latency cap when quiet).
    #[arg(long, env = "GPUMEDIC_BATCH_LINGER", default_value = D::BATCH_LINGER)]
    pub batch_linger: String,
    /// The byte bound and the poison-record rule.
    #[command(flatten)]
    pub limits: BatchLimitArgs,
    #[arg(skip)]
    defaults: PhantomData<D>,
}

impl<D: StageDefaults + Send + Sync + 'static> Validate for BatchArgs<D> {
    type Valid = BatchSettings;

    fn validate(self) -> Result<BatchSettings, Problems> {
        let mut p = Problems::default();
        let limits = self.limits.validate().map_err(|e| p.extend(e)).ok();
        if !(1..=100_000).contains(&self.batch_max) {
            p.push("--batch-max", format!("{} is not from 1 to 100000", self.batch_max));
        }
        let linger = p.check("--batch-linger", parse_duration(&self.batch_linger));
        if linger.is_some_and(|l| l > D::MAX_BATCH_LINGER) {
            p.push(
                "--batch-linger",
                format!("must be at most {} (it delays {})", render(D::MAX_BATCH_LINGER), D::LINGER_DELAYS),
            );
        }
        p.finish(|| BatchSettings {
            max: self.batch_max,
            linger: linger.expect("checked"),
            limits: limits.expect("checked"),
        })
    }
}

/// A whole number of seconds as `--batch-linger` takes it (`1s`, `10s`), else milliseconds.
fn render(d: Duration) -> String {
    if d.subsec_millis() == 0 { format!("{}s", d.as_secs()) } else { format!("{}ms", d.as_millis()) }
}

/// A consuming stage: its settings, the topics it reads (`inputs`, each with a dead-letter topic)
/// and writes (`outputs`), created with `partitions` partitions when missing.
#[derive(Debug, Clone)]
pub struct Stage {
    /// Kafka settings and the consumer group.
    pub settings: StageSettings,
    /// The topics read.
    pub inputs: Vec<String>,
    /// The topics written.
    pub outputs: Vec<String>,
    /// Partitions of the topics the stage creates.
    pub partitions: i32,
    /// Kept current with every rebalance, for a stage whose state is owned per partition.
    pub assignment: Option<Assignment>,
}

impl Stage {
    /// A stage reading `inputs` and writing `outputs`, whose topics get
    /// [`DEFAULT_PARTITIONS`](gpumedic_schemas::topics::DEFAULT_PARTITIONS) when created.
    pub fn new<I, O>(settings: StageSettings, inputs: I, outputs: O) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
        O: IntoIterator,
        O::Item: Into<String>,
    {
        Self {
            settings,
            inputs: inputs.into_iter().map(Into::into).collect(),
            outputs: outputs.into_iter().map(Into::into).collect(),
            partitions: gpumedic_schemas::topics::DEFAULT_PARTITIONS,
            assignment: None,
        }
    }

    /// The same stage, keeping `assignment` current with every rebalance.
    pub fn tracking(mut self, assignment: Assignment) -> Self {
        self.assignment = Some(assignment);
        self
    }

    /// The Kafka settings.
    pub fn kafka(&self) -> &KafkaSettings {
        &self.settings.kafka
    }

    /// The topics the stage needs: its inputs, their dead-letter topics, and its outputs.
    pub fn topics(&self) -> Vec<TopicSpec> {
        let inputs: Vec<&str> = self.inputs.iter().map(String::as_str).collect();
        let outputs: Vec<&str> = self.outputs.iter().map(String::as_str).collect();
        kafka::stage_topics(&inputs, &outputs, self.partitions)
    }

    /// Creates the stage's missing topics, retrying with backoff while Kafka is not ready; `false`
    /// when `token` was cancelled first.
    pub async fn wait_for_topics(&self, token: &CancellationToken) -> bool {
        kafka::wait_for_topics(&self.settings.kafka, &self.topics(), token).await
    }

    /// Joins the consumer group on the inputs: the consumer (`assigned` turns ready once the group
    /// has given it partitions) and the producer of its dead letters.
    pub fn join(&self, service: &'static str, assigned: ReadyFlag) -> Result<(Consumer, Producer), KafkaError> {
        let inputs: Vec<&str> = self.inputs.iter().map(String::as_str).collect();
        let kafka = &self.settings.kafka;
        let assignment = self.assignment.clone().unwrap_or_default();
        let consumer = kafka.consumer_tracking(service, &self.settings.group, &inputs, assigned, assignment)?;
        let dlq = kafka.producer(&format!("{service}-dlq"))?;
        Ok((consumer, dlq))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Clone)]
    struct Quick;

    impl StageDefaults for Quick {
        const GROUP: &'static str = "gpumedic-quick";
        const BATCH_MAX: &'static str = "7";
        const BATCH_LINGER: &'static str = "2ms";
        const MAX_BATCH_LINGER: Duration = Duration::from_secs(1);
        const LINGER_DELAYS: &'static str = "every event";
    }

    #[derive(Debug, Parser)]
    struct Args {
        #[command(flatten)]
        stage: StageArgs<Quick>,
        #[command(flatten)]
        batch: BatchArgs<Quick>,
    }

    fn parse(extra: &[&str]) -> Args {
        let mut argv = vec!["quick", "--kafka-bootstrap", "127.0.0.1:9092"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).expect("parses")
    }

    #[test]
    fn the_service_names_the_defaults() {
        let args = parse(&[]);
        let stage = args.stage.validate().expect("valid");
        assert_eq!(stage.group, "gpumedic-quick");
        let batch = args.batch.validate().expect("valid");
        assert_eq!((batch.max, batch.linger), (7, Duration::from_millis(2)));
    }

    #[test]
    fn every_problem_is_named_against_its_flag() {
        let args = parse(&["--group", " ", "--batch-max", "0", "--batch-linger", "2s", "--poison-attempts", "0"]);
        let stage = args.stage.validate().expect_err("invalid");
        assert_eq!(stage.list()[0].field, "--group");
        let batch = args.batch.validate().expect_err("invalid");
        let problems: Vec<String> = batch.list().iter().map(|p| format!("{}: {}", p.field, p.message)).collect();
        assert_eq!(
            problems,
            [
                "--poison-attempts: 0 is not from 1 to 100",
                "--batch-max: 0 is not from 1 to 100000",
                "--batch-linger: must be at most 1s (it delays every event)",
            ]
        );
    }

    #[test]
    fn a_stage_needs_its_inputs_their_dead_letters_and_its_outputs() {
        let settings = parse(&[]).stage.validate().expect("valid");
        let stage = Stage::new(settings, ["in"], ["out"]);
        let names: Vec<String> = stage.topics().into_iter().map(|t| t.name).collect();
        assert_eq!(names, ["in", "in.dlq", "out"]);
    }
}
