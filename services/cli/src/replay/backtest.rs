//! `gpumedic replay backtest`: enriched events through a rule set with no side effects, its
//! verdicts compared with the recorded ones, and its decisions judged.

use std::collections::BTreeMap;
use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use gpumedic_classifier::observe;
use gpumedic_classifier::quality::{self, Miss, Summary, Timeline};
use gpumedic_classifier::rules::{self, Decision, Engine, RuleSet, SyntheticPolicy};
use gpumedic_schemas::{EnrichedHealthEvent, Verdict};
use serde::Serialize;

use super::args::BacktestArgs;
use super::expect::read_expectations;
use super::source::{Source, TimeRange};

/// What a backtest found.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Enriched events run through the rules.
    pub events: u64,
    /// Records that did not decode as enriched events (skipped; the classifier dead-letters them).
    pub undecodable: u64,
    /// Events whose id and time an earlier record of the run already carried (skipped, as the
    /// classifier skips an event Postgres already holds).
    pub duplicates: u64,
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

/// Runs a backtest as `args` ask.
pub(super) fn backtest(args: &BacktestArgs) -> anyhow::Result<Report> {
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
    // Every event's id and time, as a digest: the classifier looks each event up in Postgres and
    // never observes one twice, however far apart the copies are, so neither may the backtest.
    let mut seen: std::collections::HashSet<u64> = std::collections::HashSet::new();
    let mut duplicates = 0u64;
    source.for_each(|item| {
        progress.tick(events);
        let Some(event) = item.payload.as_deref().and_then(|p| gpumedic_schemas::decode::<EnrichedHealthEvent>(p).ok())
        else {
            undecodable += 1;
            return Ok(());
        };
        let key = {
            use std::hash::{Hash as _, Hasher as _};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (event.event.event_id, event.event.observed_at).hash(&mut h);
            h.finish()
        };
        if !seen.insert(key) {
            duplicates += 1;
            return Ok(());
        }
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
        duplicates,
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
            "Backtested {} events ({} undecodable and {} duplicates skipped) with {} ({} rules) in {:.2} s: {:.0} events/s.\n",
            self.events,
            self.undecodable,
            self.duplicates,
            self.rules,
            self.rule_count,
            self.seconds,
            self.events_per_second
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
