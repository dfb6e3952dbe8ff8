//! The dispatch path: window arithmetic (`window.rs`, pure), request costs
//! (`cost.rs`, pure), tunables (`settings.rs`) and the loop that pulls,
//! admits, sends and settles messages (`dispatcher.rs`).

pub mod cost;
mod dispatcher;
mod settings;
pub mod window;

pub use dispatcher::QueueDispatcher;
pub use settings::DispatchSettings;
