//! `gpumedic-classifier`: see the library for what it does.

fn main() -> std::process::ExitCode {
    let config = gpumedic_runtime::config::load_or_exit::<gpumedic_classifier::Args>("gpumedic-classifier");
    let common = config.common.clone();
    gpumedic_runtime::service::main("classifier", &common, || gpumedic_classifier::run(config))
}
