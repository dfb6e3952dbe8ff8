//! The driver: one task owns the clock, advances the pool to "now",
//! injects background load and hands tokens to waiting handlers; the
//! state it shares with the handlers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::sim::config::{LoadMode, SimConfig};
use crate::sim::engine::{EngineEvent, Outcome, RequestClass, RequestRecord, SimRequest};
use crate::sim::error::SimError;
use crate::sim::load::{Arrival, LoadGenerator};
use crate::sim::metrics::{ExpositionLabels, LaggedView, MetricsSnapshot, ViewConfig};
use crate::sim::pool::{Admission, Pool, PoolConfig};
use crate::sim::time::SimTime;

/// What a handler waits for.
#[derive(Debug)]
pub(super) enum Ev {
    Token(u32),
    Done(Box<RequestRecord>),
}

/// Background interactive requests being recorded (see
/// [`SimHandle::record_interactive`]).
#[derive(Debug, Default)]
pub(super) struct InteractiveLog {
    pub(super) timings: Vec<InteractiveTiming>,
    /// Position in `timings` of each request still waiting for its first
    /// token or its end, by request id.
    pub(super) open: HashMap<u64, usize>,
}

impl InteractiveLog {
    pub(super) fn first_token(&mut self, id: u64, at: SimTime) {
        if let Some(t) = self.open.get(&id).and_then(|&i| self.timings.get_mut(i)) {
            t.first_token_at.get_or_insert(at);
        }
    }

    pub(super) fn finished(&mut self, r: &RequestRecord) {
        if let Some(t) = self
            .open
            .remove(&r.id)
            .and_then(|i| self.timings.get_mut(i))
        {
            if let Some(at) = r.first_token_at {
                t.first_token_at.get_or_insert(at);
            }
            t.rejected = matches!(r.outcome, Outcome::Rejected429 | Outcome::Rejected503);
        }
    }
}

/// Mutable simulator state, behind one lock.
#[derive(Debug)]
pub(super) struct Live {
    pub(super) pool: Pool,
    /// Handlers waiting for their request, by request id.
    pub(super) waiters: HashMap<u64, mpsc::Sender<Ev>>,
    pub(super) next_id: u64,
    pub(super) background: Option<LoadGenerator>,
    pub(super) next_background: Option<Arrival>,
    /// Background arrivals submitted so far (see
    /// [`SimHandle::interactive_arrivals`]).
    pub(super) background_arrivals: u64,
    /// Background requests with their first tokens, when recording.
    pub(super) interactive_log: Option<InteractiveLog>,
    /// Lagged `/metrics` history (only when `metrics.lag_s > 0`).
    pub(super) history: Option<LaggedView<MetricsSnapshot>>,
    pub(super) events: Vec<EngineEvent>,
    pub(super) released: Vec<(SimRequest, Admission)>,
    pub(super) output_rng: Xoshiro256PlusPlus,
}

impl Live {
    pub(super) fn deliver(&mut self, id: u64, ev: Ev) {
        let finished = matches!(ev, Ev::Done(_));
        if let Some(tx) = self.waiters.get(&id) {
            // Capacity covers every token plus the end, so only a gone
            // receiver fails here; then the client left and work is wasted.
            if tx.try_send(ev).is_err() && !finished {
                self.waiters.remove(&id);
                self.pool.abort(id);
            }
        }
        if finished {
            self.waiters.remove(&id);
        }
    }

    pub(super) fn flush(&mut self) {
        let events = std::mem::take(&mut self.events);
        for e in events {
            if let Some(log) = &mut self.interactive_log {
                match &e {
                    EngineEvent::Token { id, index: 0, at } => log.first_token(*id, *at),
                    EngineEvent::Token { .. } => {}
                    EngineEvent::Finished(r) => log.finished(r),
                }
            }
            match e {
                EngineEvent::Token { id, index, .. } => self.deliver(id, Ev::Token(index)),
                EngineEvent::Finished(r) => self.deliver(r.id, Ev::Done(r)),
            }
        }
        let released = std::mem::take(&mut self.released);
        for (req, a) in released {
            if let Admission::Rejected(code) = a {
                let outcome = if code == 429 {
                    Outcome::Rejected429
                } else {
                    Outcome::Rejected503
                };
                let record = RequestRecord::rejected(&req, outcome);
                if let Some(log) = &mut self.interactive_log {
                    log.finished(&record);
                }
                self.deliver(req.id, Ev::Done(Box::new(record)));
            }
        }
    }

    /// Advances the pool to `now`, interleaving background arrivals exactly.
    pub(super) fn advance(&mut self, now: SimTime) {
        while let Some(a) = self.next_background.filter(|a| a.at <= now) {
            self.pool
                .advance_to(a.at, &mut self.events, &mut self.released);
            let id = self.next_id;
            self.next_id += 1;
            let index = self.background_arrivals;
            self.background_arrivals += 1;
            if let Some(log) = &mut self.interactive_log {
                log.open.insert(id, log.timings.len());
                log.timings.push(InteractiveTiming {
                    index,
                    arrival: a.at,
                    first_token_at: None,
                    rejected: false,
                });
            }
            // A recorded request streams, so its first token is seen
            // before it ends; nobody waits on the events otherwise.
            let admission = self.pool.submit(SimRequest {
                id,
                class: RequestClass::Interactive,
                arrival: a.at,
                prompt_tokens: a.prompt_tokens,
                output_tokens: a.output_tokens,
                max_tokens: a.max_tokens,
                priority: a.priority,
                stream: self.interactive_log.is_some(),
                prefix: std::sync::Arc::default(),
            });
            if let (Admission::Rejected(_), Some(log)) = (admission, &mut self.interactive_log)
                && let Some(t) = log.open.remove(&id).and_then(|i| log.timings.get_mut(i))
            {
                t.rejected = true;
            }
            self.next_background = self
                .background
                .as_mut()
                .and_then(LoadGenerator::next_arrival);
        }
        self.pool
            .advance_to(now, &mut self.events, &mut self.released);
        if let Some(h) = &mut self.history
            && h.scrape_due(now)
        {
            h.scrape(now, self.pool.snapshot());
        }
        self.flush();
    }

    /// Earliest simulated time something happens without outside input.
    pub(super) fn next_wake(&self) -> Option<SimTime> {
        let mut t = self.pool.next_event_time();
        let mut take = |x: Option<SimTime>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t: f64| t.min(x)));
            }
        };
        take(self.next_background.map(|a| a.at));
        take(self.history.as_ref().map(LaggedView::next_scrape));
        t
    }
}

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) cfg: SimConfig,
    pub(super) labels: ExpositionLabels,
    pub(super) blackouts: ViewConfig,
    pub(super) live: Mutex<Live>,
    pub(super) wake: Notify,
    pub(super) origin: Instant,
    pub(super) created: u64,
}

impl Shared {
    pub(super) fn new(cfg: SimConfig) -> Result<Self, SimError> {
        let pool = Pool::new(
            &PoolConfig {
                replicas: cfg.replicas,
                engine: cfg.engine.clone(),
                gateway: cfg.gateway.clone(),
            },
            cfg.seed,
        );
        let mut background = match cfg.interactive.mode {
            LoadMode::Off => None,
            _ => Some(LoadGenerator::new(
                &cfg.interactive,
                cfg.replicas,
                cfg.engine.max_model_len,
                cfg.seed ^ 0x5EED_0001,
            )?),
        };
        let next_background = background.as_mut().and_then(LoadGenerator::next_arrival);
        let history = (cfg.metrics.lag_s > 0.0).then(|| {
            LaggedView::new(ViewConfig {
                scrape_interval_s: (cfg.metrics.lag_s / 10.0).clamp(0.05, 1.0),
                extra_lag_s: cfg.metrics.lag_s,
                blackouts: Vec::new(),
            })
        });
        let labels = ExpositionLabels {
            pool: cfg.pool_name.clone(),
            model: cfg.model_name.clone(),
            block_size: cfg.engine.block_size,
            num_gpu_blocks: cfg.engine.num_gpu_blocks,
            legacy_vllm_names: cfg.metrics.legacy_vllm_names,
        };
        let blackouts = ViewConfig {
            blackouts: cfg.metrics.blackouts.clone(),
            ..ViewConfig::direct()
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Self {
            live: Mutex::new(Live {
                pool,
                waiters: HashMap::new(),
                next_id: 1 << 40, // leaves room below for background ids
                background,
                next_background,
                background_arrivals: 0,
                interactive_log: None,
                history,
                events: Vec::new(),
                released: Vec::new(),
                output_rng: Xoshiro256PlusPlus::seed_from_u64(cfg.seed ^ 0x5EED_0003),
            }),
            labels,
            blackouts,
            wake: Notify::new(),
            origin: Instant::now(),
            created,
            cfg,
        })
    }

    pub(super) fn now(&self) -> SimTime {
        self.origin.elapsed().as_secs_f64() * self.cfg.time_scale
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Live> {
        // A panic while holding the lock leaves plain data behind; serving
        // on beats wedging every later request.
        self.live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

pub(super) async fn drive(shared: Arc<Shared>, cancel: CancellationToken) {
    loop {
        let wake_at = {
            let mut live = shared.lock();
            live.advance(shared.now());
            live.next_wake()
        };
        let sleep = async {
            match wake_at {
                Some(t) => {
                    let real =
                        std::time::Duration::from_secs_f64((t / shared.cfg.time_scale).max(0.0));
                    tokio::time::sleep_until(shared.origin + real).await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            () = cancel.cancelled() => break,
            () = shared.wake.notified() => {}
            () = sleep => {}
        }
    }
    // Dropping the senders ends every waiting handler.
    shared.lock().waiters.clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waves(seed: u64) -> SimConfig {
        let mut cfg = SimConfig {
            seed,
            ..SimConfig::default()
        };
        cfg.interactive.mode = LoadMode::Waves;
        cfg
    }

    fn record(live: &mut Live) {
        live.interactive_log = Some(InteractiveLog::default());
    }

    #[test]
    fn recorded_interactive_requests_pair_by_index_across_fronts_of_one_seed() {
        // Driven in simulated time, no clock: a front and its twin, the
        // twin recording from t = 0 and the front only from t = 5.
        let (a, b) = (
            Shared::new(waves(7)).unwrap(),
            Shared::new(waves(7)).unwrap(),
        );
        let (mut a, mut b) = (a.lock(), b.lock());
        record(&mut b);
        a.advance(5.0);
        record(&mut a);
        let skipped = a.background_arrivals;
        assert!(skipped > 0);
        a.advance(40.0);
        b.advance(40.0);
        let (ta, tb) = (
            &a.interactive_log.as_ref().unwrap().timings,
            &b.interactive_log.as_ref().unwrap().timings,
        );
        assert_eq!(tb.len() as u64, b.background_arrivals);
        assert_eq!(ta.len() as u64, a.background_arrivals - skipped);
        assert_eq!(ta.first().map(|t| t.index), Some(skipped));
        // The same requests with the same first tokens: nothing else ran.
        for t in ta {
            assert_eq!(Some(t), tb.get(t.index as usize));
        }
        // Requests got first tokens before they finished (they stream
        // while recorded), and TTFTs are positive.
        assert!(ta.iter().filter(|t| t.first_token_at.is_some()).count() > ta.len() / 2);
        for t in ta.iter().chain(tb) {
            if let Some(at) = t.first_token_at {
                assert!(at > t.arrival, "{t:?}");
            }
        }
    }

    #[test]
    fn interactive_requests_are_not_recorded_unless_asked() {
        let s = Shared::new(waves(7)).unwrap();
        let mut live = s.lock();
        live.advance(20.0);
        assert!(live.background_arrivals > 0);
        assert!(live.interactive_log.is_none());
    }
}
