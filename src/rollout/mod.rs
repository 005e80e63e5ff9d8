//! Placement versions over time: how a starting node gets the placement it serves under
//! ([`bootstrap`]), the placements a node hands out ([`board`]), and how a cluster moves
//! from one version to the next while it serves, copy then switch ([`follow`]), and how a
//! node rebalances its hot-expert copies live, on demand or every interval ([`rebalance`]).
//! The placements themselves are computed by the pure algorithms of `crate::placement`.

pub mod board;
pub mod bootstrap;
pub mod follow;
#[cfg(test)]
mod partition_sim;
pub mod rebalance;
pub mod room;

use std::time::Duration;

use crate::cluster::{MemberMeta, TableId};
use crate::experts::PlacementSwitch;
use crate::placement::{NodeSlots, Placement};

/// What a member offers a placement: its devices and the experts of a layer each has room
/// for, as it gossips them.
pub fn offered(meta: &MemberMeta) -> NodeSlots {
    NodeSlots {
        node: meta.node.clone(),
        devices: meta.devices as usize,
        slots: meta.expert_slots.iter().map(|&s| s as usize).collect(),
    }
}

/// The version and table hash members gossip for `placement`.
pub fn table_id(placement: &Placement) -> TableId {
    TableId {
        version: placement.version(),
        hash: placement.table_hash(),
    }
}

/// How long a switch waits for the layer calls that routed by the old placement.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// Waits for the layer calls that routed by the placement `switch` replaced, before this
/// node releases copies or says it serves `version`. Past [`DRAIN_LIMIT`] (a call stuck on
/// a peer that does not answer) it goes on and says so: the cluster must not stall on one
/// call, which fails over or fails on its own.
fn drain(switch: PlacementSwitch, version: u64) {
    if !switch.drain(DRAIN_LIMIT) {
        tracing::warn!(
            version,
            waited_s = DRAIN_LIMIT.as_secs(),
            "layer calls routing by the old placement still run: going on without them"
        );
    }
}
