//! A sliding-window least-squares line with non-negative coefficients:
//! step time against batch size (`slo-headroom`).

use std::collections::VecDeque;

/// A line `y ≈ a + b·x` fitted by least squares over the last `capacity`
/// points, with `a, b ≥ 0`: a step time cannot fall as the batch grows,
/// nor be negative at an empty batch, so a fit that says so (noise,
/// co-moving load) is refitted with that coefficient at 0.
#[derive(Debug, Clone)]
pub struct NnlsLine {
    points: VecDeque<(f64, f64)>,
    capacity: usize,
}

/// A fitted line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Line {
    /// Intercept, `>= 0`.
    pub a: f64,
    /// Slope, `>= 0`.
    pub b: f64,
}

impl Line {
    /// `a + b·x`.
    pub fn at(&self, x: f64) -> f64 {
        self.a + self.b * x
    }
}

impl NnlsLine {
    /// An empty window of `capacity` points (at least 2).
    pub fn new(capacity: usize) -> Self {
        Self {
            points: VecDeque::with_capacity(capacity.max(2)),
            capacity: capacity.max(2),
        }
    }

    /// Adds a point, dropping the oldest when full. Non-finite points are
    /// ignored.
    pub fn push(&mut self, x: f64, y: f64) {
        if !(x.is_finite() && y.is_finite()) {
            return;
        }
        if self.points.len() == self.capacity {
            self.points.pop_front();
        }
        self.points.push_back((x, y));
    }

    /// Number of points held.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// Whether it holds no points.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// `max(x) − min(x)` over the window (0 when empty).
    pub fn spread(&self) -> f64 {
        let (lo, hi) = self
            .points
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
                (lo.min(p.0), hi.max(p.0))
            });
        if hi >= lo { hi - lo } else { 0.0 }
    }

    /// The non-negative least-squares line, `None` when empty. Exact for
    /// two coefficients: the unconstrained fit when both are `>= 0`, else
    /// the better of the intercept-only and slope-only fits (each clamped at
    /// 0), which is where the constrained optimum lies.
    pub fn fit(&self) -> Option<Line> {
        let n = self.points.len() as f64;
        if n == 0.0 {
            return None;
        }
        let (sx, sy, sxx, sxy) = self
            .points
            .iter()
            .fold((0.0, 0.0, 0.0, 0.0), |(sx, sy, sxx, sxy), &(x, y)| {
                (sx + x, sy + y, sxx + x * x, sxy + x * y)
            });
        let det = n * sxx - sx * sx;
        if det > 1e-12 * n * sxx.max(1.0) {
            let b = (n * sxy - sx * sy) / det;
            let a = (sy - b * sx) / n;
            if a >= 0.0 && b >= 0.0 {
                return Some(Line { a, b });
            }
        }
        let sse = |l: Line| -> f64 {
            self.points
                .iter()
                .map(|&(x, y)| (y - l.at(x)).powi(2))
                .sum()
        };
        let intercept_only = Line {
            a: (sy / n).max(0.0),
            b: 0.0,
        };
        let slope_only = Line {
            a: 0.0,
            b: if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 },
        };
        Some(if sse(slope_only) < sse(intercept_only) {
            slope_only
        } else {
            intercept_only
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regression_recovers_exact_coefficients() {
        let mut r = NnlsLine::new(10);
        for x in 0..10 {
            let x = f64::from(x) * 4.0;
            r.push(x, 0.01 + 0.0005 * x);
        }
        let l = r.fit().unwrap();
        assert!(
            (l.a - 0.01).abs() < 1e-12 && (l.b - 0.0005).abs() < 1e-12,
            "{l:?}"
        );
        assert_eq!(r.spread(), 36.0);
    }

    #[test]
    fn regression_refuses_negative_coefficients() {
        // A true negative slope: the best non-negative line is flat.
        let mut r = NnlsLine::new(10);
        for x in 0..10 {
            let x = f64::from(x);
            r.push(x, 1.0 - 0.05 * x);
        }
        let l = r.fit().unwrap();
        assert_eq!(l.b, 0.0);
        assert!((l.a - 0.775).abs() < 1e-12, "{l:?}");
        // A true negative intercept: refitted through the origin.
        let mut r = NnlsLine::new(10);
        for x in 1..=10 {
            let x = f64::from(x);
            r.push(x, -1.0 + x);
        }
        let l = r.fit().unwrap();
        assert_eq!(l.a, 0.0);
        assert!(l.b > 0.0);
    }

    #[test]
    fn regression_window_slides() {
        let mut r = NnlsLine::new(3);
        for x in 0..3 {
            r.push(f64::from(x), 100.0);
        }
        for x in 10..13 {
            let x = f64::from(x);
            r.push(x, 2.0 * x);
        }
        assert_eq!(r.len(), 3);
        let l = r.fit().unwrap();
        assert!(l.a.abs() < 1e-9 && (l.b - 2.0).abs() < 1e-9, "{l:?}");
    }
}
