//! Held flex connections (issue 37, `docs/flex.md`): one `sluicegate
//! serve` process (a child, so its RSS is its own) in front of the pool
//! simulator (in this process), N flex requests sent at once. Prints the
//! server's RSS before and while the N are held, the RSS per held request,
//! and the most requests the engine had at once against the gate's window:
//! the window, not the connection count, decides what reaches the engine.
//!
//! `cargo build --bin sluicegate --example flex_held && target/debug/examples/flex_held [N] [WINDOW]`
//! (the `sluicegate` binary is taken from beside the example's directory).
#![allow(clippy::print_stdout)] // a benchmark's job is to print its figures

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sluicegate::sim::{SimConfig, spawn_http};

fn rss_kib(pid: u32) -> f64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// The sum of the series of `names` on a `/metrics` page.
async fn metric(client: &reqwest::Client, url: &str, names: &[&str]) -> f64 {
    let Ok(answer) = client.get(url).send().await else {
        return f64::NAN;
    };
    let text = answer.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            names
                .iter()
                .any(|n| l.starts_with(n) && l[n.len()..].starts_with(['{', ' ']))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2000);
    let window: u32 = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(8);
    let mut cfg = SimConfig {
        pool_name: "p".into(),
        time_scale: 20.0,
        ..SimConfig::default()
    };
    cfg.engine.max_num_seqs = 64;
    let sim = spawn_http(cfg).await.expect("simulator starts");
    let exe = std::env::current_exe().expect("this example");
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("sluicegate"))
        .expect("the sluicegate binary beside target/<profile>/examples");
    let dir = std::env::temp_dir().join(format!("sluicegate-flex-held-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let (api, telemetry) = (free_port(), free_port());
    let config = dir.join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "transport = \"embedded\"\n[gateway]\nurl = \"{}\"\n[dispatch]\npoll_interval = \"100ms\"\n[telemetry]\nlisten = \"127.0.0.1:{telemetry}\"\nlog_level = \"warn\"\n[[queue]]\nqueue_name = \"q\"\nmax_sys = {window}\ngate_type = \"constant\"\n[serve]\nlisten = \"127.0.0.1:{api}\"\nflex_max_held = {n}\nflex_max_held_per_tenant = {n}\n",
            sim.base_url()
        ),
    )
    .expect("config");
    let mut child = Command::new(&bin)
        .args(["serve", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let pid = child.id();
    let client = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{api}");
    let serve_metrics = format!("http://127.0.0.1:{telemetry}/metrics");
    while client
        .get(format!("{base}/v1/responses/resp_x"))
        .send()
        .await
        .is_err()
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A few requests first, so the baseline has its code paths warm.
    let one =
        serde_json::json!({"model": "m", "prompt": "hi", "max_tokens": 64, "service_tier": "flex"});
    for _ in 0..4 {
        let _ = client
            .post(format!("{base}/v1/completions"))
            .json(&one)
            .send()
            .await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let base_rss = rss_kib(pid);

    let answered = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (url, body) = (format!("{base}/v1/completions"), one.clone());
            let (answered, ok) = (answered.clone(), ok.clone());
            tokio::spawn(async move {
                // One connection per request, as separate clients have.
                let c = reqwest::Client::builder()
                    .timeout(Duration::from_secs(900))
                    .build()
                    .expect("client");
                let r = c.post(url).json(&body).send().await;
                if r.is_ok_and(|r| r.status().is_success()) {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                answered.fetch_add(1, Ordering::Relaxed);
            })
        })
        .collect();
    let (mut peak_rss, mut peak_held, mut peak_engine) = (base_rss, 0.0f64, 0.0f64);
    let engine_names = ["vllm:num_requests_running", "vllm:num_requests_waiting"];
    let sim_metrics = format!("{}/metrics", sim.base_url());
    while answered.load(Ordering::Relaxed) < n as u64 {
        let held = metric(&client, &serve_metrics, &["sluicegate_flex_waiting"]).await;
        let engine = metric(&client, &sim_metrics, &engine_names).await;
        let rss = rss_kib(pid);
        if held >= peak_held {
            peak_held = held;
            peak_rss = peak_rss.max(rss);
        }
        peak_engine = peak_engine.max(engine);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for t in tasks {
        let _ = t.await;
    }
    let took = started.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let _ = sim.shutdown().await;
    println!("flex requests sent at once:        {n}");
    println!(
        "answered 200:                      {}",
        ok.load(Ordering::Relaxed)
    );
    println!("most held at once (serve metric):  {peak_held}");
    println!(
        "serve RSS before:                  {:.1} MiB",
        base_rss / 1024.0
    );
    println!(
        "serve RSS at the most held:        {:.1} MiB",
        peak_rss / 1024.0
    );
    if peak_held > 0.0 {
        println!(
            "RSS per held request:              {:.1} KiB",
            (peak_rss - base_rss) / peak_held
        );
    }
    println!("gate window (max_sys):             {window}");
    println!("most requests at the engine:       {peak_engine}");
    println!(
        "time for all:                      {:.1} s",
        took.as_secs_f64()
    );
}
