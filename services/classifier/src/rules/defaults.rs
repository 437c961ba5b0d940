//! The default rule set, compiled in from `services/classifier/rules/*.yaml` so the service and
//! the CLI have it without a file on disk; operators replace it with their own files.

use std::path::Path;

use super::load::{RuleError, load_sources};
use super::model::RuleSet;

/// The default rule files: name (as messages show it) and text, in load order (the files' name order, as
/// [`check_dir`](super::load::check_dir) reads them).
pub const FILES: &[(&str, &str)] = &[
    ("rules/10-xid.yaml", include_str!("../../rules/10-xid.yaml")),
    ("rules/20-memory.yaml", include_str!("../../rules/20-memory.yaml")),
    ("rules/30-thermal-power.yaml", include_str!("../../rules/30-thermal-power.yaml")),
    ("rules/40-interconnect.yaml", include_str!("../../rules/40-interconnect.yaml")),
    ("rules/50-node.yaml", include_str!("../../rules/50-node.yaml")),
];

/// The default rule set.
pub fn rule_set() -> Result<RuleSet, Vec<RuleError>> {
    load_sources(FILES.iter().map(|(name, text)| (Path::new(*name), *text)))
}
