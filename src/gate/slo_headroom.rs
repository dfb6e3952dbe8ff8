//! `slo-headroom`: admits the most own batch work in flight that keeps the
//! interactive ITL within its SLO over the batch service horizon. Each new
//! reading of the engines' `/metrics` pages feeds
//! [`super::control::HeadroomModel`]: interactive load `L = running +
//! waiting − own in-flight`, forecast with a local-linear-trend Kalman
//! filter; step time `ITL ≈ a + b·running` by non-negative sliding-window
//! least squares, corrected by an EWMA of actual/expected; nothing while
//! the interval's TTFT quantile is over its limit or requests wait.
//! `D = M × cost_per_request / max_sys`, baseline 0, blind. sluicegate's
//! own gate: no upstream equivalent.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Unit;
use super::control::{Admitted, HeadroomConfig, HeadroomInputs, HeadroomModel, KalmanConfig};
use super::engine_signals::{History, Interval, OwnLoad, own_work_reading, read_pages};
use super::param::{GateParams, ParseCx, loose, validate_engine_urls};
use super::reading::{MetricGate, SourceReport};
use super::{BuildError, DispatchEvent, DispatchGate, GateContext, GateError, Observation};
use crate::source::{Cached, Scrape};

/// Regression points the model needs before it is trusted.
const MIN_POINTS: usize = 3;

/// Parameters of `slo-headroom`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SloHeadroomParams {
    /// The engines' `/metrics` URLs (required, at least one; not set when
    /// used as the `setpoint` of `feedback`).
    #[serde(deserialize_with = "loose::string_list")]
    pub urls: Vec<String>,
    /// Selects the interactive series of the TTFT and ITL histograms.
    #[serde(deserialize_with = "loose::string_map")]
    pub labels: BTreeMap<String, String>,
    /// TTFT SLO in seconds, > 0 (default 0.5).
    #[serde(deserialize_with = "loose::f64")]
    pub ttft_slo: f64,
    /// ITL SLO in seconds, > 0 (default 0.05).
    #[serde(deserialize_with = "loose::f64")]
    pub itl_slo: f64,
    /// Fraction of each SLO kept in reserve, in [0, 1) (default 0.3: the
    /// line in the running count under-predicts the ITL tail that prefill
    /// chunks cause; chosen by the sweep in `docs/gate-quality.md`).
    #[serde(deserialize_with = "loose::f64")]
    pub margin: f64,
    /// Which TTFT quantile is held to the SLO, in (0, 1] (default 0.99).
    #[serde(deserialize_with = "loose::f64")]
    pub ttft_quantile: f64,
    /// Which quantile of the interval's inter-token gaps the regression
    /// fits and holds to the ITL SLO, in (0, 1] (default 0.95: the SLO
    /// bounds each request's p95 ITL, and the mean hides the prefill
    /// spikes that break it).
    #[serde(deserialize_with = "loose::f64")]
    pub itl_quantile: f64,
    /// Waiting requests per engine above this admit nothing, >= 0
    /// (default 0.25, as `feedback`'s).
    #[serde(deserialize_with = "loose::f64")]
    pub waiting_threshold: f64,
    /// How long a batch request admitted now keeps running (default 10 s).
    #[serde(
        deserialize_with = "loose::duration",
        serialize_with = "loose::ser_duration"
    )]
    pub horizon: Duration,
    /// Kalman process noise of the level, requests²/s, > 0 (default 1).
    #[serde(deserialize_with = "loose::f64")]
    pub q_level: f64,
    /// Kalman process noise of the slope, (requests/s)²/s, > 0 (default 0.01).
    #[serde(deserialize_with = "loose::f64")]
    pub q_slope: f64,
    /// Kalman observation noise, requests², > 0 (default 4).
    #[serde(deserialize_with = "loose::f64")]
    pub r: f64,
    /// Readings before the trend is used, >= 1 (default 5).
    #[serde(deserialize_with = "loose::u32")]
    pub warmup: u32,
    /// Points of the step-time regression, >= 3 (default 60).
    #[serde(deserialize_with = "loose::u32")]
    pub regression_window: u32,
    /// Spread of running counts the regression needs, > 0 (default 4).
    #[serde(deserialize_with = "loose::f64")]
    pub min_spread: f64,
    /// EWMA weight of the actual/expected ratio, in (0, 1] (default 0.2).
    #[serde(deserialize_with = "loose::f64")]
    pub correction_alpha: f64,
    /// Requests admitted before the regression is trusted, >= 0 (default 1).
    #[serde(deserialize_with = "loose::f64")]
    pub initial: f64,
    /// Cost of one request in the queue's unit; required when the unit is
    /// tokens or bytes (ignored for requests).
    #[serde(deserialize_with = "loose::opt_f64")]
    pub cost_per_request: Option<f64>,
    /// Requests by which the admitted amount may exceed our own in-flight
    /// work at one reading, > 0 (default 2 % of `max_sys` in requests, at
    /// least 1): admission climbs to the model's headroom in steps.
    #[serde(deserialize_with = "loose::opt_f64")]
    pub max_increase: Option<f64>,
}

impl Default for SloHeadroomParams {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            labels: BTreeMap::new(),
            ttft_slo: 0.5,
            itl_slo: 0.05,
            margin: 0.3,
            ttft_quantile: 0.99,
            itl_quantile: 0.95,
            waiting_threshold: 0.25,
            horizon: Duration::from_secs(10),
            q_level: 1.0,
            q_slope: 0.01,
            r: 4.0,
            warmup: 5,
            regression_window: 60,
            min_spread: 4.0,
            correction_alpha: 0.2,
            initial: 1.0,
            cost_per_request: None,
            max_increase: None,
        }
    }
}

impl SloHeadroomParams {
    /// Validates everything but `urls`, keys prefixed with `prefix`
    /// (`setpoint.` when nested in `feedback`).
    pub(crate) fn validate_model(&self, cx: &mut ParseCx<'_>, prefix: &str) {
        let k = |name: &str| format!("{prefix}{name}");
        cx.positive(&k("ttft_slo"), self.ttft_slo);
        cx.positive(&k("itl_slo"), self.itl_slo);
        if !(0.0..1.0).contains(&self.margin) {
            cx.error(
                &k("margin"),
                format!("must be in [0, 1), got {}", self.margin),
            );
        }
        if !(self.ttft_quantile > 0.0 && self.ttft_quantile <= 1.0) {
            let q = self.ttft_quantile;
            cx.error(&k("ttft_quantile"), format!("must be in (0, 1], got {q}"));
        }
        if !(self.itl_quantile > 0.0 && self.itl_quantile <= 1.0) {
            let q = self.itl_quantile;
            cx.error(&k("itl_quantile"), format!("must be in (0, 1], got {q}"));
        }
        cx.non_negative(&k("waiting_threshold"), self.waiting_threshold);
        if self.horizon.is_zero() {
            cx.error(&k("horizon"), "must be greater than 0");
        }
        cx.positive(&k("q_level"), self.q_level);
        cx.positive(&k("q_slope"), self.q_slope);
        cx.positive(&k("r"), self.r);
        cx.at_least_one(&k("warmup"), self.warmup);
        if self.regression_window < 3 {
            let w = self.regression_window;
            cx.error(&k("regression_window"), format!("must be >= 3, got {w}"));
        }
        cx.positive(&k("min_spread"), self.min_spread);
        if !(self.correction_alpha > 0.0 && self.correction_alpha <= 1.0) {
            let a = self.correction_alpha;
            cx.error(
                &k("correction_alpha"),
                format!("must be in (0, 1], got {a}"),
            );
        }
        cx.non_negative(&k("initial"), self.initial);
        if let Some(c) = self.cost_per_request {
            cx.positive(&k("cost_per_request"), c);
        }
        if let Some(m) = self.max_increase {
            cx.positive(&k("max_increase"), m);
        }
    }

    /// The controller these parameters describe, for the queue of `ctx`.
    pub(crate) fn headroom(&self, ctx: &GateContext) -> Result<Headroom, BuildError> {
        let cost = match (ctx.capacity.unit, self.cost_per_request) {
            (Unit::Requests, _) => 1.0,
            (_, Some(c)) => c,
            (unit, None) => {
                return Err(BuildError::MissingParam {
                    gate_type: "slo-headroom",
                    param: "cost_per_request",
                    why: format!("the queue counts {}", unit.as_str()),
                });
            }
        };
        let cfg = HeadroomConfig {
            itl_limit: self.itl_slo * (1.0 - self.margin),
            ttft_limit: self.ttft_slo * (1.0 - self.margin),
            waiting_threshold: self.waiting_threshold,
            horizon: self.horizon.as_secs_f64(),
            min_spread: self.min_spread,
            min_points: MIN_POINTS,
            correction_alpha: self.correction_alpha,
            initial: self.initial,
            max: ctx.capacity.max_sys / cost,
            // Like `feedback`'s default step: 2 % of max_sys, at least one
            // request.
            max_increase: self
                .max_increase
                .unwrap_or_else(|| (0.02 * ctx.capacity.max_sys / cost).max(1.0)),
        };
        let kalman = KalmanConfig {
            q_level: self.q_level,
            q_slope: self.q_slope,
            r: self.r,
            warmup: self.warmup,
        };
        Ok(Headroom {
            model: HeadroomModel::new(cfg, kalman, self.regression_window as usize),
            ttft_quantile: self.ttft_quantile,
            itl_quantile: self.itl_quantile,
            cost,
        })
    }
}

impl GateParams for SloHeadroomParams {
    fn validate(&self, cx: &mut ParseCx<'_>) {
        validate_engine_urls(cx, &self.urls);
        self.validate_model(cx, "");
    }

    fn build(&self, ctx: &GateContext) -> Result<Box<dyn DispatchGate>, BuildError> {
        let pages = ctx.scrapes(&self.urls)?;
        Ok(Box::new(SloHeadroomGate {
            pages,
            labels: self.labels.clone(),
            max_sys: ctx.capacity.max_sys,
            state: Mutex::new(State {
                headroom: self.headroom(ctx)?,
                history: History::default(),
                own: OwnLoad::default(),
                last: None,
            }),
        }))
    }
}

/// The slo-headroom controller fed by intervals of page readings; also the
/// setpoint of `feedback`.
#[derive(Debug)]
pub(crate) struct Headroom {
    model: HeadroomModel,
    ttft_quantile: f64,
    itl_quantile: f64,
    /// Queue units per request.
    cost: f64,
}

impl Headroom {
    /// Folds in one interval; returns the admitted own in-flight in the
    /// queue's unit and why. `own_requests` is our own in-flight count.
    pub(crate) fn on_interval(&mut self, interval: &Interval, own_requests: f64) -> (f64, String) {
        let d = interval.deltas.as_ref();
        let inputs = HeadroomInputs {
            dt: interval.dt,
            running: interval.now.running,
            waiting: interval.now.waiting,
            engines: interval.now.engines,
            own: own_requests,
            itl: d.and_then(|d| d.itl.quantile_interpolated(self.itl_quantile)),
            ttft_quantile: d.and_then(|d| d.ttft.quantile(self.ttft_quantile)),
        };
        let (m, why) = self.model.on_interval(&inputs);
        let why = match why {
            Admitted::TtftOver => format!(
                "TTFT p{} {:.3} s over its limit",
                self.ttft_quantile * 100.0,
                inputs.ttft_quantile.unwrap_or(f64::NAN)
            ),
            Admitted::Waiting => format!("{} requests waiting", inputs.waiting),
            Admitted::Initial => "regression not trusted yet: initial".to_owned(),
            Admitted::Model {
                load,
                forecast,
                line,
                correction,
            } => format!(
                "L {load:.1} → forecast {forecast:.1}, ITL ≈ {:.4} + {:.5}·running, correction {correction:.2}",
                line.a, line.b
            ),
        };
        (m * self.cost, format!("M = {m:.2} requests: {why}"))
    }
}

#[derive(Debug)]
struct State {
    headroom: Headroom,
    history: History,
    own: OwnLoad,
    /// Admitted amount (queue units) of the newest reading and why.
    last: Option<(f64, String)>,
}

/// The `slo-headroom` gate.
#[derive(Debug)]
pub struct SloHeadroomGate {
    pages: Vec<Cached<Scrape>>,
    labels: BTreeMap<String, String>,
    max_sys: f64,
    state: Mutex<State>,
}

impl SloHeadroomGate {
    fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent (plain field
        // writes), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl MetricGate for SloHeadroomGate {
    const KIND: &'static str = "slo-headroom";

    async fn read(&self, sources: &mut Vec<SourceReport>) -> Result<Observation, GateError> {
        // Errors return before the state is touched (fail closed).
        let snap = read_pages(&self.pages, &self.labels, sources).await?;
        let taken_at = snap.taken_at;
        let mut st = self.state();
        let st = &mut *st;
        if let Some(interval) = st.history.advance(snap) {
            st.last = Some(st.headroom.on_interval(&interval, st.own.requests));
        }
        let (m, reason) = st
            .last
            .clone()
            .unwrap_or_else(|| (0.0, "no reading yet".to_owned()));
        Ok(own_work_reading(m, self.max_sys, taken_at, reason))
    }

    fn on_event(&self, event: DispatchEvent) {
        self.state().own.apply(&event);
    }
}
