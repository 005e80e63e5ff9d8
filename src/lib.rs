//! moe-node: a serving appliance for large Mixture-of-Experts language models.
//!
//! The crate is laid out by architecture (see DESIGN.md): `model` reads published
//! checkpoints, `compute` holds the numeric kernels, `moe` the gating and dispatch of tokens
//! to experts, and `engine` the forward pass and generation loop.

pub mod api;
pub mod cluster;
pub mod compute;
pub mod config;
pub mod control_plane;
pub mod engine;
pub mod experts;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod moe;
pub mod node;
pub mod placement;
pub mod plan;
pub mod progress;
pub mod rollout;
pub mod server;
pub mod transport;
