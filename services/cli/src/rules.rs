//! `gpumedic rules`: rule files checked as the classifier loads them.

use std::process::ExitCode;

use clap::Subcommand;

/// Subcommands of `gpumedic rules`.
#[derive(Debug, Subcommand)]
pub(crate) enum RulesCommand {
    /// Validate rule files as the classifier loads them; lists every problem as file:line and
    /// exits 1 when there is any. With no FILE, checks the built-in default rule set.
    Check {
        /// Rule files (YAML) to check together, as one rule set.
        files: Vec<std::path::PathBuf>,
    },
}

/// Runs a `gpumedic rules` subcommand.
pub(crate) fn run(command: RulesCommand) -> ExitCode {
    let RulesCommand::Check { files } = command;
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
