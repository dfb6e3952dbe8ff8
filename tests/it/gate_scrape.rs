//! Gates that read `/metrics` pages directly (`endpoint-scrape`, `vllm`)
//! against the live simulator, and the scrape source on its real page.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use crate::support::sim::{flood, small_pool};
use serde_json::json;
use sluicegate::config::GateSpec;
use sluicegate::gate::{DispatchGate as _, FailClosed, GateContext, Observation, build_gate};
use sluicegate::source::{Cached, MetricType, Scrape};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

const STALENESS: Duration = Duration::from_secs(4);

fn gate(kind: &str, params: serde_json::Value) -> FailClosed {
    let spec = GateSpec::parse(kind, &params, "test").unwrap();
    let ctx = GateContext::new(None, None, Duration::from_millis(100), STALENESS);
    FailClosed::new(build_gate(&spec, &ctx).unwrap(), STALENESS)
}

async fn until(
    gate: &FailClosed,
    limit: Duration,
    pred: impl Fn(&Observation) -> bool,
) -> Observation {
    let start = std::time::Instant::now();
    loop {
        let o = gate.observe().await;
        if pred(&o) || start.elapsed() > limit {
            return o;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_source_keeps_vllm_names_and_histograms_of_the_simulator() {
    let sim = small_pool().await;
    let url = format!("{}/metrics", sim.base_url()).parse().unwrap();
    let page = Cached::new(
        Scrape::new(reqwest::Client::new(), url, Duration::from_secs(2)),
        Duration::from_secs(1),
        STALENESS,
    );
    let page = page.get().await.unwrap().value;
    assert_eq!(page.named("vllm:num_requests_running").count(), 2);
    assert_eq!(page.type_of("vllm:num_requests_running"), MetricType::Gauge);
    let ttft = page.histogram("vllm:time_to_first_token_seconds");
    assert_eq!(ttft.len(), 2);
    assert_eq!(ttft[0].buckets.last().map(|b| b.0), Some(f64::INFINITY));
    assert!(page.named("llm_d_epp_ready_endpoints").next().is_some());
    assert!(
        page.named("vllm:cache_config_info")
            .all(|s| s.labels.contains_key("num_gpu_blocks"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_scrape_computes_saturation_from_a_count_and_live_pod_count() {
    let sim = small_pool().await;
    let url = format!("{}/metrics", sim.base_url());
    let g = gate(
        "endpoint-scrape",
        json!({
            "url": url,
            "metric": "vllm:num_requests_running",
            "labels": {"inference_pool": "p"},
            "max_count_per_pod": 2,
            "pods_metric": "llm_d_epp_ready_endpoints",
            "pods_labels": {"name": "p"},
            "baseline": 0.1
        }),
    );
    let idle = g.observe().await;
    assert!(idle.source_available, "{}", idle.reason);
    assert_eq!(idle.budget.get(), 1.0);
    assert_eq!(idle.max_sys, Some(4.0), "2 ready pods × 2");
    assert!((idle.baseline.get() - 0.1).abs() < 1e-12);

    let load = flood(&sim, 12, 200).await;
    let busy = until(&g, Duration::from_secs(10), |o| o.budget.get() == 0.0).await;
    assert!(
        busy.source_available && busy.budget.get() == 0.0,
        "{busy:?}"
    );
    for h in load {
        h.await.unwrap();
    }
    let drained = until(&g, Duration::from_secs(10), |o| o.budget.get() == 1.0).await;
    assert_eq!(drained.budget.get(), 1.0, "{drained:?}");

    // Direct saturation metric.
    let direct = gate(
        "endpoint-scrape",
        json!({"url": url, "metric": "llm_d_epp_flow_control_pool_saturation",
               "labels": {"inference_pool": "p"}}),
    )
    .observe()
    .await;
    assert!(
        direct.source_available && direct.budget.get() == 1.0,
        "{direct:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_scrape_fails_closed_on_typos_zero_pods_and_a_dead_endpoint() {
    let sim = small_pool().await;
    let url = format!("{}/metrics", sim.base_url());
    let typo = gate(
        "endpoint-scrape",
        json!({"url": url, "metric": "vllm:num_request_running", "max_count_per_pod": 2}),
    )
    .observe()
    .await;
    assert_eq!(typo.budget.get(), 0.0);
    assert!(!typo.source_available, "{typo:?}");

    let pods = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/metrics"))
        .respond_with(ResponseTemplate::new(200).set_body_string("ready_pods 0\n"))
        .mount(&pods)
        .await;
    let zero = gate(
        "endpoint-scrape",
        json!({"url": url, "metric": "vllm:num_requests_running", "max_count_per_pod": 2,
               "pods_url": format!("{}/metrics", pods.uri()), "pods_metric": "ready_pods"}),
    )
    .observe()
    .await;
    assert_eq!(zero.budget.get(), 0.0, "{zero:?}");
    assert_eq!(zero.max_sys, Some(0.0));

    let garbage = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/metrics"))
        .respond_with(ResponseTemplate::new(200).set_body_string("saturation{ 0.1\n"))
        .mount(&garbage)
        .await;
    let unparsable = gate(
        "endpoint-scrape",
        json!({"url": format!("{}/metrics", garbage.uri()), "metric": "saturation"}),
    )
    .observe()
    .await;
    assert!(!unparsable.source_available && unparsable.budget.get() == 0.0);

    let g = gate(
        "endpoint-scrape",
        json!({"url": url, "metric": "llm_d_epp_flow_control_pool_saturation"}),
    );
    assert!(g.observe().await.is_open());
    sim.shutdown().await.unwrap();
    let dead = until(&g, STALENESS + Duration::from_secs(2), |o| {
        !o.source_available
    })
    .await;
    assert!(
        !dead.source_available && dead.budget.get() == 0.0,
        "{dead:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_gate_follows_the_roofline_of_the_engines() {
    let sim = small_pool().await;
    let url = format!("{}/metrics", sim.base_url());
    let g = gate(
        "vllm",
        json!({"urls": [url.clone()], "max_num_seqs": 2, "baseline": 0.05}),
    );
    let idle = g.observe().await;
    assert!(idle.source_available && idle.sees_own_load, "{idle:?}");
    assert_eq!(idle.budget.get(), 1.0, "{}", idle.reason);
    assert_eq!(idle.max_sys, Some(4.0), "2 engines × max_num_seqs 2");

    let load = flood(&sim, 12, 200).await;
    let busy = until(&g, Duration::from_secs(10), |o| o.budget.get() == 0.0).await;
    assert_eq!(busy.budget.get(), 0.0, "{busy:?}");
    for h in load {
        h.await.unwrap();
    }
    let drained = until(&g, Duration::from_secs(10), |o| o.budget.get() > 0.9).await;
    assert!(drained.budget.get() > 0.9, "{drained:?}");

    // Without max_num_seqs configured or exported, vLLM's default applies.
    let default = gate("vllm", json!({"urls": [url.clone()]})).observe().await;
    assert_eq!(default.max_sys, Some(512.0));

    // One engine page unreachable: it counts as a full engine.
    let half = gate(
        "vllm",
        json!({"urls": [url, "http://127.0.0.1:9/metrics"], "max_num_seqs": 2}),
    )
    .observe()
    .await;
    assert!(half.source_available);
    assert!((half.budget.get() - 2.0 / 3.0).abs() < 1e-9, "{half:?}");

    let none = gate("vllm", json!({"urls": ["http://127.0.0.1:9/metrics"]}))
        .observe()
        .await;
    assert!(!none.source_available && none.budget.get() == 0.0);
}

/// A `vllm` decision from a page its cache still serves is the reading
/// computed from that page, reused rather than recomputed (issue 21: the
/// rescan cost 4.7 µs a decision); a new page gives a new reading, and
/// `explain` still reads and reports every source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_gate_reuses_its_reading_while_the_page_is_cached_and_follows_a_new_page() {
    let sim = small_pool().await;
    let url = format!("{}/metrics", sim.base_url());
    let ttl = Duration::from_secs(2);
    let spec = GateSpec::parse("vllm", &json!({"urls": [url], "max_num_seqs": 2}), "t").unwrap();
    let ctx = GateContext::new(None, None, ttl, STALENESS);
    let g = FailClosed::new(build_gate(&spec, &ctx).unwrap(), STALENESS);
    let first = g.observe().await;
    assert!(first.source_available, "{first:?}");
    let again = g.observe().await;
    assert_eq!(
        (again.taken_at, again.budget, &again.reason),
        (first.taken_at, first.budget, &first.reason),
        "the same cached page gives the same reading"
    );
    // `explain` of a gate whose reading is memoised still reads and
    // reports its source.
    let bare = build_gate(&spec, &ctx).unwrap();
    assert!(bare.observe().await.is_ok());
    let explained = bare.explain().await;
    assert_eq!(explained.sources.len(), 1, "{explained:?}");
    assert!(!explained.sources[0].values.is_empty(), "{explained:?}");

    // Under load (longer than the cache's TTL): a newer page, a newer
    // reading.
    let load = flood(&sim, 12, 3000).await;
    let busy = until(&g, Duration::from_secs(10), |o| {
        o.taken_at > first.taken_at && o.budget.get() < first.budget.get()
    })
    .await;
    assert!(busy.taken_at > first.taken_at, "{busy:?}");
    assert!(busy.budget.get() < first.budget.get(), "{busy:?}");
    for h in load {
        h.abort();
    }
}

/// Upstream's `admission: counted` (llm-d-async #484) on the simulator's
/// page: each reading grants floor(free slots) starts, the same reading
/// grants no more, the next reading grants again, and a failed reading
/// admits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_scrape_counted_admits_the_free_slots_of_each_reading_once() {
    use sluicegate::gate::{Admission, AdmissionRequest};
    let sim = small_pool().await;
    let params = json!({
        "url": format!("{}/metrics", sim.base_url()),
        "metric": "vllm:num_requests_running",
        "labels": {"inference_pool": "p"},
        "max_count_per_pod": 2,
        "pods_metric": "llm_d_epp_ready_endpoints",
        "pods_labels": {"name": "p"},
        "admission": "counted"
    });
    let spec = GateSpec::parse("endpoint-scrape", &params, "test").unwrap();
    // One reading lasts the cache interval: long enough for the burst.
    let ttl = Duration::from_secs(2);
    let ctx = GateContext::new(None, None, ttl, STALENESS);
    let g = FailClosed::new(build_gate(&spec, &ctx).unwrap(), STALENESS);
    let empty = std::collections::BTreeMap::new();
    let mut verdicts = Vec::new();
    for _ in 0..6 {
        verdicts.push(g.admit(AdmissionRequest::new("r", &empty, &empty)).await);
    }
    let started = verdicts
        .iter()
        .filter(|v| matches!(v, Admission::Continue(_)))
        .count();
    assert_eq!(started, 4, "an idle pool of 2 pods × 2 slots: {verdicts:?}");
    assert!(
        matches!(
            verdicts[5],
            Admission::Wait {
                reason: "no_free_slots"
            }
        ),
        "{verdicts:?}"
    );
    // The next reading grants the free slots again (nothing of ours runs:
    // this test admits without sending). The page is refreshed in the
    // background once the interval is over, so the first ask after it may
    // still see the spent reading.
    tokio::time::sleep(ttl).await;
    let ask = || g.admit(AdmissionRequest::new("r", &empty, &empty));
    let verdict_within = |limit: Duration, want: fn(&Admission) -> bool| {
        let ask = &ask;
        async move {
            let give_up = std::time::Instant::now() + limit;
            loop {
                let v = ask().await;
                if want(&v) || std::time::Instant::now() > give_up {
                    return v;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let again = verdict_within(Duration::from_secs(5), |v| {
        matches!(v, Admission::Continue(_))
    })
    .await;
    assert!(matches!(again, Admission::Continue(_)), "{again:?}");
    let mut more = 0;
    while matches!(ask().await, Admission::Continue(_)) {
        more += 1;
        assert!(more <= 3, "a new reading grants its 4 slots once");
    }
    assert_eq!(more, 3, "the new reading's other three slots");
    // Load fills the pool: a reading with no free slot admits nothing.
    let load = flood(&sim, 12, 200).await;
    until(&g, Duration::from_secs(10), |o| o.budget.get() == 0.0).await;
    tokio::time::sleep(ttl).await;
    let full = verdict_within(Duration::from_secs(5), |v| {
        matches!(
            v,
            Admission::Wait {
                reason: "no_free_slots"
            }
        )
    })
    .await;
    assert!(
        matches!(
            full,
            Admission::Wait {
                reason: "no_free_slots"
            }
        ),
        "a full pool admits nothing: {full:?}"
    );
    for h in load {
        h.abort();
    }
    // A failed reading admits nothing (once the last page is too old to
    // serve).
    sim.shutdown().await.unwrap();
    let failed = verdict_within(STALENESS + Duration::from_secs(5), |v| {
        matches!(
            v,
            Admission::Wait {
                reason: "reading_failed"
            }
        )
    })
    .await;
    assert!(
        matches!(
            failed,
            Admission::Wait {
                reason: "reading_failed"
            }
        ),
        "{failed:?}"
    );
}

/// `absent_value` stands in for a metric the page lacks (a gauge that
/// exists only while there is something to count), and `value_type =
/// "budget"` reads the value as `D` itself; a page without the metric
/// and no `absent_value` stays a failed reading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_scrape_absent_value_and_budget_value_type() {
    let page = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/metrics"))
        .respond_with(
            ResponseTemplate::new(200).set_body_string("other_metric 3\nbudget_now 0.3\n"),
        )
        .mount(&page)
        .await;
    let url = format!("{}/metrics", page.uri());
    let lacking = gate(
        "endpoint-scrape",
        json!({"url": url, "metric": "epp_batch_queue_size", "max_count_per_pod": 8}),
    )
    .observe()
    .await;
    assert!(!lacking.source_available && lacking.budget.get() == 0.0);
    let assumed = gate(
        "endpoint-scrape",
        json!({"url": url, "metric": "epp_batch_queue_size", "max_count_per_pod": 8,
               "absent_value": 2}),
    )
    .observe()
    .await;
    assert!(assumed.source_available, "{assumed:?}");
    assert!((assumed.budget.get() - 0.75).abs() < 1e-12, "{assumed:?}");
    assert_eq!(assumed.max_sys, Some(8.0));
    let direct = gate(
        "endpoint-scrape",
        json!({"url": url, "metric": "budget_now", "value_type": "budget"}),
    )
    .observe()
    .await;
    assert!((direct.budget.get() - 0.3).abs() < 1e-12, "{direct:?}");
}

#[test]
fn endpoint_scrape_refuses_counted_admission_without_a_count_or_with_a_baseline() {
    let url = "http://127.0.0.1:9/metrics";
    let refused = |params: serde_json::Value, says: &str| {
        let err = GateSpec::parse("endpoint-scrape", &params, "queue[0]")
            .expect_err("refused")
            .to_string();
        assert!(err.contains(says), "{err}");
    };
    refused(
        json!({"url": url, "metric": "m", "admission": "counted"}),
        "queue[0].gate_params.admission: `counted` needs a count metric",
    );
    refused(
        json!({"url": url, "metric": "m", "max_count_per_pod": 4, "value_type": "budget",
               "admission": "counted"}),
        "needs a count metric",
    );
    refused(
        json!({"url": url, "metric": "m", "max_count_per_pod": 4, "baseline": 0.1,
               "admission": "counted"}),
        "takes neither baseline nor fallback",
    );
    refused(
        json!({"url": url, "metric": "m", "admission": "sometimes"}),
        "admission",
    );
    refused(
        json!({"url": url, "metric": "m", "value_type": "percent"}),
        "value_type",
    );
    refused(
        json!({"url": url, "metric": "m", "absent_value": -1}),
        "absent_value",
    );
}
