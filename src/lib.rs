//! moe-node: a serving appliance for large Mixture-of-Experts language models, one binary
//! per node. This file is the crate's table of contents, top floor first: each module
//! imports only the modules below it (`tests/architecture.rs` holds the floors, and
//! `docs/architecture.md` walks one request through them). Modules that nothing outside
//! the crate needs are private.

/// `moe-node gateway`: the API in front of a cluster, holding no model; moves a stream off
/// a node that fails.
pub mod gateway;
/// `moe-node serve`: binds the HTTP API, runs the node, drains on SIGTERM.
pub mod server;

/// The HTTP API: OpenAI-compatible endpoints, health, metrics, admin.
pub mod api;

/// The composition root: one node's device actors, dispatcher, router and cluster part.
pub mod node;

/// The node's Prometheus registry.
mod metrics;
/// The readiness report (`moe-node plan`).
pub mod plan;
/// Placement versions over time: bootstrap, the placement board, copy-then-switch.
mod rollout;

/// The forward pass, its caches, batching and sampling.
pub mod engine;

/// The expert data plane: the executor seam, the dispatcher, device actors, other nodes.
pub mod experts;

/// Gossip membership.
pub mod cluster;
/// The control plane, and a node's client of it.
pub mod control_plane;
/// The gate and the dispatch plan of a MoE layer.
pub mod moe;
/// Peer links: the wire format, TCP, UCX, an in-memory twin.
pub mod transport;

/// The node's configuration as plain data, validated whole.
pub mod config;

/// Checkpoints: configs, tensors, quantized formats, tokenizer, chat templates.
pub mod model;

/// Numeric kernels (CPU and CUDA) and the blocks they run.
pub mod compute;
/// Models by Hugging Face name: the hub's cache layout, and downloads into it.
pub mod hub;
/// Pure placement algorithms: which device holds which expert.
pub mod placement;

/// Log output and its filter.
pub mod logging;
/// Start-up progress, for the log and systemd.
mod progress;
/// OpenTelemetry traces over OTLP: spans of requests, steps, dispatches and peer calls.
pub mod telemetry;
