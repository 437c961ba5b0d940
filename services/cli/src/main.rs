//! `gpumedic`: the operator CLI.
//!
//! Subcommands grow with the pipeline; today it manages the pipeline's Kafka topics.

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
    /// Manage the pipeline's Kafka topics.
    Topics {
        #[command(subcommand)]
        command: TopicsCommand,
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
        /// Replication factor (3 in production clusters).
        #[arg(long, env = "GPUMEDIC_REPLICATION", default_value_t = 1)]
        replication: i32,
    },
    /// Print the pipeline's topics in flow order.
    List,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
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
            let specs: Vec<TopicSpec> = topics::ALL
                .iter()
                .flat_map(|t| [TopicSpec::new(*t, partitions), TopicSpec::dead_letter_for(t, partitions)])
                .map(|mut s| {
                    s.replication = replication;
                    s
                })
                .collect();
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
            match runtime.block_on(settings.ensure_topics(&specs)) {
                Ok(()) => {
                    for s in &specs {
                        println!("{} (partitions {}, replication {})", s.name, s.partitions, s.replication);
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
