//! What the feedback gates (`feedback`, `slo-headroom`) read from vLLM
//! `/metrics` pages, and what they share: one snapshot of the pool per
//! reading (running, waiting, preemptions, the TTFT and ITL histograms),
//! the interval between two snapshots (deltas of the cumulative counters),
//! and this queue's own in-flight work learnt from dispatch events.
//!
//! The histograms are filtered by `labels`: vLLM's histograms count every
//! request of an engine, batch and interactive alike, so without a filter
//! (e.g. the interactive `model_name`) attainment is diluted by batch
//! requests. Running, waiting and preemptions are engine-wide, so they are
//! summed over every series.

use std::collections::BTreeMap;

use futures_util::future::join_all;
use tokio::time::Instant;

use super::control::Histogram;
use super::reading::{SourceReport, non_negative, pool_reading};
use super::{DispatchEvent, GateError, Observation};
use crate::source::{Cached, Exposition, Scrape};

/// vLLM's TTFT histogram.
pub(crate) const TTFT: &str = "vllm:time_to_first_token_seconds";
/// vLLM's inter-token latency histogram.
pub(crate) const ITL: &str = "vllm:inter_token_latency_seconds";
/// The same, before vLLM renamed it.
const ITL_LEGACY: &str = "vllm:time_per_output_token_seconds";

/// A feedback gate's reading: `amount` of our own work (queue units) the
/// pool may hold now, as `D = amount / max_sys` with baseline 0, capping
/// our own in flight at it. Blind: the amount is our own work, not a page
/// reading that counts it.
pub(crate) fn own_work_reading(
    amount: f64,
    max_sys: f64,
    taken_at: Instant,
    reason: String,
) -> Observation {
    let mut observation = pool_reading(amount / max_sys, 0.0, taken_at, None, false, reason);
    observation.caps_own_in_flight = true;
    observation
}

/// One reading of every page.
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    /// When each page's data was taken: a reading is new when this changes.
    pub(crate) key: Vec<Instant>,
    /// The oldest page's time, which the observation reports.
    pub(crate) taken_at: Instant,
    /// Requests running, summed over engines.
    pub(crate) running: f64,
    /// Requests waiting, summed over engines.
    pub(crate) waiting: f64,
    /// Engines seen (series of `vllm:num_requests_running`), so waiting
    /// thresholds can be per engine: a pool of 16 almost always has one
    /// request waiting for the next step somewhere.
    pub(crate) engines: f64,
    /// Cumulative preemptions, summed over engines.
    pub(crate) preemptions: f64,
    /// Cumulative TTFT histogram of the selected series.
    pub(crate) ttft: Histogram,
    /// Cumulative ITL histogram of the selected series.
    pub(crate) itl: Histogram,
}

/// Sum of every series of gauge or counter `name`; an error when absent.
fn sum_of(page: &Exposition, name: &str) -> Result<f64, GateError> {
    let mut total = None;
    for s in page.named(name) {
        let v = non_negative(s.value, name)?;
        total = Some(total.unwrap_or(0.0) + v);
    }
    total.ok_or_else(|| GateError::SourceUnavailable(format!("{name} is missing")))
}

fn histogram(
    page: &Exposition,
    names: &[&str],
    labels: &BTreeMap<String, String>,
) -> Result<Histogram, GateError> {
    for name in names {
        if let Some(h) = Histogram::select(&page.histogram(name), labels) {
            let values = h.buckets.iter().map(|b| b.1).chain([h.count, h.sum]);
            for v in values {
                non_negative(v, name)?;
            }
            return Ok(h);
        }
    }
    Err(GateError::SourceUnavailable(format!(
        "no {} series matching labels {}",
        names.first().copied().unwrap_or_default(),
        super::reading::show_labels(labels)
    )))
}

/// Adds `b` into `a` (same edges: the pages come from one vLLM version).
fn merge(a: &mut Histogram, b: Histogram) {
    for (le, c) in b.buckets {
        match a.buckets.iter_mut().find(|(e, _)| *e == le) {
            Some((_, total)) => *total += c,
            None => a.buckets.push((le, c)),
        }
    }
    a.buckets.sort_by(|x, y| x.0.total_cmp(&y.0));
    a.count += b.count;
    a.sum += b.sum;
}

/// Reads every page, recording each in `sources`. Any page that cannot
/// be read, or lacks a metric, is an error for the whole reading: a
/// controller fed half the pool would grow on missing data.
pub(crate) async fn read_pages(
    pages: &[Cached<Scrape>],
    labels: &BTreeMap<String, String>,
    sources: &mut Vec<SourceReport>,
) -> Result<Snapshot, GateError> {
    let read = join_all(pages.iter().map(Cached::get)).await;
    let mut snap: Option<Snapshot> = None;
    let mut first_error = None;
    for (cache, page) in pages.iter().zip(read) {
        let mut report = SourceReport::new("engine metrics", cache.source().describe_url());
        let one = page
            .map_err(|e| GateError::source(report.target.clone(), e))
            .and_then(|p| {
                let running = sum_of(&p.value, "vllm:num_requests_running")?;
                let engines = p.value.named("vllm:num_requests_running").count() as f64;
                let waiting = sum_of(&p.value, "vllm:num_requests_waiting")?;
                let preemptions = sum_of(&p.value, "vllm:num_preemptions_total")?;
                let ttft = histogram(&p.value, &[TTFT], labels)?;
                let itl = histogram(&p.value, &[ITL, ITL_LEGACY], labels)?;
                Ok(Snapshot {
                    key: vec![p.taken_at],
                    taken_at: p.taken_at,
                    running,
                    waiting,
                    engines,
                    preemptions,
                    ttft,
                    itl,
                })
            });
        match one {
            Ok(s) => {
                report.values = vec![
                    ("running".into(), s.running),
                    ("waiting".into(), s.waiting),
                    ("preemptions_total".into(), s.preemptions),
                    ("ttft_count".into(), s.ttft.count),
                    ("itl_count".into(), s.itl.count),
                ];
                report.outcome = "used".into();
                snap = Some(match snap.take() {
                    None => s,
                    Some(mut all) => {
                        all.key.extend(s.key);
                        all.taken_at = all.taken_at.min(s.taken_at);
                        all.running += s.running;
                        all.waiting += s.waiting;
                        all.engines += s.engines;
                        all.preemptions += s.preemptions;
                        merge(&mut all.ttft, s.ttft);
                        merge(&mut all.itl, s.itl);
                        all
                    }
                });
            }
            Err(e) => {
                report.outcome = format!("error: {e}");
                first_error.get_or_insert(e);
            }
        }
        sources.push(report);
    }
    match (first_error, snap) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => Ok(s),
        (None, None) => Err(GateError::SourceUnavailable("no engine URLs".into())),
    }
}

/// What happened between two readings.
#[derive(Debug, Clone)]
pub(crate) struct Interval {
    /// Seconds between the readings (0 for the first).
    pub(crate) dt: f64,
    /// The newer reading.
    pub(crate) now: Snapshot,
    /// Deltas, or `None` for the first reading and after a counter reset
    /// (an engine restarted): such a reading only sets the new baseline.
    pub(crate) deltas: Option<Deltas>,
}

/// Counter deltas over an interval.
#[derive(Debug, Clone)]
pub(crate) struct Deltas {
    /// TTFTs observed in the interval.
    pub(crate) ttft: Histogram,
    /// Inter-token gaps observed in the interval.
    pub(crate) itl: Histogram,
    /// Preemptions in the interval.
    pub(crate) preemptions: f64,
}

/// The previous reading, against which the next is differenced.
#[derive(Debug, Clone, Default)]
pub(crate) struct History {
    last: Option<Snapshot>,
}

impl History {
    /// The interval ending at `snap`, or `None` when `snap` is the reading
    /// already seen (a re-read of cached pages changes nothing).
    pub(crate) fn advance(&mut self, snap: Snapshot) -> Option<Interval> {
        let prev = match &self.last {
            Some(p) if p.key == snap.key => return None,
            p => p.clone(),
        };
        self.last = Some(snap.clone());
        let Some(prev) = prev else {
            return Some(Interval {
                dt: 0.0,
                now: snap,
                deltas: None,
            });
        };
        let dt = snap
            .taken_at
            .saturating_duration_since(prev.taken_at)
            .as_secs_f64();
        let preemptions = snap.preemptions - prev.preemptions;
        let deltas = match (snap.ttft.since(&prev.ttft), snap.itl.since(&prev.itl)) {
            (Some(ttft), Some(itl)) if preemptions >= 0.0 => Some(Deltas {
                ttft,
                itl,
                preemptions,
            }),
            _ => None,
        };
        Some(Interval {
            dt,
            now: snap,
            deltas,
        })
    }
}

/// This queue's own work in flight, from dispatch events.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct OwnLoad {
    /// Requests in flight.
    pub(crate) requests: f64,
    /// Their cost in the queue's unit.
    pub(crate) units: f64,
}

impl OwnLoad {
    /// Counts a sent request in and an answered or failed one out (never
    /// below zero: events of requests sent before this gate existed).
    pub(crate) fn apply(&mut self, event: &DispatchEvent) {
        let (sign, cost) = match *event {
            DispatchEvent::Sent { cost, .. } => (1.0, cost),
            DispatchEvent::Answered { cost, .. } | DispatchEvent::Failed { cost, .. } => {
                (-1.0, cost)
            }
        };
        self.requests = (self.requests + sign).max(0.0);
        // u64 → f64 is exact below 2^53, far beyond any in-flight cost.
        self.units = (self.units + sign * cost as f64).max(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::text::parse;

    #[test]
    fn own_load_counts_sent_minus_finished_and_never_goes_negative() {
        let at = Instant::now();
        let mut own = OwnLoad::default();
        own.apply(&DispatchEvent::Sent { at, cost: 10 });
        own.apply(&DispatchEvent::Sent { at, cost: 5 });
        own.apply(&DispatchEvent::Answered {
            at,
            sent_at: at,
            status: 200,
            cost: 10,
        });
        assert_eq!(
            own,
            OwnLoad {
                requests: 1.0,
                units: 5.0
            }
        );
        for _ in 0..3 {
            own.apply(&DispatchEvent::Failed {
                at,
                sent_at: at,
                cost: 5,
            });
        }
        assert_eq!(own, OwnLoad::default());
    }

    fn snapshot(at: Instant, preemptions: f64, ttft_fast: f64) -> Snapshot {
        let page = parse(&format!(
            "vllm:num_requests_running{{engine=\"0\"}} 3\n\
             vllm:num_requests_waiting{{engine=\"0\"}} 1\n\
             vllm:num_preemptions_total{{engine=\"0\"}} {preemptions}\n\
             {TTFT}_bucket{{engine=\"0\",le=\"0.5\"}} {ttft_fast}\n\
             {TTFT}_bucket{{engine=\"0\",le=\"+Inf\"}} 10\n\
             {TTFT}_count{{engine=\"0\"}} 10\n\
             {TTFT}_sum{{engine=\"0\"}} 3\n\
             {ITL}_bucket{{engine=\"0\",le=\"0.05\"}} 10\n\
             {ITL}_bucket{{engine=\"0\",le=\"+Inf\"}} 10\n\
             {ITL}_count{{engine=\"0\"}} 10\n\
             {ITL}_sum{{engine=\"0\"}} 0.2\n"
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        let labels = BTreeMap::new();
        let ttft = histogram(&page, &[TTFT], &labels).unwrap_or_else(|e| panic!("{e}"));
        let itl = histogram(&page, &[ITL], &labels).unwrap_or_else(|e| panic!("{e}"));
        Snapshot {
            key: vec![at],
            taken_at: at,
            running: sum_of(&page, "vllm:num_requests_running").unwrap_or(-1.0),
            waiting: 1.0,
            engines: 1.0,
            preemptions,
            ttft,
            itl,
        }
    }

    #[test]
    fn a_re_read_is_no_interval_and_a_reset_sets_a_new_baseline() {
        let t0 = Instant::now();
        let t1 = t0 + std::time::Duration::from_secs(2);
        let mut h = History::default();
        let first = h
            .advance(snapshot(t0, 4.0, 9.0))
            .unwrap_or_else(|| panic!("new"));
        assert!(first.deltas.is_none());
        assert_eq!(first.now.running, 3.0);
        assert!(h.advance(snapshot(t0, 4.0, 9.0)).is_none());
        let next = h
            .advance(snapshot(t1, 6.0, 9.0))
            .unwrap_or_else(|| panic!("new"));
        assert_eq!(next.dt, 2.0);
        assert_eq!(next.deltas.map(|d| d.preemptions), Some(2.0));
        // Preemptions went down: an engine restarted.
        let t2 = t1 + std::time::Duration::from_secs(2);
        let reset = h
            .advance(snapshot(t2, 0.0, 9.0))
            .unwrap_or_else(|| panic!("new"));
        assert!(reset.deltas.is_none());
    }

    #[test]
    fn a_missing_metric_or_histogram_is_an_error() {
        let page = parse("vllm:num_requests_running 1\n").unwrap_or_else(|e| panic!("{e}"));
        assert!(sum_of(&page, "vllm:num_requests_waiting").is_err());
        assert!(histogram(&page, &[TTFT], &BTreeMap::new()).is_err());
    }
}
