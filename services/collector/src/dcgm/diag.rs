//! `dcgmi diag -r N -j`: the JSON report of a DCGM diagnostic run, in its DCGM 3.x and 4.x shapes.
//!
//! DCGM 3.x prints `{"DCGM GPU Diagnostic": {"test_categories": [{"category", "tests": [{"name",
//! "results": [{"gpu_ids": "0", "status", "warnings", "info"}]}]}]}}`. DCGM 4.x prints `{"DCGM
//! Diagnostic": {...}}` whose results name an entity (`"entity_group": "GPU", "entity_id": 0`) and
//! whose warnings are objects (`{"warning": "...", "error_id": 37}`); its tests may sit in
//! categories or directly under `tests`. The document is walked as a [`serde_json::Value`] rather
//! than through rigid structures, so unknown fields are ignored and small differences between
//! versions (a status in another case, `gpu_ids` as `"0,1"` or a number, warnings as strings or
//! objects) do not break the parse.

use serde_json::Value;

/// The top-level keys a diagnostic report sits under, newest first.
const REPORT_KEYS: [&str; 2] = ["DCGM Diagnostic", "DCGM GPU Diagnostic"];

/// A parsed diagnostic run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiagReport {
    /// The DCGM version the report names, when it names one.
    pub version: Option<String>,
    /// The tests, in the order of the report.
    pub tests: Vec<DiagTest>,
}

/// One diagnostic test (plugin) and its results.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiagTest {
    /// The test's name, as DCGM prints it (`PCIe`, `Memory`, `Diagnostic`, `software`, ...).
    pub name: String,
    /// Its category (`Deployment`, `Integration`, `Hardware`, `Stress`, ...), when given.
    pub category: Option<String>,
    /// One result per GPU (or other entity), or a single one for a test that is not per GPU.
    pub results: Vec<DiagResult>,
}

/// The outcome of one test on one GPU (or entity).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiagResult {
    /// The GPU's DCGM index; `None` for a test that is not per GPU or an entity that is not a GPU.
    pub gpu: Option<u32>,
    /// The entity group (`GPU`, `CPU`, ...) in DCGM 4.x reports.
    pub entity_group: Option<String>,
    /// The entity id within its group in DCGM 4.x reports.
    pub entity_id: Option<u32>,
    /// The outcome.
    pub status: DiagStatus,
    /// Informational messages.
    pub info: Vec<String>,
    /// Warnings and error messages.
    pub warnings: Vec<DiagWarning>,
}

/// A warning or error message of a result.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiagWarning {
    /// The text.
    pub message: String,
    /// DCGM's error code (`dcgmError_t`), when given.
    pub error_id: Option<i64>,
}

/// The outcome of a test.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum DiagStatus {
    /// Passed.
    Pass,
    /// Failed.
    Fail,
    /// Passed with a warning.
    Warn,
    /// Skipped (not applicable, or disabled).
    Skip,
    /// Not run.
    NotRun,
    /// A status this parser does not know, or none.
    #[default]
    Unknown,
}

impl DiagStatus {
    /// Reads a status word, in any case.
    pub fn parse(s: &str) -> Self {
        match s.trim().to_ascii_lowercase().replace(['_', '-'], " ").as_str() {
            "pass" | "passed" => Self::Pass,
            "fail" | "failed" | "failure" => Self::Fail,
            "warn" | "warning" => Self::Warn,
            "skip" | "skipped" => Self::Skip,
            "not run" | "notrun" => Self::NotRun,
            _ => Self::Unknown,
        }
    }
}

/// Why a document is not a diagnostic report.
#[derive(Debug, thiserror::Error)]
pub enum DiagError {
    /// It is not JSON.
    #[error("the diagnostic output is not JSON: {0}")]
    NotJson(#[from] serde_json::Error),
    /// It is JSON, but neither the DCGM 3.x nor the 4.x shape.
    #[error("the document is not a DCGM diagnostic report (no 'DCGM Diagnostic' or 'DCGM GPU Diagnostic' with tests)")]
    UnknownShape,
    /// DCGM reported that the diagnostic could not run.
    #[error("DCGM could not run the diagnostic: {0}")]
    Runtime(String),
}

impl DiagReport {
    /// Every failed result, with its test.
    pub fn failed(&self) -> Vec<(&DiagTest, &DiagResult)> {
        self.tests
            .iter()
            .flat_map(|t| t.results.iter().filter(|r| r.status == DiagStatus::Fail).map(move |r| (t, r)))
            .collect()
    }
}

/// Parses the output of `dcgmi diag -r N -j`.
pub fn parse_diag(text: &str) -> Result<DiagReport, DiagError> {
    let doc: Value = serde_json::from_str(text.trim())?;
    let Some(top) = doc.as_object() else { return Err(DiagError::UnknownShape) };
    let report = REPORT_KEYS.iter().find_map(|k| top.get(*k)).filter(|r| has_tests(r));
    let Some(report) = report else {
        return match top.get("runtime_error").and_then(Value::as_str) {
            Some(msg) => Err(DiagError::Runtime(msg.to_owned())),
            None => Err(DiagError::UnknownShape),
        };
    };
    let version = [report.get("version"), top.get("version"), top.get("metadata").and_then(|m| m.get("version"))]
        .into_iter()
        .flatten()
        .find_map(text_of);
    let mut tests = Vec::new();
    for category in report.get("test_categories").and_then(Value::as_array).into_iter().flatten() {
        let name = category.get("category").and_then(text_of);
        for test in category.get("tests").and_then(Value::as_array).into_iter().flatten() {
            tests.extend(parse_test(test, name.clone()));
        }
    }
    for test in report.get("tests").and_then(Value::as_array).into_iter().flatten() {
        let category = test.get("category").and_then(text_of);
        tests.extend(parse_test(test, category));
    }
    Ok(DiagReport { version, tests })
}

fn has_tests(report: &Value) -> bool {
    report.get("test_categories").is_some_and(Value::is_array) || report.get("tests").is_some_and(Value::is_array)
}

fn parse_test(test: &Value, category: Option<String>) -> Option<DiagTest> {
    let name = test.get("name").and_then(text_of)?;
    let mut results: Vec<DiagResult> =
        test.get("results").and_then(Value::as_array).into_iter().flatten().flat_map(parse_result).collect();
    if results.is_empty()
        && let Some(status) = test.get("test_summary").and_then(|s| s.get("status")).and_then(Value::as_str)
    {
        // A test reported only by its summary.
        results.push(DiagResult { status: DiagStatus::parse(status), ..Default::default() });
    }
    Some(DiagTest { name, category, results })
}

/// One result, or one per GPU when a DCGM 3.x result names several (`"gpu_ids": "0,1"`).
fn parse_result(result: &Value) -> Vec<DiagResult> {
    let status = result.get("status").and_then(Value::as_str).map_or(DiagStatus::Unknown, DiagStatus::parse);
    let info = messages(result.get("info")).into_iter().map(|w| w.message).collect();
    let mut warnings = messages(result.get("warnings"));
    warnings.extend(messages(result.get("errors")));
    let base = DiagResult { status, info, warnings, ..Default::default() };
    let entity_group = result.get("entity_group").and_then(text_of);
    let entity_id = result.get("entity_id").and_then(as_u32);
    if entity_group.is_some() || entity_id.is_some() {
        let is_gpu = entity_group.as_deref().is_none_or(|g| g.eq_ignore_ascii_case("gpu"));
        return vec![DiagResult { gpu: entity_id.filter(|_| is_gpu), entity_group, entity_id, ..base }];
    }
    let gpus: Vec<u32> = match result.get("gpu_ids").or_else(|| result.get("gpu_id")) {
        Some(Value::String(s)) => s.split(',').filter_map(|g| g.trim().parse().ok()).collect(),
        Some(Value::Array(a)) => a.iter().filter_map(as_u32).collect(),
        Some(v) => as_u32(v).into_iter().collect(),
        None => Vec::new(),
    };
    if gpus.is_empty() {
        return vec![base];
    }
    gpus.into_iter().map(|gpu| DiagResult { gpu: Some(gpu), ..base.clone() }).collect()
}

/// Messages given as a string, an array of strings, or objects (`warning`, `message`, `info`).
fn messages(v: Option<&Value>) -> Vec<DiagWarning> {
    let one = |v: &Value| match v {
        Value::Object(o) => ["warning", "message", "info", "error"]
            .iter()
            .find_map(|k| o.get(*k).and_then(text_of))
            .map(|message| DiagWarning { message, error_id: o.get("error_id").and_then(Value::as_i64) }),
        other => text_of(other).map(|message| DiagWarning { message, error_id: None }),
    };
    match v {
        Some(Value::Array(items)) => items.iter().filter_map(one).collect(),
        Some(other) => one(other).into_iter().collect(),
        None => Vec::new(),
    }
}

/// A non-empty string, or a number as text.
fn text_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if !s.trim().is_empty() => Some(s.trim().to_owned()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn as_u32(v: &Value) -> Option<u32> {
    match v {
        Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DCGM3_FAIL: &str = include_str!("../../tests/fixtures/dcgm/diag-3x-r2-fail.json");
    const DCGM3_PASS: &str = include_str!("../../tests/fixtures/dcgm/diag-3x-r1-pass.json");
    const DCGM4_FAIL: &str = include_str!("../../tests/fixtures/dcgm/diag-4x-r2-fail.json");
    const DCGM4_PASS: &str = include_str!("../../tests/fixtures/dcgm/diag-4x-r1-pass.json");

    fn test<'a>(report: &'a DiagReport, name: &str) -> &'a DiagTest {
        report.tests.iter().find(|t| t.name == name).expect("the test is in the report")
    }

    #[test]
    fn dcgm3_failure_is_listed_with_gpu_and_warning() {
        let report = parse_diag(DCGM3_FAIL).expect("parses");
        assert_eq!(report.version.as_deref(), Some("3.3.5"));
        let names: Vec<_> = report.tests.iter().map(|t| (t.category.as_deref(), t.name.as_str())).collect();
        assert_eq!(
            names,
            [
                (Some("Deployment"), "Denylist"),
                (Some("Deployment"), "NVML Library"),
                (Some("Deployment"), "CUDA Main Library"),
                (Some("Deployment"), "Permissions and OS Blocks"),
                (Some("Deployment"), "Persistence Mode"),
                (Some("Integration"), "PCIe"),
                (Some("Hardware"), "GPU Memory"),
            ]
        );
        // "gpu_ids": "0,1" becomes one result per GPU.
        assert_eq!(test(&report, "PCIe").results.iter().map(|r| r.gpu).collect::<Vec<_>>(), [Some(0), Some(1)]);
        assert_eq!(test(&report, "Denylist").results[0].gpu, None);
        assert_eq!(test(&report, "Persistence Mode").results[0].status, DiagStatus::Warn);
        let failed = report.failed();
        assert_eq!(failed.len(), 1);
        let (t, r) = failed[0];
        assert_eq!((t.name.as_str(), r.gpu), ("GPU Memory", Some(1)));
        assert_eq!(r.warnings.len(), 1);
        assert!(r.warnings[0].message.contains("DBE"), "{:?}", r.warnings);
        assert_eq!(r.warnings[0].error_id, Some(4));
        let ok = &test(&report, "GPU Memory").results[0];
        assert_eq!((ok.gpu, ok.status), (Some(0), DiagStatus::Pass));
        assert_eq!(ok.info, ["Allocated 84490776576 bytes (98.4%)"]);
    }

    #[test]
    fn dcgm3_pass_has_no_failures() {
        let report = parse_diag(DCGM3_PASS).expect("parses");
        assert!(report.failed().is_empty());
        assert!(report.tests.iter().flat_map(|t| &t.results).all(|r| r.status == DiagStatus::Pass));
        assert_eq!(report.tests.len(), 5);
        assert_eq!(report.version.as_deref(), Some("3.1.8"));
    }

    #[test]
    fn dcgm4_failure_names_entity_and_error_id() {
        let report = parse_diag(DCGM4_FAIL).expect("parses");
        assert_eq!(report.version.as_deref(), Some("4.1.1"));
        let failed = report.failed();
        assert_eq!(failed.len(), 1);
        let (t, r) = failed[0];
        assert_eq!((t.name.as_str(), t.category.as_deref()), ("pcie", Some("Integration")));
        assert_eq!((r.gpu, r.entity_group.as_deref(), r.entity_id), (Some(3), Some("GPU"), Some(3)));
        assert_eq!(r.warnings[0].error_id, Some(3));
        assert!(r.warnings[0].message.contains("PCIe replay"), "{:?}", r.warnings);
        // A CPU entity is not a GPU.
        let cpu = test(&report, "cpu_eud").results.first().expect("a result");
        assert_eq!((cpu.gpu, cpu.entity_group.as_deref(), cpu.status), (None, Some("CPU"), DiagStatus::Skip));
        // A test with only a summary still gives one result; lowercase statuses are read.
        assert_eq!(test(&report, "software").results[0].status, DiagStatus::Pass);
        assert_eq!(test(&report, "memory").results.len(), 4);
    }

    #[test]
    fn dcgm4_pass_with_flat_tests() {
        let report = parse_diag(DCGM4_PASS).expect("parses");
        assert!(report.failed().is_empty());
        assert_eq!(report.version.as_deref(), Some("4.0.0"));
        let names: Vec<_> = report.tests.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["software", "pcie"]);
        assert_eq!(test(&report, "pcie").results.iter().map(|r| r.gpu).collect::<Vec<_>>(), [Some(0), Some(1)]);
        assert_eq!(test(&report, "pcie").results[1].status, DiagStatus::NotRun);
    }

    #[test]
    fn statuses_are_read_in_any_case() {
        assert_eq!(DiagStatus::parse("PASS"), DiagStatus::Pass);
        assert_eq!(DiagStatus::parse("Fail"), DiagStatus::Fail);
        assert_eq!(DiagStatus::parse("warning"), DiagStatus::Warn);
        assert_eq!(DiagStatus::parse("Skip"), DiagStatus::Skip);
        assert_eq!(DiagStatus::parse("Not Run"), DiagStatus::NotRun);
        assert_eq!(DiagStatus::parse("NOT_RUN"), DiagStatus::NotRun);
        assert_eq!(DiagStatus::parse("exploded"), DiagStatus::Unknown);
    }

    #[test]
    fn malformed_or_foreign_documents_are_typed_errors() {
        assert!(matches!(parse_diag("{\"DCGM GPU Diagnostic\": {"), Err(DiagError::NotJson(_))));
        assert!(matches!(parse_diag("Error: unable to connect to host engine"), Err(DiagError::NotJson(_))));
        assert!(matches!(parse_diag("[1, 2]"), Err(DiagError::UnknownShape)));
        assert!(matches!(parse_diag("{\"hello\": \"world\"}"), Err(DiagError::UnknownShape)));
        assert!(matches!(parse_diag("{\"DCGM Diagnostic\": {\"version\": \"4.0.0\"}}"), Err(DiagError::UnknownShape)));
        match parse_diag("{\"runtime_error\": \"The diagnostic could not run\"}") {
            Err(DiagError::Runtime(msg)) => assert_eq!(msg, "The diagnostic could not run"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unknown_fields_and_odd_gpu_ids_are_tolerated() {
        let doc = r#"{"DCGM GPU Diagnostic": {"new_field": [1, 2], "test_categories": [{"category": "Hardware",
            "tests": [{"name": "Diagnostic", "extra": true, "results": [
                {"gpu_ids": 2, "status": "FAIL", "warnings": "Xid 79 seen", "info": ["a", "b"], "timing": 1.5},
                {"gpu_ids": [4, 5], "status": "pass"},
                {"status": "Skip"}]}]}]}}"#;
        let report = parse_diag(doc).expect("parses");
        let results = &report.tests[0].results;
        let summary: Vec<_> = results.iter().map(|r| (r.gpu, r.status)).collect();
        assert_eq!(
            summary,
            [
                (Some(2), DiagStatus::Fail),
                (Some(4), DiagStatus::Pass),
                (Some(5), DiagStatus::Pass),
                (None, DiagStatus::Skip)
            ]
        );
        assert_eq!(results[0].warnings, [DiagWarning { message: "Xid 79 seen".into(), error_id: None }]);
        assert_eq!(results[0].info, ["a", "b"]);
        assert_eq!(report.version, None);
    }
}
