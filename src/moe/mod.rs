//! The mixture-of-experts layer's own arithmetic: the gate (which experts a token goes to,
//! with what weight) and the dispatch plan (rows grouped per expert, and combined back).
//! Who runs the experts is the expert data plane's business (`crate::experts`).

pub mod dispatch;
pub mod gating;

pub use dispatch::DispatchPlan;
pub use gating::{Routing, route, route_avoiding};
