//! What this node's devices hold, by (layer, expert), as replicas the dispatcher can choose
//! among when it runs work that came from another node.

use std::collections::HashSet;

use crate::placement::Replica;

/// What this node's devices hold now, which during a change of placement is more than
/// the placement it routes by says: work from other nodes runs on whatever device holds
/// its expert, whichever placement version the sender routed by.
pub(super) struct Holdings {
    /// `[layer][expert]` → local devices, as replicas of the node [`HELD_HERE`].
    pub(super) replicas: Vec<Vec<Vec<Replica>>>,
    pub(super) by_device: Vec<HashSet<(usize, u32)>>,
}

/// The node index [`Holdings`] give this node's devices.
pub(super) const HELD_HERE: u16 = u16::MAX;

impl Holdings {
    pub(super) fn new(
        by_device: Vec<HashSet<(usize, u32)>>,
        layers: usize,
        experts: usize,
    ) -> Self {
        let mut replicas = vec![vec![Vec::new(); experts]; layers];
        for (device, held) in by_device.iter().enumerate() {
            for &(layer, expert) in held {
                if let Some(copies) = replicas
                    .get_mut(layer)
                    .and_then(|l: &mut Vec<Vec<Replica>>| l.get_mut(expert as usize))
                {
                    copies.push(Replica {
                        node: HELD_HERE,
                        device: device as u16,
                    });
                }
            }
        }
        for copies in replicas.iter_mut().flatten() {
            copies.sort_unstable();
        }
        Holdings {
            replicas,
            by_device,
        }
    }

    pub(super) fn replicas(&self, layer: usize, expert: u32) -> &[Replica] {
        self.replicas
            .get(layer)
            .and_then(|l| l.get(expert as usize))
            .map_or(&[], Vec::as_slice)
    }
}
