//! `gpumedic replay`: read a topic over a time range (or a file exported from one) and either
//! export it, re-publish it, or backtest a rule set against it.
//!
//! - `export` writes the records (key, payload, headers, timestamp) to a file, so an incident's
//!   stream can be kept, shared and replayed after the topic's retention has passed.
//! - `republish` produces the records again, with their keys and headers, to a topic (the same one
//!   by default): downstream state is rebuilt, and every consumer deduplicates by event or verdict
//!   id, so a record seen before changes nothing.
//! - `backtest` runs enriched events through a rule set with no side effects (no Kafka writes, no
//!   Postgres, no Kubernetes) and prints how its verdicts differ from the recorded ones on the
//!   verdict topic.
//!
//! A backtest also prints the decision-quality summary of its decisions (quarantines, releases,
//! oscillations; `gpumedic_classifier::quality`), and with `--expect` judges them against the
//! expected outcomes of a decision-quality scenario file (docs/decisions.md).
//!
//! Ranges select records by their Kafka timestamp (the producer's create time), which is what
//! Kafka can seek by. The reader stops at the end offsets seen when it starts, so a busy topic does
//! not make a replay run forever.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, IsTerminal as _, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand, ValueEnum};
use gpumedic_classifier::observe;
use gpumedic_classifier::quality::{self, Checkpoint, Expect, Expectations, Miss, Summary, Target, Timeline};
use gpumedic_classifier::rules::{self, Decision, Engine, RuleSet, SyntheticPolicy};
use gpumedic_runtime::config::{Validate as _, render_problems};
use gpumedic_runtime::kafka::{KafkaArgs, KafkaSettings};
use gpumedic_schemas::{EnrichedHealthEvent, Verdict, topics};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer as _, ThreadedProducer};
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};

/// Flags of `gpumedic replay`.
#[derive(Debug, Subcommand)]
pub enum ReplayCommand {
    /// Write a topic's records over a range to a file (for `--file` inputs later).
    Export {
        #[command(flatten)]
        input: TopicInput,
        /// The file to write.
        #[arg(long)]
        out: PathBuf,
    },
    /// Produce a topic's records over a range (or a file's) again, keys and headers kept, to
    /// `--to-topic` (the source topic by default). Consumers deduplicate by id.
    Republish {
        #[command(flatten)]
        input: Input,
        /// Where to produce; the input topic when not given (required with `--file`).
        #[arg(long)]
        to_topic: Option<String>,
    },
    /// Run enriched events through a rule set with no side effects and print how the verdicts
    /// differ from those recorded on the verdict topic.
    Backtest(BacktestArgs),
}

/// A topic and a range of it.
#[derive(Debug, Clone, Args)]
pub struct TopicInput {
    #[command(flatten)]
    kafka: KafkaArgs,
    /// The topic to read.
    #[arg(long)]
    topic: String,
    #[command(flatten)]
    range: RangeArgs,
}

/// A range by Kafka timestamp.
#[derive(Debug, Clone, Args)]
pub struct RangeArgs {
    /// First record time: RFC 3339 (`2026-11-30T02:00:00Z`) or an age (`90m`, `2h`, `7d` ago).
    /// The topic's start when not given.
    #[arg(long)]
    from: Option<String>,
    /// Last record time, same forms. The topic's end (when the replay starts) when not given.
    #[arg(long)]
    to: Option<String>,
}

/// A topic range, or a file written by `export`.
#[derive(Debug, Clone, Args)]
pub struct Input {
    /// Read this exported file instead of a topic.
    #[arg(long, conflicts_with = "topic")]
    file: Option<PathBuf>,
    /// Kafka bootstrap servers (host:port,...).
    #[arg(long, env = "GPUMEDIC_KAFKA_BOOTSTRAP")]
    kafka_bootstrap: Option<String>,
    /// Extra librdkafka properties as key=value.
    #[arg(long = "kafka-option", env = "GPUMEDIC_KAFKA_OPTIONS", value_delimiter = ',')]
    kafka_options: Vec<String>,
    /// The topic to read (with `--kafka-bootstrap`).
    #[arg(long)]
    topic: Option<String>,
    #[command(flatten)]
    range: RangeArgs,
}

/// Flags of `gpumedic replay backtest`.
#[derive(Debug, Args)]
pub struct BacktestArgs {
    #[command(flatten)]
    input: Input,
    /// The recorded verdicts to compare with (read from the input range's start to the topic's
    /// end). Not read with `--no-compare`.
    #[arg(long, default_value = topics::VERDICTS)]
    verdicts_topic: String,
    /// Only run the rules and print the verdicts they give, without comparing.
    #[arg(long)]
    no_compare: bool,
    /// A rules directory (YAML files), as the classifier's `--rules-dir`; the built-in default rule
    /// set when not given.
    #[arg(long)]
    rules_dir: Option<PathBuf>,
    /// Act on synthetic (injected) events, as a classifier started with `--allow-synthetic`.
    #[arg(long)]
    allow_synthetic: bool,
    /// At most this many differences in the table (JSON output lists all).
    #[arg(long, default_value_t = 50)]
    limit: usize,
    /// Table for humans, or JSON for scripts.
    #[arg(long, value_enum, default_value_t = Output::Table)]
    output: Output,
    /// Judge the decisions against expected outcomes: a YAML file with `expect`, `checkpoints` and
    /// `oscillations` as a decision-quality scenario writes them (other keys are ignored, so a
    /// scenario file itself will do). Checkpoint times are RFC 3339 or an offset from the first
    /// event (`20m`).
    #[arg(long)]
    expect: Option<PathBuf>,
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned text for humans.
    Table,
    /// One JSON document.
    Json,
}

/// One record as replay moves it.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    /// Kafka timestamp, milliseconds since the epoch.
    pub timestamp_ms: i64,
    /// The key (node name in every gpumedic topic).
    pub key: Option<Vec<u8>>,
    /// The framed Avro record.
    pub payload: Option<Vec<u8>>,
    /// Headers in order.
    pub headers: Vec<(String, Vec<u8>)>,
}

/// Runs a replay subcommand.
pub fn run(command: ReplayCommand) -> anyhow::Result<()> {
    match command {
        ReplayCommand::Export { input, out } => {
            let settings =
                input.kafka.clone().validate().map_err(|p| anyhow::anyhow!(render_problems("gpumedic replay", &p)))?;
            let source = Source::Topic { settings, topic: input.topic.clone(), range: input.range.resolve()? };
            let mut writer = FileWriter::create(&out)?;
            let count = source.for_each(|item| writer.write(&item))?;
            writer.finish()?;
            eprintln!("Exported {count} records to {}.", out.display());
            Ok(())
        }
        ReplayCommand::Republish { input, to_topic } => {
            let source = input.source()?;
            let target = match (&to_topic, &input.topic) {
                (Some(t), _) | (None, Some(t)) => t.clone(),
                (None, None) => bail!("--to-topic is required when the input is a file"),
            };
            let settings = input.settings()?.context("--kafka-bootstrap is required to republish")?;
            let count = republish(&settings, &target, source)?;
            eprintln!("Republished {count} records to {target}.");
            Ok(())
        }
        ReplayCommand::Backtest(args) => {
            let report = backtest(&args)?;
            match args.output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&report)?),
                Output::Table => print!("{}", report.table(args.limit)),
            }
            Ok(())
        }
    }
}

impl RangeArgs {
    fn resolve(&self) -> anyhow::Result<TimeRange> {
        let now = Utc::now();
        let parse = |flag: &str, v: &Option<String>| -> anyhow::Result<Option<i64>> {
            v.as_deref().map(|t| parse_time(t, now).with_context(|| format!("{flag} '{t}'"))).transpose()
        };
        let range = TimeRange { from_ms: parse("--from", &self.from)?, to_ms: parse("--to", &self.to)? };
        if let (Some(f), Some(t)) = (range.from_ms, range.to_ms)
            && f > t
        {
            bail!("--from is after --to");
        }
        Ok(range)
    }
}

/// A time range by Kafka timestamp, both ends inclusive, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimeRange {
    /// From, or the start of the topic.
    pub from_ms: Option<i64>,
    /// To, or the end offsets when the read starts.
    pub to_ms: Option<i64>,
}

/// Parses RFC 3339 or an age (`30s`, `90m`, `2h`, `7d`) before `now`.
pub fn parse_time(text: &str, now: DateTime<Utc>) -> anyhow::Result<i64> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.timestamp_millis());
    }
    let age = rules::parse_duration(text).map_err(|e| anyhow::anyhow!("not RFC 3339 nor an age: {e}"))?;
    Ok(now.timestamp_millis() - age.micros() / 1000)
}

impl Input {
    fn settings(&self) -> anyhow::Result<Option<KafkaSettings>> {
        let Some(bootstrap) = &self.kafka_bootstrap else { return Ok(None) };
        let args = KafkaArgs {
            kafka_bootstrap: bootstrap.clone(),
            kafka_options: self.kafka_options.clone(),
            schema_registry_url: None,
            topic_replication: None,
        };
        Ok(Some(args.validate().map_err(|p| anyhow::anyhow!(render_problems("gpumedic replay", &p)))?))
    }

    fn source(&self) -> anyhow::Result<Source> {
        match (&self.file, &self.topic) {
            (Some(path), _) => Ok(Source::File { path: path.clone(), range: self.range.resolve()? }),
            (None, Some(topic)) => {
                let settings = self.settings()?.context("--kafka-bootstrap is required to read a topic")?;
                Ok(Source::Topic { settings, topic: topic.clone(), range: self.range.resolve()? })
            }
            (None, None) => bail!("give --topic (with --kafka-bootstrap) or --file"),
        }
    }
}

/// Where replayed records come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// A topic over a range.
    Topic {
        /// Kafka settings.
        settings: KafkaSettings,
        /// The topic.
        topic: String,
        /// The range.
        range: TimeRange,
    },
    /// A file written by `export`, filtered by the range.
    File {
        /// The file.
        path: PathBuf,
        /// The range.
        range: TimeRange,
    },
}

impl Source {
    /// Calls `f` on every record in order (per partition for a topic), on this thread, while a
    /// reader thread fetches ahead. Returns how many records were seen.
    pub fn for_each(self, mut f: impl FnMut(Item) -> anyhow::Result<()>) -> anyhow::Result<u64> {
        let (tx, rx) = sync_channel::<Vec<Item>>(64);
        let reader = std::thread::spawn(move || match self {
            Source::Topic { settings, topic, range } => read_topic(&settings, &topic, range, &tx),
            Source::File { path, range } => read_file(&path, range, &tx),
        });
        let count = drain(&rx, &mut f);
        // A failed handler drops the receiver, which stops the reader at its next send.
        drop(rx);
        let read = reader.join().map_err(|_| anyhow::anyhow!("the reader thread panicked"))?;
        let count = count?;
        read?;
        Ok(count)
    }
}

fn drain(rx: &Receiver<Vec<Item>>, f: &mut impl FnMut(Item) -> anyhow::Result<()>) -> anyhow::Result<u64> {
    let mut count = 0;
    for batch in rx {
        for item in batch {
            f(item)?;
            count += 1;
        }
    }
    Ok(count)
}

const BATCH: usize = 2_000;

/// Reads `topic` over `range` into `tx` in batches, stopping at the end offsets of the start.
fn read_topic(
    settings: &KafkaSettings,
    topic: &str,
    range: TimeRange,
    tx: &SyncSender<Vec<Item>>,
) -> anyhow::Result<()> {
    // Assigned, never subscribed: the group id is required by librdkafka but nothing is committed.
    let group = format!("gpumedic-replay-{}", uuid::Uuid::new_v4());
    let consumer: BaseConsumer = settings
        .client_config_with(
            "gpumedic-replay",
            &[
                ("group.id", &group),
                ("enable.auto.commit", "false"),
                ("enable.auto.offset.store", "false"),
                ("fetch.max.bytes", "52428800"),
                ("max.partition.fetch.bytes", "10485760"),
            ],
        )
        .create()
        .context("cannot create the Kafka consumer")?;
    let timeout = Duration::from_secs(15);
    let metadata = consumer.fetch_metadata(Some(topic), timeout).with_context(|| format!("metadata of {topic}"))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    if partitions.is_empty() {
        bail!("topic {topic} does not exist or has no partitions");
    }
    // Start offsets: by time when --from is given.
    let mut start = TopicPartitionList::new();
    for &p in &partitions {
        let offset = range.from_ms.map_or(Offset::Beginning, Offset::Offset);
        start.add_partition_offset(topic, p, offset).context("partition list")?;
    }
    let start = if range.from_ms.is_some() { consumer.offsets_for_times(start, timeout)? } else { start };
    let mut assignment = TopicPartitionList::new();
    let mut remaining: BTreeMap<i32, i64> = BTreeMap::new();
    for &p in &partitions {
        let (low, high) = consumer.fetch_watermarks(topic, p, timeout)?;
        let first = match start.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o.max(low),
            // No record at or after --from in this partition.
            Some(Offset::End) => high,
            _ => low,
        };
        if first < high {
            assignment.add_partition_offset(topic, p, Offset::Offset(first))?;
            remaining.insert(p, high);
        }
    }
    if remaining.is_empty() {
        return Ok(());
    }
    consumer.assign(&assignment).context("assigning partitions")?;
    let mut batch = Vec::with_capacity(BATCH);
    let mut idle = Instant::now();
    while !remaining.is_empty() {
        let Some(message) = consumer.poll(Duration::from_millis(200)) else {
            if idle.elapsed() > Duration::from_secs(60) {
                bail!("no record from {topic} for 60 s with {} partitions left to read", remaining.len());
            }
            continue;
        };
        idle = Instant::now();
        let m = message.with_context(|| format!("reading {topic}"))?;
        let partition = m.partition();
        let Some(&end) = remaining.get(&partition) else { continue };
        if m.offset() >= end {
            remaining.remove(&partition);
            continue;
        }
        let timestamp_ms = m.timestamp().to_millis().unwrap_or(0);
        if range.to_ms.is_some_and(|to| timestamp_ms > to) {
            remaining.remove(&partition);
            continue;
        }
        let headers = m
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec).unwrap_or_default())).collect())
            .unwrap_or_default();
        batch.push(Item {
            timestamp_ms,
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers,
        });
        if m.offset() + 1 >= end {
            remaining.remove(&partition);
        }
        if batch.len() == BATCH && tx.send(std::mem::replace(&mut batch, Vec::with_capacity(BATCH))).is_err() {
            return Ok(());
        }
    }
    if !batch.is_empty() {
        let _ = tx.send(batch);
    }
    Ok(())
}

/// The export file: a magic line, then records of
/// `i64 timestamp_ms | i32 key_len (-1: none) | key | i32 payload_len (-1: none) | payload |
/// u16 header_count | (u16 name_len | name | u32 value_len | value)*`, all big-endian.
const FILE_MAGIC: &[u8] = b"GPUMEDIC-REPLAY 1\n";

struct FileWriter {
    out: BufWriter<File>,
}

impl FileWriter {
    fn create(path: &Path) -> anyhow::Result<Self> {
        let mut out = BufWriter::new(File::create(path).with_context(|| format!("creating {}", path.display()))?);
        out.write_all(FILE_MAGIC)?;
        Ok(FileWriter { out })
    }

    fn write(&mut self, item: &Item) -> anyhow::Result<()> {
        let w = &mut self.out;
        w.write_all(&item.timestamp_ms.to_be_bytes())?;
        for part in [&item.key, &item.payload] {
            match part {
                Some(bytes) => {
                    w.write_all(&i32::try_from(bytes.len())?.to_be_bytes())?;
                    w.write_all(bytes)?;
                }
                None => w.write_all(&(-1i32).to_be_bytes())?,
            }
        }
        w.write_all(&u16::try_from(item.headers.len())?.to_be_bytes())?;
        for (name, value) in &item.headers {
            w.write_all(&u16::try_from(name.len())?.to_be_bytes())?;
            w.write_all(name.as_bytes())?;
            w.write_all(&u32::try_from(value.len())?.to_be_bytes())?;
            w.write_all(value)?;
        }
        Ok(())
    }

    fn finish(mut self) -> anyhow::Result<()> {
        self.out.flush()?;
        self.out.get_ref().sync_all()?;
        Ok(())
    }
}

fn read_file(path: &Path, range: TimeRange, tx: &SyncSender<Vec<Item>>) -> anyhow::Result<()> {
    let mut r = BufReader::new(File::open(path).with_context(|| format!("opening {}", path.display()))?);
    let mut magic = vec![0; FILE_MAGIC.len()];
    r.read_exact(&mut magic).with_context(|| format!("{} is not a replay export", path.display()))?;
    if magic != FILE_MAGIC {
        bail!("{} is not a replay export (wrong header)", path.display());
    }
    let mut batch = Vec::with_capacity(BATCH);
    let mut index = 0u64;
    loop {
        let mut ts = [0; 8];
        match r.read_exact(&mut ts) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e.into()),
        }
        let item = read_item(&mut r, i64::from_be_bytes(ts))
            .with_context(|| format!("{}: record {index} is truncated or corrupt", path.display()))?;
        index += 1;
        if range.from_ms.is_some_and(|f| item.timestamp_ms < f) || range.to_ms.is_some_and(|t| item.timestamp_ms > t) {
            continue;
        }
        batch.push(item);
        if batch.len() == BATCH && tx.send(std::mem::replace(&mut batch, Vec::with_capacity(BATCH))).is_err() {
            return Ok(());
        }
    }
    if !batch.is_empty() {
        let _ = tx.send(batch);
    }
    Ok(())
}

fn read_item(r: &mut impl Read, timestamp_ms: i64) -> anyhow::Result<Item> {
    fn bytes(r: &mut impl Read, len: usize) -> anyhow::Result<Vec<u8>> {
        // Bounded so a corrupt length cannot ask for gigabytes.
        anyhow::ensure!(len <= 64 << 20, "length {len} is implausible");
        let mut b = vec![0; len];
        r.read_exact(&mut b)?;
        Ok(b)
    }
    fn optional(r: &mut impl Read) -> anyhow::Result<Option<Vec<u8>>> {
        let mut len = [0; 4];
        r.read_exact(&mut len)?;
        match i32::from_be_bytes(len) {
            -1 => Ok(None),
            n if n >= 0 => Ok(Some(bytes(r, n as usize)?)),
            n => bail!("negative length {n}"),
        }
    }
    let key = optional(r)?;
    let payload = optional(r)?;
    let mut count = [0; 2];
    r.read_exact(&mut count)?;
    let mut headers = Vec::with_capacity(usize::from(u16::from_be_bytes(count)));
    for _ in 0..u16::from_be_bytes(count) {
        let mut n = [0; 2];
        r.read_exact(&mut n)?;
        let name = String::from_utf8(bytes(r, usize::from(u16::from_be_bytes(n)))?)?;
        let mut v = [0; 4];
        r.read_exact(&mut v)?;
        headers.push((name, bytes(r, u32::from_be_bytes(v) as usize)?));
    }
    Ok(Item { timestamp_ms, key, payload, headers })
}

fn republish(settings: &KafkaSettings, topic: &str, source: Source) -> anyhow::Result<u64> {
    let producer: ThreadedProducer<DefaultProducerContext> = settings
        .client_config_with(
            "gpumedic-replay",
            &[("acks", "all"), ("enable.idempotence", "true"), ("linger.ms", "20"), ("compression.type", "lz4")],
        )
        .create()
        .context("cannot create the producer")?;
    let count = source.for_each(|item| {
        let mut headers = OwnedHeaders::new();
        for (k, v) in &item.headers {
            headers = headers.insert(Header { key: k, value: Some(v) });
        }
        let mut record: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(topic).headers(headers);
        if let Some(k) = &item.key {
            record = record.key(k);
        }
        if let Some(p) = &item.payload {
            record = record.payload(p);
        }
        let mut record = record;
        loop {
            match producer.send(record) {
                Ok(()) => return Ok(()),
                Err((e, back)) if e.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::QueueFull) => {
                    producer.poll(Duration::from_millis(50));
                    record = back;
                }
                Err((e, _)) => return Err(anyhow::anyhow!("producing to {topic}: {e}")),
            }
        }
    })?;
    producer.flush(Duration::from_secs(60)).context("waiting for Kafka to acknowledge every record")?;
    Ok(count)
}

/// What a backtest found.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Enriched events run through the rules.
    pub events: u64,
    /// Records that did not decode as enriched events (skipped; the classifier dead-letters them).
    pub undecodable: u64,
    /// Wall time of the run, seconds.
    pub seconds: f64,
    /// Events per second.
    pub events_per_second: f64,
    /// Where the rules came from.
    pub rules: String,
    /// How many rules.
    pub rule_count: usize,
    /// Event-time span compared, RFC 3339.
    pub window: Option<(String, String)>,
    /// Verdicts the backtest gave within the window.
    pub backtest_verdicts: usize,
    /// Recorded verdicts within the window (absent with `--no-compare`).
    pub recorded_verdicts: Option<usize>,
    /// Same decision on both sides.
    pub same: usize,
    /// Every difference.
    pub differences: Vec<Difference>,
    /// What the backtest's decisions did to nodes and GPUs (and, with `--expect`, how that
    /// compares with the expected outcomes).
    pub quality: Summary,
    /// Every expectation the decisions broke (with `--expect`).
    pub misses: Vec<String>,
}

/// One verdict that differs.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Difference {
    /// `changed`, `only_recorded` or `only_backtest`.
    pub change: &'static str,
    /// Node.
    pub node: String,
    /// GPU, when the verdict names one.
    pub gpu: Option<String>,
    /// Rule id.
    pub rule: String,
    /// Issued (event) time, RFC 3339.
    pub issued_at: String,
    /// Recovery or not.
    pub recovery: bool,
    /// `severity/action` recorded.
    pub recorded: Option<String>,
    /// `severity/action` from the backtest.
    pub backtest: Option<String>,
}

/// Verdicts are matched by what they are about and when: node, GPU, rule (any version), recovery,
/// and the event time that decided them. A rule change that moves a decision in time therefore
/// shows as one `only_recorded` and one `only_backtest`.
type Key = (String, Option<String>, String, bool, i64);

fn key(v: &Verdict) -> Key {
    let gpu = v.entity.gpu_uuid.clone().or_else(|| v.entity.pci_bus_id.clone());
    (v.node.clone(), gpu, v.rule_id.clone(), v.recovery, v.issued_at.timestamp_micros())
}

/// `severity/action` in snake case, e.g. `critical/reboot_node`.
fn outcome(v: &Verdict) -> String {
    format!("{}/{}", snake(&v.severity), snake(&v.action))
}

fn snake(x: &dyn std::fmt::Debug) -> String {
    let mut out = String::new();
    for (i, c) in format!("{x:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

fn load_rules(args: &BacktestArgs) -> anyhow::Result<(RuleSet, String)> {
    let (rules, origin) = match &args.rules_dir {
        None => (rules::defaults::rule_set(), "built-in default rules".to_owned()),
        Some(dir) => (rules::check_dir(dir), dir.display().to_string()),
    };
    let rules = rules.map_err(|errors| {
        let list: Vec<String> = errors.iter().map(ToString::to_string).collect();
        anyhow::anyhow!("the rules do not load:\n{}", list.join("\n"))
    })?;
    let rules = if args.allow_synthetic { rules.with_synthetic(SyntheticPolicy::Allowed) } else { rules };
    Ok((rules, origin))
}

fn backtest(args: &BacktestArgs) -> anyhow::Result<Report> {
    let (rules, origin) = load_rules(args)?;
    let rule_count = rules.rules.len();
    let source = args.input.source()?;
    let progress = Progress::new();
    let started = Instant::now();

    let expectations = args.expect.as_deref().map(read_expectations).transpose()?;
    let mut engine = Engine::new(rules);
    let mut decisions: Vec<Decision> = Vec::new();
    let (mut first, mut last) = (i64::MAX, i64::MIN);
    let mut undecodable = 0u64;
    let mut events = 0u64;
    source.for_each(|item| {
        progress.tick(events);
        let Some(event) = item.payload.as_deref().and_then(|p| gpumedic_schemas::decode::<EnrichedHealthEvent>(p).ok())
        else {
            undecodable += 1;
            return Ok(());
        };
        events += 1;
        let o = observe::observation(&event);
        let t = o.observed_at_micros;
        first = first.min(t);
        last = last.max(t);
        decisions.extend(engine.observe(&o));
        Ok(())
    })?;
    // No tick between events: partitions are read unevenly, and a tick at one node's time would
    // move every other node's clock past events still to come. Each observation first settles its
    // own node's due deadlines, and a deadline's decision carries the deadline's own time, so one
    // tick at the end gives what the live classifier's wall-clock ticker gave.
    if last != i64::MIN {
        decisions.extend(engine.tick(last));
    }
    let verdicts: Vec<Verdict> = decisions.iter().map(observe::verdict).collect();
    let seconds = started.elapsed().as_secs_f64();
    progress.finish();

    let in_window = |v: &Verdict| {
        let t = v.issued_at.timestamp_micros();
        t >= first && t <= last
    };
    let ours: BTreeMap<Key, Verdict> = verdicts.into_iter().filter(in_window).map(|v| (key(&v), v)).collect();
    let window = (first <= last).then(|| (micros_rfc3339(first), micros_rfc3339(last)));
    let expectations = expectations.map(|e| e.resolve(first)).transpose()?;
    let timeline = Timeline::of(quality::Options::default(), &decisions);
    let (quality, misses) = timeline.evaluate(expectations.as_ref(), (first <= last).then_some(last));

    let (recorded_verdicts, same, differences) = if args.no_compare || first > last {
        let diffs = ours.values().map(|v| difference("only_backtest", v, None, Some(v))).collect();
        (None, 0, diffs)
    } else {
        let recorded = recorded_verdicts(args, first, last)?;
        let (same, diffs) = compare(&recorded, &ours);
        (Some(recorded.len()), same, diffs)
    };
    Ok(Report {
        events,
        undecodable,
        seconds,
        events_per_second: if seconds > 0.0 { events as f64 / seconds } else { 0.0 },
        rules: origin,
        rule_count,
        window,
        backtest_verdicts: ours.len(),
        recorded_verdicts,
        same,
        differences,
        quality,
        misses: misses.iter().map(Miss::to_string).collect(),
    })
}

/// The expectations part of a decision-quality scenario file.
#[derive(Debug, Deserialize)]
struct ExpectFile {
    /// Per node: an [`Expect`], plus `gpus: {gpu: Expect}`.
    #[serde(default)]
    expect: BTreeMap<String, serde_yaml::Value>,
    #[serde(default)]
    checkpoints: Vec<ExpectCheckpoint>,
    #[serde(default)]
    oscillations: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExpectCheckpoint {
    at: String,
    node: String,
    #[serde(default)]
    gpu: Option<serde_yaml::Value>,
    in_service: bool,
}

/// A GPU as an expectations file names it: its UUID, or an index in the corpus's naming
/// (`GPU-<node>-<index>`).
fn gpu_name(node: &str, v: &serde_yaml::Value) -> anyhow::Result<String> {
    match v {
        serde_yaml::Value::String(s) => Ok(s.clone()),
        serde_yaml::Value::Number(n) if n.is_u64() => Ok(format!("GPU-{node}-{n}")),
        other => bail!("{other:?} is not a GPU name or index"),
    }
}

fn read_expectations(path: &Path) -> anyhow::Result<ExpectFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("{} is not an expectations file", path.display()))
}

impl ExpectFile {
    /// Expectations with checkpoint times resolved (offsets count from `first`, the first event).
    fn resolve(self, first: i64) -> anyhow::Result<Expectations> {
        let mut out = Expectations { oscillations: self.oscillations, ..Default::default() };
        for (node, mut value) in self.expect {
            let gpus = value.as_mapping_mut().and_then(|m| m.remove("gpus"));
            let e: Expect = serde_yaml::from_value(value).with_context(|| format!("expect.{node}"))?;
            out.targets.push((Target::node(&node), e));
            let Some(serde_yaml::Value::Mapping(gpus)) = gpus else { continue };
            for (gpu, value) in gpus {
                let gpu = gpu_name(&node, &gpu).with_context(|| format!("expect.{node}.gpus"))?;
                let e: Expect = serde_yaml::from_value(value).with_context(|| format!("expect.{node}.gpus.{gpu}"))?;
                out.targets.push((Target::gpu(&node, gpu), e));
            }
        }
        for c in self.checkpoints {
            let at = match DateTime::parse_from_rfc3339(&c.at) {
                Ok(t) => t.timestamp_micros(),
                Err(_) => {
                    let offset =
                        rules::parse_duration(&c.at).map_err(|e| anyhow::anyhow!("checkpoint at {}: {e}", c.at))?;
                    first.saturating_add(offset.micros())
                }
            };
            let target = match &c.gpu {
                Some(g) => Target::gpu(&c.node, gpu_name(&c.node, g)?),
                None => Target::node(&c.node),
            };
            out.checkpoints.push(Checkpoint { at_micros: at, target, in_service: c.in_service, label: c.at });
        }
        Ok(out)
    }
}

/// Recorded verdicts whose issued time falls in `[first, last]` (microseconds).
fn recorded_verdicts(args: &BacktestArgs, first: i64, last: i64) -> anyhow::Result<BTreeMap<Key, Verdict>> {
    let settings = args.input.settings()?.context("--kafka-bootstrap is required to compare with recorded verdicts")?;
    // Verdicts are published after the events that decide them: read from the window's start to
    // the topic's end, and keep those about the window.
    let source = Source::Topic {
        settings,
        topic: args.verdicts_topic.clone(),
        range: TimeRange { from_ms: Some(first / 1000), to_ms: None },
    };
    let mut recorded = BTreeMap::new();
    source.for_each(|item| {
        if let Some(v) = item.payload.as_deref().and_then(|p| gpumedic_schemas::decode::<Verdict>(p).ok()) {
            let t = v.issued_at.timestamp_micros();
            if t >= first && t <= last {
                recorded.insert(key(&v), v);
            }
        }
        Ok(())
    })?;
    Ok(recorded)
}

/// Same count and every difference, in key order.
pub fn compare(recorded: &BTreeMap<Key, Verdict>, ours: &BTreeMap<Key, Verdict>) -> (usize, Vec<Difference>) {
    let mut same = 0;
    let mut diffs = Vec::new();
    for (k, r) in recorded {
        match ours.get(k) {
            Some(o) if outcome(o) == outcome(r) => same += 1,
            Some(o) => diffs.push(difference("changed", r, Some(r), Some(o))),
            None => diffs.push(difference("only_recorded", r, Some(r), None)),
        }
    }
    for (k, o) in ours {
        if !recorded.contains_key(k) {
            diffs.push(difference("only_backtest", o, None, Some(o)));
        }
    }
    (same, diffs)
}

fn difference(change: &'static str, v: &Verdict, recorded: Option<&Verdict>, ours: Option<&Verdict>) -> Difference {
    let (node, gpu, rule, recovery, issued) = key(v);
    Difference {
        change,
        node,
        gpu,
        rule,
        issued_at: micros_rfc3339(issued),
        recovery,
        recorded: recorded.map(outcome),
        backtest: ours.map(outcome),
    }
}

fn micros_rfc3339(micros: i64) -> String {
    DateTime::<Utc>::from_timestamp_micros(micros)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

impl Report {
    /// The human-readable report.
    pub fn table(&self, limit: usize) -> String {
        let mut s = format!(
            "Backtested {} events ({} undecodable skipped) with {} ({} rules) in {:.2} s: {:.0} events/s.\n",
            self.events, self.undecodable, self.rules, self.rule_count, self.seconds, self.events_per_second
        );
        if let Some((from, to)) = &self.window {
            s.push_str(&format!("Event-time window: {from} .. {to}\n"));
        }
        match self.recorded_verdicts {
            Some(recorded) => {
                let count = |c: &str| self.differences.iter().filter(|d| d.change == c).count();
                s.push_str(&format!(
                    "Verdicts: {recorded} recorded, {} from the backtest; {} same, {} changed, {} only recorded, {} only in the backtest.\n",
                    self.backtest_verdicts,
                    self.same,
                    count("changed"),
                    count("only_recorded"),
                    count("only_backtest")
                ));
            }
            None => s.push_str(&format!("Verdicts from the backtest: {} (not compared).\n", self.backtest_verdicts)),
        }
        if self.differences.is_empty() {
            if self.recorded_verdicts.is_some() {
                s.push_str("No differences.\n");
            }
            s.push_str(&self.quality_text());
            return s;
        }
        let rows: Vec<Vec<String>> = self
            .differences
            .iter()
            .take(limit)
            .map(|d| {
                vec![
                    d.change.to_owned(),
                    d.issued_at.clone(),
                    d.node.clone(),
                    d.gpu.clone().unwrap_or_else(|| "-".into()),
                    format!("{}{}", d.rule, if d.recovery { " (recovery)" } else { "" }),
                    d.recorded.clone().unwrap_or_else(|| "-".into()),
                    d.backtest.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        let header = ["CHANGE", "ISSUED", "NODE", "GPU", "RULE", "RECORDED", "BACKTEST"];
        s.push_str(&crate::incidents::table(&header, &rows));
        if self.differences.len() > limit {
            s.push_str(&format!(
                "... and {} more (--limit, or --output json for all)\n",
                self.differences.len() - limit
            ));
        }
        s.push_str(&self.quality_text());
        s
    }

    /// The decision-quality summary and every miss.
    fn quality_text(&self) -> String {
        let mut s = format!("\n{}", self.quality);
        for m in &self.misses {
            s.push_str(&format!("  - {m}\n"));
        }
        s
    }
}

/// A progress line on stderr when it is a terminal.
struct Progress {
    enabled: bool,
    started: Instant,
    last: std::cell::Cell<Instant>,
}

impl Progress {
    fn new() -> Self {
        let now = Instant::now();
        Progress { enabled: std::io::stderr().is_terminal(), started: now, last: std::cell::Cell::new(now) }
    }

    fn tick(&self, done: u64) {
        if !self.enabled || !done.is_multiple_of(4096) || self.last.get().elapsed() < Duration::from_millis(250) {
            return;
        }
        self.last.set(Instant::now());
        let rate = done as f64 / self.started.elapsed().as_secs_f64().max(1e-3);
        eprint!("\r{done} events, {rate:.0}/s   ");
    }

    fn finish(&self) {
        if self.enabled {
            eprint!("\r{}\r", " ".repeat(40));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_as_rfc3339_or_age() {
        let now = DateTime::parse_from_rfc3339("2026-11-30T12:00:00Z").unwrap().with_timezone(&Utc);
        assert_eq!(parse_time("2026-11-30T11:00:00Z", now).unwrap(), now.timestamp_millis() - 3_600_000);
        assert_eq!(parse_time("2h", now).unwrap(), now.timestamp_millis() - 7_200_000);
        assert!(parse_time("yesterday", now).is_err());
    }

    #[test]
    fn expectations_files_read_scenario_style_and_judge_decisions() {
        let text = r#"
description: ignored, as the rest of a scenario file
events: []
expect:
  node-a: {quarantined: true, released: false, action: reboot_node, gpus: {GPU-abc: {severity: none}, 3: {quarantined: true}}}
checkpoints:
  - {at: 20m, node: node-a, in_service: false}
  - {at: "2026-11-30T02:00:00Z", node: node-a, gpu: GPU-abc, in_service: true}
oscillations: 0
"#;
        let dir = std::env::temp_dir().join(format!("gpumedic-expect-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("expect.yaml");
        std::fs::write(&path, text).unwrap();
        let file = read_expectations(&path).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        let first = 1_000_000_000_000;
        let e = file.resolve(first).unwrap();
        let targets: Vec<String> = e.targets.iter().map(|(t, _)| t.to_string()).collect();
        assert_eq!(targets, ["node-a", "node-a/GPU-abc", "node-a/GPU-node-a-3"]);
        assert_eq!(e.checkpoints[0].at_micros, first + 20 * 60_000_000);
        assert_eq!(e.oscillations, Some(0));
        // No decision at all: the node was never quarantined, so the file's expectations miss.
        let (summary, misses) = Timeline::of(quality::Options::default(), &[]).evaluate(Some(&e), Some(first));
        assert_eq!((summary.missed_faults, summary.checkpoint_misses), (2, 1));
        assert!(misses.iter().any(|m| m.to_string() == "node-a: quarantined: expected true, got false"), "{misses:?}");
        assert!(summary.to_string().contains("missed faults"));
    }

    #[test]
    fn export_file_round_trips_and_detects_truncation() {
        let dir = std::env::temp_dir().join(format!("gpumedic-replay-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("export.bin");
        let items = vec![
            Item {
                timestamp_ms: 1,
                key: Some(b"node-a".to_vec()),
                payload: Some(vec![0, 0, 0, 0, 1, 7]),
                headers: vec![("traceparent".into(), b"00-abc".to_vec())],
            },
            Item { timestamp_ms: 5, key: None, payload: None, headers: vec![] },
            Item {
                timestamp_ms: 9,
                key: Some(vec![]),
                payload: Some(vec![1; 300]),
                headers: vec![("a".into(), vec![]), ("b".into(), vec![2])],
            },
        ];
        let mut w = FileWriter::create(&path).unwrap();
        for i in &items {
            w.write(i).unwrap();
        }
        w.finish().unwrap();

        let mut read = Vec::new();
        Source::File { path: path.clone(), range: TimeRange::default() }
            .for_each(|i| {
                read.push(i);
                Ok(())
            })
            .unwrap();
        assert_eq!(read, items);

        let mut ranged = Vec::new();
        Source::File { path: path.clone(), range: TimeRange { from_ms: Some(2), to_ms: Some(9) } }
            .for_each(|i| {
                ranged.push(i.timestamp_ms);
                Ok(())
            })
            .unwrap();
        assert_eq!(ranged, vec![5, 9]);

        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let err = Source::File { path: path.clone(), range: TimeRange::default() }.for_each(|_| Ok(())).unwrap_err();
        assert!(format!("{err:#}").contains("record 2 is truncated"), "{err:#}");

        std::fs::write(&path, b"not an export").unwrap();
        assert!(Source::File { path, range: TimeRange::default() }.for_each(|_| Ok(())).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
