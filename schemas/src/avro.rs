//! The `.avsc` files under `schemas/avro/`, embedded at build time and parsed once.
//!
//! The files are the source of truth. A file may refer to a type defined in another file by its
//! full name (the enriched event embeds the raw event; the verdict reuses the raw event's `Entity`).
//! [`parse_set`] inlines such references, so that every record gets a self-contained schema: the
//! form a schema registry stores and a consumer in another language can use on its own.
//!
//! Beside the current files, the files of every earlier released version stay embedded
//! (`schemas/avro/released/v1/`, `schemas/avro/released/v2/`): they are the writer schemas of
//! records framed with that version's ids, which stay readable forever.

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;

use apache_avro::Schema;
use serde_json::{Map, Value};

/// The raw health event schema file.
pub const HEALTH_EVENT_AVSC: &str = include_str!("../avro/health_event.avsc");
/// The enriched health event schema file.
pub const ENRICHED_HEALTH_EVENT_AVSC: &str = include_str!("../avro/enriched_health_event.avsc");
/// The verdict schema file.
pub const VERDICT_AVSC: &str = include_str!("../avro/verdict.avsc");
/// The action outcome schema file.
pub const ACTION_OUTCOME_AVSC: &str = include_str!("../avro/action_outcome.avsc");

/// The current schema files, in the order of the codec's schema table: `HealthEvent`,
/// `EnrichedHealthEvent`, `Verdict`, `ActionOutcome`.
pub const CURRENT_AVSC: [&str; 4] = [HEALTH_EVENT_AVSC, ENRICHED_HEALTH_EVENT_AVSC, VERDICT_AVSC, ACTION_OUTCOME_AVSC];

/// The version 1 schema files as released (`schemas/avro/released/v1/`), in the same order: the
/// writer schemas of records framed with the embedded ids 1 to 4.
pub const V1_AVSC: [&str; 4] = [
    include_str!("../avro/released/v1/health_event.avsc"),
    include_str!("../avro/released/v1/enriched_health_event.avsc"),
    include_str!("../avro/released/v1/verdict.avsc"),
    include_str!("../avro/released/v1/action_outcome.avsc"),
];

/// The version 2 schema files as released (`schemas/avro/released/v2/`), in the same order: the
/// writer schemas of records framed with the embedded ids 5 and 6 (`Verdict` and `ActionOutcome`
/// did not change in version 3, so ids 7 and 8 are also their current schemas).
pub const V2_AVSC: [&str; 4] = [
    include_str!("../avro/released/v2/health_event.avsc"),
    include_str!("../avro/released/v2/enriched_health_event.avsc"),
    include_str!("../avro/released/v2/verdict.avsc"),
    include_str!("../avro/released/v2/action_outcome.avsc"),
];

/// The Avro namespace of every gpumedic record.
pub const NAMESPACE: &str = "io.gpumedic.events";

/// The current schemas, self-contained, in the order of [`CURRENT_AVSC`].
static CURRENT: LazyLock<Vec<Schema>> = LazyLock::new(|| {
    // A failure here is a defect of the embedded files, caught by this crate's tests before any
    // release; there is no bad input at run time that can reach it.
    parse_set(&CURRENT_AVSC).expect("the embedded .avsc files parse (tested)")
});

/// The version 1 schemas, self-contained, in the order of [`V1_AVSC`].
static V1: LazyLock<Vec<Schema>> =
    LazyLock::new(|| parse_set(&V1_AVSC).expect("the embedded released v1 .avsc files parse (tested)"));

/// The version 2 schemas, self-contained, in the order of [`V2_AVSC`].
static V2: LazyLock<Vec<Schema>> =
    LazyLock::new(|| parse_set(&V2_AVSC).expect("the embedded released v2 .avsc files parse (tested)"));

/// The current schemas, in the order of [`CURRENT_AVSC`].
pub fn current() -> &'static [Schema] {
    &CURRENT
}

/// The version 1 schemas, in the order of [`V1_AVSC`]: what records framed with the embedded ids
/// 1 to 4 were written with.
pub fn v1() -> &'static [Schema] {
    &V1
}

/// The version 2 schemas, in the order of [`V2_AVSC`]: what records framed with the embedded ids
/// 5 to 8 were written with.
pub fn v2() -> &'static [Schema] {
    &V2
}

/// The current `HealthEvent` schema.
pub fn health_event() -> &'static Schema {
    &CURRENT[0]
}

/// The current `EnrichedHealthEvent` schema.
pub fn enriched_health_event() -> &'static Schema {
    &CURRENT[1]
}

/// The current `Verdict` schema.
pub fn verdict() -> &'static Schema {
    &CURRENT[2]
}

/// The current `ActionOutcome` schema.
pub fn action_outcome() -> &'static Schema {
    &CURRENT[3]
}

/// Why a set of schema files could not be turned into schemas.
#[derive(Debug, thiserror::Error)]
pub enum SchemaFileError {
    /// A file is not JSON.
    #[error("schema file {index} is not valid JSON: {source}")]
    Json {
        /// Position of the file in the set.
        index: usize,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// A file is JSON but not a valid Avro schema (after inlining).
    #[error("schema file {index} is not a valid Avro schema: {source}")]
    Avro {
        /// Position of the file in the set.
        index: usize,
        /// apache-avro's parse error.
        #[source]
        source: Box<apache_avro::Error>,
    },
}

/// Parses a set of `.avsc` texts that may refer to each other's named types by full name, and
/// returns one self-contained schema per text, in order.
///
/// # Errors
/// [`SchemaFileError`] when a text is not JSON or not a valid schema once references are inlined.
pub fn parse_set(sources: &[&str]) -> Result<Vec<Schema>, SchemaFileError> {
    inline_set(sources)?
        .iter()
        .enumerate()
        .map(|(index, document)| {
            Schema::parse(document).map_err(|source| SchemaFileError::Avro { index, source: Box::new(source) })
        })
        .collect()
}

/// Parses a set as [`parse_set`] does and returns the self-contained JSON text of each schema, docs
/// and defaults kept: what a schema registry stores (the canonical form would drop the defaults
/// that schema resolution needs).
///
/// # Errors
/// As [`parse_set`].
pub fn self_contained_json(sources: &[&str]) -> Result<Vec<String>, SchemaFileError> {
    // Parsed as well, so that only valid schemas are handed out.
    parse_set(sources)?;
    Ok(inline_set(sources)?.iter().map(Value::to_string).collect())
}

/// The JSON of each source with references to other sources' types inlined.
fn inline_set(sources: &[&str]) -> Result<Vec<Value>, SchemaFileError> {
    let mut documents = Vec::with_capacity(sources.len());
    for (index, source) in sources.iter().enumerate() {
        documents
            .push(serde_json::from_str::<Value>(source).map_err(|source| SchemaFileError::Json { index, source })?);
    }
    let mut definitions = HashMap::new();
    for document in &documents {
        collect_definitions(document, None, &mut definitions);
    }
    Ok(documents.iter().map(|document| inline(document, None, &definitions, &mut HashSet::new())).collect())
}

const PRIMITIVES: [&str; 8] = ["null", "boolean", "int", "long", "float", "double", "bytes", "string"];

/// The full name of a named type and the namespace its nested types inherit.
fn full_name(object: &Map<String, Value>, enclosing: Option<&str>) -> Option<(String, Option<String>)> {
    let name = object.get("name")?.as_str()?;
    if let Some((namespace, _)) = name.rsplit_once('.') {
        return Some((name.to_owned(), Some(namespace.to_owned())));
    }
    let namespace = object.get("namespace").and_then(Value::as_str).or(enclosing).filter(|ns| !ns.is_empty());
    Some(match namespace {
        Some(namespace) => (format!("{namespace}.{name}"), Some(namespace.to_owned())),
        None => (name.to_owned(), None),
    })
}

/// The schemas nested directly in a schema: field types, array items, map values, union branches.
fn children(schema: &Value) -> Vec<&Value> {
    match schema {
        Value::Array(branches) => branches.iter().collect(),
        Value::Object(object) => match object.get("type").and_then(Value::as_str) {
            Some("record" | "error") => object
                .get("fields")
                .and_then(Value::as_array)
                .map(|fields| fields.iter().filter_map(|field| field.get("type")).collect())
                .unwrap_or_default(),
            Some("array") => object.get("items").into_iter().collect(),
            Some("map") => object.get("values").into_iter().collect(),
            _ => Vec::new(),
        },
        _ => Vec::new(),
    }
}

fn is_named_definition(object: &Map<String, Value>) -> bool {
    matches!(object.get("type").and_then(Value::as_str), Some("record" | "error" | "enum" | "fixed"))
}

/// Records every named type defined anywhere in `schema`, with its namespace made explicit so the
/// definition can be moved into another file.
fn collect_definitions(schema: &Value, enclosing: Option<&str>, definitions: &mut HashMap<String, Value>) {
    let mut namespace = enclosing.map(str::to_owned);
    if let Value::Object(object) = schema
        && is_named_definition(object)
        && let Some((full, ns)) = full_name(object, enclosing)
    {
        let mut definition = object.clone();
        if let Some(ns) = &ns {
            definition.insert("namespace".to_owned(), Value::String(ns.clone()));
        }
        definitions.insert(full, Value::Object(definition));
        namespace = ns;
    }
    for child in children(schema) {
        collect_definitions(child, namespace.as_deref(), definitions);
    }
}

/// Replaces the first reference to a type defined in another file with its definition; later
/// references stay names, as Avro requires (a name may be defined once per schema).
fn inline(
    schema: &Value,
    enclosing: Option<&str>,
    definitions: &HashMap<String, Value>,
    defined: &mut HashSet<String>,
) -> Value {
    match schema {
        Value::String(name) if !PRIMITIVES.contains(&name.as_str()) => {
            let full = match (name.contains('.'), enclosing) {
                (false, Some(ns)) => format!("{ns}.{name}"),
                _ => name.clone(),
            };
            if defined.contains(&full) {
                return schema.clone();
            }
            match definitions.get(&full) {
                Some(definition) => inline(definition, enclosing, definitions, defined),
                None => schema.clone(),
            }
        }
        Value::Array(branches) => {
            Value::Array(branches.iter().map(|branch| inline(branch, enclosing, definitions, defined)).collect())
        }
        Value::Object(object) => {
            let mut object = object.clone();
            let mut namespace = enclosing.map(str::to_owned);
            if is_named_definition(&object)
                && let Some((full, ns)) = full_name(&object, enclosing)
            {
                defined.insert(full);
                namespace = ns;
            }
            let ns = namespace.as_deref();
            match object.get("type").and_then(Value::as_str) {
                Some("record" | "error") => {
                    if let Some(Value::Array(fields)) = object.get_mut("fields") {
                        for field in fields.iter_mut() {
                            if let Some(field) = field.as_object_mut()
                                && let Some(field_type) = field.get("type")
                            {
                                let inlined = inline(field_type, ns, definitions, defined);
                                field.insert("type".to_owned(), inlined);
                            }
                        }
                    }
                }
                Some("array") => {
                    if let Some(items) = object.get("items") {
                        let inlined = inline(items, ns, definitions, defined);
                        object.insert("items".to_owned(), inlined);
                    }
                }
                Some("map") => {
                    if let Some(values) = object.get("values") {
                        let inlined = inline(values, ns, definitions, defined);
                        object.insert("values".to_owned(), inlined);
                    }
                }
                _ => {}
            }
            Value::Object(object)
        }
        _ => schema.clone(),
    }
}

#[cfg(test)]
mod tests {
    use apache_avro::schema::Schema;

    use super::*;

    #[test]
    fn every_embedded_file_parses_and_is_self_contained() {
        for (schema, name) in [
            (health_event(), "HealthEvent"),
            (enriched_health_event(), "EnrichedHealthEvent"),
            (verdict(), "Verdict"),
            (action_outcome(), "ActionOutcome"),
        ] {
            let Schema::Record(record) = schema else { panic!("{name} is not a record") };
            assert_eq!(record.name.fullname(None), format!("{NAMESPACE}.{name}"));
            // Self-contained: the canonical form parses alone, without the other files.
            Schema::parse_str(&schema.canonical_form()).unwrap_or_else(|e| panic!("{name} is not self-contained: {e}"));
        }
        for (sources, schemas) in [(&CURRENT_AVSC, current()), (&V1_AVSC, v1()), (&V2_AVSC, v2())] {
            let texts = self_contained_json(sources).expect("self-contained texts");
            assert_eq!(texts.len(), schemas.len());
            for (text, schema) in texts.iter().zip(schemas) {
                assert_eq!(&Schema::parse_str(text).expect("registry text parses alone"), schema);
            }
        }
    }

    #[test]
    fn the_v1_schemas_are_records_of_the_same_names_and_differ_from_the_current_ones() {
        let names = ["HealthEvent", "EnrichedHealthEvent", "Verdict", "ActionOutcome"];
        for ((old, new), name) in v1().iter().zip(current()).zip(names) {
            let Schema::Record(record) = old else { panic!("v1 {name} is not a record") };
            assert_eq!(record.name.fullname(None), format!("{NAMESPACE}.{name}"));
            // ActionOutcome's file did not change, but the RecommendedAction it takes from the
            // verdict gained a symbol: every record is a new version.
            assert_ne!(old.canonical_form(), new.canonical_form(), "{name}: v1 and v2 are the same schema");
        }
    }

    #[test]
    fn every_field_has_a_doc() {
        fn check(value: &serde_json::Value, file: &str) {
            if let Some(object) = value.as_object() {
                if let Some(fields) = object.get("fields").and_then(|f| f.as_array()) {
                    for field in fields {
                        let name = field["name"].as_str().unwrap_or("?");
                        assert!(
                            field.get("doc").and_then(|d| d.as_str()).is_some_and(|d| !d.is_empty()),
                            "field {name} in {file} has no doc"
                        );
                    }
                }
                if object.get("type").and_then(|t| t.as_str()) == Some("enum") {
                    assert!(object.get("default").is_some(), "enum {} in {file} has no default symbol", object["name"]);
                }
            }
            for child in children(value) {
                check(child, file);
            }
        }
        for (file, text) in [
            ("health_event.avsc", HEALTH_EVENT_AVSC),
            ("enriched_health_event.avsc", ENRICHED_HEALTH_EVENT_AVSC),
            ("verdict.avsc", VERDICT_AVSC),
            ("action_outcome.avsc", ACTION_OUTCOME_AVSC),
        ] {
            let value: serde_json::Value = serde_json::from_str(text).expect("JSON");
            check(&value, file);
        }
    }

    #[test]
    fn a_reference_to_an_unknown_type_is_an_error() {
        let broken = r#"{"type":"record","name":"R","namespace":"x","fields":[{"name":"a","type":"x.Missing"}]}"#;
        assert!(matches!(parse_set(&[broken]), Err(SchemaFileError::Avro { index: 0, .. })));
    }
}
