//! Pure controllers of the feedback gates (`feedback`, `slo-headroom`): no
//! clock, no I/O, instants and readings passed in, so every rule can be
//! tested on exact sequences.
//!
//! - [`Histogram`]: a cumulative histogram summed over selected series, its
//!   delta between two readings, the fraction at or below a threshold, a
//!   quantile and the mean over the interval.
//! - [`attainment`]: interactive SLO attainment from the TTFT and ITL
//!   fractions.
//! - [`Aimd`]: the additive-increase / multiplicative-decrease window.
//! - [`Lulls`]: the readings at which the interactive load is low enough
//!   for `feedback` to start batch requests.
//! - [`LocalLinearTrend`]: a Kalman filter (level + slope) that forecasts
//!   the interactive load.
//! - [`NnlsLine`]: a sliding-window least-squares line `y ≈ a + b·x` with
//!   `a, b ≥ 0`.
//! - [`SplitMix64`]: the seeded jitter source.

mod aimd;
mod headroom;
mod histogram;
mod jitter;
mod kalman;
mod lull;
mod nnls;

pub use aimd::{Aimd, AimdConfig, Cause, Hold, Signals, Step};
pub use headroom::{Admitted, HeadroomConfig, HeadroomInputs, HeadroomModel, admissible};
pub use histogram::{Histogram, attainment};
pub use jitter::SplitMix64;
pub use kalman::{KalmanConfig, LocalLinearTrend};
pub use lull::{Lull, Lulls};
pub use nnls::{Line, NnlsLine};
