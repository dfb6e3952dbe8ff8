//! What the quota, tier and fairness suites share: messages of a tenant
//! submitted to a real Redis queue through our producer, and a gateway
//! (wiremock: the arrival order and time per tenant is what is measured)
//! that records when each request arrived and for which tenant.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wiremock::matchers::method;
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

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
