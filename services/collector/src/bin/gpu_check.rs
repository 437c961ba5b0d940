//! `gpumedic-gpu-check`: prints what NVML reports for each GPU of this machine, every field the
//! collector samples, so an operator can see on a GPU node what the collector will see. Without
//! an NVIDIA driver it says so and exits 1. With `--kernel-log FILE` (`-` for stdin) it runs a
//! kernel log (the machine's `dmesg`) through the collector's parser instead and prints what it
//! recognised, one JSON object a line, then a count. With `--dcgm-health FILE` it reads the JSON
//! of `dcgmi health -c -j` with the collector's parser and prints each incident; with
//! `--infiniband [ROOT]` it prints the InfiniBand/RoCE ports the collector reads under the sysfs
//! root (`/sys`). `load-tests/gpu-check` runs them all.

use std::process::ExitCode;

use gpumedic_collector::gpu::{GpuBackend as _, GpuSample, NvmlBackend, throttle};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!(
            "Usage: gpumedic-gpu-check [--json] | --kernel-log FILE|- | --dcgm-health FILE|- | --infiniband [ROOT]\nPrints what NVML reports for each GPU (exit 1 without a driver), what the collector's parser finds in a kernel log or in DCGM's health report, or the InfiniBand ports it reads."
        );
        return ExitCode::SUCCESS;
    }
    if let Some(at) = args.iter().position(|a| a == "--kernel-log") {
        return kernel_log(args.get(at + 1).map(String::as_str).unwrap_or("-"));
    }
    if let Some(at) = args.iter().position(|a| a == "--dcgm-health") {
        return dcgm_health(args.get(at + 1).map(String::as_str).unwrap_or("-"));
    }
    if let Some(at) = args.iter().position(|a| a == "--infiniband") {
        return infiniband(args.get(at + 1).map(String::as_str).unwrap_or("/sys"));
    }
    let mut backend = match NvmlBackend::init() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("gpumedic-gpu-check: {e}");
            eprintln!("gpumedic-gpu-check: is the NVIDIA driver installed and libnvidia-ml.so.1 on the library path?");
            return ExitCode::from(1);
        }
    };
    let samples = match backend.sample() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("gpumedic-gpu-check: {e}");
            return ExitCode::from(1);
        }
    };
    if json {
        let all: Vec<serde_json::Value> = samples.iter().map(to_json).collect();
        println!("{}", serde_json::to_string_pretty(&all).expect("JSON values always print"));
    } else {
        println!("{} GPU(s)", samples.len());
        for s in &samples {
            print_text(s);
        }
    }
    ExitCode::SUCCESS
}

/// Reads the JSON of `dcgmi health -c -j` with the collector's parser and prints each incident.
fn dcgm_health(path: &str) -> ExitCode {
    use std::io::Read as _;

    let mut text = String::new();
    let read = if path == "-" {
        std::io::stdin().read_to_string(&mut text).map(|_| ())
    } else {
        std::fs::read_to_string(path).map(|t| text = t)
    };
    if let Err(e) = read {
        eprintln!("gpumedic-gpu-check: cannot read {path}: {e}");
        return ExitCode::from(1);
    }
    match gpumedic_collector::dcgm::health::parse_health(&text) {
        Ok(report) => {
            println!("DCGM health: overall {}, {} incident(s)", report.overall, report.incidents.len());
            for i in &report.incidents {
                println!("  {} {} health:{} {:?}: {}", i.entity_group, i.entity_id, i.system, i.result, i.message);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpumedic-gpu-check: {e}");
            ExitCode::from(1)
        }
    }
}

/// Prints the InfiniBand/RoCE ports under `root` as the collector reads them.
fn infiniband(root: &str) -> ExitCode {
    match gpumedic_collector::network::read_fabric(std::path::Path::new(root)) {
        Ok(fabric) => {
            println!(
                "InfiniBand: {} HCA(s) [{}], {} port(s)",
                fabric.hcas.len(),
                fabric.hcas.join(", "),
                fabric.ports.len()
            );
            for p in &fabric.ports {
                let counters: Vec<String> = p.counters.iter().map(|(k, v)| format!("{k} {v}")).collect();
                println!(
                    "  {}/{} {} {}/{} ({}) {}",
                    p.hca,
                    p.port,
                    if p.is_up() { "up  " } else { "DOWN" },
                    p.state,
                    p.phys_state,
                    p.link_layer,
                    counters.join(", ")
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpumedic-gpu-check: {e}");
            ExitCode::from(1)
        }
    }
}

/// Runs a kernel log through the collector's parser: one JSON object per event, then a count.
fn kernel_log(path: &str) -> ExitCode {
    use std::io::BufRead as _;

    let input: Box<dyn std::io::BufRead> = if path == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        match std::fs::File::open(path) {
            Ok(f) => Box::new(std::io::BufReader::new(f)),
            Err(e) => {
                eprintln!("gpumedic-gpu-check: cannot read {path}: {e}");
                return ExitCode::from(1);
            }
        }
    };
    let mut parser = gpumedic_collector::kernel_log::LogParser::new();
    let (mut events, mut lines, mut found) = (Vec::new(), 0_u64, 0_u64);
    let mut print = |events: &mut Vec<gpumedic_collector::kernel_log::KernelEvent>| {
        for e in events.drain(..) {
            found += 1;
            println!("{}", serde_json::to_string(&e).expect("kernel events always serialise"));
        }
    };
    let mut reader = input;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) => break,
            Ok(_) => {
                lines += 1;
                parser.feed(String::from_utf8_lossy(&buf).trim_end_matches(['\n', '\r']), &mut events);
                print(&mut events);
            }
            Err(e) => {
                eprintln!("gpumedic-gpu-check: read failed: {e}");
                return ExitCode::from(1);
            }
        }
    }
    parser.flush(&mut events);
    print(&mut events);
    println!("kernel log: {lines} line(s) read, {found} GPU health event(s) recognised");
    ExitCode::SUCCESS
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "n/a".to_owned(), |v| v.to_string())
}

fn print_text(s: &GpuSample) {
    println!("\nGPU {} {} ({})", s.index, s.uuid, s.pci_bus_id);
    if s.lost {
        println!("  LOST: NVML reports GPU_IS_LOST (fallen off the bus)");
        return;
    }
    if let Some(e) = &s.error {
        println!("  UNREADABLE: {e}");
        return;
    }
    println!("  product          {} (serial {})", opt(s.product.as_deref()), opt(s.serial.as_deref()));
    println!(
        "  temperature      {} C (slowdown {} C, shutdown {} C)",
        opt(s.temperature_c),
        opt(s.slowdown_c),
        opt(s.shutdown_c)
    );
    println!("  power            {} W (limit {} W)", opt(s.power_w), opt(s.power_limit_w));
    println!("  ECC volatile     single-bit {}, double-bit {}", opt(s.ecc_sbe_volatile), opt(s.ecc_dbe_volatile));
    println!("  ECC aggregate    single-bit {}, double-bit {}", opt(s.ecc_sbe_aggregate), opt(s.ecc_dbe_aggregate));
    println!(
        "  retired pages    single-bit {}, double-bit {}, pending {}",
        opt(s.retired_pages_sbe),
        opt(s.retired_pages_dbe),
        opt(s.retired_pages_pending)
    );
    println!(
        "  row remapping    correctable {}, uncorrectable {}, pending {}, failure {}",
        opt(s.remapped_rows_correctable),
        opt(s.remapped_rows_uncorrectable),
        opt(s.remap_pending),
        opt(s.remap_failure)
    );
    match s.throttle_mask {
        Some(m) => println!("  clock events     {m:#x} [{}]", throttle::names(m).join(", ")),
        None => println!("  clock events     n/a"),
    }
    println!("  PCIe replays     {}", opt(s.pcie_replay));
    println!(
        "  PCIe link        gen {} of {}, x{} of x{}",
        opt(s.pcie_link_gen),
        opt(s.pcie_link_gen_max),
        opt(s.pcie_link_width),
        opt(s.pcie_link_width_max)
    );
    if s.nvlinks.is_empty() {
        println!("  NVLink           none");
    }
    for l in &s.nvlinks {
        println!(
            "  NVLink {:>2}        {} crc-flit {}, crc-data {}, replay {}, recovery {}",
            l.link,
            match l.active {
                Some(true) => "up  ",
                Some(false) => "DOWN",
                None => "?   ",
            },
            opt(l.crc_flit),
            opt(l.crc_data),
            opt(l.replay),
            opt(l.recovery)
        );
    }
}

fn to_json(s: &GpuSample) -> serde_json::Value {
    serde_json::json!({
        "index": s.index,
        "uuid": s.uuid,
        "pci_bus_id": s.pci_bus_id,
        "lost": s.lost,
        "error": s.error,
        "serial": s.serial,
        "product": s.product,
        "temperature_c": s.temperature_c,
        "slowdown_c": s.slowdown_c,
        "shutdown_c": s.shutdown_c,
        "power_w": s.power_w,
        "power_limit_w": s.power_limit_w,
        "ecc_sbe_volatile": s.ecc_sbe_volatile,
        "ecc_dbe_volatile": s.ecc_dbe_volatile,
        "ecc_sbe_aggregate": s.ecc_sbe_aggregate,
        "ecc_dbe_aggregate": s.ecc_dbe_aggregate,
        "retired_pages_sbe": s.retired_pages_sbe,
        "retired_pages_dbe": s.retired_pages_dbe,
        "retired_pages_pending": s.retired_pages_pending,
        "remapped_rows_correctable": s.remapped_rows_correctable,
        "remapped_rows_uncorrectable": s.remapped_rows_uncorrectable,
        "remap_pending": s.remap_pending,
        "remap_failure": s.remap_failure,
        "throttle_mask": s.throttle_mask,
        "throttle_reasons": s.throttle_mask.map(throttle::names),
        "pcie_replay": s.pcie_replay,
        "pcie_link_gen": s.pcie_link_gen,
        "pcie_link_gen_max": s.pcie_link_gen_max,
        "pcie_link_width": s.pcie_link_width,
        "pcie_link_width_max": s.pcie_link_width_max,
        "nvlinks": s.nvlinks.iter().map(|l| serde_json::json!({
            "link": l.link, "active": l.active, "crc_flit": l.crc_flit, "crc_data": l.crc_data,
            "replay": l.replay, "recovery": l.recovery,
        })).collect::<Vec<_>>(),
    })
}
