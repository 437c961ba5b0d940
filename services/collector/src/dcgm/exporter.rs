//! dcgm-exporter's `/metrics` page (the Prometheus text exposition format) into per-GPU readings.
//!
//! Only the health fields are kept: the last Xid, the temperature (and its slowdown and shutdown
//! thresholds, when the exporter's counter list includes them), the ECC totals (single and double
//! bit, volatile and aggregate), row remapping and power. Other metrics, `# HELP` and `# TYPE` lines
//! are ignored. GPUs are told apart by their labels, in both styles seen in the wild:
//!
//! - new (dcgm-exporter 2.x and later): `gpu="0",UUID="GPU-…",pci_bus_id="00000000:3B:00.0",
//!   device="nvidia0",modelName="…",Hostname="…"`, with `GPU_I_ID` / `GPU_I_PROFILE` on MIG
//!   instances;
//! - old (the 1.x exporter): `gpu="0",uuid="GPU-…"` with lowercase metric names such as
//!   `dcgm_gpu_temp`.
//!
//! A line that is structurally broken is reported with its line number and the rest of the page is
//! still read, so one truncated line never hides every GPU.

use crate::kernel_log::parse::normalize_pci;

/// What one GPU (or one MIG instance) reported in a scrape. `None` means the page did not carry the
/// field, or carried NaN, infinity or DCGM's "blank" value for it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DcgmGpuReading {
    /// The GPU's index (`gpu` label).
    pub index: Option<u32>,
    /// The GPU's UUID (`UUID`, or `uuid` in the old style).
    pub uuid: Option<String>,
    /// The PCI address, normalised to `dddd:bb:dd.f` lowercase.
    pub pci_bus_id: Option<String>,
    /// The MIG GPU instance id (`GPU_I_ID`), for a MIG instance.
    pub mig_instance: Option<String>,
    /// The MIG profile (`GPU_I_PROFILE`, e.g. `1g.10gb`), for a MIG instance.
    pub mig_profile: Option<String>,
    /// The last Xid the GPU reported (0: none since the exporter started watching).
    pub xid: Option<i64>,
    /// The GPU temperature, in degrees Celsius.
    pub temperature_c: Option<i64>,
    /// The slowdown temperature threshold (`DCGM_FI_DEV_SLOWDOWN_TEMP`, when the exporter's
    /// counter list includes it).
    pub slowdown_c: Option<i64>,
    /// The shutdown temperature threshold (`DCGM_FI_DEV_SHUTDOWN_TEMP`, when exported).
    pub shutdown_c: Option<i64>,
    /// Single-bit ECC errors since the last driver load.
    pub ecc_sbe_volatile: Option<i64>,
    /// Double-bit ECC errors since the last driver load.
    pub ecc_dbe_volatile: Option<i64>,
    /// Single-bit ECC errors over the GPU's lifetime.
    pub ecc_sbe_aggregate: Option<i64>,
    /// Double-bit ECC errors over the GPU's lifetime.
    pub ecc_dbe_aggregate: Option<i64>,
    /// Whether row remapping has failed (the GPU should be replaced).
    pub row_remap_failure: Option<bool>,
    /// Whether a row remap waits for a GPU reset (`DCGM_FI_DEV_ROW_REMAP_PENDING`, when exported).
    pub row_remap_pending: Option<bool>,
    /// Rows remapped for correctable errors.
    pub remapped_rows_correctable: Option<i64>,
    /// Rows remapped for uncorrectable errors.
    pub remapped_rows_uncorrectable: Option<i64>,
    /// Power draw, in watts.
    pub power_w: Option<f64>,
}

/// The result of reading one `/metrics` page: the readings, and the lines that could not be read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExporterScrape {
    /// One reading per GPU or MIG instance, in the order the page first names them.
    pub readings: Vec<DcgmGpuReading>,
    /// Structurally broken lines; the rest of the page was read regardless.
    pub problems: Vec<ExpositionError>,
}

/// A line of the exposition that is structurally broken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {kind}")]
pub struct ExpositionError {
    /// The line number, from 1.
    pub line: usize,
    /// What is wrong with it.
    pub kind: ExpositionErrorKind,
}

/// What is wrong with a line of the exposition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpositionErrorKind {
    /// The line does not start with a metric name.
    #[error("no metric name")]
    MissingName,
    /// The label set is not closed with `}` (or a label value with `"`).
    #[error("the label set is not closed")]
    UnclosedLabels,
    /// A label is not of the form `name="value"`.
    #[error("malformed label near '{0}'")]
    BadLabel(String),
    /// No value follows the metric.
    #[error("no sample value")]
    MissingValue,
    /// The value is not a number.
    #[error("'{0}' is not a sample value")]
    BadValue(String),
    /// The text after the value is not a timestamp.
    #[error("'{0}' is not a timestamp")]
    BadTimestamp(String),
    /// Something follows the timestamp.
    #[error("unexpected text after the sample: '{0}'")]
    TrailingText(String),
}

/// The health fields this parser keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Xid,
    Temperature,
    SlowdownTemp,
    ShutdownTemp,
    SbeVolatile,
    DbeVolatile,
    SbeAggregate,
    DbeAggregate,
    RowRemapFailure,
    RowRemapPending,
    RemappedCorrectable,
    RemappedUncorrectable,
    Power,
}

fn field_of(metric: &str) -> Option<Field> {
    Some(match metric {
        "DCGM_FI_DEV_XID_ERRORS" | "dcgm_xid_errors" => Field::Xid,
        "DCGM_FI_DEV_GPU_TEMP" | "dcgm_gpu_temp" => Field::Temperature,
        "DCGM_FI_DEV_SLOWDOWN_TEMP" => Field::SlowdownTemp,
        "DCGM_FI_DEV_SHUTDOWN_TEMP" => Field::ShutdownTemp,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" | "dcgm_ecc_sbe_volatile_total" => Field::SbeVolatile,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" | "dcgm_ecc_dbe_volatile_total" => Field::DbeVolatile,
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL" | "dcgm_ecc_sbe_aggregate_total" => Field::SbeAggregate,
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL" | "dcgm_ecc_dbe_aggregate_total" => Field::DbeAggregate,
        "DCGM_FI_DEV_ROW_REMAP_FAILURE" => Field::RowRemapFailure,
        "DCGM_FI_DEV_ROW_REMAP_PENDING" => Field::RowRemapPending,
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS" => Field::RemappedCorrectable,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS" => Field::RemappedUncorrectable,
        "DCGM_FI_DEV_POWER_USAGE" | "dcgm_power_usage" => Field::Power,
        _ => return None,
    })
}

/// DCGM's 32-bit "blank" sentinels start here (`DCGM_INT32_BLANK`).
const INT32_BLANK: f64 = 2_147_483_632.0;
/// DCGM's 64-bit "blank" sentinels start here (`DCGM_INT64_BLANK`, as a float).
const INT64_BLANK: f64 = 9.2e18;
/// DCGM's floating-point "blank" sentinels start here (`DCGM_FP64_BLANK`).
const FP64_BLANK: f64 = 140_737_488_355_328.0;

/// Parses one dcgm-exporter `/metrics` page.
pub fn parse_metrics(text: &str) -> ExporterScrape {
    let mut scrape = ExporterScrape::default();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let sample = match parse_sample(line) {
            Ok(s) => s,
            Err(kind) => {
                scrape.problems.push(ExpositionError { line: i + 1, kind });
                continue;
            }
        };
        let Some(field) = field_of(sample.name) else { continue };
        let label = |names: &[&str]| {
            sample.labels.iter().find(|(k, v)| names.contains(k) && !v.trim().is_empty()).map(|(_, v)| v.trim())
        };
        let index = label(&["gpu"]).and_then(|v| v.parse::<u32>().ok());
        let uuid = label(&["UUID", "uuid"]).map(str::to_owned);
        if index.is_none() && uuid.is_none() {
            // A metric that names no GPU cannot be attributed; it is not a health reading.
            continue;
        }
        let mig_instance = label(&["GPU_I_ID"]).map(str::to_owned);
        let reading = match scrape
            .readings
            .iter()
            .position(|r| r.index == index && r.uuid == uuid && r.mig_instance == mig_instance)
        {
            Some(p) => &mut scrape.readings[p],
            None => {
                scrape.readings.push(DcgmGpuReading { index, uuid, mig_instance, ..Default::default() });
                scrape.readings.last_mut().expect("just pushed")
            }
        };
        if reading.pci_bus_id.is_none() {
            reading.pci_bus_id = label(&["pci_bus_id"]).and_then(normalize_pci);
        }
        if reading.mig_profile.is_none() {
            reading.mig_profile = label(&["GPU_I_PROFILE"]).map(str::to_owned);
        }
        let v = sample.value;
        match field {
            Field::Xid => reading.xid = int(v, INT32_BLANK),
            Field::Temperature => reading.temperature_c = int(v, INT32_BLANK),
            Field::SlowdownTemp => reading.slowdown_c = int(v, INT32_BLANK),
            Field::ShutdownTemp => reading.shutdown_c = int(v, INT32_BLANK),
            Field::SbeVolatile => reading.ecc_sbe_volatile = int(v, INT64_BLANK),
            Field::DbeVolatile => reading.ecc_dbe_volatile = int(v, INT64_BLANK),
            Field::SbeAggregate => reading.ecc_sbe_aggregate = int(v, INT64_BLANK),
            Field::DbeAggregate => reading.ecc_dbe_aggregate = int(v, INT64_BLANK),
            Field::RowRemapFailure => reading.row_remap_failure = int(v, INT32_BLANK).map(|n| n != 0),
            Field::RowRemapPending => reading.row_remap_pending = int(v, INT32_BLANK).map(|n| n != 0),
            Field::RemappedCorrectable => reading.remapped_rows_correctable = int(v, INT64_BLANK),
            Field::RemappedUncorrectable => reading.remapped_rows_uncorrectable = int(v, INT64_BLANK),
            Field::Power => reading.power_w = (v.is_finite() && v < FP64_BLANK).then_some(v),
        }
    }
    scrape
}

/// A whole number from a sample value; `None` for NaN, infinities and DCGM's blank sentinels.
fn int(v: f64, blank: f64) -> Option<i64> {
    // The casts are exact: the value is finite and well inside i64's range.
    (v.is_finite() && v < blank && v > -blank).then_some(v.trunc() as i64)
}

/// One sample line: `name{label="value",...} value [timestamp]`.
#[derive(Debug)]
struct Sample<'a> {
    name: &'a str,
    labels: Labels<'a>,
    value: f64,
}

/// A sample's labels: name and unescaped value, in order.
type Labels<'a> = Vec<(&'a str, String)>;

fn parse_sample(line: &str) -> Result<Sample<'_>, ExpositionErrorKind> {
    let name_end = line.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')).unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return Err(ExpositionErrorKind::MissingName);
    }
    let mut rest = line[name_end..].trim_start();
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(inner)?;
        labels = parsed;
        rest = after;
    }
    let mut parts = rest.split_whitespace();
    let value = parts.next().ok_or(ExpositionErrorKind::MissingValue)?;
    let value = value.parse::<f64>().map_err(|_| ExpositionErrorKind::BadValue(value.to_owned()))?;
    if let Some(ts) = parts.next()
        && ts.parse::<i64>().is_err()
    {
        return Err(ExpositionErrorKind::BadTimestamp(ts.to_owned()));
    }
    if let Some(extra) = parts.next() {
        return Err(ExpositionErrorKind::TrailingText(extra.to_owned()));
    }
    Ok(Sample { name, labels, value })
}

/// Parses the label set after its `{`; returns the labels and the text after the closing `}`.
fn parse_labels(mut s: &str) -> Result<(Labels<'_>, &str), ExpositionErrorKind> {
    let snippet = |s: &str| s.chars().take(24).collect::<String>();
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(after) = s.strip_prefix('}') {
            return Ok((labels, after));
        }
        if s.is_empty() {
            return Err(ExpositionErrorKind::UnclosedLabels);
        }
        let name_end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
        let name = &s[..name_end];
        let after_name = s[name_end..].trim_start();
        let quoted = after_name.strip_prefix('=').map(str::trim_start).and_then(|r| r.strip_prefix('"'));
        let (false, Some(quoted)) = (name.is_empty(), quoted) else {
            return Err(ExpositionErrorKind::BadLabel(snippet(s)));
        };
        let mut value = String::new();
        let mut end = None;
        let mut chars = quoted.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, other)) => value.push(other),
                    None => break,
                },
                '"' => {
                    end = Some(i + 1);
                    break;
                }
                other => value.push(other),
            }
        }
        let end = end.ok_or(ExpositionErrorKind::UnclosedLabels)?;
        labels.push((name, value));
        s = quoted[end..].trim_start();
        if let Some(after) = s.strip_prefix(',') {
            s = after;
        } else if s.is_empty() {
            return Err(ExpositionErrorKind::UnclosedLabels);
        } else if !s.starts_with('}') {
            return Err(ExpositionErrorKind::BadLabel(snippet(s)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEW_STYLE: &str = include_str!("../../tests/fixtures/dcgm/exporter-3x.prom");
    const OLD_STYLE: &str = include_str!("../../tests/fixtures/dcgm/exporter-1x.prom");
    const SPACED: &str = include_str!("../../tests/fixtures/dcgm/exporter-2x.prom");
    const MIG: &str = include_str!("../../tests/fixtures/dcgm/exporter-mig.prom");

    fn by_index(scrape: &ExporterScrape, index: u32) -> &DcgmGpuReading {
        scrape.readings.iter().find(|r| r.index == Some(index)).expect("the GPU is in the scrape")
    }

    #[test]
    fn new_label_style_gives_one_reading_per_gpu() {
        let scrape = parse_metrics(NEW_STYLE);
        assert!(scrape.problems.is_empty(), "{:?}", scrape.problems);
        assert_eq!(scrape.readings.len(), 2);
        let gpu0 = by_index(&scrape, 0);
        assert_eq!(gpu0.uuid.as_deref(), Some("GPU-9a5e7c3e-2c1b-4f6d-8e1a-0b7c3d2e1f40"));
        assert_eq!(gpu0.pci_bus_id.as_deref(), Some("0000:18:00.0"));
        assert_eq!(gpu0.mig_instance, None);
        assert_eq!(gpu0.xid, Some(0));
        assert_eq!(gpu0.temperature_c, Some(34));
        assert_eq!(gpu0.ecc_sbe_volatile, Some(0));
        assert_eq!(gpu0.ecc_dbe_aggregate, Some(0));
        assert_eq!(gpu0.row_remap_failure, Some(false));
        assert_eq!(gpu0.power_w, Some(71.932));
        let gpu1 = by_index(&scrape, 1);
        assert_eq!(gpu1.pci_bus_id.as_deref(), Some("0000:2a:00.0"));
        assert_eq!(gpu1.xid, Some(79));
        assert_eq!(gpu1.temperature_c, Some(41));
        assert_eq!(gpu1.ecc_sbe_volatile, Some(3));
        assert_eq!(gpu1.ecc_dbe_volatile, Some(1));
        assert_eq!(gpu1.ecc_sbe_aggregate, Some(12));
        assert_eq!(gpu1.ecc_dbe_aggregate, Some(2));
        assert_eq!(gpu1.row_remap_failure, Some(true));
        assert_eq!(gpu1.remapped_rows_correctable, Some(4));
        assert_eq!(gpu1.remapped_rows_uncorrectable, Some(1));
    }

    #[test]
    fn old_label_style_and_metric_names() {
        let scrape = parse_metrics(OLD_STYLE);
        assert!(scrape.problems.is_empty(), "{:?}", scrape.problems);
        assert_eq!(scrape.readings.len(), 2);
        let gpu1 = by_index(&scrape, 1);
        assert_eq!(gpu1.uuid.as_deref(), Some("GPU-8f640a3c-7e9a-608d-02a3-f4372d72b323"));
        assert_eq!(gpu1.pci_bus_id, None);
        assert_eq!(gpu1.temperature_c, Some(67));
        assert_eq!(gpu1.xid, Some(48));
        assert_eq!(gpu1.ecc_dbe_volatile, Some(2));
        assert_eq!(gpu1.power_w, Some(248.312));
        assert_eq!(gpu1.row_remap_failure, None);
    }

    #[test]
    fn spaces_after_commas_and_timestamps_are_tolerated() {
        let scrape = parse_metrics(SPACED);
        assert!(scrape.problems.is_empty(), "{:?}", scrape.problems);
        assert_eq!(scrape.readings.len(), 1);
        let gpu0 = by_index(&scrape, 0);
        assert_eq!(gpu0.uuid.as_deref(), Some("GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"));
        assert_eq!(gpu0.temperature_c, Some(31));
        assert_eq!(gpu0.ecc_dbe_volatile, Some(0));
        assert_eq!(gpu0.power_w, Some(52.183));
    }

    #[test]
    fn mig_instances_are_separate_readings() {
        let scrape = parse_metrics(MIG);
        assert!(scrape.problems.is_empty(), "{:?}", scrape.problems);
        assert_eq!(scrape.readings.len(), 3);
        let instances: Vec<_> =
            scrape.readings.iter().map(|r| (r.index, r.mig_instance.as_deref(), r.mig_profile.as_deref())).collect();
        assert_eq!(
            instances,
            [
                (Some(0), Some("7"), Some("1g.10gb")),
                (Some(0), Some("8"), Some("1g.10gb")),
                (Some(0), Some("2"), Some("3g.40gb"))
            ]
        );
        assert!(scrape.readings.iter().all(|r| r.uuid.as_deref() == Some("GPU-1d6b7a61-3c2f-8e4b-9a0d-5f7e2c4b8a19")));
        assert!(scrape.readings.iter().all(|r| r.temperature_c == Some(29)));
        assert_eq!(scrape.readings[2].xid, Some(31));
    }

    #[test]
    fn a_broken_line_is_reported_with_its_number_and_the_rest_is_read() {
        let text = "\
# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu=\"0\",UUID=\"GPU-a\"} 40
DCGM_FI_DEV_GPU_TEMP{gpu=\"1\",UUID=\"GPU-b\" 41
DCGM_FI_DEV_GPU_TEMP{gpu=\"2\",UUID=\"GPU-c\"} 42
DCGM_FI_DEV_POWER_USAGE{gpu=\"2\",UUID=\"GPU-c\"} watts
DCGM_FI_DEV_XID_ERRORS{gpu=\"2\",UUID=\"GPU-c\"}
DCGM_FI_DEV_XID_ERRORS{gpu=\"2\",UUID=\"GPU-c\"} 13 1700000000000 extra
DCGM_FI_DEV_XID_ERRORS{gpu=\"2\",UUID=\"GPU-c\"} 13 yesterday
DCGM_FI_DEV_XID_ERRORS{gpu=2} 13
{gpu=\"2\"} 13
DCGM_FI_DEV_XID_ERRORS{gpu=\"2\",UUID=\"GPU-c\"} 43
DCGM_FI_DEV_XID_ERRORS{gpu=\"3\",UUID=\"GPU-d";
        let scrape = parse_metrics(text);
        let problems: Vec<_> = scrape.problems.iter().map(|p| (p.line, p.kind.clone())).collect();
        assert_eq!(
            problems,
            [
                (4, ExpositionErrorKind::BadLabel("41".into())),
                (6, ExpositionErrorKind::BadValue("watts".into())),
                (7, ExpositionErrorKind::MissingValue),
                (8, ExpositionErrorKind::TrailingText("extra".into())),
                (9, ExpositionErrorKind::BadTimestamp("yesterday".into())),
                (10, ExpositionErrorKind::BadLabel("gpu=2} 13".into())),
                (11, ExpositionErrorKind::MissingName),
                (13, ExpositionErrorKind::UnclosedLabels),
            ]
        );
        assert_eq!(scrape.problems[0].to_string(), "line 4: malformed label near '41'");
        assert_eq!(scrape.readings.len(), 2);
        assert_eq!(by_index(&scrape, 0).temperature_c, Some(40));
        let gpu2 = by_index(&scrape, 2);
        assert_eq!((gpu2.temperature_c, gpu2.xid, gpu2.power_w), (Some(42), Some(43), None));
    }

    #[test]
    fn nan_infinity_and_blank_values_read_as_missing() {
        let text = "\
DCGM_FI_DEV_GPU_TEMP{gpu=\"0\",UUID=\"GPU-a\"} NaN
DCGM_FI_DEV_POWER_USAGE{gpu=\"0\",UUID=\"GPU-a\"} +Inf
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu=\"0\",UUID=\"GPU-a\"} -Inf
DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{gpu=\"0\",UUID=\"GPU-a\"} 9223372036854775794
DCGM_FI_DEV_XID_ERRORS{gpu=\"0\",UUID=\"GPU-a\"} 2147483632
DCGM_FI_DEV_ECC_SBE_AGG_TOTAL{gpu=\"0\",UUID=\"GPU-a\"} 1.7e1
";
        let scrape = parse_metrics(text);
        assert!(scrape.problems.is_empty(), "{:?}", scrape.problems);
        let r = &scrape.readings[0];
        assert_eq!((r.temperature_c, r.power_w, r.ecc_dbe_volatile), (None, None, None));
        assert_eq!((r.ecc_sbe_volatile, r.xid, r.ecc_sbe_aggregate), (None, None, Some(17)));
    }

    #[test]
    fn escaped_quotes_in_label_values_and_unlabelled_metrics() {
        let text = r#"DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",modelName="NVIDIA \"H100\" 80GB\\HBM3",Hostname="n,1}"} 38
DCGM_FI_DEV_GPU_TEMP 99
DCGM_FI_DEV_GPU_TEMP{Hostname="node-1"} 99
DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-a"} 1980
"#;
        let scrape = parse_metrics(text);
        assert!(scrape.problems.is_empty(), "{:?}", scrape.problems);
        assert_eq!(scrape.readings.len(), 1);
        assert_eq!(scrape.readings[0].temperature_c, Some(38));
        let sample = parse_sample(text.lines().next().expect("a line")).expect("parses");
        assert!(sample.labels.contains(&("modelName", "NVIDIA \"H100\" 80GB\\HBM3".to_owned())));
        assert!(sample.labels.contains(&("Hostname", "n,1}".to_owned())));
    }

    #[test]
    fn an_empty_page_has_no_readings() {
        assert_eq!(parse_metrics(""), ExporterScrape::default());
        assert_eq!(parse_metrics("# HELP x\n# TYPE x gauge\n\n"), ExporterScrape::default());
    }
}
