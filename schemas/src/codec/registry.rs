//! [`RegistryResolver`]: schema ids from a schema registry (cargo feature `registry`).
//!
//! With a registry, the schema id space is the registry's: every id on the wire, 1 to 10 included,
//! is resolved through the registry, never through the embedded table, because a registry hands
//! out the same small numbers to whatever schema it saw first. How data written without a
//! registry stays readable is in docs/events.md ("Schema registry");
//! [`SchemaResolver::embedded_ids_readable`] tells whether it is with the registry at hand.
//!
//! A writer schema is compared with this build's schema (Parsing Canonical Form) once, when its
//! id is first seen, so an id that names this build's schema of the record takes the codec's
//! straight binary path.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use apache_avro::Schema;

use super::DecodeFailure;
use super::resolver::{Resolution, SchemaResolver, Writer, WriterSchema, malformed};
use crate::framing::{self, DecodeError, Record};
use crate::registry::{RegistryClient, RegistryError};
use crate::{ActionOutcome, EnrichedHealthEvent, HealthEvent, Verdict, avro};

/// Settings of [`RegistryResolver::start`].
#[derive(Debug, Clone)]
pub struct RegistryOptions {
    /// Bound on each registry request, connecting included.
    pub request_timeout: Duration,
    /// Put before every subject name: `<prefix><topic>-value`. Empty in production
    /// (TopicNameStrategy); tests use it so that parallel tests register under their own
    /// subjects.
    pub subject_prefix: String,
}

impl Default for RegistryOptions {
    fn default() -> Self {
        Self { request_timeout: Duration::from_secs(5), subject_prefix: String::new() }
    }
}

/// Why [`RegistryResolver::start`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum RegistryStartError {
    /// A schema could not be registered (registry unreachable, or it refused the schema, for
    /// example under a compatibility setting that this version breaks).
    #[error("cannot register schema {record} under subject {subject}: {source}")]
    Register {
        /// Full Avro name of the record.
        record: &'static str,
        /// The subject.
        subject: String,
        /// What the registry client reported.
        #[source]
        source: RegistryError,
    },
    /// The registry was unreachable while the embedded ids were checked.
    #[error("cannot check schema id {id} in the registry: {source}")]
    Check {
        /// The schema id.
        id: u32,
        /// What the registry client reported.
        #[source]
        source: RegistryError,
    },
}

/// Why a fetch failed, before it becomes a [`DecodeFailure`].
enum Fetch {
    /// The record is bad.
    Invalid(DecodeError),
    /// The registry cannot be asked now.
    Unavailable(RegistryError),
}

impl From<DecodeError> for Fetch {
    fn from(e: DecodeError) -> Self {
        Fetch::Invalid(e)
    }
}

/// Resolves schema ids through a Confluent-compatible schema registry, remembering every id it
/// resolved (ids are immutable in a registry, so entries never expire).
#[derive(Debug)]
pub struct RegistryResolver {
    client: RegistryClient,
    /// The registry ids of the embedded table's schemas (every version), indexed by embedded
    /// id - 1.
    writer_ids: [u32; framing::SCHEMA_TABLE.len()],
    /// Every id resolved so far.
    known: RwLock<HashMap<u32, Arc<WriterSchema>>>,
    /// One cell per id being fetched, so that concurrent decodes of a new id fetch it once.
    fetching: Mutex<HashMap<u32, Arc<tokio::sync::OnceCell<Arc<WriterSchema>>>>>,
    embedded_ids_readable: bool,
}

impl RegistryResolver {
    /// A resolver backed by the schema registry at `url` (Confluent REST API; for Apicurio, the
    /// `/apis/ccompat/v7` URL). Registers every schema of the embedded table under its record's
    /// subject `<topic>-value`, in table order (version 1 of the four records, then version 2, then
    /// version 3 of the two records that changed in it):
    /// a new version of a record is a new version of the same subject, and a fresh registry gives
    /// the schemas the embedded ids. Remembers their ids, writes the current version's, then
    /// checks what the registry's ids 1 to 10 are ([`SchemaResolver::embedded_ids_readable`]).
    ///
    /// # Errors
    /// [`RegistryStartError`] when the registry is unreachable or refuses a schema: a service
    /// should not start without the ids it must write.
    pub async fn start(url: &str, options: RegistryOptions) -> Result<Self, RegistryStartError> {
        let client = RegistryClient::new(url, options.request_timeout).map_err(|source| {
            RegistryStartError::Register { record: HealthEvent::NAME, subject: String::new(), source }
        })?;
        let texts = [
            avro::self_contained_json(&avro::V1_AVSC).expect("the embedded released .avsc files parse (tested)"),
            avro::self_contained_json(&avro::V2_AVSC).expect("the embedded released .avsc files parse (tested)"),
            avro::self_contained_json(&avro::CURRENT_AVSC).expect("the embedded .avsc files parse (tested)"),
        ];
        let current_ids =
            [HealthEvent::SCHEMA_ID, EnrichedHealthEvent::SCHEMA_ID, Verdict::SCHEMA_ID, ActionOutcome::SCHEMA_ID];
        let records = [
            (HealthEvent::NAME, HealthEvent::TOPIC),
            (EnrichedHealthEvent::NAME, EnrichedHealthEvent::TOPIC),
            (Verdict::NAME, Verdict::TOPIC),
            (ActionOutcome::NAME, ActionOutcome::TOPIC),
        ];
        let mut writer_ids = [0; framing::SCHEMA_TABLE.len()];
        let mut known = HashMap::new();
        // In table order, so that a fresh registry gives the schemas the embedded ids 1 to 10 and
        // records written without a registry stay readable through it (see docs/events.md). The
        // older versions are registered too, although this build never writes them: registering
        // a schema the subject already has only returns its id.
        for (slot, entry) in framing::SCHEMA_TABLE.iter().enumerate() {
            let position = records
                .iter()
                .position(|(name, _)| *name == entry.record)
                .expect("every table entry names one of the four records (tested)");
            let (record, topic) = records[position];
            let ours = current_ids.contains(&entry.id);
            let text = &texts[if ours {
                2
            } else if entry.version == 1 {
                0
            } else {
                1
            }][position];
            let subject = format!("{}{topic}-value", options.subject_prefix);
            let id = client.register(&subject, text).await.map_err(|source| RegistryStartError::Register {
                record,
                subject,
                source,
            })?;
            writer_ids[slot] = id;
            let schema = framing::schema_for_id(entry.id).expect("every table entry has a schema (tested)").clone();
            known.insert(id, Arc::new(WriterSchema { schema, name: record.to_owned(), ours }));
        }
        let resolver = Self {
            client,
            writer_ids,
            known: RwLock::new(known),
            fetching: Mutex::new(HashMap::new()),
            embedded_ids_readable: false,
        };
        let mut readable = true;
        for entry in &framing::SCHEMA_TABLE {
            match resolver.resolve_known_or_fetch(entry.id).await {
                Ok(writer) => readable &= framing::schema_for_id(entry.id) == Some(&writer.schema),
                Err(Fetch::Unavailable(source)) => return Err(RegistryStartError::Check { id: entry.id, source }),
                Err(Fetch::Invalid(_)) => readable = false,
            }
        }
        Ok(Self { embedded_ids_readable: readable, ..resolver })
    }

    fn known(&self, id: u32) -> Option<Arc<WriterSchema>> {
        self.known.read().unwrap_or_else(|e| e.into_inner()).get(&id).cloned()
    }

    async fn resolve_known_or_fetch(&self, id: u32) -> Result<Arc<WriterSchema>, Fetch> {
        if let Some(writer) = self.known(id) {
            return Ok(writer);
        }
        let cell = self.fetching.lock().unwrap_or_else(|e| e.into_inner()).entry(id).or_default().clone();
        let writer = cell.get_or_try_init(|| self.fetch(id)).await?.clone();
        self.known.write().unwrap_or_else(|e| e.into_inner()).insert(id, writer.clone());
        self.fetching.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        Ok(writer)
    }

    async fn fetch(&self, id: u32) -> Result<Arc<WriterSchema>, Fetch> {
        let registered = match self.client.schema_by_id(id).await {
            Ok(registered) => registered,
            // The registry does not know the id: the record is bad, not the registry.
            Err(RegistryError::NotFound { .. }) => return Err(DecodeError::UnknownSchemaId(id).into()),
            Err(source) => return Err(Fetch::Unavailable(source)),
        };
        if !registered.schema_type.eq_ignore_ascii_case("AVRO") {
            return Err(malformed(format!("schema id {id} is a {} schema, not Avro", registered.schema_type)).into());
        }
        let schema = Schema::parse_str(&registered.schema).map_err(|e| DecodeError::Malformed(Box::new(e)))?;
        let name = match &schema {
            Schema::Record(record) => record.name.fullname(None),
            _ => String::new(),
        };
        let ours = match name.as_str() {
            HealthEvent::NAME => same(&schema, 0),
            EnrichedHealthEvent::NAME => same(&schema, 1),
            Verdict::NAME => same(&schema, 2),
            ActionOutcome::NAME => same(&schema, 3),
            _ => false,
        };
        Ok(Arc::new(WriterSchema { schema, name, ours }))
    }
}

impl SchemaResolver for RegistryResolver {
    fn writer_id(&self, embedded_id: u32) -> u32 {
        self.writer_ids[(embedded_id - 1) as usize]
    }

    fn resolve(&self, id: u32) -> Resolution<'_> {
        if let Some(writer) = self.known(id) {
            return Resolution::Ready(Ok(Writer::Schema(writer)));
        }
        Resolution::Pending(Box::pin(async move {
            match self.resolve_known_or_fetch(id).await {
                Ok(writer) => Ok(Writer::Schema(writer)),
                Err(Fetch::Invalid(e)) => Err(DecodeFailure::Invalid(e)),
                Err(Fetch::Unavailable(source)) => {
                    Err(DecodeFailure::RegistryUnavailable { id, source: Box::new(source) })
                }
            }
        }))
    }

    fn embedded_ids_readable(&self) -> bool {
        self.embedded_ids_readable
    }

    fn requests_sent(&self) -> u64 {
        self.client.requests_sent()
    }
}

/// This build's schema at table index `index`.
fn ours(index: usize) -> &'static Schema {
    [avro::health_event(), avro::enriched_health_event(), avro::verdict(), avro::action_outcome()][index]
}

/// Same Parsing Canonical Form: the same bytes on the wire for every value, so the fast path reads
/// them. Computed once per id, when it is first resolved.
fn same(schema: &Schema, index: usize) -> bool {
    schema.canonical_form() == ours(index).canonical_form()
}
