//! Postgres writes. The classifier is the only writer, and every write is idempotent (keyed by
//! event id and time, incident id, verdict id, and verdict+action+status), so a redelivered batch
//! or a replayed tick changes nothing; telemetry rollups ([`crate::persist`]) are merged instead.
//!
//! A batch of records becomes one transaction: the events sent with binary `COPY` into a staging
//! table, then one statement with column arrays bound once and expanded with `UNNEST` into
//! multi-row inserts of events (from the staging table), incidents, verdicts and actions,
//! combined with data-modifying CTEs so they commit (or fail) together.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use gpumedic_schemas::{ActionOutcome, EnrichedHealthEvent, Verdict};
use sqlx::PgPool;
use uuid::Uuid;

use crate::rules::engine::{Absorbed, Decision, DecisionKind};

/// A failed write; the batch is retried.
pub type StoreError = sqlx::Error;

/// Health events as column arrays, ready to insert.
#[derive(Debug, Default, Clone)]
pub struct EventRows {
    ids: Vec<Uuid>,
    nodes: Vec<String>,
    observed_at: Vec<DateTime<Utc>>,
    sources: Vec<String>,
    components: Vec<String>,
    kinds: Vec<String>,
    gpu_uuids: Vec<Option<String>>,
    pci_bus_ids: Vec<Option<String>>,
    xids: Vec<Option<i32>>,
    healthy: Vec<bool>,
    synthetic: Vec<bool>,
    /// The whole record as JSON text, stored as `json` (see migration 0002).
    records: Vec<String>,
}

impl EventRows {
    /// Room for `n` events.
    pub fn with_capacity(n: usize) -> Self {
        EventRows {
            ids: Vec::with_capacity(n),
            nodes: Vec::with_capacity(n),
            observed_at: Vec::with_capacity(n),
            sources: Vec::with_capacity(n),
            components: Vec::with_capacity(n),
            kinds: Vec::with_capacity(n),
            gpu_uuids: Vec::with_capacity(n),
            pci_bus_ids: Vec::with_capacity(n),
            xids: Vec::with_capacity(n),
            healthy: Vec::with_capacity(n),
            synthetic: Vec::with_capacity(n),
            records: Vec::with_capacity(n),
        }
    }

    /// Adds one event (the whole record is kept as JSON, for rebuilds and the API).
    pub fn push(&mut self, e: &EnrichedHealthEvent) -> Result<(), serde_json::Error> {
        // Without its null fields: a third of the row, written and checked by Postgres for nothing
        // (`gpumedic_schemas::json`); a rebuild reads it back as the same event.
        let record = gpumedic_schemas::json::to_string_without_nulls(e)?;
        let ev = &e.event;
        self.ids.push(ev.event_id);
        self.nodes.push(ev.node.clone());
        self.observed_at.push(ev.observed_at);
        self.sources.push(json_name(&ev.source));
        self.components.push(json_name(&ev.component));
        self.kinds.push(json_name(&ev.kind));
        // The GPU as the enricher resolved it (one identity whichever source named it), else as
        // the event named it: a kernel-log line that named only a PCI bus id is found by UUID too.
        let canonical = e.gpu.as_ref();
        self.gpu_uuids.push(canonical.and_then(|g| g.uuid.clone()).or_else(|| ev.entity.gpu_uuid.clone()));
        self.pci_bus_ids.push(canonical.and_then(|g| g.pci_bus_id.clone()).or_else(|| ev.entity.pci_bus_id.clone()));
        self.xids.push(match &ev.detail {
            gpumedic_schemas::Detail::Xid(x) => Some(x.code),
            _ => None,
        });
        self.healthy.push(ev.healthy);
        self.synthetic.push(ev.synthetic);
        self.records.push(record);
        Ok(())
    }

    /// How many events.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// No events.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

impl EventRows {
    /// The events in PostgreSQL's binary `COPY` format, in `health_events`' column order from
    /// `event_id` to `record` ([`COPY_EVENT_COLUMNS`]).
    pub fn copy_binary(&self) -> Vec<u8> {
        let mut out = copy_header(self.records.iter().map(|r| r.len() + 220).sum::<usize>());
        for i in 0..self.ids.len() {
            out.extend_from_slice(&12i16.to_be_bytes());
            copy_field(&mut out, self.ids[i].as_bytes());
            copy_text(&mut out, Some(&self.nodes[i]));
            copy_time(&mut out, self.observed_at[i]);
            copy_text(&mut out, Some(&self.sources[i]));
            copy_text(&mut out, Some(&self.components[i]));
            copy_text(&mut out, Some(&self.kinds[i]));
            copy_text(&mut out, self.gpu_uuids[i].as_deref());
            copy_text(&mut out, self.pci_bus_ids[i].as_deref());
            match self.xids[i] {
                Some(x) => copy_field(&mut out, &x.to_be_bytes()),
                None => out.extend_from_slice(&(-1i32).to_be_bytes()),
            }
            copy_field(&mut out, &[u8::from(self.healthy[i])]);
            copy_field(&mut out, &[u8::from(self.synthetic[i])]);
            // `json`'s binary form is its text.
            copy_text(&mut out, Some(&self.records[i]));
        }
        out.extend_from_slice(&(-1i16).to_be_bytes());
        out
    }
}

impl crate::persist::RollupRows {
    /// The rollups in PostgreSQL's binary `COPY` format, in `telemetry_rollups`' column order
    /// ([`COPY_ROLLUP_COLUMNS`]).
    pub fn copy_binary(&self) -> Vec<u8> {
        let text_bytes: usize = self.readings.iter().chain(&self.counters).map(String::len).sum();
        let mut out = copy_header(text_bytes + self.nodes.len() * 160);
        for i in 0..self.nodes.len() {
            out.extend_from_slice(&9i16.to_be_bytes());
            copy_text(&mut out, Some(&self.nodes[i]));
            copy_text(&mut out, Some(&self.gpus[i]));
            copy_text(&mut out, Some(&self.kinds[i]));
            copy_time(&mut out, self.minutes[i]);
            copy_interval(&mut out, self.periods[i]);
            copy_field(&mut out, &self.events[i].to_be_bytes());
            copy_time(&mut out, self.last_at[i]);
            copy_jsonb(&mut out, &self.readings[i]);
            copy_jsonb(&mut out, &self.counters[i]);
        }
        out.extend_from_slice(&(-1i16).to_be_bytes());
        out
    }
}

/// The start of a binary `COPY` stream (signature, flags, no header extension), with room for
/// `body` more bytes.
fn copy_header(body: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(19 + body + 2);
    out.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
    out.extend_from_slice(&0i32.to_be_bytes());
    out.extend_from_slice(&0i32.to_be_bytes());
    out
}

/// One field of a binary `COPY` row: its length, then its bytes.
fn copy_field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as i32).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// A `text` (or `json`, whose binary form is its text) field; `None` is SQL NULL.
fn copy_text(out: &mut Vec<u8>, t: Option<&str>) {
    match t {
        Some(t) => copy_field(out, t.as_bytes()),
        None => out.extend_from_slice(&(-1i32).to_be_bytes()),
    }
}

/// A `timestamptz` field: microseconds since PostgreSQL's epoch (2000-01-01 UTC).
fn copy_time(out: &mut Vec<u8>, at: DateTime<Utc>) {
    const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;
    copy_field(out, &(at.timestamp_micros() - PG_EPOCH_MICROS).to_be_bytes());
}

/// An `interval` field of `micros` microseconds: its binary form is the microseconds, then days
/// and months (none).
fn copy_interval(out: &mut Vec<u8>, micros: i64) {
    out.extend_from_slice(&16i32.to_be_bytes());
    out.extend_from_slice(&micros.to_be_bytes());
    out.extend_from_slice(&[0; 8]);
}

/// A `jsonb` field: its binary form is a version byte (1) and the JSON text, which PostgreSQL
/// parses and checks as it would the text form.
fn copy_jsonb(out: &mut Vec<u8>, json: &str) {
    out.extend_from_slice(&(json.len() as i32 + 1).to_be_bytes());
    out.push(1);
    out.extend_from_slice(json.as_bytes());
}

/// The columns [`EventRows::copy_binary`] writes, in order.
pub const COPY_EVENT_COLUMNS: &str =
    "event_id, node, observed_at, source, component, kind, gpu_uuid, pci_bus_id, xid, healthy, synthetic, record";

/// The staging table of [`copy_events`] and [`write_batch`]: one per connection, emptied at
/// each commit. Postgres says NOTICE each time it already exists, which sqlx would log at INFO
/// for every batch: the transaction asks for warnings only.
const CREATE_STAGING: &str = "SET LOCAL client_min_messages = warning;
     CREATE TEMP TABLE IF NOT EXISTS health_events_staging
     (LIKE health_events INCLUDING DEFAULTS) ON COMMIT DELETE ROWS";

const COPY_TO_STAGING: &str = "COPY health_events_staging (event_id, node, observed_at, source, component, kind, \
     gpu_uuid, pci_bus_id, xid, healthy, synthetic, record) FROM STDIN (FORMAT binary)";

const STAGING_TO_EVENTS: &str = "INSERT INTO health_events (event_id, node, observed_at, source, component, kind, \
     gpu_uuid, pci_bus_id, xid, healthy, synthetic, record)
     SELECT event_id, node, observed_at, source, component, kind, gpu_uuid, pci_bus_id, xid, healthy, synthetic, record
       FROM health_events_staging
     ON CONFLICT (event_id, observed_at) DO NOTHING";

const COPY_TO_EVENTS: &str = "COPY health_events (event_id, node, observed_at, source, component, kind, gpu_uuid, \
     pci_bus_id, xid, healthy, synthetic, record) FROM STDIN (FORMAT binary)";

/// Writes `events` with binary `COPY` into a temporary staging table, then into `health_events`
/// with `INSERT ... SELECT ... ON CONFLICT DO NOTHING` (COPY itself cannot skip the rows a
/// redelivery already wrote), in one transaction; returns how many were new. The alternative to
/// [`write_batch`]'s `UNNEST` insert measured by the `event-writes` load scenario.
pub async fn copy_events(pool: &PgPool, events: &EventRows) -> Result<u64, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::raw_sql(CREATE_STAGING).execute(&mut *tx).await?;
    let mut copy = tx.copy_in_raw(COPY_TO_STAGING).await?;
    copy.send(events.copy_binary()).await?;
    copy.finish().await?;
    let new = sqlx::query(STAGING_TO_EVENTS).execute(&mut *tx).await?.rows_affected();
    tx.commit().await?;
    Ok(new)
}

/// Writes `events` with binary `COPY` straight into `health_events`: no conflict handling, so a
/// redelivered event fails the whole statement. Only for measuring the ceiling of COPY.
pub async fn copy_events_unchecked(pool: &PgPool, events: &EventRows) -> Result<u64, StoreError> {
    let mut conn = pool.acquire().await?;
    let mut copy = conn.copy_in_raw(COPY_TO_EVENTS).await?;
    copy.send(events.copy_binary()).await?;
    copy.finish().await
}

/// A published decision: the decision, its verdict, and the verdict record's trace id.
pub type Published = (Decision, Verdict, String);

/// Incidents and verdicts from decisions, as column arrays.
#[derive(Debug, Default, Clone)]
pub struct DecisionRows {
    // Incidents, one row per incident: decisions of one incident in a batch are folded, because
    // one statement may not upsert the same row twice.
    incident_ids: Vec<Uuid>,
    incident_nodes: Vec<String>,
    incident_gpus: Vec<Option<String>>,
    incident_rules: Vec<String>,
    /// Severity of a new row: that of the last non-recovery decision, else the first's.
    incident_severity: Vec<String>,
    /// Severity for an existing row: the last non-recovery decision's, or none to keep it.
    incident_new_severity: Vec<Option<String>>,
    incident_opened_at: Vec<DateTime<Utc>>,
    incident_resolved_at: Vec<Option<DateTime<Utc>>>,
    incident_summary: Vec<String>,
    /// The root GPU's NVLink domain, for incidents other nodes' sympathetic errors may join.
    incident_nvlink_domain: Vec<Option<String>>,
    /// One of the incident's decisions was hardware class (see [`crate::lemons`]): counted
    /// towards its node's and GPU's lemon history (see migration 0007).
    incident_hardware: Vec<bool>,
    // Verdicts, one row each.
    verdict_ids: Vec<Uuid>,
    verdict_incidents: Vec<Uuid>,
    verdict_nodes: Vec<String>,
    verdict_gpus: Vec<Option<String>>,
    verdict_severity: Vec<String>,
    verdict_rules: Vec<String>,
    verdict_rule_versions: Vec<i32>,
    verdict_actions: Vec<String>,
    verdict_reasons: Vec<String>,
    verdict_recovery: Vec<bool>,
    /// Evidence ids comma-joined (Postgres arrays of arrays must be rectangular).
    verdict_evidence: Vec<String>,
    verdict_issued_at: Vec<DateTime<Utc>>,
    /// The whole verdict as published, JSON text stored as `json` (see migration 0006).
    verdict_records: Vec<String>,
    /// The trace id of the verdict's record (its `traceparent`), for a link to the trace.
    verdict_trace_ids: Vec<Option<String>>,
}

impl DecisionRows {
    /// The rows for `decisions`, in the order they were made.
    pub fn new(decisions: &[Published]) -> Self {
        let mut rows = DecisionRows::default();
        let mut index: HashMap<Uuid, usize> = HashMap::new();
        for (d, v, trace_id) in decisions {
            let at = micros(d.decided_at_micros);
            let recovery = matches!(d.kind, DecisionKind::Recover);
            match index.get(&d.incident_id) {
                None => {
                    index.insert(d.incident_id, rows.incident_ids.len());
                    rows.incident_ids.push(d.incident_id);
                    rows.incident_nodes.push(d.node.clone());
                    rows.incident_gpus.push(d.gpu.clone());
                    rows.incident_rules.push(d.rule_id.clone());
                    rows.incident_severity.push(d.severity.as_str().to_owned());
                    rows.incident_new_severity.push((!recovery).then(|| d.severity.as_str().to_owned()));
                    rows.incident_opened_at.push(at);
                    rows.incident_resolved_at.push(recovery.then_some(at));
                    rows.incident_summary.push(d.reason.clone());
                    rows.incident_nvlink_domain.push(d.nvlink_domain.clone());
                    rows.incident_hardware.push(crate::lemons::hardware_class(d));
                }
                Some(&i) => {
                    rows.incident_hardware[i] |= crate::lemons::hardware_class(d);
                    if recovery {
                        rows.incident_resolved_at[i] = Some(at);
                    } else {
                        rows.incident_severity[i] = d.severity.as_str().to_owned();
                        rows.incident_new_severity[i] = Some(d.severity.as_str().to_owned());
                    }
                }
            }
            rows.verdict_ids.push(v.verdict_id);
            rows.verdict_incidents.push(v.incident_id);
            rows.verdict_nodes.push(v.node.clone());
            rows.verdict_gpus.push(d.gpu.clone());
            rows.verdict_severity.push(d.severity.as_str().to_owned());
            rows.verdict_rules.push(v.rule_id.clone());
            rows.verdict_rule_versions.push(v.rule_version);
            rows.verdict_actions.push(json_name(&v.action));
            rows.verdict_reasons.push(v.reason.clone());
            rows.verdict_recovery.push(v.recovery);
            rows.verdict_evidence.push(v.evidence.iter().map(Uuid::to_string).collect::<Vec<_>>().join(","));
            rows.verdict_issued_at.push(v.issued_at);
            // A verdict is plain data: serialising it cannot fail; an empty record would only make
            // the resync skip this verdict, never act on a wrong one.
            rows.verdict_records.push(serde_json::to_string(v).unwrap_or_default());
            rows.verdict_trace_ids.push((!trace_id.is_empty()).then(|| trace_id.clone()));
        }
        rows
    }

    /// No decisions.
    pub fn is_empty(&self) -> bool {
        self.verdict_ids.is_empty()
    }
}

/// Sympathetic events absorbed into root incidents ([`Absorbed`]), as column arrays.
#[derive(Debug, Default, Clone)]
pub struct SympatheticRows {
    event_ids: Vec<Uuid>,
    incident_ids: Vec<Uuid>,
    nodes: Vec<String>,
    gpus: Vec<Option<String>>,
    at: Vec<DateTime<Utc>>,
    root_rules: Vec<String>,
    root_nodes: Vec<String>,
    root_gpus: Vec<Option<String>>,
    root_opened_at: Vec<DateTime<Utc>>,
}

impl SympatheticRows {
    /// Adds one absorbed event. An event id that is not a UUID (never one from the pipeline)
    /// cannot be recorded and is skipped.
    pub fn push(&mut self, a: &Absorbed) {
        let Ok(event_id) = a.event_id.parse::<Uuid>() else { return };
        self.event_ids.push(event_id);
        self.incident_ids.push(a.incident_id);
        self.nodes.push(a.node.clone());
        self.gpus.push(a.gpu.clone());
        self.at.push(micros(a.at_micros));
        self.root_rules.push(a.root_rule.clone());
        self.root_nodes.push(a.root_node.clone());
        self.root_gpus.push(a.root_gpu.clone());
        self.root_opened_at.push(micros(a.root_opened_at_micros));
    }

    /// No rows.
    pub fn is_empty(&self) -> bool {
        self.event_ids.is_empty()
    }
}

/// Action outcomes as column arrays.
#[derive(Debug, Default, Clone)]
pub struct ActionRows {
    verdict_ids: Vec<Uuid>,
    actions: Vec<String>,
    statuses: Vec<String>,
    details: Vec<String>,
    at: Vec<DateTime<Utc>>,
}

impl ActionRows {
    /// Adds one outcome.
    pub fn push(&mut self, a: &ActionOutcome) {
        self.verdict_ids.push(a.verdict_id);
        self.actions.push(json_name(&a.action));
        self.statuses.push(json_name(&a.status));
        self.details.push(a.detail.clone());
        self.at.push(a.at);
    }

    /// No outcomes.
    pub fn is_empty(&self) -> bool {
        self.verdict_ids.is_empty()
    }
}

/// One batch to write.
#[derive(Debug, Default, Clone)]
pub struct Batch {
    /// The events.
    pub events: EventRows,
    /// The incidents and verdicts.
    pub decisions: DecisionRows,
    /// The remediator's action outcomes.
    pub actions: ActionRows,
    /// Sympathetic events recorded as evidence on root incidents.
    pub sympathetic: SympatheticRows,
    /// Per-minute rollups of healthy telemetry not recorded event by event ([`crate::persist`]).
    pub rollups: crate::persist::RollupRows,
}

impl Batch {
    /// Nothing to write.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
            && self.decisions.is_empty()
            && self.actions.is_empty()
            && self.sympathetic.is_empty()
            && self.rollups.is_empty()
    }

    /// `parts` empty batches with room for `events` events between them, for [`write_parts`].
    pub fn parts(parts: usize, events: usize) -> Vec<Batch> {
        let parts = parts.max(1);
        (0..parts)
            .map(|_| Batch { events: EventRows::with_capacity(events / parts + 1), ..Default::default() })
            .collect()
    }
}

/// A batch of at most this many records is written as one statement whatever
/// `--write-parallelism` says: the parts run on several backends at once, which pays for large
/// batches (one core of the database per statement), while each part is a commit of its own, and
/// below a few thousand rows the commit's WAL flush costs more than the rows. On a fault's path
/// (the batches of a few records each at a fleet's steady rate) that is one flush instead of two.
pub const ONE_STATEMENT_UP_TO: usize = 1000;

/// Which of `parts` concurrent writes the rows about `node` go to. A node's events, incidents and
/// verdicts are always in the same part, so one statement still writes each node's rows in
/// order and folds each incident's updates (FNV-1a: stable across builds and restarts).
pub fn part_of(node: &str, parts: usize) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h % parts.max(1) as u64) as usize
}

/// Writes the parts of one batch at once, each in its own statement on its own connection, so
/// several Postgres backends share the work. Succeeds when every part is durable; when one fails
/// the whole batch is written again, and the parts already written change nothing the second
/// time (every insert skips rows it already has, and an incident's update is idempotent).
pub async fn write_parts(pool: &PgPool, parts: &[Batch]) -> Result<Written, StoreError> {
    let writes = parts.iter().filter(|b| !b.is_empty()).map(|b| write_batch(pool, b));
    let written = futures::future::try_join_all(writes).await?;
    Ok(Written { new_events: written.iter().map(|w| w.new_events).sum() })
}

/// What a batch write changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Written {
    /// Events that were new (the rest were already recorded: a redelivery).
    pub new_events: i64,
}

/// How a rollup row merges into one already written for its node, GPU, kind and minute (a late
/// event's, another replica's, or the same one written again after a retry): events and counter
/// growth add up, the least minimum and greatest maximum stay, and the later row's last values win.
macro_rules! rollup_merge {
    () => {
        "ON CONFLICT (node, gpu_uuid, kind, minute) DO UPDATE
       SET events = t.events + EXCLUDED.events,
           period = greatest(t.period, EXCLUDED.period),
           last_at = greatest(t.last_at, EXCLUDED.last_at),
           readings = merge_rollup_readings(t.readings, EXCLUDED.readings, EXCLUDED.last_at >= t.last_at),
           counters = merge_rollup_counters(t.counters, EXCLUDED.counters)"
    };
}

/// The columns [`crate::persist::RollupRows::copy_binary`] writes, in order.
pub const COPY_ROLLUP_COLUMNS: &str = "node, gpu_uuid, kind, minute, period, events, last_at, readings, counters";

/// The rollups' staging table, as [`CREATE_STAGING`] is the events'.
const CREATE_ROLLUP_STAGING: &str = "SET LOCAL client_min_messages = warning;
     CREATE TEMP TABLE IF NOT EXISTS telemetry_rollups_staging
     (LIKE telemetry_rollups INCLUDING DEFAULTS) ON COMMIT DELETE ROWS";

const COPY_TO_ROLLUP_STAGING: &str = "COPY telemetry_rollups_staging (node, gpu_uuid, kind, minute, period, events, \
     last_at, readings, counters) FROM STDIN (FORMAT binary)";

const STAGING_TO_ROLLUPS: &str = concat!(
    "INSERT INTO telemetry_rollups AS t (node, gpu_uuid, kind, minute, period, events, last_at, readings, counters)
     SELECT node, gpu_uuid, kind, minute, period, events, last_at, readings, counters FROM telemetry_rollups_staging
     ",
    rollup_merge!()
);

/// Writes closed rollups with binary `COPY` into a temporary staging table, then into
/// `telemetry_rollups` with `INSERT ... SELECT ... ON CONFLICT DO UPDATE`, merging each into a row
/// already written for its key, in one transaction. What the rollup writer ([`crate::rollups`])
/// sends; [`write_batch`] writes the same rows bound as arrays, merged the same way. A key may
/// appear once in `rows` (one statement cannot update a row twice): the keeper hands each closed
/// rollup over once.
pub async fn copy_rollups(pool: &PgPool, rows: &crate::persist::RollupRows) -> Result<u64, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::raw_sql(CREATE_ROLLUP_STAGING).execute(&mut *tx).await?;
    let mut copy = tx.copy_in_raw(COPY_TO_ROLLUP_STAGING).await?;
    copy.send(rows.copy_binary()).await?;
    copy.finish().await?;
    let written = sqlx::query(STAGING_TO_ROLLUPS).execute(&mut *tx).await?.rows_affected();
    tx.commit().await?;
    Ok(written)
}

// Every part is an INSERT ... SELECT FROM UNNEST(arrays): one statement, one round trip, one
// implicit transaction. The foreign key from verdicts to incidents is checked at the end of the
// statement, after the incidents CTE has inserted. Incidents are inserted when new and updated
// when they exist: the UPDATE sees only rows from before the statement, so it never touches a row
// the INSERT just made (which already has the folded values).
const WRITE_BATCH: &str = concat!(
    "
WITH ev AS (
    INSERT INTO health_events (event_id, node, observed_at, source, component, kind, gpu_uuid, pci_bus_id, xid,
                               healthy, synthetic, record)
    SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::timestamptz[], $4::text[], $5::text[], $6::text[], $7::text[],
                         $8::text[], $9::int4[], $10::bool[], $11::bool[], $12::text[]::json[])
    ON CONFLICT (event_id, observed_at) DO NOTHING
    RETURNING 1
), inc_rows AS (
    SELECT * FROM UNNEST($13::uuid[], $14::text[], $15::text[], $16::text[], $17::text[], $18::text[],
                         $19::timestamptz[], $20::timestamptz[], $21::text[], $39::text[], $50::bool[])
        AS t(incident_id, node, gpu_uuid, rule_id, severity, new_severity, opened_at, resolved_at, summary,
             nvlink_domain, hardware)
), inc_new AS (
    INSERT INTO incidents (incident_id, node, gpu_uuid, rule_id, severity, opened_at, resolved_at, summary,
                           nvlink_domain, hardware)
    SELECT incident_id, node, gpu_uuid, rule_id, severity, opened_at, resolved_at, summary, nvlink_domain, hardware
      FROM inc_rows
    ON CONFLICT (incident_id) DO NOTHING
), inc_old AS (
    UPDATE incidents i
       SET severity = COALESCE(r.new_severity, i.severity),
           resolved_at = COALESCE(r.resolved_at, i.resolved_at),
           hardware = i.hardware OR r.hardware
      FROM inc_rows r
     WHERE i.incident_id = r.incident_id
), ver AS (
    INSERT INTO verdicts (verdict_id, incident_id, node, gpu_uuid, severity, rule_id, rule_version, action, reason,
                          recovery, evidence, issued_at, record, trace_id)
    SELECT verdict_id, incident_id, node, gpu_uuid, severity, rule_id, rule_version, action, reason, recovery,
           COALESCE(string_to_array(NULLIF(evidence, ''), ',')::uuid[], '{}'), issued_at, NULLIF(record, '')::json,
           trace_id
      FROM UNNEST($22::uuid[], $23::uuid[], $24::text[], $25::text[], $26::text[], $27::text[], $28::int4[],
                  $29::text[], $30::text[], $31::bool[], $32::text[], $33::timestamptz[], $49::text[], $59::text[])
        AS t(verdict_id, incident_id, node, gpu_uuid, severity, rule_id, rule_version, action, reason, recovery,
             evidence, issued_at, record, trace_id)
    ON CONFLICT (verdict_id) DO NOTHING
), act AS (
    INSERT INTO actions (verdict_id, action, status, detail, at)
    SELECT * FROM UNNEST($34::uuid[], $35::text[], $36::text[], $37::text[], $38::timestamptz[])
    ON CONFLICT (verdict_id, action, status) DO NOTHING
), sym AS (
    INSERT INTO sympathetic_evidence (event_id, incident_id, node, gpu_uuid, at, root_rule_id, root_node,
                                      root_gpu_uuid, root_opened_at)
    SELECT * FROM UNNEST($40::uuid[], $41::uuid[], $42::text[], $43::text[], $44::timestamptz[], $45::text[],
                         $46::text[], $47::text[], $48::timestamptz[])
    ON CONFLICT (event_id) DO NOTHING
), roll AS (
    INSERT INTO telemetry_rollups AS t (node, gpu_uuid, kind, minute, period, events, last_at, readings, counters)
    SELECT node, gpu_uuid, kind, minute, period * interval '1 microsecond', events, last_at, readings::jsonb,
           counters::jsonb
      FROM UNNEST($51::text[], $52::text[], $53::text[], $54::timestamptz[], $55::int4[], $56::timestamptz[],
                  $57::text[], $58::text[], $60::int8[])
        AS r(node, gpu_uuid, kind, minute, events, last_at, readings, counters, period)
    ",
    rollup_merge!(),
    "
)
SELECT count(*) FROM ev"
);

/// [`WRITE_BATCH`] with the events read from the staging table [`copy_events`] fills, not from
/// the arrays `$1` to `$12` (bound empty).
fn write_batch_staged() -> &'static str {
    static STAGED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    STAGED.get_or_init(|| {
        WRITE_BATCH.replacen(
            "    SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::timestamptz[], $4::text[], $5::text[], $6::text[], $7::text[],
                         $8::text[], $9::int4[], $10::bool[], $11::bool[], $12::text[]::json[])
    ON CONFLICT",
            "    SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::timestamptz[], $4::text[], $5::text[], $6::text[], $7::text[],
                         $8::text[], $9::int4[], $10::bool[], $11::bool[], $12::text[]::json[])
    UNION ALL
    SELECT event_id, node, observed_at, source, component, kind, gpu_uuid, pci_bus_id, xid, healthy, synthetic, record
      FROM health_events_staging
    ON CONFLICT",
            1,
        )
    })
}

/// Writes a batch, all or nothing: its events with binary `COPY` into a temporary staging table,
/// then everything in one statement (the events from the staging table), in one transaction.
/// `COPY` cannot skip the rows a redelivery already wrote, hence the staging table; the
/// `event-writes` load scenario measured this faster than binding the events as arrays
/// (docs/benchmarks.md). A batch without events is the one statement alone.
pub async fn write_batch(pool: &PgPool, b: &Batch) -> Result<Written, StoreError> {
    if b.events.is_empty() {
        return write_statement(pool, b, &b.events, WRITE_BATCH).await;
    }
    let mut tx = pool.begin().await?;
    sqlx::raw_sql(CREATE_STAGING).execute(&mut *tx).await?;
    let mut copy = tx.copy_in_raw(COPY_TO_STAGING).await?;
    copy.send(b.events.copy_binary()).await?;
    copy.finish().await?;
    // The events went by COPY: the statement binds none (the rest of the batch is borrowed, not
    // copied: cloning it cost as much CPU as encoding the events).
    let written = write_statement(&mut *tx, b, &EventRows::default(), write_batch_staged()).await?;
    tx.commit().await?;
    Ok(written)
}

/// Writes a batch in one statement, its events bound as arrays like the rest: how every batch was
/// written before [`write_batch`] sent the events with `COPY`; kept for the `event-writes` load
/// scenario, which measures the two.
pub async fn write_batch_arrays(pool: &PgPool, b: &Batch) -> Result<Written, StoreError> {
    write_statement(pool, b, &b.events, WRITE_BATCH).await
}

/// Writes `b` with `statement` ([`WRITE_BATCH`] or [`write_batch_staged`]) on `db`, with `events`
/// as its events (`b.events`, or none when they went by `COPY`).
async fn write_statement<'e, E, Q>(db: E, b: &Batch, events: &EventRows, statement: Q) -> Result<Written, StoreError>
where
    E: sqlx::PgExecutor<'e>,
    Q: sqlx::SqlSafeStr,
{
    let (e, d, a, s) = (events, &b.decisions, &b.actions, &b.sympathetic);
    let new_events: i64 = sqlx::query_scalar(statement)
        .bind(&e.ids)
        .bind(&e.nodes)
        .bind(&e.observed_at)
        .bind(&e.sources)
        .bind(&e.components)
        .bind(&e.kinds)
        .bind(&e.gpu_uuids)
        .bind(&e.pci_bus_ids)
        .bind(&e.xids)
        .bind(&e.healthy)
        .bind(&e.synthetic)
        .bind(&e.records)
        .bind(&d.incident_ids)
        .bind(&d.incident_nodes)
        .bind(&d.incident_gpus)
        .bind(&d.incident_rules)
        .bind(&d.incident_severity)
        .bind(&d.incident_new_severity)
        .bind(&d.incident_opened_at)
        .bind(&d.incident_resolved_at)
        .bind(&d.incident_summary)
        .bind(&d.verdict_ids)
        .bind(&d.verdict_incidents)
        .bind(&d.verdict_nodes)
        .bind(&d.verdict_gpus)
        .bind(&d.verdict_severity)
        .bind(&d.verdict_rules)
        .bind(&d.verdict_rule_versions)
        .bind(&d.verdict_actions)
        .bind(&d.verdict_reasons)
        .bind(&d.verdict_recovery)
        .bind(&d.verdict_evidence)
        .bind(&d.verdict_issued_at)
        .bind(&a.verdict_ids)
        .bind(&a.actions)
        .bind(&a.statuses)
        .bind(&a.details)
        .bind(&a.at)
        .bind(&d.incident_nvlink_domain)
        .bind(&s.event_ids)
        .bind(&s.incident_ids)
        .bind(&s.nodes)
        .bind(&s.gpus)
        .bind(&s.at)
        .bind(&s.root_rules)
        .bind(&s.root_nodes)
        .bind(&s.root_gpus)
        .bind(&s.root_opened_at)
        .bind(&d.verdict_records)
        .bind(&d.incident_hardware)
        .bind(&b.rollups.nodes)
        .bind(&b.rollups.gpus)
        .bind(&b.rollups.kinds)
        .bind(&b.rollups.minutes)
        .bind(&b.rollups.events)
        .bind(&b.rollups.last_at)
        .bind(&b.rollups.readings)
        .bind(&b.rollups.counters)
        .bind(&d.verdict_trace_ids)
        .bind(&b.rollups.periods)
        .fetch_one(db)
        .await?;
    Ok(Written { new_events })
}

/// Which of `events` (event id, observed_at) are already recorded in `health_events`.
///
/// An event is written only after the verdicts it led to were published (in the same transaction
/// as those verdicts), so an event found here has been classified before, however long ago: the
/// engine must not observe it again. The pairs are the table's primary key, and the batch's time
/// range is given as bounds of its own so Postgres prunes the daily partitions outside it; what
/// remains is one primary-key index probe per event.
///
/// The probe is a `LATERAL ... LIMIT 1` subquery per event, which the planner cannot turn into a
/// join of its choosing. Written as a plain join, a burst whose rows the statistics do not yet know
/// (the day's partition analysed before the burst) was planned as a nested loop with the table's
/// range scan outside, estimated at one row, and the 5,000 unnested pairs compared inside for
/// every row of the range: 3-12 s a call (`docs/benchmarks.md`, "the look-up stalls").
pub async fn recorded(
    pool: &PgPool,
    events: &[(Uuid, DateTime<Utc>)],
) -> Result<std::collections::HashSet<(Uuid, DateTime<Utc>)>, StoreError> {
    let (Some(from), Some(to)) = (events.iter().map(|e| e.1).min(), events.iter().map(|e| e.1).max()) else {
        return Ok(Default::default());
    };
    let (ids, times): (Vec<Uuid>, Vec<DateTime<Utc>>) = events.iter().copied().unzip();
    let found: Vec<(Uuid, DateTime<Utc>)> = sqlx::query_as(
        "SELECT b.event_id, b.observed_at
           FROM UNNEST($1::uuid[], $2::timestamptz[]) AS b(event_id, observed_at),
                LATERAL (SELECT 1 FROM health_events h
                          WHERE h.event_id = b.event_id AND h.observed_at = b.observed_at
                            AND h.observed_at >= $3 AND h.observed_at <= $4
                          LIMIT 1) found",
    )
    .bind(&ids)
    .bind(&times)
    .bind(from)
    .bind(to)
    .fetch_all(pool)
    .await?;
    Ok(found.into_iter().collect())
}

/// Records decisions made by a tick (no event of their own).
pub async fn record_decisions(pool: &PgPool, decisions: &[Published]) -> Result<(), StoreError> {
    let batch = Batch { decisions: DecisionRows::new(decisions), ..Default::default() };
    write_batch(pool, &batch).await.map(|_| ())
}

/// The nodes with events observed since `since`. One index probe per node (a loose index scan
/// over `(node, observed_at)`), not a pass over every event of the window: at a fleet's day of
/// history that pass takes longer than the statement timeout.
pub async fn nodes_since(pool: &PgPool, since: DateTime<Utc>) -> Result<Vec<String>, StoreError> {
    sqlx::query_scalar(
        "WITH RECURSIVE n AS (
             (SELECT node FROM health_events WHERE observed_at >= $1 ORDER BY node LIMIT 1)
             UNION ALL
             SELECT (SELECT h.node FROM health_events h
                      WHERE h.node > n.node AND h.observed_at >= $1 ORDER BY h.node LIMIT 1)
               FROM n WHERE n.node IS NOT NULL)
         SELECT node FROM n WHERE node IS NOT NULL",
    )
    .bind(since)
    .fetch_all(pool)
    .await
}

/// Rebuilds an engine with `rules` from the events of `nodes` observed since `since`, each node's
/// oldest first, streamed: memory holds the engine's state, not the rows. Returns it with the number of
/// events replayed. `keeper` takes in each replayed event ([`crate::persist::Keeper::recorded`]).
pub async fn rebuild(
    pool: &PgPool,
    rules: crate::rules::RuleSet,
    since: DateTime<Utc>,
    nodes: &[String],
    keeper: &mut crate::persist::Keeper,
) -> Result<(crate::rules::engine::Engine, u64), StoreError> {
    use futures::TryStreamExt as _;
    let mut engine = crate::rules::engine::Engine::new(rules);
    let mut replayed = 0u64;
    // A record this version cannot read (written by a later one) is skipped, counted and named.
    let (mut skipped, mut unreadable) = (0u64, None::<(String, String)>);
    // An event that joined a root incident on another node of its NVLink domain is handed that
    // root again, and only that one: the replay makes the decision that was made live, whatever
    // else the incident store knows now (a root recorded after the event opened its own incident).
    // One node at a time, oldest first: a node's state depends on its own events only (a domain
    // root comes with the event), and one query per node is an index range with a small sort,
    // where one query over the whole window sorts every event of the fleet (a day of a
    // 4,000-GPU fleet ran past the statement timeout).
    for node in nodes {
        let mut rows = sqlx::query_as::<_, RebuildRow>(
            "SELECT h.record::text, s.incident_id, s.root_rule_id, s.root_node, s.root_gpu_uuid, s.root_opened_at
               FROM health_events h
               LEFT JOIN sympathetic_evidence s ON s.event_id = h.event_id AND s.root_node <> h.node
              WHERE h.node = $2 AND h.observed_at >= $1
              ORDER BY h.observed_at, h.event_id",
        )
        .bind(since)
        .bind(node)
        .fetch(pool);
        while let Some((text, incident_id, rule_id, root_node, root_gpu, opened_at)) = rows.try_next().await? {
            let e = match serde_json::from_str::<EnrichedHealthEvent>(&text) {
                Ok(e) => e,
                Err(e) => {
                    unreadable.get_or_insert_with(|| (node.clone(), e.to_string()));
                    skipped += 1;
                    continue;
                }
            };
            let mut o = crate::observe::observation(&e);
            if let (Some(incident_id), Some(rule_id), Some(node), Some(opened_at), Some(domain)) =
                (incident_id, rule_id, root_node, opened_at, o.nvlink_domain.clone())
            {
                o.domain_roots.push(crate::rules::DomainRoot {
                    domain,
                    incident_id,
                    rule_id,
                    node,
                    gpu: root_gpu,
                    opened_at_micros: opened_at.timestamp_micros(),
                });
            }
            engine.observe(&o);
            keeper.recorded(&o);
            replayed += 1;
        }
    }
    if let Some((node, error)) = unreadable {
        tracing::warn!(
            events = skipped,
            first_node = %node,
            error = %error,
            "Recorded events this version cannot read were left out of the rebuild; the decisions they led to are in the incident history."
        );
    }
    // Refusals were counted when the events first arrived, and what was absorbed was recorded.
    engine.take_refused();
    engine.take_absorbed();
    Ok((engine, replayed))
}

/// Every incident the store holds open, with the action of its latest verdict and how many
/// verdicts it has had, for [`crate::rules::Engine::reattach`] after a rebuild. A row whose
/// severity or action this version cannot read is skipped with a warning.
pub async fn open_incidents(pool: &PgPool) -> Result<Vec<crate::rules::StoredIncident>, StoreError> {
    let rows: Vec<OpenIncidentRow> = sqlx::query_as(
        "SELECT i.incident_id, i.node, i.rule_id, i.gpu_uuid, i.severity, i.opened_at, v.action, v.n
               FROM incidents i
               CROSS JOIN LATERAL (
                   SELECT count(*) AS n, (array_agg(action ORDER BY issued_at DESC))[1] AS action
                     FROM verdicts WHERE verdicts.incident_id = i.incident_id) v
              WHERE i.resolved_at IS NULL",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(incident_id, node, rule_id, gpu, severity, opened_at, action, n)| {
            Some(crate::rules::StoredIncident {
                incident_id,
                node,
                rule_id,
                gpu,
                severity: parse("severity", &severity)?,
                action: parse("action", action.as_deref().unwrap_or("none"))?,
                opened_at_micros: opened_at.timestamp_micros(),
                verdicts: u32::try_from(n).unwrap_or(u32::MAX),
            })
        })
        .collect())
}

/// An open incident's row: id, node, rule, GPU, severity, opened at, latest action, verdicts.
type OpenIncidentRow = (Uuid, String, String, Option<String>, String, DateTime<Utc>, Option<String>, i64);

/// A severity or action as the store writes it (its serde name), or a warning and nothing.
fn parse<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> Option<T> {
    serde_json::from_value(serde_json::Value::String(text.to_owned())).ok().or_else(|| {
        tracing::warn!(
            value = text,
            field = what,
            "An open incident in the store has a value this version cannot read; it is not re-attached."
        );
        None
    })
}

/// A recorded event, with the root incident on another node it was absorbed into, if any.
type RebuildRow = (String, Option<Uuid>, Option<String>, Option<String>, Option<String>, Option<DateTime<Utc>>);

fn micros(m: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(m).unwrap_or_default()
}

fn json_name<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_value(v).ok().and_then(|j| j.as_str().map(str::to_owned)).unwrap_or_default()
}
