//! The dispatch path: window arithmetic (`window.rs`, pure), request costs
//! (`cost.rs`, pure), paced release (`pace.rs`, pure), the retry policy
//! (`retry.rs`, pure), fair shares among tenants (`fair.rs`, pure), what is
//! held and its bytes (`held.rs`, pure), tunables
//! (`settings.rs`, from the typed config), inert-gate detection
//! (`inert.rs`, pure), merge policies among a pool's queues (`merge.rs`,
//! pure) and the loop that pulls, admits,
//! sends and settles messages, split by task: `state.rs` (what the
//! dispatcher is built from, the state its tasks share), `dispatcher.rs`
//! (start and drain), `receive.rs`, `send.rs`, `settle.rs`, `observe.rs`,
//! `cancel.rs` (cancels that reach requests in flight).

mod cancel;
pub mod congestion;
pub mod cost;
mod dispatcher;
mod fair;
mod held;
pub mod inert;
pub mod merge;
mod observe;
pub mod pace;
pub mod pool;
mod receive;
mod retry;
mod send;
mod settings;
mod settle;
pub mod shared_window;
mod state;
pub mod window;

#[cfg(test)]
mod tests;

pub use pool::Pool;
pub use retry::{RetryDecision, RetryPolicy};
pub use settings::{DispatchSettings, MAX_PARK, MAX_PARKED, RECEIVE_BATCH};
pub use state::QueueDispatcher;
