//! The node's InfiniBand and RoCE ports, read from sysfs (`<root>/class/infiniband/<hca>/ports/<n>/`).
//!
//! A GPU node whose fabric port is down, flapping or collecting link errors fails the jobs that
//! span nodes while every GPU reads healthy, so the port state, the link error counters and the
//! number of HCAs present are watched here. Events are `custom` (monitor [`MONITOR`], the event's
//! `check` in its values), component `node`: the health event schema has no network component or
//! sysfs source, and adding either is a schema evolution this source does not need.
//!
//! What is an event ([`PortWatch::observe`]):
//! - `check: ib_port`: a port whose link goes down (state not `ACTIVE` or physical state not
//!   `LinkUp`, e.g. `DOWN`/`Polling`) or comes back; at first sight every port, down or up (the
//!   clear evidence an incident opened before a restart needs). Healthy only when every watched
//!   port of the node is up: incidents about the network are per node.
//! - `check: ib_counters`: a port's link error counters grew since the last reading; the values
//!   are the increases, not the totals. A counter that went down was reset: it is the new base,
//!   not an increase.
//! - `check: ib_hcas`: fewer HCAs than `--ib-expected-hcas` (when set), and healthy again when
//!   they are all back.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpumedic_schemas::HealthEvent;
use gpumedic_schemas::health::{Component, CustomDetail, Detail, Entity, MonitorState, Source};
use tokio_util::sync::CancellationToken;

use crate::events::{InternalEvent as _, NetworkReadFailed, names};
use crate::publisher::Sink;

/// The `monitor` of every event this source publishes.
pub const MONITOR: &str = "infiniband";

/// The link error counters read from `ports/<n>/counters/`, by file name.
pub const COUNTERS: [&str; 4] = ["link_downed", "symbol_error", "link_error_recovery", "port_rcv_errors"];

/// One port as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortReading {
    /// The HCA's name (`mlx5_0`).
    pub hca: String,
    /// The port number (from 1).
    pub port: u32,
    /// The logical state's name (`ACTIVE`, `DOWN`, `INIT`, `ARMED`), from `state` (`4: ACTIVE`).
    pub state: String,
    /// The physical state's name (`LinkUp`, `Polling`, `Disabled`, ...), from `phys_state`.
    pub phys_state: String,
    /// `InfiniBand` or `Ethernet` (RoCE), from `link_layer`; empty when unreadable.
    pub link_layer: String,
    /// The counters of [`COUNTERS`] that could be read.
    pub counters: BTreeMap<&'static str, u64>,
}

impl PortReading {
    /// The port carries traffic: logically `ACTIVE` and physically `LinkUp`.
    pub fn is_up(&self) -> bool {
        self.state.eq_ignore_ascii_case("ACTIVE") && self.phys_state.eq_ignore_ascii_case("LinkUp")
    }

    fn key(&self) -> (String, u32) {
        (self.hca.clone(), self.port)
    }

    fn name(&self) -> String {
        format!("{}/{}", self.hca, self.port)
    }
}

/// What the sysfs tree holds: the HCAs present and their ports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FabricReading {
    /// Every HCA under `class/infiniband`, sorted.
    pub hcas: Vec<String>,
    /// Every readable port of those HCAs.
    pub ports: Vec<PortReading>,
}

/// Why the sysfs tree could not be read.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// `class/infiniband` exists but cannot be listed.
    #[error("cannot list {path}: {source}")]
    List {
        /// The folder.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// The value of a sysfs state file: `4: ACTIVE` gives `ACTIVE`, a bare word is kept.
fn state_name(text: &str) -> String {
    let text = text.trim();
    text.split_once(':').map_or(text, |(_, name)| name.trim()).to_owned()
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

fn list_dir(path: &Path) -> std::io::Result<Vec<String>> {
    let mut names: Vec<String> =
        std::fs::read_dir(path)?.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    Ok(names)
}

/// Reads every HCA and port under `<root>/class/infiniband`. A node without the folder has no
/// HCAs (an empty reading, not an error); a port whose `state` cannot be read is skipped.
///
/// # Errors
/// [`NetworkError::List`] when the folder exists but cannot be listed.
pub fn read_fabric(root: &Path) -> Result<FabricReading, NetworkError> {
    let class = root.join("class/infiniband");
    let hcas = match list_dir(&class) {
        Ok(h) => h,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(FabricReading::default()),
        Err(source) => return Err(NetworkError::List { path: class, source }),
    };
    let mut ports = Vec::new();
    for hca in &hcas {
        let dir = class.join(hca).join("ports");
        let Ok(numbers) = list_dir(&dir) else { continue };
        let mut numbers: Vec<u32> = numbers.iter().filter_map(|n| n.parse().ok()).collect();
        numbers.sort_unstable();
        for port in numbers {
            let p = dir.join(port.to_string());
            let Some(state) = read_trimmed(&p.join("state")) else { continue };
            let counters = COUNTERS
                .iter()
                .filter_map(|c| read_trimmed(&p.join("counters").join(c)).and_then(|v| v.parse().ok()).map(|v| (*c, v)))
                .collect();
            ports.push(PortReading {
                hca: hca.clone(),
                port,
                state: state_name(&state),
                phys_state: read_trimmed(&p.join("phys_state")).map(|s| state_name(&s)).unwrap_or_default(),
                link_layer: read_trimmed(&p.join("link_layer")).unwrap_or_default(),
                counters,
            });
        }
    }
    Ok(FabricReading { hcas, ports })
}

/// How the fabric source runs.
#[derive(Debug, Clone)]
pub struct NetworkSettings {
    /// This node's name.
    pub node: String,
    /// The sysfs root (`/sys`; a fixture tree in tests).
    pub sysfs_root: PathBuf,
    /// Time between readings.
    pub interval: Duration,
    /// How many HCAs the node should have; `None`: not checked.
    pub expected_hcas: Option<u32>,
    /// HCAs (`mlx5_3`) or ports (`mlx5_3/2`) that are not watched: unused ports are down for good.
    pub ignore: BTreeSet<String>,
}

/// Turns fabric readings into events: state changes, counter increases and a missing HCA.
#[derive(Debug)]
pub struct PortWatch {
    node: String,
    expected_hcas: Option<u32>,
    ignore: BTreeSet<String>,
    /// The last reading of each port, by (HCA, port).
    last: HashMap<(String, u32), PortReading>,
    /// Whether the last reading was short of the expected HCAs (`None`: no reading yet).
    short: Option<bool>,
    /// Whether some port's error counters grew at the last reading.
    growing: bool,
}

impl PortWatch {
    /// A watch for `settings.node` with nothing seen yet.
    pub fn new(settings: &NetworkSettings) -> Self {
        Self {
            node: settings.node.clone(),
            expected_hcas: settings.expected_hcas,
            ignore: settings.ignore.clone(),
            last: HashMap::new(),
            short: None,
            growing: false,
        }
    }

    fn event(&self, values: BTreeMap<String, String>, healthy: bool, now: DateTime<Utc>) -> HealthEvent {
        let mut e = HealthEvent::new(
            &self.node,
            Source::KernelLog,
            Component::Node,
            Entity::default(),
            Detail::Custom(CustomDetail { monitor: MONITOR.into(), values }),
        );
        e.observed_at = now;
        e.healthy = healthy;
        e
    }

    fn ignored(&self, p: &PortReading) -> bool {
        self.ignore.contains(&p.hca) || self.ignore.contains(&p.name())
    }

    /// The events `reading`, taken at `now`, calls for.
    pub fn observe(&mut self, reading: &FabricReading, now: DateTime<Utc>) -> Vec<HealthEvent> {
        let mut out = Vec::new();
        let ports: Vec<&PortReading> = reading.ports.iter().filter(|p| !self.ignored(p)).collect();
        let down: Vec<String> = ports.iter().filter(|p| !p.is_up()).map(|p| p.name()).collect();
        let all_up = down.is_empty();
        let mut grew_now = false;
        for p in &ports {
            let prev = self.last.get(&p.key());
            let changed =
                prev.is_none_or(|q| q.is_up() != p.is_up() || q.state != p.state || q.phys_state != p.phys_state);
            if changed {
                let mut v = values("ib_port", p);
                v.insert("link".into(), if p.is_up() { "up" } else { "down" }.into());
                v.insert("state".into(), p.state.clone());
                v.insert("phys_state".into(), p.phys_state.clone());
                if prev.is_none() {
                    v.insert("seen".into(), "start".into());
                }
                if !down.is_empty() {
                    v.insert("down_ports".into(), down.join(","));
                }
                // Healthy only when the whole node's fabric is up: a port back while another is
                // still down is no evidence that the node's network incident is over.
                out.push(self.event(v, all_up, now));
            }
            if let Some(q) = prev {
                let mut grew = BTreeMap::new();
                for (name, value) in &p.counters {
                    // A counter below its last value was reset (driver reload, perfquery -R):
                    // the new value is the base, not an increase.
                    if let Some(before) = q.counters.get(name)
                        && value > before
                    {
                        grew.insert(*name, value - before);
                    }
                }
                if !grew.is_empty() {
                    grew_now = true;
                    let mut v = values("ib_counters", p);
                    for (name, delta) in grew {
                        v.insert(name.to_owned(), delta.to_string());
                    }
                    out.push(self.event(v, false, now));
                }
            }
        }
        if self.growing && !grew_now {
            // The errors stopped: the healthy evidence an error incident's quiet period counts from.
            let mut v = BTreeMap::new();
            v.insert("check".into(), "ib_counters".into());
            v.insert("growing".into(), "none".into());
            out.push(self.event(v, true, now));
        }
        self.growing = grew_now;
        if let Some(expected) = self.expected_hcas {
            let present = u32::try_from(reading.hcas.len()).unwrap_or(u32::MAX);
            let short = present < expected;
            // At first sight the count is published whatever it is: a complete set is the clear
            // evidence for a missing-HCA incident opened before a restart.
            if self.short != Some(short) {
                let mut v = BTreeMap::new();
                v.insert("check".into(), "ib_hcas".into());
                v.insert("present".into(), present.to_string());
                v.insert("expected".into(), expected.to_string());
                v.insert("hcas".into(), reading.hcas.join(","));
                if self.short.is_none() {
                    v.insert("seen".into(), "start".into());
                }
                out.push(self.event(v, !short, now));
            }
            self.short = Some(short);
        }
        // A port that vanished (its HCA gone) is forgotten; the HCA count says it.
        self.last = ports.into_iter().map(|p| (p.key(), p.clone())).collect();
        out
    }
}

fn values(check: &str, p: &PortReading) -> BTreeMap<String, String> {
    let mut v = BTreeMap::new();
    v.insert("check".into(), check.into());
    v.insert("hca".into(), p.hca.clone());
    v.insert("port".into(), p.port.to_string());
    if !p.link_layer.is_empty() {
        v.insert("link_layer".into(), p.link_layer.clone());
    }
    v
}

fn monitor(node: &str, state: MonitorState, message: String) -> HealthEvent {
    crate::sources::monitor_event(node, Source::KernelLog, MONITOR, state, message)
}

/// Reads the fabric every `settings.interval` and publishes what [`PortWatch`] finds. A tree
/// that cannot be read is a `monitor_health` `error` (monitor `infiniband`, once until it reads
/// again, then a healthy one); the source keeps reading.
pub async fn watch_fabric(settings: NetworkSettings, sink: Sink, token: CancellationToken) -> Result<(), NetworkError> {
    let mut watch = PortWatch::new(&settings);
    let mut failing = false;
    loop {
        let root = settings.sysfs_root.clone();
        let reading = tokio::task::spawn_blocking(move || read_fabric(&root)).await;
        let events = match reading {
            Ok(Ok(r)) => {
                let mut events = Vec::new();
                if std::mem::take(&mut failing) {
                    events.push(monitor(
                        &settings.node,
                        MonitorState::Ok,
                        "the InfiniBand ports are read again".into(),
                    ));
                }
                events.extend(watch.observe(&r, Utc::now()));
                events
            }
            Ok(Err(e)) => {
                NetworkReadFailed { error: &e }.emit();
                if std::mem::replace(&mut failing, true) {
                    Vec::new()
                } else {
                    vec![monitor(&settings.node, MonitorState::Error, e.to_string())]
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "Reading the InfiniBand ports failed; trying again at the next interval.");
                Vec::new()
            }
        };
        for e in &events {
            if let Detail::Custom(c) = &e.detail {
                let check = c.values.get("check").map_or("", String::as_str);
                metrics::counter!(names::NETWORK_EVENTS_TOTAL, "check" => check.to_owned()).increment(1);
            }
            if !sink.emit_until_done(e, &token).await {
                return Ok(());
            }
        }
        tokio::select! {
            () = token.cancelled() => return Ok(()),
            () = tokio::time::sleep(settings.interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs root in a temp dir.
    struct Tree(PathBuf);

    impl Tree {
        fn new() -> Self {
            let dir = std::env::temp_dir().join(format!("gpumedic-sysfs-{}", uuid::Uuid::new_v4()));
            std::fs::create_dir_all(dir.join("class/infiniband")).unwrap();
            Self(dir)
        }

        fn port(&self, hca: &str, port: u32, state: &str, phys: &str, counters: [u64; 4]) -> &Self {
            let p = self.0.join(format!("class/infiniband/{hca}/ports/{port}"));
            std::fs::create_dir_all(p.join("counters")).unwrap();
            std::fs::write(p.join("state"), format!("{state}\n")).unwrap();
            std::fs::write(p.join("phys_state"), format!("{phys}\n")).unwrap();
            std::fs::write(p.join("link_layer"), "InfiniBand\n").unwrap();
            for (name, v) in COUNTERS.iter().zip(counters) {
                std::fs::write(p.join("counters").join(name), format!("{v}\n")).unwrap();
            }
            self
        }

        fn remove(&self, hca: &str) {
            std::fs::remove_dir_all(self.0.join(format!("class/infiniband/{hca}"))).unwrap();
        }

        fn read(&self) -> FabricReading {
            read_fabric(&self.0).unwrap()
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn settings(expected: Option<u32>) -> NetworkSettings {
        NetworkSettings {
            node: "n1".into(),
            sysfs_root: PathBuf::from("/nonexistent"),
            interval: Duration::from_secs(30),
            expected_hcas: expected,
            ignore: BTreeSet::new(),
        }
    }

    fn custom(e: &HealthEvent) -> &BTreeMap<String, String> {
        match &e.detail {
            Detail::Custom(c) => &c.values,
            other => panic!("not custom: {other:?}"),
        }
    }

    fn get<'a>(e: &'a HealthEvent, key: &str) -> &'a str {
        custom(e).get(key).map_or("", String::as_str)
    }

    const UP: (&str, &str) = ("4: ACTIVE", "5: LinkUp");

    #[test]
    fn sysfs_files_are_read_by_name() {
        let t = Tree::new();
        t.port("mlx5_0", 1, UP.0, UP.1, [1, 2, 3, 4]).port("mlx5_1", 1, "1: DOWN", "2: Polling", [0; 4]);
        let r = t.read();
        assert_eq!(r.hcas, vec!["mlx5_0", "mlx5_1"]);
        assert_eq!((r.ports[0].state.as_str(), r.ports[0].phys_state.as_str()), ("ACTIVE", "LinkUp"));
        assert!(r.ports[0].is_up());
        assert_eq!(r.ports[0].counters.get("port_rcv_errors"), Some(&4));
        assert_eq!(r.ports[0].link_layer, "InfiniBand");
        assert_eq!((r.ports[1].state.as_str(), r.ports[1].phys_state.as_str()), ("DOWN", "Polling"));
        assert!(!r.ports[1].is_up());
        // No InfiniBand at all: no HCAs, not an error.
        assert_eq!(read_fabric(Path::new("/nonexistent-sysfs")).unwrap(), FabricReading::default());
    }

    #[test]
    fn a_port_going_down_and_back_is_one_event_each_healthy_only_when_all_are_up() {
        let t = Tree::new();
        t.port("mlx5_0", 1, UP.0, UP.1, [0; 4]).port("mlx5_1", 1, UP.0, UP.1, [0; 4]);
        let mut w = PortWatch::new(&settings(None));
        let start = w.observe(&t.read(), Utc::now());
        assert_eq!(start.len(), 2, "one start event per port: {start:?}");
        assert!(start.iter().all(|e| e.healthy && get(e, "link") == "up" && get(e, "seen") == "start"));
        assert!(w.observe(&t.read(), Utc::now()).is_empty(), "nothing changed");

        t.port("mlx5_0", 1, "1: DOWN", "3: Disabled", [0; 4]);
        let down = w.observe(&t.read(), Utc::now());
        assert_eq!(down.len(), 1);
        assert!(!down[0].healthy);
        assert_eq!(
            (get(&down[0], "check"), get(&down[0], "link"), get(&down[0], "hca")),
            ("ib_port", "down", "mlx5_0")
        );
        assert_eq!((get(&down[0], "state"), get(&down[0], "phys_state")), ("DOWN", "Disabled"));
        assert_eq!(down[0].component, Component::Node);

        // The second port polls (cable pulled): down too.
        t.port("mlx5_1", 1, "1: DOWN", "2: Polling", [0; 4]);
        let second = w.observe(&t.read(), Utc::now());
        assert_eq!(get(&second[0], "down_ports"), "mlx5_0/1,mlx5_1/1");

        // One comes back while the other is still down: up, but not healthy for the node.
        t.port("mlx5_0", 1, UP.0, UP.1, [0; 4]);
        let back = w.observe(&t.read(), Utc::now());
        assert_eq!((back.len(), get(&back[0], "link"), back[0].healthy), (1, "up", false));
        t.port("mlx5_1", 1, UP.0, UP.1, [0; 4]);
        let whole = w.observe(&t.read(), Utc::now());
        assert_eq!((whole.len(), get(&whole[0], "link"), whole[0].healthy), (1, "up", true));
    }

    #[test]
    fn armed_or_init_with_the_link_up_is_not_active() {
        let t = Tree::new();
        t.port("mlx5_0", 1, "2: INIT", "5: LinkUp", [0; 4]);
        let mut w = PortWatch::new(&settings(None));
        let start = w.observe(&t.read(), Utc::now());
        assert_eq!((get(&start[0], "link"), start[0].healthy), ("down", false), "no subnet manager: no traffic");
    }

    #[test]
    fn counters_report_increases_per_interval_and_a_reset_is_no_increase() {
        let t = Tree::new();
        t.port("mlx5_0", 1, UP.0, UP.1, [1, 100, 0, 7]);
        let mut w = PortWatch::new(&settings(None));
        let start = w.observe(&t.read(), Utc::now());
        assert!(start.iter().all(|e| get(e, "check") == "ib_port"), "old totals are no news: {start:?}");

        t.port("mlx5_0", 1, UP.0, UP.1, [1, 150, 0, 9]);
        let grew = w.observe(&t.read(), Utc::now());
        assert_eq!(grew.len(), 1);
        let v = custom(&grew[0]);
        assert_eq!(v.get("check").map(String::as_str), Some("ib_counters"));
        assert_eq!(v.get("symbol_error").map(String::as_str), Some("50"), "the delta, not the total");
        assert_eq!(v.get("port_rcv_errors").map(String::as_str), Some("2"));
        assert!(!v.contains_key("link_downed"), "unchanged counters are left out");
        assert!(!grew[0].healthy);

        let stopped = w.observe(&t.read(), Utc::now());
        assert_eq!(stopped.len(), 1, "the errors stopped: one healthy event");
        assert!(stopped[0].healthy && get(&stopped[0], "check") == "ib_counters");
        assert!(w.observe(&t.read(), Utc::now()).is_empty(), "no growth, no event");
        // Reset (driver reload, perfquery -R): lower values are the new base.
        t.port("mlx5_0", 1, UP.0, UP.1, [0, 0, 0, 0]);
        assert!(w.observe(&t.read(), Utc::now()).is_empty(), "a reset is not an increase");
        t.port("mlx5_0", 1, UP.0, UP.1, [1, 0, 0, 0]);
        let after = w.observe(&t.read(), Utc::now());
        assert_eq!(get(&after[0], "link_downed"), "1", "counted from the reset");
        assert!(!after[0].healthy);
    }

    #[test]
    fn a_missing_hca_against_the_expected_count() {
        let t = Tree::new();
        t.port("mlx5_0", 1, UP.0, UP.1, [0; 4]).port("mlx5_1", 1, UP.0, UP.1, [0; 4]);
        let mut w = PortWatch::new(&settings(Some(2)));
        let start = w.observe(&t.read(), Utc::now());
        let hcas: Vec<&HealthEvent> = start.iter().filter(|e| get(e, "check") == "ib_hcas").collect();
        assert_eq!(hcas.len(), 1);
        assert!(hcas[0].healthy, "complete at start: clear evidence");
        t.remove("mlx5_1");
        let gone = w.observe(&t.read(), Utc::now());
        assert_eq!(gone.len(), 1, "{gone:?}");
        assert_eq!((get(&gone[0], "present"), get(&gone[0], "expected"), gone[0].healthy), ("1", "2", false));
        assert!(w.observe(&t.read(), Utc::now()).is_empty(), "reported once");
        t.port("mlx5_1", 1, UP.0, UP.1, [0; 4]);
        let back = w.observe(&t.read(), Utc::now());
        let hca = back.iter().find(|e| get(e, "check") == "ib_hcas").expect("back");
        assert!(hca.healthy);
        // Unset: the count is not checked at all.
        let mut unchecked = PortWatch::new(&settings(None));
        assert!(unchecked.observe(&FabricReading::default(), Utc::now()).is_empty());
    }

    #[test]
    fn ignored_ports_and_hcas_are_not_watched() {
        let t = Tree::new();
        t.port("mlx5_0", 1, UP.0, UP.1, [0; 4]).port("mlx5_0", 2, "1: DOWN", "3: Disabled", [0; 4]);
        t.port("mlx5_9", 1, "1: DOWN", "3: Disabled", [0; 4]);
        let mut s = settings(None);
        s.ignore = ["mlx5_0/2".to_owned(), "mlx5_9".to_owned()].into();
        let mut w = PortWatch::new(&s);
        let start = w.observe(&t.read(), Utc::now());
        assert_eq!(start.len(), 1);
        assert!(start[0].healthy);
    }
}
