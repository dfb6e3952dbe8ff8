//! Issue 26 item 7: the prefix-aware order (`serve.order = "model-prefix"`)
//! measured against the file's order on the simulator, whose replicas keep
//! a prefix cache (`docs/simulator.md`, "Prefix cache"). The workload: a
//! batch whose chat lines share 8 long system prompts (documents of 4 096
//! characters, about 1 000 tokens), shuffled, 8 output tokens each, on one
//! replica whose KV space holds about 6 of the documents (those of the 4
//! requests in flight among them).
//!
//! Two measurements, both printed (`cargo test --test batch_order --
//! --nocapture`; `docs/batch-api.md`, "Prefix-aware order"):
//!
//! - in virtual time: the engine alone, fed in each order by a closed loop
//!   of 4 in flight. Deterministic, so the hit-rate ordering is asserted;
//! - end to end: `serve` with the simulator as its gateway, one batch per
//!   order (picked by its metadata). Real time, so nothing about speed is
//!   asserted: only that each run answers every custom_id exactly once.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::support::serve::{Api, ServeSpec, start, terminal};
use crate::support::sim::metric_sum;
use serde_json::{Value, json};
use sluicegate::serve::order::{Key, plan};
use sluicegate::sim::config::EngineConfig;
use sluicegate::sim::engine::{Engine, EngineEvent, RequestClass, SimRequest};
use sluicegate::sim::{SimConfig, spawn_http};

/// Lines of the batch.
const LINES: usize = 240;
/// Distinct system prompts.
const DOCUMENTS: usize = 8;
/// Requests in flight (the serve window, the virtual closed loop).
const IN_FLIGHT: usize = 4;
/// Output tokens per line.
const MAX_TOKENS: u32 = 8;

/// One replica: 384 blocks of 16 tokens (6 144 tokens: about 6 of the 8
/// documents, those of the 4 requests in flight among them), no jitter,
/// prefix caching on (the default).
fn engine_config() -> EngineConfig {
    let mut c = EngineConfig {
        num_gpu_blocks: 384,
        max_model_len: 2048,
        ..EngineConfig::default()
    };
    c.step.jitter = 0.0;
    c
}

/// Document `d`: 4 096 characters that differ from the others' from the
/// first block on.
fn document(d: usize) -> String {
    let mut text = format!("Document {d}. ");
    let mut k = 0;
    while text.len() < 4096 {
        text.push_str(&format!(
            "Section {k} of report {d} lists the figures of the quarter. "
        ));
        k += 1;
    }
    text.truncate(4096);
    text
}

/// The batch's request bodies in file order: each document's lines
/// spread through the file by a fixed shuffle.
fn bodies() -> Vec<Value> {
    let documents: Vec<String> = (0..DOCUMENTS).map(document).collect();
    shuffled(LINES)
        .into_iter()
        .map(|slot| {
            json!({
                "model": "sim-model",
                "messages": [
                    {"role": "system", "content": documents[slot % DOCUMENTS]},
                    {"role": "user", "content": format!("Question {slot}: what changed since the last quarter?")},
                ],
                "max_tokens": MAX_TOKENS,
            })
        })
        .collect()
}

/// A fixed pseudo-random permutation of `0..n` (Fisher-Yates on
/// SplitMix64 from a constant seed): every run has the same file, and no
/// document comes back at a regular pace (a cyclic file order would be
/// the worst case of an LRU cache, not a typical one).
fn shuffled(n: usize) -> Vec<usize> {
    let mut state: u64 = 26;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// The input file of `bodies`.
fn input_file(bodies: &[Value]) -> String {
    bodies
        .iter()
        .enumerate()
        .map(|(i, body)| {
            format!(
                "{}\n",
                json!({"custom_id": format!("q-{i}"), "method": "POST", "url": "/v1/chat/completions", "body": body})
            )
        })
        .collect()
}

/// What the simulator's HTTP front makes of a chat body: 4 tokens per
/// message plus its characters at 4 per token, and its block identities.
fn sim_request(id: u64, body: &Value, at: f64) -> SimRequest {
    let messages = body["messages"].as_array().expect("messages");
    let prompt_tokens: u32 = messages
        .iter()
        .map(|m| {
            4 + m["content"]
                .as_str()
                .expect("text")
                .chars()
                .count()
                .div_ceil(4) as u32
        })
        .sum();
    let text = sluicegate::prompt::text(body);
    SimRequest {
        id,
        class: RequestClass::Batch,
        arrival: at,
        prompt_tokens,
        output_tokens: MAX_TOKENS,
        max_tokens: MAX_TOKENS,
        priority: 0,
        stream: false,
        prefix: sluicegate::prompt::blocks("sim-model", &text, 64, 128).into(),
    }
}

/// Figures of one run.
#[derive(Debug, Clone, Copy)]
struct Figures {
    /// Prefix-cache hits / queries, tokens.
    hit_rate: f64,
    /// Lines per second.
    lines_per_s: f64,
    /// Requests preempted for KV space.
    preemptions: u64,
}

/// The engine alone, fed `bodies` in `order` by a closed loop of
/// [`IN_FLIGHT`]: each finished line is replaced by the next at once.
fn virtual_run(bodies: &[Value], order: &[usize]) -> Figures {
    let mut engine = Engine::new(engine_config(), 0, 1);
    let mut queue = order.iter().copied();
    let (mut now, mut done, mut events) = (0.0, 0usize, Vec::new());
    let mut feed = |engine: &mut Engine, now: f64| {
        if let Some(i) = queue.next() {
            engine.add_request(sim_request(i as u64, &bodies[i], now));
        }
    };
    for _ in 0..IN_FLIGHT {
        feed(&mut engine, now);
    }
    while done < order.len() {
        now = engine.start_step(now).expect("work left");
        engine.finish_step(&mut events);
        for event in events.drain(..) {
            if let EngineEvent::Finished(record) = event {
                assert_eq!(record.output_tokens, MAX_TOKENS);
                done += 1;
                feed(&mut engine, now);
            }
        }
    }
    let g = engine.gauges();
    Figures {
        hit_rate: g.prefix_cache_hits_total as f64 / g.prefix_cache_queries_total as f64,
        lines_per_s: order.len() as f64 / now,
        preemptions: g.preemptions_total,
    }
}

/// The model-prefix order of `bodies`, as `serve` plans it.
fn prefix_order(bodies: &[Value]) -> Vec<usize> {
    let keys: Vec<Key> = bodies.iter().map(Key::of).collect();
    plan(&keys).into_iter().map(|i| i as usize).collect()
}

/// Prints the figures of the arrival and the model-prefix run.
fn show(title: &str, clock: &str, [arrival, prefix]: [Figures; 2]) {
    eprintln!("{title}, one replica of 384 KV blocks:");
    for (name, f) in [("arrival", arrival), ("model-prefix", prefix)] {
        eprintln!(
            "  {name:>12}: prefix-cache hit rate {:.3}, {:.1} lines/s ({clock}), {} preemptions",
            f.hit_rate, f.lines_per_s, f.preemptions
        );
    }
}

#[test]
fn the_prefix_order_raises_the_prefix_cache_hit_rate_in_virtual_time() {
    let bodies = bodies();
    let arrival = virtual_run(&bodies, &(0..LINES).collect::<Vec<_>>());
    let prefix = virtual_run(&bodies, &prefix_order(&bodies));
    show(
        &format!(
            "virtual time, {LINES} lines, {DOCUMENTS} documents shuffled, {IN_FLIGHT} in flight"
        ),
        "simulated",
        [arrival, prefix],
    );
    // Deterministic (no jitter, no clock): the ordering of the two runs is
    // a property of the orders, not of a machine.
    assert!(
        prefix.hit_rate > arrival.hit_rate + 0.2,
        "{prefix:?} against {arrival:?}"
    );
    assert!(prefix.hit_rate > 0.9, "{prefix:?}");
}

/// One batch in `order` through `serve` on a fresh simulator: its
/// figures, after checking every custom_id is answered exactly once.
async fn served_run(file: &str, order: &str) -> Figures {
    let mut config = SimConfig {
        pool_name: "p".into(),
        replicas: 1,
        time_scale: 1.0,
        engine: engine_config(),
        ..SimConfig::default()
    };
    config.http.max_output_tokens = MAX_TOKENS;
    let sim = spawn_http(config).await.expect("simulator starts");
    let mut spec = ServeSpec::new(&sim.base_url());
    spec.max_sys = IN_FLIGHT as u32;
    let served = start(&spec, None).await;
    let api = Api::new(&served.base, None);
    let began = Instant::now();
    let metadata = json!({"sluicegate_order": order});
    let batch = api
        .batch_with(file, "/v1/chat/completions", "24h", &metadata)
        .await;
    let id = batch["id"].as_str().expect("id");
    let done = api.wait_for(id, Duration::from_secs(300), terminal).await;
    let took = began.elapsed().as_secs_f64();
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(
        done["request_counts"],
        json!({"total": LINES, "completed": LINES, "failed": 0})
    );
    let out = done["output_file_id"].as_str().expect("output file");
    let (status, text) = api.text(&format!("/v1/files/{out}/content")).await;
    assert_eq!(status, 200);
    let mut answers = BTreeMap::<String, usize>::new();
    for line in text.lines() {
        let line: Value = serde_json::from_str(line).expect("output line");
        assert_eq!(line["response"]["status_code"], 200, "{line}");
        let custom_id = line["custom_id"].as_str().expect("custom_id").to_owned();
        *answers.entry(custom_id).or_default() += 1;
    }
    assert_eq!(answers.len(), LINES, "every custom_id answered");
    assert!(answers.values().all(|n| *n == 1), "each exactly once");
    let (client, base) = (reqwest::Client::new(), sim.base_url());
    let queries = metric_sum(&client, &base, &["vllm:prefix_cache_queries_total"]).await;
    let hits = metric_sum(&client, &base, &["vllm:prefix_cache_hits_total"]).await;
    let preemptions = metric_sum(&client, &base, &["vllm:num_preemptions_total"]).await;
    served.stop().await;
    sim.shutdown().await.expect("simulator stops");
    Figures {
        hit_rate: hits / queries,
        lines_per_s: LINES as f64 / took,
        preemptions: preemptions as u64,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrival_and_model_prefix_batches_through_serve_on_the_simulator() {
    let file = input_file(&bodies());
    let arrival = served_run(&file, "arrival").await;
    let prefix = served_run(&file, "model-prefix").await;
    show(
        &format!(
            "serve + simulator (real time), {LINES} lines, {DOCUMENTS} documents shuffled, window {IN_FLIGHT}"
        ),
        "wall, creation to completed",
        [arrival, prefix],
    );
}
