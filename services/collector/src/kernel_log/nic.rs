//! NIC driver errors in the kernel log: the network watchdog's transmit timeouts and the
//! ConnectX (`mlx5_core`) driver's command timeouts and firmware health reports.
//!
//! A NIC whose firmware stopped answering can keep its port `ACTIVE`/`LinkUp` in sysfs while its
//! data path is dead, so these lines are the only sign. Formats, as the kernel and the mlx5
//! driver print them (the device prefix is `<driver> <pci> [<ifname>]:`):
//!
//! - `NETDEV WATCHDOG: eth0 (mlx5_core): transmit queue 3 timed out` (newer kernels add
//!   `5120 ms`; from 6.8 `mlx5_core 0000:3b:00.0 eth0: NETDEV WATCHDOG: CPU: 12: transmit queue 3
//!   timed out 5120 ms`). The driver's own `TX timeout detected` and `TX timeout on queue: ...`
//!   lines follow every watchdog line (the watchdog calls the driver), so they are not events of
//!   their own: one stall is one event;
//! - `mlx5_core 0000:03:00.0: wait_func:964:(pid 112): ENABLE_HCA(0x104) timeout. Will cause a
//!   leak of a command resource`, and `cmd_work_handler`/`wait_func` lines with `timeout` or `No
//!   done completion`;
//! - `mlx5_core 0000:41:00.0: poll_health:852:(pid 0): device's health compromised - reached miss
//!   count`, `print_health_info:...: synd 0x8: unrecoverable hardware error`, `Fatal error 1
//!   detected`, `FW is unable to respond to initialization segment reads`, and the health
//!   recovery giving up (`health recovery flow aborted`);
//! - `mlx5_pcie_event:...: Detected insufficient power on the PCIe slot (27W).` and `temp_warn:
//!   ...: High temperature on sensors ...`.
//!
//! Fatal (`severity` `fatal`) are the ones after which the device does not work until it is
//! reset or the node rebooted: a firmware that stopped answering, an unrecoverable hardware
//! syndrome, a failed recovery. Transmit timeouts, command timeouts, power and temperature
//! warnings are `non_fatal`: the driver recovers from them, and only their repetition says the
//! NIC is failing.

use serde::Serialize;

/// A NIC driver error found in one kernel-log line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NicError {
    /// What went wrong: `tx_timeout`, `cmd_timeout`, `health_compromised`, `unrecoverable`,
    /// `fatal_error`, `fw_unresponsive`, `recovery_failed`, `insufficient_power`,
    /// `high_temperature`.
    pub error: &'static str,
    /// The driver (`mlx5_core`), when the line names it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// The NIC's PCI address, normalised, when the line names it. Kept apart from the event's
    /// GPU PCI id: a NIC is not a GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The network interface (`eth0`, `ibp12s0`), when the line names it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    /// The transmit queue that timed out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue: Option<u32>,
    /// `fatal` or `non_fatal` (see the module's documentation).
    pub severity: &'static str,
}

/// What each recognised mlx5 message means: a marker, the error name, and whether it is fatal.
const MLX5: &[(&str, &str, bool)] = &[
    ("health compromised", "health_compromised", true),
    ("unrecoverable hardware error", "unrecoverable", true),
    ("FW is unable to respond", "fw_unresponsive", true),
    ("health recovery flow aborted", "recovery_failed", true),
    ("insufficient power", "insufficient_power", false),
    ("High temperature on sensors", "high_temperature", false),
];

/// The NIC driver error in `line`, if it holds one.
pub fn parse(line: &str) -> Option<NicError> {
    if let Some(at) = line.find("NETDEV WATCHDOG:") {
        return Some(watchdog(line, at));
    }
    let at = line.find("mlx5_core")?;
    let body = &line[at..];
    let (driver, device, interface) = prefix(body);
    let mut error = MLX5.iter().find(|(marker, _, _)| body.contains(marker)).map(|(_, name, fatal)| (*name, *fatal));
    if error.is_none() && body.contains("Fatal error") && body.contains("detected") {
        error = Some(("fatal_error", true));
    }
    if error.is_none()
        && (body.contains("wait_func") || body.contains("cmd_work_handler") || body.contains("cmd_exec"))
        && (body.contains("timeout") || body.contains("No done completion"))
    {
        error = Some(("cmd_timeout", false));
    }
    let (error, fatal) = error?;
    Some(NicError {
        error,
        driver,
        device,
        interface,
        queue: None,
        severity: if fatal { "fatal" } else { "non_fatal" },
    })
}

/// `NETDEV WATCHDOG: eth0 (mlx5_core): transmit queue 3 timed out 5120 ms`, or from 6.8 with the
/// device prefix before it and `CPU: 12:` in place of the interface.
fn watchdog(line: &str, at: usize) -> NicError {
    let rest = line[at + "NETDEV WATCHDOG:".len()..].trim_start();
    let (mut driver, device, mut interface) = (None, None, None);
    let (pdriver, pdevice, pinterface) = prefix(line[..at].rsplit(']').next().unwrap_or(&line[..at]).trim());
    if let Some((name, tail)) = rest.split_once(' ')
        && let Some(inner) = tail.trim_start().strip_prefix('(')
        && let Some((d, _)) = inner.split_once(')')
    {
        interface = Some(name.to_owned());
        driver = Some(d.to_owned());
    }
    NicError {
        error: "tx_timeout",
        driver: driver.or(pdriver),
        device: device.or(pdevice),
        interface: interface.or(pinterface),
        queue: number_after(rest, "transmit queue"),
        severity: "non_fatal",
    }
}

/// The `<driver> <pci> [<ifname>]:` device prefix of a driver message.
fn prefix(body: &str) -> (Option<String>, Option<String>, Option<String>) {
    let head = body.split(": ").next().unwrap_or(body);
    let mut words = head.split_whitespace();
    let Some(driver) = words.next().filter(|d| d.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')) else {
        return (None, None, None);
    };
    let device = words.next().and_then(super::parse::normalize_pci);
    if device.is_none() {
        return (None, None, None);
    }
    let interface = words.next().map(|i| i.trim_end_matches(':').to_owned());
    (Some(driver.to_owned()), device, interface)
}

/// The decimal number after `marker` (`queue: 3`, `transmit queue 3`).
fn number_after(s: &str, marker: &str) -> Option<u32> {
    let tail = s[s.find(marker)? + marker.len()..].trim_start();
    let end = tail.find(|c: char| !c.is_ascii_digit()).unwrap_or(tail.len());
    tail[..end].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(line: &str) -> NicError {
        parse(line).unwrap_or_else(|| panic!("no NIC error in {line:?}"))
    }

    #[test]
    fn the_network_watchdog_in_every_kernel_format() {
        let e = get("6,2201,7423342012,-;NETDEV WATCHDOG: enp59s0f0 (mlx5_core): transmit queue 10 timed out");
        assert_eq!((e.error, e.severity, e.queue), ("tx_timeout", "non_fatal", Some(10)));
        assert_eq!((e.driver.as_deref(), e.interface.as_deref()), (Some("mlx5_core"), Some("enp59s0f0")));
        let e = get("[ 8123.4411] NETDEV WATCHDOG: eth2 (mlx5_core): transmit queue 3 timed out 5376 ms");
        assert_eq!((e.queue, e.interface.as_deref()), (Some(3), Some("eth2")));
        let e = get(
            "[ 912.0001] mlx5_core 0000:3B:00.0 eth0: NETDEV WATCHDOG: CPU: 12: transmit queue 7 timed out 5120 ms",
        );
        assert_eq!(e.queue, Some(7));
        assert_eq!(
            (e.driver.as_deref(), e.device.as_deref(), e.interface.as_deref()),
            (Some("mlx5_core"), Some("0000:3b:00.0"), Some("eth0"))
        );
        // The driver's follow-up lines are the same stall: no second event.
        assert_eq!(parse("mlx5_core 0000:3b:00.0 enp59s0f0: TX timeout detected"), None);
        assert_eq!(
            parse(
                "mlx5_core 0000:3b:00.0 enp59s0f0: TX timeout on queue: 10, SQ: 0x1ad, CQ: 0x4e7, SQ Cons: 0x0 SQ Prod: 0x7, usecs since last trans: 20392000"
            ),
            None
        );
    }

    #[test]
    fn mlx5_command_timeouts() {
        let e = get(
            "kernel: [   66.816635] mlx5_core 0000:03:00.0: wait_func:964:(pid 112): ENABLE_HCA(0x104) timeout. Will cause a leak of a command resource",
        );
        assert_eq!((e.error, e.severity, e.device.as_deref()), ("cmd_timeout", "non_fatal", Some("0000:03:00.0")));
        assert_eq!(e.interface, None);
        let e =
            get("mlx5_core 0000:5e:00.0: cmd_work_handler:955:(pid 2171): cmd[0]: CREATE_EQ(0x301) No done completion");
        assert_eq!(e.error, "cmd_timeout");
        let e = get("mlx5_core 0000:5e:00.0: cmd_work_handler:877:(pid 2171): cmd 3 timeout");
        assert_eq!(e.error, "cmd_timeout");
    }

    #[test]
    fn mlx5_firmware_health_is_fatal() {
        let e = get(
            "kernel: [   17.982092] mlx5_core 0000:41:00.0: poll_health:852:(pid 0): device's health compromised - reached miss count",
        );
        assert_eq!((e.error, e.severity, e.device.as_deref()), ("health_compromised", "fatal", Some("0000:41:00.0")));
        let e = get("mlx5_core 0000:41:00.0: print_health_info:458:(pid 0): synd 0x8: unrecoverable hardware error");
        assert_eq!((e.error, e.severity), ("unrecoverable", "fatal"));
        assert_eq!(get("mlx5_core 0000:41:00.0: poll_health:741:(pid 0): Fatal error 1 detected").error, "fatal_error");
        assert_eq!(
            get("mlx5_core 0000:41:00.0: poll_health:745:(pid 0): FW is unable to respond to initialization segment reads")
                .error,
            "fw_unresponsive"
        );
        let e = get(
            "mlx5_core 0000:06:00.0: mlx5_health_try_recover:335:(pid 1142): health recovery flow aborted, PCI reads still not working",
        );
        assert_eq!((e.error, e.severity), ("recovery_failed", "fatal"));
    }

    #[test]
    fn power_and_temperature_warnings() {
        let e = get(
            "mlx5_core 0000:3b:00.0: mlx5_pcie_event:301:(pid 711): Detected insufficient power on the PCIe slot (27W).",
        );
        assert_eq!((e.error, e.severity), ("insufficient_power", "non_fatal"));
        let e = get("mlx5_core 0000:3b:00.0: temp_warn:165:(pid 0): High temperature on sensors with bit set 0 1");
        assert_eq!(e.error, "high_temperature");
    }

    #[test]
    fn ordinary_driver_lines_are_not_errors() {
        for line in [
            "mlx5_core 0000:3b:00.0: firmware version: 28.39.1002",
            "mlx5_core 0000:3b:00.0 eth0: Link up",
            "mlx5_core 0000:3b:00.0: print_health_info:430:(pid 0): assert_var[0] 0x00000000",
            "mlx5_core 0000:3b:00.0: E-Switch: Total vports 2, per vport: max uc(128) max mc(2048)",
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.",
        ] {
            assert_eq!(parse(line), None, "{line}");
        }
    }
}
