//! Metrics with the real names: vLLM per replica, endpoint-picker per pool,
//! the Prometheus text exposition, and lagged views with blackouts.
//!
//! The exposition is written by hand rather than through a registry because
//! the simulator impersonates other programs: names contain `:`, histogram
//! buckets are vLLM's, and a lagged view must render an old snapshot.

use std::collections::VecDeque;
use std::fmt::Write as _;

use serde::Serialize;

use super::time::SimTime;

/// vLLM's `vllm:time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `vllm:inter_token_latency_seconds` buckets.
pub const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request latency buckets (e2e and queue time).
pub const REQUEST_LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A Prometheus histogram over fixed bucket bounds (non-cumulative counts inside).
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    /// One count per bound plus the +Inf bucket.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    /// Adds one observation.
    pub fn observe(&mut self, v: f64) {
        let i = self.bounds.partition_point(|b| *b < v);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// `(upper bound, cumulative count)` pairs, ending with +Inf.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut acc = 0;
        let mut out = Vec::with_capacity(self.counts.len());
        for (i, c) in self.counts.iter().enumerate() {
            acc += c;
            out.push((self.bounds.get(i).copied().unwrap_or(f64::INFINITY), acc));
        }
        out
    }
}

/// A replica's latency histograms.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaHistograms {
    /// Time to first token, from gateway arrival.
    pub ttft: Histogram,
    /// Gap between consecutive tokens.
    pub itl: Histogram,
    /// Arrival to last token.
    pub e2e: Histogram,
    /// Arrival to first scheduled.
    pub queue: Histogram,
}

impl Default for ReplicaHistograms {
    fn default() -> Self {
        Self {
            ttft: Histogram::new(&TTFT_BUCKETS),
            itl: Histogram::new(&ITL_BUCKETS),
            e2e: Histogram::new(&REQUEST_LATENCY_BUCKETS),
            queue: Histogram::new(&REQUEST_LATENCY_BUCKETS),
        }
    }
}

/// A replica's gauges and counters: what a scrape of its `/metrics` shows.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct ReplicaGauges {
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc` (0–1).
    pub kv_usage: f64,
    /// `vllm:num_preemptions_total`.
    pub preemptions_total: u64,
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens_total: u64,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens_total: u64,
    /// `vllm:request_success_total`.
    pub success_total: u64,
    /// `vllm:prefix_cache_queries_total`: prompt tokens looked up in the
    /// prefix cache.
    pub prefix_cache_queries_total: u64,
    /// `vllm:prefix_cache_hits_total`: prompt tokens found there.
    pub prefix_cache_hits_total: u64,
}

/// What a gate can observe of the pool at one instant.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct PoolObservation {
    /// The simulated time this observation describes.
    pub taken_at: SimTime,
    /// Per replica, in replica order.
    pub replicas: Vec<ReplicaGauges>,
    /// Requests held by gateway flow control.
    pub flow_control_queue_size: u32,
    /// EPP utilisation-detector saturation (average of per-replica
    /// `max(waiting / depth, kv / kv_threshold)`); ≥ 1 means saturated.
    pub saturation: f64,
}

impl PoolObservation {
    /// `inference_pool_ready_pods`.
    pub fn ready_pods(&self) -> usize {
        self.replicas.len()
    }

    /// Total running requests.
    pub fn running(&self) -> u32 {
        self.replicas.iter().map(|r| r.running).sum()
    }

    /// Total waiting requests.
    pub fn waiting(&self) -> u32 {
        self.replicas.iter().map(|r| r.waiting).sum()
    }

    /// Mean KV usage over replicas.
    pub fn avg_kv_usage(&self) -> f64 {
        mean(self.replicas.iter().map(|r| r.kv_usage))
    }
}

fn mean(it: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = it.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { s / n as f64 }
}

/// Everything `/metrics` renders: an observation plus histograms.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsSnapshot {
    /// Gauges and counters.
    pub obs: PoolObservation,
    /// Histograms per replica, in replica order.
    pub hist: Vec<ReplicaHistograms>,
}

/// Names and labels for the exposition.
#[derive(Debug, Clone)]
pub struct ExpositionLabels {
    /// Pool name (`name` / `inference_pool` label; pods are `<pool>-<i>`).
    pub pool: String,
    /// `model_name` label.
    pub model: String,
    /// `block_size` label of `vllm:cache_config_info`.
    pub block_size: u32,
    /// `num_gpu_blocks` label of `vllm:cache_config_info`.
    pub num_gpu_blocks: u32,
    /// Also emit vLLM's older metric names.
    pub legacy_vllm_names: bool,
}

/// Escapes a label value for the text format.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn fmt_f64(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 {
            "+Inf".to_owned()
        } else {
            "-Inf".to_owned()
        }
    } else {
        format!("{v:?}")
    }
}

/// Renders the Prometheus text format (version 0.0.4) of a snapshot.
pub fn render(snap: &MetricsSnapshot, l: &ExpositionLabels) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let pool = esc(&l.pool);
    let model = esc(&l.model);
    let vlabels: Vec<String> = (0..snap.obs.replicas.len())
        .map(|i| {
            format!(
                "engine=\"0\",inference_pool=\"{pool}\",model_name=\"{model}\",pod=\"{pool}-{i}\""
            )
        })
        .collect();

    type GaugeFn = fn(&ReplicaGauges) -> f64;
    let mut gauges: Vec<(&str, &str, &str, GaugeFn)> = vec![
        (
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            |g| f64::from(g.running),
        ),
        (
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            |g| f64::from(g.waiting),
        ),
        (
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            |g| g.kv_usage,
        ),
        (
            "vllm:num_preemptions_total",
            "counter",
            "Cumulative number of preemption from the engine.",
            |g| g.preemptions_total as f64,
        ),
        (
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            |g| g.prompt_tokens_total as f64,
        ),
        (
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            |g| g.generation_tokens_total as f64,
        ),
        (
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            |g| g.prefix_cache_queries_total as f64,
        ),
        (
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            |g| g.prefix_cache_hits_total as f64,
        ),
    ];
    if l.legacy_vllm_names {
        gauges.push((
            "vllm:gpu_cache_usage_perc",
            "gauge",
            "GPU KV-cache usage. 1 means 100 percent usage.",
            |g| g.kv_usage,
        ));
    }
    for (name, kind, help, f) in gauges {
        family(&mut out, name, kind, help);
        for (g, lab) in snap.obs.replicas.iter().zip(&vlabels) {
            let _ = writeln!(out, "{name}{{{lab}}} {}", fmt_f64(f(g)));
        }
    }
    family(
        &mut out,
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
    );
    for (g, lab) in snap.obs.replicas.iter().zip(&vlabels) {
        let _ = writeln!(
            out,
            "vllm:request_success_total{{{lab},finished_reason=\"length\"}} {}",
            fmt_f64(g.success_total as f64)
        );
    }
    family(
        &mut out,
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
    );
    for lab in &vlabels {
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{{lab},block_size=\"{}\",num_gpu_blocks=\"{}\"}} 1.0",
            l.block_size, l.num_gpu_blocks
        );
    }

    type HistFn = fn(&ReplicaHistograms) -> &Histogram;
    let mut hists: Vec<(&str, &str, HistFn)> = vec![
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            |h| &h.ttft,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            |h| &h.itl,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            |h| &h.e2e,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            |h| &h.queue,
        ),
    ];
    if l.legacy_vllm_names {
        hists.push((
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            |h| &h.itl,
        ));
    }
    for (name, help, f) in hists {
        family(&mut out, name, "histogram", help);
        for (h, lab) in snap.hist.iter().zip(&vlabels) {
            let h = f(h);
            for (le, c) in h.cumulative() {
                let _ = writeln!(
                    out,
                    "{name}_bucket{{{lab},le=\"{}\"}} {}",
                    fmt_f64(le),
                    fmt_f64(c as f64)
                );
            }
            let _ = writeln!(out, "{name}_sum{{{lab}}} {}", fmt_f64(h.sum()));
            let _ = writeln!(out, "{name}_count{{{lab}}} {}", fmt_f64(h.count() as f64));
        }
    }

    // Endpoint-picker pool metrics, current (llm_d_epp_*) and legacy names.
    let obs = &snap.obs;
    let n = obs.replicas.len() as f64;
    let avg_queue = mean(obs.replicas.iter().map(|r| f64::from(r.waiting)));
    let avg_running = mean(obs.replicas.iter().map(|r| f64::from(r.running)));
    let pool_gauges: [(&str, &str, &str, f64); 4] = [
        (
            "ready_endpoints",
            "ready_pods",
            "Number of ready endpoints in the pool.",
            n,
        ),
        (
            "average_kv_cache_utilization",
            "average_kv_cache_utilization",
            "Average KV cache utilization of the pool.",
            obs.avg_kv_usage(),
        ),
        (
            "average_queue_size",
            "average_queue_size",
            "Average waiting queue size of the pool.",
            avg_queue,
        ),
        (
            "average_running_requests",
            "average_running_requests",
            "Average running requests of the pool.",
            avg_running,
        ),
    ];
    for (current, legacy, help, v) in pool_gauges {
        for name in [
            format!("llm_d_epp_{current}"),
            format!("inference_pool_{legacy}"),
        ] {
            family(&mut out, &name, "gauge", help);
            let _ = writeln!(out, "{name}{{name=\"{pool}\"}} {}", fmt_f64(v));
        }
    }
    for (name, pod_label) in [
        ("llm_d_epp_per_endpoint_queue_size", "model_server_endpoint"),
        ("inference_pool_per_pod_queue_size", "model_server_pod"),
    ] {
        family(
            &mut out,
            name,
            "gauge",
            "Waiting queue size of each endpoint as the picker sees it.",
        );
        for (i, r) in obs.replicas.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}{{{pod_label}=\"{pool}-{i}\",name=\"{pool}\"}} {}",
                fmt_f64(f64::from(r.waiting))
            );
        }
    }
    for prefix in ["llm_d_epp", "inference_extension"] {
        let name = format!("{prefix}_flow_control_queue_size");
        family(&mut out, &name, "gauge", "Requests held by flow control.");
        let _ = writeln!(
            out,
            "{name}{{inference_pool=\"{pool}\"}} {}",
            fmt_f64(f64::from(obs.flow_control_queue_size))
        );
        let name = format!("{prefix}_flow_control_pool_saturation");
        family(
            &mut out,
            &name,
            "gauge",
            "Pool saturation as seen by the flow-control saturation detector.",
        );
        let _ = writeln!(
            out,
            "{name}{{inference_pool=\"{pool}\"}} {}",
            fmt_f64(obs.saturation)
        );
    }
    out
}

/// How a consumer sees the pool's metrics: scrape interval, extra lag, blackouts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ViewConfig {
    /// Seconds between scrapes (0 = every query reads the pool directly).
    pub scrape_interval_s: f64,
    /// Extra delay between a scrape and when queries can see it (query cache,
    /// rule evaluation), seconds.
    pub extra_lag_s: f64,
    /// `[start, end]` windows where scrapes fail and queries return nothing.
    pub blackouts: Vec<[f64; 2]>,
}

impl ViewConfig {
    /// Direct scrape: no lag.
    pub fn direct() -> Self {
        Self {
            scrape_interval_s: 0.0,
            extra_lag_s: 0.0,
            blackouts: Vec::new(),
        }
    }

    /// Prometheus-like: 15 s scrape plus a 5 s query cache.
    pub fn prometheus() -> Self {
        Self {
            scrape_interval_s: 15.0,
            extra_lag_s: 5.0,
            blackouts: Vec::new(),
        }
    }

    /// Whether `t` falls in a blackout window.
    pub fn blacked_out(&self, t: SimTime) -> bool {
        self.blackouts.iter().any(|[a, b]| (*a..*b).contains(&t))
    }
}

/// A lagged, blackout-prone view of a value sampled from the pool over time.
#[derive(Debug, Clone)]
pub struct LaggedView<T> {
    cfg: ViewConfig,
    /// Successful scrapes, oldest first; pruned to what queries can still return.
    history: VecDeque<(SimTime, T)>,
    next_scrape: SimTime,
}

impl<T: Clone> LaggedView<T> {
    /// An empty view; the first scrape is due at time 0.
    pub fn new(cfg: ViewConfig) -> Self {
        Self {
            cfg,
            history: VecDeque::new(),
            next_scrape: 0.0,
        }
    }

    /// The view's configuration.
    pub fn config(&self) -> &ViewConfig {
        &self.cfg
    }

    /// When the next scrape is due (for the event loop).
    pub fn next_scrape(&self) -> SimTime {
        self.next_scrape
    }

    /// Whether a scrape is due at `now`.
    pub fn scrape_due(&self, now: SimTime) -> bool {
        now >= self.next_scrape
    }

    /// Scrapes `value` at `now` (fails silently inside a blackout, like a real
    /// scrape that times out) and schedules the next one.
    pub fn scrape(&mut self, now: SimTime, value: T) {
        if !self.cfg.blacked_out(now) {
            self.history.push_back((now, value));
        }
        self.next_scrape = if self.cfg.scrape_interval_s > 0.0 {
            // Stay on the grid so lag does not drift with event timing.
            let k = (now / self.cfg.scrape_interval_s).floor() + 1.0;
            k * self.cfg.scrape_interval_s
        } else {
            now
        };
        // Keep only the newest entry already visible plus the invisible ones.
        let visible_before = now - self.cfg.extra_lag_s;
        while self.history.len() > 1 && self.history[1].0 <= visible_before {
            self.history.pop_front();
        }
    }

    /// The newest scrape visible at `now`: `(time it describes, value)`, or
    /// `None` inside a blackout or before any scrape is visible.
    pub fn observe(&self, now: SimTime) -> Option<&(SimTime, T)> {
        if self.cfg.blacked_out(now) {
            return None;
        }
        let horizon = now - self.cfg.extra_lag_s;
        self.history.iter().rev().find(|(t, _)| *t <= horizon)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_with_le_semantics() {
        let mut h = Histogram::new(&TTFT_BUCKETS);
        h.observe(0.001); // on the edge: counts in le="0.001"
        h.observe(0.03);
        h.observe(5000.0);
        let c = h.cumulative();
        assert_eq!(c[0], (0.001, 1));
        assert_eq!(c[4], (0.04, 2));
        assert_eq!(c.last().copied(), Some((f64::INFINITY, 3)));
        assert_eq!(h.count(), 3);
    }

    #[test]
    fn render_has_real_names_and_labels() {
        let snap = MetricsSnapshot {
            obs: PoolObservation {
                taken_at: 1.0,
                replicas: vec![ReplicaGauges {
                    running: 3,
                    waiting: 2,
                    kv_usage: 0.5,
                    ..Default::default()
                }],
                flow_control_queue_size: 0,
                saturation: 0.625,
            },
            hist: vec![ReplicaHistograms::default()],
        };
        let labels = ExpositionLabels {
            pool: "p".into(),
            model: "m".into(),
            block_size: 16,
            num_gpu_blocks: 100,
            legacy_vllm_names: true,
        };
        let text = render(&snap, &labels);
        assert!(text.contains(
            "vllm:num_requests_running{engine=\"0\",inference_pool=\"p\",model_name=\"m\",pod=\"p-0\"} 3.0"
        ));
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",inference_pool=\"p\",model_name=\"m\",pod=\"p-0\",le=\"2560.0\"} 0.0"));
        assert!(text.contains(
            "inference_pool_per_pod_queue_size{model_server_pod=\"p-0\",name=\"p\"} 2.0"
        ));
        assert!(
            text.contains("llm_d_epp_flow_control_pool_saturation{inference_pool=\"p\"} 0.625")
        );
        assert!(text.contains("vllm:cache_config_info{engine=\"0\",inference_pool=\"p\",model_name=\"m\",pod=\"p-0\",block_size=\"16\",num_gpu_blocks=\"100\"} 1.0"));
        assert!(text.contains("vllm:gpu_cache_usage_perc{"));
        assert!(text.contains("vllm:prefix_cache_queries_total{engine=\"0\",inference_pool=\"p\",model_name=\"m\",pod=\"p-0\"} 0.0"));
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter"));
    }

    #[test]
    fn lagged_view_returns_old_scrapes_and_nothing_in_blackouts() {
        let mut v = LaggedView::new(ViewConfig {
            scrape_interval_s: 15.0,
            extra_lag_s: 5.0,
            blackouts: vec![[40.0, 70.0]],
        });
        let mut t = 0.0;
        while t <= 100.0 {
            if v.scrape_due(t) {
                v.scrape(t, t);
            }
            let seen = v.observe(t).map(|(at, _)| *at);
            if (40.0..70.0).contains(&t) {
                assert_eq!(seen, None, "t={t}");
            } else if t >= 5.0 {
                let at = seen.unwrap();
                assert!(t - at >= 5.0 - 1e-9, "t={t} at={at}");
                if t >= 80.0 {
                    assert!(t - at <= 20.0 + 1e-9, "t={t} at={at}");
                }
                if (70.0..80.0).contains(&t) {
                    assert_eq!(at, 30.0, "scrapes at 45 and 60 failed");
                }
            } else {
                assert_eq!(seen, None);
            }
            t += 0.5;
        }
    }
}
