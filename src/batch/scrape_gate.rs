//! `SimVllmScrapeGate`: a small metric-driven gate that scrapes a vLLM
//! `/metrics` page (the simulator's, or a single vLLM server's) directly.
//!
//! Interim: the demo and `batch --gate vllm-scrape` use it until the
//! upstream-catalogue `vllm` / Prometheus gates land in `src/gate/`; it
//! should then be replaced by them. Per pod (label `pod`, or one pod when
//! absent) the roofline saturation is
//! `max(kv / kv_limit, running / max_num_seqs, waiting / waiting_limit)`,
//! `D = 1 − mean saturation` clamped to [0, 1]. It sees the pool's load
//! (ours included), and fails closed: an unreadable page is an error,
//! which the fail-closed wrapper turns into budget zero.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use crate::gate::{Budget, DispatchGate, GateError, Observation};

/// Parameters of [`SimVllmScrapeGate`].
#[derive(Debug, Clone)]
pub struct ScrapeGateParams {
    /// The `/metrics` URL.
    pub url: String,
    /// vLLM's `max_num_seqs` per pod.
    pub max_num_seqs: f64,
    /// KV use counted as full.
    pub kv_limit: f64,
    /// Waiting requests per pod counted as full.
    pub waiting_limit: f64,
    /// Batch requests per pod at budget 1: `max_SYS = pods × this`.
    pub max_concurrency_per_pod: f64,
    /// Baseline `B` kept for interactive traffic.
    pub baseline: f64,
}

impl ScrapeGateParams {
    /// Defaults for a pool whose metrics are at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            max_num_seqs: 256.0,
            kv_limit: 0.9,
            waiting_limit: 5.0,
            max_concurrency_per_pod: 32.0,
            baseline: 0.1,
        }
    }

    /// Reads `url`, `max_num_seqs`, `kv_limit`, `waiting_limit`,
    /// `max_concurrency_per_pod`, `baseline` from a JSON object.
    pub fn from_json(params: &serde_json::Value) -> Result<Self, String> {
        let url = params
            .get("url")
            .and_then(serde_json::Value::as_str)
            .ok_or("vllm-scrape: `url` (the /metrics URL) is required")?;
        let mut p = Self::new(url);
        let num = |key: &str, slot: &mut f64| -> Result<(), String> {
            match params.get(key) {
                None => Ok(()),
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() && x >= 0.0 => {
                        *slot = x;
                        Ok(())
                    }
                    _ => Err(format!(
                        "vllm-scrape: `{key}` must be a non-negative number"
                    )),
                },
            }
        };
        num("max_num_seqs", &mut p.max_num_seqs)?;
        num("kv_limit", &mut p.kv_limit)?;
        num("waiting_limit", &mut p.waiting_limit)?;
        num("max_concurrency_per_pod", &mut p.max_concurrency_per_pod)?;
        num("baseline", &mut p.baseline)?;
        if p.max_num_seqs <= 0.0 || p.kv_limit <= 0.0 || p.waiting_limit <= 0.0 {
            return Err("vllm-scrape: limits must be > 0".into());
        }
        if p.baseline > 1.0 {
            return Err("vllm-scrape: `baseline` must be in [0, 1]".into());
        }
        Ok(p)
    }
}

/// The interim vLLM scrape gate (see the module docs).
#[derive(Debug)]
pub struct SimVllmScrapeGate {
    params: ScrapeGateParams,
    client: reqwest::Client,
}

impl SimVllmScrapeGate {
    /// A gate scraping `params.url`.
    pub fn new(params: ScrapeGateParams) -> Result<Self, String> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| format!("vllm-scrape: http client: {e}"))?;
        Ok(Self { params, client })
    }
}

/// Per-pod vLLM gauges read from one page.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct PodLoad {
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// `vllm:kv_cache_usage_perc` (or the legacy `gpu_cache_usage_perc`).
    pub kv: f64,
}

/// Reads the vLLM gauges per pod from Prometheus text. Pods come from the
/// `pod` label; series without one count as one pod `""`.
pub fn parse_pod_loads(text: &str) -> BTreeMap<String, PodLoad> {
    let mut pods: BTreeMap<String, PodLoad> = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => line.split_at(i),
            None => continue,
        };
        let field: fn(&mut PodLoad) -> &mut f64 = match name {
            "vllm:num_requests_running" => |p| &mut p.running,
            "vllm:num_requests_waiting" => |p| &mut p.waiting,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => |p| &mut p.kv,
            _ => continue,
        };
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => match r.rfind('}') {
                Some(end) => (&r[..end], r[end + 1..].trim()),
                None => continue,
            },
            None => ("", rest.trim()),
        };
        let Some(value) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        let pod = labels
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| k.trim() == "pod")
            .map(|(_, v)| v.trim().trim_matches('"').to_owned())
            .unwrap_or_default();
        *field(pods.entry(pod).or_default()) = value;
    }
    pods
}

impl DispatchGate for SimVllmScrapeGate {
    fn observe(&self) -> BoxFuture<'_, Result<Observation, GateError>> {
        Box::pin(async move {
            let taken_at = Instant::now();
            let unavailable = |e: String| GateError::SourceUnavailable(e);
            let response = self
                .client
                .get(&self.params.url)
                .send()
                .await
                .map_err(|e| unavailable(format!("scrape {}: {e}", self.params.url)))?;
            if !response.status().is_success() {
                return Err(unavailable(format!(
                    "scrape {}: HTTP {}",
                    self.params.url,
                    response.status()
                )));
            }
            let text = response
                .text()
                .await
                .map_err(|e| unavailable(format!("scrape {}: {e}", self.params.url)))?;
            let pods = parse_pod_loads(&text);
            if pods.is_empty() {
                return Err(unavailable("no vllm gauges on the page".into()));
            }
            let p = &self.params;
            let free: f64 = pods
                .values()
                .map(|l| {
                    let sat = (l.kv / p.kv_limit)
                        .max(l.running / p.max_num_seqs)
                        .max(l.waiting / p.waiting_limit);
                    (1.0 - sat).clamp(0.0, 1.0)
                })
                .sum::<f64>()
                / pods.len() as f64;
            let budget = Budget::saturating(free);
            Ok(Observation {
                budget,
                baseline: Budget::saturating(p.baseline),
                taken_at,
                max_sys: Some(pods.len() as f64 * p.max_concurrency_per_pod),
                sees_own_load: true,
                source_available: true,
                reason: format!("vllm roofline over {} pods: D = {budget}", pods.len()),
            })
        })
    }

    fn kind(&self) -> &'static str {
        "vllm-scrape"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_gauges_per_pod() {
        let text = "# HELP x\nvllm:num_requests_running{engine=\"0\",pod=\"p-0\"} 10\nvllm:num_requests_waiting{pod=\"p-0\"} 2.0\nvllm:kv_cache_usage_perc{pod=\"p-1\",model_name=\"m\"} 0.45\nvllm:num_requests_running_other 5\n";
        let pods = parse_pod_loads(text);
        assert_eq!(pods.len(), 2);
        assert_eq!(pods["p-0"].running, 10.0);
        assert_eq!(pods["p-0"].waiting, 2.0);
        assert_eq!(pods["p-1"].kv, 0.45);
    }

    #[test]
    fn params_need_a_url_and_sane_limits() {
        assert!(ScrapeGateParams::from_json(&serde_json::json!({})).is_err());
        let p = ScrapeGateParams::from_json(
            &serde_json::json!({"url": "http://x/metrics", "baseline": 0.2}),
        )
        .expect("valid");
        assert_eq!(p.baseline, 0.2);
        assert!(
            ScrapeGateParams::from_json(&serde_json::json!({"url": "u", "kv_limit": 0})).is_err()
        );
    }
}
