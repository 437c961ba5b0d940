//! Writes the tests' fixtures, framed, into `corpus/decode/` as the fuzz target's seed corpus:
//! every detail kind as a HealthEvent, each as an EnrichedHealthEvent, a Verdict and an
//! ActionOutcome, so libFuzzer starts from valid records instead of finding the frame first.
//!
//! ```sh
//! cargo run --example seed_corpus
//! ```

#[path = "../../tests/common/mod.rs"]
mod common;

use std::fs;
use std::path::Path;

use gpumedic_schemas::framing;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/decode");
    fs::create_dir_all(&dir)?;
    let mut seeds = Vec::new();
    for (i, detail) in common::all_details().into_iter().enumerate() {
        seeds.push((format!("seed-health-event-{i:02}"), framing::encode(&common::health_event(detail.clone()))?));
        seeds.push((format!("seed-enriched-{i:02}"), framing::encode(&common::enriched(detail))?));
    }
    seeds.push(("seed-verdict".to_owned(), framing::encode(&common::verdict())?));
    seeds.push(("seed-action-outcome".to_owned(), framing::encode(&common::action_outcome())?));
    for (name, bytes) in &seeds {
        fs::write(dir.join(name), bytes)?;
    }
    println!("wrote {} seeds to {}", seeds.len(), dir.display());
    Ok(())
}
