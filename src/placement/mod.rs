//! Which device holds which expert, and which replica serves a group of tokens. Pure
//! functions and plain types: the router actor feeds them device health and carries out
//! what they decide.

pub mod load;

pub use load::ExpertLoad;

/// The expert → devices map of one node: `replicas(layer, expert)` lists the devices holding
/// a copy, all distinct.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    num_devices: usize,
    /// `[layer][expert]` → devices; empty rows for dense layers.
    replicas: Vec<Vec<Vec<usize>>>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("no devices to place experts on")]
    NoDevices,
    #[error("replication {replication} needs as many devices, but there are {devices}")]
    TooFewDevices { replication: usize, devices: usize },
}

impl Placement {
    /// Spreads `replication` copies of every expert of every MoE layer over `num_devices`
    /// devices: within a layer each device holds the same number of experts give or take
    /// one, and the copies of an expert sit on distinct devices. Layers start at different
    /// devices so the extra experts of uneven layers do not pile up on device 0.
    pub fn balanced(
        moe_layers: &[bool],
        num_experts: usize,
        num_devices: usize,
        replication: usize,
    ) -> Result<Self, PlacementError> {
        if num_devices == 0 {
            return Err(PlacementError::NoDevices);
        }
        if replication == 0 || replication > num_devices {
            return Err(PlacementError::TooFewDevices {
                replication,
                devices: num_devices,
            });
        }
        let slots_per_layer = num_experts * replication;
        let replicas = moe_layers
            .iter()
            .enumerate()
            .map(|(layer, &is_moe)| {
                if !is_moe {
                    return Vec::new();
                }
                (0..num_experts)
                    .map(|e| {
                        // Consecutive slots of one expert land on consecutive devices, which
                        // are distinct because replication <= num_devices.
                        (0..replication)
                            .map(|r| (layer * slots_per_layer + e * replication + r) % num_devices)
                            .collect()
                    })
                    .collect()
            })
            .collect();
        Ok(Placement {
            num_devices,
            replicas,
        })
    }

    pub fn num_devices(&self) -> usize {
        self.num_devices
    }

    pub fn num_layers(&self) -> usize {
        self.replicas.len()
    }

    /// Devices holding `expert` of `layer`; empty for dense layers or unknown experts.
    pub fn replicas(&self, layer: usize, expert: u32) -> &[usize] {
        self.replicas
            .get(layer)
            .and_then(|experts| experts.get(expert as usize))
            .map_or(&[], Vec::as_slice)
    }

    /// Every (layer, expert) held by `device`.
    pub fn experts_on(&self, device: usize) -> Vec<(usize, u32)> {
        let mut held = Vec::new();
        for (layer, experts) in self.replicas.iter().enumerate() {
            for (expert, devices) in experts.iter().enumerate() {
                if devices.contains(&device) {
                    held.push((layer, expert as u32));
                }
            }
        }
        held
    }
}

/// Chooses, for each active expert of a step, the device that runs its rows: a live replica,
/// the least loaded one so far in this step (ties go to the first listed). Returns the
/// device per expert, or the first expert that has no live replica.
pub fn assign_groups(
    placement: &Placement,
    layer: usize,
    experts: &[u32],
    rows_per_expert: impl Fn(usize) -> usize,
    alive: &[bool],
) -> Result<Vec<usize>, u32> {
    let mut step_load = vec![0usize; placement.num_devices()];
    let mut chosen = Vec::with_capacity(experts.len());
    for (i, &expert) in experts.iter().enumerate() {
        let device = placement
            .replicas(layer, expert)
            .iter()
            .copied()
            .filter(|&d| alive.get(d).copied().unwrap_or(false))
            .min_by_key(|&d| step_load[d])
            .ok_or(expert)?;
        step_load[device] += rows_per_expert(i);
        chosen.push(device);
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_within_one_and_replicas_distinct() {
        for (experts, devices, replication) in [(896, 2, 1), (10, 3, 2), (5, 4, 2), (7, 7, 7)] {
            let layers = [false, true, true, true];
            let p = Placement::balanced(&layers, experts, devices, replication).unwrap();
            assert!(p.replicas(0, 0).is_empty(), "dense layer holds no experts");
            for layer in 1..4 {
                let mut per_device = vec![0; devices];
                for e in 0..experts as u32 {
                    let r = p.replicas(layer, e);
                    assert_eq!(r.len(), replication);
                    let mut distinct = r.to_vec();
                    distinct.sort();
                    distinct.dedup();
                    assert_eq!(distinct.len(), replication, "copies on distinct devices");
                    for &d in r {
                        per_device[d] += 1;
                    }
                }
                let (min, max) = (per_device.iter().min(), per_device.iter().max());
                assert!(max.unwrap() - min.unwrap() <= 1, "{per_device:?}");
            }
        }
    }

    #[test]
    fn too_few_devices_is_an_error() {
        assert_eq!(
            Placement::balanced(&[true], 8, 2, 3),
            Err(PlacementError::TooFewDevices {
                replication: 3,
                devices: 2
            })
        );
        assert_eq!(
            Placement::balanced(&[true], 8, 0, 1),
            Err(PlacementError::NoDevices)
        );
    }

    #[test]
    fn groups_go_to_live_replicas_least_loaded_first() {
        let p = Placement::balanced(&[true], 4, 2, 2).unwrap();
        let experts = [0, 1, 2, 3];
        let rows = |i: usize| [5, 1, 1, 1][i];
        // Both alive: expert 0 (5 rows) on one device, the rest balance onto the other.
        let chosen = assign_groups(&p, 0, &experts, rows, &[true, true]).unwrap();
        assert_eq!(chosen[0], 0);
        assert!(chosen[1..].iter().all(|&d| d == 1), "{chosen:?}");
        // Device 0 dead: everything fails over to device 1.
        let chosen = assign_groups(&p, 0, &experts, rows, &[false, true]).unwrap();
        assert_eq!(chosen, vec![1, 1, 1, 1]);
        // No replication and a dead device: the experts it held have no live copy.
        let single = Placement::balanced(&[true], 4, 2, 1).unwrap();
        let lost = assign_groups(&single, 0, &experts, rows, &[false, true]).unwrap_err();
        assert_eq!(single.replicas(0, lost), &[0]);
    }
}
