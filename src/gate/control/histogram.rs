//! vLLM's cumulative histograms read as intervals: the delta between two
//! readings, the fraction at or below a threshold, quantiles and the mean;
//! and interactive SLO attainment from the TTFT and ITL fractions.

use crate::source::text::HistogramSeries;

/// A cumulative histogram (vLLM's counters since engine start), summed over
/// the selected series: `(upper bound, cumulative count)` sorted by bound,
/// the total count and the sum of observations.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Histogram {
    /// `(le, cumulative count)`, sorted by `le`.
    pub buckets: Vec<(f64, f64)>,
    /// Number of observations.
    pub count: f64,
    /// Sum of the observed values.
    pub sum: f64,
}

impl Histogram {
    /// The sum of `series` whose labels include every `(name, value)` of
    /// `labels`; `None` when no series matches. Series of different engines
    /// share vLLM's bucket edges; an edge only some series have is summed
    /// over those that have it (never happens with one vLLM version).
    pub fn select(
        series: &[HistogramSeries],
        labels: &std::collections::BTreeMap<String, String>,
    ) -> Option<Self> {
        let mut out = Self::default();
        let mut any = false;
        for s in series {
            let selected = labels
                .iter()
                .all(|(k, v)| s.labels.get(k).is_some_and(|have| have == v));
            if !selected {
                continue;
            }
            any = true;
            for &(le, c) in &s.buckets {
                match out.buckets.iter_mut().find(|(e, _)| *e == le) {
                    Some((_, total)) => *total += c,
                    None => out.buckets.push((le, c)),
                }
            }
            // Without `_count`, the +Inf bucket is the count.
            let count = s.count.or_else(|| {
                s.buckets
                    .last()
                    .filter(|(le, _)| le.is_infinite())
                    .map(|b| b.1)
            });
            out.count += count.unwrap_or(0.0);
            out.sum += s.sum.unwrap_or(0.0);
        }
        out.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        any.then_some(out)
    }

    /// What was observed between `earlier` and `self`. `None` when a
    /// counter went down or the bucket edges changed (an engine restarted
    /// or a series disappeared): that interval says nothing.
    pub fn since(&self, earlier: &Self) -> Option<Self> {
        let count = self.count - earlier.count;
        let sum = self.sum - earlier.sum;
        if self.buckets.len() != earlier.buckets.len() || count < 0.0 || !count.is_finite() {
            return None;
        }
        let mut buckets = Vec::with_capacity(self.buckets.len());
        for (&(le, now), &(le0, then)) in self.buckets.iter().zip(&earlier.buckets) {
            let d = now - then;
            if le != le0 || d < 0.0 || !d.is_finite() {
                return None;
            }
            buckets.push((le, d));
        }
        Some(Self {
            buckets,
            count,
            sum,
        })
    }

    /// The fraction of observations at or below `threshold`, read at the
    /// largest bucket edge `<= threshold` (so a threshold between edges is
    /// read conservatively). `None` without observations.
    pub fn fraction_within(&self, threshold: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let within = self
            .buckets
            .iter()
            .take_while(|(le, _)| *le <= threshold)
            .last()
            .map_or(0.0, |b| b.1);
        Some((within / self.count).clamp(0.0, 1.0))
    }

    /// The `p`-quantile, read as the upper edge of the bucket where it
    /// falls (an over-estimate, never an under-estimate); `+Inf` when it
    /// falls in the last bucket. `None` without observations.
    pub fn quantile(&self, p: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = p * self.count;
        Some(
            self.buckets
                .iter()
                .find(|(_, c)| *c >= rank)
                .map_or(f64::INFINITY, |b| b.0),
        )
    }

    /// The `p`-quantile interpolated linearly inside its bucket, as
    /// Prometheus' `histogram_quantile` does (a continuous value a
    /// regression can fit, where the bucket edge jumps); the upper edge of
    /// the last finite bucket when it falls in `+Inf`. `None` without
    /// observations.
    pub fn quantile_interpolated(&self, p: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = p.clamp(0.0, 1.0) * self.count;
        let (mut lower_edge, mut lower_count) = (0.0, 0.0);
        for &(le, cumulative) in &self.buckets {
            if cumulative >= rank {
                if le.is_infinite() {
                    return Some(lower_edge);
                }
                let inside = cumulative - lower_count;
                let share = if inside > 0.0 {
                    (rank - lower_count) / inside
                } else {
                    1.0
                };
                return Some(lower_edge + (le - lower_edge) * share);
            }
            (lower_edge, lower_count) = (le, cumulative);
        }
        Some(lower_edge)
    }

    /// The mean observation (`sum / count`). `None` without observations.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }
}

/// Interactive SLO attainment from the fraction of requests whose TTFT met
/// its SLO and the fraction of inter-token gaps that met theirs. vLLM's
/// histograms are separate (and ITL counts token gaps, not requests), so
/// the joint per-request fraction is not observable; this takes its
/// lower bound `max(0, ttft + itl − 1)` (Fréchet), so a gate can only
/// under-estimate attainment. A side without observations counts as met.
pub fn attainment(ttft_fraction: Option<f64>, itl_fraction: Option<f64>) -> Option<f64> {
    match (ttft_fraction, itl_fraction) {
        (None, None) => None,
        (t, i) => Some((t.unwrap_or(1.0) + i.unwrap_or(1.0) - 1.0).max(0.0)),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn series(labels: &[(&str, &str)], buckets: &[(f64, f64)], sum: f64) -> HistogramSeries {
        HistogramSeries {
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            buckets: buckets.to_vec(),
            sum: Some(sum),
            count: buckets.last().map(|b| b.1),
        }
    }

    #[test]
    fn histogram_delta_reads_the_interval_at_the_edge_below_the_threshold() {
        let inf = f64::INFINITY;
        let before = [
            series(
                &[("model_name", "chat")],
                &[(0.1, 10.0), (0.5, 20.0), (1.0, 20.0), (inf, 20.0)],
                4.0,
            ),
            series(
                &[("model_name", "batch")],
                &[(0.1, 0.0), (0.5, 0.0), (1.0, 50.0), (inf, 50.0)],
                40.0,
            ),
        ];
        let after = [
            series(
                &[("model_name", "chat")],
                &[(0.1, 50.0), (0.5, 118.0), (1.0, 119.0), (inf, 120.0)],
                24.0,
            ),
            series(
                &[("model_name", "batch")],
                &[(0.1, 0.0), (0.5, 0.0), (1.0, 90.0), (inf, 90.0)],
                80.0,
            ),
        ];
        let chat: BTreeMap<String, String> = [("model_name".to_owned(), "chat".to_owned())].into();
        let d = Histogram::select(&after, &chat)
            .unwrap()
            .since(&Histogram::select(&before, &chat).unwrap())
            .unwrap();
        assert_eq!(d.count, 100.0);
        assert_eq!(d.fraction_within(0.5), Some(0.98));
        // 0.7 lies between edges: read at 0.5.
        assert_eq!(d.fraction_within(0.7), Some(0.98));
        assert_eq!(d.fraction_within(0.05), Some(0.0));
        assert_eq!(d.quantile(0.5), Some(0.5));
        assert_eq!(d.quantile(0.99), Some(1.0));
        assert_eq!(d.quantile(1.0), Some(inf));
        assert_eq!(d.mean(), Some(0.2));
        // Without a filter the batch series dilutes the interactive one.
        let all = BTreeMap::new();
        let d = Histogram::select(&after, &all)
            .unwrap()
            .since(&Histogram::select(&before, &all).unwrap())
            .unwrap();
        assert_eq!(d.count, 140.0);
        assert!((d.fraction_within(0.5).unwrap() - 98.0 / 140.0).abs() < 1e-12);
        // A restart (counters down) gives no interval; no match gives none.
        assert!(
            Histogram::select(&before, &chat)
                .unwrap()
                .since(&Histogram::select(&after, &chat).unwrap())
                .is_none()
        );
        let other: BTreeMap<String, String> = [("model_name".to_owned(), "x".to_owned())].into();
        assert!(Histogram::select(&after, &other).is_none());
        assert_eq!(Histogram::default().fraction_within(1.0), None);
    }

    #[test]
    fn attainment_is_the_lower_bound_of_the_joint_fraction() {
        assert_eq!(attainment(None, None), None);
        assert_eq!(attainment(Some(0.99), None), Some(0.99));
        assert!((attainment(Some(0.995), Some(0.99)).unwrap() - 0.985).abs() < 1e-12);
        assert_eq!(attainment(Some(0.3), Some(0.2)), Some(0.0));
    }

    #[test]
    fn interpolated_quantiles_fall_inside_their_bucket() {
        let inf = f64::INFINITY;
        let h = Histogram::select(
            &[series(
                &[],
                &[(0.025, 50.0), (0.05, 90.0), (0.075, 100.0), (inf, 100.0)],
                3.0,
            )],
            &BTreeMap::new(),
        )
        .unwrap();
        // Rank 70 is half-way through the (0.025, 0.05] bucket (50 → 90).
        let q = h.quantile_interpolated(0.7).unwrap();
        assert!((q - 0.0375).abs() < 1e-12, "{q}");
        // The bucket-edge reading over-estimates; interpolation does not.
        assert_eq!(h.quantile(0.7), Some(0.05));
        assert!((h.quantile_interpolated(0.25).unwrap() - 0.0125).abs() < 1e-12);
        assert_eq!(h.quantile_interpolated(1.0), Some(0.075));
        let empty = Histogram::select(&[series(&[], &[(inf, 0.0)], 0.0)], &BTreeMap::new());
        assert!(empty.is_none_or(|h| h.quantile_interpolated(0.5).is_none()));
    }
}
