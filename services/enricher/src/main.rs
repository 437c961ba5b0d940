//! `gpumedic-enricher`: see the library for what it does.

fn main() -> std::process::ExitCode {
    let config = gpumedic_runtime::config::load_or_exit::<gpumedic_enricher::Args>("gpumedic-enricher");
    let common = config.common.clone();
    gpumedic_runtime::service::main("enricher", &common, || gpumedic_enricher::run(config))
}
