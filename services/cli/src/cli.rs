//! The command line: every subcommand ([`Cli`]) and which room carries it out.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::{control, demo, hooks, incidents, inject, parse_log, replay, rules, topics};

/// The command line of `gpumedic`.
#[derive(Debug, Parser)]
#[command(
    name = "gpumedic",
    version,
    about = "Operate gpumedic: GPU health detection and node remediation for Kubernetes."
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the whole pipeline on this machine with a simulated GPU fleet: bring the testbed up,
    /// start the four services, make one GPU fall off the bus, and narrate detection,
    /// classification, cordon, drain, the incident in Postgres, and the recovery once a reboot
    /// proves the repair.
    Demo(demo::DemoArgs),
    /// Print one JSON object per GPU health event found in a kernel log (FILE, or stdin), using
    /// the collector's parser: Xid, SXid, fallen off the bus, MCE, PCIe AER. Other lines print
    /// nothing.
    ParseLog {
        /// The log to read (dmesg output, /var/log/kern.log, journalctl -k, a copy of /dev/kmsg).
        file: Option<std::path::PathBuf>,
    },
    /// Publish a synthetic health event on the raw topic (marked synthetic): a fault (`--xid 79`,
    /// `--gpu-lost`) or healthy evidence (`--healthy`), straight to Kafka or through a collector
    /// (`--collector`); or, through a collector with simulated GPUs, make a GPU fall off the bus
    /// (`--fall-off-bus --gpu N`) or the node reboot (`--reboot`). Prints each event id (and the
    /// new boot id of a reboot).
    Inject(inject::InjectArgs),
    /// Incident history from the classifier's API: a list with filters, or one incident's story
    /// with `--id`.
    Incidents(incidents::IncidentsArgs),
    /// Replay a topic over a time range (or an exported file): export it, re-publish it, or
    /// backtest a rule set against it.
    Replay {
        #[command(subcommand)]
        command: replay::ReplayCommand,
    },
    /// Work with classifier rule files.
    Rules {
        #[command(subcommand)]
        command: rules::RulesCommand,
    },
    /// The remediator's circuit breaker: `status` shows it, `reset` closes it.
    Breaker {
        #[command(subcommand)]
        command: control::BreakerCommand,
    },
    /// Pause remediation globally: the leading remediator reports verdicts but changes nothing
    /// new (no quarantine, drain, recovery or deferred action) until `gpumedic resume`.
    Pause {
        #[command(flatten)]
        target: control::Target,
        #[command(flatten)]
        who: control::Who,
        /// Why, recorded in the status object for the next operator.
        #[arg(long, env = "GPUMEDIC_PAUSE_REASON")]
        reason: Option<String>,
    },
    /// Lift the global pause.
    Resume {
        #[command(flatten)]
        target: control::Target,
        #[command(flatten)]
        who: control::Who,
    },
    /// The repair webhook's signature as a receiver sees it: `verify` checks a dumped request
    /// (signature, key id, replay window), `sign` makes one for a receiver's tests.
    Hooks {
        #[command(subcommand)]
        command: hooks::HooksCommand,
    },
    /// Manage the pipeline's Kafka topics.
    Topics {
        #[command(subcommand)]
        command: topics::TopicsCommand,
    },
}

/// Runs the subcommand `cli` names; the exit status says how it went.
pub fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::ParseLog { file } => parse_log::run(file.as_deref()),
        Command::Rules { command } => rules::run(command),
        Command::Breaker { command } => block_on("breaker", control::breaker(command)),
        Command::Pause { target, who, reason } => block_on("pause", control::pause(true, target, who, reason)),
        Command::Resume { target, who } => block_on("resume", control::pause(false, target, who, None)),
        Command::Incidents(args) => {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
            match runtime.block_on(incidents::run(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("gpumedic incidents: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Inject(args) => {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
            match runtime.block_on(inject::run(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("gpumedic inject: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Demo(args) => {
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
            match runtime.block_on(demo::run(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("\ndemo failed: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Replay { command } => match replay::run(command) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("gpumedic replay: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Hooks { command } => hooks::run(command),
        Command::Topics { command } => topics::run(command),
    }
}

/// Runs one async subcommand to completion; its error is printed as `gpumedic <name>: ...`.
fn block_on(name: &str, work: impl std::future::Future<Output = Result<(), String>>) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    match runtime.block_on(work) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpumedic {name}: {e}");
            ExitCode::FAILURE
        }
    }
}
