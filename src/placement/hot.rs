//! A placement with hot-expert copies: the layout `serve` starts with, plus copies of the
//! experts a profile shows hot in the devices' spare slots ([`replicate::add_replicas`]).
//! Every copy of the base layout stays where it is, so going from one such placement to
//! the next loads only the copies added and drops only the copies no longer wanted.
//!
//! An expert's base copies come first in its replica list and the hot copies after them
//! (the search only adds and moves unpinned copies), so the base layout of any placement is
//! its first `replication` copies of each expert ([`Placement::without_hot_copies`]): a
//! cluster, whose layout changes with its members, lays the next copies over that.

use std::collections::HashMap;

use super::replicate::{self, LayerReplicas, LayerSlots};
use super::{Placement, PlacementError, Replica};

impl Placement {
    /// The base layout under `self`: each expert's first `spec.replication` copies (a
    /// placement revised after a membership change holds no more than those).
    pub fn without_hot_copies(&self) -> Placement {
        let keep = self.spec.replication.max(1);
        let replicas = self
            .replicas
            .iter()
            .map(|layer| {
                layer
                    .iter()
                    .map(|copies| copies.iter().take(keep).copied().collect())
                    .collect()
            })
            .collect();
        Placement {
            spec: self.spec.clone(),
            replicas,
        }
    }

    /// Each device's share of `loads` (one MoE layer's load per expert, split evenly over
    /// each expert's copies), devices numbered node by node.
    pub fn device_loads(&self, layer: usize, loads: &[f64]) -> Vec<f64> {
        let mut first_device = Vec::with_capacity(self.spec.nodes.len());
        let mut devices = 0;
        for n in &self.spec.nodes {
            first_device.push(devices);
            devices += n.devices;
        }
        let mut per_device = vec![0.0; devices];
        for (expert, &load) in loads.iter().enumerate() {
            let copies = self.replicas(layer, expert as u32);
            for r in copies {
                let index = first_device
                    .get(r.node as usize)
                    .map(|first| first + r.device as usize);
                if let Some(d) = index.and_then(|i| per_device.get_mut(i)) {
                    *d += load / copies.len() as f64;
                }
            }
        }
        per_device
    }

    /// Keeps `current`'s copies for each layer where both lay hot copies over the same
    /// base, `current`'s fit `spare_slots` extra per device, and they balance `loads`
    /// within `tolerance` (relative) of `self`'s: a rebalance on a workload that has not
    /// changed then loads and drops nothing there.
    pub fn keep_layers_of(
        &mut self,
        current: &Placement,
        loads: &[Option<Vec<f64>>],
        spare_slots: usize,
        tolerance: f64,
    ) {
        if current.spec.nodes != self.spec.nodes
            || current.spec.replication != self.spec.replication
        {
            return;
        }
        let keep = self.spec.replication.max(1);
        for (layer, layer_loads) in loads.iter().enumerate() {
            let Some(layer_loads) = layer_loads else {
                continue;
            };
            let (Some(mine), Some(theirs)) =
                (self.replicas.get(layer), current.replicas.get(layer))
            else {
                continue;
            };
            let same_base = mine.len() == theirs.len()
                && mine
                    .iter()
                    .zip(theirs)
                    .all(|(a, b)| a.iter().take(keep).eq(b.iter().take(keep)));
            if !same_base {
                continue;
            }
            let mut base_held = HashMap::<Replica, usize>::new();
            let mut held = HashMap::<Replica, usize>::new();
            for copies in theirs {
                for (i, r) in copies.iter().enumerate() {
                    if i < keep {
                        *base_held.entry(*r).or_default() += 1;
                    }
                    *held.entry(*r).or_default() += 1;
                }
            }
            let fits = held
                .iter()
                .all(|(r, &n)| n <= base_held.get(r).copied().unwrap_or(0) + spare_slots);
            let worst = |p: &Placement| {
                p.device_loads(layer, layer_loads)
                    .into_iter()
                    .fold(0.0f64, f64::max)
            };
            if fits && worst(current) <= worst(self) * (1.0 + tolerance) {
                self.replicas[layer] = theirs.clone();
            }
        }
    }

    /// `self` (the base layout) with copies of hot experts in `spare_slots` extra slots per
    /// device and MoE layer, as version `version`. `loads[layer]` is the layer's load per
    /// expert; a layer with none (or no load at all) keeps its base copies.
    pub fn with_hot_copies(
        &self,
        loads: &[Option<Vec<f64>>],
        spare_slots: usize,
        version: u64,
    ) -> Result<Placement, PlacementError> {
        // Devices numbered node by node.
        let devices: Vec<Replica> = self
            .spec
            .nodes
            .iter()
            .enumerate()
            .flat_map(|(node, slots)| {
                (0..slots.devices).map(move |device| Replica {
                    node: node as u16,
                    device: device as u16,
                })
            })
            .collect();
        let index = |r: &Replica| devices.iter().position(|d| d == r);
        let mut replicas = self.replicas.clone();
        for (layer, experts) in replicas.iter_mut().enumerate() {
            let Some(layer_loads) = loads.get(layer).and_then(Option::as_ref) else {
                continue;
            };
            if experts.is_empty()
                || layer_loads.len() != experts.len()
                || layer_loads.iter().sum::<f64>() <= 0.0
            {
                continue;
            }
            let serving = LayerReplicas {
                devices_of: experts
                    .iter()
                    .map(|copies| copies.iter().filter_map(index).collect())
                    .collect(),
            };
            let mut capacity = vec![spare_slots; devices.len()];
            for &d in serving.devices_of.iter().flatten() {
                capacity[d] += 1;
            }
            let slots = LayerSlots {
                node_of: devices.iter().map(|d| d.node).collect(),
                capacity,
            };
            let placed = replicate::add_replicas(layer_loads, &slots, &serving)
                .map_err(|e| PlacementError::BadTable(format!("layer {layer}: {e}")))?;
            *experts = placed
                .devices_of
                .into_iter()
                .map(|copies| copies.into_iter().map(|d| devices[d]).collect())
                .collect();
        }
        let mut spec = self.spec.clone();
        spec.version = version;
        Ok(Placement { spec, replicas })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hot_experts_get_copies_and_the_base_copies_stay() {
        let base = Placement::single_node(&[false, true], 16, 4, 1).unwrap();
        let mut loads = vec![1.0; 16];
        loads[3] = 40.0;
        let hot = base.with_hot_copies(&[None, Some(loads)], 1, 2).unwrap();
        assert_eq!(hot.version(), 2);
        assert!(hot.replicas(1, 3).len() > 1, "{:?}", hot.replicas(1, 3));
        for e in 0..16 {
            assert!(hot.replicas(1, e).contains(&base.replicas(1, e)[0]));
        }
        for d in 0..4 {
            assert!(hot.experts_on(0, d).len() <= 16 / 4 + 1);
        }
        // The base copies come first: dropping the hot ones gives the base back.
        let mut unhot = hot.without_hot_copies();
        assert_eq!(unhot.to_table().layers, base.to_table().layers);
        unhot.spec.version = 1;
        assert_eq!(unhot, base);
        // It travels like any placement.
        let back = Placement::from_table(hot.to_table(), &[false, true], 16).unwrap();
        assert_eq!(back, hot);
        // No profile, no copies.
        assert_eq!(
            base.with_hot_copies(&[None, None], 1, 2)
                .unwrap()
                .to_table()
                .layers,
            base.to_table().layers
        );
    }

    #[test]
    fn a_rebalance_on_an_unchanged_workload_keeps_the_copies_it_has() {
        let base = Placement::single_node(&[false, true], 16, 4, 1).unwrap();
        let mut loads = vec![1.0; 16];
        loads[3] = 40.0;
        loads[7] = 20.0;
        let loads = [None, Some(loads)];
        let hot = base.with_hot_copies(&loads, 2, 2).unwrap();
        // The same workload, a little noisier: the copies stay (within 5%).
        let mut noisy = loads.clone();
        if let Some(l) = noisy[1].as_mut() {
            l[3] = 41.0;
        }
        let mut next = hot
            .without_hot_copies()
            .with_hot_copies(&noisy, 2, 3)
            .unwrap();
        // Laid afresh, the copies land elsewhere (the search breaks ties anew) ...
        assert_ne!(next.to_table().layers, hot.to_table().layers);
        // ... but they balance no better: the copies held stay.
        next.keep_layers_of(&hot, &noisy, 2, 0.05);
        assert_eq!(next.to_table().layers, hot.to_table().layers);
        assert_eq!(next.version(), 3);
        // A workload that moved: the new copies win.
        let mut moved = vec![1.0; 16];
        moved[11] = 60.0;
        let moved = [None, Some(moved)];
        let fresh = hot
            .without_hot_copies()
            .with_hot_copies(&moved, 2, 3)
            .unwrap();
        let mut next = fresh.clone();
        next.keep_layers_of(&hot, &moved, 2, 0.05);
        assert_eq!(next, fresh);
        assert!(next.replicas(1, 11).len() > 1);
        // Fewer spare slots than the copies held: the current copies do not fit.
        let mut next = hot
            .without_hot_copies()
            .with_hot_copies(&loads, 1, 3)
            .unwrap();
        let fewer = next.clone();
        next.keep_layers_of(&hot, &loads, 1, 10.0);
        assert_eq!(next, fewer);
    }

    #[test]
    fn across_nodes_the_base_stays_on_distinct_nodes_and_a_second_rebalance_starts_from_it() {
        use super::super::{NodeSlots, PlacementSpec};
        let spec = PlacementSpec {
            version: 4,
            replication: 2,
            nodes: ["a", "b"]
                .iter()
                .map(|n| NodeSlots {
                    node: n.to_string(),
                    devices: 2,
                })
                .collect(),
        };
        let base = Placement::balanced(&[false, true], 16, spec).unwrap();
        let mut loads = vec![1.0; 16];
        loads[5] = 50.0;
        loads[9] = 20.0;
        let hot = base.with_hot_copies(&[None, Some(loads)], 2, 5).unwrap();
        assert!(hot.replicas(1, 5).len() > 2, "{:?}", hot.replicas(1, 5));
        for e in 0..16 {
            let copies = hot.replicas(1, e);
            assert_eq!(&copies[..2], base.replicas(1, e), "expert {e}: base first");
            assert_ne!(
                copies[0].node, copies[1].node,
                "expert {e}: base on two nodes"
            );
            let mut distinct = copies.to_vec();
            distinct.sort();
            distinct.dedup();
            assert_eq!(
                distinct.len(),
                copies.len(),
                "expert {e}: one copy per device"
            );
        }
        // The next rebalance, on a workload gone flat, starts from the base: the hot copies
        // it no longer wants are dropped.
        let flat = hot
            .without_hot_copies()
            .with_hot_copies(&[None, Some(vec![1.0; 16])], 2, 6)
            .unwrap();
        assert!(flat.replicas(1, 5).len() <= hot.replicas(1, 5).len());
        assert_eq!(flat.version(), 6);
    }
}
