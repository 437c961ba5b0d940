//! `gpumedic topics`: the pipeline's Kafka topics listed and created.

use std::process::ExitCode;

use clap::Subcommand;
use gpumedic_runtime::config::Validate as _;
use gpumedic_runtime::kafka::{KafkaArgs, TopicSpec};
use gpumedic_schemas::topics;

/// Subcommands of `gpumedic topics`.
#[derive(Debug, Subcommand)]
pub(crate) enum TopicsCommand {
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

/// Runs a `gpumedic topics` subcommand.
pub(crate) fn run(command: TopicsCommand) -> ExitCode {
    match command {
        TopicsCommand::List => {
            for t in topics::ALL {
                println!("{t}");
            }
            ExitCode::SUCCESS
        }
        TopicsCommand::Create { kafka, partitions, replication } => {
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
