//! `gpumedic-classifier`: see the library for what it does.

/// Every event's decode, rules and write allocate and free many small values; mimalloc does that
/// for a fraction of glibc malloc's CPU (docs/profiles.md, "The allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let config = gpumedic_runtime::config::load_or_exit::<gpumedic_classifier::Args>("gpumedic-classifier");
    let common = config.common.clone();
    gpumedic_runtime::service::main("classifier", &common, || gpumedic_classifier::run(config))
}
