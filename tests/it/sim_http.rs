//! The simulator's real-time HTTP front, over loopback.
#![allow(clippy::unwrap_used)]

use serde_json::Value;
use sluicegate::sim::config::LoadMode;
use sluicegate::sim::{SimConfig, SimHandle, spawn_http};

const METRIC_NAMES: [&str; 26] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "inference_pool_ready_pods",
    "inference_pool_per_pod_queue_size",
    "inference_pool_average_kv_cache_utilization",
    "inference_pool_average_queue_size",
    "inference_pool_average_running_requests",
    "inference_extension_flow_control_queue_size",
    "inference_extension_flow_control_pool_saturation",
    "llm_d_epp_ready_endpoints",
    "llm_d_epp_per_endpoint_queue_size",
    "llm_d_epp_average_kv_cache_utilization",
    "llm_d_epp_average_queue_size",
    "llm_d_epp_average_running_requests",
    "llm_d_epp_flow_control_queue_size",
    "llm_d_epp_flow_control_pool_saturation",
];

async fn start(cfg: SimConfig) -> (SimHandle, reqwest::Client) {
    (spawn_http(cfg).await.unwrap(), reqwest::Client::new())
}

async fn post(c: &reqwest::Client, h: &SimHandle, path: &str, body: &str) -> (u16, String) {
    let r = c
        .post(format!("{}{path}", h.base_url()))
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn get(c: &reqwest::Client, h: &SimHandle, path: &str) -> (u16, String) {
    let r = c
        .get(format!("{}{path}", h.base_url()))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test]
async fn answers_completions_streams_chat_and_serves_metrics() {
    let cfg = SimConfig {
        pool_name: "test-pool".into(),
        ..SimConfig::default()
    };
    let (h, c) = start(cfg).await;

    let (status, body) = post(
        &c,
        &h,
        "/v1/completions",
        r#"{"model":"sim-model","prompt":"hello there, simulator","max_tokens":12}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["usage"]["prompt_tokens"], 6);
    assert_eq!(v["usage"]["total_tokens"], 18);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(!v["choices"][0]["text"].as_str().unwrap().is_empty());

    let (status, body) = post(
        &c,
        &h,
        "/v1/chat/completions",
        r#"{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let events: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last().copied(), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let content: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("content"))
        .collect();
    assert_eq!(content.len(), 6, "role chunk + 5 tokens: {body}");
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 5);

    let (status, body) = post(
        &c,
        &h,
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user""#,
    )
    .await;
    assert_eq!(status, 400);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (status, _) = post(&c, &h, "/v1/completions", r#"{"model":"m"}"#).await;
    assert_eq!(status, 400, "missing prompt");

    let (status, body) = get(&c, &h, "/v1/models").await;
    assert_eq!(status, 200);
    assert!(body.contains("\"sim-model\""));
    assert_eq!(get(&c, &h, "/health").await.0, 200);

    let (status, text) = get(&c, &h, "/metrics").await;
    assert_eq!(status, 200);
    for name in METRIC_NAMES {
        assert!(text.lines().any(|l| l.starts_with(name)), "missing {name}");
    }
    assert!(
        text.contains("inference_pool_ready_pods{name=\"test-pool\"} 2.0"),
        "{text}"
    );
    assert!(
        text.contains("inference_pool=\"test-pool\",model_name=\"sim-model\",pod=\"test-pool-0\"")
    );
    assert!(text.contains("block_size=\"16\",num_gpu_blocks=\"8192\""));
    let generated: f64 = text
        .lines()
        .filter(|l| l.starts_with("vllm:generation_tokens_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(generated, 17.0);
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn refuses_with_openai_errors_when_admission_caps_trigger() {
    let mut cfg = SimConfig::default();
    cfg.gateway.queue_cap_429 = Some(0);
    let (h, c) = start(cfg).await;
    let (status, body) = post(
        &c,
        &h,
        "/v1/completions",
        r#"{"prompt":"x","max_tokens":3}"#,
    )
    .await;
    assert_eq!(status, 429, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["error"]["message"].is_string());

    let mut cfg = SimConfig {
        replicas: 1,
        ..SimConfig::default()
    };
    cfg.gateway.admission_cap_503 = Some(1);
    let (h2, c2) = start(cfg).await;
    let long = post(
        &c2,
        &h2,
        "/v1/completions",
        r#"{"prompt":"x","max_tokens":50}"#,
    );
    let second = async {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        post(
            &c2,
            &h2,
            "/v1/completions",
            r#"{"prompt":"y","max_tokens":3}"#,
        )
        .await
    };
    let ((s1, _), (s2, _)) = tokio::join!(long, second);
    assert_eq!((s1, s2), (200, 503));
    drop(h);
}

#[tokio::test]
async fn background_load_keeps_the_pool_busy() {
    let mut cfg = SimConfig::default();
    cfg.interactive.mode = LoadMode::Waves;
    cfg.time_scale = 20.0;
    let (h, c) = start(cfg).await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let (_, text) = get(&c, &h, "/metrics").await;
    let generated: f64 = text
        .lines()
        .filter(|l| l.starts_with("vllm:generation_tokens_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert!(
        generated > 1000.0,
        "10 simulated seconds of a wave: {generated}"
    );
    let (status, _) = post(
        &c,
        &h,
        "/v1/completions",
        r#"{"prompt":"hello","max_tokens":4}"#,
    )
    .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn metrics_blackout_answers_503() {
    let mut cfg = SimConfig::default();
    cfg.metrics.blackouts = vec![[0.0, 3600.0]];
    let (h, c) = start(cfg).await;
    assert_eq!(get(&c, &h, "/metrics").await.0, 503);
}
