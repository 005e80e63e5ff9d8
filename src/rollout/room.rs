//! Whether a placement change fits: before the leader proposes a placement, every node
//! must have room for the experts it would newly hold (copy-then-switch loads them beside
//! what it holds until the switch). Members gossip their room and the bytes an expert takes
//! on them ([`MemberMeta::expert_room`]); a change that would not fit is refused with a log
//! line naming the nodes, and tried again later. Before refusing, the leader places the
//! change anew within each node's room ([`spread`]): when that restores every copy the
//! change would have, it proposes that instead.

use std::collections::{HashMap, HashSet};

use crate::cluster::MemberView;
use crate::experts::remote::best_member;
use crate::placement::{NodeSlots, Placement, PlacementError};

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

/// Each node's room and bytes per expert, as it said them: `me` (this node) from `mine`,
/// the others from gossip; a node whose bytes per expert are unknown (it holds none yet) is
/// counted with the largest any node of `next` reports. Nodes that said nothing are left
/// out (nothing is refused for them).
fn rooms(
    next: &Placement,
    members: &[MemberView],
    me: &str,
    mine: (u64, u64),
) -> HashMap<String, (u64, u64)> {
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
            Some((
                n.node.clone(),
                (room, if bytes == 0 { largest } else { bytes }),
            ))
        })
        .collect()
}

/// The nodes of `next` that lack room for the experts it gives them beyond what `current`
/// does. `me` is this node, whose room and bytes per expert are `mine`; the others' come
/// from gossip. With no bytes per expert known anywhere, nothing is refused.
pub fn without_room(
    current: &Placement,
    next: &Placement,
    members: &[MemberView],
    me: &str,
    mine: (u64, u64),
) -> Vec<NoRoom> {
    let rooms = rooms(next, members, me, mine);
    next.nodes()
        .iter()
        .filter_map(|n| {
            let &(room, bytes) = rooms.get(&n.node)?;
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

/// `current` revised over `live` as [`Placement::revise`] would, with no node given more
/// new copies than its room holds; `Some` when that still makes every copy `wanted` (the
/// unlimited revision) has, so that it may be proposed instead.
pub fn spread(
    current: &Placement,
    wanted: &Placement,
    live: &[NodeSlots],
    members: &[MemberView],
    me: &str,
    mine: (u64, u64),
) -> Result<Option<Placement>, PlacementError> {
    let rooms = rooms(wanted, members, me, mine);
    let fits = |node: &str| {
        let &(room, bytes) = rooms.get(node)?;
        (bytes > 0).then(|| (room / bytes) as usize)
    };
    let spread = current.revise_within(live, &fits)?;
    let copies = |p: &Placement| -> usize {
        (0..p.num_layers())
            .flat_map(|l| (0..p.experts_in(l) as u32).map(move |e| (l, e)))
            .map(|(l, e)| p.replicas(l, e).len())
            .sum()
    };
    Ok((copies(&spread) == copies(wanted)).then_some(spread))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::MemberState;
    use crate::placement::{NodeSlots, PlacementSpec};

    fn nodes(ids: &[&str]) -> Vec<NodeSlots> {
        ids.iter().map(|n| NodeSlots::new(*n, 1)).collect()
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

    #[test]
    fn a_change_one_node_has_no_room_for_goes_to_the_nodes_that_have() {
        let spec = PlacementSpec {
            version: 1,
            replication: 2,
            nodes: nodes(&["a", "b", "c", "d"]),
        };
        let current = Placement::balanced(&[true], 16, spec).unwrap();
        // d is gone: a, b and c would each take some of its copies; b has room for none.
        let live = nodes(&["a", "b", "c"]);
        let wanted = current.revise(&live).unwrap();
        const MIB: u64 = 1 << 20;
        let members = [member("b", 0, MIB), member("c", 100 * MIB, MIB)];
        let mine = (100 * MIB, MIB);
        assert_eq!(
            without_room(&current, &wanted, &members, "a", mine).len(),
            1
        );
        let spread_out = spread(&current, &wanted, &live, &members, "a", mine)
            .unwrap()
            .expect("a and c have room for all of d's copies");
        assert!(without_room(&current, &spread_out, &members, "a", mine).is_empty());
        assert_eq!(share(&spread_out, "b"), share(&current, "b"));
        // Room for none anywhere: nothing to propose.
        let full = [member("b", 0, MIB), member("c", 0, MIB)];
        assert!(
            spread(&current, &wanted, &live, &full, "a", (0, MIB))
                .unwrap()
                .is_none()
        );
    }
}
