//! A real Redis Sentinel deployment on loopback: one master, one replica
//! (`--replicaof`) and three `redis-server --sentinel` processes with
//! generated configs, each on a free 127.0.0.1 port in its own directory,
//! killed by PID (on drop too).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sluicegate::config::{EndpointUrl, RedisConfig, RedisMode};

use super::free_port;

/// The name the sentinels monitor the master under.
pub(crate) const MASTER_NAME: &str = "sluicegate-master";

/// One `redis-server` process (data node or sentinel).
#[derive(Debug)]
pub(crate) struct Node {
    child: Option<Child>,
    /// Its port.
    pub(crate) port: u16,
}

impl Node {
    fn spawn(dir: &PathBuf, args: &[String]) -> Child {
        std::fs::create_dir_all(dir).expect("node dir");
        Command::new("redis-server")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs (apt-get install redis-server)")
    }

    /// Runs `redis-cli` against the node; its standard output.
    pub(crate) fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .arg("-p")
            .arg(self.port.to_string())
            .args(args)
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// An integer answer of `redis-cli`.
    pub(crate) fn int(&self, args: &[&str]) -> i64 {
        let text = self.cli(args);
        text.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{args:?} on :{} answered {text:?}", self.port))
    }

    /// `master` or `slave`, from `ROLE`.
    pub(crate) fn role(&self) -> String {
        self.cli(&["ROLE"]).lines().next().unwrap_or("").to_owned()
    }

    /// SIGKILLs the process (by PID).
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn wait_answers(&self) {
        let give_up = Instant::now() + Duration::from_secs(20);
        while self.cli(&["PING"]).trim() != "PONG" {
            assert!(
                Instant::now() < give_up,
                "redis-server on :{} did not start",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Master, replica and three sentinels.
#[derive(Debug)]
pub(crate) struct SentinelGroup {
    /// The data nodes, the first one the master at start.
    pub(crate) data: [Node; 2],
    /// The sentinels.
    pub(crate) sentinels: [Node; 3],
    dir: PathBuf,
}

impl SentinelGroup {
    /// Starts the group and waits until every sentinel knows the master,
    /// its replica (in sync) and the two other sentinels, so a failover
    /// can start at once.
    pub(crate) fn start() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "sluicegate-sentinel-{}-{}",
            std::process::id(),
            free_port()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let data_node = |name: &str, port: u16, replica_of: Option<u16>| {
            let node_dir = dir.join(name);
            let mut args: Vec<String> = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
            if let Some(master) = replica_of {
                args.extend(["--replicaof".into(), "127.0.0.1".into(), master.to_string()]);
            }
            let node = Node {
                child: Some(Node::spawn(&node_dir, &args)),
                port,
            };
            node.wait_answers();
            node
        };
        let master_port = free_port();
        let master = data_node("master", master_port, None);
        let replica = data_node("replica", free_port(), Some(master_port));
        let sentinel = |i: usize| {
            let port = free_port();
            let node_dir = dir.join(format!("sentinel-{i}"));
            std::fs::create_dir_all(&node_dir).expect("sentinel dir");
            // Sentinel rewrites its config file: each has its own.
            let conf = node_dir.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                     sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
                     sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
                     sentinel failover-timeout {MASTER_NAME} 10000\n\
                     sentinel parallel-syncs {MASTER_NAME} 1\n",
                    dir = node_dir.display()
                ),
            )
            .expect("sentinel.conf");
            let node = Node {
                child: Some(Node::spawn(
                    &node_dir,
                    &[conf.display().to_string(), "--sentinel".to_owned()],
                )),
                port,
            };
            node.wait_answers();
            node
        };
        let group = Self {
            data: [master, replica],
            sentinels: [sentinel(0), sentinel(1), sentinel(2)],
            dir,
        };
        group.wait_settled(master_port);
        group
    }

    /// Waits until the replica is in sync with `master_port` and every
    /// sentinel sees that master, one replica and two other sentinels.
    fn wait_settled(&self, master_port: u16) {
        let give_up = Instant::now() + Duration::from_secs(60);
        loop {
            let replica_up = self.data.iter().filter(|n| n.port != master_port).all(|n| {
                n.cli(&["INFO", "replication"])
                    .contains("master_link_status:up")
            });
            let sentinels_agree = self.sentinels.iter().all(|s| {
                let info = field_map(&s.cli(&["SENTINEL", "MASTER", MASTER_NAME]));
                info.get("port").map(String::as_str) == Some(&master_port.to_string())
                    && info.get("num-slaves").map(String::as_str) == Some("1")
                    && info.get("num-other-sentinels").map(String::as_str) == Some("2")
                    && info.get("flags").map(String::as_str) == Some("master")
            });
            if replica_up && sentinels_agree {
                return;
            }
            assert!(
                Instant::now() < give_up,
                "sentinel group did not settle on master :{master_port}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `host:port` of each sentinel.
    pub(crate) fn sentinel_addrs(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect()
    }

    /// The master's port as the first sentinel that answers names it.
    pub(crate) fn master_port(&self) -> u16 {
        self.sentinels
            .iter()
            .find_map(|s| {
                let out = s.cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME]);
                out.lines().nth(1)?.trim().parse().ok()
            })
            .expect("a sentinel names the master")
    }

    /// The data node that is the master now.
    pub(crate) fn master(&self) -> &Node {
        let port = self.master_port();
        self.data
            .iter()
            .find(|n| n.port == port)
            .expect("the master is one of the data nodes")
    }

    /// Waits until the replica has everything the master wrote (their
    /// replication offsets agree), so a failover loses nothing written
    /// before it.
    pub(crate) async fn wait_replica_synced(&self) {
        let offset = |node: &Node, field: &str| -> Option<i64> {
            node.cli(&["INFO", "replication"])
                .lines()
                .find_map(|l| l.strip_prefix(field)?.trim().parse().ok())
        };
        let master = self.master();
        let replica = self
            .data
            .iter()
            .find(|n| n.port != master.port)
            .expect("replica");
        let give_up = Instant::now() + Duration::from_secs(20);
        loop {
            let (m, r) = (
                offset(master, "master_repl_offset:"),
                offset(replica, "slave_repl_offset:"),
            );
            if m.is_some() && m == r {
                return;
            }
            assert!(Instant::now() < give_up, "replica behind: {m:?} vs {r:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILLs the current master.
    pub(crate) fn kill_master(&mut self) -> u16 {
        let port = self.master_port();
        let node = self
            .data
            .iter_mut()
            .find(|n| n.port == port)
            .expect("master node");
        node.kill();
        port
    }

    /// `SENTINEL FAILOVER`, asked of the first sentinel.
    pub(crate) fn failover(&self) {
        let out = self.sentinels[0].cli(&["SENTINEL", "FAILOVER", MASTER_NAME]);
        assert_eq!(out.trim(), "OK", "SENTINEL FAILOVER answered {out:?}");
    }

    /// Waits until every live sentinel names a master other than `old`,
    /// and that node says it is a master; its port.
    pub(crate) async fn wait_new_master(&self, old: u16, within: Duration) -> u16 {
        let give_up = Instant::now() + within;
        loop {
            let named: Vec<Option<u16>> = self
                .sentinels
                .iter()
                .map(|s| {
                    let out = s.cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME]);
                    out.lines().nth(1)?.trim().parse().ok()
                })
                .collect();
            if let Some(Some(port)) = named.first()
                && *port != old
                && named.iter().all(|p| *p == Some(*port))
                && self
                    .data
                    .iter()
                    .any(|n| n.port == *port && n.role() == "master")
            {
                return *port;
            }
            assert!(
                Instant::now() < give_up,
                "no new master after {within:?}: sentinels name {named:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `[redis]` in sentinel mode for this group (database 0, no TLS).
    pub(crate) fn redis_config(&self) -> RedisConfig {
        RedisConfig {
            url: EndpointUrl::new(url::Url::parse("redis://127.0.0.1:6379/0").expect("url")),
            mode: RedisMode::Sentinel,
            addrs: self.sentinel_addrs(),
            master_name: Some(MASTER_NAME.to_owned()),
            ..RedisConfig::default()
        }
    }
}

impl Drop for SentinelGroup {
    fn drop(&mut self) {
        for node in self.sentinels.iter_mut().chain(self.data.iter_mut()) {
            node.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `redis-cli`'s flat field/value lines (`SENTINEL MASTER`) as a map.
fn field_map(text: &str) -> std::collections::HashMap<String, String> {
    let lines: Vec<&str> = text.lines().collect();
    lines
        .chunks(2)
        .filter_map(|kv| Some((kv.first()?.to_string(), kv.get(1)?.to_string())))
        .collect()
}
