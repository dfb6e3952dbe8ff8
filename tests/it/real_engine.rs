//! A real vLLM instead of our simulator (issue 38): the CPU build of vLLM
//! serving a tiny random-weight Llama (`scripts/vllm.sh`,
//! `support::vllm`), `max_num_seqs` 32 and a 2 048-token context. Each
//! test starts one engine (23–30 s, more on a busy machine) and checks
//! everything it can on it; the nextest group `real-engine` runs them one
//! at a time. What each test proves, and how long it takes:
//! docs/real-engine.md.
//!
//! Load is sent straight to the engine: 48 completions at once, more than
//! its 32 sequences, so 16 wait; aborting the requests (dropping their
//! connections) makes vLLM abort them, so the load ends when a test is done
//! with it. Counts of what reached the engine come from the engine's own
//! `/metrics`, read as text here (not by our parser, which is under test).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluicegate::config::{EndpointUrl, GateSpec, PrometheusConfig};
use sluicegate::gate::{FailClosed, GateContext, Observation, build_gate};
use sluicegate::queue::embedded::EmbeddedQueue;

use crate::support::TempDir;
use crate::support::cli::{BIN, Background, sluicegate, text};
use crate::support::prometheus::{Prometheus, PrometheusSpec, RecordingRule};
use crate::support::redis::RedisServer;
use crate::support::serve::{self, ServeSpec};
use crate::support::vllm::{MAX_MODEL_LEN, MODEL, Vllm};

const STALENESS: Duration = Duration::from_secs(4);
/// The engine's `--max-num-seqs`.
const MAX_NUM_SEQS: u32 = 32;
/// Requests of the load: more than the engine runs at once.
const LOAD: usize = 48;
/// Tokens each request of the load generates (`ignore_eos`): about a
/// minute of decoding, longer than the checks under load take.
const LOAD_TOKENS: u32 = 1_900;

/// Prints how long the test has run at `what` (the phases' durations in
/// docs/real-engine.md come from these lines).
fn step(t0: Instant, what: &str) {
    eprintln!("[{:6.1} s] {what}", t0.elapsed().as_secs_f64());
}

/// Starts an engine off the async workers (the start blocks for 23–30 s, more on a busy machine).
async fn start_engine(port: Option<u16>) -> Vllm {
    tokio::task::spawn_blocking(move || Vllm::start_on(port))
        .await
        .expect("engine start task")
}

/// The sum of the series of `name` on the engine's page whose labels
/// include every pair of `labels`.
async fn engine_metric(base: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let page = reqwest::Client::new()
        .get(format!("{base}/metrics"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("engine metrics")
        .text()
        .await
        .expect("engine metrics body");
    page.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests running and waiting at the engine.
async fn running_waiting(base: &str) -> (f64, f64) {
    (
        engine_metric(base, "vllm:num_requests_running", &[]).await,
        engine_metric(base, "vllm:num_requests_waiting", &[]).await,
    )
}

/// Answers of the engine's API server to `POST <handler>` with a status
/// of class `class` (`2xx`, `4xx`): every request that reached it, the ones
/// its engine never ran (a prompt over the context) included.
async fn answered(base: &str, handler: &str, class: &str) -> f64 {
    let labels = [("handler", handler), ("status", class)];
    engine_metric(base, "http_requests_total", &labels).await
}

/// Polls the engine until `done(running, waiting)` holds (bounded).
async fn wait_for_engine(base: &str, what: &str, done: impl Fn(f64, f64) -> bool) {
    let give_up = Instant::now() + Duration::from_secs(120);
    loop {
        let (running, waiting) = running_waiting(base).await;
        if done(running, waiting) {
            return;
        }
        assert!(
            Instant::now() < give_up,
            "engine never reached: {what} (running {running}, waiting {waiting})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `n` completions of `max_tokens` each sent at once, straight to the
/// engine; aborting the handles drops the connections and vLLM aborts the
/// requests.
fn load(base: &str, n: usize, max_tokens: u32) -> Vec<tokio::task::JoinHandle<()>> {
    let client = reqwest::Client::new();
    (0..n)
        .map(|i| {
            let (client, url) = (client.clone(), format!("{base}/v1/completions"));
            tokio::spawn(async move {
                let body = json!({"model": MODEL, "prompt": format!("Load {i}: tell a long story."),
                                  "max_tokens": max_tokens, "ignore_eos": true});
                let _ = client
                    .post(url)
                    .json(&body)
                    .timeout(Duration::from_secs(600))
                    .send()
                    .await;
            })
        })
        .collect()
}

fn prometheus_context(prom: &Prometheus) -> GateContext {
    let cfg = PrometheusConfig {
        url: EndpointUrl::new(prom.url().parse().unwrap()),
        bearer_token: None,
        bearer_token_file: None,
        basic_user: None,
        basic_password: None,
        basic_password_file: None,
    };
    GateContext::new(Some(cfg), None, Duration::from_millis(100), STALENESS)
}

fn gate(kind: &str, params: Value, ctx: &GateContext) -> FailClosed {
    let spec = GateSpec::parse(kind, &params, "test").unwrap();
    FailClosed::new(build_gate(&spec, ctx).unwrap(), STALENESS)
}

/// Polls `gate` until `pred` holds (at most 60 s); the last reading.
async fn until(gate: &FailClosed, pred: impl Fn(&Observation) -> bool) -> Observation {
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        let o = gate.observe().await;
        if pred(&o) || Instant::now() > give_up {
            return o;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `sluicegate gate probe` for `kind` with `params`, configured by the
/// environment alone: exit code and standard output.
fn probe(kind: &str, params: &Value, prometheus: Option<&str>, json: bool) -> (i32, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["gate", "probe"])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("SLUICEGATE_GATE_TYPE", kind)
        .env("SLUICEGATE_GATE_PARAMS", params.to_string());
    if json {
        cmd.arg("--json");
    }
    if let Some(url) = prometheus {
        cmd.env("SLUICEGATE_PROMETHEUS_URL", url);
    }
    let out = cmd.output().expect("sluicegate runs");
    let stdout = text(&out.stdout);
    eprintln!("probe {kind}:\n{stdout}{}", text(&out.stderr));
    (out.status.code().unwrap_or(-1), stdout)
}

/// The gates that read vLLM pages, on the real page: open on the idle
/// engine with the values the page holds, and each budget falls (to 0
/// where its rule says so) while 48 requests load an engine of 32
/// sequences; `gate probe` names the page's series and values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gates_read_the_real_page_and_every_budget_falls_when_requests_wait() {
    let t0 = Instant::now();
    let engine = start_engine(None).await;
    step(t0, "engine up");
    let base = engine.base_url();
    let page = format!("{base}/metrics");
    // A real Prometheus scraping the engine every second. No endpoint
    // picker here: the pool label comes with the target (as service
    // discovery adds it) and the ready-endpoint count is a recording rule
    // over the scrape's `up`.
    let prom = Prometheus::start_labelled(
        &PrometheusSpec {
            targets: vec![format!("127.0.0.1:{}", engine.port())],
            drop_metrics: Vec::new(),
        },
        &[("inference_pool", "tiny")],
        &[RecordingRule {
            record: "llm_d_epp_ready_endpoints".into(),
            expr: "count(up{job=\"pool\"} == 1)".into(),
            labels: vec![("name".into(), "tiny".into())],
        }],
    )
    .await;
    prom.wait_for_sample(
        "vllm:num_requests_running{inference_pool=\"tiny\"}",
        Duration::from_secs(30),
    )
    .await;
    prom.wait_for_sample(
        "llm_d_epp_ready_endpoints{name=\"tiny\"}",
        Duration::from_secs(30),
    )
    .await;

    step(t0, "prometheus has the engine's samples");
    let ctx = prometheus_context(&prom);
    let vllm_params = json!({"urls": [page.clone()], "max_num_seqs": MAX_NUM_SEQS});
    let vllm = gate("vllm", vllm_params.clone(), &ctx);
    // vLLM 0.32 exports no max_num_seqs (not in vllm:cache_config_info):
    // unconfigured, the gate assumes vLLM's default of 256.
    let vllm_default = gate("vllm", json!({"urls": [page.clone()]}), &ctx);
    let feedback = gate(
        "feedback",
        json!({"urls": [page.clone()], "jitter": 0}),
        &ctx,
    );
    let headroom = gate("slo-headroom", json!({"urls": [page.clone()]}), &ctx);
    let scrape = gate(
        "endpoint-scrape",
        json!({"url": page.clone(), "metric": "vllm:num_requests_running",
               "labels": {"model_name": MODEL}, "max_count_per_pod": MAX_NUM_SEQS,
               "sees_own_load": true}),
        &ctx,
    );
    let query = gate(
        "prometheus-query",
        json!({"query": format!(
            "clamp_min(1 - sum(vllm:num_requests_running{{job=\"pool\"}}) / {MAX_NUM_SEQS}, 0)"
        )}),
        &ctx,
    );
    let budget_params = json!({"pool": "tiny", "max_concurrency": MAX_NUM_SEQS});
    let budget = gate("prometheus-budget", budget_params.clone(), &ctx);

    // Idle.
    let o = vllm.observe().await;
    assert!(o.source_available && o.sees_own_load, "{o:?}");
    assert_eq!(o.budget.get(), 1.0, "{}", o.reason);
    assert_eq!(o.max_sys, Some(f64::from(MAX_NUM_SEQS)));
    let o = vllm_default.observe().await;
    assert_eq!((o.budget.get(), o.max_sys), (1.0, Some(256.0)), "{o:?}");
    let feedback_idle = feedback.observe().await;
    assert!(feedback_idle.source_available, "{}", feedback_idle.reason);
    // max_sys 100 (the context's default): the initial window of 5 %.
    assert!(
        (feedback_idle.budget.get() - 0.05).abs() < 1e-9,
        "{feedback_idle:?}"
    );
    let o = headroom.observe().await;
    assert!(o.source_available, "{}", o.reason);
    assert!(
        (o.budget.get() - 0.01).abs() < 1e-9,
        "initial: {}",
        o.reason
    );
    let o = scrape.observe().await;
    assert!(o.source_available, "{}", o.reason);
    assert_eq!(o.budget.get(), 1.0, "{}", o.reason);
    assert_eq!(o.max_sys, Some(f64::from(MAX_NUM_SEQS)));
    let o = until(&query, |o| o.source_available).await;
    assert_eq!(o.budget.get(), 1.0, "{o:?}");
    let o = until(&budget, |o| o.source_available).await;
    assert_eq!(o.budget.get(), 1.0, "{o:?}");
    assert_eq!(o.max_sys, Some(f64::from(MAX_NUM_SEQS)), "1 ready × 32");
    assert!(o.sees_own_load && o.counts_own_requests, "{o:?}");

    // gate probe explains the real page: its URL, the engine's series
    // (labels as the page writes them) and the values it read.
    let (code, out) = probe("vllm", &vllm_params, None, true);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(
        (v["d"].as_f64(), v["open"].as_bool()),
        (Some(1.0), Some(true)),
        "{v}"
    );
    assert_eq!(v["max_sys"], 32.0);
    assert_eq!(v["sources"][0]["role"], "engine metrics");
    assert_eq!(v["sources"][0]["target"], page);
    assert_eq!(
        v["sources"][0]["values"][0]["labels"],
        format!("{{engine=\"0\",model_name=\"{MODEL}\"}}")
    );
    let outcome = v["sources"][0]["outcome"].as_str().unwrap();
    for needle in [
        "kv 0.000/0.9",
        "running 0/32 (config)",
        "waiting 0/5",
        "KV capacity 131072 tokens",
    ] {
        assert!(
            outcome.contains(needle),
            "{needle:?} missing from {outcome}"
        );
    }
    let (code, out) = probe(
        "prometheus-budget",
        &budget_params,
        Some(&prom.url()),
        false,
    );
    assert_eq!(code, 0);
    for needle in [
        "max(llm_d_epp_ready_endpoints{name=\"tiny\"})",
        "running requests (vLLM)",
        "sum(vllm:num_requests_running{inference_pool=\"tiny\"})",
        "D (budget):       1.0000",
        "max_SYS:          32 requests (live from the gate)",
        "OPEN",
    ] {
        assert!(out.contains(needle), "{needle:?} missing from:\n{out}");
    }

    step(t0, "idle readings and probes checked");
    // Load: 32 run, 16 wait.
    let requests = load(&base, LOAD, LOAD_TOKENS);
    wait_for_engine(&base, "32 running and 16 waiting", |r, w| {
        r == 32.0 && w == 16.0
    })
    .await;
    step(t0, "loaded: 32 running, 16 waiting");

    let o = until(&vllm, |o| o.budget.get() == 0.0).await;
    assert!(o.source_available && o.budget.get() == 0.0, "{o:?}");
    // Unconfigured (running 32 of an assumed 256), the waiting requests
    // still close it.
    let o = until(&vllm_default, |o| o.budget.get() == 0.0).await;
    assert!(o.source_available && o.budget.get() == 0.0, "{o:?}");
    let o = until(&scrape, |o| o.budget.get() == 0.0).await;
    assert!(o.source_available && o.budget.get() == 0.0, "{o:?}");
    let o = until(&headroom, |o| o.budget.get() == 0.0).await;
    assert!(o.source_available && o.budget.get() == 0.0, "{o:?}");
    assert!(
        o.reason.contains("waiting") || o.reason.contains("TTFT"),
        "{}",
        o.reason
    );
    // feedback halves its window once per fresh reading while requests
    // wait: below one request of its max_sys 100.
    let o = until(&feedback, |o| o.budget.get() < 0.01).await;
    assert!(o.source_available && o.budget.get() < 0.01, "{o:?}");
    assert!(o.budget.get() < feedback_idle.budget.get());
    assert!(o.reason.contains("cut"), "{}", o.reason);
    let o = until(&query, |o| o.budget.get() == 0.0).await;
    assert!(o.source_available && o.budget.get() == 0.0, "{o:?}");
    let o = until(&budget, |o| o.budget.get() == 0.0).await;
    assert!(o.source_available && o.budget.get() == 0.0, "{o:?}");

    let (code, out) = probe("vllm", &vllm_params, None, false);
    assert_eq!(code, 0);
    let url_line = format!("query/url: {page}");
    for needle in [
        url_line.as_str(),
        "running 32/32 (config)",
        "waiting 16/5",
        "D (budget):       0.0000",
        "CLOSED",
    ] {
        assert!(out.contains(needle), "{needle:?} missing from:\n{out}");
    }
    let (code, out) = probe("prometheus-budget", &budget_params, Some(&prom.url()), true);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(
        (v["d"].as_f64(), v["open"].as_bool()),
        (Some(0.0), Some(false)),
        "{v}"
    );
    assert_eq!(v["source_available"], true);

    step(t0, "every gate closed or cut under load");
    // The load aborted, the engine idle again: the pool readings reopen.
    for r in requests {
        r.abort();
    }
    wait_for_engine(&base, "idle after the load", |r, w| r == 0.0 && w == 0.0).await;
    for (name, g) in [
        ("vllm", &vllm),
        ("endpoint-scrape", &scrape),
        ("prometheus-query", &query),
        ("prometheus-budget", &budget),
    ] {
        let o = until(g, |o| o.budget.get() == 1.0).await;
        assert!(o.source_available && o.budget.get() == 1.0, "{name}: {o:?}");
    }
    step(t0, "reopened after the load");

    // `eval --live` on the same engine, as small as it runs: a baseline and
    // one contender, each 10 s of interactive traffic timed at the client.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluicegate"))
        .args([
            "eval",
            "--live",
            &base,
            "--duration",
            "10s",
            "--warmup",
            "0s",
        ])
        .args([
            "--repeats",
            "1",
            "--rate",
            "2",
            "--gate",
            "static-cap-1",
            "--json",
        ])
        .output()
        .expect("sluicegate runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let runs = report["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2, "{report}");
    for run in runs {
        let name = &run["contender"];
        assert!(
            run["interactive"]["requests"].as_u64() > Some(0),
            "{name}: {run}"
        );
        // Interactive requests completed and were timed (a p50 TTFT under
        // the 60 s a failed request counts as).
        assert!(
            run["interactive"]["ttft_p50_s"].as_f64() < Some(60.0),
            "{name}: {run}"
        );
    }
    assert_eq!(runs[1]["contender"], "static-cap-1");
    // The cap of one sent batch work through the engine; the baseline none.
    assert!(
        runs[1]["batch_tokens_per_s"].as_f64() > Some(0.0),
        "{report}"
    );
    assert!(
        runs[0]["batch_tokens_per_s"].as_f64() < runs[1]["batch_tokens_per_s"].as_f64(),
        "{report}"
    );
    let score = &report["contenders"][0]["scores"][0];
    assert!(
        score["delta_v_pp"].is_number() && score["rho_ttft"].is_number(),
        "{report}"
    );
    step(t0, "eval --live scored a contender against its baseline");

    // `sim sweep --live` as small as the fit allows: three prompt lengths at
    // concurrency 1, two concurrencies, a few seconds each; then the same
    // fit and table again from the saved sweep, without the engine.
    let tmp = TempDir::new("real-engine-sweep");
    let (saved, profile) = (tmp.0.join("sweep.json"), tmp.0.join("profile.toml"));
    let sweep = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_sluicegate"))
            .args(["sim", "sweep", "--duration", "60"])
            .args(extra)
            .output()
            .expect("sluicegate runs")
    };
    let out = sweep(&[
        "--live",
        &base,
        "--concurrency",
        "1,2",
        "--prompt-words",
        "100",
        "--long-prompt-words",
        "400",
        "--point-duration",
        "4s",
        "--point-warmup",
        "1s",
        "--save",
        saved.to_str().expect("utf-8"),
        "--profile",
        profile.to_str().expect("utf-8"),
    ]);
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{table}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let measured: Value =
        serde_json::from_str(&std::fs::read_to_string(&saved).expect("saved")).expect("JSON");
    // The KV shape is the engine's own (1 GiB of 128-token blocks).
    assert_eq!(measured["kv"]["block_size"], 128, "{measured}");
    let points = measured["points"].as_array().expect("points");
    let shape: Vec<(u64, u64)> = points
        .iter()
        .map(|p| {
            (
                p["concurrency"].as_u64().unwrap(),
                p["prompt_words"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(shape, [(1, 100), (2, 100), (1, 250), (1, 400), (8, 400)]);
    for p in points {
        assert!(p["requests"].as_u64() > Some(0), "{p}");
        assert!(p["itl_mean_s"].as_f64() > Some(0.0), "{p}");
    }
    // Longer prompts: more tokens as the engine counted them, later first
    // tokens at concurrency 1.
    let at = |i: usize, key: &str| points[i][key].as_f64().expect("number");
    assert!(
        at(0, "prompt_tokens") < at(2, "prompt_tokens")
            && at(2, "prompt_tokens") < at(3, "prompt_tokens")
    );
    assert!(at(0, "ttft_p50_s") < at(3, "ttft_p50_s"), "{measured}");
    // The profile is a simulator configuration with the fitted steps.
    let cfg: toml::Value =
        toml::from_str(&std::fs::read_to_string(&profile).expect("profile")).expect("TOML");
    let fitted = &cfg["engine"]["step"];
    assert!(fitted["c0_ms"].as_float() > Some(0.0), "{cfg}");
    assert!(
        fitted["c1_ms_per_prefill_token"].as_float() > Some(0.0),
        "{cfg}"
    );
    assert_eq!(cfg["replicas"].as_integer(), Some(1));
    let again = sweep(&["--against", saved.to_str().expect("utf-8")]);
    assert!(again.status.success());
    assert_eq!(
        String::from_utf8_lossy(&again.stdout),
        table,
        "the fit is deterministic"
    );
    step(t0, "sim sweep --live measured, fitted and compared");
}

/// An OpenAI batch line to the engine: a completion (`chat` false) or a
/// chat completion of `max_tokens` (`ignore_eos`, so exactly that many).
fn openai_line(custom_id: &str, chat: bool, max_tokens: u32) -> String {
    let (url, body) = if chat {
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": max_tokens, "ignore_eos": true, "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": format!("Question {custom_id}?")}]}),
        )
    } else {
        (
            "/v1/completions",
            json!({"model": MODEL, "max_tokens": max_tokens, "ignore_eos": true,
                   "prompt": format!("Story {custom_id}:")}),
        )
    };
    json!({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).to_string()
}

/// A completion whose prompt is longer than the engine's context: each
/// word is at least one token, so `MAX_MODEL_LEN` words and the BOS token
/// are over it, and the engine answers 400.
fn too_long_line(custom_id: &str) -> String {
    let body = json!({"model": MODEL, "max_tokens": 4, "prompt": "hello ".repeat(MAX_MODEL_LEN)});
    json!({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})
        .to_string()
}

/// What the engine's API server has answered so far, by endpoint and
/// status class.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Answered {
    completions_2xx: f64,
    completions_4xx: f64,
    chat_2xx: f64,
    chat_4xx: f64,
}

impl Answered {
    async fn read(base: &str) -> Self {
        let (completions, chat) = ("/v1/completions", "/v1/chat/completions");
        Self {
            completions_2xx: answered(base, completions, "2xx").await,
            completions_4xx: answered(base, completions, "4xx").await,
            chat_2xx: answered(base, chat, "2xx").await,
            chat_4xx: answered(base, chat, "4xx").await,
        }
    }

    fn since(self, before: Self) -> Self {
        Self {
            completions_2xx: self.completions_2xx - before.completions_2xx,
            completions_4xx: self.completions_4xx - before.completions_4xx,
            chat_2xx: self.chat_2xx - before.chat_2xx,
            chat_4xx: self.chat_4xx - before.chat_4xx,
        }
    }
}

/// A successful body for the line `custom_id` (`chat-*` or `cmpl-*`):
/// the engine's model, the right object, `max_tokens` tokens.
fn assert_answer(custom_id: &str, body: &Value, max_tokens: u32) {
    assert_eq!(body["model"], MODEL, "{custom_id}: {body}");
    assert_eq!(
        body["usage"]["completion_tokens"], max_tokens,
        "{custom_id}: {body}"
    );
    if custom_id.starts_with("chat") {
        assert_eq!(body["object"], "chat.completion", "{custom_id}: {body}");
        assert_eq!(body["choices"][0]["message"]["role"], "assistant", "{body}");
        assert!(
            body["choices"][0]["message"]["content"].is_string(),
            "{body}"
        );
    } else {
        assert_eq!(body["object"], "text_completion", "{custom_id}: {body}");
        assert!(body["choices"][0]["text"].is_string(), "{body}");
    }
}

/// The engine's 400 for a prompt over its context, as the engine wrote it.
fn assert_too_long(body: &Value) {
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("maximum context length is 2048 tokens"),
        "{body}"
    );
}

/// `sluicegate run` on Redis, configured by the environment alone, its
/// gate and dispatch timings from `env`; stderr to `log`.
fn run_on_redis(
    redis_url: &str,
    queue: &str,
    gateway: &str,
    env: &[(&str, String)],
    log: &Path,
) -> Background {
    let mut cmd = Command::new(BIN);
    cmd.arg("run")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("SLUICEGATE_TRANSPORT", "redis")
        .env("SLUICEGATE_REDIS_URL", redis_url)
        .env("SLUICEGATE_QUEUE", queue)
        .env("SLUICEGATE_GATEWAY_URL", gateway)
        .env("SLUICEGATE_QUEUE_MAX_SYS", "8")
        .env("SLUICEGATE_LISTEN", "127.0.0.1:0")
        .env("SLUICEGATE_DISPATCH_POLL_INTERVAL", "100ms")
        .env("SLUICEGATE_DISPATCH_RECEIVE_WAIT", "100ms")
        .env("SLUICEGATE_DISPATCH_RETRY_INITIAL_BACKOFF", "100ms")
        .env("SLUICEGATE_DISPATCH_SHUTDOWN_GRACE", "10s")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"));
    Background(cmd.spawn().expect("sluicegate run starts"))
}

/// SIGTERM (by PID) and the drain's end, bounded.
async fn sigterm_and_wait(mut run: Background) {
    let status = Command::new("kill")
        .args(["-TERM", &run.0.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = run.0.try_wait().expect("wait") {
            assert!(status.success(), "run exited with {status}");
            return;
        }
        assert!(Instant::now() < give_up, "run did not drain within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `sluicegate submit` of `file` into `queue` on Redis.
fn submit(redis_url: &str, queue: &str, file: &Path) {
    let out = sluicegate(&[
        "submit",
        "--redis-url",
        redis_url,
        "--queue",
        queue,
        "--deadline",
        "1h",
    ])
    .arg(file)
    .output()
    .expect("submit runs");
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// `sluicegate batch` of `input` into `gateway` (no progress display).
fn batch(
    input: &Path,
    output: &Path,
    gateway: &str,
    gate: &str,
    params: &Value,
    max_attempts: u32,
) -> Command {
    let mut cmd = sluicegate(&["batch", "--quiet", "--max-in-flight", "8"]);
    cmd.arg("--input")
        .arg(input)
        .arg("--output")
        .arg(output)
        .args(["--gateway-url", gateway, "--gate", gate])
        .args(["--gate-params", &params.to_string()])
        .args(["--max-attempts", &max_attempts.to_string()]);
    cmd
}

/// Every result record in Redis' `result-list`.
fn result_list(redis: &RedisServer) -> Vec<Value> {
    redis
        .cli(&["LRANGE", "result-list", "0", "-1"])
        .lines()
        // An empty list prints one blank line.
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("result JSON"))
        .collect()
}

fn read_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect()
}

/// Completions and chat completions end to end through the engine by
/// `run` on Redis (behind the `vllm` gate), `sluicegate batch` (behind
/// `feedback`) and `serve` driven by the official openai Python client;
/// and in each, a prompt over the engine's context gets the engine's 400
/// as its result, sent once (the engine's own request counters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_batch_and_serve_complete_chat_and_completions_and_a_400_is_sent_once() {
    const TOKENS: u32 = 8;
    let t0 = Instant::now();
    let engine = start_engine(None).await;
    step(t0, "engine up");
    let base = engine.base_url();
    let page = format!("{base}/metrics");
    let tmp = TempDir::new("real-engine-e2e");
    let dir = &tmp.0;
    let input = dir.join("in.jsonl");
    let ids = ["cmpl-0", "cmpl-1", "chat-0", "chat-1"];
    let mut lines: Vec<String> = ids
        .iter()
        .map(|id| openai_line(id, id.starts_with("chat"), TOKENS))
        .collect();
    lines.push(too_long_line("too-long"));
    std::fs::write(&input, lines.join("\n")).expect("input");
    // What one pass of the five lines must reach the engine as: each line
    // once, the too-long one answered 400 without reaching the model.
    let once = Answered {
        completions_2xx: 2.0,
        completions_4xx: 1.0,
        chat_2xx: 2.0,
        chat_4xx: 0.0,
    };

    // run on Redis, behind the vllm gate reading the engine's page. At
    // most 3 attempts, so a retried 400 would end (with attempts > 1)
    // instead of retrying until its deadline.
    let redis = RedisServer::start();
    let before = Answered::read(&base).await;
    submit(&redis.url(), "real", &input);
    let gate_env = [
        ("SLUICEGATE_GATE_TYPE", "vllm".to_owned()),
        (
            "SLUICEGATE_GATE_PARAMS",
            json!({"urls": [page.clone()], "max_num_seqs": MAX_NUM_SEQS}).to_string(),
        ),
        ("SLUICEGATE_DISPATCH_MAX_ATTEMPTS", "3".to_owned()),
    ];
    let run = run_on_redis(&redis.url(), "real", &base, &gate_env, &dir.join("run.log"));
    redis
        .wait_for_len_within("result-list", 5, Duration::from_secs(120))
        .await;
    sigterm_and_wait(run).await;
    let records = result_list(&redis);
    step(t0, "run on Redis answered and drained");
    assert_eq!(
        Answered::read(&base).await.since(before),
        once,
        "run on Redis"
    );
    let mut seen = BTreeMap::new();
    for r in &records {
        let id = r["id"].as_str().expect("id").to_owned();
        let body: Value =
            serde_json::from_str(r["payload"].as_str().expect("payload")).expect("body");
        if id == "too-long" {
            // The engine's answer is the result: its status and body, no
            // error code of ours, one attempt.
            assert_eq!(r["status_code"], 400, "{r}");
            assert!(r.get("error_code").is_none(), "{r}");
            assert_eq!(r["attempts"], 1, "{r}");
            assert_too_long(&body);
        } else {
            assert_eq!(r["status_code"], 200, "{r}");
            assert_eq!(r["attempts"], 1, "{r}");
            assert_answer(&id, &body, TOKENS);
        }
        *seen.entry(id).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 5, "{seen:?}");
    assert!(seen.values().all(|n| *n == 1), "{seen:?}");
    // The producer's reader turns them into OpenAI output lines.
    let collected = dir.join("run-results.jsonl");
    let out = sluicegate(&[
        "results",
        "--redis-url",
        &redis.url(),
        "--list",
        "result-list",
    ])
    .args([
        "--expect",
        "5",
        "--timeout",
        "30s",
        "--format",
        "openai",
        "--output",
    ])
    .arg(&collected)
    .output()
    .expect("results runs");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let openai = read_lines(&collected);
    assert_eq!(openai.len(), 5);
    let too_long = openai
        .iter()
        .find(|l| l["custom_id"] == "too-long")
        .expect("too-long");
    assert_eq!(too_long["response"]["status_code"], 400, "{too_long}");
    assert_too_long(&too_long["response"]["body"]);

    step(t0, "run on Redis checked");
    cancel_aborts_requests_at_the_engine(&redis, &base, dir).await;
    step(t0, "a cancel aborted two generations at the engine");
    // sluicegate batch, behind the feedback gate reading the engine's page.
    let before = Answered::read(&base).await;
    let output = dir.join("batch-out.jsonl");
    let params = json!({"urls": [page.clone()]});
    let status = batch(&input, &output, &base, "feedback", &params, 3)
        .status()
        .expect("batch runs");
    assert!(status.success(), "{status}");
    assert_eq!(
        Answered::read(&base).await.since(before),
        once,
        "sluicegate batch"
    );
    let out = read_lines(&output);
    let got: Vec<&str> = out
        .iter()
        .map(|l| l["custom_id"].as_str().unwrap())
        .collect();
    assert_eq!(got, ["cmpl-0", "cmpl-1", "chat-0", "chat-1", "too-long"]);
    for l in &out {
        let id = l["custom_id"].as_str().unwrap();
        assert!(l["error"].is_null(), "{l}");
        if id == "too-long" {
            assert_eq!(l["response"]["status_code"], 400, "{l}");
            assert_eq!(
                l["response"]["request_id"], "too-long#1",
                "one attempt: {l}"
            );
            assert_too_long(&l["response"]["body"]);
        } else {
            assert_eq!(l["response"]["status_code"], 200, "{l}");
            assert_answer(id, &l["response"]["body"], TOKENS);
        }
    }

    step(t0, "sluicegate batch checked");
    // serve, driven by the official openai client: a completions batch
    // (three lines and a too-long prompt) and a chat batch (three lines).
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let python = root.join("target/py-venv/bin/python");
    if !python.is_file() && std::env::var_os("SLUICEGATE_SKIP_PYTHON_SUITE").is_some() {
        eprintln!(
            "SKIPPED: serve with the openai Python client (SLUICEGATE_SKIP_PYTHON_SUITE is set)"
        );
        return;
    }
    assert!(
        python.is_file(),
        "{} is missing: run `bash scripts/test.sh` (it creates the venv with the pinned openai client), or set SLUICEGATE_SKIP_PYTHON_SUITE=1",
        python.display()
    );
    let mut spec = ServeSpec::new(&base);
    spec.keys = Some("alice:key-alice".into());
    let served = serve::start(&spec, None).await;
    let before = Answered::read(&base).await;
    let api = served.base.clone();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg("tests/python/real_engine_batches.py")
            .current_dir(root)
            .env("SLUICEGATE_API_BASE", api)
            .env("SLUICEGATE_KEY", "key-alice")
            .env("SLUICEGATE_MODEL", MODEL)
            .env("SLUICEGATE_LONG_PROMPT_WORDS", MAX_MODEL_LEN.to_string())
            .env_remove("OPENAI_API_KEY")
            .env_remove("OPENAI_BASE_URL")
            .output()
            .expect("python runs")
    })
    .await
    .expect("python task");
    let said = format!("{}{}", text(&output.stdout), text(&output.stderr));
    eprintln!("{said}");
    assert!(
        output.status.success(),
        "the openai client script failed:\n{said}"
    );
    served.stop().await;
    let expected = Answered {
        completions_2xx: 3.0,
        completions_4xx: 1.0,
        chat_2xx: 3.0,
        chat_4xx: 0.0,
    };
    assert_eq!(Answered::read(&base).await.since(before), expected, "serve");
    step(t0, "serve checked");
}

/// Cancel in flight on the real engine: two long generations (1 500
/// tokens, `ignore_eos`) run through `run` on Redis; `sluicegate cancel`
/// makes the dispatcher close their connections, vLLM aborts them (its
/// running count falls to 0 long before they could have finished), and
/// each id gets exactly one `CANCELLED` result.
async fn cancel_aborts_requests_at_the_engine(redis: &RedisServer, base: &str, dir: &Path) {
    let input = dir.join("long.jsonl");
    let long = |id: &str| {
        json!({"custom_id": id, "method": "POST", "url": "/v1/completions",
               "body": {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 1_500, "ignore_eos": true}})
        .to_string()
    };
    std::fs::write(&input, [long("long-0"), long("long-1")].join("\n")).expect("input");
    // `results` above took the earlier results off the list.
    let results_before = redis.int(&["LLEN", "result-list"]);
    let finished = [("finished_reason", "length")];
    let ran_to_length = engine_metric(base, "vllm:request_success_total", &finished).await;
    submit(&redis.url(), "cancel-me", &input);
    let gate_env = [
        ("SLUICEGATE_GATE_TYPE", "constant".to_owned()),
        (
            "SLUICEGATE_DISPATCH_CANCEL_CHECK_INTERVAL",
            "200ms".to_owned(),
        ),
    ];
    let run = run_on_redis(
        &redis.url(),
        "cancel-me",
        base,
        &gate_env,
        &dir.join("cancel.log"),
    );
    wait_for_engine(base, "both generations running", |running, _| {
        running >= 2.0
    })
    .await;
    let out = sluicegate(&["cancel", "--redis-url", &redis.url(), "long-0", "long-1"])
        .output()
        .expect("cancel runs");
    assert!(out.status.success(), "{}", text(&out.stderr));
    redis
        .wait_for_len_within("result-list", results_before + 2, Duration::from_secs(60))
        .await;
    // Aborted, not finished: the engine has nothing running any more, and
    // neither generation produced its answer.
    wait_for_engine(base, "the aborts freed the engine", |running, waiting| {
        running == 0.0 && waiting == 0.0
    })
    .await;
    assert_eq!(
        engine_metric(base, "vllm:request_success_total", &finished).await,
        ran_to_length,
        "an aborted generation must not run to its length"
    );
    sigterm_and_wait(run).await;
    let records = result_list(redis);
    let cancelled: Vec<&Value> = records
        .iter()
        .filter(|r| r["id"].as_str().is_some_and(|id| id.starts_with("long-")))
        .collect();
    assert_eq!(cancelled.len(), 2, "{cancelled:?}");
    for r in cancelled {
        assert_eq!(r["error_code"], "CANCELLED", "{r}");
    }
}

/// The engine SIGKILLed while `sluicegate batch` and `run` on Redis each
/// have requests in flight and results written, and restarted on the same
/// port: every id is answered exactly once, with the engine's 200, and the
/// new engine is sent only what had no result before the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_mid_batch_and_restarted_answers_every_id_exactly_once() {
    const LINES: usize = 24;
    let t0 = Instant::now();
    let mut engine = start_engine(None).await;
    step(t0, "engine up");
    let base = engine.base_url();
    let tmp = TempDir::new("real-engine-kill");
    let dir = &tmp.0;
    // Lengths staggered so answers trickle in rather than in one wave.
    let tokens = |i: usize| 32 + 24 * (i % 8) as u32;
    let lines: Vec<String> = (0..LINES)
        .map(|i| {
            openai_line(
                &format!("{}-{i}", if i % 2 == 0 { "cmpl" } else { "chat" }),
                i % 2 == 1,
                tokens(i),
            )
        })
        .collect();
    let input = dir.join("in.jsonl");
    std::fs::write(&input, lines.join("\n")).expect("input");

    let redis = RedisServer::start();
    submit(&redis.url(), "kill", &input);
    // Until the deadline, whatever fails; a short congestion hold, so the
    // restart is found soon after it is up.
    let env = [
        ("SLUICEGATE_GATE_TYPE", "constant".to_owned()),
        ("SLUICEGATE_DISPATCH_MAX_ATTEMPTS", "0".to_owned()),
        (
            "SLUICEGATE_DISPATCH_CONGESTION_MAX_BACKOFF",
            "4s".to_owned(),
        ),
    ];
    let run = run_on_redis(&redis.url(), "kill", &base, &env, &dir.join("run.log"));
    let output = dir.join("batch-out.jsonl");
    let mut batch_run = Background(
        batch(&input, &output, &base, "constant", &json!({}), 0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("batch starts"),
    );
    let db = dir.join("batch-out.jsonl.state").join("queue.db");
    let batch_done = || {
        if !db.exists() {
            return 0;
        }
        EmbeddedQueue::open(&db, "batch")
            .and_then(|q| q.result_count())
            .unwrap_or(0) as usize
    };
    let redis_done = || redis.int(&["LLEN", "result-list"]) as usize;

    // Kill once both have answers and both still have work in flight.
    let give_up = Instant::now() + Duration::from_secs(120);
    while batch_done() < 4 || redis_done() < 4 {
        assert!(
            Instant::now() < give_up,
            "no progress: batch {}, run {}",
            batch_done(),
            redis_done()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (running, _) = running_waiting(&base).await;
    engine.kill();
    let (batch_before, redis_before) = (batch_done(), redis_done());
    assert!(running > 0.0, "requests were in flight at the kill");
    assert!(
        batch_before < LINES && redis_before < LINES,
        "mid-batch: {batch_before}, {redis_before}"
    );
    eprintln!(
        "killed with {running} running; results before: batch {batch_before}, run {redis_before}"
    );

    step(t0, "engine killed");
    let engine = start_engine(Some(engine.port())).await;
    assert_eq!(engine.base_url(), base);
    step(t0, "engine restarted on the same port");

    redis
        .wait_for_len_within("result-list", LINES as i64, Duration::from_secs(240))
        .await;
    let give_up = Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(status) = batch_run.0.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < give_up,
            "batch did not finish: {} results",
            batch_done()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(status.success(), "{status}");
    sigterm_and_wait(run).await;
    step(t0, "batch done and run drained");

    // Exactly once, per id, with the engine's answer (read after the
    // drain, so a late duplicate would be there).
    let results = result_list(&redis);
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for r in &results {
        let id = r["id"].as_str().expect("id");
        assert_eq!(r["status_code"], 200, "{r}");
        let body: Value =
            serde_json::from_str(r["payload"].as_str().expect("payload")).expect("body");
        let i: usize = id.rsplit('-').next().unwrap().parse().unwrap();
        assert_answer(id, &body, tokens(i));
        *seen.entry(id.to_owned()).or_default() += 1;
    }
    assert_eq!(seen.len(), LINES, "run on Redis: {seen:?}");
    assert!(seen.values().all(|n| *n == 1), "run on Redis: {seen:?}");
    let out = read_lines(&output);
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for l in &out {
        let id = l["custom_id"].as_str().expect("custom_id");
        assert_eq!(l["response"]["status_code"], 200, "{l}");
        let i: usize = id.rsplit('-').next().unwrap().parse().unwrap();
        assert_answer(id, &l["response"]["body"], tokens(i));
        *seen.entry(id.to_owned()).or_default() += 1;
    }
    assert_eq!(seen.len(), LINES, "batch: {seen:?}");
    assert!(seen.values().all(|n| *n == 1), "batch: {seen:?}");
    // The new engine answered only ids without a result before the kill.
    let after = Answered::read(&base).await;
    let sent_again = after.completions_2xx + after.chat_2xx;
    let open = (2 * LINES - batch_before - redis_before) as f64;
    eprintln!(
        "the restarted engine answered {sent_again} requests; {open} had no result at the kill"
    );
    assert!(
        sent_again >= 1.0 && sent_again <= open,
        "new engine answered {sent_again}, open at the kill {open}"
    );
}
