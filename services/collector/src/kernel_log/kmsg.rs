//! Reading `/dev/kmsg` with a cursor that survives restarts.
//!
//! Each read of `/dev/kmsg` returns one record: `priority,sequence,timestamp_us,flags[,...];text`
//! followed by optional ` KEY=value` lines. Sequence numbers grow within a boot and restart at a
//! reboot, so the cursor saved to disk is the pair (boot id, last sequence handled): on start, a
//! matching boot id resumes after that sequence (nothing re-reported, nothing missed while the
//! ring buffer still holds it); a different boot id means the node rebooted, and the whole buffer
//! of the new boot is read.

use std::io::{self, Read as _};
use std::path::{Path, PathBuf};

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
        for line in text.lines() {
            match line.split_once('=') {
                Some(("boot_id", v)) => boot_id = Some(v.trim().to_owned()),
                Some(("seq", v)) => seq = v.trim().parse().ok(),
                _ => {}
            }
        }
        match (boot_id, seq) {
            (Some(boot_id), Some(seq)) => Ok(Some(Cursor { boot_id, seq })),
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

/// Reads records from `/dev/kmsg` (one per `read`). Blocks until the next record arrives, so it
/// runs on a thread of its own.
pub struct KmsgReader {
    file: std::fs::File,
    path: PathBuf,
    buf: Vec<u8>,
}

impl KmsgReader {
    /// Opens the device (or a character device like it) at `path`, from the oldest record.
    pub fn open(path: &Path) -> Result<Self, KmsgError> {
        let file = std::fs::File::open(path).map_err(|source| KmsgError::Read { path: path.to_owned(), source })?;
        // A record is at most 8 KiB (the kernel's CONSOLE_EXT_LOG_MAX).
        Ok(Self { file, path: path.to_owned(), buf: vec![0; 8192] })
    }

    /// The next record. When the ring buffer overwrote records before we read them, the kernel
    /// answers EPIPE once; that is counted and reading goes on with the oldest record left.
    pub fn next_record(&mut self) -> Result<KmsgRecord, KmsgError> {
        loop {
            match self.file.read(&mut self.buf) {
                Ok(0) => {
                    return Err(KmsgError::Read {
                        path: self.path.clone(),
                        source: io::Error::new(io::ErrorKind::UnexpectedEof, "end of kernel log"),
                    });
                }
                Ok(n) => return parse_record(&self.buf[..n]),
                Err(e) if e.raw_os_error() == Some(32) => {
                    metrics::counter!("gpumedic_collector_kmsg_records_lost_total").increment(1);
                    tracing::warn!("Kernel log records were overwritten before they were read.");
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(KmsgError::Read { path: self.path.clone(), source }),
            }
        }
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

        let c = Cursor { boot_id: "boot-a".into(), seq: 41 };
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

        std::fs::write(&path, "garbage").unwrap();
        assert_eq!(Cursor::load(&path).unwrap(), None, "a torn cursor reads as none");
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
