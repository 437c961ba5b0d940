//! The export file: what `gpumedic replay export` writes and `--file` reads.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::sync::mpsc::SyncSender;

use anyhow::{Context as _, bail};

use super::source::{BATCH, Item, TimeRange};

/// The export file: a magic line, then records of
/// `i64 timestamp_ms | i32 key_len (-1: none) | key | i32 payload_len (-1: none) | payload |
/// u16 header_count | (u16 name_len | name | u32 value_len | value)*`, all big-endian.
const FILE_MAGIC: &[u8] = b"GPUMEDIC-REPLAY 1\n";

/// Writes an export file.
pub(super) struct FileWriter {
    out: BufWriter<File>,
}

impl FileWriter {
    pub(super) fn create(path: &Path) -> anyhow::Result<Self> {
        let mut out = BufWriter::new(File::create(path).with_context(|| format!("creating {}", path.display()))?);
        out.write_all(FILE_MAGIC)?;
        Ok(FileWriter { out })
    }

    pub(super) fn write(&mut self, item: &Item) -> anyhow::Result<()> {
        let w = &mut self.out;
        w.write_all(&item.timestamp_ms.to_be_bytes())?;
        for part in [&item.key, &item.payload] {
            match part {
                Some(bytes) => {
                    w.write_all(&i32::try_from(bytes.len())?.to_be_bytes())?;
                    w.write_all(bytes)?;
                }
                None => w.write_all(&(-1i32).to_be_bytes())?,
            }
        }
        w.write_all(&u16::try_from(item.headers.len())?.to_be_bytes())?;
        for (name, value) in &item.headers {
            w.write_all(&u16::try_from(name.len())?.to_be_bytes())?;
            w.write_all(name.as_bytes())?;
            w.write_all(&u32::try_from(value.len())?.to_be_bytes())?;
            w.write_all(value)?;
        }
        Ok(())
    }

    pub(super) fn finish(mut self) -> anyhow::Result<()> {
        self.out.flush()?;
        self.out.get_ref().sync_all()?;
        Ok(())
    }
}

/// Reads the export file at `path` into `tx` in batches, keeping the records within `range`.
pub(super) fn read_file(path: &Path, range: TimeRange, tx: &SyncSender<Vec<Item>>) -> anyhow::Result<()> {
    let mut r = BufReader::new(File::open(path).with_context(|| format!("opening {}", path.display()))?);
    let mut magic = vec![0; FILE_MAGIC.len()];
    r.read_exact(&mut magic).with_context(|| format!("{} is not a replay export", path.display()))?;
    if magic != FILE_MAGIC {
        bail!("{} is not a replay export (wrong header)", path.display());
    }
    let mut batch = Vec::with_capacity(BATCH);
    let mut index = 0u64;
    loop {
        let mut ts = [0; 8];
        match r.read_exact(&mut ts) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e.into()),
        }
        let item = read_item(&mut r, i64::from_be_bytes(ts))
            .with_context(|| format!("{}: record {index} is truncated or corrupt", path.display()))?;
        index += 1;
        if range.from_ms.is_some_and(|f| item.timestamp_ms < f) || range.to_ms.is_some_and(|t| item.timestamp_ms > t) {
            continue;
        }
        batch.push(item);
        if batch.len() == BATCH && tx.send(std::mem::replace(&mut batch, Vec::with_capacity(BATCH))).is_err() {
            return Ok(());
        }
    }
    if !batch.is_empty() {
        let _ = tx.send(batch);
    }
    Ok(())
}

fn read_item(r: &mut impl Read, timestamp_ms: i64) -> anyhow::Result<Item> {
    fn bytes(r: &mut impl Read, len: usize) -> anyhow::Result<Vec<u8>> {
        // Bounded so a corrupt length cannot ask for gigabytes.
        anyhow::ensure!(len <= 64 << 20, "length {len} is implausible");
        let mut b = vec![0; len];
        r.read_exact(&mut b)?;
        Ok(b)
    }
    fn optional(r: &mut impl Read) -> anyhow::Result<Option<Vec<u8>>> {
        let mut len = [0; 4];
        r.read_exact(&mut len)?;
        match i32::from_be_bytes(len) {
            -1 => Ok(None),
            n if n >= 0 => Ok(Some(bytes(r, n as usize)?)),
            n => bail!("negative length {n}"),
        }
    }
    let key = optional(r)?;
    let payload = optional(r)?;
    let mut count = [0; 2];
    r.read_exact(&mut count)?;
    let mut headers = Vec::with_capacity(usize::from(u16::from_be_bytes(count)));
    for _ in 0..u16::from_be_bytes(count) {
        let mut n = [0; 2];
        r.read_exact(&mut n)?;
        let name = String::from_utf8(bytes(r, usize::from(u16::from_be_bytes(n)))?)?;
        let mut v = [0; 4];
        r.read_exact(&mut v)?;
        headers.push((name, bytes(r, u32::from_be_bytes(v) as usize)?));
    }
    Ok(Item { timestamp_ms, key, payload, headers })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::source::Source;

    #[test]
    fn export_file_round_trips_and_detects_truncation() {
        let dir = std::env::temp_dir().join(format!("gpumedic-replay-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("export.bin");
        let items = vec![
            Item {
                timestamp_ms: 1,
                key: Some(b"node-a".to_vec()),
                payload: Some(vec![0, 0, 0, 0, 1, 7]),
                headers: vec![("traceparent".into(), b"00-abc".to_vec())],
            },
            Item { timestamp_ms: 5, key: None, payload: None, headers: vec![] },
            Item {
                timestamp_ms: 9,
                key: Some(vec![]),
                payload: Some(vec![1; 300]),
                headers: vec![("a".into(), vec![]), ("b".into(), vec![2])],
            },
        ];
        let mut w = FileWriter::create(&path).unwrap();
        for i in &items {
            w.write(i).unwrap();
        }
        w.finish().unwrap();

        let mut read = Vec::new();
        Source::File { path: path.clone(), range: TimeRange::default() }
            .for_each(|i| {
                read.push(i);
                Ok(())
            })
            .unwrap();
        assert_eq!(read, items);

        let mut ranged = Vec::new();
        Source::File { path: path.clone(), range: TimeRange { from_ms: Some(2), to_ms: Some(9) } }
            .for_each(|i| {
                ranged.push(i.timestamp_ms);
                Ok(())
            })
            .unwrap();
        assert_eq!(ranged, vec![5, 9]);

        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let err = Source::File { path: path.clone(), range: TimeRange::default() }.for_each(|_| Ok(())).unwrap_err();
        assert!(format!("{err:#}").contains("record 2 is truncated"), "{err:#}");

        std::fs::write(&path, b"not an export").unwrap();
        assert!(Source::File { path, range: TimeRange::default() }.for_each(|_| Ok(())).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
