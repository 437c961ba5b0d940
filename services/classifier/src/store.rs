//! Postgres writes. The classifier is the only writer, and every write is idempotent (keyed by
//! event id, incident id, verdict id, and verdict+action+status), so a redelivered record or a
//! replayed tick changes nothing.

use chrono::{DateTime, Utc};
use gpumedic_schemas::{ActionOutcome, EnrichedHealthEvent, Verdict};
use sqlx::{PgPool, Postgres, Transaction};

use crate::rules::engine::{Decision, DecisionKind};

/// A failed write; the record is retried.
pub type StoreError = sqlx::Error;

/// Records an event and the decisions it caused in one transaction.
pub async fn record_event(
    pool: &PgPool,
    e: &EnrichedHealthEvent,
    decisions: &[(Decision, Verdict)],
) -> Result<(), StoreError> {
    let mut tx = pool.begin().await?;
    let ev = &e.event;
    let xid = match &ev.detail {
        gpumedic_schemas::Detail::Xid(x) => Some(x.code),
        _ => None,
    };
    let json = serde_json::to_value(e).map_err(|err| sqlx::Error::Encode(Box::new(err)))?;
    sqlx::query(
        "INSERT INTO health_events (event_id, node, observed_at, source, component, kind, gpu_uuid, pci_bus_id, xid,
                                    healthy, synthetic, record)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
         ON CONFLICT (event_id) DO NOTHING",
    )
    .bind(ev.event_id)
    .bind(&ev.node)
    .bind(ev.observed_at)
    .bind(json_name(&ev.source))
    .bind(json_name(&ev.component))
    .bind(json_name(&ev.kind))
    .bind(&ev.entity.gpu_uuid)
    .bind(&ev.entity.pci_bus_id)
    .bind(xid)
    .bind(ev.healthy)
    .bind(ev.synthetic)
    .bind(json)
    .execute(&mut *tx)
    .await?;
    write_decisions(&mut tx, decisions).await?;
    tx.commit().await
}

/// Records decisions made by a tick (no event of their own).
pub async fn record_decisions(pool: &PgPool, decisions: &[(Decision, Verdict)]) -> Result<(), StoreError> {
    let mut tx = pool.begin().await?;
    write_decisions(&mut tx, decisions).await?;
    tx.commit().await
}

async fn write_decisions(
    tx: &mut Transaction<'_, Postgres>,
    decisions: &[(Decision, Verdict)],
) -> Result<(), StoreError> {
    for (d, v) in decisions {
        let at = micros(d.decided_at_micros);
        let resolved_at = matches!(d.kind, DecisionKind::Recover).then_some(at);
        // Opening creates the incident; later steps raise its severity or resolve it.
        sqlx::query(
            "INSERT INTO incidents (incident_id, node, gpu_uuid, rule_id, severity, opened_at, resolved_at, summary)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (incident_id) DO UPDATE SET
               severity = CASE WHEN $7::timestamptz IS NULL THEN EXCLUDED.severity ELSE incidents.severity END,
               resolved_at = COALESCE(EXCLUDED.resolved_at, incidents.resolved_at)",
        )
        .bind(d.incident_id)
        .bind(&d.node)
        .bind(&d.gpu)
        .bind(&d.rule_id)
        .bind(d.severity.as_str())
        .bind(at)
        .bind(resolved_at)
        .bind(&d.reason)
        .execute(&mut **tx)
        .await?;
        sqlx::query(
            "INSERT INTO verdicts (verdict_id, incident_id, node, gpu_uuid, severity, rule_id, rule_version, action,
                                   reason, recovery, evidence, issued_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
             ON CONFLICT (verdict_id) DO NOTHING",
        )
        .bind(v.verdict_id)
        .bind(v.incident_id)
        .bind(&v.node)
        .bind(&d.gpu)
        .bind(d.severity.as_str())
        .bind(&v.rule_id)
        .bind(v.rule_version)
        .bind(json_name(&v.action))
        .bind(&v.reason)
        .bind(v.recovery)
        .bind(&v.evidence)
        .bind(v.issued_at)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// Records what the remediator did about a verdict.
pub async fn record_action(pool: &PgPool, a: &ActionOutcome) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO actions (verdict_id, action, status, detail, at) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (verdict_id, action, status) DO NOTHING",
    )
    .bind(a.verdict_id)
    .bind(json_name(&a.action))
    .bind(json_name(&a.status))
    .bind(&a.detail)
    .bind(a.at)
    .execute(pool)
    .await
    .map(|_| ())
}

/// Recorded events observed since `since`, oldest first, to rebuild the engine's state at start.
pub async fn events_since(pool: &PgPool, since: DateTime<Utc>) -> Result<Vec<EnrichedHealthEvent>, StoreError> {
    let rows: Vec<serde_json::Value> =
        sqlx::query_scalar("SELECT record FROM health_events WHERE observed_at >= $1 ORDER BY observed_at, event_id")
            .bind(since)
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().filter_map(|v| serde_json::from_value(v).ok()).collect())
}

fn micros(m: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(m).unwrap_or_default()
}

fn json_name<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_value(v).ok().and_then(|j| j.as_str().map(str::to_owned)).unwrap_or_default()
}
