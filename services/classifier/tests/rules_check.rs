//! `check_files` on real files, as `gpumedic rules check FILE...` runs it: several broken files
//! give every problem, each as `file:line: message`, and a valid set loads.

use std::path::{Path, PathBuf};

use gpumedic_classifier::rules::{check_files, reload};

/// A scratch directory unique to this test process, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("gpumedic-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const VALID: &str = "\
rules:
  - id: xid-79
    version: 1
    description: fallen off the bus
    match: {kind: xid, xid: [79]}
    severity: critical
    action: reboot_node
    clear: {proof: reboot, quiet: 15m}
";

const SEMANTIC: &str = "\
rules:
  - id: Bad Id
    version: one
    description: many problems
    match:
      kind: [xid, temprature]
      source: nvml
      colour: red
    condition:
      burst: {gap: 3 minutes, judge: sometimes}
    severity: critical
    action: reboot
    clear: {quiet: 10m, when: healthy}
  - id: xid-79
    version: 1
    description: a duplicate id
    match: {kind: gpu_lost}
    condition: {threshold: {field: value, ge: hot, for: 1m}}
    severity: warning
    action: drain
";

const SYNTAX: &str = "\
rules:
  - id: fine
    description: [unclosed
";

fn lines(errors: &[gpumedic_classifier::rules::RuleError]) -> Vec<String> {
    errors.iter().map(ToString::to_string).collect()
}

#[test]
fn every_problem_in_every_file_is_listed_with_file_and_line() {
    let dir = Scratch::new("rules-check");
    let valid = dir.write("a-valid.yaml", VALID);
    let semantic = dir.write("b-semantic.yaml", SEMANTIC);
    let syntax = dir.write("c-syntax.yaml", SYNTAX);
    let missing = dir.0.join("d-missing.yaml");
    let errors = check_files([&valid, &semantic, &syntax, &missing]).unwrap_err();
    let s = |p: &Path| p.display().to_string();
    let (b, c, d) = (s(&semantic), s(&syntax), s(&missing));
    let got = lines(&errors);
    let want_prefixes = [
        format!("{d}:0: cannot read the file"),
        format!("{b}:2: rule id `Bad Id` may hold only lower-case letters"),
        format!("{b}:3: `version` must be a whole number of at least 1, not `one`"),
        format!("{b}:6: unknown kind `temprature`"),
        format!("{b}:8: unknown key `colour` in `match`"),
        format!("{b}:10: `gap`: invalid duration `3 minutes`"),
        format!("{b}:10: invalid judge `sometimes` (expected one of: each, close)"),
        format!("{b}:12: invalid action `reboot`"),
        format!("{b}:13: unknown key `when` in `clear`"),
        format!("{b}:14: missing required key `clear`"),
        format!("{b}:18: `ge` must be a number, not `hot`"),
        format!("{c}:"),
    ];
    for want in &want_prefixes {
        assert!(got.iter().any(|g| g.starts_with(want.as_str())), "missing {want:?} in:\n{}", got.join("\n"));
    }
    assert_eq!(got.len(), want_prefixes.len(), "unexpected extra problems:\n{}", got.join("\n"));
    assert!(got.iter().any(|g| g.starts_with(&c) && g.contains("YAML syntax error")), "{got:#?}");
}

#[test]
fn a_duplicate_id_across_files_names_both_places() {
    let dir = Scratch::new("rules-dup");
    let a = dir.write("a.yaml", VALID);
    let b = dir.write("b.yaml", &format!("# another file\n{VALID}"));
    let got = lines(&check_files([&a, &b]).unwrap_err());
    assert_eq!(got, [format!("{}:3: duplicate rule id `xid-79` (first defined at {}:2)", b.display(), a.display())]);
}

#[test]
fn a_bad_reload_keeps_the_running_rules() {
    let dir = Scratch::new("rules-reload");
    let path = dir.write("r.yaml", VALID);
    let mut running = check_files([&path]).unwrap();
    dir.write("r.yaml", &VALID.replace("reboot_node", "reboot_nod"));
    let errors = reload(&mut running, [&path]).unwrap_err();
    assert_eq!(
        lines(&errors),
        [format!(
            "{}:7: invalid action `reboot_nod` (expected one of: none, monitor, run_diagnostics, custom, cordon, drain, reset_gpu, reboot_node, contact_support, replace_node)",
            path.display()
        )]
    );
    assert_eq!(running.rules[0].action.as_str(), "reboot_node");
}
