//! `gpumedic-console`: see the library for what it does.

fn main() -> std::process::ExitCode {
    let config = gpumedic_runtime::config::load_or_exit::<gpumedic_console::Args>("gpumedic-console");
    let common = config.common.clone();
    gpumedic_runtime::service::main(gpumedic_console::NAME, &common, || gpumedic_console::run(config))
}
