//! Which (node, device) holds which expert, and which replica serves a group of tokens. Pure
//! functions and plain types: the dispatcher feeds them the health it has measured and
//! carries out what they decide.

mod improve;
mod layout;
pub mod load;
pub mod migrate;
pub mod profile;
pub mod replicate;
mod revise;

use serde::{Deserialize, Serialize};

pub use load::ExpertLoad;
pub use migrate::{Migration, VersionMoves};
pub use profile::{Profile, ProfileError};

/// One copy of an expert: a device of a node. `node` indexes [`Placement::nodes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Replica {
    pub node: u16,
    pub device: u16,
}

/// A node taking part in a placement, how many devices it offers and how many experts of
/// a layer each may hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSlots {
    pub node: String,
    pub devices: usize,
    /// Experts of one MoE layer each device has memory for ([`crate::plan::expert_slots`]:
    /// a device carrying a dense replica keeps room for its KV cache); empty: no bound (CPU
    /// slots, or memory not known). Placement fills the devices evenly and stops at these
    /// while any device with room is left.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slots: Vec<usize>,
}

impl NodeSlots {
    /// `devices` devices with no bound on the experts each holds.
    pub fn new(node: impl Into<String>, devices: usize) -> NodeSlots {
        NodeSlots {
            node: node.into(),
            devices,
            slots: Vec::new(),
        }
    }

    /// Experts of one layer `device` has room for (`usize::MAX`: no bound).
    pub fn slots_of(&self, device: usize) -> usize {
        self.slots.get(device).copied().unwrap_or(usize::MAX)
    }
}

/// The expert → replicas map of a cluster (or of one node: a cluster of one), with a
/// version. Every node derives the same map from the same nodes, replication and model, so
/// a placement travels as its [`PlacementSpec`] and is rebuilt where it is needed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    spec: PlacementSpec,
    /// `[layer][expert]` → replicas; empty rows for dense layers.
    replicas: Vec<Vec<Vec<Replica>>>,
}

/// What a placement is derived from: the nodes (in the order replicas index them), the
/// replication factor and a version that grows with every change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementSpec {
    pub version: u64,
    pub replication: usize,
    pub nodes: Vec<NodeSlots>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("no devices to place experts on")]
    NoDevices,
    #[error("replication {replication} needs as many devices, but there are {devices}")]
    TooFewDevices { replication: usize, devices: usize },
    #[error("node `{0}` appears twice in the placement")]
    DuplicateNode(String),
    #[error("{0} nodes is more than a placement can index")]
    TooManyNodes(usize),
    #[error("placement table: {0}")]
    BadTable(String),
    #[error("rebalancing layer {layer}: {reason}")]
    Rebalance { layer: usize, reason: String },
}

/// The top bits of [`Placement::table_hash`] that rank a table by its copies: 2^24 copies
/// (layers × experts × replication) is more than any model served has.
pub const RANK_BITS: u32 = 24;

impl Placement {
    /// One node with `num_devices` devices: copies on distinct devices.
    pub fn single_node(
        moe_layers: &[bool],
        num_experts: usize,
        num_devices: usize,
        replication: usize,
    ) -> Result<Self, PlacementError> {
        Placement::on_one_node(
            moe_layers,
            num_experts,
            NodeSlots::new("", num_devices),
            replication,
        )
    }

    /// One node (its name is not used) whose devices hold at most `node.slots` experts of a
    /// layer each while others have room.
    pub fn on_one_node(
        moe_layers: &[bool],
        num_experts: usize,
        node: NodeSlots,
        replication: usize,
    ) -> Result<Self, PlacementError> {
        let spec = PlacementSpec {
            version: 1,
            replication,
            nodes: vec![NodeSlots {
                node: String::new(),
                ..node
            }],
        };
        Placement::balanced(moe_layers, num_experts, spec)
    }

    /// Spreads `spec.replication` copies of every expert of every MoE layer over the devices
    /// of `spec.nodes`. The copies of an expert sit on distinct nodes while there are nodes
    /// enough, else on distinct devices. Within a layer each device holds the same number of
    /// experts give or take one whenever the nodes offer equal devices: each copy goes to
    /// the least-filled eligible device, ties broken by a position that rotates with the
    /// layer so that uneven layers do not pile their extra experts on the first device.
    /// A device with as many experts as its [`NodeSlots::slots`] takes no more while an
    /// eligible device has room (where none has, the excess is spread evenly): where memory
    /// is tight, a device carrying a dense replica holds fewer experts than the others.
    pub fn balanced(
        moe_layers: &[bool],
        num_experts: usize,
        spec: PlacementSpec,
    ) -> Result<Self, PlacementError> {
        let mut names: Vec<&str> = spec.nodes.iter().map(|n| n.node.as_str()).collect();
        names.sort_unstable();
        if let Some(pair) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(PlacementError::DuplicateNode(pair[0].to_string()));
        }
        let devices = revise::device_order(&spec)?;
        let room = slots_by_device(&spec, &devices);
        let replication = spec.replication;
        if replication == 0 || replication > devices.len() {
            return Err(PlacementError::TooFewDevices {
                replication,
                devices: devices.len(),
            });
        }
        let distinct_nodes = replication <= spec.nodes.iter().filter(|n| n.devices > 0).count();
        let mut next_slot = 0usize;
        let replicas = moe_layers
            .iter()
            .map(|&is_moe| {
                if !is_moe {
                    return Vec::new();
                }
                let mut held = vec![0usize; devices.len()];
                (0..num_experts)
                    .map(|_| {
                        let mut copies: Vec<Replica> = Vec::with_capacity(replication);
                        for _ in 0..replication {
                            let eligible = |i: &usize| {
                                let r = devices[*i];
                                if distinct_nodes {
                                    copies.iter().all(|c| c.node != r.node)
                                } else {
                                    !copies.contains(&r)
                                }
                            };
                            // With room first, least filled first; among equals, the first
                            // at or after the rotating slot.
                            let n = devices.len();
                            let pick = (0..n)
                                .map(|k| (next_slot + k) % n)
                                .filter(eligible)
                                .min_by_key(|&i| fill_order(held[i], room[i]))
                                .expect("replication <= devices leaves an eligible device");
                            held[pick] += 1;
                            next_slot = (pick + 1) % n;
                            copies.push(devices[pick]);
                        }
                        copies
                    })
                    .collect()
            })
            .collect();
        Ok(Placement { spec, replicas })
    }

    pub fn spec(&self) -> &PlacementSpec {
        &self.spec
    }

    pub fn version(&self) -> u64 {
        self.spec.version
    }

    /// A hash of the whole table (its nodes, replication and every replica), never 0: two
    /// placements proposed under one version by two leaders (a partition) differ in it.
    /// Members gossip it beside the version, and where two tables share a version the lower
    /// hash wins everywhere. So its top [`RANK_BITS`] rank the table, lower for more copies
    /// (the larger side's table, which keeps every expert on more nodes, beats the one a
    /// node cut off alone made with every expert on itself); the rest is a SHA-256 of it.
    pub fn table_hash(&self) -> u64 {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        hash.update(self.spec.version.to_le_bytes());
        hash.update((self.spec.replication as u64).to_le_bytes());
        for node in &self.spec.nodes {
            hash.update(node.node.as_bytes());
            hash.update([0]);
            hash.update((node.devices as u64).to_le_bytes());
        }
        for layer in &self.replicas {
            hash.update((layer.len() as u64).to_le_bytes());
            for copies in layer {
                hash.update([copies.len() as u8]);
                for r in copies {
                    hash.update(r.node.to_le_bytes());
                    hash.update(r.device.to_le_bytes());
                }
            }
        }
        let digest = hash.finalize();
        let digest = u64::from_le_bytes(digest[..8].try_into().unwrap_or_default());
        let copies: usize = self.replicas.iter().flatten().map(Vec::len).sum();
        let most = (1u64 << RANK_BITS) - 1;
        let rank = most - (copies as u64).min(most);
        ((rank << (64 - RANK_BITS)) | (digest >> RANK_BITS)).max(1)
    }

    pub fn nodes(&self) -> &[NodeSlots] {
        &self.spec.nodes
    }

    /// The index replicas use for the node called `name`.
    pub fn node_index(&self, name: &str) -> Option<u16> {
        self.spec
            .nodes
            .iter()
            .position(|n| n.node == name)
            .map(|i| i as u16)
    }

    pub fn num_layers(&self) -> usize {
        self.replicas.len()
    }

    /// Experts placed in `layer` (0 for a dense layer).
    pub fn experts_in(&self, layer: usize) -> usize {
        self.replicas.get(layer).map_or(0, Vec::len)
    }

    /// Replicas of `expert` of `layer`; empty for dense layers or unknown experts.
    pub fn replicas(&self, layer: usize, expert: u32) -> &[Replica] {
        self.replicas
            .get(layer)
            .and_then(|experts| experts.get(expert as usize))
            .map_or(&[], Vec::as_slice)
    }

    /// Every (layer, expert) held by `device` of `node`.
    pub fn experts_on(&self, node: u16, device: u16) -> Vec<(usize, u32)> {
        let here = Replica { node, device };
        let mut held = Vec::new();
        for (layer, experts) in self.replicas.iter().enumerate() {
            for (expert, replicas) in experts.iter().enumerate() {
                if replicas.contains(&here) {
                    held.push((layer, expert as u32));
                }
            }
        }
        held
    }

    /// How many (layer, expert) copies `node` holds over all its devices.
    pub fn experts_held_by(&self, node: u16) -> usize {
        self.replicas
            .iter()
            .flatten()
            .map(|replicas| replicas.iter().filter(|r| r.node == node).count())
            .sum()
    }
}

/// A placement as it travels between nodes: its spec and every replica, `[layer][expert]`
/// → `[node, device]` pairs (empty for dense layers). A revised placement depends on the
/// ones before it, so nodes that take it take the whole table, not only the spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementTable {
    pub spec: PlacementSpec,
    pub layers: Vec<Vec<Vec<[u16; 2]>>>,
}

impl Placement {
    pub fn to_table(&self) -> PlacementTable {
        PlacementTable {
            spec: self.spec.clone(),
            layers: self
                .replicas
                .iter()
                .map(|layer| {
                    layer
                        .iter()
                        .map(|copies| copies.iter().map(|r| [r.node, r.device]).collect())
                        .collect()
                })
                .collect(),
        }
    }

    /// Checks a table received from another node against this model (`moe_layers`,
    /// `num_experts`): every MoE layer places every expert at least once, on devices the
    /// spec has, never twice on one device.
    pub fn from_table(
        table: PlacementTable,
        moe_layers: &[bool],
        num_experts: usize,
    ) -> Result<Placement, PlacementError> {
        let bad = |why: String| Err(PlacementError::BadTable(why));
        let PlacementTable { spec, layers } = table;
        revise::device_order(&spec)?;
        if layers.len() != moe_layers.len() {
            return bad(format!(
                "{} layers, the model has {}",
                layers.len(),
                moe_layers.len()
            ));
        }
        let mut replicas = Vec::with_capacity(layers.len());
        for (layer, (experts, &is_moe)) in layers.into_iter().zip(moe_layers).enumerate() {
            let expected = if is_moe { num_experts } else { 0 };
            if experts.len() != expected {
                return bad(format!(
                    "layer {layer} places {} experts, the model has {expected}",
                    experts.len()
                ));
            }
            let mut rows = Vec::with_capacity(experts.len());
            for (expert, pairs) in experts.into_iter().enumerate() {
                let copies: Vec<Replica> = pairs
                    .into_iter()
                    .map(|[node, device]| Replica { node, device })
                    .collect();
                let on_device = |r: &Replica| {
                    spec.nodes
                        .get(r.node as usize)
                        .is_some_and(|n| (r.device as usize) < n.devices)
                };
                let mut distinct = copies.clone();
                distinct.sort_unstable();
                distinct.dedup();
                if copies.is_empty()
                    || distinct.len() != copies.len()
                    || !copies.iter().all(on_device)
                {
                    return bad(format!(
                        "layer {layer} expert {expert}: replicas {copies:?} are not distinct \
                         devices of the spec"
                    ));
                }
                rows.push(copies);
            }
            replicas.push(rows);
        }
        Ok(Placement { spec, replicas })
    }
}

/// The order devices take copies in, least first: those with room by how many they hold,
/// then those without by how far past their room they are (all full: the excess is
/// spread evenly).
fn fill_order(held: usize, room: usize) -> (bool, usize) {
    match held.checked_sub(room) {
        None => (false, held),
        Some(past) => (true, past),
    }
}

/// The experts of a layer each of `devices` (in that order) has room for.
fn slots_by_device(spec: &PlacementSpec, devices: &[Replica]) -> Vec<usize> {
    devices
        .iter()
        .map(|r| spec.nodes[r.node as usize].slots_of(r.device as usize))
        .collect()
}

/// Version 1 of a placement over nodes `n0`, `n1`, ... with `devices[i]` devices each (for
/// the tests of this folder and of the replica choice).
#[cfg(test)]
pub(crate) fn numbered_spec(devices: &[usize], replication: usize) -> PlacementSpec {
    PlacementSpec {
        version: 1,
        replication,
        nodes: devices
            .iter()
            .enumerate()
            .map(|(i, &devices)| NodeSlots::new(format!("n{i}"), devices))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::placement::numbered_spec as spec;

    fn check_balanced(p: &Placement, layers: usize, experts: usize) {
        let devices: usize = p.nodes().iter().map(|n| n.devices).sum();
        for layer in 1..layers {
            let mut per_device: std::collections::HashMap<Replica, usize> = Default::default();
            for e in 0..experts as u32 {
                let r = p.replicas(layer, e);
                assert_eq!(r.len(), p.spec().replication);
                let mut distinct = r.to_vec();
                distinct.sort();
                distinct.dedup();
                assert_eq!(distinct.len(), r.len(), "copies on distinct devices");
                for &d in r {
                    *per_device.entry(d).or_default() += 1;
                }
            }
            let counts: Vec<usize> = per_device.values().copied().collect();
            let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            let min = if per_device.len() < devices { &0 } else { min };
            assert!(max - min <= 1, "layer {layer}: {per_device:?}");
        }
    }

    /// Two sides of a partition each re-placed the experts under version 2: the table of
    /// the two nodes (every expert twice) has the lower hash, so it wins everywhere, not
    /// the one node `n2` made alone (every expert once, on itself).
    #[test]
    fn of_two_tables_under_one_version_the_one_with_more_copies_wins() {
        let layers = [false, true, true];
        let p1 = Placement::balanced(&layers, 16, spec(&[1, 1, 1], 2)).unwrap();
        let larger = p1
            .revise(&[NodeSlots::new("n0", 1), NodeSlots::new("n1", 1)])
            .unwrap();
        let alone = p1.revise(&[NodeSlots::new("n2", 1)]).unwrap();
        assert_eq!((larger.version(), alone.version()), (2, 2));
        assert!(larger.table_hash() < alone.table_hash());
        // Tables with as many copies differ in the digest part of the hash.
        let other = p1
            .revise(&[NodeSlots::new("n1", 1), NodeSlots::new("n2", 1)])
            .unwrap();
        assert_ne!(larger.table_hash(), other.table_hash());
        assert_eq!(
            larger.table_hash() >> (64 - RANK_BITS),
            other.table_hash() >> (64 - RANK_BITS)
        );
    }

    #[test]
    fn one_node_balanced_within_one_and_replicas_distinct() {
        for (experts, devices, replication) in [(896, 2, 1), (10, 3, 2), (5, 4, 2), (7, 7, 7)] {
            let layers = [false, true, true, true];
            let p = Placement::single_node(&layers, experts, devices, replication).unwrap();
            assert!(p.replicas(0, 0).is_empty(), "dense layer holds no experts");
            check_balanced(&p, 4, experts);
        }
    }

    #[test]
    fn cluster_copies_on_distinct_nodes_and_balanced() {
        let layers = [false, true, true, true, true];
        for (nodes, experts, replication) in [
            (vec![1, 1, 1], 16, 2),
            (vec![2, 2, 2], 896, 2),
            (vec![1, 1, 1, 1], 10, 3),
            (vec![8, 8], 384, 2),
            (vec![2, 2, 2, 2, 2], 7, 2),
        ] {
            let p = Placement::balanced(&layers, experts, spec(&nodes, replication)).unwrap();
            check_balanced(&p, layers.len(), experts);
            for layer in 1..layers.len() {
                for e in 0..experts as u32 {
                    let mut on: Vec<u16> = p.replicas(layer, e).iter().map(|r| r.node).collect();
                    on.sort();
                    on.dedup();
                    assert_eq!(on.len(), replication, "copies of {e} on distinct nodes");
                }
            }
            // Each node holds its share (fewer than all experts when there are more nodes
            // than copies).
            let moe_layers = layers.len() - 1;
            let share = (experts * moe_layers * replication).div_ceil(nodes.len());
            for node in 0..nodes.len() as u16 {
                let held = p.experts_held_by(node);
                let slack = moe_layers * nodes[node as usize];
                assert!(
                    held <= share + slack,
                    "node {node} holds {held} of share {share}"
                );
                if replication < nodes.len() {
                    assert!(
                        held < experts * moe_layers,
                        "node {node} holds every expert"
                    );
                }
                let on_devices: usize = (0..nodes[node as usize] as u16)
                    .map(|d| p.experts_on(node, d).len())
                    .sum();
                assert_eq!(held, on_devices);
            }
        }
    }

    /// Per-device counts of layer `layer`, `[node][device]`.
    fn held(p: &Placement, layer: usize) -> Vec<Vec<usize>> {
        let mut held: Vec<Vec<usize>> = p.nodes().iter().map(|n| vec![0; n.devices]).collect();
        for e in 0..p.experts_in(layer) as u32 {
            for r in p.replicas(layer, e) {
                held[r.node as usize][r.device as usize] += 1;
            }
        }
        held
    }

    #[test]
    fn a_device_short_of_memory_holds_fewer_experts_only_when_it_must() {
        let layers = [true, true];
        // Two nodes of four devices, device 0 of each (a dense replica) with room for 5.
        let with_room = |rest: usize| {
            let mut s = spec(&[4, 4], 2);
            for n in &mut s.nodes {
                n.slots = vec![5, rest, rest, rest];
            }
            s
        };
        // 2 x 32 copies over 8 devices: 8 each would not fit device 0; it takes 5.
        let p = Placement::balanced(&layers, 32, with_room(100)).unwrap();
        for layer in 0..2 {
            for node in held(&p, layer) {
                assert_eq!(node[0], 5, "{node:?}");
                assert!(node[1..].iter().all(|&h| h == 9 || h == 10), "{node:?}");
            }
        }
        // Room enough everywhere: the even share, as without slots.
        let even = Placement::balanced(&layers, 16, with_room(100)).unwrap();
        assert_eq!(
            even.replicas,
            Placement::balanced(&layers, 16, spec(&[4, 4], 2))
                .unwrap()
                .replicas
        );
        // Room short everywhere (room for 5 + 3 x 6 = 23 of the 32 copies on a node): each
        // device holds the same number past its room (2 or 3).
        let short = Placement::balanced(&layers, 32, with_room(6)).unwrap();
        for node in held(&short, 0) {
            let past: Vec<usize> = node.iter().zip([5, 6, 6, 6]).map(|(h, r)| h - r).collect();
            assert!(past.iter().all(|&p| p == 2 || p == 3), "{node:?}");
        }
        // Copies of an expert stay on distinct nodes.
        check_balanced_nodes(&p);
    }

    fn check_balanced_nodes(p: &Placement) {
        for layer in 0..p.num_layers() {
            for e in 0..p.experts_in(layer) as u32 {
                let r = p.replicas(layer, e);
                assert_ne!(r[0].node, r[1].node, "{r:?}");
            }
        }
    }

    #[test]
    fn uneven_nodes_still_distinct_nodes() {
        let layers = [true, true];
        let p = Placement::balanced(&layers, 64, spec(&[4, 1, 1], 2)).unwrap();
        for layer in 0..2 {
            for e in 0..64 {
                let r = p.replicas(layer, e);
                assert_ne!(r[0].node, r[1].node);
            }
        }
    }

    #[test]
    fn same_spec_same_placement() {
        let layers = [true, false, true];
        let a = Placement::balanced(&layers, 33, spec(&[2, 3, 1], 2)).unwrap();
        let b = Placement::balanced(&layers, 33, spec(&[2, 3, 1], 2)).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn bad_specs_are_errors() {
        assert_eq!(
            Placement::single_node(&[true], 8, 2, 3),
            Err(PlacementError::TooFewDevices {
                replication: 3,
                devices: 2
            })
        );
        assert_eq!(
            Placement::single_node(&[true], 8, 0, 1),
            Err(PlacementError::NoDevices)
        );
        let mut dup = spec(&[1, 1], 1);
        dup.nodes[1].node = "n0".into();
        assert_eq!(
            Placement::balanced(&[true], 8, dup),
            Err(PlacementError::DuplicateNode("n0".into()))
        );
    }

    #[test]
    fn a_table_round_trips_and_a_wrong_one_is_refused() {
        let layers = [false, true, true];
        let p = Placement::balanced(&layers, 12, spec(&[2, 1, 1], 2)).unwrap();
        let revised = p.revise(&spec(&[2, 1], 2).nodes).unwrap();
        let json = serde_json::to_string(&revised.to_table()).unwrap();
        let back: PlacementTable = serde_json::from_str(&json).unwrap();
        assert_eq!(
            Placement::from_table(back.clone(), &layers, 12),
            Ok(revised)
        );
        let refused = |table: PlacementTable, layers: &[bool], experts: usize| {
            matches!(
                Placement::from_table(table, layers, experts),
                Err(PlacementError::BadTable(_))
            )
        };
        assert!(refused(back.clone(), &layers, 13), "another expert count");
        assert!(
            refused(back.clone(), &[true, true, true], 12),
            "dense layer placed"
        );
        let mut gone = back.clone();
        gone.layers[1][3][0] = [2, 0];
        assert!(refused(gone, &layers, 12), "a device node 2 no longer has");
        let mut twice = back.clone();
        twice.layers[2][0] = vec![[0, 1], [0, 1]];
        assert!(refused(twice, &layers, 12), "two copies on one device");
        let mut none = back;
        none.layers[2][5].clear();
        assert!(refused(none, &layers, 12), "an expert nowhere");
    }
}
