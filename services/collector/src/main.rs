//! `gpumedic-collector`: see the library for what it does.

fn main() -> std::process::ExitCode {
    let config = gpumedic_runtime::config::load_or_exit::<gpumedic_collector::Args>("gpumedic-collector");
    let common = config.common.clone();
    gpumedic_runtime::service::main("collector", &common, || gpumedic_collector::run(config))
}
