//! `gpumedic breaker status|reset` and `gpumedic pause|resume`: the remediator's control surface.
//!
//! They read and patch the remediator's status object (a ConfigMap in its namespace, see
//! `gpumedic_remediator::control`) with the user's kubeconfig, and read the leader-election Lease
//! to say which replica leads. A reset or a pause is a request the leading remediator carries out
//! within its `--control-poll`; `breaker status` shows whether it has.

use clap::{Args, Subcommand, ValueEnum};
use gpumedic_remediator::control::{self, Status, StatusClient};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use serde::Serialize;

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned fields for people.
    Table,
    /// One JSON object for scripts.
    Json,
}

/// Where the remediator keeps its state, and how to print it.
#[derive(Debug, Args)]
pub struct Target {
    /// The remediator's namespace (its Lease and status object live there).
    #[arg(long, short = 'n', env = "GPUMEDIC_NAMESPACE", default_value = "gpumedic")]
    namespace: String,
    /// The status object's name (the remediator's --status-configmap).
    #[arg(long, env = "GPUMEDIC_STATUS_CONFIGMAP", default_value = control::STATUS_CONFIGMAP)]
    status_configmap: String,
    /// The leader-election Lease's name (the remediator's --lease-name).
    #[arg(long, env = "GPUMEDIC_LEASE_NAME", default_value = "gpumedic-remediator")]
    lease_name: String,
    /// `table` for people, `json` for scripts.
    #[arg(long, short = 'o', value_enum, env = "GPUMEDIC_OUTPUT", default_value = "table")]
    output: Output,
}

/// Who asks, recorded in the status object.
#[derive(Debug, Args)]
pub struct Who {
    /// Your name, recorded with the request (default: $USER).
    #[arg(long, env = "GPUMEDIC_OPERATOR")]
    by: Option<String>,
}

impl Who {
    fn name(&self) -> String {
        self.by
            .clone()
            .or_else(|| std::env::var("USER").ok())
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(|| "unknown".to_owned())
    }
}

/// `gpumedic breaker ...`.
#[derive(Debug, Subcommand)]
pub enum BreakerCommand {
    /// Show the circuit breaker, the pause and the leading replica.
    Status {
        #[command(flatten)]
        target: Target,
    },
    /// Ask the leading remediator to close the circuit breaker and start a fresh quarantine
    /// budget. Find out why it tripped first (`gpumedic breaker status`).
    Reset {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        who: Who,
    },
}

/// Everything `breaker status` shows.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct View {
    namespace: String,
    leader: Option<String>,
    #[serde(flatten)]
    status: Status,
}

async fn view(client: &kube::Client, target: &Target) -> Result<View, String> {
    let status = StatusClient::new(client.clone(), &target.namespace, &target.status_configmap);
    let status = status.read().await.map_err(|e| e.to_string())?;
    let lease = Api::<Lease>::namespaced(client.clone(), &target.namespace)
        .get_opt(&target.lease_name)
        .await
        .map_err(|e| format!("cannot read lease {}/{}: {e}", target.namespace, target.lease_name))?;
    let leader = lease.and_then(|l| l.spec).and_then(|s| s.holder_identity).filter(|h| !h.is_empty());
    Ok(View { namespace: target.namespace.clone(), leader, status })
}

fn render(view: &View, output: Output) -> String {
    if output == Output::Json {
        return serde_json::to_string_pretty(view).unwrap_or_default() + "\n";
    }
    let s = &view.status;
    let or = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".to_owned());
    let mut rows: Vec<(&str, String)> = vec![
        ("NAMESPACE", view.namespace.clone()),
        ("LEADER", view.leader.clone().unwrap_or_else(|| "none".to_owned())),
        ("BREAKER", if s.breaker_open { "open".to_owned() } else { "closed".to_owned() }),
    ];
    if s.breaker_open || s.breaker_reason.is_some() {
        rows.push((if s.breaker_open { "TRIPPED" } else { "LAST TRIP" }, or(&s.breaker_tripped_at)));
        rows.push(("REASON", or(&s.breaker_reason)));
        rows.push(("COUNTED", s.quarantines_counted.map(|c| c.to_string()).unwrap_or_else(|| "-".to_owned())));
    }
    if s.reset_requested() {
        rows.push((
            "RESET",
            format!("requested by {} at {}, not carried out yet", or(&s.reset_requested_by), or(&s.reset_requested_at)),
        ));
    }
    if s.last_reset_at.is_some() {
        rows.push(("LAST RESET", format!("{} by {}", or(&s.last_reset_at), or(&s.last_reset_by))));
    }
    rows.push(("PAUSED", if s.paused { "yes".to_owned() } else { "no".to_owned() }));
    if s.paused_at.is_some() {
        let what = if s.paused { "paused" } else { "resumed" };
        let mut line = format!("{what} by {} at {}", or(&s.paused_by), or(&s.paused_at));
        if let Some(r) = &s.pause_reason {
            line.push_str(&format!(": {r}"));
        }
        rows.push(("PAUSE", line));
    }
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    rows.iter().map(|(k, v)| format!("{k:<width$}  {v}\n")).collect()
}

async fn client() -> Result<kube::Client, String> {
    kube::Client::try_default().await.map_err(|e| format!("cannot reach Kubernetes with your kubeconfig: {e}"))
}

/// Runs `gpumedic breaker ...`; the error is printed by the caller.
pub async fn breaker(command: BreakerCommand) -> Result<(), String> {
    let client = client().await?;
    match command {
        BreakerCommand::Status { target } => {
            print!("{}", render(&view(&client, &target).await?, target.output));
        }
        BreakerCommand::Reset { target, who } => {
            let status = StatusClient::new(client.clone(), &target.namespace, &target.status_configmap);
            status
                .patch(&control::reset_request_patch(&who.name(), &control::now()))
                .await
                .map_err(|e| e.to_string())?;
            if target.output == Output::Table {
                println!("Reset requested; the leading remediator closes the breaker within its --control-poll.");
            }
            print!("{}", render(&view(&client, &target).await?, target.output));
        }
    }
    Ok(())
}

/// Runs `gpumedic pause` (`paused`) or `gpumedic resume`.
pub async fn pause(paused: bool, target: Target, who: Who, reason: Option<String>) -> Result<(), String> {
    let client = client().await?;
    let status = StatusClient::new(client.clone(), &target.namespace, &target.status_configmap);
    status
        .patch(&control::pause_patch(paused, &who.name(), reason.as_deref(), &control::now()))
        .await
        .map_err(|e| e.to_string())?;
    if target.output == Output::Table {
        println!(
            "{}",
            if paused {
                "Paused: the leading remediator changes nothing new from its next --control-poll on."
            } else {
                "Resumed: the leading remediator acts on verdicts again from its next --control-poll on."
            }
        );
    }
    print!("{}", render(&view(&client, &target).await?, target.output));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_an_open_breaker_and_the_pause() {
        let view = View {
            namespace: "gpumedic".into(),
            leader: Some("remediator-0".into()),
            status: Status {
                breaker_open: true,
                breaker_reason: Some("4 of 10 GPU nodes".into()),
                breaker_tripped_at: Some("2026-01-01T00:00:00Z".into()),
                quarantines_counted: Some(3),
                paused: true,
                paused_by: Some("alice".into()),
                paused_at: Some("2026-01-01T00:05:00Z".into()),
                pause_reason: Some("driver rollout".into()),
                ..Status::default()
            },
        };
        let t = render(&view, Output::Table);
        assert!(t.contains("BREAKER    open"), "{t}");
        assert!(t.contains("REASON     4 of 10 GPU nodes"), "{t}");
        assert!(t.contains("paused by alice at 2026-01-01T00:05:00Z: driver rollout"), "{t}");
        let j: serde_json::Value = serde_json::from_str(&render(&view, Output::Json)).unwrap();
        assert_eq!(j["breakerOpen"], true);
        assert_eq!(j["leader"], "remediator-0");
        assert_eq!(j["paused"], true);
    }
}
