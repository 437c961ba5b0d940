//! Reading `/dev/kmsg` with a cursor that survives restarts.
//!
//! Each read of `/dev/kmsg` returns one record: `priority,sequence,timestamp_us,flags[,...];text`
//! followed by optional ` KEY=value` lines. Sequence numbers grow within a boot and restart at a
//! reboot, so the cursor saved to disk is the pair (boot id, last sequence handled): on start, a
//! matching boot id resumes after that sequence (nothing re-reported, nothing missed while the
//! ring buffer still holds it); a different boot id means the node rebooted, and the whole buffer
//! of the new boot is read.
//!
//! The kernel's records are also what an event's identity and time come from, never the moment
//! the collector read them: only records of the kernel facility count (a userspace write to
//! `/dev/kmsg` cannot claim it), an event's id is derived from (node, boot id, sequence number), so
//! re-reading a record gives the same id, and its time is the boot time plus the record's
//! timestamp. On a first run, records older than a look-back are not published as new faults.

use std::io::{self, BufRead as _, Read as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::events::{InternalEvent as _, KmsgRecordsLost};

/// What went wrong with the kernel log or its cursor.
#[derive(Debug, thiserror::Error)]
pub enum KmsgError {
    /// A record did not have the `priority,sequence,timestamp,flags;text` shape.
    #[error("malformed kmsg record: {0}")]
    Malformed(String),
    /// The cursor file could not be read or written.
    #[error("cursor file {path}: {source}")]
    Cursor {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// Reading the log failed.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The device or file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// The boot time could not be read from `/proc/stat`.
    #[error("no boot time (btime) in {0}")]
    BootTime(PathBuf),
}

/// The syslog facility of the kernel's own messages. Userspace writes to `/dev/kmsg` get the
/// facility they ask for, or `user` (1), never this one.
pub const KERNEL_FACILITY: u8 = 0;

/// The namespace of kernel-log event ids (UUID v5).
const EVENT_NAMESPACE: Uuid = Uuid::from_u128(0x6770_756d_6564_6963_6b6d_7367_6576_6e74);

/// The id of the event that the record `seq` of boot `boot_id` on `node` starts: the same however
/// often the record is read, so a re-read (a restart before the cursor was saved) is recognised
/// downstream as the event already seen.
pub fn event_id(node: &str, boot_id: &str, seq: u64) -> Uuid {
    Uuid::new_v5(&EVENT_NAMESPACE, format!("{node}\n{boot_id}\n{seq}").as_bytes())
}

/// The wall-clock time of a record: the boot time plus the record's timestamp (microseconds since
/// boot, as the kernel stamped it when it logged the line).
pub fn wall_time(boot_time_us: i64, timestamp_us: u64) -> DateTime<Utc> {
    let at = boot_time_us.saturating_add(i64::try_from(timestamp_us).unwrap_or(i64::MAX));
    DateTime::from_timestamp_micros(at).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// The boot time in microseconds since the epoch, from the `btime` line of `/proc/stat` (whole
/// seconds: the kernel's realtime clock minus the time since boot).
pub fn read_boot_time(proc_stat: &Path) -> Result<i64, KmsgError> {
    let text =
        std::fs::read_to_string(proc_stat).map_err(|source| KmsgError::Read { path: proc_stat.to_owned(), source })?;
    text.lines()
        .find_map(|l| l.strip_prefix("btime ").and_then(|v| v.trim().parse::<i64>().ok()))
        .map(|s| s.saturating_mul(1_000_000))
        .ok_or_else(|| KmsgError::BootTime(proc_stat.to_owned()))
}

/// One kernel log record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KmsgRecord {
    /// Syslog priority (0 emergency ... 7 debug).
    pub priority: u8,
    /// Syslog facility (0 is the kernel).
    pub facility: u8,
    /// Sequence number within this boot.
    pub seq: u64,
    /// Microseconds since boot (monotonic clock).
    pub timestamp_us: u64,
    /// The record's text, without the key/value lines.
    pub text: String,
}

impl KmsgRecord {
    /// Whether the kernel itself logged the record (not a userspace write to `/dev/kmsg`).
    pub fn is_kernel(&self) -> bool {
        self.facility == KERNEL_FACILITY
    }
}

/// Parses one record as `/dev/kmsg` returns it.
pub fn parse_record(raw: &[u8]) -> Result<KmsgRecord, KmsgError> {
    let raw = String::from_utf8_lossy(raw);
    let (header, body) = raw.split_once(';').ok_or_else(|| KmsgError::Malformed(truncate(&raw)))?;
    let mut fields = header.split(',');
    let mut number = |what: &str| -> Result<u64, KmsgError> {
        fields
            .next()
            .and_then(|f| f.trim().parse().ok())
            .ok_or_else(|| KmsgError::Malformed(format!("no {what} in '{}'", truncate(header))))
    };
    let prefix = number("priority")?;
    let seq = number("sequence")?;
    let timestamp_us = number("timestamp")?;
    // Continuation lines (` KEY=value`) describe the device; the text is the first line.
    let text = body.split('\n').next().unwrap_or("").to_owned();
    Ok(KmsgRecord { priority: (prefix & 7) as u8, facility: (prefix >> 3) as u8, seq, timestamp_us, text })
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

/// Where reading resumes: the saved (boot id, sequence) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// `/proc/sys/kernel/random/boot_id` when the cursor was saved.
    pub boot_id: String,
    /// The last sequence number whose events were published.
    pub seq: u64,
    /// The boot time (microseconds since the epoch) used for this boot's event times, kept so a
    /// restart gives a re-read record the same time even if the clock was stepped since.
    pub boot_time_us: Option<i64>,
}

impl Cursor {
    /// Reads the cursor file; `None` when there is none yet.
    pub fn load(path: &Path) -> Result<Option<Cursor>, KmsgError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(KmsgError::Cursor { path: path.to_owned(), source }),
        };
        let mut boot_id = None;
        let mut seq = None;
        let mut boot_time_us = None;
        for line in text.lines() {
            match line.split_once('=') {
                Some(("boot_id", v)) => boot_id = Some(v.trim().to_owned()),
                Some(("seq", v)) => seq = v.trim().parse().ok(),
                Some(("boot_time_us", v)) => boot_time_us = v.trim().parse().ok(),
                _ => {}
            }
        }
        match (boot_id, seq) {
            (Some(boot_id), Some(seq)) => Ok(Some(Cursor { boot_id, seq, boot_time_us })),
            // A torn or foreign file: start as after a reboot rather than guess.
            _ => Ok(None),
        }
    }

    /// Writes the cursor atomically (temporary file, fsync, rename), so a crash leaves either the
    /// old cursor or the new one.
    pub fn save(&self, path: &Path) -> Result<(), KmsgError> {
        use std::io::Write as _;
        let err = |source| KmsgError::Cursor { path: path.to_owned(), source };
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp).map_err(err)?;
        write!(f, "boot_id={}\nseq={}\n", self.boot_id, self.seq).map_err(err)?;
        if let Some(t) = self.boot_time_us {
            writeln!(f, "boot_time_us={t}").map_err(err)?;
        }
        f.sync_all().map_err(err)?;
        std::fs::rename(&tmp, path).map_err(err)
    }
}

/// What to do with the records of the current boot, given the saved cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// No cursor: the collector runs for the first time on this node; read the whole buffer.
    FirstRun,
    /// The boot id changed: the node rebooted; read the whole buffer of the new boot.
    Rebooted,
    /// Same boot: skip records up to and including this sequence number.
    After(u64),
}

impl Resume {
    /// Decides from the saved cursor and the current boot id.
    pub fn decide(saved: Option<&Cursor>, boot_id: &str) -> Resume {
        match saved {
            None => Resume::FirstRun,
            Some(c) if c.boot_id != boot_id => Resume::Rebooted,
            Some(c) => Resume::After(c.seq),
        }
    }

    /// Whether the record with sequence `seq` is new.
    pub fn wants(self, seq: u64) -> bool {
        match self {
            Resume::FirstRun | Resume::Rebooted => true,
            Resume::After(last) => seq > last,
        }
    }
}

/// Why a record read from the kernel log is not published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// Handled before the saved cursor: already published.
    Seen,
    /// Not of the kernel facility: a userspace write, which must not pass as a driver message.
    NotKernel,
    /// On a first run, older than the look-back: history, not a new fault.
    BeforeLookBack,
}

impl Skip {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::Seen => "seen",
            Skip::NotKernel => "not_kernel",
            Skip::BeforeLookBack => "before_look_back",
        }
    }
}

/// Which records of the log are published: the new ones (by the cursor) of the kernel facility,
/// and on a first run only those within the look-back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Where reading resumes.
    pub resume: Resume,
    /// On a first run, the oldest time a record may have to be published.
    pub first_run_since: Option<DateTime<Utc>>,
}

impl Admission {
    /// The admission for `resume`, started at `now`: on a first run, records from before
    /// `now - look_back` are history. After a reboot the whole new boot is read, as before.
    pub fn new(resume: Resume, now: DateTime<Utc>, look_back: Duration) -> Self {
        let first_run_since = (resume == Resume::FirstRun)
            .then(|| now - chrono::Duration::from_std(look_back).unwrap_or(chrono::Duration::MAX));
        Admission { resume, first_run_since }
    }

    /// Whether `record`, which happened at `at`, is published.
    pub fn check(&self, record: &KmsgRecord, at: DateTime<Utc>) -> Result<(), Skip> {
        if !self.resume.wants(record.seq) {
            return Err(Skip::Seen);
        }
        if !record.is_kernel() {
            return Err(Skip::NotKernel);
        }
        if self.first_run_since.is_some_and(|since| at < since) {
            return Err(Skip::BeforeLookBack);
        }
        Ok(())
    }
}

/// Reads records from `/dev/kmsg` (one per `read`), or from a file of records in its format (one
/// a line, as `cat /dev/kmsg` prints them), followed as it grows. Blocks until the next record
/// arrives, so it runs on a thread of its own.
pub struct KmsgReader {
    input: Input,
    path: PathBuf,
    buf: Vec<u8>,
}

enum Input {
    /// The kernel's device: one record per `read`.
    Device(std::fs::File),
    /// A file (or pipe) of records, one a line; `partial` holds a line not yet complete.
    Lines { reader: io::BufReader<std::fs::File>, partial: String },
}

impl KmsgReader {
    /// Opens the device (or a character device like it) at `path`, from the oldest record; any
    /// other file is read as lines of records, from its start.
    pub fn open(path: &Path) -> Result<Self, KmsgError> {
        use std::os::unix::fs::FileTypeExt as _;
        let err = |source| KmsgError::Read { path: path.to_owned(), source };
        let file = std::fs::File::open(path).map_err(err)?;
        let input = if file.metadata().map_err(err)?.file_type().is_char_device() {
            Input::Device(file)
        } else {
            Input::Lines { reader: io::BufReader::new(file), partial: String::new() }
        };
        // A record is at most 8 KiB (the kernel's CONSOLE_EXT_LOG_MAX).
        Ok(Self { input, path: path.to_owned(), buf: vec![0; 8192] })
    }

    /// The next record. When the ring buffer overwrote records before we read them, the kernel
    /// answers EPIPE once; that is counted and reading goes on with the oldest record left.
    pub fn next_record(&mut self) -> Result<KmsgRecord, KmsgError> {
        let file = match &mut self.input {
            Input::Device(file) => file,
            Input::Lines { reader, partial } => return next_line_record(reader, partial, &self.path),
        };
        loop {
            match file.read(&mut self.buf) {
                Ok(0) => {
                    return Err(KmsgError::Read {
                        path: self.path.clone(),
                        source: io::Error::new(io::ErrorKind::UnexpectedEof, "end of kernel log"),
                    });
                }
                Ok(n) => return parse_record(&self.buf[..n]),
                Err(e) if e.raw_os_error() == Some(32) => {
                    KmsgRecordsLost.emit();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(KmsgError::Read { path: self.path.clone(), source }),
            }
        }
    }
}

/// The next record of a file of records: waits for more at its end (a growing file), skips the
/// device's ` KEY=value` continuation lines and blank ones.
fn next_line_record(
    reader: &mut io::BufReader<std::fs::File>,
    partial: &mut String,
    path: &Path,
) -> Result<KmsgRecord, KmsgError> {
    loop {
        let n = reader.read_line(partial).map_err(|source| KmsgError::Read { path: path.to_owned(), source })?;
        if n == 0 {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        if !partial.ends_with('\n') {
            continue;
        }
        let line = std::mem::take(partial);
        if line.starts_with(' ') || line.trim().is_empty() {
            continue;
        }
        return parse_record(line.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse_with_and_without_device_lines() {
        let r = parse_record(
            b"3,1342,5523234118,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.\n",
        )
        .unwrap();
        assert_eq!((r.priority, r.facility, r.seq, r.timestamp_us), (3, 0, 1342, 5_523_234_118));
        assert!(r.text.starts_with("NVRM: Xid"));
        let r = parse_record(b"6,339,5140900,-,caller=T1;pcieport 0000:00:01.0: AER: enabled\n SUBSYSTEM=pci\n DEVICE=+pci:0000:00:01.0\n").unwrap();
        assert_eq!(r.seq, 339);
        assert_eq!(r.text, "pcieport 0000:00:01.0: AER: enabled");
        let r = parse_record(b"30,7,100,-;systemd[1]: started\n").unwrap();
        assert_eq!((r.priority, r.facility), (6, 3));
        assert!(parse_record(b"no header here").is_err());
        assert!(parse_record(b"x,y,z;text").is_err());
    }

    #[test]
    fn cursor_round_trips_and_decides_resume() {
        let dir = std::env::temp_dir().join(format!("gpumedic-cursor-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kmsg.cursor");
        let _ = std::fs::remove_file(&path);
        assert_eq!(Cursor::load(&path).unwrap(), None);
        assert_eq!(Resume::decide(None, "boot-a"), Resume::FirstRun);

        let c = Cursor { boot_id: "boot-a".into(), seq: 41, boot_time_us: Some(1_764_547_200_000_000) };
        c.save(&path).unwrap();
        let loaded = Cursor::load(&path).unwrap().expect("saved");
        assert_eq!(loaded, c);

        // Same boot: resume after 41, so 41 is not reported again and 42 is not missed.
        let same = Resume::decide(Some(&loaded), "boot-a");
        assert_eq!(same, Resume::After(41));
        assert!(!same.wants(41) && same.wants(42));
        // New boot: sequence numbers restarted; read everything.
        let rebooted = Resume::decide(Some(&loaded), "boot-b");
        assert_eq!(rebooted, Resume::Rebooted);
        assert!(rebooted.wants(0));

        // A cursor saved before boot times were kept still resumes.
        std::fs::write(&path, "boot_id=boot-a\nseq=41\n").unwrap();
        assert_eq!(Cursor::load(&path).unwrap(), Some(Cursor { boot_time_us: None, ..c }));

        std::fs::write(&path, "garbage").unwrap();
        assert_eq!(Cursor::load(&path).unwrap(), None, "a torn cursor reads as none");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn record(prefix: u64, seq: u64) -> KmsgRecord {
        let raw = format!("{prefix},{seq},5523234118,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n");
        parse_record(raw.as_bytes()).unwrap()
    }

    #[test]
    fn only_the_kernel_facility_counts() {
        // The kernel's own Xid line (priority 3, facility 0).
        assert!(record(3, 1).is_kernel());
        // `echo '<3>NVRM: Xid ...' > /dev/kmsg` from userspace: the kernel files it under `user`
        // (facility 1, prefix 11); a writer that asks for another facility gets that one.
        assert!(!record(11, 2).is_kernel());
        assert!(!record(30, 3).is_kernel());
        let all = Admission::new(Resume::Rebooted, Utc::now(), Duration::from_secs(600));
        assert_eq!(all.check(&record(11, 2), Utc::now()), Err(Skip::NotKernel));
        assert_eq!(all.check(&record(3, 2), Utc::now()), Ok(()));
    }

    #[test]
    fn event_ids_are_derived_from_node_boot_and_sequence() {
        let id = event_id("gpu-1", "boot-a", 1342);
        assert_eq!(id, event_id("gpu-1", "boot-a", 1342), "a re-read record has the same id");
        assert_eq!(id.get_version_num(), 5);
        assert_ne!(id, event_id("gpu-1", "boot-a", 1343));
        assert_ne!(id, event_id("gpu-1", "boot-b", 1342), "sequence numbers restart at a reboot");
        assert_ne!(id, event_id("gpu-2", "boot-a", 1342));
    }

    #[test]
    fn a_records_time_is_the_boot_time_plus_its_timestamp() {
        let boot = DateTime::parse_from_rfc3339("2026-12-01T00:00:00Z").unwrap().with_timezone(&Utc);
        let r = record(3, 1);
        let at = wall_time(boot.timestamp_micros(), r.timestamp_us);
        assert_eq!(at, boot + chrono::Duration::microseconds(5_523_234_118));
        assert_eq!(wall_time(i64::MAX, u64::MAX), DateTime::<Utc>::MAX_UTC, "never wraps");

        let dir = std::env::temp_dir().join(format!("gpumedic-btime-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let stat = dir.join("stat");
        std::fs::write(&stat, "cpu  1 2 3\nintr 5\nbtime 1764547200\nprocesses 9\n").unwrap();
        assert_eq!(read_boot_time(&stat).unwrap(), 1_764_547_200_000_000);
        std::fs::write(&stat, "cpu  1 2 3\n").unwrap();
        assert!(matches!(read_boot_time(&stat), Err(KmsgError::BootTime(_))));
        std::fs::remove_dir_all(&dir).unwrap();
        let here = read_boot_time(Path::new("/proc/stat")).expect("this machine's boot time");
        assert!(here > 0 && here < Utc::now().timestamp_micros());
    }

    #[test]
    fn a_first_run_publishes_only_records_within_the_look_back() {
        let now = DateTime::parse_from_rfc3339("2026-12-01T12:00:00Z").unwrap().with_timezone(&Utc);
        let look_back = Duration::from_secs(600);
        let first = Admission::new(Resume::FirstRun, now, look_back);
        let r = record(3, 7);
        assert_eq!(first.check(&r, now - chrono::Duration::minutes(11)), Err(Skip::BeforeLookBack));
        assert_eq!(first.check(&r, now - chrono::Duration::minutes(9)), Ok(()));
        // After a reboot every record is of the new boot, and new: all of it is read.
        let rebooted = Admission::new(Resume::Rebooted, now, look_back);
        assert_eq!(rebooted.check(&r, now - chrono::Duration::hours(3)), Ok(()));
        // Same boot: the cursor decides, whatever the time.
        let same = Admission::new(Resume::After(7), now, look_back);
        assert_eq!(same.check(&r, now), Err(Skip::Seen));
        assert_eq!(same.check(&record(3, 8), now - chrono::Duration::hours(3)), Ok(()));
    }

    #[test]
    fn a_file_of_records_is_read_line_by_line_as_it_grows() {
        use std::io::Write as _;
        let dir = std::env::temp_dir().join(format!("gpumedic-kmsg-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kmsg");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(b"6,339,5140900,-;pcieport 0000:00:01.0: AER: enabled\n SUBSYSTEM=pci\n\n3,340,5140901,-;NVRM: Xi")
            .unwrap();
        let mut reader = KmsgReader::open(&path).unwrap();
        let first = reader.next_record().unwrap();
        assert_eq!((first.seq, first.text.as_str()), (339, "pcieport 0000:00:01.0: AER: enabled"));
        // The rest of a line written later completes it.
        f.write_all(b"d (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n").unwrap();
        let second = reader.next_record().unwrap();
        assert_eq!(second.seq, 340);
        assert!(second.text.starts_with("NVRM: Xid (PCI:0000:3b:00): 79"), "{}", second.text);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reads_this_machines_kernel_log() {
        // /dev/kmsg is readable by root, which is how the collector runs (and how CI runs).
        let mut reader = KmsgReader::open(Path::new("/dev/kmsg")).expect("open /dev/kmsg (run as root)");
        let first = reader.next_record().expect("the kernel log has at least one record");
        let second = reader.next_record().expect("and a second");
        assert!(second.seq > first.seq, "sequence numbers grow: {} then {}", first.seq, second.seq);
    }
}
