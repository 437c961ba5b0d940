//! The on-disk spool: where health events wait while Kafka cannot take them, bounded in bytes,
//! surviving a restart, and drained in the order the events were spooled.
//!
//! # Layout
//! A folder (`<state-dir>/spool`) of append-only segment files named by a 20-digit sequence
//! number (`00000000000000000007.seg`), oldest first. Each segment starts with an 8-byte magic
//! ([`MAGIC`]) and holds framed records:
//!
//! ```text
//! u32 LE payload length | u32 LE CRC-32C of the payload | payload
//! payload = u8 flags (bit 0: droppable) | u16 LE key length | key | u16 LE id length | id
//!         | u16 LE kind length | kind | value (the Confluent-framed Avro record, as produced)
//! ```
//!
//! The record carries the Kafka key, the event id and the finished value, so draining needs no
//! decoding and survives a schema upgrade between the spooling and the draining collector.
//!
//! # Durability
//! [`Spool::sync`] fsyncs the active segment; the publisher calls it once per batch of appends,
//! before it tells any source that its events are safe (the kernel-log cursor is saved, an ingest
//! call answers). A new segment and a rewritten one also fsync their folder. A crash may tear the
//! last record being written: [`Spool::open`] finds it by its length or checksum, truncates the
//! segment there and counts it in `gpumedic_collector_spool_truncated_total`; it never panics on
//! a bad file.
//!
//! # Bound
//! The segment files together stay under `max_bytes`. When an append would exceed it, the oldest
//! segment that holds droppable records (healthy evidence: heartbeats, recoveries) not yet sent is
//! rewritten without them, counted by kind in `gpumedic_collector_spool_dropped_total`. When only
//! faults remain, a droppable record is dropped itself and a fault is refused
//! ([`SpoolError::Full`]): the publisher then stops taking events until the spool drains.
//!
//! # Draining
//! Records are handed out in order ([`Spool::next_unsent`]), acknowledged in the same order
//! ([`Spool::ack`]); a segment file is deleted only once every record in it is acknowledged.
//! After a failed send, [`Spool::rewind`] hands out the first unacknowledged record again. A crash
//! between Kafka's acknowledgement and the segment's deletion sends that segment's acknowledged
//! records again after the restart: consumers deduplicate on the event id.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use crate::events::{InternalEvent as _, SpoolFull, SpoolTruncated, names};

/// The first bytes of every segment file (format version 1).
pub const MAGIC: &[u8; 8] = b"GPMSPL1\n";
const FRAME_HEADER: u64 = 8;
/// No valid record is larger: a length above it means the frame is torn or corrupt.
const MAX_PAYLOAD: u32 = 16 * 1024 * 1024;
const CRC: crc::Crc<u32> = crc::Crc::<u32>::new(&crc::CRC_32_ISCSI);

/// One event as the spool keeps it: everything needed to produce it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolRecord {
    /// The Kafka key (the node name).
    pub key: String,
    /// The event id (the `gpumedic.event-id` header).
    pub id: String,
    /// The event kind, for metric labels.
    pub kind: String,
    /// Healthy evidence that may be dropped first when the spool is full.
    pub droppable: bool,
    /// The record value, exactly as produced.
    pub value: Vec<u8>,
}

impl SpoolRecord {
    fn payload(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(7 + self.key.len() + self.id.len() + self.kind.len() + self.value.len());
        p.push(u8::from(self.droppable));
        for s in [&self.key, &self.id, &self.kind] {
            let bytes = &s.as_bytes()[..s.len().min(usize::from(u16::MAX))];
            p.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
            p.extend_from_slice(bytes);
        }
        p.extend_from_slice(&self.value);
        p
    }

    fn from_payload(p: &[u8]) -> Option<Self> {
        let (&flags, mut rest) = p.split_first()?;
        let mut field = || -> Option<String> {
            let (len, tail) = rest.split_first_chunk::<2>()?;
            let len = usize::from(u16::from_le_bytes(*len));
            let (s, tail) = (tail.get(..len)?, tail.get(len..)?);
            rest = tail;
            String::from_utf8(s.to_vec()).ok()
        };
        let (key, id, kind) = (field()?, field()?, field()?);
        Some(Self { key, id, kind, droppable: flags & 1 == 1, value: rest.to_vec() })
    }

    fn frame(&self) -> Vec<u8> {
        let payload = self.payload();
        let mut f = Vec::with_capacity(payload.len() + 8);
        f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        f.extend_from_slice(&CRC.checksum(&payload).to_le_bytes());
        f.extend_from_slice(&payload);
        f
    }
}

/// What became of an appended record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    /// It is in the spool (durable after the next [`Spool::sync`]).
    Stored,
    /// The spool is full of faults and the record was droppable: it was dropped and counted.
    Dropped,
}

/// What went wrong with the spool.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    /// The spool is full and holds nothing that may be dropped; the record was not stored.
    #[error("the spool is full ({bytes} of {max} bytes) and holds only faults")]
    Full {
        /// Bytes in use.
        bytes: u64,
        /// The bound.
        max: u64,
    },
    /// A record alone is larger than the whole spool.
    #[error("a record of {0} bytes does not fit in the spool at all")]
    TooLarge(u64),
    /// Another collector process uses the same spool folder.
    #[error("the spool {0} is in use by another collector process")]
    InUse(PathBuf),
    /// A file operation failed.
    #[error("spool file {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SpoolError + '_ {
    move |source| SpoolError::Io { path: path.to_owned(), source }
}

#[derive(Debug, Clone)]
struct Meta {
    seq: u64,
    offset: u64,
    len: u64,
    droppable: bool,
    kind: String,
}

#[derive(Debug)]
struct Segment {
    id: u64,
    path: PathBuf,
    records: VecDeque<Meta>,
    size: u64,
}

/// The spool folder, opened by one collector process at a time.
pub struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    segment_bytes: u64,
    segments: VecDeque<Segment>,
    /// The newest segment, open for appends (`None`: the next append starts a new segment).
    writer: Option<File>,
    reader: Option<(u64, File)>,
    next_seq: u64,
    /// The next record [`Spool::next_unsent`] hands out.
    cursor: u64,
    bytes: u64,
    records: usize,
    dirty: bool,
    // Held for the process's life: a second collector on the same folder fails to claim it.
    _lock: std::os::unix::net::UnixListener,
}

impl std::fmt::Debug for Spool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spool")
            .field("dir", &self.dir)
            .field("bytes", &self.bytes)
            .field("records", &self.records)
            .finish_non_exhaustive()
    }
}

impl Spool {
    /// Opens (creating it when missing) the spool in `dir`, bounded by `max_bytes`: recovers the
    /// segments a previous process left, truncating a torn last record.
    ///
    /// # Errors
    /// [`SpoolError::InUse`] when another live collector holds the folder, [`SpoolError::Io`].
    pub fn open(dir: &Path, max_bytes: u64) -> Result<Self, SpoolError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let lock_path = dir.join("lock.sock");
        let lock = crate::socket_claim::claim_socket(&lock_path).map_err(|e| match e {
            crate::socket_claim::ClaimError::InUse(p) => SpoolError::InUse(p),
            crate::socket_claim::ClaimError::Io { path, source } => SpoolError::Io { path, source },
        })?;
        // Small enough that a drained segment frees its bytes soon, large enough to keep the
        // file count low.
        let segment_bytes = (max_bytes / 16).clamp(64 * 1024, 8 * 1024 * 1024);
        let mut spool = Self {
            dir: dir.to_owned(),
            max_bytes,
            segment_bytes,
            segments: VecDeque::new(),
            writer: None,
            reader: None,
            next_seq: 0,
            cursor: 0,
            bytes: 0,
            records: 0,
            dirty: false,
            _lock: lock,
        };
        spool.recover()?;
        spool.report();
        Ok(spool)
    }

    fn recover(&mut self) -> Result<(), SpoolError> {
        let mut ids: Vec<u64> = std::fs::read_dir(&self.dir)
            .map_err(io(&self.dir))?
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str()?.strip_suffix(".seg")?.parse().ok())
            .collect();
        ids.sort_unstable();
        for id in ids {
            let path = self.segment_path(id);
            let data = std::fs::read(&path).map_err(io(&path))?;
            if data.len() < MAGIC.len() || &data[..MAGIC.len()] != MAGIC {
                // A segment torn while its header was written holds nothing; anything else with
                // a foreign header is set aside rather than read or deleted.
                if data.len() < MAGIC.len() && MAGIC.starts_with(&data) {
                    std::fs::remove_file(&path).map_err(io(&path))?;
                } else {
                    let aside = path.with_extension("corrupt");
                    tracing::error!(path = %path.display(), aside = %aside.display(), "A spool segment has no valid header; setting it aside, its events are not sent.");
                    std::fs::rename(&path, &aside).map_err(io(&path))?;
                }
                continue;
            }
            let (records, valid_len) = scan(&data, &mut self.next_seq);
            if valid_len < data.len() as u64 {
                let torn = data.len() as u64 - valid_len;
                SpoolTruncated { path: &path.display(), bytes: torn }.emit();
                let f = OpenOptions::new().write(true).open(&path).map_err(io(&path))?;
                f.set_len(valid_len).map_err(io(&path))?;
                f.sync_all().map_err(io(&path))?;
            }
            if records.is_empty() {
                std::fs::remove_file(&path).map_err(io(&path))?;
                continue;
            }
            self.records += records.len();
            self.bytes += valid_len;
            self.segments.push_back(Segment { id, path, records, size: valid_len });
        }
        self.cursor = self.first_seq().unwrap_or(self.next_seq);
        if self.records > 0 {
            tracing::info!(
                records = self.records,
                bytes = self.bytes,
                "Found spooled events from before the restart; they are sent first."
            );
        }
        Ok(())
    }

    fn segment_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id:020}.seg"))
    }

    /// True when no record is waiting (every spooled record was acknowledged or dropped).
    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    /// Records waiting (sent or not, not yet acknowledged).
    pub fn len(&self) -> usize {
        self.records
    }

    /// Bytes of segment files on disk.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// True when a record not yet handed out by [`Spool::next_unsent`] is waiting.
    pub fn has_unsent(&self) -> bool {
        self.segments.back().and_then(|s| s.records.back()).is_some_and(|m| m.seq >= self.cursor)
    }

    fn first_seq(&self) -> Option<u64> {
        self.segments.front().and_then(|s| s.records.front()).map(|m| m.seq)
    }

    fn report(&self) {
        metrics::gauge!(names::SPOOL_BYTES).set(self.bytes as f64);
        metrics::gauge!(names::SPOOL_RECORDS).set(self.records as f64);
    }

    /// Appends `record`, making room by dropping the oldest unsent droppable records when the
    /// spool is full. Durable after the next [`Spool::sync`].
    ///
    /// # Errors
    /// [`SpoolError::Full`] for a fault when only faults remain, [`SpoolError::TooLarge`],
    /// [`SpoolError::Io`].
    pub fn append(&mut self, record: &SpoolRecord) -> Result<Appended, SpoolError> {
        let frame = record.frame();
        let len = frame.len() as u64;
        if len + MAGIC.len() as u64 > self.max_bytes {
            return Err(SpoolError::TooLarge(len));
        }
        while self.bytes + len + MAGIC.len() as u64 > self.max_bytes {
            if !self.drop_oldest_droppable()? {
                if record.droppable {
                    count_dropped(&record.kind, 1);
                    return Ok(Appended::Dropped);
                }
                return Err(SpoolError::Full { bytes: self.bytes, max: self.max_bytes });
            }
        }
        let roll = match (&self.writer, self.segments.back()) {
            (Some(_), Some(last)) => last.size + len > self.segment_bytes,
            _ => true,
        };
        if roll {
            self.start_segment()?;
        }
        let seg = self.segments.back_mut().expect("a segment is open");
        let writer = self.writer.as_mut().expect("a segment is open");
        writer.write_all(&frame).map_err(io(&seg.path))?;
        seg.records.push_back(Meta {
            seq: self.next_seq,
            offset: seg.size,
            len,
            droppable: record.droppable,
            kind: record.kind.clone(),
        });
        seg.size += len;
        self.next_seq += 1;
        self.bytes += len;
        self.records += 1;
        self.dirty = true;
        self.report();
        Ok(Appended::Stored)
    }

    fn start_segment(&mut self) -> Result<(), SpoolError> {
        self.sync()?;
        let id = self.segments.back().map_or(0, |s| s.id + 1);
        let path = self.segment_path(id);
        let mut f = OpenOptions::new().create(true).truncate(true).write(true).open(&path).map_err(io(&path))?;
        f.write_all(MAGIC).map_err(io(&path))?;
        self.sync_dir()?;
        self.bytes += MAGIC.len() as u64;
        self.segments.push_back(Segment { id, path, records: VecDeque::new(), size: MAGIC.len() as u64 });
        self.writer = Some(f);
        self.dirty = true;
        Ok(())
    }

    fn sync_dir(&self) -> Result<(), SpoolError> {
        File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io(&self.dir))
    }

    /// Makes every append so far durable (fsync of the active segment).
    ///
    /// # Errors
    /// [`SpoolError::Io`].
    pub fn sync(&mut self) -> Result<(), SpoolError> {
        if self.dirty
            && let (Some(w), Some(seg)) = (&self.writer, self.segments.back())
        {
            w.sync_data().map_err(io(&seg.path))?;
        }
        self.dirty = false;
        Ok(())
    }

    /// The next record to send, in spool order, and its sequence number for [`Spool::ack`].
    ///
    /// # Errors
    /// [`SpoolError::Io`] when the segment cannot be read.
    pub fn next_unsent(&mut self) -> Result<Option<(u64, SpoolRecord)>, SpoolError> {
        let cursor = self.cursor;
        let Some((seg_id, path, meta)) = self.segments.iter().find_map(|s| {
            let i = s.records.partition_point(|m| m.seq < cursor);
            s.records.get(i).map(|m| (s.id, s.path.clone(), m.clone()))
        }) else {
            return Ok(None);
        };
        if self.reader.as_ref().is_none_or(|(id, _)| *id != seg_id) {
            self.reader = Some((seg_id, File::open(&path).map_err(io(&path))?));
        }
        let (_, file) = self.reader.as_ref().expect("opened above");
        let mut frame = vec![0u8; meta.len as usize];
        file.read_exact_at(&mut frame, meta.offset).map_err(io(&path))?;
        let record = SpoolRecord::from_payload(&frame[FRAME_HEADER as usize..]).ok_or_else(|| SpoolError::Io {
            path: path.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, "a checked record no longer decodes"),
        })?;
        self.cursor = meta.seq + 1;
        Ok(Some((meta.seq, record)))
    }

    /// Hands out the first unacknowledged record again next (after a failed send).
    pub fn rewind(&mut self) {
        self.cursor = self.first_seq().unwrap_or(self.next_seq);
    }

    /// Acknowledges the oldest record, which must be `seq`; deletes its segment file once every
    /// record in it is acknowledged. Returns whether `seq` was the oldest record (a record
    /// dropped or acknowledged meanwhile is ignored).
    ///
    /// # Errors
    /// [`SpoolError::Io`] when a drained segment cannot be deleted.
    pub fn ack(&mut self, seq: u64) -> Result<bool, SpoolError> {
        let Some(front) = self.segments.front_mut() else { return Ok(false) };
        if front.records.front().is_none_or(|m| m.seq != seq) {
            return Ok(false);
        }
        front.records.pop_front();
        self.records -= 1;
        if front.records.is_empty() {
            let done = self.segments.pop_front().expect("front exists");
            if self.segments.is_empty() {
                // It was the active segment: the next append starts a fresh one.
                self.writer = None;
                self.dirty = false;
            }
            if self.reader.as_ref().is_some_and(|(id, _)| *id == done.id) {
                self.reader = None;
            }
            std::fs::remove_file(&done.path).map_err(io(&done.path))?;
            self.bytes -= done.size;
        }
        self.report();
        Ok(true)
    }

    /// Rewrites the oldest segment holding unsent droppable records without them. False when
    /// there is none.
    fn drop_oldest_droppable(&mut self) -> Result<bool, SpoolError> {
        let cursor = self.cursor;
        let Some(index) = self.segments.iter().position(|s| s.records.iter().any(|m| m.droppable && m.seq >= cursor))
        else {
            return Ok(false);
        };
        let is_active = index + 1 == self.segments.len() && self.writer.is_some();
        if is_active {
            self.sync()?;
        }
        let seg = &self.segments[index];
        let data = std::fs::read(&seg.path).map_err(io(&seg.path))?;
        let mut out = Vec::with_capacity(data.len());
        out.extend_from_slice(MAGIC);
        let mut kept = VecDeque::new();
        let mut dropped: Vec<&str> = Vec::new();
        for m in &seg.records {
            if m.droppable && m.seq >= cursor {
                dropped.push(&m.kind);
                continue;
            }
            let frame = &data[m.offset as usize..(m.offset + m.len) as usize];
            kept.push_back(Meta { offset: out.len() as u64, ..m.clone() });
            out.extend_from_slice(frame);
        }
        let mut by_kind: Vec<(&str, u64)> = Vec::new();
        for k in dropped {
            match by_kind.iter_mut().find(|(kind, _)| *kind == k) {
                Some((_, n)) => *n += 1,
                None => by_kind.push((k, 1)),
            }
        }
        SpoolFull { dropped: &by_kind, segment: seg.id }.emit();
        let tmp = seg.path.with_extension("tmp");
        let path = seg.path.clone();
        {
            let mut f = File::create(&tmp).map_err(io(&tmp))?;
            f.write_all(&out).map_err(io(&tmp))?;
            f.sync_all().map_err(io(&tmp))?;
        }
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        self.sync_dir()?;
        let seg = &mut self.segments[index];
        let removed = seg.records.len() - kept.len();
        self.bytes = self.bytes - seg.size + out.len() as u64;
        self.records -= removed;
        seg.size = out.len() as u64;
        seg.records = kept;
        if self.reader.as_ref().is_some_and(|(id, _)| *id == seg.id) {
            self.reader = None;
        }
        if is_active {
            self.writer = Some(OpenOptions::new().append(true).open(&path).map_err(io(&path))?);
        }
        if seg.records.is_empty() && !is_active {
            let seg = self.segments.remove(index).expect("index is valid");
            std::fs::remove_file(&seg.path).map_err(io(&seg.path))?;
            self.bytes -= seg.size;
        }
        self.report();
        Ok(true)
    }
}

fn count_dropped(kind: &str, n: u64) {
    metrics::counter!(names::SPOOL_DROPPED_TOTAL, "kind" => kind.to_owned()).increment(n);
}

/// Reads the valid records of a segment; returns them and the length of the valid prefix (where
/// the first torn or corrupt frame starts).
fn scan(data: &[u8], next_seq: &mut u64) -> (VecDeque<Meta>, u64) {
    let mut records = VecDeque::new();
    let mut at = MAGIC.len();
    while let Some(header) = data.get(at..at + FRAME_HEADER as usize) {
        let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(header[4..].try_into().expect("4 bytes"));
        if len == 0 || len > MAX_PAYLOAD {
            break;
        }
        let start = at + FRAME_HEADER as usize;
        let Some(payload) = data.get(start..start + len as usize) else { break };
        if CRC.checksum(payload) != crc {
            break;
        }
        let Some(record) = SpoolRecord::from_payload(payload) else { break };
        records.push_back(Meta {
            seq: *next_seq,
            offset: at as u64,
            len: FRAME_HEADER + u64::from(len),
            droppable: record.droppable,
            kind: record.kind,
        });
        *next_seq += 1;
        at = start + len as usize;
    }
    (records, at.min(data.len()) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        std::env::temp_dir().join(format!("gpumedic-spool-{}", uuid::Uuid::new_v4().simple()))
    }

    fn record(i: usize, droppable: bool) -> SpoolRecord {
        SpoolRecord {
            key: "node-1".into(),
            id: format!("id-{i}"),
            kind: if droppable { "MonitorHealth" } else { "Xid" }.into(),
            droppable,
            value: vec![i as u8; 100],
        }
    }

    fn drain(spool: &mut Spool) -> Vec<String> {
        let mut ids = Vec::new();
        while let Some((seq, r)) = spool.next_unsent().unwrap() {
            ids.push(r.id);
            assert!(spool.ack(seq).unwrap());
        }
        ids
    }

    #[test]
    fn records_survive_a_reopen_and_drain_in_order() {
        let d = dir();
        {
            let mut s = Spool::open(&d, 1 << 20).unwrap();
            for i in 0..50 {
                assert_eq!(s.append(&record(i, i % 2 == 0)).unwrap(), Appended::Stored);
            }
            s.sync().unwrap();
        }
        let mut s = Spool::open(&d, 1 << 20).unwrap();
        assert_eq!(s.len(), 50);
        let got = drain(&mut s);
        assert_eq!(got, (0..50).map(|i| format!("id-{i}")).collect::<Vec<_>>());
        assert!(s.is_empty());
        assert_eq!(s.bytes(), 0, "drained segments are deleted");
        let left: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "seg"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        drop(s);
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn a_second_process_cannot_open_the_same_spool() {
        let d = dir();
        let _first = Spool::open(&d, 1 << 20).unwrap();
        assert!(matches!(Spool::open(&d, 1 << 20), Err(SpoolError::InUse(_))));
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn a_torn_last_record_is_truncated_not_fatal() {
        let d = dir();
        {
            let mut s = Spool::open(&d, 1 << 20).unwrap();
            for i in 0..3 {
                s.append(&record(i, false)).unwrap();
            }
            s.sync().unwrap();
        }
        let seg = d.join(format!("{:020}.seg", 0));
        let full = std::fs::read(&seg).unwrap();
        // A crash in the middle of the third record, then garbage from a crash in a checksum.
        std::fs::write(&seg, &full[..full.len() - 30]).unwrap();
        let mut s = Spool::open(&d, 1 << 20).unwrap();
        assert_eq!(drain(&mut s), ["id-0", "id-1"]);
        drop(s);
        {
            let mut s = Spool::open(&d, 1 << 20).unwrap();
            s.append(&record(7, false)).unwrap();
            s.sync().unwrap();
        }
        let seg = std::fs::read_dir(&d)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "seg"))
            .unwrap();
        let mut bytes = std::fs::read(&seg).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&seg, &bytes).unwrap();
        let s = Spool::open(&d, 1 << 20).unwrap();
        assert!(s.is_empty(), "the corrupt record is not handed out");
        drop(s);
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn a_full_spool_drops_the_oldest_heartbeats_first_and_never_faults() {
        let d = dir();
        // Room for about 20 records of ~130 bytes.
        let mut s = Spool::open(&d, 64 * 1024).unwrap();
        let mut i = 0;
        let frame = record(0, true).frame().len() as u64;
        let capacity = ((64 * 1024 - MAGIC.len() as u64) / frame) as usize;
        // Heartbeats first, then faults until the spool is full.
        for _ in 0..capacity / 2 {
            s.append(&record(i, true)).unwrap();
            i += 1;
        }
        let mut faults = Vec::new();
        loop {
            faults.push(format!("id-{i}"));
            match s.append(&record(i, false)) {
                Ok(Appended::Stored) => i += 1,
                Ok(Appended::Dropped) => unreachable!("faults are never dropped"),
                Err(SpoolError::Full { .. }) => {
                    faults.pop();
                    break;
                }
                Err(e) => panic!("{e}"),
            }
            assert!(i < 10 * capacity, "the spool never filled up");
        }
        assert!(s.bytes() <= 64 * 1024);
        assert_eq!(s.append(&record(i + 1, true)).unwrap(), Appended::Dropped, "a heartbeat into a spool of faults");
        let got = drain(&mut s);
        assert_eq!(got, faults, "every fault kept, in order; the heartbeats made room");
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn rewind_hands_out_unacknowledged_records_again() {
        let d = dir();
        let mut s = Spool::open(&d, 1 << 20).unwrap();
        for i in 0..3 {
            s.append(&record(i, false)).unwrap();
        }
        let (a, _) = s.next_unsent().unwrap().unwrap();
        let _ = s.next_unsent().unwrap().unwrap();
        assert!(s.ack(a).unwrap());
        s.rewind();
        assert_eq!(drain(&mut s), ["id-1", "id-2"]);
        std::fs::remove_dir_all(&d).ok();
    }
}
