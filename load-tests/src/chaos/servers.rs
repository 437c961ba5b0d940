//! The chaos scenario's own servers: PostgreSQL, Kafka, etcd and a kube-apiserver started by
//! `compose/up` with a private state folder and private ports, so the scenario can stop, restart
//! and pause them without touching the shared testbed that other tests use.
//!
//! Every action goes through the compose scripts with the private environment (`GPUMEDIC_TESTBED`
//! and the port variables of `compose/lib/common.sh`), and the scripts act only on the pid files,
//! the data folder and the ports of that environment. Before anything starts, every private port
//! must be free: a server already answering there would be "left alone" by `compose/up` and then
//! restarted by the schedule, which must never happen to a server this run did not start.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;

/// The longest a compose script may run (starting Kafka, PostgreSQL and the apiserver together
/// takes under a minute on a quiet machine).
const SCRIPT_LIMIT: Duration = Duration::from_secs(300);

/// The servers the scenario runs, by their `compose/up` names.
pub const SERVERS: [&str; 3] = ["postgres", "kafka", "kubernetes"];

/// A private testbed: the compose scripts run with their own state folder and ports.
#[derive(Debug, Clone)]
pub struct PrivateTestbed {
    compose: PathBuf,
    state: PathBuf,
    base: u16,
}

impl PrivateTestbed {
    /// A testbed whose state lives in `state` and whose ports are `base` plus the testbed's usual
    /// offsets (Kafka `base+92`, PostgreSQL `base+432`, the apiserver `base+443`, ...).
    pub fn new(compose: PathBuf, state: PathBuf, base: u16) -> Self {
        Self { compose, state, base }
    }

    /// The private ports, by the environment variable that sets each.
    fn ports(&self) -> [(&'static str, u16); 11] {
        let b = self.base;
        [
            ("GPUMEDIC_KAFKA_PORT", b + 92),
            ("GPUMEDIC_KAFKA_CONTROLLER_PORT", b + 93),
            ("GPUMEDIC_POSTGRES_PORT", b + 432),
            ("GPUMEDIC_ETCD_PORT", b + 379),
            ("GPUMEDIC_ETCD_PEER_PORT", b + 380),
            ("GPUMEDIC_APISERVER_PORT", b + 443),
            ("GPUMEDIC_SCHEMA_REGISTRY_PORT", b + 81),
            ("GPUMEDIC_OTLP_GRPC_PORT", b + 317),
            ("GPUMEDIC_OTLP_HTTP_PORT", b + 318),
            ("GPUMEDIC_JAEGER_QUERY_PORT", b + 686),
            ("GPUMEDIC_JAEGER_QUERY_GRPC_PORT", b + 685),
        ]
    }

    fn port(&self, var: &str) -> u16 {
        self.ports().iter().find(|(v, _)| *v == var).map_or(0, |(_, p)| *p)
    }

    /// The private state folder.
    pub fn state_dir(&self) -> &Path {
        &self.state
    }

    /// Kafka's bootstrap address.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port("GPUMEDIC_KAFKA_PORT"))
    }

    /// The URL of the private PostgreSQL's `gpumedic` database.
    pub fn database_url(&self) -> String {
        format!("postgres://gpumedic:gpumedic@127.0.0.1:{}/gpumedic", self.port("GPUMEDIC_POSTGRES_PORT"))
    }

    /// The admin kubeconfig `compose/up` writes for the private apiserver.
    pub fn kubeconfig(&self) -> PathBuf {
        self.state.join("kubeconfig")
    }

    /// Fails when any private port already accepts connections: that server is not this run's.
    pub fn ensure_ports_free(&self) -> anyhow::Result<()> {
        let taken: Vec<String> = self
            .ports()
            .iter()
            .filter(|(_, p)| {
                std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], *p).into(), Duration::from_millis(300)).is_ok()
            })
            .map(|(v, p)| format!("{p} ({v})"))
            .collect();
        anyhow::ensure!(
            taken.is_empty(),
            "the chaos scenario's private ports are in use: {}; another chaos run is up (stop it with \
             `GPUMEDIC_TESTBED={} compose/down`) or choose other ports with --port-base",
            taken.join(", "),
            self.state.display()
        );
        Ok(())
    }

    /// The environment every compose script runs with: the state folder and every port.
    fn env(&self) -> Vec<(String, String)> {
        let mut env = vec![("GPUMEDIC_TESTBED".to_owned(), self.state.display().to_string())];
        env.extend(self.ports().iter().map(|(var, port)| ((*var).to_owned(), port.to_string())));
        env
    }

    fn script(&self, name: &str, args: &[&str]) -> std::process::Command {
        let mut cmd = std::process::Command::new(self.compose.join(name));
        cmd.args(args).envs(self.env()).stdin(std::process::Stdio::null());
        cmd
    }

    /// Runs a compose script to its end, its output appended to `logs/compose.log`.
    async fn run_script(&self, name: &str, args: &[&str]) -> anyhow::Result<Duration> {
        std::fs::create_dir_all(self.state.join("logs"))?;
        let log_path = self.state.join("logs/compose.log");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path)?;
        let mut cmd = self.script(name, args);
        cmd.stdout(log.try_clone()?).stderr(log);
        let started = Instant::now();
        let mut child = tokio::process::Command::from(cmd).kill_on_drop(true).spawn()?;
        let status = match tokio::time::timeout(SCRIPT_LIMIT, child.wait()).await {
            Ok(status) => status?,
            Err(_) => anyhow::bail!(
                "compose/{name} {} did not finish within {SCRIPT_LIMIT:?}; see {}",
                args.join(" "),
                log_path.display()
            ),
        };
        anyhow::ensure!(
            status.success(),
            "compose/{name} {} failed ({status}); see {}",
            args.join(" "),
            log_path.display()
        );
        Ok(started.elapsed())
    }

    /// Starts `servers` (`compose/up`); returns how long it took.
    pub async fn up(&self, servers: &[&str]) -> anyhow::Result<Duration> {
        self.run_script("up", servers).await
    }

    /// Stops `servers` (`compose/down`); returns how long it took.
    pub async fn down(&self, servers: &[&str]) -> anyhow::Result<Duration> {
        self.run_script("down", servers).await
    }

    /// Stops every private server and deletes the state folder (`compose/down --wipe`).
    pub async fn wipe(&self) -> anyhow::Result<()> {
        self.run_script("down", &["--wipe"]).await.map(|_| ())
    }

    /// The private PostgreSQL's data folder, as the compose scripts place it (under the state
    /// folder, or under /var/tmp when the `postgres` user cannot enter it).
    fn postgres_data(&self) -> anyhow::Result<PathBuf> {
        let lib = self.compose.join("lib");
        // Ask the scripts themselves rather than repeat their rule.
        let script = format!("source '{}/common.sh'; source '{}/servers.sh'; pg_root", lib.display(), lib.display());
        let out = std::process::Command::new("bash").args(["-c", &script]).envs(self.env()).output().context("bash")?;
        anyhow::ensure!(out.status.success(), "pg_root failed: {}", String::from_utf8_lossy(&out.stderr));
        Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("data"))
    }

    /// The private postmaster's pid and its children's (backends and background workers), read
    /// from the cluster's own `postmaster.pid` and `/proc`.
    pub fn postgres_pids(&self) -> anyhow::Result<Vec<u32>> {
        let pidfile = self.postgres_data()?.join("postmaster.pid");
        let text = std::fs::read_to_string(&pidfile).with_context(|| format!("read {}", pidfile.display()))?;
        let postmaster: u32 = text.lines().next().unwrap_or("").trim().parse().context("postmaster.pid")?;
        let mut pids = vec![postmaster];
        for entry in std::fs::read_dir("/proc")?.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
            // The fields after the command (which may hold spaces) start after its last ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(postmaster) {
                pids.push(pid);
            }
        }
        Ok(pids)
    }
}

/// Sends `signal` (`STOP`, `CONT`, `KILL`) to `pids`.
pub fn signal(pids: &[u32], signal: &str) -> anyhow::Result<()> {
    if pids.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = pids.iter().map(u32::to_string).collect();
    let status = std::process::Command::new("kill").arg(format!("-{signal}")).args(&list).status()?;
    if status.success() {
        return Ok(());
    }
    // `kill` signals every process it can and fails if any one could not be: a process that
    // exited between the listing and the signal (a backend closing its connection) is gone, not
    // a failure. Each one still there is signalled again, alone, and must take it.
    for pid in pids.iter().filter(|p| std::path::Path::new(&format!("/proc/{p}")).exists()) {
        let status = std::process::Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status()?;
        anyhow::ensure!(
            status.success() || !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "kill -{signal} {pid} failed (of {})",
            list.join(" ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_gone_before_its_signal_is_not_a_failure_and_the_rest_are_signalled() {
        let mut gone = std::process::Command::new("true").spawn().expect("spawned");
        let gone_pid = gone.id();
        gone.wait().expect("exited");
        let mut alive = std::process::Command::new("sleep").arg("30").spawn().expect("spawned");
        signal(&[gone_pid, alive.id()], "KILL").expect("the exited one is skipped");
        let status = alive.wait().expect("waited");
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(status.signal(), Some(9), "the living one took the signal");
    }
}
