//! A placement's next version when the nodes change: a dead node's copies are made again on
//! the survivors, a node that joins takes a share, and nothing else moves. Copy-then-switch
//! costs one load per moved copy, so the fewer copies move the sooner the cluster is whole.

use super::{NodeSlots, Placement, PlacementError, PlacementSpec, Replica};

impl Placement {
    /// The next placement (version `self.version() + 1`) over the nodes in `live`, each with
    /// the devices it offers now. Node indices stay stable: a node that left keeps its index
    /// with no devices (so the health and links kept per index stay right), a node that
    /// returns gets its index back, and new nodes are appended in name order.
    ///
    /// Copies on nodes still live stay where they are. Experts short of copies (their node
    /// left) get new ones on the least-filled eligible devices, as [`Placement::balanced`]
    /// would place them; then copies move from the fullest to the emptiest devices until
    /// every device is within one expert of the others, which is how a joining node gets
    /// its share. Copies stay on distinct nodes while there are nodes enough.
    pub fn revise(&self, live: &[NodeSlots]) -> Result<Placement, PlacementError> {
        self.revise_within(live, &|_| None)
    }

    /// [`Placement::revise`] where node `n` may take at most `room(n)` copies it does not
    /// hold now (`None`: any number): a node short of memory gets what fits, and the rest
    /// goes to nodes with room, or stays short of copies where none has room (which the
    /// caller sees, and refuses).
    pub fn revise_within(
        &self,
        live: &[NodeSlots],
        room: &dyn Fn(&str) -> Option<usize>,
    ) -> Result<Placement, PlacementError> {
        let mut nodes: Vec<NodeSlots> = self
            .spec
            .nodes
            .iter()
            .map(|n| {
                live.iter()
                    .find(|l| l.node == n.node)
                    .cloned()
                    .unwrap_or_else(|| NodeSlots::new(n.node.clone(), 0))
            })
            .collect();
        let mut joining: Vec<&NodeSlots> = live
            .iter()
            .filter(|n| self.node_index(&n.node).is_none())
            .collect();
        joining.sort_by(|a, b| a.node.cmp(&b.node));
        joining.dedup_by(|a, b| a.node == b.node);
        nodes.extend(joining.into_iter().cloned());
        let spec = PlacementSpec {
            version: self.spec.version + 1,
            replication: self.spec.replication,
            nodes,
        };
        let devices = device_order(&spec)?;
        let slots = super::slots_by_device(&spec, &devices);
        // Fewer devices than copies (a cluster shrunk to one small node): as many copies as
        // there are devices, never none.
        let copies = spec.replication.min(devices.len()).max(1);
        let distinct_nodes = copies <= spec.nodes.iter().filter(|n| n.devices > 0).count();
        let usable = |r: &Replica| {
            spec.nodes
                .get(r.node as usize)
                .is_some_and(|n| (r.device as usize) < n.devices)
        };
        let may_hold = |held: &[Replica], r: Replica| {
            if distinct_nodes {
                held.iter().all(|c| c.node != r.node)
            } else {
                !held.contains(&r)
            }
        };
        let mut new_copies = NewCopies(spec.nodes.iter().map(|n| room(&n.node)).collect());
        let mut take = |old: &[Replica], node: u16, dry: bool| new_copies.take(old, node, dry);
        let replicas = self
            .replicas
            .iter()
            .map(|old_layer| {
                if old_layer.is_empty() {
                    return Vec::new();
                }
                let mut layer: Vec<Vec<Replica>> = old_layer
                    .iter()
                    .map(|old| {
                        let mut kept: Vec<Replica> = Vec::with_capacity(copies);
                        for &r in old.iter().filter(|r| usable(r)) {
                            if kept.len() < copies && may_hold(&kept, r) {
                                kept.push(r);
                            }
                        }
                        kept
                    })
                    .collect();
                let slot = |r: Replica| {
                    devices
                        .iter()
                        .position(|&d| d == r)
                        .expect("usable replicas are devices of the spec")
                };
                let mut held = vec![0usize; devices.len()];
                for r in layer.iter().flatten() {
                    held[slot(*r)] += 1;
                }
                // Copies lost with their node, made again where there is most room.
                let mut next_slot = 0usize;
                for (e, expert) in layer.iter_mut().enumerate() {
                    while expert.len() < copies {
                        let n = devices.len();
                        let Some(pick) = (0..n)
                            .map(|k| (next_slot + k) % n)
                            .filter(|&i| {
                                may_hold(expert, devices[i])
                                    && take(&old_layer[e], devices[i].node, true)
                            })
                            .min_by_key(|&i| super::fill_order(held[i], slots[i]))
                        else {
                            break;
                        };
                        take(&old_layer[e], devices[pick].node, false);
                        held[pick] += 1;
                        next_slot = (pick + 1) % n;
                        expert.push(devices[pick]);
                    }
                }
                // Then even out: one copy at a time from the fullest device to the
                // emptiest one with room that may hold it; a device past its room gives
                // copies to any with room.
                'moves: loop {
                    let mut by_held: Vec<usize> = (0..devices.len()).collect();
                    by_held.sort_by_key(|&i| (held[i], i));
                    for &from in by_held.iter().rev() {
                        for &to in &by_held {
                            let worth = held[to] < slots[to]
                                && (held[from] > slots[from] || held[from] >= held[to] + 2);
                            if !worth {
                                continue;
                            }
                            let movable = layer.iter().enumerate().position(|(e, copies)| {
                                copies.contains(&devices[from]) && {
                                    let others: Vec<Replica> = copies
                                        .iter()
                                        .copied()
                                        .filter(|&c| c != devices[from])
                                        .collect();
                                    may_hold(&others, devices[to])
                                        && take(&old_layer[e], devices[to].node, true)
                                }
                            });
                            if let Some(expert) = movable {
                                take(&old_layer[expert], devices[to].node, false);
                                for c in layer[expert].iter_mut() {
                                    if *c == devices[from] {
                                        *c = devices[to];
                                    }
                                }
                                held[from] -= 1;
                                held[to] += 1;
                                continue 'moves;
                            }
                        }
                    }
                    break;
                }
                layer
            })
            .collect();
        Ok(Placement { spec, replicas })
    }
}

/// The new copies each node (by index) may still take; `None`: any number.
struct NewCopies(Vec<Option<usize>>);

impl NewCopies {
    /// Whether `node` may take a copy of the expert whose copies were `old` (a node that
    /// held it takes nothing new); unless `dry`, the copy is counted.
    fn take(&mut self, old: &[Replica], node: u16, dry: bool) -> bool {
        if old.iter().any(|r| r.node == node) {
            return true;
        }
        match self.0.get_mut(node as usize) {
            Some(Some(0)) => false,
            Some(Some(n)) => {
                if !dry {
                    *n -= 1;
                }
                true
            }
            _ => true,
        }
    }
}

/// Every device of `spec`, interleaved across nodes (node 0's device 0, node 1's device 0,
/// ...), the order ties are broken in.
pub(super) fn device_order(spec: &PlacementSpec) -> Result<Vec<Replica>, PlacementError> {
    if spec.nodes.len() > u16::MAX as usize
        || spec.nodes.iter().any(|n| n.devices > u16::MAX as usize)
    {
        return Err(PlacementError::TooManyNodes(spec.nodes.len()));
    }
    let max_devices = spec.nodes.iter().map(|n| n.devices).max().unwrap_or(0);
    let devices: Vec<Replica> = (0..max_devices)
        .flat_map(|d| {
            spec.nodes
                .iter()
                .enumerate()
                .filter(move |(_, n)| d < n.devices)
                .map(move |(node, _)| Replica {
                    node: node as u16,
                    device: d as u16,
                })
        })
        .collect();
    if devices.is_empty() {
        return Err(PlacementError::NoDevices);
    }
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(nodes: &[(&str, usize)]) -> Vec<NodeSlots> {
        nodes
            .iter()
            .map(|&(node, devices)| NodeSlots::new(node, devices))
            .collect()
    }

    fn first(nodes: &[(&str, usize)], experts: usize, replication: usize) -> Placement {
        let spec = PlacementSpec {
            version: 1,
            replication,
            nodes: slots(nodes),
        };
        Placement::balanced(&[false, true, true], experts, spec).unwrap()
    }

    /// Every expert has `copies` copies on distinct nodes, all on live devices, and every
    /// live device holds its share within one.
    fn check(p: &Placement, experts: usize, copies: usize) {
        check_copies(p, experts, copies, true)
    }

    fn check_copies(p: &Placement, experts: usize, copies: usize, balanced: bool) {
        for layer in 1..3 {
            let mut held: std::collections::HashMap<Replica, usize> = Default::default();
            for e in 0..experts as u32 {
                let r = p.replicas(layer, e);
                assert_eq!(r.len(), copies, "layer {layer} expert {e}: {r:?}");
                let mut on: Vec<u16> = r.iter().map(|c| c.node).collect();
                on.sort();
                on.dedup();
                assert_eq!(on.len(), copies, "copies on distinct nodes: {r:?}");
                for c in r {
                    assert!((c.device as usize) < p.nodes()[c.node as usize].devices);
                    *held.entry(*c).or_default() += 1;
                }
            }
            let live: usize = p.nodes().iter().map(|n| n.devices).sum();
            let counts: Vec<usize> = held.values().copied().collect();
            let max = *counts.iter().max().unwrap();
            let min = if held.len() < live {
                0
            } else {
                *counts.iter().min().unwrap()
            };
            assert!(!balanced || max - min <= 1, "layer {layer}: {held:?}");
        }
    }

    fn moved(a: &Placement, b: &Placement, experts: usize) -> usize {
        (1..3)
            .flat_map(|l| (0..experts as u32).map(move |e| (l, e)))
            .map(|(l, e)| {
                let name = |p: &Placement, r: &Replica| {
                    (p.nodes()[r.node as usize].node.clone(), r.device)
                };
                let before: Vec<_> = a.replicas(l, e).iter().map(|r| name(a, r)).collect();
                b.replicas(l, e)
                    .iter()
                    .filter(|r| !before.contains(&name(b, r)))
                    .count()
            })
            .sum()
    }

    #[test]
    fn a_dead_nodes_copies_are_made_again_on_the_survivors_and_nothing_else_moves() {
        let p1 = first(&[("a", 1), ("b", 1), ("c", 1)], 16, 2);
        let p2 = p1.revise(&slots(&[("a", 1), ("c", 1)])).unwrap();
        assert_eq!(p2.version(), 2);
        assert_eq!(p2.node_index("b"), Some(1), "indices stay");
        assert_eq!(p2.nodes()[1].devices, 0, "b holds nothing");
        check(&p2, 16, 2);
        // Only b's copies were made again: one per expert b held.
        let on_b = p1.experts_held_by(1);
        assert_eq!(moved(&p1, &p2, 16), on_b);
        // b returns: it gets its index back and a share again, taken from a and c.
        let p3 = p2.revise(&slots(&[("a", 1), ("b", 1), ("c", 1)])).unwrap();
        assert_eq!(p3.node_index("b"), Some(1));
        check(&p3, 16, 2);
        assert!(p3.experts_held_by(1) >= 2 * 16 * 2 / 3 - 2);
        assert_eq!(moved(&p2, &p3, 16), p3.experts_held_by(1));
    }

    #[test]
    fn a_joining_node_takes_a_share_from_the_fullest_devices() {
        let p1 = first(&[("a", 2), ("b", 2)], 30, 2);
        let p2 = p1.revise(&slots(&[("a", 2), ("b", 2), ("c", 2)])).unwrap();
        assert_eq!(p2.node_index("c"), Some(2));
        check(&p2, 30, 2);
        // 120 copies over 6 devices: c takes 40, and only those move.
        assert_eq!(p2.experts_held_by(2), 40);
        assert_eq!(moved(&p1, &p2, 30), 40);
    }

    #[test]
    fn a_cluster_shrunk_below_the_replication_keeps_what_its_devices_allow() {
        let p1 = first(&[("a", 1), ("b", 1)], 8, 2);
        let p2 = p1.revise(&slots(&[("a", 2)])).unwrap();
        // One node with two devices: two copies on distinct devices.
        for e in 0..8 {
            let r = p2.replicas(1, e);
            assert_eq!(r.len(), 2);
            assert!(r.iter().all(|c| c.node == 0));
            assert_ne!(r[0].device, r[1].device);
        }
        let p3 = p2.revise(&slots(&[("b", 1)])).unwrap();
        for e in 0..8 {
            assert_eq!(p3.replicas(1, e), [Replica { node: 1, device: 0 }]);
        }
        assert_eq!(p3.revise(&[]), Err(PlacementError::NoDevices));
    }

    #[test]
    fn the_same_change_gives_the_same_placement() {
        let p1 = first(&[("a", 1), ("b", 2), ("c", 1)], 33, 2);
        let live = slots(&[("c", 1), ("a", 1), ("d", 3)]);
        assert_eq!(p1.revise(&live), p1.revise(&live));
        // d's three devices cannot take their full share: two copies of an expert never
        // share a node.
        check_copies(&p1.revise(&live).unwrap(), 33, 2, false);
    }

    #[test]
    fn a_device_short_of_memory_takes_no_more_than_its_slots_when_copies_are_made_again() {
        let with_slots = |nodes: &[(&str, usize)]| -> Vec<NodeSlots> {
            slots(nodes)
                .into_iter()
                .map(|n| NodeSlots {
                    slots: vec![4, 100],
                    ..n
                })
                .collect()
        };
        let spec = PlacementSpec {
            version: 1,
            replication: 2,
            nodes: with_slots(&[("a", 2), ("b", 2), ("c", 2)]),
        };
        let p1 = Placement::balanced(&[false, true, true], 24, spec).unwrap();
        // c dies: its copies go to a and b, whose device 0 stays at 4 experts a layer.
        let p2 = p1.revise(&with_slots(&[("a", 2), ("b", 2)])).unwrap();
        check_copies(&p2, 24, 2, false);
        for layer in 1..3 {
            for node in 0..2u16 {
                let on = |device: u16| {
                    (0..24)
                        .filter(|&e| p2.replicas(layer, e).contains(&Replica { node, device }))
                        .count()
                };
                assert_eq!((on(0), on(1)), (4, 20), "layer {layer} node {node}");
            }
        }
        // Without the slots, the even share.
        let p3 = p1.revise(&slots(&[("a", 2), ("b", 2)])).unwrap();
        check(&p3, 24, 2);
    }

    #[test]
    fn a_node_without_room_takes_no_new_copies_and_the_others_take_them() {
        let before = first(&[("a", 1), ("b", 1), ("c", 1), ("d", 1)], 16, 2);
        let survivors = slots(&[("a", 1), ("b", 1), ("c", 1)]);
        let held = |p: &Placement, node: &str| p.experts_held_by(p.node_index(node).unwrap());
        // a has room for none, b and c for as many as they need: d's copies go to b and c.
        let room = |node: &str| (node == "a").then_some(0);
        let after = before.revise_within(&survivors, &room).unwrap();
        check_copies(&after, 16, 2, false);
        assert_eq!(
            held(&after, "a"),
            held(&before, "a"),
            "a took copies it had no room for"
        );
        for layer in 1..3 {
            for e in 0..16 {
                let on = |p: &Placement| {
                    p.replicas(layer, e)
                        .iter()
                        .any(|r| p.nodes()[r.node as usize].node == "a")
                };
                assert_eq!(on(&after), on(&before), "layer {layer} expert {e}");
            }
        }
        // Without the limit a takes its share of them.
        let free = before.revise(&survivors).unwrap();
        assert!(held(&free, "a") > held(&before, "a"));
        // With room for none anywhere the lost copies stay lost, for the caller to refuse.
        let nowhere = before.revise_within(&survivors, &|_| Some(0)).unwrap();
        let short = (1..3)
            .flat_map(|l| (0..16u32).map(move |e| (l, e)))
            .filter(|&(l, e)| nowhere.replicas(l, e).len() < 2)
            .count();
        assert_eq!(
            short,
            before.experts_held_by(before.node_index("d").unwrap())
        );
    }
}
