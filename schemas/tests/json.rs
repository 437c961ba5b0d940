//! An enriched event written as JSON without its null fields reads back as the same event, for
//! every detail kind and with every optional field left empty in turn: incident history stores
//! recorded events that way (`health_events.record`) and a classifier's rebuild reads them back.

mod common;

use gpumedic_schemas::EnrichedHealthEvent;
use gpumedic_schemas::json::to_string_without_nulls;
use serde_json::Value;

/// The paths (object keys from the root) of every non-null value under `v`.
fn set_paths(v: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    if let Value::Object(map) = v {
        for (k, child) in map {
            if child.is_null() {
                continue;
            }
            at.push(k.clone());
            out.push(at.clone());
            set_paths(child, at, out);
            at.pop();
        }
    }
}

fn set_null(v: &mut Value, path: &[String]) {
    let (last, parents) = path.split_last().unwrap();
    let mut node = v;
    for p in parents {
        node = node.get_mut(p).unwrap();
    }
    node[last] = Value::Null;
}

/// `e` written without nulls reads back equal, and has no `null` left in an object.
fn reads_back(e: &EnrichedHealthEvent) {
    let text = to_string_without_nulls(e).unwrap();
    let back: EnrichedHealthEvent = serde_json::from_str(&text)
        .unwrap_or_else(|err| panic!("{err}: the record without nulls does not read back: {text}"));
    assert_eq!(&back, e, "{text}");
    assert!(!text.contains(":null"), "a null struct field was written: {text}");
    // And it is the same JSON as `serde_json` writes, less the nulls.
    let full: Value = serde_json::to_value(e).unwrap();
    let stripped: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(strip(full), stripped);
}

fn strip(v: Value) -> Value {
    match v {
        Value::Object(map) => {
            Value::Object(map.into_iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k, strip(v))).collect())
        }
        Value::Array(items) => Value::Array(items.into_iter().map(strip).collect()),
        other => other,
    }
}

#[test]
fn every_kind_with_every_optional_field_empty_in_turn_reads_back_without_nulls() {
    let mut optional = 0;
    for detail in common::all_details() {
        let e = common::enriched(detail);
        reads_back(&e);
        // Each field that may be null (the event still reads with it null) is tried empty.
        let full = serde_json::to_value(&e).unwrap();
        let mut paths = Vec::new();
        set_paths(&full, &mut Vec::new(), &mut paths);
        for path in paths {
            let mut v = full.clone();
            set_null(&mut v, &path);
            if let Ok(emptied) = serde_json::from_value::<EnrichedHealthEvent>(v) {
                optional += 1;
                reads_back(&emptied);
            }
        }
    }
    // The fixture sets every optional field, so many are tried (a count that fell to zero would
    // mean the loop tried nothing).
    assert!(optional > 100, "only {optional} optional fields tried");
}

#[test]
fn a_record_written_with_nulls_still_reads() {
    for detail in common::all_details() {
        let e = common::enriched(detail);
        let with_nulls = serde_json::to_string(&e).unwrap();
        assert_eq!(serde_json::from_str::<EnrichedHealthEvent>(&with_nulls).unwrap(), e);
    }
}
