//! The dispatch path in virtual time: a [`BatchPolicy`] for the simulator's
//! runner that drives the simulated batch with the production gate (built
//! from the catalogue, behind the fail-closed and staleness wrappers), the
//! production window ([`Window::apply`], `available`, `sent`, `finished`,
//! `congested`) and the production congestion hold. Only the transport is
//! different: metrics come from [`SimMetrics`] in-process and requests go
//! to the simulated gateway.
//!
//! Time: each run owns a single-threaded tokio runtime with a paused clock
//! that the harness moves in step with simulated time, so every
//! `Instant::now()` inside the gates, sources and caches reads simulated
//! time. Nothing here sleeps.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use tokio::time::Instant;

use super::endpoint::SimMetrics;
use crate::config::GateSpec;
use crate::dispatch::DispatchSettings;
use crate::dispatch::congestion::{Clearance, Congestion, CongestionPolicy};
use crate::dispatch::pace::Pacer;
use crate::dispatch::window::{Applied, Window};
use crate::gate::{
    Admission, AdmissionRequest, BuildError, Capacity, DispatchEvent, FailClosed, GateContext,
    Ticket, build_gate,
};
use crate::sim::engine::RequestRecord;
use crate::sim::runner::{BatchPolicy, PolicyInput};
use crate::sim::time::SimTime;
use crate::source::MetricsAccess;

/// How readings become dispatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// sluicegate: the window (`N` per fresh reading, in-flight counted),
    /// the congestion hold and the gate's admission.
    Window,
    /// llm-d-async's per-poll budget: every poll release
    /// `floor(batch_size × (D − B))`, in-flight work and 429s ignored.
    PerPoll {
        /// Upstream's batch size (10).
        batch_size: u32,
    },
}

/// One gate reading as the run saw it, for charts and reports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GateSample {
    /// Simulated time of the reading.
    pub t: f64,
    /// `D`.
    pub budget: f64,
    /// `B`.
    pub baseline: f64,
    /// `N` granted by this reading (0 unless it was fresh and open).
    pub n: u64,
    /// The window limit after the reading, if a grant is live.
    pub window: Option<u64>,
    /// Whether the source answered usably.
    pub source_available: bool,
}

/// Why a contender could not run.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// The gate could not be built.
    #[error("gate `{name}`: {source}")]
    Build {
        /// Contender name.
        name: String,
        /// Why.
        #[source]
        source: BuildError,
    },
    /// The virtual-time runtime could not be built.
    #[error("virtual-time runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

/// A production gate driving the simulated batch.
pub struct GatePolicy {
    name: String,
    runtime: tokio::runtime::Runtime,
    /// The instant of simulated time 0 on the paused clock.
    t0: Instant,
    gate: FailClosed,
    window: Window,
    congestion: Congestion,
    settings: DispatchSettings,
    release: Release,
    metrics: Arc<SimMetrics>,
    next_poll: SimTime,
    /// The observer's rule: a fresh, open reading may be refilled as soon
    /// as the window is used up.
    refill_on_demand: bool,
    /// Headroom `D − B` of the latest reading (per-poll release only).
    last_headroom: f64,
    /// Jitter of the congestion hold, seeded.
    rng: Xoshiro256PlusPlus,
    /// Admission tickets of requests admitted this tick, not yet sent.
    admitted: Vec<Ticket>,
    /// Tickets of requests in flight, oldest first (gates that reserve,
    /// such as `local-max-concurrency`, count slots, so any one frees one).
    in_flight: VecDeque<Ticket>,
    /// Metric blackouts of the scenario, to count dark dispatches.
    blackouts: Vec<[f64; 2]>,
    /// Paced release (`dispatch.pace`), as the pool's window applies it
    /// in `run`.
    pacer: Option<Pacer>,
    /// Every reading.
    pub readings: Vec<GateSample>,
    /// Requests released while metrics had been dark longer than
    /// `max_staleness`.
    pub dark_dispatches: u64,
}

impl std::fmt::Debug for GatePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatePolicy")
            .field("name", &self.name)
            .field("release", &self.release)
            .finish_non_exhaustive()
    }
}

/// The queue's static capacity, as the dispatcher's observer uses it.
fn capacity(settings: &DispatchSettings) -> Capacity {
    Capacity {
        max_sys: settings.max_sys,
        unit: settings.unit,
    }
}

/// Labels and metadata of simulated batch requests (none).
static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

impl GatePolicy {
    /// Builds `spec` as `run` would (catalogue constructor, fail-closed and
    /// staleness wrappers) on the in-process `metrics`.
    pub fn new(
        name: impl Into<String>,
        spec: &GateSpec,
        settings: DispatchSettings,
        release: Release,
        metrics: Arc<SimMetrics>,
        seed: u64,
        blackouts: Vec<[f64; 2]>,
    ) -> Result<Self, HarnessError> {
        let name = name.into();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .map_err(HarnessError::Runtime)?;
        let _entered = runtime.enter();
        let t0 = Instant::now();
        let max_staleness = settings.max_staleness;
        let mut ctx = GateContext::new(None, None, settings.poll_interval, max_staleness);
        ctx.metrics = MetricsAccess::InProcess(metrics.clone());
        ctx.seed = seed;
        ctx.capacity = capacity(&settings);
        let gate = build_gate(spec, &ctx).map_err(|source| HarnessError::Build {
            name: name.clone(),
            source,
        })?;
        let pacer = settings.pace.map(|pace| Pacer::new(pace, t0));
        let mut window = Window::new(t0, max_staleness);
        window.set_refill_own_finishes(settings.refill_own_finishes);
        Ok(Self {
            name,
            t0,
            gate: FailClosed::new(gate, max_staleness),
            window,
            congestion: Congestion::new(CongestionPolicy {
                initial_backoff: settings.congestion_backoff,
                max_backoff: settings.congestion_max_backoff,
            }),
            settings,
            release,
            metrics,
            next_poll: 0.0,
            refill_on_demand: false,
            last_headroom: 0.0,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed ^ 0xC0_4E57),
            admitted: Vec::new(),
            in_flight: VecDeque::new(),
            blackouts,
            pacer,
            readings: Vec::new(),
            dark_dispatches: 0,
            runtime,
        })
    }

    /// The paused-clock instant of simulated time `t`.
    fn at(&self, t: SimTime) -> Instant {
        self.t0 + Duration::from_secs_f64(t.max(0.0))
    }

    /// Moves the paused clock to simulated time `t`.
    fn sync_clock(&self, t: SimTime) {
        let target = self.at(t);
        self.runtime.block_on(async move {
            let ahead = target.saturating_duration_since(Instant::now());
            if !ahead.is_zero() {
                tokio::time::advance(ahead).await;
            }
        });
    }

    /// Reads the gate and applies the reading to the window, as the
    /// dispatcher's observer does.
    fn observe(&mut self, now: SimTime) {
        let observation = self.runtime.block_on(self.gate.observe());
        let (n, applied) = self.window.apply(
            &observation,
            capacity(&self.settings),
            self.settings.rounding,
        );
        self.refill_on_demand = applied == Applied::Fresh && n > 0;
        self.next_poll = now + self.settings.poll_interval.as_secs_f64();
        self.last_headroom = observation.headroom();
        self.readings.push(GateSample {
            t: now,
            budget: observation.budget.get(),
            baseline: observation.baseline.get(),
            n: if applied == Applied::Fresh { n } else { 0 },
            window: self.window.grant().map(|(_, limit)| limit),
            source_available: observation.source_available,
        });
    }

    /// How many requests the window, the congestion hold and admission let
    /// go now.
    fn window_release(&mut self, now: SimTime) -> u32 {
        let at = self.at(now);
        let mut want = self.window.available(at);
        if let Some(pacer) = &self.pacer {
            // As the pool's window does in `run` (`PoolWindow::available`):
            // a `tokens` pace lets one request a tick start, charged its
            // prompt when it is sent.
            want = want.min(pacer.room(at));
        }
        let clearance = self.congestion.clearance(at);
        match clearance {
            Clearance::Open => {}
            Clearance::Probe => want = want.min(1),
            Clearance::Held { .. } => want = 0,
        }
        self.admitted.clear();
        for _ in 0..want.min(u64::from(u32::MAX)) {
            let request = AdmissionRequest::new("batch", &NO_LABELS, &NO_LABELS);
            match self.runtime.block_on(self.gate.admit(request)) {
                Admission::Continue(ticket) => self.admitted.push(ticket),
                // Wait / refuse / drop: the rest stays in the backlog.
                _ => break,
            }
        }
        if !self.admitted.is_empty() && clearance == Clearance::Probe {
            self.congestion.probe_started();
        }
        u32::try_from(self.admitted.len()).unwrap_or(u32::MAX)
    }

    fn in_blackout_beyond_staleness(&self, t: SimTime) -> bool {
        self.blackouts
            .iter()
            // Beyond: data from the blackout's start is exactly
            // `max_staleness` old at `a + max_staleness`, and a reading that
            // old still counts (`docs/architecture.md`: older than
            // `max_staleness` is no reading); a send on that very tick is
            // within the rule, not in the dark.
            .any(|[a, b]| t > a + self.settings.max_staleness.as_secs_f64() && t < *b)
    }

    /// The request sent at `sent_at` is over.
    fn ended(&mut self, now: SimTime) {
        self.window.finished(self.at(now), 1);
        self.in_flight.pop_front();
    }
}

impl BatchPolicy for GatePolicy {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn release(&mut self, input: &PolicyInput<'_>) -> u32 {
        let now = input.now;
        self.sync_clock(now);
        let poll_due = now >= self.next_poll;
        let refill = self.refill_on_demand && self.window.available(self.at(now)) == 0;
        self.metrics.advance(now, input.pool, poll_due || refill);
        if poll_due || refill {
            self.observe(now);
        }
        match self.release {
            Release::Window => self.window_release(now),
            Release::PerPoll { batch_size } if poll_due => {
                // Upstream: floor(batch_size × budget), nothing else.
                (f64::from(batch_size) * self.last_headroom).floor() as u32
            }
            Release::PerPoll { .. } => 0,
        }
    }

    fn sent(&mut self, now: SimTime, prompt_tokens: u32) {
        let at = self.at(now);
        self.window.sent(at, 1);
        if let Some(pacer) = &mut self.pacer {
            let cost = pacer.pace().cost(u64::from(prompt_tokens));
            pacer.spend(at, cost);
        }
        self.in_flight
            .push_back(self.admitted.pop().unwrap_or_else(Ticket::none));
        self.gate.on_event(DispatchEvent::Sent { at, cost: 1 });
        if self.in_blackout_beyond_staleness(now) {
            self.dark_dispatches += 1;
        }
    }

    fn refused(&mut self, now: SimTime, status: u16) {
        let at = self.at(now);
        self.ended(now);
        self.window.congested(at);
        let jitter = self.rng.random::<f64>();
        self.congestion.signal(at, at, None, jitter);
        self.gate.on_event(DispatchEvent::Answered {
            at,
            sent_at: at,
            status,
            cost: 1,
        });
    }

    fn finished(&mut self, now: SimTime, record: &RequestRecord) {
        let at = self.at(now);
        let sent_at = self.at(record.arrival);
        self.ended(now);
        self.congestion.answered(sent_at);
        self.gate.on_event(DispatchEvent::Answered {
            at,
            sent_at,
            status: 200,
            cost: 1,
        });
    }
}
