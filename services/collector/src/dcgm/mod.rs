//! DCGM, where it is deployed: dcgm-exporter's `/metrics` page, and the JSON of `dcgmi diag -j`
//! and of `dcgmi health -c -j`.
//!
//! Both parsers are pure (text in, typed values out) so they can be tested without DCGM and shared
//! with any command that wants to check an operator's own output; [`source`] puts them on a
//! schedule and turns what they read into health events.
//!
//! - [`exporter`]: the Prometheus text exposition of dcgm-exporter, in its old and new label styles,
//!   into one [`exporter::DcgmGpuReading`] per GPU (and per MIG instance).
//! - [`diag`]: `dcgmi diag -r N -j` in its DCGM 3.x and 4.x shapes, into a [`diag::DiagReport`].
//! - [`health`]: `dcgmi health -c -j`, DCGM's health watches, into a [`health::HealthReport`],
//!   and the events its incidents call for.
//! - [`source`]: the exporter scrape, the diagnostic scheduler and the health-watch schedule of
//!   the collector.

pub mod diag;
pub mod exporter;
pub mod health;
pub mod source;

pub use diag::{DiagError, DiagReport, DiagResult, DiagStatus, DiagTest, DiagWarning, parse_diag};
pub use exporter::{DcgmGpuReading, ExporterScrape, ExpositionError, ExpositionErrorKind, parse_metrics};
