//! The cluster's membership: SWIM gossip through foca, on its own thread, and what members
//! tell each other about themselves. Nothing here knows about experts or placements'
//! rollout: `crate::experts::remote` reaches the members, `crate::rollout` changes what
//! they serve.
//!
//! - [`membership`]: the handle and the thread that drives foca over UDP.
//! - [`keyring`]: AES-256-GCM sealing of every gossip datagram.
//! - [`replay`]: the stamp inside every sealed datagram, so a replayed one is refused.
//! - `schedule`: when the thread announces on its own (alone, or members fell silent).
//! - [`identity`]: a member's identity on the wire ([`MemberMeta`] plus a generation).
//! - [`table`]: the member table (Alive/Suspect/Dead bookkeeping), plain data.
//! - [`screen`]: refusal of members serving another model, and log rate limiting.
//! - [`sim`]: a deterministic in-memory simulation of a cluster (virtual clock, lossy links),
//!   for tests and the detection-time bench.

pub mod identity;
pub mod keyring;
pub mod membership;
pub mod replay;
mod schedule;
pub mod screen;
pub mod sim;
mod table;

#[cfg(test)]
mod loopback_tests;

pub use identity::{MemberMeta, NodeIdentity, TableId};
pub use membership::{
    DEFAULT_PROBE_PERIOD, DEFAULT_SUSPICION_TIMEOUT, GossipRejections, Membership,
    MembershipConfig, MembershipError, MembershipStats, Rejection, TransitionCounters, foca_config,
};
pub use table::{MemberState, MemberView};
