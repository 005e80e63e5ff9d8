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

    /// Sets `placement` as the next one unless a next one is there already (a change in
    /// progress) or it does not follow the current one (version + 1). The follower's
    /// proposals and a rebalance both go through here, so two proposals for one version
    /// cannot both be taken.
    pub fn offer_next(&self, placement: Arc<Placement>) -> Result<(), String> {
        let mut next = self.next.write().unwrap_or_else(|e| e.into_inner());
        if let Some(pending) = next.as_ref() {
            return Err(format!(
                "placement version {} is being loaded; try again once it is served",
                pending.version()
            ));
        }
        let current = self.current().map_or(0, |c| c.version());
        if placement.version() != current + 1 {
            return Err(format!(
                "placement version {} does not follow version {current}, the one served",
                placement.version()
            ));
        }
        *next = Some(placement);
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::Placement;

    #[test]
    fn only_one_next_version_is_taken_at_a_time() {
        let board = PlacementBoard::default();
        let v1 = Placement::single_node(&[true], 4, 2, 1).unwrap();
        board.set_current(Arc::new(v1.clone()));
        let v2 = v1
            .migrate(&[Some(vec![9.0, 1.0, 1.0, 1.0])], &[1, 1], 0)
            .unwrap()
            .versions
            .remove(0);
        assert_eq!(v2.version(), 2);
        let v3 = v2.revise(v2.nodes()).unwrap();
        assert!(
            board
                .offer_next(Arc::new(v3))
                .unwrap_err()
                .contains("does not follow")
        );
        board.offer_next(Arc::new(v2.clone())).unwrap();
        let other = v1.revise(v1.nodes()).unwrap();
        assert!(
            board
                .offer_next(Arc::new(other))
                .unwrap_err()
                .contains("being loaded")
        );
        assert_eq!(board.next().as_deref(), Some(&v2));
        assert_eq!(board.switch().as_deref(), Some(&v2));
        assert_eq!(board.current().map(|c| c.version()), Some(2));
    }
}
