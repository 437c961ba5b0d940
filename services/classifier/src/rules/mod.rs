//! The classifier's rules: runbook rules as data, and the engine that applies them.
//!
//! - [`load`]: reads YAML rule files, validates everything and lists every problem with
//!   `file:line` ([`check_files`] backs `gpumedic rules check`; [`reload`] swaps a set only when
//!   the new one is valid).
//! - [`model`]: the validated rules.
//! - [`engine`]: observations in, decisions out; incidents per rule, node and GPU, flap damping,
//!   recovery on healthy evidence, deterministic ids, snapshot and restore.
//! - [`defaults`]: the default rule set shipped in `services/classifier/rules/`.
//!
//! The engine is pure: no I/O, no wall clock. Its input is [`Observation`], a flat view the
//! service maps the enriched Avro records onto.
//!
//! # Rule files
//!
//! A file holds one or more YAML documents, each a mapping with `rules:` (a list) and optionally
//! `synthetic: ignored|allowed` (default `ignored`; files that set it must agree). Unknown keys
//! are errors everywhere. One rule:
//!
//! ```yaml
//! - id: xid-48-with-row-remap        # unique across all files: [a-z0-9._-]
//!   version: 1                       # bump on any change of meaning; part of every id
//!   description: Double-bit ECC with row-remap events
//!   scope: gpu                       # gpu (default) or node: what state and incidents are per
//!   match:                           # a mapping, or a list of mappings (any of them)
//!     source: [kernel_log, nvml]     # nvml, kernel_log, dcgm, cloud, ingest, synthetic
//!     component: gpu                 # free text
//!     kind: xid                      # see KINDS
//!     xid: [48, 63, "144-150"]       # codes and ranges
//!     healthy: false                 # false (default for match), true, any
//!     fields:                        # all must hold; `name: value` is short for eq
//!       value: {ge: {field: slowdown_threshold}}   # eq ne gt ge lt le in exists
//!   condition:                       # exactly one; default {count: {at_least: 1}}
//!     burst: {gap: 3m, judge: each, with_all: [48], with_any: [63, 64]}
//!     # count:     {at_least: 3, within: 24h}
//!     # burst:     {gap: 3m, judge: close, with_all: [], with_any: [], without: [], only: [], min_events: 1}
//!     # together:  {of: [{xid: [48]}, {xid: [63, 64]}], within: 3m}
//!     # rate:      {field: crc_errors, more_than: 100, per: 1h}
//!     # threshold: {field: value, ge: 90 | {field: name}, for: 1m}   # or gt, lt, le
//!   severity: critical               # info, warning, critical
//!   action: drain                    # none monitor custom cordon drain reset_gpu reboot_node
//!   then: [reset_gpu]                #   contact_support replace_node; `then`: follow-ups
//!   custom: name                     # required with action custom
//!   overridable: true                # an override rule (Xid 154) on the GPU replaces the action
//!   override:                        # this rule's action comes from a field (needs count)
//!     field: recovery_action
//!     actions: {gpu_reset_required: {action: reset_gpu, severity: critical}, none: none}
//!   clear:
//!     evidence: {healthy: true}      # default: healthy observations of the rule's kinds
//!     quiet: 30m                     # how long the evidence must stand with no new fault
//! ```
//!
//! Durations are numbers with units: `ms`, `s`, `m`, `h`, `d`, combinable (`1h30m`).

pub mod defaults;
pub mod duration;
pub mod engine;
pub mod facts;
pub mod id;
mod keys;
pub mod load;
pub mod model;
pub mod observation;
pub mod sanity;
pub mod state;
pub mod yaml;

pub use duration::{DurationError, Interval, parse_duration};
pub use engine::{
    Absorbed, Bearing, Decision, DecisionKind, Engine, OpenIncident, Reattached, Refused, RestoreError, Snapshot,
    StoredIncident,
};
pub use load::{RuleError, check_dir, check_files, load_sources, reload};
pub use model::{Action, KINDS, Proof, Rule, RuleSet, SOURCES, Scope, Severity, SyntheticPolicy};
pub use observation::{DomainRoot, FieldValue, Observation};
pub use sanity::Invalid;
