//! Event ids and GPU identities as the engine's state holds them.
//!
//! The rules keep evidence per node and GPU (the samples of a rate, the latest events of a count,
//! the readings of a threshold), and each piece names its event and its GPU. As `String`s those
//! are two heap allocations a piece (a 36-character UUID and a 40-character `GPU-` UUID, 48 to 64
//! bytes each with the allocator's rounding), which at fleet scale is most of what the evidence
//! costs. The collector's event ids are UUIDs and NVML names a GPU by `GPU-` and a UUID, so an
//! [`Id`] holds those as their 16 bytes, inline, and anything else as text: the same string goes
//! in and comes out, and snapshots are written as the string, as before. The keeper's open
//! rollups (`crate::persist`) name their GPU the same way.

use std::cmp::Ordering;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use uuid::Uuid;

/// A string as the engine's state holds it (24 bytes; no allocation for a UUID or a GPU's
/// `GPU-` UUID in canonical lowercase form).
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum Id {
    /// A UUID, written in its canonical lowercase hyphenated form.
    Uuid(Uuid),
    /// `GPU-` and a UUID in that form: NVML's name of a GPU.
    Gpu(Uuid),
    /// Any other string.
    Text(Box<str>),
}

/// The UUID `s` is the canonical lowercase hyphenated form of, if it is one: only then does the
/// UUID give `s` back.
fn canonical(s: &str) -> Option<Uuid> {
    if s.len() != 36 {
        return None;
    }
    let u = Uuid::try_parse(s).ok()?;
    let mut buf = Uuid::encode_buffer();
    (u.hyphenated().encode_lower(&mut buf) == s).then_some(u)
}

impl Id {
    /// `s`, held compactly when it can be.
    pub fn new(s: &str) -> Id {
        if let Some(u) = canonical(s) {
            return Id::Uuid(u);
        }
        if let Some(u) = s.strip_prefix("GPU-").and_then(canonical) {
            return Id::Gpu(u);
        }
        Id::Text(s.into())
    }

    /// True when this is the string `s`, without writing it out.
    pub fn is(&self, s: &str) -> bool {
        match self {
            Id::Uuid(u) => canonical(s) == Some(*u),
            Id::Gpu(u) => s.strip_prefix("GPU-").and_then(canonical) == Some(*u),
            Id::Text(t) => **t == *s,
        }
    }
}

impl From<&str> for Id {
    fn from(s: &str) -> Id {
        Id::new(s)
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Id::Uuid(u) => write!(f, "{}", u.hyphenated()),
            Id::Gpu(u) => write!(f, "GPU-{}", u.hyphenated()),
            Id::Text(t) => f.write_str(t),
        }
    }
}

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.to_string(), f)
    }
}

impl PartialEq<str> for Id {
    fn eq(&self, other: &str) -> bool {
        self.is(other)
    }
}

impl PartialEq<String> for Id {
    fn eq(&self, other: &String) -> bool {
        self.is(other)
    }
}

/// Ordered as the strings are (evidence is sorted by time, then id).
impl Ord for Id {
    fn cmp(&self, other: &Id) -> Ordering {
        match (self, other) {
            // A UUID's bytes are in the order of its lowercase hexadecimal digits.
            (Id::Uuid(a), Id::Uuid(b)) | (Id::Gpu(a), Id::Gpu(b)) => a.cmp(b),
            _ => self.to_string().cmp(&other.to_string()),
        }
    }
}

impl PartialOrd for Id {
    fn partial_cmp(&self, other: &Id) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Serialize for Id {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Id, D::Error> {
        let s = String::deserialize(deserializer)?;
        Ok(Id::new(&s))
    }
}

/// A small set of [`Id`]s (the GPUs an incident names, or has seen healthy again), as a sorted
/// list: a node has a few GPUs, and a `BTreeSet<String>` took a B-tree node of some 300 bytes and
/// a heap string a GPU even for one GPU (about 4 KB a node of open incidents with the simulated
/// fault mix). Ordered and written as that set was: a list of the strings, sorted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdSet(Vec<Id>);

impl IdSet {
    /// Adds `id`; false when it was there already.
    pub fn insert(&mut self, id: Id) -> bool {
        match self.0.binary_search(&id) {
            Ok(_) => false,
            Err(at) => {
                crate::tight::insert(&mut self.0, at, id);
                true
            }
        }
    }

    /// True when `id` is in the set.
    pub fn contains(&self, id: &Id) -> bool {
        self.0.binary_search(id).is_ok()
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Empties it.
    pub fn clear(&mut self) {
        self.0 = Vec::new();
    }

    /// In order.
    pub fn iter(&self) -> std::slice::Iter<'_, Id> {
        self.0.iter()
    }
}

impl FromIterator<Id> for IdSet {
    fn from_iter<I: IntoIterator<Item = Id>>(iter: I) -> IdSet {
        let mut ids: Vec<Id> = iter.into_iter().collect();
        ids.sort();
        ids.dedup();
        ids.shrink_to_fit();
        IdSet(ids)
    }
}

impl Serialize for IdSet {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(&self.0)
    }
}

impl<'de> Deserialize<'de> for IdSet {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<IdSet, D::Error> {
        Ok(Vec::<Id>::deserialize(deserializer)?.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_string_comes_back_as_it_went_in() {
        let cases = [
            "0190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f",
            "GPU-3c2b1a09-8f7e-4d6c-b5a4-93827160f5e4",
            // Not canonical: upper case, braces, no hyphens. Held as text, so they come back.
            "0190C8F2-6A7E-7D3C-9B1E-2F4A5C6D7E8F",
            "{0190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f}",
            "0190c8f26a7e7d3c9b1e2f4a5c6d7e8f",
            "GPU-0190C8F2-6A7E-7D3C-9B1E-2F4A5C6D7E8F",
            "gpu-0190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f",
            "0000:17:00.0",
            "e12",
            "",
        ];
        for s in cases {
            let id = Id::new(s);
            assert_eq!(id.to_string(), s);
            assert!(id.is(s) && id == *s, "{s}");
            let json = serde_json::to_string(&id).unwrap();
            assert_eq!(json, serde_json::to_string(s).unwrap(), "written as the string");
            assert_eq!(serde_json::from_str::<Id>(&json).unwrap(), id);
        }
        assert!(matches!(Id::new(cases[0]), Id::Uuid(_)));
        assert!(matches!(Id::new(cases[1]), Id::Gpu(_)));
        assert!(matches!(Id::new(cases[2]), Id::Text(_)));
        assert!(!Id::new(cases[0]).is(cases[2]), "the same UUID in another form is another string");
        assert!(!Id::new(cases[1]).is(&cases[1][4..]), "a GPU is not its bare UUID");
        assert!(std::mem::size_of::<Id>() <= 24 && std::mem::size_of::<Option<Id>>() <= 24);
    }

    #[test]
    fn ids_sort_as_their_strings() {
        let strings = [
            "0190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f",
            "a190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f",
            "1190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f",
            "GPU-f190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f",
            "GPU-0190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f",
            "e12",
            "B",
        ];
        let mut ids: Vec<Id> = strings.iter().map(|s| Id::new(s)).collect();
        ids.sort();
        let mut sorted = strings.to_vec();
        sorted.sort_unstable();
        assert_eq!(ids.iter().map(ToString::to_string).collect::<Vec<_>>(), sorted);
    }

    #[test]
    fn an_id_set_is_sorted_once_each_and_written_as_the_set_of_strings() {
        let gpus = ["GPU-f190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f", "GPU-0190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f", "g7"];
        let mut set = IdSet::default();
        for g in gpus.iter().chain(&gpus) {
            set.insert(Id::new(g));
        }
        let strings: std::collections::BTreeSet<String> = gpus.iter().map(|g| g.to_string()).collect();
        assert_eq!(set.len(), 3);
        assert!(gpus.iter().all(|g| set.contains(&Id::new(g))) && !set.contains(&Id::new("g8")));
        let json = serde_json::to_string(&set).unwrap();
        assert_eq!(json, serde_json::to_string(&strings).unwrap(), "written as the BTreeSet<String> it replaced");
        let back: IdSet = serde_json::from_str(
            r#"["g7", "GPU-f190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f", "g7", "GPU-0190c8f2-6a7e-7d3c-9b1e-2f4a5c6d7e8f"]"#,
        )
        .unwrap();
        assert_eq!(back, set, "read back sorted, each once");
        assert_eq!(gpus.iter().map(|g| Id::new(g)).collect::<IdSet>(), set);
        set.clear();
        assert!(set.is_empty());
    }
}
