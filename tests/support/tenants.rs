//! What the quota, tier and fairness suites share: messages of a tenant
//! submitted to a real Redis queue through our producer, and a gateway
//! (wiremock: the arrival order and time per tenant is what is measured)
//! that records when each request arrived and for which tenant.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sluicegate::config::{EndpointUrl, RedisConfig};
use sluicegate::queue::redis::{Submission, enqueue};
use sluicegate::redis::connection;
use sluicegate::request::parse_message;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

use super::redis::RedisServer;

/// Unix seconds now.
pub fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs() as i64
}

/// `[redis]` pointing at `server`.
pub fn redis_config(server: &RedisServer) -> RedisConfig {
    RedisConfig {
        url: EndpointUrl::new(url::Url::parse(&server.url()).expect("url")),
        username: None,
        password: None,
        password_file: None,
        cluster: false,
    }
}

/// One request of `tenant` (metadata `userid`) with `deadline`.
pub fn tenant_line(id: &str, tenant: &str, deadline: i64) -> String {
    serde_json::json!({
        "id": id,
        "deadline": deadline,
        "metadata": {"userid": tenant},
        "payload": {"model": "m", "prompt": "p", "max_tokens": 1}
    })
    .to_string()
}

/// Submits `lines` to `queue` through our producer.
pub async fn submit(server: &RedisServer, queue: &str, lines: &[String]) {
    submit_filed(server, queue, lines, None).await;
}

/// Submits `lines` to `queue` through our producer, each also filed in its
/// tenant's lane (metadata `userid`, the default fairness attribute).
pub async fn submit_in_lanes(server: &RedisServer, queue: &str, lines: &[String]) {
    submit_filed(server, queue, lines, Some("userid")).await;
}

async fn submit_filed(
    server: &RedisServer,
    queue: &str,
    lines: &[String],
    attribute: Option<&str>,
) {
    let mut conn = connection(&redis_config(server)).expect("connection");
    let now_ms = unix_now() * 1000;
    let batch: Vec<Submission> = lines
        .iter()
        .map(|l| {
            let message = parse_message(l.as_bytes()).expect("valid");
            let tenant =
                attribute.map(|a| message.request.metadata.get(a).cloned().unwrap_or_default());
            Submission::new(message, queue, now_ms).in_lane(tenant)
        })
        .collect();
    enqueue(&mut conn, queue, &batch).await.expect("enqueued");
}

/// One request as the gateway saw it.
#[derive(Debug, Clone)]
pub struct Arrival {
    /// When it arrived.
    pub at: Instant,
    /// Its `x-llm-d-inference-fairness-id` (the tenant).
    pub tenant: String,
}

/// Records arrivals, answers 200 after `delay`.
struct Recorder {
    arrivals: Arc<Mutex<Vec<Arrival>>>,
    delay: Duration,
}

impl Respond for Recorder {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let tenant = request
            .headers
            .get("x-llm-d-inference-fairness-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        self.arrivals.lock().expect("arrivals").push(Arrival {
            at: Instant::now(),
            tenant,
        });
        ResponseTemplate::new(200)
            .set_body_string(r#"{"choices":[]}"#)
            .set_delay(self.delay)
    }
}

/// A gateway recording every arrival; answers after `delay`.
pub async fn recording_gateway(delay: Duration) -> (MockServer, Arc<Mutex<Vec<Arrival>>>) {
    let gateway = MockServer::start().await;
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    Mock::given(method("POST"))
        .respond_with(Recorder {
            arrivals: arrivals.clone(),
            delay,
        })
        .mount(&gateway)
        .await;
    (gateway, arrivals)
}

/// The arrivals so far.
pub fn seen(arrivals: &Arc<Mutex<Vec<Arrival>>>) -> Vec<Arrival> {
    arrivals.lock().expect("arrivals").clone()
}
