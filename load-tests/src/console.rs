//! `console`: how long the console takes to render its fleet page and the first page of its node
//! list with a large fleet (10,000 GPU Nodes in the apiserver) and a long history (1,000,000
//! incidents, a verdict each, an action for one in ten, in PostgreSQL), beside a plain `SELECT`
//! of the same rows the page reads from PostgreSQL, timed on the same database in the same run.
//!
//! The Nodes carry a label of the run and the console selects them by it; the history is written
//! with `generate_series` into a fresh database migrated by the classifier. 1% of the incidents
//! stay open; the opening times are 7 s apart, so the newest hour holds about 500 of them.
//! Everything created is deleted at the end (the database is dropped).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::{StreamExt as _, TryStreamExt as _};
use gpumedic_testkit as testkit;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

/// Options of the scenario.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// GPU Nodes created in the apiserver.
    #[arg(long, default_value_t = 10_000)]
    pub nodes: usize,
    /// Incidents written to PostgreSQL (a verdict each, an action for one in ten).
    #[arg(long, default_value_t = 1_000_000)]
    pub incidents: u64,
    /// Timed requests per page (after two untimed ones).
    #[arg(long, default_value_t = 20)]
    pub requests: usize,
}

/// Timings of one page, in milliseconds.
#[derive(Debug, serde::Serialize)]
pub struct Timing {
    /// What was timed.
    pub what: String,
    /// Median.
    pub p50_ms: f64,
    /// 95th percentile.
    pub p95_ms: f64,
    /// Slowest.
    pub max_ms: f64,
}

/// The scenario's result.
#[derive(Debug, serde::Serialize)]
pub struct Summary {
    scenario: &'static str,
    nodes: usize,
    incidents: u64,
    fill_seconds: f64,
    timings: Vec<Timing>,
}

fn timing(what: &str, mut samples: Vec<Duration>) -> Timing {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let at = |q: f64| ms(samples[((samples.len() as f64 - 1.0) * q).round() as usize]);
    Timing { what: what.to_owned(), p50_ms: at(0.5), p95_ms: at(0.95), max_ms: ms(samples[samples.len() - 1]) }
}

async fn time_http(addr: std::net::SocketAddr, path: &str, n: usize) -> anyhow::Result<Vec<Duration>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n + 2 {
        let t = Instant::now();
        let (code, body) = testkit::http_get(addr, path).await?;
        let took = t.elapsed();
        anyhow::ensure!(code == 200, "GET {path}: {code} {body}");
        if i >= 2 {
            out.push(took);
        }
    }
    Ok(out)
}

async fn time_sql(db: &sqlx::PgPool, statements: &[String], n: usize) -> anyhow::Result<Vec<Duration>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n + 2 {
        let t = Instant::now();
        for s in statements {
            sqlx::query(sqlx::AssertSqlSafe(s.clone())).fetch_all(db).await?;
        }
        if i >= 2 {
            out.push(t.elapsed());
        }
    }
    Ok(out)
}

/// Runs the scenario.
pub async fn run(o: Options) -> anyhow::Result<Summary> {
    let client = testkit::require_kubernetes().await?;
    let admin = testkit::require_postgres().await?;
    testkit::require_kafka().await?;
    let run = testkit::unique_name("console-load");
    let database_url = testkit::fresh_database(&admin, &run.replace('-', "_")).await?;
    let db =
        gpumedic_runtime::postgres::connect_with_settings(&database_url, 4, &[("statement_timeout", "30min")]).await?;
    gpumedic_runtime::postgres::migrate(&db, &gpumedic_classifier::MIGRATOR).await?;

    let names: Vec<String> = (0..o.nodes).map(|i| format!("{run}-{i:05}")).collect();
    let started = Instant::now();
    println!("console: writing {} incidents, their verdicts and actions", o.incidents);
    let nodes = i64::try_from(o.nodes)?;
    let incidents = i64::try_from(o.incidents)?;
    sqlx::query(
        "INSERT INTO incidents (incident_id, node, rule_id, severity, opened_at, resolved_at, summary)
         SELECT gen_random_uuid(), $1 || '-' || lpad((i % $2)::text, 5, '0'),
                (ARRAY['xid-79-fallen-off-the-bus','xid-48-double-bit-ecc','row-remap-failure','thermal-slowdown'])[1 + i % 4],
                (ARRAY['critical','warning','info'])[1 + i % 3],
                now() - i * interval '7 seconds',
                CASE WHEN i % 100 = 0 THEN NULL ELSE now() - i * interval '7 seconds' + interval '30 minutes' END,
                'load test incident'
           FROM generate_series(1, $3) i",
    )
    .bind(&run)
    .bind(nodes)
    .bind(incidents)
    .execute(&db)
    .await
    .context("writing incidents")?;
    sqlx::query(
        "INSERT INTO verdicts (verdict_id, incident_id, node, severity, rule_id, rule_version, action, reason, issued_at)
         SELECT gen_random_uuid(), incident_id, node, severity, rule_id, 1, 'cordon_and_drain', summary, opened_at
           FROM incidents",
    )
    .execute(&db)
    .await
    .context("writing verdicts")?;
    sqlx::query(
        "INSERT INTO actions (verdict_id, action, status, detail, at)
         SELECT verdict_id, 'cordon_and_drain', 'applied', 'load test', issued_at + interval '1 second'
           FROM verdicts TABLESAMPLE SYSTEM (10)",
    )
    .execute(&db)
    .await
    .context("writing actions")?;
    sqlx::query("ANALYZE").execute(&db).await?;
    println!("console: creating {} GPU Nodes", o.nodes);
    let api: Api<Node> = Api::all(client.clone());
    futures::stream::iter(names.iter().enumerate().map(|(i, name)| {
        let api = api.clone();
        let run = run.clone();
        async move {
            let mut labels = json!({
                "gpumedic.io/console-load": run,
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": if i % 2 == 0 { "NVIDIA-H100-80GB-HBM3" } else { "NVIDIA-A100-SXM4-80GB" },
                "nvidia.com/gpu.count": "8",
                "topology.kubernetes.io/zone": format!("zone-{}", i % 4),
            });
            let mut spec = json!({});
            if i % 100 == 0 {
                labels["gpumedic.io/state"] = json!("quarantined");
                spec = json!({ "unschedulable": true });
            }
            let node: Node =
                serde_json::from_value(json!({ "metadata": { "name": name, "labels": labels }, "spec": spec }))?;
            api.create(&PostParams::default(), &node).await.with_context(|| format!("create node {name}"))?;
            Ok::<_, anyhow::Error>(())
        }
    }))
    .buffer_unordered(32)
    .try_collect::<Vec<()>>()
    .await?;
    let fill_seconds = started.elapsed().as_secs_f64();

    let result = measure(&o, &run, &database_url, &db).await;
    println!("console: deleting the Nodes and the database");
    futures::stream::iter(names.iter().map(|name| {
        let api = api.clone();
        async move {
            let _ = api.delete(name, &DeleteParams::default()).await;
        }
    }))
    .buffer_unordered(32)
    .collect::<Vec<()>>()
    .await;
    db.close().await;
    let _ =
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", run.replace('-', "_"))))
            .execute(&admin)
            .await;
    let timings = result?;
    for t in &timings {
        println!(
            "console: {:<48} p50 {:>7.1} ms  p95 {:>7.1} ms  max {:>7.1} ms",
            t.what, t.p50_ms, t.p95_ms, t.max_ms
        );
    }
    Ok(Summary { scenario: "console", nodes: o.nodes, incidents: o.incidents, fill_seconds, timings })
}

async fn measure(o: &Options, run: &str, database_url: &str, db: &sqlx::PgPool) -> anyhow::Result<Vec<Timing>> {
    let env = [
        ("GPUMEDIC_KAFKA_BOOTSTRAP", testkit::kafka_bootstrap()),
        ("GPUMEDIC_DATABASE_URL", database_url.to_owned()),
        ("GPUMEDIC_GPU_NODE_SELECTOR", format!("gpumedic.io/console-load={run}")),
        ("GPUMEDIC_API_AUTH", "none".to_owned()),
        ("GPUMEDIC_LOG", "warn".to_owned()),
        ("KUBECONFIG", testkit::kubeconfig_path().display().to_string()),
    ];
    let mut console = testkit::ServiceProcess::start(&crate::release_binary("gpumedic-console")?, &[], &env)?;
    console.wait_ready(Duration::from_secs(300)).await.map_err(anyhow::Error::msg)?;
    let addr = console.admin_addr();
    let n = o.requests;
    let first_page: Vec<String> = {
        let (_, body) = testkit::http_get(addr, "/api/v1/nodes?limit=100").await?;
        let v: serde_json::Value = serde_json::from_str(&body)?;
        v["items"].as_array().context("items")?.iter().filter_map(|n| n["name"].as_str().map(str::to_owned)).collect()
    };
    anyhow::ensure!(first_page.len() == 100, "the node list's first page has {} nodes", first_page.len());
    let list = first_page.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(",");
    // The rows the pages read from PostgreSQL, as plain statements.
    let fleet_sql = vec![
        "SELECT severity, recovery, count(*) FROM verdicts WHERE issued_at > now() - interval '1 hour' GROUP BY 1, 2".to_owned(),
        "SELECT action || ':' || status, count(*) FROM actions WHERE at > now() - interval '1 hour' GROUP BY 1".to_owned(),
        "SELECT * FROM verdicts WHERE issued_at > now() - interval '1 hour' ORDER BY issued_at DESC LIMIT 20".to_owned(),
        "SELECT a.*, v.node FROM actions a JOIN verdicts v USING (verdict_id) WHERE a.at > now() - interval '1 hour' ORDER BY a.at DESC LIMIT 20".to_owned(),
    ];
    let nodes_sql = vec![
        format!("SELECT node, count(*) FROM incidents WHERE resolved_at IS NULL AND node IN ({list}) GROUP BY node"),
        "SELECT DISTINCT rule_id FROM incidents WHERE resolved_at IS NULL ORDER BY 1 LIMIT 200".to_owned(),
    ];
    let node = &first_page[0];
    let node_sql = vec![
        format!("SELECT * FROM incidents WHERE node = '{node}' ORDER BY opened_at DESC, incident_id DESC LIMIT 51"),
        format!(
            "SELECT a.* FROM actions a JOIN verdicts v USING (verdict_id) WHERE v.incident_id IN (SELECT incident_id FROM incidents WHERE node = '{node}') ORDER BY a.at DESC LIMIT 50"
        ),
    ];
    let timings = vec![
        timing("fleet page (GET /)", time_http(addr, "/", n).await?),
        timing("fleet API (GET /api/v1/fleet)", time_http(addr, "/api/v1/fleet", n).await?),
        timing("plain SELECT of the fleet page's rows", time_sql(db, &fleet_sql, n).await?),
        timing(&format!("node list page (GET /nodes, 100 of {})", o.nodes), time_http(addr, "/nodes", n).await?),
        timing("node list API (GET /api/v1/nodes)", time_http(addr, "/api/v1/nodes", n).await?),
        timing("plain SELECT of the node list's rows", time_sql(db, &nodes_sql, n).await?),
        timing("node page (GET /nodes/{name})", time_http(addr, &format!("/nodes/{node}"), n).await?),
        timing("plain SELECT of the node page's rows", time_sql(db, &node_sql, n).await?),
    ];
    let _ = console.terminate(Duration::from_secs(30)).await;
    Ok(timings)
}
