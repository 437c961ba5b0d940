//! The processes a scenario measures, read from `/proc`: resident memory and CPU time of one
//! process or of a process and its children (PostgreSQL's backends), and the process listening on
//! a local TCP port (how a scenario finds the servers underneath it: Kafka, PostgreSQL, etcd and
//! the apiserver of the testbed it was pointed at).

use std::collections::BTreeSet;

/// Clock ticks per second of `/proc/<pid>/stat` (`_SC_CLK_TCK`, 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

/// One reading of a group of processes: their memory and the CPU time they used so far.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub(crate) struct Reading {
    /// Resident memory, MiB: the proportional set size summed over the group (shared pages are
    /// split between the processes that map them, so PostgreSQL's shared buffers count once), the
    /// RSS of a single process.
    pub(crate) mib: f64,
    /// User plus system CPU seconds used so far, summed over the group.
    pub(crate) cpu_seconds: f64,
}

/// A process to measure: one pid, or a pid and its children.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Watched {
    pub(crate) pid: u32,
    pub(crate) with_children: bool,
}

impl Watched {
    /// Reads the process (and its children when asked) now; `None` when it is gone.
    pub(crate) fn read(&self) -> Option<Reading> {
        let mut pids = vec![self.pid];
        if self.with_children {
            pids.extend(children(self.pid));
        }
        let own = read_one(self.pid, !self.with_children)?;
        let rest = pids[1..].iter().filter_map(|&p| read_one(p, false));
        Some(rest.fold(own, |a, b| Reading { mib: a.mib + b.mib, cpu_seconds: a.cpu_seconds + b.cpu_seconds }))
    }
}

/// `pid`'s memory (RSS when `rss`, else PSS) and CPU seconds.
fn read_one(pid: u32, rss: bool) -> Option<Reading> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: the fields start after the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5); after the name, 12 and 13 counting from 1.
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    let (file, key) = if rss { ("status", "VmRSS:") } else { ("smaps_rollup", "Pss:") };
    let kb = std::fs::read_to_string(format!("/proc/{pid}/{file}"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())?;
    Some(Reading { mib: kb / 1024.0, cpu_seconds: ticks / TICKS_PER_SECOND })
}

/// A memory field of `pid`'s `/proc/<pid>/status` in MiB (`VmHWM:`, the peak resident memory;
/// `VmRSS:`), 0 when the process is gone.
pub(crate) fn status_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse::<f64>().ok()))
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// The direct children of `pid`.
fn children(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).ok().is_some_and(|s| {
                s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok()) == Some(pid)
            })
        })
        .collect()
}

/// The process listening on TCP `port` (IPv4 or IPv6), if this user can see it.
pub(crate) fn listening_on(port: u16) -> Option<u32> {
    // The listening sockets' inodes from /proc/net/tcp{,6}: local address `ADDR:PORT` in hex,
    // state 0A (LISTEN), inode in the tenth column.
    let mut inodes = BTreeSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let Some(local) = f.get(1) else { continue };
            let listening = f.get(3) == Some(&"0A");
            let on_port = local.rsplit_once(':').and_then(|(_, p)| u16::from_str_radix(p, 16).ok()) == Some(port);
            if listening
                && on_port
                && let Some(inode) = f.get(9)
            {
                inodes.insert(format!("socket:[{inode}]"));
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    std::fs::read_dir("/proc").ok()?.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()).find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).ok().is_some_and(|fds| {
            fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
                .any(|target| target.to_str().is_some_and(|t| inodes.contains(t)))
        })
    })
}

/// The port of an address such as `127.0.0.1:19092`, `https://127.0.0.1:16443/` or
/// `postgres://u:p@127.0.0.1:15432/db`.
pub(crate) fn port_of(address: &str) -> Option<u16> {
    let rest = address.split_once("://").map_or(address, |(_, r)| r);
    let host_port = rest.split('/').next()?.rsplit('@').next()?;
    host_port.rsplit_once(':')?.1.parse().ok()
}

/// The value of `--flag` in `pid`'s command line (`--flag value` or `--flag=value`).
pub(crate) fn flag_of(pid: u32, flag: &str) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = raw.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let prefix = format!("{flag}=");
    args.iter().enumerate().find_map(|(i, a)| {
        if a == flag { args.get(i + 1).cloned() } else { a.strip_prefix(&prefix).map(str::to_owned) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_come_out_of_every_address_form() {
        assert_eq!(port_of("127.0.0.1:19092"), Some(19092));
        assert_eq!(port_of("https://127.0.0.1:16443/"), Some(16443));
        assert_eq!(port_of("postgres://gpumedic:gpumedic@127.0.0.1:15432/gpumedic"), Some(15432));
        assert_eq!(port_of("http://127.0.0.1:22379"), Some(22379));
        assert_eq!(port_of("localhost"), None);
    }

    #[test]
    fn this_process_reads_and_a_listener_is_found_by_its_port() {
        let me = Watched { pid: std::process::id(), with_children: false }.read().expect("this process");
        assert!(me.mib > 1.0 && me.cpu_seconds >= 0.0, "{me:?}");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        assert_eq!(listening_on(port), Some(std::process::id()));
    }
}
