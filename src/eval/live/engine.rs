//! What the live eval reads off the engine and the machine: the engine's
//! `/metrics` (tokens generated, its own TTFT histogram, running and
//! waiting requests) and the CPU time of each process involved.

use std::time::Duration;

use crate::source::text::{self, HistogramSeries};

/// One reading of the engine's page.
#[derive(Debug, Clone, Default)]
pub struct EngineReading {
    /// `vllm:generation_tokens_total`, summed over series.
    pub generation_tokens: f64,
    /// `vllm:time_to_first_token_seconds`.
    pub ttft: Vec<HistogramSeries>,
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
}

/// The HTTP client of the live eval and the sweep: connections kept for
/// as many requests as the engine runs at once.
pub fn client() -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .map_err(|e| e.to_string())
}

/// Fetches and parses the engine's page.
pub async fn page(client: &reqwest::Client, metrics_url: &str) -> Result<text::Exposition, String> {
    let text = client
        .get(metrics_url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| format!("{metrics_url}: {e}"))?
        .text()
        .await
        .map_err(|e| format!("{metrics_url}: {e}"))?;
    text::parse(&text).map_err(|e| format!("{metrics_url}: {e}"))
}

/// Reads the engine's page.
pub async fn read(client: &reqwest::Client, metrics_url: &str) -> Result<EngineReading, String> {
    let page = page(client, metrics_url).await?;
    let sum = |name: &str| page.named(name).map(|s| s.value).sum::<f64>();
    if page.named("vllm:num_requests_running").next().is_none() {
        return Err(format!(
            "{metrics_url}: no vllm:num_requests_running: not a vLLM page"
        ));
    }
    Ok(EngineReading {
        generation_tokens: sum("vllm:generation_tokens_total"),
        ttft: page.histogram("vllm:time_to_first_token_seconds"),
        running: sum("vllm:num_requests_running"),
        waiting: sum("vllm:num_requests_waiting"),
    })
}

/// Waits until the engine runs and queues nothing (what a run left behind
/// has finished or been aborted), at most `limit`.
pub async fn wait_idle(
    client: &reqwest::Client,
    metrics_url: &str,
    limit: Duration,
) -> Result<(), String> {
    let give_up = tokio::time::Instant::now() + limit;
    loop {
        let r = read(client, metrics_url).await?;
        if r.running + r.waiting == 0.0 {
            return Ok(());
        }
        if tokio::time::Instant::now() > give_up {
            return Err(format!(
                "the engine still has {} running and {} waiting after {limit:?}",
                r.running, r.waiting
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Clock ticks per second of `/proc/<pid>/stat` times (`USER_HZ`, 100 on
/// every Linux architecture this runs on).
const TICKS_PER_S: f64 = 100.0;

/// The fields of `/proc/<pid>/stat` from the third (the state) on; `None`
/// when the process is gone.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: fields
    // count from after its closing one.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// CPU seconds (user + system) a process has used so far, its threads
/// included; `None` when it is gone.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let fields = stat_fields(pid)?;
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_S)
}

/// `pid` and every process descending from it (the engine's API server
/// and its engine core).
pub fn process_tree(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| Some((p, stat_fields(p)?.get(1)?.parse().ok()?)))
        .collect();
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    tree
}

/// A process's short name (`/proc/<pid>/comm`).
pub fn process_name(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_cpu_time_is_read_and_grows() {
        let pid = std::process::id();
        let before = cpu_seconds(pid).expect("our own stat");
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let after = cpu_seconds(pid).expect("our own stat");
        assert!(after >= before, "{before} -> {after}");
        assert!(process_tree(pid).contains(&pid));
        assert!(!process_name(pid).is_empty());
    }
}
