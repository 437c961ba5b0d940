//! `gpumedic`: the operator CLI.
//!
//! Subcommands grow with the pipeline: the pipeline's Kafka topics, kernel logs checked with the
//! collector's own parser, synthetic faults, incident history, rule checks, replay and backtest, the
//! demo, the remediator's control surface (circuit breaker status and reset, global pause and
//! resume), and the repair webhook's signature as a receiver checks it.

mod control;
mod demo;
mod hooks;
mod incidents;
mod inject;
mod replay;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpumedic_runtime::config::Validate as _;
use gpumedic_runtime::kafka::{KafkaArgs, TopicSpec};
use gpumedic_schemas::topics;

#[derive(Debug, Parser)]
#[command(
    name = "gpumedic",
    version,
    about = "Operate gpumedic: GPU health detection and node remediation for Kubernetes."
)]
struct Cli {
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
        command: RulesCommand,
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
        command: TopicsCommand,
    },
}

#[derive(Debug, Subcommand)]
enum RulesCommand {
    /// Validate rule files as the classifier loads them; lists every problem as file:line and
    /// exits 1 when there is any. With no FILE, checks the built-in default rule set.
    Check {
        /// Rule files (YAML) to check together, as one rule set.
        files: Vec<std::path::PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
enum TopicsCommand {
    /// Create every pipeline topic and its dead-letter topic; existing topics are left alone.
    Create {
        #[command(flatten)]
        kafka: KafkaArgs,
        /// Partitions per topic: the most replicas of a consuming service that can share work.
        #[arg(long, env = "GPUMEDIC_PARTITIONS", default_value_t = topics::DEFAULT_PARTITIONS)]
        partitions: i32,
        /// Replication factor. Unset: --topic-replication, else 3 or the number of brokers when
        /// there are fewer.
        #[arg(long, env = "GPUMEDIC_REPLICATION")]
        replication: Option<i32>,
    },
    /// Print the pipeline's topics in flow order.
    List,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::ParseLog { file } => parse_log(file.as_deref()),
        Command::Rules { command: RulesCommand::Check { files } } => {
            let result = if files.is_empty() {
                gpumedic_classifier::rules::defaults::rule_set()
            } else {
                gpumedic_classifier::rules::load::check_files(&files)
            };
            match result {
                Ok(set) => {
                    println!("ok: {} rules", set.rules.len());
                    ExitCode::SUCCESS
                }
                Err(errors) => {
                    for e in &errors {
                        eprintln!("{e}");
                    }
                    eprintln!("{} problem{}", errors.len(), if errors.len() == 1 { "" } else { "s" });
                    ExitCode::FAILURE
                }
            }
        }
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
        Command::Topics { command: TopicsCommand::List } => {
            for t in topics::ALL {
                println!("{t}");
            }
            ExitCode::SUCCESS
        }
        Command::Topics { command: TopicsCommand::Create { kafka, partitions, replication } } => {
            let settings = match kafka.validate() {
                Ok(s) => s,
                Err(problems) => {
                    eprint!("{}", gpumedic_runtime::config::render_problems("gpumedic topics create", &problems));
                    return ExitCode::from(gpumedic_runtime::config::EXIT_CONFIG);
                }
            };
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
            let replication = match replication.map_or_else(|| runtime.block_on(settings.default_replication()), Ok) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("gpumedic: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let specs: Vec<TopicSpec> = topics::ALL
                .iter()
                .flat_map(|t| [TopicSpec::new(*t, partitions), TopicSpec::dead_letter_for(t, partitions)])
                .map(|s| s.with_replication(replication))
                .collect();
            match runtime.block_on(settings.ensure_topics(&specs)) {
                Ok(()) => {
                    for s in &specs {
                        println!("{} (partitions {}, replication {replication})", s.name, s.partitions);
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("gpumedic: {e}");
                    ExitCode::FAILURE
                }
            }
        }
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

/// `gpumedic parse-log`: streams lines through the collector's kernel-log parser.
fn parse_log(file: Option<&std::path::Path>) -> ExitCode {
    use std::io::{BufRead as _, Write as _};

    let input: Box<dyn std::io::BufRead> = match file {
        Some(path) => match std::fs::File::open(path) {
            Ok(f) => Box::new(std::io::BufReader::new(f)),
            Err(e) => {
                eprintln!("gpumedic parse-log: cannot read {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        },
        None => Box::new(std::io::stdin().lock()),
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut parser = gpumedic_collector::kernel_log::LogParser::new();
    let mut events = Vec::new();
    // Lines are read as bytes: a kernel log may hold invalid UTF-8, which must not stop the scan.
    let mut buf = Vec::new();
    let mut reader = input;
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) => break,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf);
                parser.feed(line.trim_end_matches(['\n', '\r']), &mut events);
                if let Err(e) = write_events(&mut out, &mut events) {
                    eprintln!("gpumedic parse-log: cannot write: {e}");
                    return ExitCode::FAILURE;
                }
            }
            Err(e) => {
                eprintln!("gpumedic parse-log: read failed: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    parser.flush(&mut events);
    match write_events(&mut out, &mut events).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpumedic parse-log: cannot write: {e}");
            ExitCode::FAILURE
        }
    }
}

fn write_events(
    out: &mut impl std::io::Write,
    events: &mut Vec<gpumedic_collector::kernel_log::KernelEvent>,
) -> std::io::Result<()> {
    for event in events.drain(..) {
        serde_json::to_writer(&mut *out, &event)?;
        out.write_all(b"\n")?;
    }
    Ok(())
}
