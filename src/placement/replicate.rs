//! Hot-expert replicas for one MoE layer: given how much work each expert gets (a load
//! profile) and how many experts each device may hold (its share plus spare slots, as its
//! memory permits), choose how many copies each expert gets and where, so that the most
//! loaded device carries as little as possible. A replicated expert's load is split evenly
//! over its copies (the dispatcher sends each group to the least busy copy).
//!
//! Two algorithms, both pure:
//! - [`eplb`]: DeepSeek's EPLB as published, the baseline: give the next copy to the expert
//!   with the highest load per copy until the slots are used, then pack the copies heaviest
//!   first, each onto the least loaded device that may take it.
//! - [`balance`] (moe-node's): EPLB's layout improved by local search ([`super::improve`]):
//!   moves and swaps of copies off the most loaded device, and copies taken from an expert
//!   that needs them least and given to one on the most loaded device. A step is taken only
//!   when it lowers the most loaded device's load without lifting any other device to it,
//!   so the result is never worse than EPLB's, and the search ends.
//!
//! Both keep every expert's copies on distinct devices, and its first `min_copies` copies
//! on distinct nodes while there are nodes enough (a node failure then never takes every
//! copy). [`add_replicas`] keeps a given layout (the one serving) and only fills spare
//! slots, so a live rebalance loads the new copies and moves nothing else.

use std::collections::BinaryHeap;

use super::improve::improve;
use super::layout::Layout;
pub use super::layout::{CopyChange, LayerReplicas, LayerSlots, Step, imbalance};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReplicateError {
    #[error("no device may hold an expert")]
    NoDevices,
    #[error(
        "{copies} copies of each of {experts} experts need {needed} slots; the devices offer {slots}"
    )]
    NotEnoughSlots {
        experts: usize,
        copies: usize,
        needed: usize,
        slots: usize,
    },
    #[error("{copies} copies of an expert need as many devices; {devices} may hold experts")]
    TooFewDevices { copies: usize, devices: usize },
    #[error("expert {expert}'s load {load} is not a finite number at least 0")]
    BadLoad { expert: usize, load: f64 },
    #[error("the layout given places {given} experts; the profile has {experts}")]
    WrongExperts { given: usize, experts: usize },
    #[error("no device may take another copy of expert {expert} (every one with room holds it)")]
    NoRoom { expert: usize },
}

/// Checks the inputs every algorithm shares and returns the number of nodes an expert's
/// first copies spread over.
pub(super) fn check(
    loads: &[f64],
    slots: &LayerSlots,
    min_copies: usize,
) -> Result<usize, ReplicateError> {
    if let Some((expert, &load)) = loads
        .iter()
        .enumerate()
        .find(|(_, l)| !l.is_finite() || **l < 0.0)
    {
        return Err(ReplicateError::BadLoad { expert, load });
    }
    let usable = slots.capacity.iter().filter(|&&c| c > 0).count();
    if usable == 0 || slots.capacity.len() != slots.node_of.len() {
        return Err(ReplicateError::NoDevices);
    }
    let copies = min_copies.max(1);
    if copies > usable {
        return Err(ReplicateError::TooFewDevices {
            copies,
            devices: usable,
        });
    }
    let total: usize = slots.capacity.iter().sum();
    if total < loads.len() * copies {
        return Err(ReplicateError::NotEnoughSlots {
            experts: loads.len(),
            copies,
            needed: loads.len() * copies,
            slots: total,
        });
    }
    Ok(copies.min(slots.usable_nodes()))
}

/// How many copies each expert gets: `min_copies` each, then every remaining slot to the
/// expert with the highest load per copy (never more copies than devices).
pub(super) fn copy_counts(loads: &[f64], slots: &LayerSlots, min_copies: usize) -> Vec<usize> {
    let usable = slots.capacity.iter().filter(|&&c| c > 0).count();
    let total: usize = slots.capacity.iter().sum();
    let mut counts = vec![min_copies; loads.len()];
    let mut spare = total - loads.len() * min_copies;
    let mut heap: BinaryHeap<PerCopy> = loads
        .iter()
        .enumerate()
        .map(|(expert, &load)| PerCopy {
            load: load / min_copies as f64,
            expert,
        })
        .collect();
    while spare > 0 {
        let Some(top) = heap.pop() else { break };
        if counts[top.expert] >= usable {
            continue;
        }
        counts[top.expert] += 1;
        spare -= 1;
        heap.push(PerCopy {
            load: loads[top.expert] / counts[top.expert] as f64,
            expert: top.expert,
        });
    }
    counts
}

/// An expert keyed by its load per copy: highest first, then the lower expert id.
#[derive(PartialEq)]
struct PerCopy {
    load: f64,
    expert: usize,
}

impl Eq for PerCopy {}

impl PartialOrd for PerCopy {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for PerCopy {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.load
            .total_cmp(&other.load)
            .then(other.expert.cmp(&self.expert))
    }
}

/// DeepSeek's EPLB (the baseline): copies to the expert with the highest load per copy
/// until the slots are used, then each copy, heaviest first, onto the least loaded device
/// that may take it.
pub fn eplb(
    loads: &[f64],
    slots: &LayerSlots,
    min_copies: usize,
) -> Result<LayerReplicas, ReplicateError> {
    let spread = check(loads, slots, min_copies)?;
    let min_copies = min_copies.max(1);
    let counts = copy_counts(loads, slots, min_copies);
    // Copies heaviest first. Where the first copies must sit on distinct nodes, those go
    // first (a small node filled with hot copies could otherwise have no room left for an
    // expert whose only other node is full), then the extra copies.
    let copies = |from: usize, to: Option<usize>| -> Vec<(f64, usize)> {
        let mut items: Vec<(f64, usize)> = counts
            .iter()
            .enumerate()
            .flat_map(|(expert, &count)| {
                let n = to.unwrap_or(count).min(count).saturating_sub(from);
                std::iter::repeat_n((loads[expert] / count as f64, expert), n)
            })
            .collect();
        items.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        items
    };
    let phases = if spread > 1 {
        vec![copies(0, Some(min_copies)), copies(min_copies, None)]
    } else {
        vec![copies(0, None)]
    };
    let mut layout = Layout::empty(loads, slots, spread);
    for (_, expert) in phases.into_iter().flatten() {
        match layout.place(expert) {
            Ok(()) => {}
            // A copy beyond the minimum that no device can take (the devices without one
            // are full of copies that cannot move): the expert makes do with fewer.
            Err(ReplicateError::NoRoom { .. }) if layout.devices_of[expert].len() >= min_copies => {
            }
            Err(e) => return Err(e),
        }
    }
    Ok(layout.into_replicas())
}

/// moe-node's algorithm: EPLB's layout, then local search ([`super::improve`]). Never
/// worse than [`eplb`] on the same input.
pub fn balance(
    loads: &[f64],
    slots: &LayerSlots,
    min_copies: usize,
) -> Result<LayerReplicas, ReplicateError> {
    let spread = check(loads, slots, min_copies)?;
    let start = eplb(loads, slots, min_copies)?;
    let mut layout = Layout::from_replicas(loads, slots, spread, &start, false);
    layout.min_copies = min_copies.max(1);
    improve(&mut layout);
    Ok(layout.into_replicas())
}

/// Keeps `serving` (every copy stays where it is) and fills the spare slots `slots` leaves
/// with copies of the experts that most load the most loaded devices, then improves the
/// added copies by local search. What a live rebalance loads is exactly the added copies.
pub fn add_replicas(
    loads: &[f64],
    slots: &LayerSlots,
    serving: &LayerReplicas,
) -> Result<LayerReplicas, ReplicateError> {
    if serving.devices_of.len() != loads.len() {
        return Err(ReplicateError::WrongExperts {
            given: serving.devices_of.len(),
            experts: loads.len(),
        });
    }
    let min_copies = serving.devices_of.iter().map(Vec::len).min().unwrap_or(1);
    let spread = check(loads, slots, min_copies)?;
    let mut layout = Layout::from_replicas(loads, slots, spread, serving, true);
    layout.min_copies = min_copies.max(1);
    improve(&mut layout);
    Ok(layout.into_replicas())
}

/// EPLB's packing step, on the layout it builds.
impl Layout<'_> {
    /// Puts one more copy of `expert` on the least loaded device that may take it; when
    /// every device with room holds it, first moves another expert's copy out of the way.
    pub(super) fn place(&mut self, expert: usize) -> Result<(), ReplicateError> {
        self.begin_step();
        let pick = (0..self.slots.num_devices())
            .filter(|&d| self.has_room(d) && self.may_take(expert, d, None))
            .min_by(|&a, &b| self.device_load[a].total_cmp(&self.device_load[b]));
        let device = match pick {
            Some(d) => d,
            None => self.make_room(expert)?,
        };
        self.add_copy(expert, device);
        Ok(())
    }

    /// Frees a slot for `expert` on a device that may take it, by moving one copy of some
    /// other expert from there to a device with room (least loaded such pair first).
    fn make_room(&mut self, expert: usize) -> Result<usize, ReplicateError> {
        let mut best: Option<(f64, usize, usize, usize)> = None;
        for target in 0..self.slots.num_devices() {
            if !self.may_take(expert, target, None) || self.slots.capacity[target] == 0 {
                continue;
            }
            for &other in &self.held[target] {
                for free in 0..self.slots.num_devices() {
                    if free != target
                        && self.has_room(free)
                        && self.may_take(other, free, Some(target))
                    {
                        let load = self.device_load[target].max(self.device_load[free]);
                        if best.is_none_or(|b| load < b.0) {
                            best = Some((load, target, other, free));
                        }
                    }
                }
            }
        }
        let (_, target, other, free) = best.ok_or(ReplicateError::NoRoom { expert })?;
        self.move_copy(other, target, free);
        Ok(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Zipf-like loads: the expert at rank r (a fixed shuffle of ids) gets 1 / r^skew.
    fn zipf(experts: usize, skew: f64, seed: u64) -> Vec<f64> {
        let mut order: Vec<usize> = (0..experts).collect();
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        for i in (1..experts).rev() {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            order.swap(i, (state >> 33) as usize % (i + 1));
        }
        let mut loads = vec![0.0; experts];
        for (rank, &expert) in order.iter().enumerate() {
            loads[expert] = 1000.0 / ((rank + 1) as f64).powf(skew);
        }
        loads
    }

    /// Every expert has at least `min_copies` copies, all on distinct devices, within the
    /// devices' capacities; the first copies on distinct nodes while there are enough.
    fn check_valid(r: &LayerReplicas, slots: &LayerSlots, experts: usize, min_copies: usize) {
        assert_eq!(r.devices_of.len(), experts);
        let mut held = vec![0usize; slots.num_devices()];
        let nodes = slots.usable_nodes();
        for (e, devices) in r.devices_of.iter().enumerate() {
            assert!(devices.len() >= min_copies, "expert {e}: {devices:?}");
            let mut distinct = devices.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(
                distinct.len(),
                devices.len(),
                "expert {e} twice on a device"
            );
            let mut on: Vec<u16> = devices.iter().map(|&d| slots.node_of[d]).collect();
            on.sort_unstable();
            on.dedup();
            assert!(on.len() >= devices.len().min(min_copies).min(nodes));
            for &d in devices {
                held[d] += 1;
            }
        }
        for (d, &h) in held.iter().enumerate() {
            assert!(h <= slots.capacity[d], "device {d} holds {h}");
        }
    }

    #[test]
    fn without_spare_slots_896_experts_fill_8_and_64_devices_exactly() {
        let loads = zipf(896, 1.0, 7);
        for (nodes, per_node) in [(8, 1), (8, 8), (1, 8)] {
            let devices = nodes * per_node;
            let slots = LayerSlots::uniform(nodes, per_node, 896 / devices);
            for r in [
                eplb(&loads, &slots, 1).unwrap(),
                balance(&loads, &slots, 1).unwrap(),
            ] {
                check_valid(&r, &slots, 896, 1);
                assert_eq!(r.copies(), 896, "no slot to spare, no copy added");
            }
        }
    }

    #[test]
    fn one_spare_slot_per_device_is_used_for_hot_experts_and_balances() {
        let loads = zipf(896, 1.0, 3);
        let slots = LayerSlots::uniform(8, 8, 896 / 64 + 1);
        let plain = eplb(&loads, &LayerSlots::uniform(8, 8, 14), 1).unwrap();
        let baseline = eplb(&loads, &slots, 1).unwrap();
        let ours = balance(&loads, &slots, 1).unwrap();
        for r in [&baseline, &ours] {
            check_valid(r, &slots, 896, 1);
            assert_eq!(r.copies(), 896 + 64);
        }
        let (unreplicated, eplb_ratio, ours_ratio) = (
            plain.imbalance(&loads, 64),
            baseline.imbalance(&loads, 64),
            ours.imbalance(&loads, 64),
        );
        assert!(
            ours_ratio <= eplb_ratio + 1e-9,
            "{ours_ratio} > {eplb_ratio}"
        );
        assert!(eplb_ratio < unreplicated, "{eplb_ratio} vs {unreplicated}");
        assert!(ours_ratio < 1.10, "one spare slot: {ours_ratio}");
        // The hottest expert has the most copies.
        let hottest = (0..896)
            .max_by(|&a, &b| loads[a].total_cmp(&loads[b]))
            .unwrap();
        let most = ours.devices_of.iter().map(Vec::len).max().unwrap();
        assert_eq!(ours.devices_of[hottest].len(), most);
    }

    #[test]
    fn replication_two_keeps_copies_on_distinct_nodes() {
        let loads = zipf(896, 0.8, 11);
        // 8 workers of one device each, replication 2, one spare slot.
        let slots = LayerSlots::uniform(8, 1, 2 * 896 / 8 + 1);
        for r in [
            eplb(&loads, &slots, 2).unwrap(),
            balance(&loads, &slots, 2).unwrap(),
        ] {
            check_valid(&r, &slots, 896, 2);
        }
    }

    #[test]
    fn uneven_capacities_and_a_device_short_of_memory_are_respected() {
        let loads = zipf(100, 1.2, 5);
        // Three nodes; node 2's second device has room for only 3 experts (its memory).
        let slots = LayerSlots {
            node_of: vec![0, 0, 1, 1, 2, 2],
            capacity: vec![40, 40, 40, 40, 40, 3],
        };
        for min_copies in [1, 2] {
            let ours = balance(&loads, &slots, min_copies).unwrap();
            check_valid(&ours, &slots, 100, min_copies);
            let baseline = eplb(&loads, &slots, min_copies).unwrap();
            check_valid(&baseline, &slots, 100, min_copies);
            assert!(ours.imbalance(&loads, 6) <= baseline.imbalance(&loads, 6) + 1e-9);
        }
    }

    #[test]
    fn a_small_node_still_gets_every_required_copy() {
        // One device on node 0, three on node 1, two copies each on distinct nodes: node 0
        // must keep a slot for every expert, however hot the others are.
        let slots = LayerSlots {
            node_of: vec![0, 1, 1, 1],
            capacity: vec![7, 4, 4, 3],
        };
        let loads = [8.0, 83110.0, 0.0, 2.0, 7.0];
        for r in [
            eplb(&loads, &slots, 2).unwrap(),
            balance(&loads, &slots, 2).unwrap(),
        ] {
            check_valid(&r, &slots, 5, 2);
        }
    }

    #[test]
    fn never_worse_than_eplb_over_many_profiles() {
        for seed in 0..20 {
            for (skew, spare) in [(0.6, 1), (1.0, 2), (1.4, 1), (0.0, 0)] {
                let loads = zipf(96, skew, seed);
                let slots = LayerSlots::uniform(4, 4, 6 + spare);
                let a = eplb(&loads, &slots, 1).unwrap().imbalance(&loads, 16);
                let b = balance(&loads, &slots, 1).unwrap().imbalance(&loads, 16);
                assert!(b <= a + 1e-9, "seed {seed} skew {skew}: {b} > {a}");
            }
        }
    }

    #[test]
    fn adding_replicas_keeps_the_serving_layout_and_fills_only_spare_slots() {
        let loads = zipf(64, 1.0, 9);
        let serving = LayerReplicas {
            devices_of: (0..64).map(|e| vec![e % 4]).collect(),
        };
        let slots = LayerSlots::uniform(1, 4, 16 + 2);
        let before = serving.imbalance(&loads, 4);
        let after = add_replicas(&loads, &slots, &serving).unwrap();
        check_valid(&after, &slots, 64, 1);
        for (e, devices) in serving.devices_of.iter().enumerate() {
            assert!(
                after.devices_of[e].contains(&devices[0]),
                "expert {e} moved"
            );
        }
        assert!(after.copies() <= 64 + 8);
        assert!(after.imbalance(&loads, 4) < before, "{before}");
    }

    #[test]
    fn bad_inputs_are_errors_not_panics() {
        let slots = LayerSlots::uniform(1, 2, 2);
        assert_eq!(
            eplb(&[1.0; 5], &slots, 1),
            Err(ReplicateError::NotEnoughSlots {
                experts: 5,
                copies: 1,
                needed: 5,
                slots: 4
            })
        );
        assert!(matches!(
            balance(&[1.0, f64::NAN], &slots, 1),
            Err(ReplicateError::BadLoad { expert: 1, .. })
        ));
        assert_eq!(
            balance(&[1.0], &slots, 3),
            Err(ReplicateError::TooFewDevices {
                copies: 3,
                devices: 2
            })
        );
        assert_eq!(
            eplb(&[1.0], &LayerSlots::uniform(1, 2, 0), 1),
            Err(ReplicateError::NoDevices)
        );
        let wrong = LayerReplicas {
            devices_of: vec![vec![0]],
        };
        assert!(matches!(
            add_replicas(&[1.0, 2.0], &slots, &wrong),
            Err(ReplicateError::WrongExperts { .. })
        ));
    }

    #[test]
    fn idle_layers_are_laid_out_too() {
        let slots = LayerSlots::uniform(2, 2, 5);
        let r = balance(&[0.0; 8], &slots, 2).unwrap();
        check_valid(&r, &slots, 8, 2);
        assert_eq!(r.imbalance(&[0.0; 8], 4), 0.0);
    }
}
