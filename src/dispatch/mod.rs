//! The dispatch path: window arithmetic (pure), request costs (pure), and
//! the loop that pulls, admits, sends and settles messages.

pub mod cost;
pub mod window;
