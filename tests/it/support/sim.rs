//! The pool simulator as a test fixture: a small pool that queues quickly,
//! and a load generator that floods it.

use serde_json::json;
use sluicegate::sim::{SimConfig, SimHandle, spawn_http};

/// A small, fast pool that queues quickly: 2 replicas of 2 sequences.
pub async fn small_pool() -> SimHandle {
    let mut cfg = SimConfig {
        pool_name: "p".into(),
        time_scale: 4.0,
        ..SimConfig::default()
    };
    cfg.engine.max_num_seqs = 2;
    spawn_http(cfg).await.expect("simulator starts")
}

/// Sends `n` completion requests of `max_tokens` at once; the handles end
/// when the answers arrive.
pub async fn flood(sim: &SimHandle, n: usize, max_tokens: u32) -> Vec<tokio::task::JoinHandle<()>> {
    let client = reqwest::Client::new();
    (0..n)
        .map(|_| {
            let c = client.clone();
            let url = format!("{}/v1/completions", sim.base_url());
            tokio::spawn(async move {
                let _ = c
                    .post(url)
                    .header("content-type", "application/json")
                    .body(
                        json!({"model": "m", "prompt": "hello", "max_tokens": max_tokens})
                            .to_string(),
                    )
                    .send()
                    .await;
            })
        })
        .collect()
}

/// Requests running or waiting at the pool, summed over its replicas, from
/// its own `/metrics` (the truth a gate must respect).
pub async fn pool_in_flight(client: &reqwest::Client, sim: &SimHandle) -> f64 {
    let names = ["vllm:num_requests_running", "vllm:num_requests_waiting"];
    metric_sum(client, &sim.base_url(), &names).await
}

/// Every series of the metrics `names` on the simulator at `base`, summed
/// (over replicas and labels).
pub async fn metric_sum(client: &reqwest::Client, base: &str, names: &[&str]) -> f64 {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("simulator metrics")
        .text()
        .await
        .expect("simulator metrics body");
    let named = |line: &str| {
        names.iter().any(|n| {
            line.strip_prefix(n)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
    };
    text.lines()
        .filter(|l| named(l))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests the simulator aborted so far because their client went away
/// (`/sim/state`'s `aborted`).
pub async fn aborted(client: &reqwest::Client, sim: &SimHandle) -> u64 {
    let state: serde_json::Value = client
        .get(format!("{}/sim/state", sim.base_url()))
        .send()
        .await
        .expect("simulator state")
        .json()
        .await
        .expect("simulator state body");
    state["aborted"].as_u64().expect("`aborted` in /sim/state")
}
