//! `vllm`: a budget straight from the engines' own `/metrics`, no
//! Prometheus. Per engine (one label set of `vllm:num_requests_running`;
//! a page may hold several), the utilisation roofline
//! `D_i = 1 − max(kv_usage / kv_ceiling, running / max_num_seqs, waiting / queue_threshold)`;
//! the pool's `D` is the mean over engines and `max_SYS = Σ max_num_seqs`.
//! `max_num_seqs` comes from the parameter, else a `max_num_seqs` label of
//! `vllm:cache_config_info`, else vLLM's default 256. An engine page that
//! cannot be read counts as one engine with `D_i = 0` and no capacity; if
//! none can be read the gate is closed and unavailable.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures_util::future::join_all;
use serde::{Deserialize, Serialize};

use super::param::{GateParams, ParseCx, loose, validate_engine_urls};
use super::reading::{MetricGate, SourceReport, non_negative, pool_reading, show_labels};
use super::{BuildError, DispatchGate, GateContext, GateError, Observation};
use crate::source::{Cached, Exposition, Scrape, text::Sample};

/// Parameters of `vllm`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VllmParams {
    /// The servers' `/metrics` URLs (required, at least one).
    #[serde(deserialize_with = "loose::string_list")]
    pub urls: Vec<String>,
    /// KV-cache usage at which a server counts as full, in (0, 1] (default 0.9).
    #[serde(deserialize_with = "loose::f64")]
    pub kv_ceiling: f64,
    /// Waiting requests at which a server counts as full, > 0 (default 5).
    #[serde(deserialize_with = "loose::f64")]
    pub queue_threshold: f64,
    /// Concurrency per server; `None` = read from the server's metrics.
    #[serde(deserialize_with = "loose::opt_u32")]
    pub max_num_seqs: Option<u32>,
    /// Reserved baseline in [0, 1] (default 0.05).
    #[serde(deserialize_with = "loose::f64")]
    pub baseline: f64,
}

impl Default for VllmParams {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            kv_ceiling: 0.9,
            queue_threshold: 5.0,
            max_num_seqs: None,
            baseline: 0.05,
        }
    }
}

impl GateParams for VllmParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        validate_engine_urls(cx, &self.urls);
        if !(self.kv_ceiling > 0.0 && self.kv_ceiling <= 1.0) {
            cx.error(
                "kv_ceiling",
                format!("must be in (0, 1], got {}", self.kv_ceiling),
            );
        }
        cx.positive("queue_threshold", self.queue_threshold);
        if let Some(n) = self.max_num_seqs {
            cx.at_least_one("max_num_seqs", n);
        }
        cx.fraction("baseline", self.baseline);
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let pages = ctx.scrapes(&self.urls)?;
        Ok(Box::new(VllmGate::new(
            pages,
            Roofline {
                kv_ceiling: self.kv_ceiling,
                queue_threshold: self.queue_threshold,
                max_num_seqs: self.max_num_seqs.map(f64::from),
            },
            self.baseline,
        )))
    }
}

/// vLLM's default `max_num_seqs`, used when neither the config nor the
/// server says otherwise.
const DEFAULT_MAX_NUM_SEQS: f64 = 256.0;

/// Limits of the roofline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Roofline {
    /// KV usage counted as full.
    pub kv_ceiling: f64,
    /// Waiting requests counted as full.
    pub queue_threshold: f64,
    /// Configured `max_num_seqs`, if any.
    pub max_num_seqs: Option<f64>,
}

/// One engine's reading.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineReading {
    /// The engine's labels.
    pub labels: BTreeMap<String, String>,
    /// `D_i`.
    pub d: f64,
    /// The engine's `max_num_seqs`.
    pub max_num_seqs: f64,
    /// For the explanation.
    pub detail: String,
}

/// Labels of `a` and `b` agree wherever both have them.
fn agree(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> bool {
    a.iter().all(|(k, v)| b.get(k).is_none_or(|w| w == v))
}

fn same_engine<'a>(
    page: &'a Exposition,
    name: &'a str,
    engine: &'a BTreeMap<String, String>,
) -> impl Iterator<Item = &'a Sample> + 'a {
    page.named(name).filter(move |s| agree(engine, &s.labels))
}

/// Reads every engine on one page.
pub fn read_engines(page: &Exposition, limits: Roofline) -> Result<Vec<EngineReading>, GateError> {
    let mut out = Vec::new();
    for running in page.named("vllm:num_requests_running") {
        let engine = &running.labels;
        let who = show_labels(engine);
        let one = |name: &str| -> Result<f64, GateError> {
            let mut it = same_engine(page, name, engine).filter(|s| s.labels == *engine);
            match (it.next(), it.next()) {
                (Some(s), None) => non_negative(s.value, name),
                (None, _) => Err(GateError::SourceUnavailable(format!(
                    "{name}{who} is missing"
                ))),
                (Some(_), Some(_)) => Err(GateError::SourceUnavailable(format!(
                    "{name}{who} has several series"
                ))),
            }
        };
        let r = non_negative(running.value, "vllm:num_requests_running")?;
        let waiting = one("vllm:num_requests_waiting")?;
        let kv = one("vllm:kv_cache_usage_perc").or_else(|_| one("vllm:gpu_cache_usage_perc"))?;
        let info = same_engine(page, "vllm:cache_config_info", engine).next();
        let from_server = info
            .and_then(|i| i.labels.get("max_num_seqs"))
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| *v >= 1.0);
        let (max_num_seqs, seqs_from) = match (limits.max_num_seqs, from_server) {
            (Some(m), _) => (m, "config"),
            (None, Some(m)) => (m, "vllm:cache_config_info"),
            (None, None) => (DEFAULT_MAX_NUM_SEQS, "vLLM default"),
        };
        let kv_tokens = info.and_then(|i| {
            let blocks = i.labels.get("num_gpu_blocks")?.parse::<f64>().ok()?;
            let size = i.labels.get("block_size")?.parse::<f64>().ok()?;
            Some(blocks * size)
        });
        let terms = [
            kv / limits.kv_ceiling,
            r / max_num_seqs,
            waiting / limits.queue_threshold,
        ];
        let load = terms.iter().copied().fold(0.0, f64::max);
        out.push(EngineReading {
            labels: engine.clone(),
            d: (1.0 - load).clamp(0.0, 1.0),
            max_num_seqs,
            detail: format!(
                "{who}: kv {kv:.3}/{} , running {r}/{max_num_seqs} ({seqs_from}), waiting {waiting}/{}{} → D_i = {:.4}",
                limits.kv_ceiling,
                limits.queue_threshold,
                kv_tokens
                    .map(|t| format!(", KV capacity {t} tokens"))
                    .unwrap_or_default(),
                (1.0 - load).clamp(0.0, 1.0)
            ),
        });
    }
    if out.is_empty() {
        return Err(GateError::SourceUnavailable(
            "no vllm:num_requests_running on the page".into(),
        ));
    }
    Ok(out)
}

/// The `vllm` gate.
#[derive(Debug)]
pub struct VllmGate {
    pages: Vec<Cached<Scrape>>,
    limits: Roofline,
    baseline: f64,
    /// The last successful reading and the cached pages it was computed
    /// from: while every page cache still serves those same pages, the
    /// reading is the same, and recomputing it (scanning each page for
    /// every engine's series, formatting the report) cost about 4.7 µs a
    /// decision (issue 21).
    last: Mutex<Option<(Vec<Arc<Exposition>>, Observation)>>,
}

impl VllmGate {
    /// The gate over the engines' pages.
    pub fn new(pages: Vec<Cached<Scrape>>, limits: Roofline, baseline: f64) -> Self {
        Self {
            pages,
            limits,
            baseline,
            last: Mutex::new(None),
        }
    }

    fn last(&self) -> std::sync::MutexGuard<'_, Option<(Vec<Arc<Exposition>>, Observation)>> {
        // The memo is replaced whole; a poisoned lock still holds a
        // consistent one.
        self.last.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl MetricGate for VllmGate {
    const KIND: &'static str = "vllm";

    async fn reuse(&self) -> Option<Observation> {
        let pages = join_all(self.pages.iter().map(Cached::get)).await;
        let last = self.last();
        let (read_from, observation) = last.as_ref()?;
        let same = pages.len() == read_from.len()
            && pages
                .iter()
                .zip(read_from)
                .all(|(now, then)| now.as_ref().is_ok_and(|p| Arc::ptr_eq(&p.value, then)));
        same.then(|| observation.clone())
    }

    async fn read(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        let pages = join_all(self.pages.iter().map(Cached::get)).await;
        // Reusable later only if every page was read.
        let read_from: Option<Vec<Arc<Exposition>>> = pages
            .iter()
            .map(|p| p.as_ref().ok().map(|p| p.value.clone()))
            .collect();
        let mut engines: Vec<EngineReading> = Vec::new();
        let mut unreadable = 0usize;
        let mut oldest = None;
        let mut first_error = None;
        for (cache, page) in self.pages.iter().zip(pages) {
            let mut report = SourceReport::new("engine metrics", cache.source().describe_url());
            let read = page
                .map_err(|e| GateError::source(report.target.clone(), e))
                .and_then(|p| read_engines(&p.value, self.limits).map(|e| (e, p.taken_at)));
            match read {
                Ok((list, at)) => {
                    oldest = Some(oldest.map_or(at, |o: tokio::time::Instant| o.min(at)));
                    report.values = list.iter().map(|e| (show_labels(&e.labels), e.d)).collect();
                    report.outcome = list
                        .iter()
                        .map(|e| e.detail.clone())
                        .collect::<Vec<_>>()
                        .join("; ");
                    engines.extend(list);
                }
                Err(e) => {
                    report.outcome = format!("error (counts as a full engine): {e}");
                    unreadable += 1;
                    first_error.get_or_insert(e);
                }
            }
            sources.push(report);
        }
        match (oldest, first_error) {
            (None, Some(e)) => Err(e),
            (None, None) => Err(GateError::SourceUnavailable("no engine URLs".into())),
            (Some(taken_at), _) => {
                let count = engines.len() + unreadable;
                let d = engines.iter().map(|e| e.d).sum::<f64>() / count as f64;
                let max_sys: f64 = engines.iter().map(|e| e.max_num_seqs).sum();
                let mut observation = pool_reading(
                    d,
                    self.baseline,
                    taken_at,
                    Some(max_sys),
                    // Running, waiting and KV of each engine include ours.
                    true,
                    format!(
                        "mean roofline over {count} engines ({unreadable} unreadable count as full): D = {d:.4}"
                    ),
                );
                // D_i ≤ 1 − running_i / max_num_seqs_i and max_SYS is the sum
                // of max_num_seqs: each running request of ours takes at
                // least one request of N, so finished ones of ours may be
                // refilled before the next page.
                observation.counts_own_requests = true;
                *self.last() = read_from.map(|pages| (pages, observation.clone()));
                Ok(observation)
            }
        }
    }

    fn notes(&self) -> Vec<String> {
        vec![
            "D_i = 1 − max(kv_usage / kv_ceiling, running / max_num_seqs, waiting / queue_threshold)"
                .into(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::text::parse;

    const LIMITS: Roofline = Roofline {
        kv_ceiling: 0.8,
        queue_threshold: 5.0,
        max_num_seqs: None,
    };

    fn page(running: f64, waiting: f64, kv: f64, info: &str) -> Exposition {
        parse(&format!(
            "vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}\n\
             vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}\n\
             vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {kv}\n{info}"
        ))
        .unwrap()
    }

    #[test]
    fn the_largest_term_of_the_roofline_wins() {
        let e = read_engines(&page(64.0, 1.0, 0.2, ""), LIMITS).unwrap();
        assert!((e[0].d - 0.75).abs() < 1e-9, "{e:?}");
        let e = read_engines(&page(0.0, 4.0, 0.2, ""), LIMITS).unwrap();
        assert!((e[0].d - 0.2).abs() < 1e-9, "{e:?}");
        let e = read_engines(&page(0.0, 0.0, 0.9, ""), LIMITS).unwrap();
        assert_eq!(e[0].d, 0.0);
    }

    #[test]
    fn max_num_seqs_comes_from_cache_config_info_when_present() {
        let info = "vllm:cache_config_info{engine=\"0\",block_size=\"16\",num_gpu_blocks=\"100\",max_num_seqs=\"32\"} 1\n";
        let e = read_engines(&page(16.0, 0.0, 0.0, info), LIMITS).unwrap();
        assert_eq!(e[0].max_num_seqs, 32.0);
        assert!((e[0].d - 0.5).abs() < 1e-9);
        assert!(e[0].detail.contains("KV capacity 1600"), "{}", e[0].detail);
        let configured = Roofline {
            max_num_seqs: Some(64.0),
            ..LIMITS
        };
        let e = read_engines(&page(16.0, 0.0, 0.0, info), configured).unwrap();
        assert_eq!(e[0].max_num_seqs, 64.0);
    }

    #[test]
    fn missing_or_nan_metrics_are_errors() {
        let p = parse("vllm:num_requests_running{engine=\"0\"} 1\n").unwrap();
        assert!(read_engines(&p, LIMITS).is_err());
        assert!(read_engines(&page(1.0, f64::NAN, 0.1, ""), LIMITS).is_err());
        assert!(read_engines(&parse("other 1\n").unwrap(), LIMITS).is_err());
    }
}
