//! `gpumedic incidents`: incident history from the classifier's API, as a table for people or
//! JSON for scripts.
//!
//! The API wants a Kubernetes bearer token whose user may `list`/`get` `incidents.gpumedic.io`
//! (the ClusterRole `gpumedic-incident-reader`). The token is the first of `--token`,
//! `--token-file`, `GPUMEDIC_TOKEN` and the current kubeconfig user's token.

use clap::{Args, ValueEnum};
use secrecy::ExposeSecret as _;
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
    #[arg(long, conflicts_with = "lemons")]
    id: Option<String>,
    /// Show the nodes and GPUs declared lemons (too many hardware faults: held out until
    /// replaced), with the incidents that made each one; `--status open` for those still out.
    #[arg(long)]
    lemons: bool,
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
    /// The bearer token to send (seen by anyone who can list processes: prefer --token-file or
    /// GPUMEDIC_TOKEN).
    #[arg(long, conflicts_with = "token_file")]
    token: Option<String>,
    /// A file holding the bearer token to send (e.g. from `kubectl create token`).
    #[arg(long)]
    token_file: Option<std::path::PathBuf>,
}

/// Where the bearer token came from: named in messages, the token never is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenSource {
    /// `--token`.
    Flag,
    /// `--token-file`.
    File,
    /// `GPUMEDIC_TOKEN`.
    Environment,
    /// The current kubeconfig user's `token` or `tokenFile`.
    Kubeconfig,
}

impl std::fmt::Display for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TokenSource::Flag => "--token",
            TokenSource::File => "--token-file",
            TokenSource::Environment => "GPUMEDIC_TOKEN",
            TokenSource::Kubeconfig => "your kubeconfig",
        })
    }
}

/// The first non-blank token of `candidates`, in their order, trimmed.
pub fn first_token(candidates: Vec<(Option<String>, TokenSource)>) -> Option<(String, TokenSource)> {
    candidates.into_iter().find_map(|(t, source)| {
        let t = t?.trim().to_owned();
        (!t.is_empty()).then_some((t, source))
    })
}

/// The bearer token of the current context's user in the kubeconfig (`KUBECONFIG` or
/// `~/.kube/config`), if it has one. A kubeconfig that authenticates with a client certificate
/// or an exec plugin has none.
fn kubeconfig_token() -> Option<String> {
    let config = kube::config::Kubeconfig::read().ok()?;
    let context = config.current_context.as_deref()?;
    let user = config.contexts.iter().find(|c| c.name == context)?.context.as_ref()?.user.clone()?;
    let auth = config.auth_infos.iter().find(|a| a.name == user)?.auth_info.as_ref()?;
    match (&auth.token, &auth.token_file) {
        (Some(t), _) => Some(t.expose_secret().to_owned()),
        (None, Some(file)) => std::fs::read_to_string(file).ok(),
        (None, None) => None,
    }
}

/// The token to send, and where it came from; an unreadable `--token-file` is an error.
fn token(args: &IncidentsArgs) -> Result<Option<(String, TokenSource)>, String> {
    let file = match &args.token_file {
        Some(path) => {
            let t = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read --token-file {}: {e}", path.display()))?;
            if t.trim().is_empty() {
                return Err(format!("--token-file {} is empty", path.display()));
            }
            Some(t)
        }
        None => None,
    };
    let explicit = first_token(vec![
        (args.token.clone(), TokenSource::Flag),
        (file, TokenSource::File),
        (std::env::var("GPUMEDIC_TOKEN").ok(), TokenSource::Environment),
    ]);
    Ok(explicit.or_else(|| first_token(vec![(kubeconfig_token(), TokenSource::Kubeconfig)])))
}

/// What to tell the user when the API refuses who they are (401) or what they ask (403).
pub fn refusal(status: u16, reason: Option<&str>, sent: Option<TokenSource>) -> Option<String> {
    match (status, sent) {
        (401, None) => Some(
            "401 Unauthorized: the incident API needs a Kubernetes bearer token. Pass --token-file FILE \
             (e.g. from `kubectl create token`), --token or GPUMEDIC_TOKEN, or use a kubeconfig whose user has a token."
                .to_owned(),
        ),
        (401, Some(source)) => Some(format!(
            "401 Unauthorized: the classifier did not accept the token from {source} (unknown, expired, or from \
             another cluster)."
        )),
        (403, _) => Some(format!(
            "403 Forbidden: {}. An operator grants it by binding the ClusterRole gpumedic-incident-reader to you \
             (docs/deploy.md).",
            reason.unwrap_or("the token's user may not read incidents")
        )),
        _ => None,
    }
}

/// Runs the command; the error is printed by the caller.
pub async fn run(args: IncidentsArgs) -> Result<(), String> {
    let base = args.api.trim_end_matches('/');
    let client =
        reqwest::Client::builder().timeout(std::time::Duration::from_secs(30)).build().map_err(|e| e.to_string())?;
    let request = match &args.id {
        Some(id) => client.get(format!("{base}/api/v1/incidents/{id}")),
        None if args.lemons => {
            let q: Vec<(&str, String)> = args.status.iter().map(|s| ("status", s.clone())).collect();
            client.get(format!("{base}/api/v1/lemons")).query(&q)
        }
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
    let token = token(&args)?;
    let request = match &token {
        Some((t, _)) => request.bearer_auth(t),
        None => request,
    };
    let response = request.send().await.map_err(|e| format!("cannot reach the classifier at {base}: {e}"))?;
    let status = response.status();
    let body: Result<Value, _> = response.json().await;
    if let Some(message) = refusal(
        status.as_u16(),
        body.as_ref().ok().and_then(|b| b["error"].as_str()),
        token.as_ref().map(|(_, source)| *source),
    ) {
        return Err(message);
    }
    let body = body.map_err(|e| format!("the classifier answered {status} without JSON: {e}"))?;
    if !status.is_success() {
        return Err(format!("{status}: {}", body["error"].as_str().unwrap_or("no reason given")));
    }
    match (args.output, args.id.is_some()) {
        (Output::Json, _) => println!("{}", serde_json::to_string_pretty(&body).unwrap_or_default()),
        (Output::Table, false) if args.lemons => print!("{}", lemon_table(&body)),
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

/// The lemons: one row per lemon, then one indented line per incident of its history.
pub fn lemon_table(list: &Value) -> String {
    let mut rows = Vec::new();
    for l in list.as_array().into_iter().flatten() {
        let status =
            if l["resolved_at"].is_null() { "held out".to_owned() } else { format!("closed {}", s(&l["resolved_at"])) };
        rows.push(vec![
            s(&l["part"]),
            s(&l["node"]),
            s(&l["gpu"]),
            s(&l["hardware_incidents"]),
            s(&l["declared_at"]),
            status,
            s(&l["incident_id"]),
        ]);
        for h in l["history"].as_array().into_iter().flatten() {
            rows.push(vec![
                String::new(),
                format!("  {}", s(&h["node"])),
                s(&h["gpu_uuid"]),
                s(&h["rule_id"]),
                s(&h["opened_at"]),
                if h["resolved_at"].is_null() { "open".into() } else { format!("resolved {}", s(&h["resolved_at"])) },
                s(&h["incident_id"]),
            ]);
        }
    }
    table(&["PART", "NODE", "GPU", "FAULTS", "DECLARED", "STATUS", "INCIDENT"], &rows)
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
        let reason = match v["trace_id"].as_str() {
            Some(t) => format!("{} (trace {t})", s(&v["reason"])),
            None => s(&v["reason"]),
        };
        rows.push(vec![s(&v["issued_at"]), "verdict".into(), what, reason]);
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

    #[test]
    fn lemons_list_their_history_under_them() {
        let list = serde_json::json!([{
            "incident_id": "l1", "part": "gpu", "node": "n1", "gpu": "GPU-a", "hardware_incidents": 3,
            "declared_at": "t3", "resolved_at": null, "reason": "...",
            "history": [
                { "incident_id": "i1", "node": "n1", "gpu_uuid": "GPU-a", "rule_id": "ecc-double-bit", "opened_at": "t1", "resolved_at": "t1b" },
                { "incident_id": "i3", "node": "n1", "gpu_uuid": "GPU-a", "rule_id": "xid-48-alone", "opened_at": "t3", "resolved_at": null }
            ]
        }]);
        let t = lemon_table(&list);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(lines[1].starts_with("gpu") && lines[1].contains("held out") && lines[1].contains("3"), "{t}");
        assert!(lines[2].contains("ecc-double-bit") && lines[2].contains("resolved t1b"), "{t}");
        assert!(lines[3].contains("xid-48-alone") && lines[3].contains("open"), "{t}");
    }

    #[test]
    fn the_first_non_blank_token_wins_in_order() {
        let pick = |flag: Option<&str>, file: Option<&str>, env: Option<&str>| {
            first_token(vec![
                (flag.map(str::to_owned), TokenSource::Flag),
                (file.map(str::to_owned), TokenSource::File),
                (env.map(str::to_owned), TokenSource::Environment),
            ])
        };
        assert_eq!(pick(Some("a"), Some("b"), Some("c")), Some(("a".into(), TokenSource::Flag)));
        assert_eq!(pick(None, Some("b\n"), Some("c")), Some(("b".into(), TokenSource::File)));
        assert_eq!(pick(Some(" "), None, Some("c")), Some(("c".into(), TokenSource::Environment)));
        assert_eq!(pick(None, None, None), None);
    }

    #[test]
    fn refusals_say_what_to_do() {
        let none = refusal(401, None, None).unwrap();
        assert!(none.starts_with("401") && none.contains("--token-file"), "{none}");
        let bad = refusal(401, None, Some(TokenSource::Kubeconfig)).unwrap();
        assert!(bad.contains("your kubeconfig") && bad.contains("expired"), "{bad}");
        let denied =
            refusal(403, Some("user \"x\" cannot list resource \"incidents\""), Some(TokenSource::Flag)).unwrap();
        assert!(denied.contains("cannot list") && denied.contains("gpumedic-incident-reader"), "{denied}");
        assert_eq!(refusal(400, Some("status: bad"), None), None);
    }
}
