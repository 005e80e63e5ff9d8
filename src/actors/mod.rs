//! The actors of one node: a device actor per device holding experts, the dispatcher that
//! hands them (and other nodes) expert work, and the router actor that batches requests and
//! steps the model. `crate::node` wires them together.

pub mod device;
pub mod dispatch;
pub mod router;
