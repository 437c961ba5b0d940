//! `gpumedic`: the operator CLI; see the library for what it does.

fn main() -> std::process::ExitCode {
    let cli = <gpumedic::Cli as clap::Parser>::parse();
    gpumedic::run(cli)
}
