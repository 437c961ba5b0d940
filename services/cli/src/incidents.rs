//! `gpumedic incidents`: incident history from the classifier's API, as a table for people or
//! JSON for scripts.

use clap::{Args, ValueEnum};
use serde_json::Value;

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned columns.
    Table,
    /// The API's JSON, unchanged.
    Json,
}

/// Flags of `gpumedic incidents`.
#[derive(Debug, Args)]
pub struct IncidentsArgs {
    /// The classifier's admin address (its API is served there).
    #[arg(long, env = "GPUMEDIC_API", default_value = "http://127.0.0.1:9403")]
    api: String,
    /// Show one incident, with its verdicts, evidence and actions.
    #[arg(long)]
    id: Option<String>,
    /// Only this node.
    #[arg(long)]
    node: Option<String>,
    /// Only `open` or `resolved` incidents.
    #[arg(long)]
    status: Option<String>,
    /// Only this severity: info, warning, critical.
    #[arg(long)]
    severity: Option<String>,
    /// Only incidents opened at or after this RFC 3339 time.
    #[arg(long)]
    since: Option<String>,
    /// At most this many, newest first.
    #[arg(long, default_value_t = 50)]
    limit: u32,
    /// `table` for people, `json` for scripts.
    #[arg(long, value_enum, default_value = "table")]
    output: Output,
}

/// Runs the command; the error is printed by the caller.
pub async fn run(args: IncidentsArgs) -> Result<(), String> {
    let base = args.api.trim_end_matches('/');
    let client =
        reqwest::Client::builder().timeout(std::time::Duration::from_secs(30)).build().map_err(|e| e.to_string())?;
    let request = match &args.id {
        Some(id) => client.get(format!("{base}/api/v1/incidents/{id}")),
        None => {
            let mut q: Vec<(&str, String)> = vec![("limit", args.limit.to_string())];
            for (k, v) in
                [("node", &args.node), ("status", &args.status), ("severity", &args.severity), ("since", &args.since)]
            {
                if let Some(v) = v {
                    q.push((k, v.clone()));
                }
            }
            client.get(format!("{base}/api/v1/incidents")).query(&q)
        }
    };
    let response = request.send().await.map_err(|e| format!("cannot reach the classifier at {base}: {e}"))?;
    let status = response.status();
    let body: Value =
        response.json().await.map_err(|e| format!("the classifier answered {status} without JSON: {e}"))?;
    if !status.is_success() {
        return Err(format!("{status}: {}", body["error"].as_str().unwrap_or("no reason given")));
    }
    match (args.output, args.id.is_some()) {
        (Output::Json, _) => println!("{}", serde_json::to_string_pretty(&body).unwrap_or_default()),
        (Output::Table, false) => print!("{}", incident_table(&body)),
        (Output::Table, true) => print!("{}", incident_story(&body)),
    }
    Ok(())
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Columns of the list: one row per incident.
pub fn incident_table(list: &Value) -> String {
    let rows: Vec<Vec<String>> = list
        .as_array()
        .map(|a| {
            a.iter()
                .map(|i| {
                    vec![
                        s(&i["incident_id"]),
                        s(&i["node"]),
                        s(&i["severity"]),
                        s(&i["rule_id"]),
                        s(&i["opened_at"]),
                        if i["resolved_at"].is_null() { "open".into() } else { s(&i["resolved_at"]) },
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    table(&["INCIDENT", "NODE", "SEVERITY", "RULE", "OPENED", "RESOLVED"], &rows)
}

/// One incident's story: the incident, then verdicts and actions in time order.
pub fn incident_story(d: &Value) -> String {
    let mut out = format!(
        "incident {}\n  node {}  gpu {}  rule {}  severity {}\n  opened {}  resolved {}\n  {}\n",
        s(&d["incident_id"]),
        s(&d["node"]),
        s(&d["gpu"]),
        s(&d["rule_id"]),
        s(&d["severity"]),
        s(&d["opened_at"]),
        s(&d["resolved_at"]),
        s(&d["summary"]),
    );
    let mut rows = Vec::new();
    for v in d["verdicts"].as_array().into_iter().flatten() {
        let what = if v["recovery"].as_bool() == Some(true) { "recovery".to_owned() } else { s(&v["action"]) };
        rows.push(vec![s(&v["issued_at"]), "verdict".into(), what, s(&v["reason"])]);
    }
    for a in d["actions"].as_array().into_iter().flatten() {
        rows.push(vec![
            s(&a["at"]),
            "action".into(),
            format!("{} {}", s(&a["action"]), s(&a["status"])),
            s(&a["detail"]),
        ]);
    }
    rows.sort();
    out.push_str(&table(&["TIME", "WHAT", "", "DETAIL"], &rows));
    out
}

/// Aligned columns, two spaces apart, trailing blanks trimmed: every table the CLI prints.
pub(crate) fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut l: String = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}  ", w = *w)).collect();
        l.truncate(l.trim_end().len());
        l.push('\n');
        l
    };
    let mut out = line(headers.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_show_open_incidents() {
        let list = serde_json::json!([
            { "incident_id": "a", "node": "gpu-node-1", "severity": "critical", "rule_id": "xid-79", "opened_at": "t1", "resolved_at": null },
            { "incident_id": "b", "node": "n2", "severity": "info", "rule_id": "xid-application", "opened_at": "t2", "resolved_at": "t3" }
        ]);
        let t = incident_table(&list);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[1].ends_with("open"), "{t}");
        assert_eq!(lines[0].find("NODE"), lines[1].find("gpu-node-1"), "{t}");
    }
}
