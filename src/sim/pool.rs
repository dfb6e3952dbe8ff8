//! Replicas behind a gateway: routing, 429/503 admission, optional flow
//! control, and the discrete-event clock that drives the engines.
//!
//! Pure like the engine: time only moves when the caller says so
//! ([`Pool::advance_to`]), so the virtual-time runner and the real-time HTTP
//! front share this code.

use std::collections::BTreeMap;

use super::config::{EngineConfig, GatewayConfig};
use super::engine::{Engine, EngineEvent, Outcome, RequestRecord, SimRequest};
use super::metrics::{MetricsSnapshot, PoolObservation};
use super::time::SimTime;

/// The gateway's answer to a submitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Sent to this replica.
    Routed(usize),
    /// Held by gateway flow control until the pool has room.
    Held,
    /// Refused with this HTTP status (429 or 503).
    Rejected(u16),
}

/// Shape of a pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolConfig {
    /// Number of replicas.
    pub replicas: usize,
    /// Engine parameters, the same for every replica.
    pub engine: EngineConfig,
    /// Gateway routing and admission.
    pub gateway: GatewayConfig,
}

/// Replicas plus gateway.
#[derive(Debug)]
pub struct Pool {
    gateway: GatewayConfig,
    engines: Vec<Engine>,
    /// Requests held by flow control, in (priority, arrival, id) order.
    held: BTreeMap<(i32, u64, u64), SimRequest>,
    now: SimTime,
    rejected_429: u64,
    rejected_503: u64,
    /// Requests aborted because their client went away.
    aborted: u64,
}

impl Pool {
    /// A pool at time 0; replica `i` draws jitter from `seed` mixed with `i`.
    pub fn new(cfg: &PoolConfig, seed: u64) -> Self {
        let engines = (0..cfg.replicas)
            .map(|i| {
                let s = seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                Engine::new(cfg.engine.clone(), i, s)
            })
            .collect();
        Self {
            gateway: cfg.gateway.clone(),
            engines,
            held: BTreeMap::new(),
            now: 0.0,
            rejected_429: 0,
            rejected_503: 0,
            aborted: 0,
        }
    }

    /// The pool's current time.
    pub fn now(&self) -> SimTime {
        self.now
    }

    /// The replicas.
    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    /// Requests refused with 429 and 503 so far.
    pub fn rejections(&self) -> (u64, u64) {
        (self.rejected_429, self.rejected_503)
    }

    /// Requests aborted so far (their client went away before the end).
    pub fn aborted(&self) -> u64 {
        self.aborted
    }

    /// Largest prompt + output a request may have.
    pub fn max_model_len(&self) -> u32 {
        self.engines.first().map_or(0, |e| e.config().max_model_len)
    }

    /// EPP utilisation-detector saturation: mean over replicas of
    /// `max(waiting / depth, kv / kv_threshold)`.
    pub fn saturation(&self) -> f64 {
        let g = &self.gateway;
        let n = self.engines.len().max(1) as f64;
        self.engines
            .iter()
            .map(|e| {
                (e.num_waiting() as f64 / g.saturation_queue_depth)
                    .max(e.kv_usage() / g.saturation_kv)
            })
            .sum::<f64>()
            / n
    }

    /// Fewest waiting, then lowest KV use, then fewest running, then index.
    fn pick(&self) -> usize {
        let mut best = 0;
        for (i, e) in self.engines.iter().enumerate().skip(1) {
            let b = &self.engines[best];
            let key = (e.num_waiting(), e.kv_usage(), e.num_running());
            let bkey = (b.num_waiting(), b.kv_usage(), b.num_running());
            if key.partial_cmp(&bkey) == Some(std::cmp::Ordering::Less) {
                best = i;
            }
        }
        best
    }

    /// Submits a request at the pool's current time (its `arrival` should be
    /// `now()`). Rejections produce no event; the caller records them.
    pub fn submit(&mut self, req: SimRequest) -> Admission {
        if self.gateway.flow_control && (self.saturation() >= 1.0 || !self.held.is_empty()) {
            if self.held.len() >= self.gateway.flow_control_max_queue as usize {
                self.rejected_429 += 1;
                return Admission::Rejected(429);
            }
            let key = (req.priority, req.arrival.max(0.0).to_bits(), req.id);
            self.held.insert(key, req);
            return Admission::Held;
        }
        self.route(req)
    }

    fn route(&mut self, req: SimRequest) -> Admission {
        let i = self.pick();
        let e = &self.engines[i];
        if let Some(cap) = self.gateway.queue_cap_429 {
            // The pick has the fewest waiting, so every replica is at the cap.
            if e.num_waiting() >= cap as usize {
                self.rejected_429 += 1;
                return Admission::Rejected(429);
            }
        }
        if let Some(cap) = self.gateway.admission_cap_503
            && e.num_waiting() + e.num_running() >= cap as usize
        {
            self.rejected_503 += 1;
            return Admission::Rejected(503);
        }
        let now = self.now;
        let e = &mut self.engines[i];
        e.add_request(req);
        if e.step_end().is_none() {
            e.start_step(now);
        }
        Admission::Routed(i)
    }

    /// Releases flow-control holds while the pool is below saturation.
    fn release_held(&mut self, out: &mut Vec<(SimRequest, Admission)>) {
        while !self.held.is_empty() && self.saturation() < 1.0 {
            let Some((_, req)) = self.held.pop_first() else {
                break;
            };
            let copy = req.clone();
            out.push((copy, self.route(req)));
        }
    }

    /// Earliest pending step end.
    pub fn next_event_time(&self) -> Option<SimTime> {
        self.engines
            .iter()
            .filter_map(Engine::step_end)
            .min_by(f64::total_cmp)
    }

    /// Runs every step that ends at or before `t`, then sets the clock to `t`.
    /// Tokens and completions go to `out`; requests released from flow
    /// control go to `released` with their admission (a release can still be
    /// refused by the 429/503 caps).
    pub fn advance_to(
        &mut self,
        t: SimTime,
        out: &mut Vec<EngineEvent>,
        released: &mut Vec<(SimRequest, Admission)>,
    ) {
        loop {
            let next = self
                .engines
                .iter()
                .enumerate()
                .filter_map(|(i, e)| e.step_end().map(|end| (i, end)))
                .min_by(|a, b| a.1.total_cmp(&b.1));
            let Some((i, end)) = next else { break };
            if end > t {
                break;
            }
            self.now = end;
            let e = &mut self.engines[i];
            e.finish_step(out);
            e.start_step(end);
            if !self.held.is_empty() {
                self.release_held(released);
            }
        }
        if t > self.now {
            self.now = t;
        }
    }

    /// Aborts a request wherever it is.
    pub fn abort(&mut self, id: u64) -> Option<RequestRecord> {
        let record = match self.held.iter().find(|(_, r)| r.id == id).map(|(k, _)| *k) {
            Some(key) => self
                .held
                .remove(&key)
                .map(|r| RequestRecord::rejected(&r, Outcome::Aborted)),
            None => self.engines.iter_mut().find_map(|e| e.abort(id)),
        };
        self.aborted += u64::from(record.is_some());
        record
    }

    /// The gauges a scrape would see now.
    pub fn observe(&self) -> PoolObservation {
        PoolObservation {
            taken_at: self.now,
            replicas: self.engines.iter().map(Engine::gauges).collect(),
            flow_control_queue_size: self.held.len() as u32,
            saturation: self.saturation(),
        }
    }

    /// Gauges plus histograms, for `/metrics`.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            obs: self.observe(),
            hist: self
                .engines
                .iter()
                .map(|e| e.histograms().clone())
                .collect(),
        }
    }

    /// Records of everything still in the pool (end of a run).
    pub fn drain_unfinished(&mut self) -> Vec<RequestRecord> {
        let mut out: Vec<RequestRecord> = std::mem::take(&mut self.held)
            .into_values()
            .map(|r| RequestRecord::rejected(&r, Outcome::Unfinished))
            .collect();
        for e in &mut self.engines {
            out.extend(e.drain_unfinished());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::engine::RequestClass;

    fn pool(replicas: usize, gw: GatewayConfig) -> Pool {
        Pool::new(
            &PoolConfig {
                replicas,
                engine: EngineConfig::default(),
                gateway: gw,
            },
            7,
        )
    }

    fn req(id: u64) -> SimRequest {
        SimRequest {
            id,
            class: RequestClass::Interactive,
            arrival: 0.0,
            prompt_tokens: 100,
            output_tokens: 10,
            max_tokens: 100,
            priority: 0,
            stream: false,
            prefix: std::sync::Arc::default(),
        }
    }

    #[test]
    fn routes_to_fewest_waiting() {
        let mut p = pool(3, GatewayConfig::default());
        let picks: Vec<Admission> = (0..6).map(|i| p.submit(req(i))).collect();
        // First three each start a step on an idle replica (nothing waiting
        // after scheduling); the next three spread because waiting counts rise.
        let mut counts = [0; 3];
        for a in picks {
            if let Admission::Routed(i) = a {
                counts[i] += 1;
            }
        }
        assert_eq!(counts, [2, 2, 2]);
    }

    #[test]
    fn answers_429_above_waiting_cap_and_503_above_admission_cap() {
        let gw = GatewayConfig {
            queue_cap_429: Some(2),
            ..GatewayConfig::default()
        };
        let mut p = pool(1, gw);
        let results: Vec<Admission> = (0..4).map(|i| p.submit(req(i))).collect();
        assert_eq!(results[3], Admission::Rejected(429), "{results:?}");

        let gw = GatewayConfig {
            admission_cap_503: Some(2),
            ..GatewayConfig::default()
        };
        let mut p = pool(1, gw);
        let results: Vec<Admission> = (0..3).map(|i| p.submit(req(i))).collect();
        assert_eq!(results[2], Admission::Rejected(503));
        assert_eq!(p.rejections(), (0, 1));
    }

    #[test]
    fn flow_control_holds_while_saturated_and_releases_later() {
        let gw = GatewayConfig {
            flow_control: true,
            saturation_queue_depth: 1.0,
            ..GatewayConfig::default()
        };
        let mut p = pool(1, gw);
        let a: Vec<Admission> = (0..4).map(|i| p.submit(req(i))).collect();
        assert!(a.contains(&Admission::Held), "{a:?}");
        assert!(p.observe().flow_control_queue_size > 0);
        let (mut ev, mut rel) = (Vec::new(), Vec::new());
        p.advance_to(60.0, &mut ev, &mut rel);
        assert!(!rel.is_empty());
        let done = ev
            .iter()
            .filter(|e| matches!(e, EngineEvent::Finished(_)))
            .count();
        assert_eq!(done, 4);
        assert_eq!(p.observe().flow_control_queue_size, 0);
    }
}
