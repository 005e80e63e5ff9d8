//! The cluster: membership (SWIM gossip through foca, on its own thread) and what members
//! tell each other about themselves.
//!
//! - [`membership`]: the handle and the thread that drives foca over UDP.
//! - [`keyring`]: AES-256-GCM sealing of every gossip datagram.
//! - [`identity`]: a member's identity on the wire ([`MemberMeta`] plus a generation).
//! - [`table`]: the member table (Alive/Suspect/Dead bookkeeping), plain data.
//! - [`screen`]: refusal of members serving another model, and log rate limiting.
//! - [`sim`]: a deterministic in-memory simulation of a cluster (virtual clock, lossy links),
//!   for tests and the detection-time bench.
//! - [`bootstrap`]: how a starting node gets the placement it serves under.
//! - [`joined`]: a node's part in a cluster (peer server, membership, peer clients).
//! - [`peers`]: other nodes as the dispatcher reaches them; work from them run here.
//! - [`metrics`]: the cluster's Prometheus series.

pub mod board;
pub mod bootstrap;
pub mod control_plane;
pub mod follow;
pub mod identity;
pub mod joined;
pub mod keyring;
pub mod membership;
pub mod metrics;
pub mod peers;
pub mod screen;
pub mod sim;
pub mod table;

#[cfg(test)]
mod loopback_tests;

pub use identity::{MemberMeta, NodeIdentity};
pub use membership::{
    DEFAULT_PROBE_PERIOD, DEFAULT_SUSPICION_TIMEOUT, Membership, MembershipConfig, MembershipError,
    MembershipStats, TransitionCounters, foca_config,
};
pub use table::{MemberState, MemberView};
