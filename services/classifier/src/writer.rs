//! The batch writer ([`Writes`]): a batch's rows go to Postgres while the next batch is read,
//! classified and published.
//!
//! The write was two thirds of the classifier's time in a burst at 10,000 nodes, and every fault
//! waited for the write of the batch before its own (docs/benchmarks.md). So the handler publishes
//! a batch's verdicts, hands its rows to a task of their own and returns; the consumer loop reads
//! and handles the next batch meanwhile, and stores a batch's offsets only once its write has
//! landed ([`gpumedic_runtime::kafka::BatchHandler::settle`]). What keeps this as safe as the
//! write in line:
//!
//! - **Order.** Each write waits for the one before it to land, so a node's incident is inserted
//!   before a later batch updates it; a write whose predecessor failed writes nothing.
//! - **History read after it lands.** A batch that writes incidents is waited for before a later
//!   batch's look-ups of incidents (NVLink roots by domain, lemon history by node and GPU) when
//!   they concern one of its nodes, GPUs or domains ([`Parts`]), and by the ticker before it
//!   decides: their reads see every earlier decision about what they read. Other batches (healthy
//!   telemetry, faults on other nodes: nearly all) are not waited for. Workload faults are
//!   decided inside the writes, in order, and no look-up reads sympathetic evidence or outcomes.
//! - **Failure.** A failed write gives up its batch and every later one still on its way: the
//!   handler keeps what each needs to be written again (its decisions, as the engine has already
//!   taken its events in), the loop offers them again in order, and each is then written before
//!   the next is offered, with the loop's retries and poison rule as before.
//! - **Rebalance.** Each write is counted on the consumer's assignment until it lands: a revoke
//!   waits for it, so the next owner rebuilds from Postgres with it.
//! - **Crash.** Offsets are stored only after the write, so a crash redelivers the batch, and the
//!   write is idempotent, as before.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use gpumedic_runtime::kafka::WriteGuard;
use tokio::sync::watch;

use crate::classifier::{ClassifierError, WorkloadWriter};
use crate::{store, workload};

/// What a landed write took.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wrote {
    /// What the batch's rows changed.
    pub(crate) written: store::Written,
    /// The batch's statements, to their commit.
    pub(crate) write: Duration,
    /// Its workload-fault transactions after it.
    pub(crate) workload: Duration,
}

/// One batch's write, queued.
pub(crate) struct Job {
    pub(crate) pool: sqlx::PgPool,
    pub(crate) parts: Vec<store::Batch>,
    pub(crate) sightings: Vec<workload::Sighting>,
    pub(crate) workload: WorkloadWriter,
    /// Counted on the consumer's assignment until the write lands.
    pub(crate) guard: WriteGuard,
}

/// Nodes, GPUs and NVLink domains: those a batch's incidents concern, or those a batch's
/// look-ups read.
#[derive(Debug, Default)]
pub(crate) struct Parts {
    nodes: HashSet<String>,
    gpus: HashSet<String>,
    domains: HashSet<String>,
}

impl Parts {
    /// Adds a node, with its GPU and NVLink domain when known.
    pub(crate) fn add(&mut self, node: &str, gpu: Option<&str>, domain: Option<&str>) {
        if !self.nodes.contains(node) {
            self.nodes.insert(node.to_owned());
        }
        if let Some(g) = gpu.filter(|g| !self.gpus.contains(*g)) {
            self.gpus.insert(g.to_owned());
        }
        if let Some(d) = domain.filter(|d| !self.domains.contains(*d)) {
            self.domains.insert(d.to_owned());
        }
    }

    /// Whether the two share a node, a GPU or a domain.
    pub(crate) fn meets(&self, other: &Parts) -> bool {
        let (small, large) = if self.nodes.len() <= other.nodes.len() { (self, other) } else { (other, self) };
        small.nodes.iter().any(|n| large.nodes.contains(n))
            || small.gpus.iter().any(|g| large.gpus.contains(g))
            || small.domains.iter().any(|d| large.domains.contains(d))
    }
}

/// A write on its way, with what its batch needs afterwards: `T`.
pub(crate) struct Writing<T> {
    /// What the batch's incidents concern (none: it writes no incident).
    pub(crate) history: Parts,
    /// `Some(true)` once landed, `Some(false)` once failed.
    landed: watch::Receiver<Option<bool>>,
    task: tokio::task::JoinHandle<Result<Wrote, ClassifierError>>,
    /// What the batch needs once its write is done (or given up).
    pub(crate) then: T,
}

impl<T> Writing<T> {
    /// Waits for the write to be done; what it took, or why it failed.
    pub(crate) async fn done(self) -> (Result<Wrote, ClassifierError>, T) {
        let result = match self.task.await {
            Ok(r) => r,
            Err(e) => Err(ClassifierError::NotWritten(format!("the write task ended abnormally: {e}"))),
        };
        (result, self.then)
    }
}

/// The writes on their way, oldest first.
pub(crate) struct Writes<T> {
    queue: VecDeque<Writing<T>>,
}

impl<T> Default for Writes<T> {
    fn default() -> Self {
        Writes { queue: VecDeque::new() }
    }
}

impl<T> Writes<T> {
    /// Starts `job` once every earlier write has landed.
    pub(crate) fn start(&mut self, job: Job, history: Parts, then: T) {
        let previous = self.queue.back().map(|w| w.landed.clone());
        let (tx, landed) = watch::channel(None);
        let task = tokio::spawn(write(previous, job, tx));
        self.queue.push_back(Writing { history, landed, task, then });
    }

    /// Waits until every write on its way whose incidents concern one of `reads` is done;
    /// whether each landed.
    pub(crate) async fn landed(&self, reads: &Parts) -> bool {
        let mut all = true;
        for w in self.queue.iter().filter(|w| w.history.meets(reads)) {
            all &= landed(w.landed.clone()).await;
        }
        all
    }

    /// Waits until every write on its way is done; whether each landed.
    pub(crate) async fn landed_all(&self) -> bool {
        let mut all = true;
        for w in &self.queue {
            all &= landed(w.landed.clone()).await;
        }
        all
    }

    /// What waits until every write on its way now is done, apart from the queue (so the
    /// classifier's lock need not be held meanwhile).
    pub(crate) fn landing(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let all: Vec<_> = self.queue.iter().map(|w| w.landed.clone()).collect();
        async move {
            for rx in all {
                landed(rx).await;
            }
        }
    }

    /// The oldest write on its way.
    pub(crate) fn oldest(&mut self) -> Option<Writing<T>> {
        self.queue.pop_front()
    }

    /// Every write on its way, oldest first.
    pub(crate) fn all(&mut self) -> Vec<Writing<T>> {
        self.queue.drain(..).collect()
    }
}

/// Waits for a write to be done; whether it landed (a task gone without a word did not).
async fn landed(mut rx: watch::Receiver<Option<bool>>) -> bool {
    match rx.wait_for(Option::is_some).await {
        Ok(v) => *v == Some(true),
        Err(_) => false,
    }
}

/// The write task: waits for `previous` to land, then writes the job's rows and records its
/// workload sightings; says how it went on `tx`.
async fn write(
    previous: Option<watch::Receiver<Option<bool>>>,
    job: Job,
    tx: watch::Sender<Option<bool>>,
) -> Result<Wrote, ClassifierError> {
    let Job { pool, parts, sightings, workload, guard } = job;
    let result = async {
        if let Some(previous) = previous
            && !landed(previous).await
        {
            return Err(ClassifierError::NotWritten(
                "the write of an earlier batch failed; it is written first".into(),
            ));
        }
        let started = Instant::now();
        let written = store::write_parts(&pool, &parts).await?;
        let wrote = Instant::now();
        // After the events are recorded: a failure here writes the batch again, which writes
        // nothing twice.
        workload.record(sightings).await?;
        Ok(Wrote { written, write: wrote.duration_since(started), workload: wrote.elapsed() })
    }
    .await;
    tx.send_replace(Some(result.is_ok()));
    drop(guard);
    result
}

#[cfg(test)]
mod tests {
    use super::Parts;

    #[test]
    fn parts_meet_on_a_shared_node_gpu_or_domain_and_not_otherwise() {
        let mut written = Parts::default();
        written.add("node-a", Some("GPU-1"), Some("domain-x"));
        let read = |node: &str, gpu: Option<&str>, domain: Option<&str>| {
            let mut p = Parts::default();
            p.add(node, gpu, domain);
            p
        };
        assert!(written.meets(&read("node-a", None, None)), "same node");
        assert!(written.meets(&read("node-b", Some("GPU-1"), None)), "the GPU moved to another node");
        assert!(written.meets(&read("node-c", Some("GPU-9"), Some("domain-x"))), "a peer of the NVLink domain");
        assert!(!written.meets(&read("node-d", Some("GPU-2"), Some("domain-y"))), "nothing shared");
        assert!(!Parts::default().meets(&read("node-a", Some("GPU-1"), Some("domain-x"))), "a write of no incident");
    }
}
