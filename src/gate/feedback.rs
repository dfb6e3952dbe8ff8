//! `feedback`: an AIMD window `W` of this queue's own batch work in flight,
//! in the queue's unit, driven by what the engines' `/metrics` pages show
//! (interactive SLO attainment from TTFT and ITL histogram deltas, the
//! waiting queue, new preemptions) and by 429/503 answers. `D = W / max_sys`,
//! baseline 0, blind (the window caps own in-flight at `W`). The rules are
//! in [`super::control::Aimd`]; this file reads the pages and feeds it once
//! per new reading. With `lull_quantile` set, new work starts only at lulls
//! of the foreign load ([`super::control::Lulls`]). sluicegate's own gate:
//! no upstream equivalent.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

use super::Unit;
use super::control::{Aimd, AimdConfig, Lulls, Signals, Step, attainment};
use super::engine_signals::{History, OwnLoad, own_work_reading, read_pages};
use super::param::{GateParams, ParseCx, loose, validate_engine_urls};
use super::reading::{MetricGate, SourceReport};
use super::slo_headroom::{Headroom, SloHeadroomParams};
use super::{BuildError, DispatchEvent, DispatchGate, GateContext, GateError, Observation};
use crate::source::{Cached, Scrape};

/// Parameters of `feedback`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FeedbackParams {
    /// The engines' `/metrics` URLs (required, at least one).
    #[serde(deserialize_with = "loose::string_list")]
    pub urls: Vec<String>,
    /// Selects the interactive series of the TTFT and ITL histograms (e.g.
    /// `model_name`); empty = every series, batch included.
    #[serde(deserialize_with = "loose::string_map")]
    pub labels: BTreeMap<String, String>,
    /// TTFT SLO in seconds, > 0 (default 0.5).
    #[serde(deserialize_with = "loose::f64")]
    pub ttft_slo: f64,
    /// ITL SLO in seconds, > 0 (default 0.05).
    #[serde(deserialize_with = "loose::f64")]
    pub itl_slo: f64,
    /// Attainment below this cuts, in (0, 1] (default 0.986: attainment
    /// counts token gaps, and the SLO allows each request 5 % of slow ones;
    /// `docs/gate-quality.md` has the sweep behind the defaults).
    #[serde(deserialize_with = "loose::f64")]
    pub target: f64,
    /// Growth needs attainment >= target + margin, >= 0 (default 0.005).
    #[serde(deserialize_with = "loose::f64")]
    pub margin: f64,
    /// Waiting requests per engine above this count as waiting, >= 0
    /// (default 0.25: a quarter of the engines with one request waiting; a pool of
    /// many engines almost always has one request waiting for the next
    /// step somewhere, which is no queue).
    #[serde(deserialize_with = "loose::f64")]
    pub waiting_threshold: f64,
    /// Waiting over this many consecutive readings cuts, >= 1 (default 1:
    /// a queue at the engines is the earliest sign of a wave).
    #[serde(deserialize_with = "loose::u32")]
    pub waiting_persist: u32,
    /// Window at start in the queue's unit (default 5 % of `max_sys`, at
    /// least 1 for requests).
    #[serde(deserialize_with = "loose::opt_f64")]
    pub initial_window: Option<f64>,
    /// Floor of the window in the queue's unit, >= 0 (default 0).
    #[serde(deserialize_with = "loose::f64")]
    pub min_window: f64,
    /// Growth step per clean reading in the queue's unit (default 2 % of
    /// `max_sys`, at least 1 for requests).
    #[serde(deserialize_with = "loose::opt_f64")]
    pub increase: Option<f64>,
    /// Cut factor in (0, 1) (default 0.5).
    #[serde(deserialize_with = "loose::f64")]
    pub decrease: f64,
    /// Relative jitter of the growth step in [0, 1) (default 0.2).
    #[serde(deserialize_with = "loose::f64")]
    pub jitter: f64,
    /// Growth needs own in-flight >= this fraction of `W`, in [0, 1]
    /// (default 0.5).
    #[serde(deserialize_with = "loose::f64")]
    pub use_fraction: f64,
    /// Cut in proportion to how far a reading misses (attainment below
    /// `target`, waiting above `waiting_threshold`), the full `decrease`
    /// only for a miss of a whole allowance, 429/503 or preemption
    /// (default false: cut by `decrease` on any miss).
    #[serde(deserialize_with = "loose::bool")]
    pub graded_cut: bool,
    /// Start new batch requests only at lulls of the interactive load: at
    /// readings whose foreign requests per engine (running and waiting, less
    /// ours in flight) are at or below this quantile of the last
    /// `lull_readings` readings, in [0, 1); unset = start at any reading
    /// (`control::Lulls` says why).
    #[serde(deserialize_with = "loose::opt_f64")]
    pub lull_quantile: Option<f64>,
    /// Readings the lull level is taken over, >= 1 (default 120: 30 s at
    /// the batch runner's 250 ms, 2 min at `run`'s 1 s).
    #[serde(deserialize_with = "loose::u32")]
    pub lull_readings: u32,
    /// Most new work started per lull, in the queue's unit, > 0 (default
    /// the growth step `increase`): starts bunched into one lull make one
    /// long prefill step, which an interactive request arriving during it
    /// waits for.
    #[serde(deserialize_with = "loose::opt_f64")]
    pub lull_burst: Option<f64>,
    /// `slo-headroom` parameters (without `urls`: it reads these pages)
    /// whose admitted amount caps `W`.
    pub setpoint: Option<SloHeadroomParams>,
}

impl Default for FeedbackParams {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            labels: BTreeMap::new(),
            ttft_slo: 0.5,
            itl_slo: 0.05,
            target: 0.986,
            margin: 0.005,
            waiting_threshold: 0.25,
            waiting_persist: 1,
            initial_window: None,
            min_window: 0.0,
            increase: None,
            decrease: 0.5,
            jitter: 0.2,
            use_fraction: 0.5,
            graded_cut: false,
            lull_quantile: None,
            lull_readings: 120,
            lull_burst: None,
            setpoint: None,
        }
    }
}

impl GateParams for FeedbackParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        validate_engine_urls(cx, &self.urls);
        cx.positive("ttft_slo", self.ttft_slo);
        cx.positive("itl_slo", self.itl_slo);
        if !(self.target > 0.0 && self.target <= 1.0) {
            cx.error("target", format!("must be in (0, 1], got {}", self.target));
        }
        cx.non_negative("margin", self.margin);
        cx.non_negative("waiting_threshold", self.waiting_threshold);
        cx.at_least_one("waiting_persist", self.waiting_persist);
        if let Some(w) = self.initial_window {
            cx.non_negative("initial_window", w);
        }
        cx.non_negative("min_window", self.min_window);
        if let Some(i) = self.increase {
            cx.positive("increase", i);
        }
        if !(self.decrease > 0.0 && self.decrease < 1.0) {
            cx.error(
                "decrease",
                format!("must be in (0, 1), got {}", self.decrease),
            );
        }
        if !(0.0..1.0).contains(&self.jitter) {
            cx.error("jitter", format!("must be in [0, 1), got {}", self.jitter));
        }
        cx.fraction("use_fraction", self.use_fraction);
        if let Some(q) = self.lull_quantile
            && !(0.0..1.0).contains(&q)
        {
            cx.error("lull_quantile", format!("must be in [0, 1), got {q}"));
        }
        cx.at_least_one("lull_readings", self.lull_readings);
        if let Some(b) = self.lull_burst {
            cx.positive("lull_burst", b);
        }
        if let Some(s) = &self.setpoint {
            if !s.urls.is_empty() {
                cx.error(
                    "setpoint.urls",
                    "not allowed: the setpoint reads the feedback gate's urls",
                );
            }
            s.validate_model(cx, "setpoint.");
        }
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let pages = ctx.scrapes(&self.urls)?;
        let max_sys = ctx.capacity.max_sys;
        let requests = ctx.capacity.unit == Unit::Requests;
        // One request has no meaning in tokens or bytes, so steps are a
        // fraction of max_sys: empty to full takes 50 clean readings
        // whatever the unit. In requests, never below one request, or a
        // small max_sys could never show use of the window.
        let at_least = |x: f64| if requests { x.max(1.0) } else { x };
        let increase = self.increase.unwrap_or_else(|| at_least(0.02 * max_sys));
        let initial = self
            .initial_window
            .unwrap_or_else(|| at_least(0.05 * max_sys));
        let cfg = AimdConfig {
            initial,
            min: self.min_window.min(max_sys),
            max: max_sys,
            increase,
            decrease: self.decrease,
            jitter: self.jitter,
            target: self.target,
            margin: self.margin,
            waiting_threshold: self.waiting_threshold,
            waiting_persist: self.waiting_persist,
            use_fraction: self.use_fraction,
            graded: self.graded_cut,
        };
        let setpoint = match &self.setpoint {
            Some(s) => Some(s.headroom(ctx)?),
            None => None,
        };
        Ok(Box::new(FeedbackGate {
            pages,
            labels: self.labels.clone(),
            ttft_slo: self.ttft_slo,
            itl_slo: self.itl_slo,
            max_sys,
            state: Mutex::new(State {
                aimd: Aimd::new(cfg, ctx.seed),
                history: History::default(),
                own: OwnLoad::default(),
                setpoint,
                lulls: self.lull_quantile.map(|q| {
                    (
                        Lulls::new(q, self.lull_readings as usize),
                        self.lull_burst.unwrap_or(increase),
                    )
                }),
                last: None,
            }),
        }))
    }
}

/// What the gate learns over time.
#[derive(Debug)]
struct State {
    aimd: Aimd,
    history: History,
    own: OwnLoad,
    /// The slo-headroom controller capping `W`, if configured.
    setpoint: Option<Headroom>,
    /// The lull rule and the most started per lull, if configured.
    lulls: Option<(Lulls, f64)>,
    /// The window reported for the newest reading and why.
    last: Option<(f64, String)>,
}

/// The `feedback` gate.
#[derive(Debug)]
pub struct FeedbackGate {
    pages: Vec<Cached<Scrape>>,
    labels: BTreeMap<String, String>,
    ttft_slo: f64,
    itl_slo: f64,
    max_sys: f64,
    state: Mutex<State>,
}

impl FeedbackGate {
    fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent (plain field
        // writes), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The window `W` now, in the queue's unit.
    pub fn window(&self) -> f64 {
        self.state().aimd.window()
    }
}

fn describe(step: Step) -> String {
    match step {
        Step::Grew(by) => format!("grew by {by:.3}"),
        Step::Cut(c) => format!("cut: {}", c.label()),
        Step::Held(h) => format!("held: {h:?}"),
    }
}

impl MetricGate for FeedbackGate {
    const KIND: &'static str = "feedback";

    async fn read(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        // Errors return before the state is touched: no growth on missing
        // data, and the fail-closed wrapper closes the gate.
        let snap = read_pages(&self.pages, &self.labels, sources).await?;
        let taken_at = snap.taken_at;
        let mut st = self.state();
        let st = &mut *st;
        if let Some(interval) = st.history.advance(snap) {
            let cap = st
                .setpoint
                .as_mut()
                .map(|h| h.on_interval(&interval, st.own.requests));
            let reason = match &interval.deltas {
                None => "first reading or counter reset: baseline only".to_owned(),
                Some(d) => {
                    let signals = Signals {
                        attainment: attainment(
                            d.ttft.fraction_within(self.ttft_slo),
                            d.itl.fraction_within(self.itl_slo),
                        ),
                        waiting: interval.now.waiting / interval.now.engines.max(1.0),
                        new_preemptions: d.preemptions,
                        own_in_flight: st.own.units,
                    };
                    let step = st.aimd.on_reading(&signals);
                    format!(
                        "attainment {}, waiting {}, new preemptions {}, own in flight {}: {}",
                        signals
                            .attainment
                            .map_or_else(|| "n/a".to_owned(), |a| format!("{a:.4}")),
                        signals.waiting,
                        signals.new_preemptions,
                        signals.own_in_flight,
                        describe(step)
                    )
                }
            };
            let mut w = st.aimd.window();
            let mut reason = format!("W = {w:.3} ({reason})");
            if let Some((admitted, why)) = cap {
                st.aimd.cap(admitted);
                w = w.min(admitted);
                reason.push_str(&format!("; setpoint {admitted:.3} ({why})"));
            }
            if let Some((lulls, burst)) = st.lulls.as_mut() {
                let now = &interval.now;
                let foreign = (now.running + now.waiting - st.own.requests) / now.engines.max(1.0);
                let lull = lulls.on_reading(foreign);
                w = if lull.is_lull {
                    w.min(st.own.units + *burst)
                } else {
                    // No new start until a lull: what runs goes on (the
                    // window never recalls a request), and a request of
                    // ours that finishes frees no room for another.
                    0.0
                };
                reason.push_str(&format!(
                    "; {} foreign requests per engine {:.2} {} lull level {:.2}",
                    if lull.is_lull { "lull:" } else { "no start:" },
                    lull.foreign,
                    if lull.is_lull { "<=" } else { ">" },
                    lull.level
                ));
            }
            st.last = Some((w, reason));
        }
        let (w, reason) = st
            .last
            .clone()
            .unwrap_or_else(|| (st.aimd.window(), "no reading yet".to_owned()));
        Ok(own_work_reading(w, self.max_sys, taken_at, reason))
    }

    fn notes(&self) -> Vec<String> {
        let state = self.state();
        let c = *state.aimd.config();
        // Three decimals at most: `0.05 × 48` reads 2.4, not 2.4000000000000004.
        let n = |x: f64| {
            let s = format!("{x:.3}");
            s.trim_end_matches('0').trim_end_matches('.').to_owned()
        };
        let graded = if c.graded {
            " (in proportion to the miss below a whole allowance, unless the previous reading missed too)"
        } else {
            ""
        };
        let mut notes = vec![format!(
            "AIMD window in [{}, {}] from {}: +{} (±{:.0} %) per clean reading (attainment >= {} + {}, own in flight >= {} of the window), ×{} on 429/503, preemption, attainment < {} or waiting > {} per engine for {} readings{graded}; attainment of TTFT <= {} s and ITL <= {} s",
            n(c.min),
            n(c.max),
            n(c.initial),
            n(c.increase),
            c.jitter * 100.0,
            n(c.target),
            n(c.margin),
            n(c.use_fraction),
            n(c.decrease),
            n(c.target),
            n(c.waiting_threshold),
            c.waiting_persist,
            n(self.ttft_slo),
            n(self.itl_slo)
        )];
        if let Some((l, burst)) = &state.lulls {
            notes.push(format!(
                "new batch work starts only at lulls, at most {} per lull: readings whose foreign requests per engine are at or below the {} quantile of the last {} readings",
                n(*burst),
                n(l.quantile()),
                l.readings()
            ));
        }
        notes
    }

    fn on_event(&self, event: DispatchEvent) {
        let mut st = self.state();
        st.own.apply(&event);
        if event.is_congestion() {
            let cut = st.aimd.on_congestion();
            tracing::debug!(cut, window = st.aimd.window(), "feedback gate saw 429/503");
        }
    }
}
