//! The official Pub/Sub emulator (`gcloud beta emulators pubsub start`) on
//! a free 127.0.0.1 port, stopped by process group: gcloud's Python
//! wrapper spawns the Java server as a child, so the wrapper is started as
//! the leader of its own group and the whole group is killed (on drop
//! too), leaving no java behind. Restartable on the same port; the
//! emulator keeps its state in memory only, so a restart starts empty.

use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sluicegate::queue::pubsub::{SetupPlan, Target, connect_to, pubsub_message, setup};

pub use super::free_port;

/// The project every test uses (the emulator accepts any).
pub const PROJECT: &str = "sluicegate-test";

/// A running (or stopped) emulator.
#[derive(Debug)]
pub struct Emulator {
    child: Option<Child>,
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: super::TempDir,
}

impl Emulator {
    /// Starts the emulator and waits (up to 60 s) until it answers.
    pub fn start() -> Self {
        let mut e = Self {
            child: None,
            port: free_port(),
            dir: super::TempDir::new("pubsub-emulator"),
        };
        e.spawn();
        e
    }

    /// `host:port`, as `PUBSUB_EMULATOR_HOST` and `[pubsub] emulator_host` take it.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.0.join("emulator.log")).expect("log file");
        let child = Command::new("gcloud")
            .args([
                "beta",
                "emulators",
                "pubsub",
                "start",
                &format!("--host-port=127.0.0.1:{}", self.port),
                &format!("--data-dir={}", self.dir.0.display()),
                "--quiet",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("gcloud starts (is the Cloud SDK with the pubsub emulator installed?)");
        self.child = Some(child);
        let give_up = Instant::now() + Duration::from_secs(60);
        while !self.answers() {
            assert!(
                Instant::now() < give_up,
                "the emulator did not answer within 60 s: {}",
                std::fs::read_to_string(self.dir.0.join("emulator.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Whether the emulator answers an HTTP GET / with 200.
    fn answers(&self) -> bool {
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if s.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .is_err()
        {
            return false;
        }
        let mut buf = [0u8; 64];
        matches!(s.read(&mut buf), Ok(n) if n > 12 && buf[..n].starts_with(b"HTTP/1.1 200"))
    }

    /// Kills the whole process group (wrapper and java) and reaps it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let group = format!("-{}", child.id());
            let _ = Command::new("kill")
                .args(["-KILL", "--", &group])
                .stderr(Stdio::null())
                .status();
            let _ = child.wait();
            // Nothing of the group may survive (java ignores nothing sent
            // with KILL, but check rather than assume).
            let give_up = Instant::now() + Duration::from_secs(10);
            while group_alive(&group) {
                assert!(Instant::now() < give_up, "emulator group {group} survived");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Stops and starts again on the same port (with empty state).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// A client for [`PROJECT`] on this emulator.
    pub async fn client(&self) -> gcloud_pubsub::client::Client {
        connect_to(PROJECT, Target::Emulator(self.host()))
            .await
            .expect("client for the emulator")
    }

    /// A `[pubsub]` section for this emulator.
    pub fn toml(&self, result_topic: &str) -> String {
        format!(
            "[pubsub]\nproject_id = \"{PROJECT}\"\nresult_topic_id = \"{result_topic}\"\nemulator_host = \"{}\"\n",
            self.host()
        )
    }
}

fn group_alive(group: &str) -> bool {
    Command::new("kill")
        .args(["-0", "--", group])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Drop for Emulator {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Names of one test's topics and subscriptions (ids need >= 3 chars).
#[derive(Debug, Clone)]
pub struct Names {
    /// Request topic.
    pub topic: String,
    /// Request subscription (the queue).
    pub subscription: String,
    /// Result topic.
    pub results: String,
    /// Subscription on the result topic.
    pub result_sub: String,
    /// Dead-letter topic.
    pub dead: String,
}

impl Names {
    /// Names prefixed with `tag`.
    pub fn new(tag: &str) -> Self {
        Self {
            topic: format!("{tag}-requests"),
            subscription: format!("{tag}-work"),
            results: format!("{tag}-results"),
            result_sub: format!("{tag}-results-sub"),
            dead: format!("{tag}-dead"),
        }
    }

    /// The plan `sluicegate pubsub setup` would run for these names.
    pub fn plan(&self, max_delivery_attempts: i32) -> SetupPlan {
        SetupPlan {
            request_topic: self.topic.clone(),
            subscription: self.subscription.clone(),
            dead_letter_topic: Some(self.dead.clone()),
            max_delivery_attempts,
            min_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(2),
            ack_deadline_secs: 10,
            exactly_once: false,
            result_topic: self.results.clone(),
            result_subscription: Some(self.result_sub.clone()),
        }
    }
}

/// Creates the topics and subscriptions of `names`.
pub async fn create(client: &gcloud_pubsub::client::Client, names: &Names, attempts: i32) {
    setup(client, &names.plan(attempts)).await.expect("setup");
}

/// Publishes `bodies` to `topic`, each confirmed.
pub async fn publish(client: &gcloud_pubsub::client::Client, topic: &str, bodies: &[String]) {
    let publisher = client.topic(topic).new_publisher(None);
    for chunk in bodies.chunks(500) {
        let messages = chunk
            .iter()
            .map(|b| pubsub_message(b.clone().into_bytes(), HashMap::new()))
            .collect();
        for r in sluicegate::queue::pubsub::publish_confirmed(&publisher, messages).await {
            r.expect("published");
        }
    }
}

/// Pulls and acks messages from `subscription` until `done` says so or
/// `within` passes; returns every message (data, attributes) in order.
pub async fn collect(
    client: &gcloud_pubsub::client::Client,
    subscription: &str,
    within: Duration,
    mut done: impl FnMut(&[(Vec<u8>, HashMap<String, String>)]) -> bool,
) -> Vec<(Vec<u8>, HashMap<String, String>)> {
    let sub = client.subscription(subscription);
    // Pulls that answer at once: a waiting Pull abandoned on a timeout can
    // swallow messages until their ack deadline (docs/transports.md).
    #[allow(deprecated)]
    let request = gcloud_googleapis::pubsub::v1::PullRequest {
        subscription: sub.fully_qualified_name().to_owned(),
        return_immediately: true,
        max_messages: 1000,
    };
    let give_up = Instant::now() + within;
    let mut out = Vec::new();
    while !done(&out) && Instant::now() < give_up {
        let pulled = match sub.get_client().pull(request.clone(), None).await {
            Ok(p) => p.into_inner().received_messages,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        if pulled.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let ids: Vec<String> = pulled.iter().map(|m| m.ack_id.clone()).collect();
        for m in pulled.into_iter().filter_map(|m| m.message) {
            out.push((m.data, m.attributes));
        }
        sub.ack(ids).await.expect("ack collected messages");
    }
    out
}

/// Result records by id, from collected result messages.
pub fn results_by_id(
    messages: &[(Vec<u8>, HashMap<String, String>)],
) -> HashMap<String, Vec<sluicegate::result::ResultRecord>> {
    let mut by_id: HashMap<String, Vec<_>> = HashMap::new();
    for (data, attributes) in messages {
        let r: sluicegate::result::ResultRecord =
            serde_json::from_slice(data).expect("a result record");
        assert_eq!(
            attributes.get("id"),
            Some(&r.id),
            "attribute id = record id"
        );
        by_id.entry(r.id.clone()).or_default().push(r);
    }
    by_id
}
