//! The crate's Pub/Sub emulator (`sluicegate::servers::emulator`: `gcloud
//! beta emulators pubsub start` on a free 127.0.0.1 port, stopped by
//! process group; a restart starts empty) with the tests' failures as
//! panics, and the topics, publishing and collecting the tests use.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sluicegate::queue::pubsub::{SetupPlan, Target, connect_to, pubsub_message, setup};

/// The project every test uses (the emulator accepts any).
pub const PROJECT: &str = "sluicegate-test";

/// A running (or stopped) emulator; `port`, `host` of the crate's through
/// `Deref`.
#[derive(Debug)]
pub struct Emulator(sluicegate::servers::Emulator);

impl Emulator {
    /// Starts the emulator and waits (up to 60 s) until it answers.
    pub fn start() -> Self {
        Self(sluicegate::servers::Emulator::start().unwrap_or_else(|e| panic!("{e}")))
    }

    /// Kills the whole process group (wrapper and java) and reaps it.
    pub fn stop(&mut self) {
        self.0.stop().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Stops and starts again on the same port (with empty state).
    pub fn restart(&mut self) {
        self.0.restart().unwrap_or_else(|e| panic!("{e}"));
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

impl std::ops::Deref for Emulator {
    type Target = sluicegate::servers::Emulator;
    fn deref(&self) -> &Self::Target {
        &self.0
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
