//! Parser tests from driver messages as they appear in public bug reports, forums and NVIDIA's
//! documentation, under each wrapping the parser must see through.

use super::*;

fn one(line: &str) -> KernelEvent {
    let events = parse_all(line);
    assert_eq!(events.len(), 1, "expected one event from {line:?}, got {events:?}");
    events.into_iter().next().unwrap()
}

#[test]
fn xid_with_pid_and_name() {
    let e = one(
        "NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
    );
    assert_eq!(e.kind, KernelEventKind::Xid);
    assert_eq!(e.xid, Some(109));
    assert_eq!(e.pci_bus_id.as_deref(), Some("0000:cb:00.0"));
    assert_eq!(e.pid, Some(1797828));
    assert_eq!(e.process.as_deref(), Some("pt_main_thread"));
    assert_eq!(e.message, "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005");
}

#[test]
fn xid_with_unknown_pid_and_name() {
    let e = one(
        "[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
    );
    assert_eq!((e.xid, e.pid, e.process.as_deref()), (Some(13), None, None));
    assert_eq!(e.message, "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter");
}

#[test]
fn xid_79_fallen_off_the_bus() {
    let e = one(
        "[ 5523.234118] NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    );
    assert_eq!(e.kind, KernelEventKind::Xid);
    assert_eq!(e.xid, Some(79));
    assert_eq!(e.message, "GPU has fallen off the bus.");
}

#[test]
fn xid_without_pci_prefix_or_pid() {
    let e = one("NVRM: Xid (0000:03:00): 14, Channel 00000001");
    assert_eq!((e.xid, e.pci_bus_id.as_deref()), (Some(14), Some("0000:03:00.0")));
    assert_eq!((e.pid, e.message.as_str()), (None, "Channel 00000001"));
}

#[test]
fn xid_with_pid_but_no_name() {
    let e = one("NVRM: Xid (PCI:0000:07:00): 43, pid=2153, Ch 00000010");
    assert_eq!((e.pid, e.process.as_deref(), e.message.as_str()), (Some(2153), None, "Ch 00000010"));
}

#[test]
fn xid_process_name_with_spaces() {
    let e =
        one("NVRM: Xid (PCI:0000:01:00): 13, pid=4242, name=Web Content, Graphics Exception: ESR 0x404600=0x80000002");
    assert_eq!(e.process.as_deref(), Some("Web Content"));
    assert_eq!(e.message, "Graphics Exception: ESR 0x404600=0x80000002");
}

#[test]
fn xid_with_mig_instance_and_nonzero_domain() {
    let e = one(
        "NVRM: Xid (PCI:0002:c1:00 GPU-I:05): 31, pid=14021, name=python, Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f6a_c0000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    );
    assert_eq!(e.pci_bus_id.as_deref(), Some("0002:c1:00.0"));
    assert_eq!(e.mig, Some(MigInstance { gpu_instance: 5, compute_instance: None }));
    let e = one("NVRM: Xid (PCI:0000:4b:00 GPU-I:01 GPU-C:02): 43, pid=77, name=worker, Ch 00000010");
    assert_eq!(e.mig, Some(MigInstance { gpu_instance: 1, compute_instance: Some(2) }));
}

#[test]
fn xid_154_recovery_action() {
    let e =
        one("NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)");
    assert_eq!(e.recovery_action.as_deref(), Some("gpu_reset_required"));
    let e = one(
        "NVRM: Xid (PCI:0000:9d:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x2 (Node Reboot Required)",
    );
    assert_eq!(e.recovery_action.as_deref(), Some("node_reboot_required"));
    let e =
        one("NVRM: Xid (PCI:0000:9d:00): 154, GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)");
    assert_eq!(e.recovery_action.as_deref(), Some("drain_and_reset"));
}

#[test]
fn xid_nvlink5_fields() {
    let e = one(
        "NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 04 (0x004505c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
    );
    assert_eq!(e.xid, Some(149));
    assert_eq!(e.pci_bus_id.as_deref(), Some("0018:01:00.0"));
    assert_eq!(e.severity.as_deref(), Some("fatal"));
    let nv = e.nvlink.expect("nvlink fields");
    assert_eq!(nv.link, Some(4));
    assert_eq!(nv.unit.as_deref(), Some("NETIR_LINK_EVT"));
    assert_eq!(nv.registers.len(), 6);
    assert_eq!(nv.registers[0], "0x004505c6");
    let e = one("NVRM: Xid (PCI:0008:01:00): 145, RLW_REMAP Nonfatal XC1 i1 Link 06 (0x00000000 0x00000001)");
    assert_eq!(e.severity.as_deref(), Some("non_fatal"));
    assert_eq!(e.nvlink.unwrap().link, Some(6));
}

#[test]
fn xid_74_names_its_link() {
    let e = one(
        "NVRM: Xid (PCI:0000:8a:00): 74, pid=3301, name=nccl-tests, NVLink: Link 4, fatal error detected on link 4 (0x0,0x0,0x10000,0x0,0x0,0x0,0x0)",
    );
    assert_eq!(e.xid, Some(74));
    assert_eq!(e.nvlink.as_ref().and_then(|n| n.link), Some(4));
}

#[test]
fn wrappings_are_seen_through() {
    let body = "NVRM: Xid (PCI:0000:3b:00): 48, pid=991, name=train, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.";
    for line in [
        body.to_owned(),
        format!("3,1342,5523234118,-;{body}"),
        format!("[ 5523.234118] {body}"),
        format!("[Mon Nov 30 00:11:22 2026] {body}"),
        format!("Nov 30 00:11:22 gpu-node-7 kernel: [ 5523.234118] {body}"),
        format!("Nov 30 00:11:22 gpu-node-7 kernel: {body}"),
        format!("2026-11-30T00:11:22.123456+00:00 gpu-node-7 kernel: {body}"),
    ] {
        let e = one(&line);
        assert_eq!((e.xid, e.pid, e.pci_bus_id.as_deref()), (Some(48), Some(991), Some("0000:3b:00.0")), "{line}");
    }
}

#[test]
fn fallen_off_the_bus_without_xid() {
    let e = one(
        "NVRM: The NVIDIA GPU 0000:3b:00.0 (PCI ID: 10de:20b0) installed in this system has fallen off the bus and is not responding to commands.",
    );
    assert_eq!(e.kind, KernelEventKind::GpuLost);
    assert_eq!(e.pci_bus_id.as_deref(), Some("0000:3b:00.0"));
    let e = one("kernel: NVRM: GPU 0000:41:00.0: GPU has fallen off the bus.");
    assert_eq!((e.kind, e.pci_bus_id.as_deref()), (KernelEventKind::GpuLost, Some("0000:41:00.0")));
    let e = one("NVRM: GPU at PCI:0000:c1:00: GPU has fallen off the bus.");
    assert_eq!(e.pci_bus_id.as_deref(), Some("0000:c1:00.0"));
}

#[test]
fn sxid_multi_line_record_is_one_event() {
    let text = "\
[ 1042.5] nvidia-nvswitch3: SXid (PCI:0000:c8:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)
[ 1042.5] nvidia-nvswitch3: SXid (PCI:0000:c8:00.0): 12028, Severity 0 Engine instance 32 Sub-engine instance 00
[ 1042.5] nvidia-nvswitch3: SXid (PCI:0000:c8:00.0): 12028, Data {0x00000000, 0x00000000, 0x00000000, 0x00000000}
[ 1042.6] nvidia-nvswitch1: SXid (PCI:0000:a5:00.0): 24007, Fatal, Link 44 sourcetrack TCEN0 crumbstore ECC DBE Error (First)
[ 1042.6] NVRM: Xid (PCI:0000:3b:00): 74, pid=1, name=x, NVLink: Link 2
";
    let events = parse_all(text);
    assert_eq!(events.len(), 3, "{events:#?}");
    let first = &events[0];
    assert_eq!((first.kind, first.sxid), (KernelEventKind::Sxid, Some(12028)));
    assert_eq!(first.device.as_deref(), Some("nvidia-nvswitch3"));
    assert_eq!(first.pci_bus_id.as_deref(), Some("0000:c8:00.0"));
    assert_eq!(first.severity.as_deref(), Some("non_fatal"));
    assert_eq!(first.nvlink.as_ref().and_then(|n| n.link), Some(32));
    assert!(first.message.contains("Severity 0 Engine instance 32"), "{}", first.message);
    assert!(first.message.contains("Data {0x00000000"), "{}", first.message);
    assert_eq!((events[1].sxid, events[1].severity.as_deref()), (Some(24007), Some("fatal")));
    assert_eq!(events[2].xid, Some(74));
}

#[test]
fn a_joined_record_keeps_the_origin_of_its_first_line() {
    let lines = [
        "nvidia-nvswitch3: SXid (PCI:0000:c8:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)",
        "nvidia-nvswitch3: SXid (PCI:0000:c8:00.0): 12028, Severity 0 Engine instance 32 Sub-engine instance 00",
        "NVRM: Xid (PCI:0000:3b:00): 74, pid=1, name=x, NVLink: Link 2",
    ];
    let mut parser = LogParser::new();
    let mut out = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let n = n as u64;
        parser.feed_from(line, LineOrigin { seq: 10 + n, timestamp_us: 1_000 * n }, &mut out);
    }
    parser.flush_from(&mut out);
    let origins: Vec<(Option<u32>, Option<u32>, u64, u64)> =
        out.iter().map(|(e, o)| (e.sxid, e.xid, o.seq, o.timestamp_us)).collect();
    assert_eq!(origins, vec![(Some(12028), None, 10, 0), (None, Some(74), 12, 2_000)]);
}

#[test]
fn machine_checks() {
    let e = one("mce: [Hardware Error]: CPU 3: Machine Check Exception: 5 Bank 7: be00000000800400");
    assert_eq!((e.kind, e.cpu, e.mce_bank), (KernelEventKind::Mce, Some(3), Some(7)));
    let e = one("[ 99.1] mce: [Hardware Error]: Machine check events logged");
    assert_eq!(e.kind, KernelEventKind::Mce);
    assert!(parse_all("mce: [Hardware Error]: RIP !INEXACT! 10:<ffffffff8100b3a2>").is_empty());
    assert!(parse_all("mce: [Hardware Error]: Run the above through 'mcelog --ascii'").is_empty());
    let e = one(
        "EDAC MC1: 1 UE memory read error on CPU_SrcID#1_MC#0_Chan#1_DIMM#0 (channel:1 slot:0 page:0x8f3a offset:0x0 grain:32)",
    );
    assert_eq!((e.kind, e.severity.as_deref()), (KernelEventKind::Mce, Some("uncorrected")));
    let e = one("EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#0_DIMM#0");
    assert_eq!(e.severity.as_deref(), Some("corrected"));
}

#[test]
fn pcie_aer() {
    let e = one("nvidia 0000:3b:00.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)");
    assert_eq!((e.kind, e.pci_bus_id.as_deref()), (KernelEventKind::PcieAer, Some("0000:3b:00.0")));
    assert_eq!(e.severity.as_deref(), Some("corrected"));
    let e = one(
        "pcieport 0000:00:03.0: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, (Requester ID)",
    );
    assert_eq!(e.severity.as_deref(), Some("uncorrected_non_fatal"));
    let e = one("pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:01:00.0");
    assert_eq!((e.pci_bus_id.as_deref(), e.severity.as_deref()), (Some("0000:01:00.0"), Some("fatal")));
    // Reported again with detail as "PCIe Bus Error", so not an event of its own.
    assert!(parse_all("pcieport 0000:00:03.1: AER: Corrected error received: 0000:3b:00.0").is_empty());
    assert!(parse_all("nvidia 0000:3b:00.0: AER:   device [10de:2330] error status/mask=00000001/0000e000").is_empty());
}

#[test]
fn other_lines_are_ignored() {
    for line in [
        "",
        "[    0.000000] Linux version 6.1.0-27-amd64",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
        "NVRM: GPU at PCI:0000:03:00: GPU-b850f46d-d5ea-c752-ddf3-c4453e44d3f7",
        "nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context, skipping further processing",
        "mce: CPU12: Core temperature above threshold, cpu clock throttled (total events = 1)",
        "NVRM: Xid garbage without the expected shape",
        "NVRM: Xid (PCI:0000:3b:00): notanumber, pid=1",
    ] {
        assert!(parse_all(line).is_empty(), "{line:?} should give nothing");
    }
}

#[test]
fn pci_ids_normalise() {
    assert_eq!(normalize_pci("0000:3B:00").as_deref(), Some("0000:3b:00.0"));
    assert_eq!(normalize_pci("00000000:3B:00.0").as_deref(), Some("0000:3b:00.0"));
    assert_eq!(normalize_pci("0009:01:00.1").as_deref(), Some("0009:01:00.1"));
    assert_eq!(normalize_pci("10de:20b0"), None);
    assert_eq!(normalize_pci("00:00:00"), None);
}

#[test]
fn arbitrary_bytes_never_panic() {
    // A deterministic walk over mutations of real lines: the parser must only ever return.
    let seeds = [
        "NVRM: Xid (PCI:0000:3b:00 GPU-I:05): 79, pid=1, name=a b, GPU has fallen off the bus.",
        "nvidia-nvswitch3: SXid (PCI:0000:c8:00.0): 12028, Non-fatal, Link 32 egress",
        "pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:01:00.0",
        "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
    ];
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for seed in seeds {
        for _ in 0..2000 {
            let mut bytes = seed.as_bytes().to_vec();
            let cut = (next() as usize) % (bytes.len() + 1);
            bytes.truncate(cut.max(1));
            for _ in 0..(next() % 4) {
                let i = (next() as usize) % bytes.len();
                bytes[i] = (next() % 128) as u8;
            }
            let line = String::from_utf8_lossy(&bytes);
            let _ = parse_all(&line);
        }
    }
}
