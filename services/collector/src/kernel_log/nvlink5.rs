//! What an NVLink5 Xid (144 to 150, Blackwell: B100, B200, GB200) means, from the fields the
//! driver logs: `NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 04
//! (0x004505c6 0x00000000 ...)`. After the code come the unit that raised the error (its name
//! starts with the NVLink block: `RLW_REMAP` is the RLW block), the severity (`Fatal`,
//! `Nonfatal`), the reporting instance (`XC0 i0`), the link, and the registers: the interrupt
//! info first, the error status second. Drivers before R575 print `XC 1 i 2 Link 01
//! [0x0000000a]`.
//!
//! NVIDIA's Xid catalog gives these Xids no fixed action ("decode the reported fields"); its
//! NVLink5 rules decide by block, unit, severity and error status, and [`decode`] follows them:
//!
//! | Xid | block | GPU reset needed when |
//! |---|---|---|
//! | 144 | SAW | the error status has bit `0x2` or `0x10` |
//! | 145 | RLW | the severity is fatal; `RLW_REMAP` and `RLW_SRC_TRACK` defer to the Xid 154 that follows |
//! | 146 | TLW | the error status has bit `0x4` |
//! | 147 | TREX | never (informational) |
//! | 148 | NVLPW_CTRL | never (informational) |
//! | 149 | NETIR | always, except `NETIR_BER_EVENT` (a bit-error-rate report) |
//! | 150 | MSE | always |
//!
//! Any fatal NVLink5 error needs at least a GPU reset. None of them asks for a node reboot on its
//! own: when the driver wants more than a reset it says so with Xid 154, which overrides.

use serde::Serialize;

/// What the decoded Xid asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Nvlink5Action {
    /// Nothing: the error is informational or was corrected.
    None,
    /// A GPU reset (the link and the GPU's other links come back with it).
    GpuReset,
    /// The driver's Xid 154 that accompanies it names the action.
    FollowXid154,
}

/// An NVLink5 Xid decoded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Nvlink5Decode {
    /// The catalog's mnemonic for the code (`NVLINK_NETIR_ERROR`).
    pub mnemonic: &'static str,
    /// The NVLink block that raised it (`NETIR`).
    pub block: &'static str,
    /// The unit as logged (`NETIR_LINK_EVT`), when logged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    /// True when the driver logged the error fatal.
    pub fatal: bool,
    /// The link, when logged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub link: Option<u32>,
    /// The error status register, when logged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_status: Option<u32>,
    /// What it asks for.
    pub action: Nvlink5Action,
    /// One sentence for people: the block, the link and the action.
    pub meaning: String,
}

/// The catalog mnemonic and the block of NVLink5 Xid `code`; `None` outside 144-150.
pub fn block(code: u32) -> Option<(&'static str, &'static str)> {
    Some(match code {
        144 => ("NVLINK_SAW_ERROR", "SAW"),
        145 => ("NVLINK_RLW_ERROR", "RLW"),
        146 => ("NVLINK_TLW_ERROR", "TLW"),
        147 => ("NVLINK_TREX_ERROR", "TREX"),
        148 => ("NVLINK_NVLPW_CTRL_ERROR", "NVLPW_CTRL"),
        149 => ("NVLINK_NETIR_ERROR", "NETIR"),
        150 => ("NVLINK_MSE_ERROR", "MSE"),
        _ => return None,
    })
}

/// A register as logged (`0x00000010`).
pub fn register(raw: &str) -> Option<u32> {
    u32::from_str_radix(raw.trim().trim_start_matches("0x").trim_start_matches("0X"), 16).ok()
}

/// Decodes NVLink5 Xid `code` from its logged unit, severity (`fatal`/`non_fatal`), link and
/// error status register. `None` outside 144-150.
pub fn decode(
    code: u32,
    unit: Option<&str>,
    severity: Option<&str>,
    link: Option<u32>,
    error_status: Option<u32>,
) -> Option<Nvlink5Decode> {
    let (mnemonic, block) = block(code)?;
    let fatal = severity == Some("fatal");
    let status = error_status.unwrap_or(0);
    let unit_is = |name: &str| unit.is_some_and(|u| u.eq_ignore_ascii_case(name));
    let action = match code {
        145 if unit_is("RLW_REMAP") || unit_is("RLW_SRC_TRACK") => Nvlink5Action::FollowXid154,
        _ if fatal => Nvlink5Action::GpuReset,
        144 if status & (0x2 | 0x10) != 0 => Nvlink5Action::GpuReset,
        146 if status & 0x4 != 0 => Nvlink5Action::GpuReset,
        149 if unit_is("NETIR_BER_EVENT") => Nvlink5Action::None,
        149 | 150 => Nvlink5Action::GpuReset,
        _ => Nvlink5Action::None,
    };
    let on_link = link.map(|l| format!(" on link {l}")).unwrap_or_default();
    let what = unit.map_or_else(|| format!("the {block} block"), |u| format!("{u} in the {block} block"));
    let severity_word = if fatal { "fatal" } else { "non-fatal" };
    let needs = match action {
        Nvlink5Action::None => "no action is needed",
        Nvlink5Action::GpuReset => "the GPU needs a reset",
        Nvlink5Action::FollowXid154 => "the accompanying Xid 154 names the action",
    };
    Some(Nvlink5Decode {
        mnemonic,
        block,
        unit: unit.map(str::to_owned),
        fatal,
        link,
        error_status,
        action,
        meaning: format!("NVLink5 {severity_word} error from {what}{on_link}: {needs}."),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel_log::parse::parse_all;

    /// Decodes one documented-format line through the parser.
    fn decoded(line: &str) -> Nvlink5Decode {
        let events = parse_all(line);
        assert_eq!(events.len(), 1, "{line}");
        events[0].nvlink5.clone().unwrap_or_else(|| panic!("not decoded: {line}"))
    }

    #[test]
    fn netir_link_event_fatal_needs_a_gpu_reset() {
        let d = decoded(
            "NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 04 (0x004505c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
        );
        assert_eq!((d.mnemonic, d.block, d.unit.as_deref()), ("NVLINK_NETIR_ERROR", "NETIR", Some("NETIR_LINK_EVT")));
        assert_eq!((d.fatal, d.link, d.error_status), (true, Some(4), Some(0)));
        assert_eq!(d.action, Nvlink5Action::GpuReset);
        assert_eq!(
            d.meaning,
            "NVLink5 fatal error from NETIR_LINK_EVT in the NETIR block on link 4: the GPU needs a reset."
        );
    }

    #[test]
    fn drivers_before_r575_print_the_register_in_brackets() {
        let d = decoded("NVRM: Xid (PCI:0000:00:1e): 149, NETIR_LINK_EVT Fatal XC 1 i 2 Link 01 [0x0000000a]");
        assert_eq!((d.link, d.action), (Some(1), Nvlink5Action::GpuReset));
    }

    #[test]
    fn rlw_remap_defers_to_xid_154_and_a_nonfatal_rlw_needs_nothing() {
        let d = decoded("NVRM: Xid (PCI:0008:01:00): 145, RLW_REMAP Nonfatal XC1 i1 Link 06 (0x00000000 0x00000001)");
        assert_eq!((d.block, d.link, d.action), ("RLW", Some(6), Nvlink5Action::FollowXid154));
        let d = decoded(
            "NVRM: Xid (PCI:0000:04:00): 145, RLW_CTRL Nonfatal XC0 i0 Link 00 (0x00000003 0x80000000 0x00000000 0x00000000)",
        );
        assert_eq!((d.error_status, d.action), (Some(0x8000_0000), Nvlink5Action::None));
        let d = decoded("NVRM: Xid (PCI:0000:04:00): 145, RLW_CTRL Fatal XC0 i0 Link 00 (0x00000003 0x00000001)");
        assert_eq!(d.action, Nvlink5Action::GpuReset, "any fatal NVLink5 error needs a reset");
    }

    #[test]
    fn error_status_bits_decide_saw_and_tlw() {
        let line = |code: u32, unit: &str, status: &str| {
            format!("NVRM: Xid (PCI:0000:04:00): {code}, {unit} Nonfatal XC0 i0 Link 02 (0x00000000 {status})")
        };
        assert_eq!(decoded(&line(144, "SAW_MVB", "0x00000010")).action, Nvlink5Action::GpuReset);
        assert_eq!(decoded(&line(144, "SAW_MVB", "0x00000002")).action, Nvlink5Action::GpuReset);
        assert_eq!(decoded(&line(144, "SAW_MVB", "0x00000001")).action, Nvlink5Action::None);
        assert_eq!(decoded(&line(146, "TLW_RX_PIPE0", "0x00000004")).action, Nvlink5Action::GpuReset);
        assert_eq!(decoded(&line(146, "TLW_RX_PIPE0", "0x80000000")).action, Nvlink5Action::None);
        assert_eq!(decoded(&line(147, "TREX_INT", "0x00000004")).action, Nvlink5Action::None);
        assert_eq!(decoded(&line(148, "NVLPW_CTRL_INT", "0x00000010")).action, Nvlink5Action::None);
        assert_eq!(decoded(&line(149, "NETIR_BER_EVENT", "0x00000001")).action, Nvlink5Action::None);
        assert_eq!(decoded(&line(150, "MSE_WATCHDOG", "0x00000000")).action, Nvlink5Action::GpuReset);
    }

    #[test]
    fn only_144_to_150_are_nvlink5() {
        assert!(decode(74, Some("x"), Some("fatal"), Some(1), None).is_none());
        assert!(decode(151, None, None, None, None).is_none());
        assert_eq!(register("0x004505c6"), Some(0x0045_05c6));
    }
}
