//! The demo's interactive cost, pure: the waves' own requests paired
//! between the gated pool and its batch-free twin, their TTFT p99 on each
//! and `ρ`, computed as `sluicegate eval` computes them (nearest-rank
//! quantile, censored waits, the same ratio).

use std::collections::HashMap;

use crate::eval::score::ratio;
use crate::sim::InteractiveTiming;
use crate::sim::runner::quantile;
use crate::sim::time::SimTime;

/// One pool's recording: its simulated time when read, and its
/// interactive requests ([`crate::sim::SimHandle::interactive_timings`]).
pub(crate) type Recording<'a> = (SimTime, &'a [InteractiveTiming]);

/// The waves' requests that arrived in a window, paired by arrival index
/// between the gated pool and its twin (same seed, so the same requests
/// at the same moments), with each pool's TTFTs.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct PairedTtft {
    /// `(arrival, TTFT)` on the gated pool, seconds; refusals left out.
    pub(crate) pool: Vec<(f64, f64)>,
    /// The same on the twin.
    pub(crate) twin: Vec<(f64, f64)>,
    /// Requests that arrived in the window, seen by both pools.
    pub(crate) requests: usize,
    /// TTFTs that are lower bounds, both pools together: no first token
    /// when read, counted as the wait so far (as `sluicegate eval` does).
    pub(crate) censored: usize,
    /// Refused requests (429/503) on the gated pool and on the twin.
    pub(crate) refused: (usize, usize),
}

impl PairedTtft {
    /// Pairs the requests of `pool` and `twin` whose arrival lies in
    /// `[from, to]` (simulated seconds of the load generator, the same in
    /// both pools).
    pub(crate) fn of(pool: Recording<'_>, twin: Recording<'_>, from: f64, to: f64) -> Self {
        let in_window = |t: &&InteractiveTiming| (from..=to).contains(&t.arrival);
        let twin_by_index: HashMap<u64, &InteractiveTiming> = twin
            .1
            .iter()
            .filter(in_window)
            .map(|t| (t.index, t))
            .collect();
        let mut out = Self::default();
        for p in pool.1.iter().filter(in_window) {
            let Some(&tw) = twin_by_index.get(&p.index) else {
                continue;
            };
            out.requests += 1;
            for (now, t, into, refused) in [
                (pool.0, p, &mut out.pool, &mut out.refused.0),
                (twin.0, tw, &mut out.twin, &mut out.refused.1),
            ] {
                if t.rejected {
                    *refused += 1;
                    continue;
                }
                let ttft = match t.first_token_at {
                    Some(at) => at - t.arrival,
                    None => {
                        out.censored += 1;
                        (now - t.arrival).max(0.0)
                    }
                };
                into.push((t.arrival, ttft));
            }
        }
        out
    }

    /// TTFT p99 on the gated pool and on the twin, seconds (`None` when a
    /// pool has no TTFT in the window).
    pub(crate) fn p99(&self) -> Option<(f64, f64)> {
        Some((p99(&self.pool)?, p99(&self.twin)?))
    }

    /// `ρ`: TTFT p99 with the batch / without it.
    pub(crate) fn rho(&self) -> Option<f64> {
        self.p99().map(|(with, without)| ratio(with, without))
    }

    /// What the report should add: refusals and lower-bound TTFTs, if any
    /// (`""` when none).
    pub(crate) fn caveats(&self) -> String {
        let mut parts = Vec::new();
        if self.refused != (0, 0) {
            parts.push(format!(
                "{} refused with the batch, {} on the twin",
                self.refused.0, self.refused.1
            ));
        }
        if self.censored > 0 {
            parts.push(format!(
                "{} without a first token yet, counted with their wait",
                self.censored
            ));
        }
        parts.iter().map(|p| format!("; {p}")).collect()
    }

    /// Whether every request has its first token or was refused.
    pub(crate) fn settled(&self) -> bool {
        self.censored == 0
    }
}

/// Nearest-rank p99 of the TTFTs in `v`.
fn p99(v: &[(f64, f64)]) -> Option<f64> {
    quantile(&mut v.iter().map(|(_, x)| *x).collect::<Vec<_>>(), 0.99)
}

/// Rolling TTFT p99 for a chart: at each time in `at`, over the requests
/// that arrived in the `span` seconds up to it (`(t, p99)`, times without
/// a request left out).
pub(crate) fn rolling_p99(v: &[(f64, f64)], at: &[f64], span: f64) -> Vec<(f64, f64)> {
    at.iter()
        .filter_map(|&t| {
            let mut w: Vec<f64> = v
                .iter()
                .filter(|(arrival, _)| *arrival <= t && t - arrival < span)
                .map(|(_, x)| *x)
                .collect();
            quantile(&mut w, 0.99).map(|q| (t, q))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(index: u64, arrival: f64, ttft: Option<f64>) -> InteractiveTiming {
        InteractiveTiming {
            index,
            arrival,
            first_token_at: ttft.map(|x| arrival + x),
            rejected: false,
        }
    }

    #[test]
    fn pairs_by_arrival_index_inside_the_window() {
        // The twin started recording one arrival earlier (index 0), and
        // index 3 arrived after the window: neither is paired. (Binary
        // fractions, so TTFTs come back exact.)
        let pool = [
            timing(1, 1.0, Some(0.125)),
            timing(2, 2.0, Some(0.5)),
            timing(3, 9.0, Some(5.0)),
        ];
        let twin = [
            timing(0, 0.5, Some(9.0)),
            timing(1, 1.0, Some(0.125)),
            timing(2, 2.0, Some(0.25)),
            timing(3, 9.0, Some(0.125)),
        ];
        let p = PairedTtft::of((10.0, &pool), (10.0, &twin), 0.75, 5.0);
        assert_eq!(p.requests, 2);
        assert_eq!(p.pool, vec![(1.0, 0.125), (2.0, 0.5)]);
        assert_eq!(p.twin, vec![(1.0, 0.125), (2.0, 0.25)]);
        assert!(p.settled());
        assert_eq!(p.caveats(), "");
        // Nearest rank with two values: p99 is the larger.
        assert_eq!(p.p99(), Some((0.5, 0.25)));
        assert_eq!(p.rho(), Some(2.0));
    }

    #[test]
    fn p99_is_the_nearest_rank_of_a_hundred_ttfts() {
        // TTFTs 1..=100 ms on the pool, all 50 ms on the twin: p99 is the
        // 99th smallest, 99 ms, and rho 99 / 50.
        let pool: Vec<_> = (0..100)
            .map(|i| timing(i, i as f64, Some((i + 1) as f64 / 1000.0)))
            .collect();
        let twin: Vec<_> = (0..100).map(|i| timing(i, i as f64, Some(0.05))).collect();
        let p = PairedTtft::of((200.0, &pool), (200.0, &twin), 0.0, 200.0);
        let (with, without) = p.p99().unwrap_or_default();
        assert!((with - 0.099).abs() < 1e-12, "{with}");
        assert!((without - 0.05).abs() < 1e-12, "{without}");
        assert!((p.rho().unwrap_or_default() - 1.98).abs() < 1e-9);
    }

    #[test]
    fn a_request_without_a_first_token_counts_its_wait_so_far() {
        let pool = [timing(0, 1.0, None)];
        let twin = [timing(0, 1.0, Some(0.1))];
        let p = PairedTtft::of((4.0, &pool), (4.0, &twin), 0.0, 2.0);
        assert_eq!(p.pool, vec![(1.0, 3.0)]);
        assert_eq!(p.censored, 1);
        assert!(!p.settled());
        assert_eq!(
            p.caveats(),
            "; 1 without a first token yet, counted with their wait"
        );
    }

    #[test]
    fn refused_requests_have_no_ttft_but_are_counted() {
        let mut refused = timing(0, 1.0, None);
        refused.rejected = true;
        let pool = [refused, timing(1, 1.5, Some(0.25))];
        let twin = [timing(0, 1.0, Some(0.125)), timing(1, 1.5, Some(0.25))];
        let p = PairedTtft::of((4.0, &pool), (4.0, &twin), 0.0, 2.0);
        assert_eq!(p.requests, 2);
        assert_eq!(p.refused, (1, 0));
        assert_eq!(p.pool, vec![(1.5, 0.25)]);
        assert!(p.settled());
        assert_eq!(p.p99(), Some((0.25, 0.25)));
        assert_eq!(p.caveats(), "; 1 refused with the batch, 0 on the twin");
    }

    #[test]
    fn no_requests_give_no_rho() {
        let p = PairedTtft::of((1.0, &[]), (1.0, &[]), 0.0, 1.0);
        assert_eq!(p.requests, 0);
        assert_eq!(p.rho(), None);
    }

    #[test]
    fn rolling_p99_looks_back_over_the_span() {
        let v = [(0.5, 0.1), (1.5, 0.3), (3.5, 0.2)];
        assert_eq!(
            rolling_p99(&v, &[0.0, 1.0, 2.0, 4.0, 9.0], 3.0),
            vec![(1.0, 0.1), (2.0, 0.3), (4.0, 0.3)]
        );
    }
}
