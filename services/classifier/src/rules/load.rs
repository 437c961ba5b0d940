//! Loading rule files: parse, validate everything, and list every problem with file and line.
//!
//! A rule file holds one or more YAML documents, each a mapping with `rules:` (a list) and
//! optionally `synthetic: allowed|ignored`. The loader never stops at the first problem: it
//! walks every file and every rule so `gpumedic rules check` shows the whole list at once, and a
//! set with any problem is refused whole (the caller keeps the rules it had).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use super::duration::{Interval, parse_duration};
use super::model::*;
use super::observation::FieldValue;
use super::yaml::{self, Node, Value};

/// One problem in a rule file. Displays as `file:line: message`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}:{line}: {message}", file.display())]
pub struct RuleError {
    /// The file.
    pub file: PathBuf,
    /// The 1-based line (0 when the file could not be read at all).
    pub line: usize,
    /// What is wrong, as a sentence fragment.
    pub message: String,
}

/// Reads, validates and combines rule files, in the order given.
///
/// Returns every problem in every file, sorted by file order and line, or the rule set.
pub fn check_files<I, P>(paths: I) -> Result<RuleSet, Vec<RuleError>>
where
    I: IntoIterator<Item = P>,
    P: AsRef<Path>,
{
    let mut order = Vec::new();
    let mut sources = Vec::new();
    let mut errors = Vec::new();
    for path in paths {
        let path = path.as_ref().to_path_buf();
        order.push(path.clone());
        match std::fs::read_to_string(&path) {
            Ok(text) => sources.push((path, text)),
            Err(e) => errors.push(RuleError { file: path, line: 0, message: format!("cannot read the file: {e}") }),
        }
    }
    // All readable files are validated together so duplicate ids across files are found.
    let result = load_sources(sources.iter().map(|(p, t)| (p.as_path(), t.as_str())));
    match result {
        Ok(set) if errors.is_empty() => Ok(set),
        Ok(_) => Err(errors),
        Err(more) => {
            errors.extend(more);
            let position = |e: &RuleError| order.iter().position(|p| *p == e.file).unwrap_or(usize::MAX);
            errors.sort_by_key(|e| (position(e), e.line));
            Err(errors)
        }
    }
}

/// Reads every `*.yaml` and `*.yml` file in `dir`, in name order, as [`check_files`] does.
pub fn check_dir(dir: &Path) -> Result<RuleSet, Vec<RuleError>> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        vec![RuleError { file: dir.to_path_buf(), line: 0, message: format!("cannot list the directory: {e}") }]
    })?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(vec![RuleError { file: dir.to_path_buf(), line: 0, message: "no *.yaml rule files".into() }]);
    }
    check_files(paths)
}

/// Validates rule files already in memory, each named for messages.
pub fn load_sources<'a, I>(sources: I) -> Result<RuleSet, Vec<RuleError>>
where
    I: IntoIterator<Item = (&'a Path, &'a str)>,
{
    let mut errors = Vec::new();
    let mut rules: Vec<Rule> = Vec::new();
    let mut synthetic: Option<(SyntheticPolicy, PathBuf, usize)> = None;
    let mut seen: HashMap<String, Origin> = HashMap::new();
    for (file, text) in sources {
        let first_error = errors.len();
        load_file(file, text, &mut errors, &mut rules, &mut synthetic, &mut seen);
        // Walk order is not line order (a missing key is noticed after its siblings).
        errors[first_error..].sort_by_key(|e| e.line);
    }
    for rule in &rules {
        // A rule may be its own root (Xid 149 on one GPU, Xid 145 on its peers), never its own
        // suppressor.
        let suppressors = rule.suppressed_by.iter().map(|o| (o, **o == *rule.id));
        let roots = rule.sympathetic.iter().flat_map(|s| s.to.iter()).map(|o| (o, false));
        for (other, itself) in suppressors.chain(roots) {
            if !seen.contains_key(other) || itself {
                errors.push(RuleError {
                    file: rule.origin.file.clone(),
                    line: rule.origin.line,
                    message: format!(
                        "`{other}` (in `suppressed_by` or `sympathetic.to`) is not another rule of the set"
                    ),
                });
            }
        }
    }
    if errors.is_empty() {
        Ok(RuleSet { rules, synthetic: synthetic.map(|(p, _, _)| p).unwrap_or_default(), lead: None, max_quiet: None })
    } else {
        Err(errors)
    }
}

/// Validates one file into `rules`, reporting into `errors`.
fn load_file(
    file: &Path,
    text: &str,
    errors: &mut Vec<RuleError>,
    rules: &mut Vec<Rule>,
    synthetic: &mut Option<(SyntheticPolicy, PathBuf, usize)>,
    seen: &mut HashMap<String, Origin>,
) {
    let mut cx = Cx { file, errors };
    let docs = match yaml::parse(text) {
        Ok(docs) => docs,
        Err(e) => {
            cx.err(e.line, format!("YAML syntax error: {}", e.message));
            return;
        }
    };
    if docs.is_empty() {
        cx.err(1, "the file holds no rules".to_owned());
    }
    for doc in &docs {
        let Some(top) = cx.fields(doc, "a rule file", &["rules", "synthetic"]) else { continue };
        if let Some(node) = top.get("synthetic") {
            let table = [("ignored", SyntheticPolicy::Ignored), ("allowed", SyntheticPolicy::Allowed)];
            if let Some(policy) = cx.one_of(node, "synthetic", &table) {
                match synthetic {
                    Some((earlier, f, l)) if *earlier != policy => cx.err(
                        node.line,
                        format!("`synthetic` disagrees with {}:{l}, which sets it differently", f.display()),
                    ),
                    Some(_) => {}
                    None => *synthetic = Some((policy, file.to_path_buf(), node.line)),
                }
            }
        }
        let Some(list) = top.require(&mut cx, "rules") else { continue };
        let Value::Seq(items) = &list.value else {
            cx.err(list.line, format!("`rules` must be a list of rules, not {}", list.type_name()));
            continue;
        };
        for item in items {
            if let Some(rule) = rule(&mut cx, item) {
                if let Some(first) = seen.get(&*rule.id) {
                    cx.err(rule.origin.line, format!("duplicate rule id `{}` (first defined at {first})", rule.id));
                } else {
                    seen.insert(rule.id.to_string(), rule.origin.clone());
                    rules.push(rule);
                }
            }
        }
    }
}

/// Loads `paths` as a replacement for `current`: on success `current` becomes the new set, on
/// failure it is left untouched and every problem is returned, so a bad edit never removes the
/// rules that are running.
pub fn reload<I, P>(current: &mut RuleSet, paths: I) -> Result<(), Vec<RuleError>>
where
    I: IntoIterator<Item = P>,
    P: AsRef<Path>,
{
    *current = check_files(paths)?;
    Ok(())
}

/// The error sink for one file.
struct Cx<'a> {
    file: &'a Path,
    errors: &'a mut Vec<RuleError>,
}

/// The accepted entries of a mapping.
struct Fields<'n> {
    line: usize,
    entries: Vec<(&'n str, &'n Node)>,
}

impl<'n> Fields<'n> {
    fn get(&self, key: &str) -> Option<&'n Node> {
        self.entries.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
    }

    fn require(&self, cx: &mut Cx<'_>, key: &str) -> Option<&'n Node> {
        let node = self.get(key);
        if node.is_none() {
            cx.err(self.line, format!("missing required key `{key}`"));
        }
        node
    }
}

impl Cx<'_> {
    fn err(&mut self, line: usize, message: String) {
        self.errors.push(RuleError { file: self.file.to_path_buf(), line, message });
    }

    /// Reads a mapping, reporting keys that are not in `allowed` and keys given twice.
    fn fields<'n>(&mut self, node: &'n Node, what: &str, allowed: &[&str]) -> Option<Fields<'n>> {
        let Value::Map(entries) = &node.value else {
            self.err(node.line, format!("{what} must be a mapping, not {}", node.type_name()));
            return None;
        };
        let mut out = Fields { line: node.line, entries: Vec::new() };
        for (key, value) in entries {
            let Value::Scalar { text, .. } = &key.value else {
                self.err(key.line, format!("keys in {what} must be plain words"));
                continue;
            };
            if !allowed.contains(&text.as_str()) {
                self.err(key.line, format!("unknown key `{text}` in {what} (expected one of: {})", allowed.join(", ")));
            } else if out.get(text).is_some() {
                self.err(key.line, format!("key `{text}` given twice in {what}"));
            } else {
                out.entries.push((text.as_str(), value));
            }
        }
        Some(out)
    }

    fn text(&mut self, node: &Node, what: &str) -> Option<String> {
        match &node.value {
            Value::Scalar { text, .. } if !node.is_null() && !text.trim().is_empty() => Some(text.clone()),
            _ => {
                self.err(node.line, format!("`{what}` must be text, not {}", node.type_name()));
                None
            }
        }
    }

    fn number(&mut self, node: &Node, what: &str) -> Option<f64> {
        match &node.value {
            Value::Scalar { text, plain: true } => match text.parse::<f64>() {
                Ok(n) if n.is_finite() => Some(n),
                _ => {
                    self.err(node.line, format!("`{what}` must be a number, not `{text}`"));
                    None
                }
            },
            _ => {
                self.err(node.line, format!("`{what}` must be a number, not {}", node.type_name()));
                None
            }
        }
    }

    fn count(&mut self, node: &Node, what: &str, min: u32) -> Option<u32> {
        match &node.value {
            Value::Scalar { text, plain: true } => match text.parse::<u32>() {
                Ok(n) if n >= min => Some(n),
                _ => {
                    self.err(node.line, format!("`{what}` must be a whole number of at least {min}, not `{text}`"));
                    None
                }
            },
            _ => {
                self.err(node.line, format!("`{what}` must be a whole number, not {}", node.type_name()));
                None
            }
        }
    }

    fn boolean(&mut self, node: &Node, what: &str) -> Option<bool> {
        match &node.value {
            Value::Scalar { text, plain: true } if text == "true" => Some(true),
            Value::Scalar { text, plain: true } if text == "false" => Some(false),
            _ => {
                self.err(node.line, format!("`{what}` must be true or false"));
                None
            }
        }
    }

    fn duration(&mut self, node: &Node, what: &str, allow_zero: bool) -> Option<Interval> {
        let text = self.text(node, what)?;
        match parse_duration(&text) {
            Ok(d) if d == Interval::ZERO && !allow_zero => {
                self.err(node.line, format!("`{what}` must be longer than zero"));
                None
            }
            Ok(d) => Some(d),
            Err(e) => {
                self.err(node.line, format!("`{what}`: {e}"));
                None
            }
        }
    }

    fn one_of<T: Copy>(&mut self, node: &Node, what: &str, table: &[(&str, T)]) -> Option<T> {
        let text = self.text(node, what)?;
        match table.iter().find(|(name, _)| *name == text) {
            Some((_, v)) => Some(*v),
            None => {
                let names: Vec<&str> = table.iter().map(|(n, _)| *n).collect();
                self.err(node.line, format!("invalid {what} `{text}` (expected one of: {})", names.join(", ")));
                None
            }
        }
    }

    /// A scalar or a list of scalars, as a list of nodes.
    fn list<'n>(&mut self, node: &'n Node, what: &str) -> Vec<&'n Node> {
        match &node.value {
            Value::Seq(items) if items.is_empty() => {
                self.err(node.line, format!("`{what}` must not be an empty list"));
                Vec::new()
            }
            Value::Seq(items) => items.iter().collect(),
            Value::Scalar { .. } if !node.is_null() => vec![node],
            _ => {
                self.err(node.line, format!("`{what}` must be a value or a list, not {}", node.type_name()));
                Vec::new()
            }
        }
    }

    fn words(&mut self, node: &Node, what: &str, vocabulary: Option<&[&str]>) -> Vec<String> {
        let mut out = Vec::new();
        for item in self.list(node, what) {
            let Some(word) = self.text(item, what) else { continue };
            match vocabulary {
                Some(known) if !known.contains(&word.as_str()) => {
                    self.err(item.line, format!("unknown {what} `{word}` (expected one of: {})", known.join(", ")))
                }
                _ => out.push(word),
            }
        }
        out
    }

    fn codes(&mut self, node: &Node, what: &str) -> Vec<CodeRange> {
        let mut out = Vec::new();
        for item in self.list(node, what) {
            let Value::Scalar { text, .. } = &item.value else {
                self.err(item.line, format!("`{what}` entries must be codes like 48 or ranges like 144-150"));
                continue;
            };
            let parsed = match text.split_once('-') {
                Some((a, b)) => a.trim().parse::<u32>().ok().zip(b.trim().parse::<u32>().ok()),
                None => text.trim().parse::<u32>().ok().map(|c| (c, c)),
            };
            match parsed {
                Some((lo, hi)) if lo <= hi => out.push(CodeRange { lo, hi }),
                _ => self.err(item.line, format!("invalid code `{text}` in `{what}` (expected 48 or 144-150)")),
            }
        }
        out
    }

    fn literal(&mut self, node: &Node, what: &str) -> Option<FieldValue> {
        match &node.value {
            Value::Scalar { text, plain: true } if text == "true" || text == "false" => {
                Some(FieldValue::Bool(text == "true"))
            }
            Value::Scalar { text, plain: true } if !node.is_null() => Some(
                text.parse::<i64>()
                    .map(FieldValue::Int)
                    .or_else(|_| text.parse::<f64>().map(FieldValue::Float))
                    .unwrap_or_else(|_| FieldValue::Text(text.clone())),
            ),
            Value::Scalar { text, plain: false } => Some(FieldValue::Text(text.clone())),
            _ => {
                self.err(node.line, format!("`{what}` must be a value, not {}", node.type_name()));
                None
            }
        }
    }

    fn operand(&mut self, node: &Node, what: &str) -> Option<Operand> {
        if let Value::Map(_) = node.value {
            let f = self.fields(node, &format!("`{what}`"), &["field"])?;
            let name = f.require(self, "field")?;
            return self.text(name, "field").map(Operand::Field);
        }
        self.number(node, what).map(Operand::Number)
    }
}

const RULE_KEYS: &[&str] = &[
    "id",
    "version",
    "description",
    "scope",
    "match",
    "condition",
    "severity",
    "action",
    "then",
    "custom",
    "overridable",
    "override",
    "deferrable",
    "suppressed_by",
    "not_before",
    "sympathetic",
    "clear",
];

const MATCH_KEYS: &[&str] = &["source", "component", "kind", "xid", "healthy", "fields"];

fn rule(cx: &mut Cx<'_>, node: &Node) -> Option<Rule> {
    let f = cx.fields(node, "a rule", RULE_KEYS)?;
    let origin_line = f.get("id").map_or(node.line, |n| n.line);
    let id = f.require(cx, "id").and_then(|n| {
        let id = cx.text(n, "id")?;
        let ok = id.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c));
        if !ok {
            cx.err(n.line, format!("rule id `{id}` may hold only lower-case letters, digits, `-`, `_` and `.`"));
        }
        ok.then_some(id)
    });
    let version = f.require(cx, "version").and_then(|n| cx.count(n, "version", 1));
    let description = f.require(cx, "description").and_then(|n| cx.text(n, "description"));
    let scope = match f.get("scope") {
        Some(n) => cx.one_of(n, "scope", &[("gpu", Scope::Gpu), ("node", Scope::Node)]),
        None => Some(Scope::Gpu),
    };
    let matcher = f.require(cx, "match").and_then(|n| matching(cx, n, "match", Health::Unhealthy));
    let condition = match f.get("condition") {
        Some(n) => condition(cx, n),
        None => Some(Condition::Count { at_least: 1, within: None, distinct: None }),
    };
    let severity = f.require(cx, "severity").and_then(|n| cx.one_of(n, "severity", Severity::ALL));
    let action = f.require(cx, "action").and_then(|n| cx.one_of(n, "action", Action::ALL));
    let then = match f.get("then") {
        Some(n) => action_list(cx, n),
        None => Some(Vec::new()),
    };
    let custom = f.get("custom").and_then(|n| cx.text(n, "custom"));
    let wants_custom = action == Some(Action::Custom) || then.as_ref().is_some_and(|t| t.contains(&Action::Custom));
    if wants_custom && custom.is_none() && f.get("custom").is_none() {
        cx.err(f.line, "action `custom` needs a `custom` key naming the operator-defined action".into());
    }
    if !wants_custom && let Some(n) = f.get("custom") {
        cx.err(n.line, "`custom` is only meaningful with action `custom`".into());
    }
    let overridable = match f.get("overridable") {
        Some(n) => cx.boolean(n, "overridable"),
        None => Some(false),
    };
    let override_ = match f.get("override") {
        Some(n) => override_spec(cx, n).map(Some),
        None => Some(None),
    };
    if overridable == Some(true)
        && let Some(n) = f.get("override")
    {
        cx.err(n.line, "a rule with `override` cannot itself be `overridable`".into());
    }
    if let (Some(n), Some(c)) = (f.get("override"), &condition)
        && !matches!(c, Condition::Count { .. })
    {
        // The action is read from the event that fires the rule; only `count` fires on one.
        cx.err(n.line, format!("`override` needs a `count` condition, not `{}`", c.name()));
    }
    let clear =
        f.require(cx, "clear").and_then(|n| clear_spec(cx, n, matcher.as_ref().map(|m: &Match| default_evidence(m))));
    let deferrable = match f.get("deferrable") {
        Some(n) => cx.boolean(n, "deferrable"),
        None => Some(false),
    };
    let suppressed_by = f.get("suppressed_by").map(|n| cx.words(n, "suppressed_by", None)).unwrap_or_default();
    let not_before = match f.get("not_before") {
        Some(n) => schedule(cx, n).map(Some),
        None => Some(None),
    };
    let sympathetic = match f.get("sympathetic") {
        Some(n) => sympathetic_spec(cx, n).map(Some),
        None => Some(None),
    };
    if let (Some(m), Some(action), Some(then)) = (&matcher, action, &then) {
        let worst = then.iter().copied().fold(action, Action::max);
        if worst.quarantines() && only_application_xids(m) {
            // NVIDIA's catalog: these are the job's errors; the GPU is usually fine.
            cx.err(
                f.line,
                format!(
                    "a rule on application-class Xids only ({}) may not take the GPU out of service \
                     (`{worst}`): recommend `run_diagnostics` and let a failed diagnostic or a hardware Xid decide",
                    APPLICATION_XIDS.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
                ),
            );
        }
        if let Some(c) = &clear {
            // An override rule's action comes from the evidence: it must prove the remedies that
            // its outcomes may name, too.
            let named = override_.as_ref().and_then(Option::as_ref).into_iter().flat_map(|o| {
                o.actions.values().flat_map(|out| std::iter::once(out.action).chain(out.then.iter().copied()))
            });
            let remedies: Vec<Action> = std::iter::once(action).chain(then.iter().copied()).chain(named).collect();
            proof_fits(cx, f.get("clear").map_or(f.line, |n| n.line), scope, &remedies, c);
        }
    }
    Some(Rule {
        id: id?.into(),
        version: version?,
        description: description?,
        matcher: matcher?,
        scope: scope?,
        condition: condition?,
        severity: severity?,
        action: action?,
        then: then?,
        custom,
        overridable: overridable?,
        override_: override_?,
        deferrable: deferrable?,
        suppressed_by,
        not_before: not_before?,
        sympathetic: sympathetic?,
        clear: clear?,
        origin: Origin { file: cx.file.to_path_buf(), line: origin_line },
    })
}

fn action_list(cx: &mut Cx<'_>, node: &Node) -> Option<Vec<Action>> {
    let items = cx.list(node, "then");
    let parsed: Vec<Option<Action>> = items.into_iter().map(|n| cx.one_of(n, "action", Action::ALL)).collect();
    parsed.into_iter().collect()
}

/// Reads a `match`: one mapping or a list of mappings (any of them).
fn matching(cx: &mut Cx<'_>, node: &Node, what: &str, health: Health) -> Option<Match> {
    let alternatives: Vec<&Node> = match &node.value {
        Value::Seq(items) if items.is_empty() => {
            cx.err(node.line, format!("`{what}` must not be an empty list"));
            return None;
        }
        Value::Seq(items) => items.iter().collect(),
        _ => vec![node],
    };
    let mut out = Vec::new();
    let mut ok = true;
    for alt in alternatives {
        match matcher(cx, alt, what, health) {
            Some(m) => out.push(m),
            None => ok = false,
        }
    }
    ok.then_some(Match(out))
}

fn matcher(cx: &mut Cx<'_>, node: &Node, what: &str, default_health: Health) -> Option<Matcher> {
    let f = cx.fields(node, &format!("`{what}`"), MATCH_KEYS)?;
    let before = cx.errors.len();
    let source = f.get("source").map(|n| cx.words(n, "source", Some(SOURCES))).unwrap_or_default();
    let component = f.get("component").map(|n| cx.words(n, "component", None)).unwrap_or_default();
    let kind = f.get("kind").map(|n| cx.words(n, "kind", Some(KINDS))).unwrap_or_default();
    let xid = f.get("xid").map(|n| cx.codes(n, "xid")).unwrap_or_default();
    let health = match f.get("healthy") {
        Some(n) if matches!(&n.value, Value::Scalar { text, plain: true } if text == "any") => Health::Any,
        Some(n) => match cx.boolean(n, "healthy") {
            Some(true) => Health::Healthy,
            Some(false) => Health::Unhealthy,
            None => default_health,
        },
        None => default_health,
    };
    let mut fields = Vec::new();
    if let Some(n) = f.get("fields") {
        field_tests(cx, n, &mut fields);
    }
    let names_something = !(f.get("source").is_none()
        && f.get("component").is_none()
        && f.get("kind").is_none()
        && f.get("xid").is_none()
        && f.get("fields").is_none());
    // A clear condition may accept "any healthy observation"; a rule's match may not accept
    // everything, because a typo'd key would otherwise turn into a rule that fires on all events.
    let healthy_only = default_health == Health::Healthy && f.get("healthy").is_some();
    if !names_something && !healthy_only {
        cx.err(f.line, format!("`{what}` names no criterion (source, component, kind, xid or fields)"));
    }
    (cx.errors.len() == before).then_some(Matcher { source, component, kind, xid, health, fields })
}

const TEST_KEYS: &[&str] = &["eq", "ne", "gt", "ge", "lt", "le", "in", "exists"];

fn field_tests(cx: &mut Cx<'_>, node: &Node, out: &mut Vec<FieldPredicate>) {
    // `fields` keys are field names, so they are read without a fixed vocabulary.
    let Value::Map(entries) = &node.value else {
        cx.err(node.line, format!("`fields` must map field names to tests, not {}", node.type_name()));
        return;
    };
    if entries.is_empty() {
        cx.err(node.line, "`fields` names no field".into());
    }
    let mut seen: Vec<&str> = Vec::new();
    for (key, value) in entries {
        let Value::Scalar { text: name, .. } = &key.value else {
            cx.err(key.line, "field names must be plain words".into());
            continue;
        };
        if seen.contains(&name.as_str()) {
            cx.err(key.line, format!("field `{name}` given twice in `fields`"));
            continue;
        }
        seen.push(name);
        if !matches!(value.value, Value::Map(_)) {
            // `field: value` is shorthand for equality.
            if let Some(v) = cx.literal(value, name) {
                out.push(FieldPredicate { field: name.clone(), test: FieldTest::Eq(v) });
            }
            continue;
        }
        let Some(tests) = cx.fields(value, &format!("field `{name}`"), TEST_KEYS) else { continue };
        if tests.entries.is_empty() {
            cx.err(value.line, format!("field `{name}` has no test (expected one of: {})", TEST_KEYS.join(", ")));
        }
        for (op, arg) in &tests.entries {
            let test = match *op {
                "eq" => cx.literal(arg, op).map(FieldTest::Eq),
                "ne" => cx.literal(arg, op).map(FieldTest::Ne),
                "exists" => cx.boolean(arg, op).map(FieldTest::Exists),
                "in" => {
                    let items = cx.list(arg, "in");
                    let values: Option<Vec<FieldValue>> = items.into_iter().map(|n| cx.literal(n, "in")).collect();
                    values.map(FieldTest::In)
                }
                cmp => {
                    let c = match cmp {
                        "gt" => Cmp::Gt,
                        "ge" => Cmp::Ge,
                        "lt" => Cmp::Lt,
                        _ => Cmp::Le,
                    };
                    cx.operand(arg, cmp).map(|o| FieldTest::Cmp(c, o))
                }
            };
            if let Some(test) = test {
                out.push(FieldPredicate { field: name.clone(), test });
            }
        }
    }
}

/// The largest `count.at_least`.
const MAX_COUNT: u32 = 10_000;

const CONDITIONS: &[&str] = &["count", "burst", "together", "rate", "threshold"];

fn condition(cx: &mut Cx<'_>, node: &Node) -> Option<Condition> {
    let f = cx.fields(node, "`condition`", CONDITIONS)?;
    if f.entries.len() != 1 {
        cx.err(f.line, format!("`condition` must name exactly one of: {}", CONDITIONS.join(", ")));
        return None;
    }
    let (name, body) = f.entries[0];
    match name {
        "count" => {
            let c = cx.fields(body, "`count`", &["at_least", "within", "distinct"])?;
            let distinct = match c.get("distinct") {
                Some(n) => cx.one_of(n, "distinct", &[("process", Distinct::Process)]).map(Some),
                None => Some(None),
            };
            let at_least = c.require(cx, "at_least").and_then(|n| {
                let v = cx.count(n, "at_least", 1)?;
                if v > MAX_COUNT {
                    // The state keeps the latest `at_least` events, so this bounds its memory.
                    cx.err(n.line, format!("`at_least` may be at most {MAX_COUNT}"));
                    return None;
                }
                Some(v)
            });
            let within = match c.get("within") {
                Some(n) => cx.duration(n, "within", false).map(Some),
                None if at_least.is_some_and(|n| n > 1) => {
                    cx.err(c.line, "`count` above 1 needs a `within` window".into());
                    None
                }
                None => Some(None),
            };
            Some(Condition::Count { at_least: at_least?, within: within?, distinct: distinct? })
        }
        "burst" => {
            let keys = ["gap", "judge", "with_all", "with_any", "without", "only", "min_events"];
            let b = cx.fields(body, "`burst`", &keys)?;
            let gap = match b.get("gap") {
                Some(n) => cx.duration(n, "gap", false),
                None => Some(Interval::from_secs(180)),
            };
            let judge = match b.get("judge") {
                Some(n) => cx.one_of(n, "judge", &[("each", Judge::Each), ("close", Judge::Close)]),
                None => Some(Judge::Close),
            };
            let mut codes = |key: &str| b.get(key).map(|n| cx.codes(n, key)).unwrap_or_default();
            let test = BurstTest {
                with_all: codes("with_all"),
                with_any: codes("with_any"),
                without: codes("without"),
                only: codes("only"),
                min_events: match b.get("min_events") {
                    Some(n) => cx.count(n, "min_events", 1)?,
                    None => 1,
                },
            };
            if judge == Some(Judge::Each) {
                for key in ["without", "only"] {
                    if let Some(n) = b.get(key) {
                        // A growing burst may still gain the excluded code, so "alone" can only
                        // be known once the burst has ended.
                        cx.err(n.line, format!("`{key}` needs `judge: close`: a growing burst may still gain codes"));
                    }
                }
            }
            Some(Condition::Burst { gap: gap?, judge: judge?, test })
        }
        "together" => {
            let t = cx.fields(body, "`together`", &["of", "within"])?;
            let within = t.require(cx, "within").and_then(|n| cx.duration(n, "within", false));
            let of = t.require(cx, "of").and_then(|n| {
                let Value::Seq(items) = &n.value else {
                    cx.err(n.line, "`of` must be a list of matches".into());
                    return None;
                };
                if items.len() < 2 {
                    cx.err(n.line, "`of` needs at least two matches".into());
                }
                let parsed: Vec<Option<Match>> =
                    items.iter().map(|i| matching(cx, i, "together.of", Health::Any)).collect();
                parsed.into_iter().collect::<Option<Vec<_>>>().filter(|v| v.len() >= 2)
            });
            Some(Condition::Together { of: of?, within: within? })
        }
        "rate" => {
            let r = cx.fields(body, "`rate`", &["field", "more_than", "per"])?;
            let field = r.require(cx, "field").and_then(|n| cx.text(n, "field"));
            let more_than = r.require(cx, "more_than").and_then(|n| cx.number(n, "more_than"));
            if let (Some(m), Some(n)) = (more_than, r.get("more_than"))
                && m < 0.0
            {
                cx.err(n.line, "`more_than` must not be negative".into());
            }
            let per = r.require(cx, "per").and_then(|n| cx.duration(n, "per", false));
            Some(Condition::Rate { field: field?, more_than: more_than.filter(|m| *m >= 0.0)?, per: per? })
        }
        _ => {
            let t = cx.fields(body, "`threshold`", &["field", "gt", "ge", "lt", "le", "for", "readings"])?;
            let field = t.require(cx, "field").and_then(|n| cx.text(n, "field"));
            let cmps: Vec<(&str, &Node)> =
                t.entries.iter().filter(|(k, _)| matches!(*k, "gt" | "ge" | "lt" | "le")).copied().collect();
            if cmps.len() != 1 {
                cx.err(t.line, "`threshold` needs exactly one of gt, ge, lt, le".into());
            }
            let limit = cmps.first().and_then(|(k, n)| {
                let cmp = match *k {
                    "gt" => Cmp::Gt,
                    "ge" => Cmp::Ge,
                    "lt" => Cmp::Lt,
                    _ => Cmp::Le,
                };
                cx.operand(n, k).map(|o| (cmp, o))
            });
            let for_ = match t.get("for") {
                Some(n) => cx.duration(n, "for", true),
                None => Some(Interval::ZERO),
            };
            let readings = match t.get("readings") {
                Some(n) => cx.count(n, "readings", 2),
                None => Some(0),
            };
            if for_ == Some(Interval::ZERO) && readings == Some(0) {
                // One reading decides nothing: a glitch or an absurd value would act at once.
                cx.err(t.line, "`threshold` needs a hold: `for` longer than zero, or `readings` of at least 2".into());
            }
            let (cmp, limit) = limit.filter(|_| cmps.len() == 1)?;
            Some(Condition::Threshold { field: field?, cmp, limit, for_: for_?, readings: readings? })
        }
    }
}

fn override_spec(cx: &mut Cx<'_>, node: &Node) -> Option<Override> {
    let f = cx.fields(node, "`override`", &["field", "actions"])?;
    let field = f.require(cx, "field").and_then(|n| cx.text(n, "field"));
    let actions_node = f.require(cx, "actions")?;
    let Value::Map(entries) = &actions_node.value else {
        cx.err(actions_node.line, "`actions` must map field values to actions".into());
        return None;
    };
    let mut actions = BTreeMap::new();
    let before = cx.errors.len();
    for (key, value) in entries {
        let Some(name) = cx.text(key, "actions key") else { continue };
        let outcome = match &value.value {
            Value::Map(_) => {
                let o = cx.fields(value, &format!("the outcome for `{name}`"), &["action", "then", "severity"]);
                o.and_then(|o| {
                    let action = o.require(cx, "action").and_then(|n| cx.one_of(n, "action", Action::ALL));
                    let then = o.get("then").map_or(Some(Vec::new()), |n| action_list(cx, n));
                    let severity = match o.get("severity") {
                        Some(n) => cx.one_of(n, "severity", Severity::ALL).map(Some),
                        None => Some(None),
                    };
                    Some(Outcome { action: action?, then: then?, severity: severity? })
                })
            }
            _ => cx.one_of(value, "action", Action::ALL).map(|action| Outcome { action, then: vec![], severity: None }),
        };
        if let Some(outcome) = outcome
            && actions.insert(normalise_key(&name), outcome).is_some()
        {
            cx.err(key.line, format!("`{name}` is given twice in `actions`"));
        }
    }
    if entries.is_empty() {
        cx.err(actions_node.line, "`actions` must map at least one value".into());
    }
    (cx.errors.len() == before).then_some(())?;
    Some(Override { field: field?, actions })
}

/// The evidence a clear condition accepts when the rule does not say: healthy observations of
/// the kinds the rule watches (or of any kind, when the rule's match names none).
fn default_evidence(m: &Match) -> Match {
    let mut kinds: Vec<String> = Vec::new();
    for alt in &m.0 {
        if alt.kind.is_empty() {
            kinds.clear();
            break;
        }
        for k in &alt.kind {
            if !kinds.contains(k) {
                kinds.push(k.clone());
            }
        }
    }
    Match(vec![Matcher {
        source: vec![],
        component: vec![],
        kind: kinds,
        xid: vec![],
        health: Health::Healthy,
        fields: vec![],
    }])
}

fn clear_spec(cx: &mut Cx<'_>, node: &Node, default: Option<Match>) -> Option<Clear> {
    let f = cx.fields(node, "`clear`", &["evidence", "proof", "quiet"])?;
    let quiet = f.require(cx, "quiet").and_then(|n| cx.duration(n, "quiet", true));
    let evidence = match f.get("evidence") {
        Some(n) => matching(cx, n, "clear.evidence", Health::Healthy),
        None => default,
    };
    let proof = match f.get("proof") {
        Some(n) => cx.one_of(n, "proof", Proof::ALL),
        None => Some(Proof::None),
    };
    Some(Clear { evidence: evidence?, proof: proof?, quiet: quiet? })
}

fn sympathetic_spec(cx: &mut Cx<'_>, node: &Node) -> Option<Sympathetic> {
    let f = cx.fields(node, "`sympathetic`", &["xid", "to", "within"])?;
    let xid = f.require(cx, "xid").map(|n| cx.codes(n, "xid"));
    let to = f.require(cx, "to").map(|n| cx.words(n, "to", None));
    let within = f.require(cx, "within").and_then(|n| cx.duration(n, "within", false));
    Some(Sympathetic { xid: xid?, to: to?, within: within? })
}

fn schedule(cx: &mut Cx<'_>, node: &Node) -> Option<Schedule> {
    let f = cx.fields(node, "`not_before`", &["field", "lead"])?;
    let field = f.require(cx, "field").and_then(|n| cx.text(n, "field"));
    let lead = f.require(cx, "lead").and_then(|n| cx.duration(n, "lead", true));
    Some(Schedule { field: field?, lead: lead? })
}

/// True when every alternative of `m` names Xid codes and all of them are application-class.
fn only_application_xids(m: &Match) -> bool {
    !m.0.is_empty()
        && m.0.iter().all(|alt| {
            !alt.xid.is_empty()
                && alt.kind.iter().all(|k| k == "xid")
                && alt.xid.iter().all(|r| (r.lo..=r.hi).all(|c| APPLICATION_XIDS.contains(&c)))
        })
}

/// Refuses a clear whose proof cannot show the remedy happened. A heartbeat says the GPU
/// answers, not that it was reset or that the node rebooted: a rule that resets or reboots, and
/// accepts evidence of any kind, must wait for the proof of that remedy first.
fn proof_fits(cx: &mut Cx<'_>, line: usize, scope: Option<Scope>, remedies: &[Action], clear: &Clear) {
    let any_kind = clear.evidence.0.iter().any(|alt| alt.kind.is_empty() && alt.fields.is_empty());
    let reboots = remedies.iter().any(|a| matches!(a, Action::RebootNode | Action::ReplaceNode));
    let (needed, worst) = if reboots && (scope == Some(Scope::Node) || !remedies.contains(&Action::ResetGpu)) {
        (Proof::Reboot, Action::RebootNode)
    } else if remedies.contains(&Action::ResetGpu) || reboots {
        // A GPU-scoped rule whose outcomes range from a reset to a reboot: a reboot resets the GPU
        // too, so the reset is the proof they share.
        (Proof::Reset, Action::ResetGpu)
    } else {
        return;
    };
    let shown = match clear.proof {
        Proof::Reboot => true,
        Proof::Reset => needed == Proof::Reset,
        Proof::None => false,
    };
    if any_kind && !shown {
        cx.err(
            line,
            format!(
                "a rule that recommends `{worst}` and clears on any healthy evidence needs `proof: {}` \
                 (another GPU's heartbeat, or this one's before the remedy, proves nothing)",
                needed.as_str()
            ),
        );
    }
    if scope == Some(Scope::Node) && needed == Proof::Reboot && clear.proof != Proof::Reboot {
        cx.err(line, format!("a node-wide rule that recommends `{worst}` needs `proof: reboot`"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<RuleSet, Vec<RuleError>> {
        load_sources([(Path::new("t.yaml"), text)])
    }

    fn messages(text: &str) -> Vec<String> {
        load(text).unwrap_err().into_iter().map(|e| e.to_string()).collect()
    }

    const GOOD: &str = r#"
synthetic: allowed
rules:
  - id: xid-48
    version: 2
    description: Double-bit ECC
    match: {kind: xid, xid: [48, "144-150"]}
    condition: {burst: {gap: 3m, with_all: [48], without: [63, 64]}}
    severity: critical
    action: reset_gpu
    then: [contact_support]
    overridable: true
    clear: {quiet: 10m}
  - id: temp
    version: 1
    description: Hot
    match:
      - kind: temperature
        healthy: any
        fields: {value: {ge: {field: slowdown_threshold}}, unit: C}
    condition: {threshold: {field: value, ge: 90, for: 30s}}
    severity: warning
    action: custom
    custom: fan-check
    clear: {evidence: {kind: temperature, fields: {value: {lt: 80}}}, quiet: 5m}
"#;

    #[test]
    fn reads_a_valid_file() {
        let set = load(GOOD).unwrap();
        assert_eq!(set.synthetic, SyntheticPolicy::Allowed);
        let r = set.get("xid-48").unwrap();
        assert_eq!(r.version, 2);
        assert_eq!(r.origin.line, 4);
        assert_eq!(r.matcher.0[0].xid, vec![CodeRange { lo: 48, hi: 48 }, CodeRange { lo: 144, hi: 150 }]);
        assert!(
            matches!(&r.condition, Condition::Burst { judge: Judge::Close, gap, .. } if *gap == Interval::from_secs(180))
        );
        assert_eq!(r.clear.evidence.0[0].kind, vec!["xid".to_string()], "default evidence follows the rule's kinds");
        assert_eq!(r.clear.evidence.0[0].health, Health::Healthy);
        let t = set.get("temp").unwrap();
        assert_eq!(t.matcher.0[0].health, Health::Any);
        assert_eq!(t.matcher.0[0].fields.len(), 2);
        assert_eq!(t.custom.as_deref(), Some("fan-check"));
    }

    #[test]
    fn lists_every_problem_with_its_line() {
        let text = "\
rules:
  - id: a
    version: 0
    description: x
    match: {kind: xidd}
    condition: {count: {at_least: 3, within: 3x}}
    severity: crit
    action: reset_gpu
    colour: red
    clear: {quiet: 1m}
  - id: b
    version: 1
    description: y
    match: {}
    severity: info
    action: none
    clear: {quiet: 1m}
";
        let msgs = messages(text);
        let expect = [
            "t.yaml:3: `version` must be a whole number of at least 1, not `0`",
            "t.yaml:5: unknown kind `xidd`",
            "t.yaml:6: `within`: invalid duration `3x`",
            "t.yaml:7: invalid severity `crit`",
            "t.yaml:9: unknown key `colour` in a rule",
            "t.yaml:14: `match` names no criterion",
        ];
        for e in expect {
            assert!(msgs.iter().any(|m| m.starts_with(e)), "missing {e:?} in {msgs:#?}");
        }
        assert_eq!(msgs.len(), expect.len(), "{msgs:#?}");
    }

    #[test]
    fn refuses_inconsistent_conditions() {
        let base = |cond: &str| {
            format!(
                "rules:\n  - id: r\n    version: 1\n    description: d\n    match: {{kind: xid}}\n    condition: {cond}\n    severity: info\n    action: none\n    clear: {{quiet: 1m}}\n"
            )
        };
        let cases = [
            ("{count: {at_least: 2}}", "`count` above 1 needs a `within` window"),
            ("{burst: {judge: each, only: [45]}}", "`only` needs `judge: close`"),
            ("{together: {of: [{xid: [48]}], within: 1m}}", "`of` needs at least two matches"),
            ("{rate: {field: c, more_than: -1, per: 1h}}", "`more_than` must not be negative"),
            ("{threshold: {field: v, gt: 1, lt: 2}}", "needs exactly one of gt, ge, lt, le"),
            ("{count: {at_least: 1}, rate: {field: c, more_than: 1, per: 1h}}", "exactly one of"),
            ("{burst: {gap: 0s}}", "`gap` must be longer than zero"),
        ];
        for (cond, want) in cases {
            let msgs = messages(&base(cond));
            assert!(msgs.iter().any(|m| m.contains(want)), "{cond}: {msgs:#?}");
            assert!(msgs.iter().all(|m| m.starts_with("t.yaml:6:")), "{cond}: {msgs:#?}");
        }
    }

    #[test]
    fn refuses_duplicate_ids_conflicting_settings_and_bad_overrides() {
        let a = "synthetic: allowed\nrules:\n  - {id: r, version: 1, description: d, match: {kind: xid}, severity: info, action: none, clear: {quiet: 1m}}\n";
        let b = "synthetic: ignored\nrules:\n  - {id: r, version: 1, description: d, match: {kind: xid}, severity: info, action: custom, clear: {quiet: 1m}}\n  - {id: o, version: 1, description: d, match: {kind: xid}, severity: info, action: none, overridable: true, override: {field: f, actions: {x: explode}}, clear: {quiet: 1m}}\n";
        let errs = load_sources([(Path::new("a.yaml"), a), (Path::new("b.yaml"), b)]).unwrap_err();
        let msgs: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        for want in [
            "b.yaml:1: `synthetic` disagrees with a.yaml:1",
            "b.yaml:3: duplicate rule id `r` (first defined at a.yaml:3)",
            "b.yaml:3: action `custom` needs a `custom` key",
            "b.yaml:4: invalid action `explode`",
            "b.yaml:4: a rule with `override` cannot itself be `overridable`",
        ] {
            assert!(msgs.iter().any(|m| m.starts_with(want)), "missing {want:?} in {msgs:#?}");
        }
    }

    #[test]
    fn reports_syntax_errors_and_unreadable_files_and_keeps_going() {
        let errs = load_sources([
            (Path::new("bad.yaml"), "rules:\n  - id: [unclosed\n"),
            (Path::new("ok.yaml"), "rules: 3\n"),
        ])
        .unwrap_err();
        assert_eq!(errs.len(), 2, "{errs:#?}");
        assert!(errs[0].to_string().starts_with("bad.yaml:"), "{}", errs[0]);
        assert!(errs[0].message.contains("YAML syntax error"));
        assert_eq!(errs[1].to_string(), "ok.yaml:1: `rules` must be a list of rules, not a scalar");
        let errs = check_files(["/nonexistent/rules.yaml"]).unwrap_err();
        assert!(errs[0].to_string().starts_with("/nonexistent/rules.yaml:0: cannot read the file"));
    }

    #[test]
    fn reload_keeps_the_old_set_on_error() {
        let dir = std::env::temp_dir().join(format!("gpumedic-rules-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.yaml");
        std::fs::write(&path, GOOD).unwrap();
        let mut current = check_files([&path]).unwrap();
        std::fs::write(&path, GOOD.replace("severity: critical", "severity: dire")).unwrap();
        let errs = reload(&mut current, [&path]).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(current.get("xid-48").unwrap().severity, Severity::Critical, "old rules stay");
        std::fs::write(&path, GOOD.replace("version: 2", "version: 3")).unwrap();
        reload(&mut current, [&path]).unwrap();
        assert_eq!(current.get("xid-48").unwrap().version, 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
