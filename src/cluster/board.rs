//! The placements a node can hand out: the one it serves and the next one, loaded ahead
//! of a switch. Nodes that join or follow a change read them from
//! `GET /cluster/placement/{version}`; they are there before the node is ready, since the
//! nodes of a new cluster load their shares at the same time.

use std::sync::{Arc, RwLock};

use crate::placement::Placement;

#[derive(Default)]
pub struct PlacementBoard {
    current: RwLock<Option<Arc<Placement>>>,
    next: RwLock<Option<Arc<Placement>>>,
}

fn read(slot: &RwLock<Option<Arc<Placement>>>) -> Option<Arc<Placement>> {
    slot.read().unwrap_or_else(|e| e.into_inner()).clone()
}

fn write(slot: &RwLock<Option<Arc<Placement>>>, value: Option<Arc<Placement>>) {
    *slot.write().unwrap_or_else(|e| e.into_inner()) = value;
}

impl PlacementBoard {
    /// The placement the node serves.
    pub fn current(&self) -> Option<Arc<Placement>> {
        read(&self.current)
    }

    /// The placement the node loads or has loaded, not yet switched to.
    pub fn next(&self) -> Option<Arc<Placement>> {
        read(&self.next)
    }

    /// Whichever of the two has `version`.
    pub fn get(&self, version: u64) -> Option<Arc<Placement>> {
        [self.current(), self.next()]
            .into_iter()
            .flatten()
            .find(|p| p.version() == version)
    }

    pub fn set_current(&self, placement: Arc<Placement>) {
        write(&self.current, Some(placement));
    }

    pub fn set_next(&self, placement: Arc<Placement>) {
        write(&self.next, Some(placement));
    }

    /// The next placement becomes the one served.
    pub fn switch(&self) -> Option<Arc<Placement>> {
        let next = self
            .next
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        self.set_current(next.clone());
        Some(next)
    }
}
