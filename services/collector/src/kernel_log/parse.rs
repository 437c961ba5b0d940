//! Parsing kernel log lines into health events.
//!
//! The parser looks for its markers anywhere in a line, so it reads every wrapping seen in the
//! wild without knowing which one it has: raw `/dev/kmsg` records (`6,1234,5678,-;NVRM: ...`),
//! dmesg (`[ 1234.5678] ...`, `[Mon Nov 30 ...] ...`), syslog and journal prefixes
//! (`Nov 30 00:00:00 host kernel: ...`). Lines without any marker are rejected after a few
//! substring searches.
//!
//! One record can span lines: NVSwitch `SXid` reports add `Severity ...` and `Data {...}` lines
//! for the same code and device. [`LogParser`] keeps such a record open until a line that does
//! not continue it arrives (or [`LogParser::flush`] is called), then emits it once.

use serde::Serialize;

/// What a kernel log event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelEventKind {
    /// An NVIDIA driver Xid (`NVRM: Xid`).
    Xid,
    /// An NVSwitch error (`SXid`).
    Sxid,
    /// A GPU has fallen off the bus, reported as text without an Xid number.
    GpuLost,
    /// A machine check or EDAC memory error.
    Mce,
    /// A PCIe Advanced Error Reporting error.
    PcieAer,
    /// A NIC driver error: a transmit timeout, an mlx5 command timeout or firmware health report.
    NicDriver,
}

/// A MIG instance named by an Xid line (`GPU-I:05`, optionally `GPU-C:01`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MigInstance {
    /// The GPU instance id.
    pub gpu_instance: u32,
    /// The compute instance id, when the line names one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compute_instance: Option<u32>,
}

/// NVLink details of Xid 74, the NVLink5 Xids 144-150, and NVSwitch SXids.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NvlinkFields {
    /// The link number.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub link: Option<u32>,
    /// The unit or error name reported first (NVLink5: `NETIR_LINK_EVT`, `RLW_REMAP`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    /// The raw register values, as written.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub registers: Vec<String>,
}

/// One health event found in the kernel log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KernelEvent {
    /// What it is.
    pub kind: KernelEventKind,
    /// The Xid code, for [`KernelEventKind::Xid`].
    pub xid: Option<u32>,
    /// The SXid code, for [`KernelEventKind::Sxid`].
    pub sxid: Option<u32>,
    /// The PCI bus id, normalised to `dddd:bb:dd.f` lowercase.
    pub pci_bus_id: Option<String>,
    /// The process the driver blamed, when it named one.
    pub pid: Option<u32>,
    /// That process's name (it may contain spaces).
    pub process: Option<String>,
    /// The rest of the message after the fields above.
    pub message: String,
    /// Xid 154's new recovery action: `none`, `gpu_reset_required`, `node_reboot_required`,
    /// `drain_p2p`, `drain_and_reset`, or the driver's words in snake case when new.
    pub recovery_action: Option<String>,
    /// `fatal`, `non_fatal` or `corrected`/`uncorrected` (SXid, AER, EDAC), when given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub severity: Option<String>,
    /// The MIG instance, when the Xid names one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigInstance>,
    /// NVLink fields, for Xid 74, 144-150 and SXids that name a link.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvlink: Option<NvlinkFields>,
    /// What an NVLink5 Xid (144-150) means: block, link, and the action it asks for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvlink5: Option<super::nvlink5::Nvlink5Decode>,
    /// The reporting kernel device (`nvidia-nvswitch3`), when the line starts with one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The CPU a machine check was reported on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<u32>,
    /// The machine-check bank.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mce_bank: Option<u32>,
    /// The NIC driver error, for [`KernelEventKind::NicDriver`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nic: Option<super::nic::NicError>,
}

impl KernelEvent {
    fn new(kind: KernelEventKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            xid: None,
            sxid: None,
            pci_bus_id: None,
            pid: None,
            process: None,
            message: message.into(),
            recovery_action: None,
            severity: None,
            mig: None,
            nvlink: None,
            nvlink5: None,
            device: None,
            cpu: None,
            mce_bank: None,
            nic: None,
        }
    }
}

/// Where a line came from, carried to the event it starts: the kernel log's sequence number and
/// timestamp for a `/dev/kmsg` record, nothing for plain text. An event joined from several lines
/// (an SXid with its `Severity` and `Data` lines) keeps the origin of its first line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LineOrigin {
    /// The record's sequence number within its boot.
    pub seq: u64,
    /// The record's timestamp, microseconds since boot.
    pub timestamp_us: u64,
}

/// A line-at-a-time parser that joins multi-line records.
#[derive(Debug, Default)]
pub struct LogParser {
    pending: Option<(KernelEvent, LineOrigin)>,
}

impl LogParser {
    /// A parser with nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds one line; completed events are appended to `out`.
    pub fn feed(&mut self, line: &str, out: &mut Vec<KernelEvent>) {
        self.feed_with(line, LineOrigin::default(), &mut |e, _| out.push(e));
    }

    /// Feeds one line that came from `origin`; completed events are appended to `out` with the
    /// origin of the line each started on.
    pub fn feed_from(&mut self, line: &str, origin: LineOrigin, out: &mut Vec<(KernelEvent, LineOrigin)>) {
        self.feed_with(line, origin, &mut |e, o| out.push((e, o)));
    }

    fn feed_with(&mut self, line: &str, origin: LineOrigin, emit: &mut dyn FnMut(KernelEvent, LineOrigin)) {
        if let Some(event) = line.find("SXid").and_then(|at| parse_sxid(line, at)) {
            if let Some((pending, _)) = self.pending.as_mut()
                && is_sxid_continuation(pending, &event)
            {
                pending.message.push_str(" | ");
                pending.message.push_str(&event.message);
                return;
            }
            self.flush_with(emit);
            self.pending = Some((event, origin));
            return;
        }
        self.flush_with(emit);
        if let Some(event) = parse_line(line) {
            emit(event, origin);
        }
    }

    /// True when no record is kept open waiting for continuation lines.
    pub fn is_idle(&self) -> bool {
        self.pending.is_none()
    }

    /// Emits a record kept open for continuation lines. Call when the input ends or pauses.
    pub fn flush(&mut self, out: &mut Vec<KernelEvent>) {
        self.flush_with(&mut |e, _| out.push(e));
    }

    /// [`LogParser::flush`], with the origin of the line the record started on.
    pub fn flush_from(&mut self, out: &mut Vec<(KernelEvent, LineOrigin)>) {
        self.flush_with(&mut |e, o| out.push((e, o)));
    }

    fn flush_with(&mut self, emit: &mut dyn FnMut(KernelEvent, LineOrigin)) {
        if let Some((event, origin)) = self.pending.take() {
            emit(event, origin);
        }
    }
}

/// Parses every line of `text`; a convenience over [`LogParser`].
pub fn parse_all(text: &str) -> Vec<KernelEvent> {
    let mut parser = LogParser::new();
    let mut out = Vec::new();
    for line in text.lines() {
        parser.feed(line, &mut out);
    }
    parser.flush(&mut out);
    out
}

/// Parses one line on its own (multi-line SXid records come out line by line).
pub fn parse_line(line: &str) -> Option<KernelEvent> {
    if let Some(at) = line.find("NVRM: Xid") {
        return parse_xid(&line[at + "NVRM: Xid".len()..]);
    }
    if let Some(at) = line.find("SXid") {
        return parse_sxid(line, at);
    }
    if line.contains("fallen off the bus") {
        return Some(parse_gpu_lost(line));
    }
    if line.contains("[Hardware Error]") || line.contains("EDAC ") {
        return parse_mce(line);
    }
    if line.contains("PCIe Bus Error") || line.contains("error received") {
        return parse_aer(line);
    }
    if line.contains("NETDEV WATCHDOG") || line.contains("mlx5_core") {
        let nic = super::nic::parse(line)?;
        let body = line.find("NETDEV WATCHDOG").or_else(|| line.find("mlx5_core")).map_or(line, |at| &line[at..]);
        let mut event = KernelEvent::new(KernelEventKind::NicDriver, body.trim());
        event.severity = Some(nic.severity.to_owned());
        event.nic = Some(nic);
        return Some(event);
    }
    None
}

/// `NVRM: Xid (PCI:0000:3b:00 GPU-I:05): 79, pid=1234, name=python, GPU has fallen off the bus.`
fn parse_xid(rest: &str) -> Option<KernelEvent> {
    let rest = rest.trim_start();
    let (inside, after) = rest.strip_prefix('(')?.split_once(')')?;
    let after = after.strip_prefix(':')?.trim_start();
    let (code, after) = split_number(after)?;
    let mut event = KernelEvent::new(KernelEventKind::Xid, "");
    event.xid = Some(code);
    for token in inside.split_whitespace() {
        if let Some(id) = token.strip_prefix("GPU-I:") {
            let gpu_instance = parse_id(id)?;
            event.mig = Some(MigInstance { gpu_instance, compute_instance: None });
        } else if let Some(id) = token.strip_prefix("GPU-C:") {
            if let Some(mig) = event.mig.as_mut() {
                mig.compute_instance = parse_id(id);
            }
        } else if event.pci_bus_id.is_none() {
            event.pci_bus_id = normalize_pci(token.strip_prefix("PCI:").unwrap_or(token));
        }
    }
    let mut msg = after.strip_prefix(',').unwrap_or(after).trim_start();
    if let Some(v) = msg.strip_prefix("pid=") {
        let (pid, tail) = v.split_once(',').unwrap_or((v, ""));
        event.pid = pid.trim().trim_matches('\'').parse().ok();
        msg = tail.trim_start();
        if let Some(v) = msg.strip_prefix("name=") {
            let (name, tail) = v.split_once(", ").unwrap_or((v.trim_end_matches(','), ""));
            let name = name.trim();
            if !name.is_empty() && name != "<unknown>" {
                event.process = Some(name.to_owned());
            }
            msg = tail.trim_start();
        }
    }
    event.message = msg.trim_end().to_owned();
    if code == 154 {
        event.recovery_action = recovery_action(&event.message);
    }
    if code == 74 || (144..=150).contains(&code) {
        let fields = nvlink_fields(&event.message, code != 74);
        event.severity = severity_word(&event.message);
        event.nvlink5 = super::nvlink5::decode(
            code,
            fields.unit.as_deref(),
            event.severity.as_deref(),
            fields.link,
            fields.registers.get(1).and_then(|r| super::nvlink5::register(r)),
        );
        event.nvlink = Some(fields);
    }
    Some(event)
}

/// `nvidia-nvswitch3: SXid (PCI:0000:c8:00.0): 12028, Non-fatal, Link 32 egress ... (First)`
fn parse_sxid(line: &str, at: usize) -> Option<KernelEvent> {
    let rest = line[at + "SXid".len()..].trim_start();
    let (inside, after) = rest.strip_prefix('(')?.split_once(')')?;
    let after = after.strip_prefix(':')?.trim_start();
    let (code, after) = split_number(after)?;
    let mut event = KernelEvent::new(KernelEventKind::Sxid, after.strip_prefix(',').unwrap_or(after).trim());
    event.sxid = Some(code);
    event.pci_bus_id = normalize_pci(inside.trim().strip_prefix("PCI:").unwrap_or(inside.trim()));
    event.device = line[..at]
        .trim_end()
        .strip_suffix(':')
        .and_then(|head| head.split_whitespace().last())
        .filter(|d| d.starts_with("nvidia"))
        .map(str::to_owned);
    event.severity = severity_word(&event.message);
    let link = find_after_word(&event.message, "Link");
    if link.is_some() {
        event.nvlink = Some(NvlinkFields { link, ..Default::default() });
    }
    Some(event)
}

/// A continuation of an SXid record: same code and switch, and a `Severity`/`Data` body.
fn is_sxid_continuation(pending: &KernelEvent, next: &KernelEvent) -> bool {
    pending.kind == KernelEventKind::Sxid
        && pending.sxid == next.sxid
        && pending.pci_bus_id == next.pci_bus_id
        && (next.message.starts_with("Severity") || next.message.starts_with("Data"))
}

fn parse_gpu_lost(line: &str) -> KernelEvent {
    let body = line.find("NVRM:").map_or(line, |at| &line[at + "NVRM:".len()..]).trim();
    let mut event = KernelEvent::new(KernelEventKind::GpuLost, body);
    event.pci_bus_id = find_pci(body);
    event
}

/// `mce: [Hardware Error]: CPU 3: Machine Check Exception: 5 Bank 7: be000000...`,
/// `mce: [Hardware Error]: Machine check events logged`, `EDAC MC0: 1 UE memory read error on ...`.
fn parse_mce(line: &str) -> Option<KernelEvent> {
    if let Some(at) = line.find("EDAC ") {
        let body = line[at..].trim();
        let severity = if body.contains(" UE ") {
            "uncorrected"
        } else if body.contains(" CE ") {
            "corrected"
        } else {
            return None;
        };
        let mut event = KernelEvent::new(KernelEventKind::Mce, body);
        event.severity = Some(severity.to_owned());
        return Some(event);
    }
    let body = line[line.find("[Hardware Error]:")? + "[Hardware Error]:".len()..].trim();
    let header = body.contains("Bank") && (body.contains("Machine Check") || body.contains("Machine check"));
    if !header && !body.starts_with("Machine check events logged") {
        // Detail lines of a report already emitted (RIP, TSC, PROCESSOR, mcelog advice).
        return None;
    }
    let mut event = KernelEvent::new(KernelEventKind::Mce, body);
    event.cpu = find_after_word(body, "CPU");
    event.mce_bank = find_after_word(body, "Bank");
    Some(event)
}

/// `nvidia 0000:3b:00.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, ...` and
/// `pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:01:00.0`.
fn parse_aer(line: &str) -> Option<KernelEvent> {
    if let Some(at) = line.find("PCIe Bus Error") {
        let body = line[at..].trim();
        let mut event = KernelEvent::new(KernelEventKind::PcieAer, body);
        event.pci_bus_id = find_pci(&line[..at]);
        event.severity =
            body.split_once("severity=").map(|(_, s)| s.split(',').next().unwrap_or(s).trim()).map(snake_case);
        return Some(event);
    }
    let at = line.find("AER:")?;
    let body = line[at + "AER:".len()..].trim();
    if !body.contains("Uncorrected (Fatal) error received") {
        // Corrected and non-fatal errors are reported again, with detail, as "PCIe Bus Error".
        return None;
    }
    let mut event = KernelEvent::new(KernelEventKind::PcieAer, body);
    event.pci_bus_id =
        body.split_once("received:").and_then(|(_, dev)| find_pci(dev)).or_else(|| find_pci(&line[..at]));
    event.severity = Some("fatal".to_owned());
    Some(event)
}

/// Xid 154: `GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)`.
fn recovery_action(message: &str) -> Option<String> {
    let to = message.rsplit_once(" to ").map_or(message, |(_, t)| t);
    let (_, inner) = to.split_once('(')?;
    let (name, _) = inner.split_once(')')?;
    Some(snake_case(name))
}

fn nvlink_fields(message: &str, unit_first: bool) -> NvlinkFields {
    let link = find_after_word(message, "Link").or_else(|| find_after_word(message, "link"));
    let unit =
        if unit_first { message.split_whitespace().next().map(|u| u.trim_end_matches(',').to_owned()) } else { None };
    // `(0x... 0x...)`, or `[0x...]` from drivers before R575.
    let registers = message
        .split_once(['(', '['])
        .map(|(_, r)| r.split([')', ']']).next().unwrap_or(r))
        .map(|r| {
            r.split(|c: char| c == ',' || c.is_whitespace())
                .filter(|t| t.starts_with("0x"))
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    NvlinkFields { link, unit, registers }
}

/// `Fatal`, `Non-fatal`, `Nonfatal` among the first words of a message.
fn severity_word(message: &str) -> Option<String> {
    message.split(|c: char| c == ',' || c.is_whitespace()).take(6).find_map(|w| match w.to_ascii_lowercase().as_str() {
        "fatal" => Some("fatal".to_owned()),
        "non-fatal" | "nonfatal" => Some("non_fatal".to_owned()),
        _ => None,
    })
}

/// A leading decimal number and what follows it.
fn split_number(s: &str) -> Option<(u32, &str)> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    Some((s[..end].parse().ok()?, &s[end..]))
}

/// A MIG id: decimal, or hex when it has hex letters.
fn parse_id(s: &str) -> Option<u32> {
    s.parse().ok().or_else(|| u32::from_str_radix(s, 16).ok())
}

/// The number after `word ` (`Link 32`, `CPU 3:`, `Bank 7:`, `CPU12:`).
fn find_after_word(s: &str, word: &str) -> Option<u32> {
    let mut from = 0;
    while let Some(i) = s[from..].find(word) {
        let start = from + i;
        let before_ok = start == 0 || !s.as_bytes()[start - 1].is_ascii_alphanumeric();
        let tail = s[start + word.len()..].trim_start_matches([' ', '#']);
        if before_ok && let Some((n, _)) = split_number(tail) {
            return Some(n);
        }
        from = start + word.len();
    }
    None
}

/// Normalises `0000:3b:00`, `PCI:0002:00:00`, `00000000:3B:00.0` to `dddd:bb:dd.f` lowercase.
pub fn normalize_pci(raw: &str) -> Option<String> {
    let raw = raw.trim().trim_end_matches([':', ',', '.']);
    let (main, function) = match raw.rsplit_once('.') {
        Some((m, f)) => (m, u8::from_str_radix(f, 16).ok()?),
        None => (raw, 0),
    };
    let mut parts = main.split(':');
    let (domain, bus, device) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !(4..=8).contains(&domain.len()) || bus.len() != 2 || device.len() != 2 {
        return None;
    }
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let device = u8::from_str_radix(device, 16).ok()?;
    if domain > 0xffff || function > 7 || device > 0x1f {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

/// The first PCI address in free text.
fn find_pci(s: &str) -> Option<String> {
    s.split(|c: char| c.is_whitespace() || c == '(' || c == ')' || c == ',')
        .map(|t| t.strip_prefix("PCI:").unwrap_or(t))
        .find_map(normalize_pci)
}

fn snake_case(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.trim().chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('_') {
            out.push('_');
        }
    }
    out.trim_matches('_').to_owned()
}

#[cfg(test)]
mod tests;
