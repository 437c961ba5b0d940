//! The Xid catalog: what each NVIDIA Xid means and what to do about it, loaded from a versioned
//! data file (`services/enricher/catalog/xid-catalog.yaml`, embedded as the default) so a catalog
//! revision is a data change, not a code change.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

/// The catalog that ships with this build.
pub const EMBEDDED: &str = include_str!("../catalog/xid-catalog.yaml");

/// What is wrong with a catalog file.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// The file could not be read.
    #[error("cannot read the Xid catalog {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a valid catalog.
    #[error("invalid Xid catalog {path}: {problems:?}")]
    Invalid {
        /// The file.
        path: String,
        /// Every problem found.
        problems: Vec<String>,
    },
}

/// One Xid's entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidEntry {
    /// Short name, for example "GPU has fallen off the bus".
    pub name: String,
    /// NVIDIA's immediate action.
    pub immediate: String,
    /// NVIDIA's investigatory action.
    pub investigatory: String,
    /// Anything else worth knowing.
    pub notes: Option<String>,
}

/// The loaded catalog.
#[derive(Debug, Clone)]
pub struct XidCatalog {
    /// The catalog's `version` field.
    pub version: String,
    entries: BTreeMap<u32, XidEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    version: serde_yaml::Value,
    xids: Vec<Row>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Row {
    code: u32,
    through: Option<u32>,
    name: String,
    immediate: String,
    investigatory: String,
    notes: Option<String>,
}

impl XidCatalog {
    /// The catalog embedded in this build.
    pub fn embedded() -> Self {
        Self::parse("embedded", EMBEDDED).expect("the embedded catalog is checked by tests")
    }

    /// Loads a catalog file.
    pub fn load(path: &Path) -> Result<Self, CatalogError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| CatalogError::Read { path: path.display().to_string(), source })?;
        Self::parse(&path.display().to_string(), &text)
    }

    /// Parses catalog text, listing every problem (bad YAML, empty fields, overlapping codes).
    pub fn parse(origin: &str, text: &str) -> Result<Self, CatalogError> {
        let invalid = |problems| CatalogError::Invalid { path: origin.to_owned(), problems };
        let file: File = serde_yaml::from_str(text).map_err(|e| invalid(vec![e.to_string()]))?;
        let version = match file.version {
            serde_yaml::Value::String(s) => s,
            other => serde_yaml::to_string(&other).unwrap_or_default().trim().to_owned(),
        };
        let mut problems = Vec::new();
        let mut entries = BTreeMap::new();
        for row in file.xids {
            let last = row.through.unwrap_or(row.code);
            if last < row.code {
                problems.push(format!("Xid {}: `through` ({last}) is below `code`", row.code));
                continue;
            }
            if row.name.trim().is_empty() || row.immediate.trim().is_empty() {
                problems.push(format!("Xid {}: name and immediate action must not be empty", row.code));
            }
            let entry = XidEntry {
                name: row.name,
                immediate: row.immediate,
                investigatory: row.investigatory,
                notes: row.notes.filter(|n| !n.trim().is_empty()),
            };
            for code in row.code..=last {
                if entries.insert(code, entry.clone()).is_some() {
                    problems.push(format!("Xid {code} is listed twice"));
                }
            }
        }
        if problems.is_empty() { Ok(Self { version, entries }) } else { Err(invalid(problems)) }
    }

    /// The entry for `code`, when the catalog knows it.
    pub fn get(&self, code: u32) -> Option<&XidEntry> {
        self.entries.get(&code)
    }

    /// How many codes the catalog covers.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the catalog covers no code.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_catalog_loads_and_expands_ranges() {
        let c = XidCatalog::embedded();
        assert_eq!(c.version, "2026-11-30");
        assert_eq!(c.get(79).unwrap().name, "GPU has fallen off the bus");
        assert_eq!(c.get(79).unwrap().immediate, "restart the machine");
        for code in 144..=150 {
            assert!(c.get(code).is_some(), "NVLink5 Xid {code}");
        }
        assert!(c.get(154).unwrap().notes.as_deref().unwrap().contains("overrides"));
        assert!(c.get(1).is_none());
        assert_eq!(c.len(), 41);
    }

    #[test]
    fn every_problem_is_reported() {
        let text = "version: 1\nxids:\n  - { code: 5, through: 3, name: a, immediate: b, investigatory: c }\n  - { code: 7, name: '', immediate: b, investigatory: c }\n  - { code: 7, name: x, immediate: b, investigatory: c }\n";
        let Err(CatalogError::Invalid { problems, .. }) = XidCatalog::parse("t", text) else { panic!("invalid") };
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(XidCatalog::parse("t", "version: 1\nxids:\n  - { code: 1, nme: typo }\n").is_err());
    }
}
