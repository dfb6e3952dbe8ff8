//! A real three-node Redis Cluster on free 127.0.0.1 ports: three
//! `redis-server --cluster-enabled yes` processes joined with
//! `redis-cli --cluster create`, each killed by PID (on drop too).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{TempDir, free_port};

/// A running cluster of three masters (no replicas).
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<(Child, u16)>,
    _dir: TempDir,
}

impl RedisCluster {
    /// Starts three nodes, creates the cluster and waits until every node
    /// reports `cluster_state:ok`.
    pub fn start() -> Self {
        let dir = TempDir::new("redis-cluster");
        let nodes = (0..3)
            .map(|i| spawn_node(&dir.0.join(format!("node-{i}"))))
            .collect();
        let cluster = Self { nodes, _dir: dir };
        let addrs: Vec<String> = cluster
            .nodes
            .iter()
            .map(|(_, p)| format!("127.0.0.1:{p}"))
            .collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli runs (apt-get install redis-tools)");
        assert!(created.success(), "redis-cli --cluster create failed");
        for &(_, port) in &cluster.nodes {
            wait(
                Duration::from_secs(30),
                "every node reports cluster_state:ok",
                || cli(port, &["CLUSTER", "INFO"]).contains("cluster_state:ok"),
            );
        }
        cluster
    }

    /// `redis://127.0.0.1:<port>` of the first node: the seed clients use.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.nodes[0].1)
    }

    /// Runs `redis-cli -c` (follows redirections) against the first node.
    pub fn cli(&self, args: &[&str]) -> String {
        let mut all = vec!["-c"];
        all.extend_from_slice(args);
        cli(self.nodes[0].1, &all)
    }

    /// An integer answer of [`Self::cli`].
    pub fn int(&self, args: &[&str]) -> i64 {
        let text = self.cli(args);
        text.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{args:?} answered {text:?}"))
    }

    /// Keys matching `pattern` on every node (`KEYS` per node).
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        self.nodes
            .iter()
            .flat_map(|(_, port)| {
                cli(*port, &["KEYS", pattern])
                    .lines()
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// How many distinct nodes own at least one of `keys`' slots.
    pub fn nodes_owning(&self, keys: &[&str]) -> usize {
        let mut ports: Vec<u16> = keys
            .iter()
            .map(|k| {
                let slot: u16 = cli(self.nodes[0].1, &["CLUSTER", "KEYSLOT", k])
                    .trim()
                    .parse()
                    .expect("CLUSTER KEYSLOT answers a number");
                self.owner_of(slot)
            })
            .collect();
        ports.sort_unstable();
        ports.dedup();
        ports.len()
    }

    /// The port of the node that owns `slot`.
    fn owner_of(&self, slot: u16) -> u16 {
        // `CLUSTER SHARDS` would be structured, but `redis-cli` prints RESP
        // arrays flat; `CLUSTER NODES` is one line per node with its ranges.
        let nodes = cli(self.nodes[0].1, &["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let Some(addr) = fields.get(1) else { continue };
            let port: u16 = addr
                .split(['@', ':'])
                .nth(1)
                .and_then(|p| p.parse().ok())
                .expect("node address has a port");
            for range in fields.iter().skip(8) {
                let (lo, hi) = match range.split_once('-') {
                    Some((lo, hi)) => (lo.parse::<u16>(), hi.parse::<u16>()),
                    None => (range.parse::<u16>(), range.parse::<u16>()),
                };
                if let (Ok(lo), Ok(hi)) = (lo, hi)
                    && (lo..=hi).contains(&slot)
                {
                    return port;
                }
            }
        }
        panic!("no node owns slot {slot}: {nodes}");
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for (child, _) in &mut self.nodes {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts one cluster node on free ports and waits until it answers PING.
/// A node whose port was taken between `free_port` and its bind (another
/// suite's server, started in parallel) exits at once: it is started again
/// on other ports, a few times, instead of failing the suite.
fn spawn_node(node_dir: &std::path::Path) -> (Child, u16) {
    std::fs::create_dir_all(node_dir).expect("node dir");
    for _ in 0..5 {
        let port = free_port();
        // The bus port is given explicitly: the default (port + 10000)
        // may be taken or beyond 65535.
        let bus = free_port();
        let mut child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--cluster-enabled", "yes", "--cluster-port"])
            .arg(bus.to_string())
            .args(["--cluster-config-file", "nodes.conf"])
            .args(["--cluster-node-timeout", "2000"])
            .arg("--dir")
            .arg(node_dir)
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs (apt-get install redis-server)");
        let mut exited = false;
        wait(
            Duration::from_secs(20),
            "a cluster node answers PING",
            || {
                exited = matches!(child.try_wait(), Ok(Some(_)));
                exited || cli(port, &["PING"]).trim() == "PONG"
            },
        );
        if !exited {
            return (child, port);
        }
        let _ = std::fs::remove_file(node_dir.join("nodes.conf"));
    }
    panic!("no cluster node could bind a free port in five tries");
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait(within: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let give_up = Instant::now() + within;
    while !done() {
        assert!(
            Instant::now() < give_up,
            "timed out after {within:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
