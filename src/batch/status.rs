//! What holds a batch back at a moment, told apart so the live line and
//! the summary never call a full window a closed gate: the gate's source
//! unavailable, a 429/503 congestion hold, the gate closed (`D ≤ B`), the
//! window full (as many requests in flight as it allows), or sending.

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use super::watch::GateStats;
use crate::dispatch::congestion::Clearance;

/// The batch's state at one moment.
#[derive(Debug, Clone, PartialEq)]
pub enum BatchState {
    /// Room in the window and the gate open: work goes out.
    Sending {
        /// Own requests in flight.
        in_flight: u64,
        /// The dispatch window (own in-flight allowed).
        window: u64,
        /// The gate's budget `D`, for gates that read the pool (none for
        /// a local limit, whose `D` is only its free share).
        budget: Option<f64>,
    },
    /// As many requests in flight as the window allows: the batch runs at
    /// its limit (a `local-max-concurrency` limit, `max_SYS`, or `N`).
    WindowFull {
        /// Own requests in flight.
        in_flight: u64,
        /// The dispatch window.
        window: u64,
    },
    /// The gate reads the pool as busy: `D ≤ B`, or `D` so near `B` that
    /// the window allows no request.
    GateClosed {
        /// Budget `D`.
        budget: f64,
        /// Baseline `B`.
        baseline: f64,
        /// The gate's reason.
        reason: String,
    },
    /// The gate's data source could not be read (closed, or a fallback).
    SourceUnavailable {
        /// Why.
        reason: String,
    },
    /// The gateway answered 429/503: nothing goes until the hold ends and
    /// a probe request is answered.
    CongestionHold {
        /// Time left, or `None` while the probe's answer is awaited.
        remaining: Option<Duration>,
    },
}

impl BatchState {
    /// Classifies the moment `now` from the gate's last reading, the
    /// window's numbers and the congestion clearance. A source failure
    /// comes first (nothing else is known), then a congestion hold (it
    /// overrides an open gate), then the gate, then the window.
    pub fn classify(
        gate: &GateStats,
        in_flight: u64,
        window: u64,
        clearance: Clearance,
        now: Instant,
    ) -> Self {
        let observed = gate.observations > 0;
        if observed && !gate.source_available {
            return Self::SourceUnavailable {
                reason: gate.reason.clone(),
            };
        }
        if let Clearance::Held { until } = clearance {
            return Self::CongestionHold {
                remaining: until.map(|t| t.saturating_duration_since(now)),
            };
        }
        if observed && !gate.open && !gate.local_limit {
            return Self::GateClosed {
                budget: gate.budget,
                baseline: gate.baseline,
                reason: gate.reason.clone(),
            };
        }
        // An open pool gate whose window allows no request (`max_SYS ×
        // (D − B)` rounds to 0, e.g. a feedback window near 0) holds the
        // batch back as surely as a closed one: not "sending".
        if observed && gate.source_available && !gate.local_limit && window == 0 {
            return Self::GateClosed {
                budget: gate.budget,
                baseline: gate.baseline,
                reason: gate.reason.clone(),
            };
        }
        // A local limit reading "closed" is our own slots all taken.
        let local_full = observed && !gate.open && gate.local_limit;
        if local_full || (window > 0 && in_flight >= window) {
            return Self::WindowFull { in_flight, window };
        }
        Self::Sending {
            in_flight,
            window,
            budget: (observed && !gate.local_limit).then_some(gate.budget),
        }
    }
}

impl fmt::Display for BatchState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sending {
                in_flight,
                window,
                budget,
            } => {
                write!(f, "sending, {in_flight}/{window} in flight")?;
                if let Some(d) = budget {
                    write!(f, ", gate open D={d:.2}")?;
                }
                Ok(())
            }
            Self::WindowFull { in_flight, window } => {
                write!(f, "window full, {in_flight}/{window} in flight")
            }
            Self::GateClosed {
                budget,
                baseline,
                reason,
            } => {
                if budget > baseline {
                    write!(
                        f,
                        "gate closed, D={budget:.3} allows no request (B={baseline:.2})"
                    )?;
                } else {
                    write!(f, "gate closed, D={budget:.2} <= B={baseline:.2}")?;
                }
                if !reason.is_empty() {
                    write!(f, " ({reason})")?;
                }
                Ok(())
            }
            Self::SourceUnavailable { reason } => write!(f, "gate source unavailable ({reason})"),
            Self::CongestionHold {
                remaining: Some(left),
            } => write!(
                f,
                "congestion hold after 429/503, {:.1} s left",
                left.as_secs_f64()
            ),
            Self::CongestionHold { remaining: None } => {
                write!(f, "congestion hold after 429/503, probe out")
            }
        }
    }
}

/// Time spent in each state during a run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StateTimes {
    /// Sending (room in the window, gate open).
    pub sending: Duration,
    /// Window full (running at the limit).
    pub window_full: Duration,
    /// Gate closed (`D ≤ B`).
    pub gate_closed: Duration,
    /// Gate source unavailable.
    pub source_unavailable: Duration,
    /// Congestion hold after 429/503.
    pub congestion_hold: Duration,
}

impl StateTimes {
    /// Counts `spent` in `state`.
    pub fn add(&mut self, state: &BatchState, spent: Duration) {
        let slot = match state {
            BatchState::Sending { .. } => &mut self.sending,
            BatchState::WindowFull { .. } => &mut self.window_full,
            BatchState::GateClosed { .. } => &mut self.gate_closed,
            BatchState::SourceUnavailable { .. } => &mut self.source_unavailable,
            BatchState::CongestionHold { .. } => &mut self.congestion_hold,
        };
        *slot += spent;
    }

    /// Time something other than the window held work back (the gate, its
    /// source, a congestion hold).
    pub fn held_back(&self) -> Duration {
        self.gate_closed + self.source_unavailable + self.congestion_hold
    }
}

/// States with at least 0.05 s, e.g. `window full 66.5 s, gate closed
/// 3.0 s`; `-` when none.
impl fmt::Display for StateTimes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = [
            ("sending", self.sending),
            ("window full", self.window_full),
            ("gate closed", self.gate_closed),
            ("gate source unavailable", self.source_unavailable),
            ("congestion hold", self.congestion_hold),
        ]
        .into_iter()
        .filter(|(_, d)| d.as_secs_f64() >= 0.05)
        .map(|(name, d)| format!("{name} {:.1} s", d.as_secs_f64()))
        .collect();
        if parts.is_empty() {
            f.write_str("-")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// A rate with precision that fits its size: `1234`, `56.7`, `8.91`,
/// `0.123`, `0`.
pub fn format_rate(per_sec: f64) -> String {
    let v = if per_sec.is_finite() { per_sec } else { 0.0 };
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else if v > 0.0 {
        format!("{v:.3}")
    } else {
        "0".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(open: bool, local_limit: bool) -> GateStats {
        let mut g = GateStats::default();
        g.budget = if open { 0.6 } else { 0.0 };
        g.open = open;
        g.source_available = true;
        g.local_limit = local_limit;
        g.observations = 1;
        g
    }

    #[test]
    fn full_local_limit_is_a_full_window_not_a_closed_gate() {
        let now = Instant::now();
        let s = BatchState::classify(&gate(false, true), 16, 16, Clearance::Open, now);
        assert_eq!(
            s,
            BatchState::WindowFull {
                in_flight: 16,
                window: 16
            }
        );
        assert_eq!(s.to_string(), "window full, 16/16 in flight");
        // Room again: sending, and no D for a local limit.
        let s = BatchState::classify(&gate(true, true), 15, 16, Clearance::Open, now);
        assert_eq!(s.to_string(), "sending, 15/16 in flight");
    }

    #[test]
    fn pool_gate_at_or_below_baseline_is_closed_with_its_reason() {
        let mut g = gate(false, false);
        g.baseline = 0.3;
        g.budget = 0.2;
        g.reason = "kv cache 90%".into();
        let s = BatchState::classify(&g, 8, 8, Clearance::Open, Instant::now());
        assert_eq!(
            s.to_string(),
            "gate closed, D=0.20 <= B=0.30 (kv cache 90%)"
        );
    }

    #[test]
    fn open_pool_gate_with_a_full_window_is_a_full_window() {
        let s = BatchState::classify(&gate(true, false), 24, 24, Clearance::Open, Instant::now());
        assert!(matches!(s, BatchState::WindowFull { .. }));
        let s = BatchState::classify(&gate(true, false), 3, 24, Clearance::Open, Instant::now());
        assert_eq!(s.to_string(), "sending, 3/24 in flight, gate open D=0.60");
    }

    #[test]
    fn a_budget_that_allows_no_request_is_held_back_not_sending() {
        // feedback's window near 0: D = 0.002 > B = 0, but max_sys × D
        // floors to a window of 0.
        let mut g = gate(true, false);
        g.budget = 0.002;
        let s = BatchState::classify(&g, 0, 0, Clearance::Open, Instant::now());
        assert!(matches!(s, BatchState::GateClosed { .. }), "{s}");
        assert_eq!(
            s.to_string(),
            "gate closed, D=0.002 allows no request (B=0.00)"
        );
        let mut t = StateTimes::default();
        t.add(&s, Duration::from_secs(3));
        assert_eq!(t.held_back(), Duration::from_secs(3));
        // Before any reading nothing is known: still sending.
        let s = BatchState::classify(&GateStats::default(), 0, 0, Clearance::Open, Instant::now());
        assert!(matches!(s, BatchState::Sending { .. }), "{s}");
    }

    #[test]
    fn source_failure_and_congestion_hold_come_before_the_gate() {
        let now = Instant::now();
        let mut g = gate(false, false);
        g.source_available = false;
        g.reason = "connection refused".into();
        let s = BatchState::classify(&g, 0, 0, Clearance::Open, now);
        assert!(matches!(s, BatchState::SourceUnavailable { .. }), "{s}");
        let held = Clearance::Held {
            until: Some(now + Duration::from_secs(2)),
        };
        let s = BatchState::classify(&gate(true, false), 0, 4, held, now);
        assert_eq!(s.to_string(), "congestion hold after 429/503, 2.0 s left");
    }

    #[test]
    fn state_times_list_only_states_that_took_time() {
        let mut t = StateTimes::default();
        let full = BatchState::WindowFull {
            in_flight: 1,
            window: 1,
        };
        t.add(&full, Duration::from_secs_f64(66.5));
        assert_eq!(t.to_string(), "window full 66.5 s");
        assert_eq!(t.held_back(), Duration::ZERO);
        assert_eq!(StateTimes::default().to_string(), "-");
    }

    #[test]
    fn rates_keep_about_three_significant_digits() {
        assert_eq!(format_rate(1234.4), "1234");
        assert_eq!(format_rate(56.78), "56.8");
        assert_eq!(format_rate(8.914), "8.91");
        assert_eq!(format_rate(0.1234), "0.123");
        assert_eq!(format_rate(0.0), "0");
    }
}
