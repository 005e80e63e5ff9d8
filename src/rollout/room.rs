//! Whether a placement change fits: before the leader proposes a placement, every node
//! must have room for the experts it would newly hold (copy-then-switch loads them beside
//! what it holds until the switch). Members gossip their room and the bytes an expert takes
//! on them ([`MemberMeta::expert_room`]); a change that would not fit is refused with a log
//! line naming the nodes, and tried again later.

use std::collections::HashSet;

use crate::cluster::MemberView;
use crate::experts::remote::best_member;
use crate::placement::Placement;

/// A node of a proposed placement without room for its new share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoRoom {
    pub node: String,
    /// Bytes of the experts it would newly hold.
    pub need: u64,
    /// Bytes of experts it could still take.
    pub room: u64,
}

impl std::fmt::Display for NoRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} needs {} MiB for the experts it would newly hold and has room for {} MiB",
            self.node,
            self.need.div_ceil(1 << 20),
            self.room >> 20
        )
    }
}

/// The `(layer, expert)` pairs `placement` gives node `node`, on any of its devices.
fn share(placement: &Placement, node: &str) -> HashSet<(usize, u32)> {
    let Some(index) = placement.node_index(node) else {
        return HashSet::new();
    };
    let devices = placement.nodes()[index as usize].devices;
    (0..devices)
        .flat_map(|d| placement.experts_on(index, d as u16))
        .collect()
}

/// The nodes of `next` that lack room for the experts it gives them beyond what `current`
/// does. `me` is this node, whose room and bytes per expert are `mine`; the others' come
/// from gossip. A node whose bytes per expert are unknown (it holds none yet) is counted
/// with the largest any node reports; with none known, nothing is refused.
pub fn without_room(
    current: &Placement,
    next: &Placement,
    members: &[MemberView],
    me: &str,
    mine: (u64, u64),
) -> Vec<NoRoom> {
    let said = |node: &str| -> Option<(u64, u64)> {
        if node == me {
            Some(mine)
        } else {
            best_member(members, node).map(|m| (m.meta.expert_room, m.meta.expert_bytes))
        }
    };
    let largest = next
        .nodes()
        .iter()
        .filter_map(|n| said(&n.node))
        .map(|(_, bytes)| bytes)
        .max()
        .unwrap_or(0);
    next.nodes()
        .iter()
        .filter_map(|n| {
            let (room, bytes) = said(&n.node)?;
            let bytes = if bytes == 0 { largest } else { bytes };
            let new = share(next, &n.node)
                .difference(&share(current, &n.node))
                .count() as u64;
            let need = new.saturating_mul(bytes);
            (need > room).then(|| NoRoom {
                node: n.node.clone(),
                need,
                room,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::MemberState;
    use crate::placement::{NodeSlots, PlacementSpec};

    fn nodes(ids: &[&str]) -> Vec<NodeSlots> {
        ids.iter()
            .map(|n| NodeSlots {
                node: n.to_string(),
                devices: 1,
            })
            .collect()
    }

    fn member(node: &str, room: u64, bytes: u64) -> MemberView {
        let mut m = MemberView::for_test(node, MemberState::Alive, 1, 1);
        m.meta.expert_room = room;
        m.meta.expert_bytes = bytes;
        m
    }

    #[test]
    fn a_change_that_would_not_fit_names_the_nodes_short_of_room() {
        let spec = PlacementSpec {
            version: 1,
            replication: 2,
            nodes: nodes(&["a", "b", "c"]),
        };
        let current = Placement::balanced(&[true], 12, spec).unwrap();
        // c is gone: a and b take its copies. Each held 8 of the 24 copies; now 12.
        let next = current.revise(&nodes(&["a", "b"])).unwrap();
        let gained = |node: &str| {
            share(&next, node)
                .difference(&share(&current, node))
                .count()
        };
        assert!(gained("a") > 0 && gained("b") > 0);
        const MIB: u64 = 1 << 20;
        let roomy = [member("b", 100 * MIB, MIB)];
        assert_eq!(
            without_room(&current, &next, &roomy, "a", (100 * MIB, MIB)),
            []
        );
        // b has room for one expert of the several it would take.
        let tight = [member("b", MIB, MIB)];
        let short = without_room(&current, &next, &tight, "a", (100 * MIB, MIB));
        assert_eq!(short.len(), 1);
        assert_eq!(short[0].node, "b");
        assert_eq!(short[0].need, gained("b") as u64 * MIB);
        assert!(short[0].to_string().contains("b needs"), "{}", short[0]);
        // b holds no expert yet (bytes unknown): counted at the largest size reported.
        let unknown = [member("b", MIB, 0)];
        assert_eq!(
            without_room(&current, &next, &unknown, "a", (100 * MIB, 3 * MIB))[0].need,
            gained("b") as u64 * 3 * MIB
        );
        // Nothing known anywhere: nothing refused.
        let silent = [member("b", 0, 0)];
        assert!(without_room(&current, &next, &silent, "a", (0, 0)).is_empty());
    }
}
