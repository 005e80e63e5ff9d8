//! The member table: what this node believes about every member, fed from foca's state.
//!
//! Plain data, no sockets: the membership thread hands it foca's full membership state
//! after every event and publishes the result when it changed.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Instant;

use super::identity::{MemberMeta, NodeIdentity};

/// A member's liveness as this node sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberState {
    /// Answering probes (or vouched for by members that hear it).
    Alive,
    /// Missed a probe; drain new work off it. Becomes Dead unless it refutes in time.
    Suspect,
    /// Declared down (or left): fail its work over.
    Dead,
}

impl From<foca::State> for MemberState {
    fn from(state: foca::State) -> MemberState {
        match state {
            foca::State::Alive => MemberState::Alive,
            foca::State::Suspect => MemberState::Suspect,
            foca::State::Down => MemberState::Dead,
        }
    }
}

/// One member as this node sees it.
#[derive(Clone, Debug)]
pub struct MemberView {
    /// What the member says about itself.
    pub meta: MemberMeta,
    /// Its UDP gossip address.
    pub gossip: SocketAddr,
    /// Its liveness.
    pub state: MemberState,
    /// SWIM incarnation (grows when it refutes a suspicion; restarts at 0 with a new
    /// generation).
    pub incarnation: u64,
    /// Identity generation: grows on restart, renewal and metadata change.
    pub generation: u64,
    /// When this node last received a datagram from it (or first learned of it).
    pub last_heard: Instant,
    /// This entry is the local node.
    pub is_self: bool,
}

#[cfg(test)]
impl MemberView {
    /// A member as decisions see it, for unit tests: serving placement `serving`, having
    /// loaded `loaded`, one CPU device, its API at a loopback address that names it.
    pub(crate) fn for_test(node: &str, state: MemberState, serving: u64, loaded: u64) -> Self {
        MemberView {
            meta: MemberMeta {
                node: node.into(),
                peer: SocketAddr::from(([127, 0, 0, 1], 1)),
                api: SocketAddr::from(([127, 0, 0, node.len().min(255) as u8], 80)),
                devices: 1,
                rows_bf16: false,
                model: 7,
                placement_version: serving,
                loaded_version: loaded,
                placement_hash: 0,
                loaded_hash: 0,
                expert_room: u64::MAX,
                expert_bytes: 0,
                expert_slots: Vec::new(),
            },
            gossip: SocketAddr::from(([127, 0, 0, 1], 3)),
            state,
            incarnation: 0,
            generation: 0,
            last_heard: Instant::now(),
            is_self: false,
        }
    }
}

/// How many times members entered each state (the local node excluded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransitionTally {
    /// New members and members back from Suspect or Dead.
    pub alive: u64,
    /// Members that became Suspect.
    pub suspect: u64,
    /// Members that became Dead.
    pub dead: u64,
}

impl TransitionTally {
    fn count(&mut self, state: MemberState) {
        match state {
            MemberState::Alive => self.alive += 1,
            MemberState::Suspect => self.suspect += 1,
            MemberState::Dead => self.dead += 1,
        }
    }
}

/// Every member this node knows, keyed by gossip address (one entry per member however
/// many identities it went through).
#[derive(Debug)]
pub struct MemberTable {
    local: MemberView,
    others: HashMap<SocketAddr, MemberView>,
    transitions: TransitionTally,
}

impl MemberTable {
    /// A table that knows only the local node.
    pub fn new(local: &NodeIdentity, now: Instant) -> MemberTable {
        MemberTable {
            local: MemberView {
                meta: local.meta.clone(),
                gossip: local.gossip,
                state: MemberState::Alive,
                incarnation: 0,
                generation: local.generation,
                last_heard: now,
                is_self: true,
            },
            others: HashMap::new(),
            transitions: TransitionTally::default(),
        }
    }

    /// Records the local node's current identity and incarnation; true when it changed.
    pub fn set_local(&mut self, local: &NodeIdentity, incarnation: u64, now: Instant) -> bool {
        self.local.last_heard = now;
        let changed = self.local.meta != local.meta
            || self.local.generation != local.generation
            || self.local.incarnation != incarnation;
        self.local.meta = local.meta.clone();
        self.local.generation = local.generation;
        self.local.incarnation = incarnation;
        changed
    }

    /// A datagram from `gossip` passed authentication and screening.
    pub fn heard_from(&mut self, gossip: SocketAddr, now: Instant) {
        if let Some(view) = self.others.get_mut(&gossip) {
            view.last_heard = now;
        }
    }

    /// Replaces what the table knows by foca's full membership state `(identity,
    /// incarnation, state)`, counting transitions. Members foca forgot are dropped. Returns
    /// true when anything a reader can see changed (other than `last_heard`).
    pub fn sync<'a>(
        &mut self,
        state: impl Iterator<Item = (&'a NodeIdentity, u64, MemberState)>,
        now: Instant,
    ) -> bool {
        let mut changed = false;
        let mut present = HashSet::new();
        for (identity, incarnation, member_state) in state {
            present.insert(identity.gossip);
            match self.others.get_mut(&identity.gossip) {
                None => {
                    // A member first learned as Dead (gossip about an old death) is not a
                    // transition this node saw.
                    if member_state != MemberState::Dead {
                        self.transitions.count(member_state);
                    }
                    self.others.insert(
                        identity.gossip,
                        MemberView {
                            meta: identity.meta.clone(),
                            gossip: identity.gossip,
                            state: member_state,
                            incarnation,
                            generation: identity.generation,
                            last_heard: now,
                            is_self: false,
                        },
                    );
                    changed = true;
                }
                Some(view) => {
                    if view.state != member_state {
                        self.transitions.count(member_state);
                        view.state = member_state;
                        changed = true;
                    }
                    if view.meta != identity.meta
                        || view.generation != identity.generation
                        || view.incarnation != incarnation
                    {
                        view.meta = identity.meta.clone();
                        view.generation = identity.generation;
                        view.incarnation = incarnation;
                        changed = true;
                    }
                }
            }
        }
        // Foca forgets down members after `remove_down_after`: forget them too.
        let before = self.others.len();
        self.others.retain(|gossip, _| present.contains(gossip));
        changed || before != self.others.len()
    }

    /// Every member, the local node first, then by node id. Gateways are left out (see
    /// [`MemberMeta::is_gateway`]): they serve nothing, so no decision counts them.
    pub fn views(&self) -> Vec<MemberView> {
        let mut others: Vec<MemberView> = self
            .others
            .values()
            .filter(|m| !m.meta.is_gateway())
            .cloned()
            .collect();
        others.sort_by(|a, b| a.meta.node.cmp(&b.meta.node).then(a.gossip.cmp(&b.gossip)));
        let mut views = Vec::with_capacity(others.len() + 1);
        views.push(self.local.clone());
        views.extend(others);
        views
    }

    /// Transitions counted so far.
    pub fn transitions(&self) -> TransitionTally {
        self.transitions
    }

    /// The member at `gossip`, if known (never the local node).
    #[cfg(test)]
    pub fn get(&self, gossip: SocketAddr) -> Option<&MemberView> {
        self.others.get(&gossip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(index: u8, generation: u64) -> NodeIdentity {
        let gossip = SocketAddr::from(([10, 0, 0, index], 7946));
        NodeIdentity {
            meta: MemberMeta {
                node: format!("node-{index}"),
                peer: SocketAddr::from(([10, 0, 0, index], 7000)),
                api: SocketAddr::from(([10, 0, 0, index], 8000)),
                devices: 1,
                rows_bf16: false,
                model: 1,
                placement_version: 0,
                loaded_version: 0,
                placement_hash: 0,
                loaded_hash: 0,
                expert_room: u64::MAX,
                expert_bytes: 0,
                expert_slots: Vec::new(),
            },
            gossip,
            generation,
        }
    }

    fn sync(table: &mut MemberTable, members: &[(NodeIdentity, u64, MemberState)]) -> bool {
        table.sync(
            members
                .iter()
                .map(|(id, incarnation, state)| (id, *incarnation, *state)),
            Instant::now(),
        )
    }

    #[test]
    fn joins_suspicion_and_death_are_counted() {
        let mut table = MemberTable::new(&identity(1, 1), Instant::now());
        let b = identity(2, 1);
        assert!(sync(&mut table, &[(b.clone(), 0, MemberState::Alive)]));
        assert!(!sync(&mut table, &[(b.clone(), 0, MemberState::Alive)]));
        assert!(sync(&mut table, &[(b.clone(), 0, MemberState::Suspect)]));
        // Refuted: a higher incarnation, Alive again.
        assert!(sync(&mut table, &[(b.clone(), 1, MemberState::Alive)]));
        assert!(sync(&mut table, &[(b.clone(), 1, MemberState::Suspect)]));
        assert!(sync(&mut table, &[(b.clone(), 1, MemberState::Dead)]));
        assert_eq!(
            table.transitions(),
            TransitionTally {
                alive: 2,
                suspect: 2,
                dead: 1
            }
        );
        let views = table.views();
        assert_eq!(views.len(), 2);
        assert!(views[0].is_self);
        assert_eq!(views[1].state, MemberState::Dead);
        assert_eq!(views[1].incarnation, 1);
    }

    #[test]
    fn a_restarted_member_replaces_its_dead_self() {
        let mut table = MemberTable::new(&identity(1, 1), Instant::now());
        let old = identity(2, 1);
        sync(&mut table, &[(old.clone(), 3, MemberState::Alive)]);
        sync(&mut table, &[(old.clone(), 3, MemberState::Dead)]);
        let restarted = identity(2, 9);
        assert!(sync(
            &mut table,
            &[(restarted.clone(), 0, MemberState::Alive)]
        ));
        let view = table.get(restarted.gossip).expect("known");
        assert_eq!(view.state, MemberState::Alive);
        assert_eq!(view.generation, 9);
        assert_eq!(table.views().len(), 2, "one entry per member");
        assert_eq!(table.transitions().alive, 2);
    }

    #[test]
    fn metadata_changes_are_changes_but_not_transitions() {
        let mut table = MemberTable::new(&identity(1, 1), Instant::now());
        let before = identity(2, 1);
        sync(&mut table, &[(before.clone(), 0, MemberState::Alive)]);
        let mut after = before.clone();
        after.meta.placement_version = 7;
        after.generation = 2;
        assert!(sync(&mut table, &[(after.clone(), 0, MemberState::Alive)]));
        assert_eq!(table.transitions().alive, 1);
        assert_eq!(
            table
                .get(after.gossip)
                .map(|view| view.meta.placement_version),
            Some(7)
        );
    }

    #[test]
    fn members_first_learned_dead_are_listed_but_not_counted() {
        let mut table = MemberTable::new(&identity(1, 1), Instant::now());
        assert!(sync(&mut table, &[(identity(2, 1), 0, MemberState::Dead)]));
        assert_eq!(table.transitions(), TransitionTally::default());
        assert_eq!(table.views().len(), 2);
    }

    #[test]
    fn forgotten_members_leave_the_table() {
        let mut table = MemberTable::new(&identity(1, 1), Instant::now());
        sync(&mut table, &[(identity(2, 1), 0, MemberState::Dead)]);
        assert!(sync(&mut table, &[]));
        assert_eq!(table.views().len(), 1);
    }

    #[test]
    fn local_changes_are_reported() {
        let local = identity(1, 1);
        let mut table = MemberTable::new(&local, Instant::now());
        assert!(!table.set_local(&local, 0, Instant::now()));
        let renewed = local.with_meta(MemberMeta {
            placement_version: 3,
            loaded_version: 3,
            placement_hash: 0,
            loaded_hash: 0,
            expert_room: u64::MAX,
            expert_bytes: 0,
            expert_slots: Vec::new(),
            ..local.meta.clone()
        });
        assert!(table.set_local(&renewed, 0, Instant::now()));
        assert_eq!(table.views()[0].meta.placement_version, 3);
    }
}
