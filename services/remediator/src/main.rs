//! `gpumedic-remediator`: see the library for what it does.

fn main() -> std::process::ExitCode {
    let config = gpumedic_runtime::config::load_or_exit::<gpumedic_remediator::Args>("gpumedic-remediator");
    let common = config.common.clone();
    gpumedic_runtime::service::main("remediator", &common, || gpumedic_remediator::run(config))
}
