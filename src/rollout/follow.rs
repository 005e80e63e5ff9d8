//! Placement changes while the cluster serves: copy, then switch.
//!
//! The lowest-id serving node (the leader) proposes the next placement version when a node
//! holding experts has been gone for `cluster.rereplicate_after_ms` (its copies are made
//! again on the others) or when a node serves that the placement does not use (a joiner,
//! a node come back: it gets a share). Every node then, while it goes on serving the
//! current version:
//! 1. fetches the next version from a member that announces it (`loaded_version` in its
//!    gossip metadata) and loads the experts it newly holds, from its own copy of the
//!    checkpoint;
//! 2. announces it has loaded it; once every live member has, it switches at a step
//!    boundary (the dispatcher reads one placement per step);
//! 3. once every live member serves the new version, it lets go of the experts the new
//!    version puts elsewhere (until then other nodes may still route by the old one, and
//!    work from other nodes runs on whatever device holds its expert).
//!
//! [`Follower::decide`] is the pure decision; [`follow`] runs it on a thread of its own.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::board::PlacementBoard;
use super::bootstrap::fetch_table;
use super::room::{spread, without_room};
use super::{drain, table_id};
use crate::cluster::{MemberState, MemberView, Membership, TableId};
use crate::experts::Dispatcher;
use crate::experts::device::{ReleaseExperts, TakeExperts, expert_room, load_experts};
use crate::experts::remote::{PeerNodes, best_member};
use crate::model::{Checkpoint, ModelConfig};
use crate::placement::{NodeSlots, Placement};

/// What a node does next about placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Idle,
    /// (Leader) Propose the next version over these nodes; `why` goes to the log.
    Propose {
        nodes: Vec<NodeSlots>,
        why: String,
    },
    /// Take version `version` from the member whose API is at `api`.
    Fetch {
        api: SocketAddr,
        version: u64,
    },
    /// Load this node's share of the next version.
    Load,
    /// Every live member has loaded the next version: serve it.
    Switch,
    /// Every live member serves the current version: let go of what it puts elsewhere.
    Release,
    /// This node's own gossip says other versions than it serves and has loaded (a write
    /// of its metadata crossed another, as at start-up): say them again, or the others
    /// wait forever for a load they cannot see.
    Announce {
        serving: TableId,
        loaded: TableId,
    },
}

/// What one node knows about the change in progress, besides the members and placements.
pub struct Follower {
    me: String,
    /// How long a node holding experts may be gone before its copies are made again.
    grace: Duration,
    /// Since when each node holding experts has been seen gone.
    gone_since: HashMap<String, Instant>,
    /// The newest placement whose share this node loaded.
    pub loaded: TableId,
    /// The version whose leftovers this node let go of.
    pub released: u64,
    /// When this node last told its membership which versions it serves and has loaded.
    pub said_at: Instant,
}

/// How long this node's own gossip may lag what it told its membership (the membership
/// thread writes it within milliseconds) before the follower says it again.
const SAY_AGAIN_AFTER: Duration = Duration::from_secs(1);

/// Whether a member takes part: serving (it has a placement) and not dead.
fn serving(m: &MemberView) -> bool {
    m.state != MemberState::Dead && m.meta.placement_version > 0
}

/// The one speaking for each node other than `me`, by id.
fn others_of<'a>(me: &str, members: &'a [MemberView]) -> Vec<&'a MemberView> {
    let mut ids: Vec<&str> = members
        .iter()
        .map(|m| m.meta.node.as_str())
        .filter(|id| !id.is_empty() && *id != me)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids.into_iter()
        .filter_map(|id| best_member(members, id))
        .collect()
}

/// Why a node may not propose the next placement now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotNow {
    /// Another serving node has a lower id: it leads, and only it proposes.
    NotLeader { leader: String, api: SocketAddr },
    /// A change is in progress: a live member serves or has loaded another version.
    Unsettled(String),
}

impl std::fmt::Display for NotNow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotNow::NotLeader { leader, api } => write!(
                f,
                "the cluster's placement is proposed by its leader, node `{leader}` (the \
                 lowest serving id): ask it (http://{api})"
            ),
            NotNow::Unsettled(why) => write!(
                f,
                "a placement change is in progress ({why}); try again once it is served"
            ),
        }
    }
}

/// Whether `me`, serving placement version `current`, may propose the next one: it leads
/// (the lowest id of the serving nodes that are not dead, so that two nodes never propose
/// two different placements under one version) and every live serving member serves and
/// has loaded `current` (no change in progress).
pub fn may_propose(me: &str, members: &[MemberView], current: u64) -> Result<(), NotNow> {
    let others = others_of(me, members);
    if let Some(leader) = others
        .iter()
        .filter(|m| serving(m) && m.meta.node.as_str() < me)
        .min_by(|a, b| a.meta.node.cmp(&b.meta.node))
    {
        return Err(NotNow::NotLeader {
            leader: leader.meta.node.clone(),
            api: leader.meta.api,
        });
    }
    if let Some(m) = others.iter().find(|m| {
        m.state == MemberState::Alive
            && m.meta.placement_version > 0
            && (m.meta.placement_version != current || m.meta.loaded_version != current)
    }) {
        return Err(NotNow::Unsettled(format!(
            "node `{}` serves version {} and has loaded version {}, this node serves {current}",
            m.meta.node, m.meta.placement_version, m.meta.loaded_version
        )));
    }
    Ok(())
}

impl Follower {
    pub fn new(me: &str, grace: Duration, serving: TableId) -> Self {
        Follower {
            me: me.to_string(),
            grace,
            gone_since: HashMap::new(),
            loaded: serving,
            released: serving.version,
            said_at: Instant::now(),
        }
    }

    fn others<'a>(&self, members: &'a [MemberView]) -> Vec<&'a MemberView> {
        others_of(&self.me, members)
    }

    /// What this node offers: its devices as its own gossip says them (a leader that was
    /// re-placed away while it was gone, and is back, offers its devices again), else as
    /// the placement served has them.
    fn offered(&self, members: &[MemberView], current: &Placement) -> NodeSlots {
        if let Some(me) = self.own_view(members) {
            return super::offered(&me.meta);
        }
        current.node_index(&self.me).map_or_else(
            || NodeSlots::new(self.me.clone(), 0),
            |i| current.nodes()[i as usize].clone(),
        )
    }

    /// This node as its own membership shows it.
    fn own_view<'a>(&self, members: &'a [MemberView]) -> Option<&'a MemberView> {
        members.iter().find(|m| m.is_self && m.meta.node == self.me)
    }

    /// What this node's gossip should say and does not: the placement served, and the
    /// newest one loaded.
    fn unsaid(&self, members: &[MemberView], current: &Placement, now: Instant) -> Option<Step> {
        if now.duration_since(self.said_at) < SAY_AGAIN_AFTER {
            return None;
        }
        let me = self.own_view(members)?;
        let serving = table_id(current);
        let loaded = self.loaded.loaded_beside(serving);
        let said = me.meta.serving().agrees(serving) && me.meta.loaded().agrees(loaded);
        (!said).then_some(Step::Announce { serving, loaded })
    }

    /// The step toward `next`, the placement this node has taken and not yet switched to.
    fn toward(&self, others: &[&MemberView], next: &Placement) -> Step {
        let alive_serving = || {
            others
                .iter()
                .filter(|m| m.state == MemberState::Alive && m.meta.placement_version > 0)
        };
        let ours = table_id(next);
        // Two leaders proposed this version, one on each side of a partition: the table
        // with the lower hash wins everywhere, so that every node switches to one table
        // (the one with more copies: `Placement::table_hash` ranks by them).
        if let Some(m) = alive_serving()
            .filter(|m| {
                m.meta.loaded_version == ours.version
                    && m.meta.loaded_hash != 0
                    && m.meta.loaded_hash < ours.hash
            })
            .min_by_key(|m| m.meta.loaded_hash)
        {
            return Step::Fetch {
                api: m.meta.api,
                version: ours.version,
            };
        }
        if self.loaded != ours {
            return Step::Load;
        }
        // Every live member has loaded it, or serves this version already: as another
        // table only after a partition, which the leader mends with the next version
        // once everyone serves this one.
        if alive_serving().all(|m| {
            m.meta.loaded_version > ours.version
                || m.meta.loaded().agrees(ours)
                || m.meta.placement_version >= ours.version
        }) {
            return Step::Switch;
        }
        Step::Idle
    }

    /// Decides the next step from the members gossip shows, the placement served and the
    /// next one if known.
    pub fn decide(
        &mut self,
        members: &[MemberView],
        current: &Placement,
        next: Option<&Placement>,
        now: Instant,
    ) -> Step {
        let others = self.others(members);
        let alive_serving = || {
            others
                .iter()
                .filter(|m| m.state == MemberState::Alive && m.meta.placement_version > 0)
        };
        if let Some(announce) = self.unsaid(members, current, now) {
            return announce;
        }
        if let Some(next) = next {
            return self.toward(&others, next);
        }
        // The newest version a member has loaded; of two tables under it, the winner.
        if let Some(m) = others
            .iter()
            .filter(|m| m.state == MemberState::Alive && m.meta.loaded_version > current.version())
            .min_by_key(|m| {
                (
                    std::cmp::Reverse(m.meta.loaded_version),
                    m.meta.loaded_hash,
                    &m.meta.node,
                )
            })
        {
            return Step::Fetch {
                api: m.meta.api,
                version: m.meta.loaded_version,
            };
        }
        let served = table_id(current);
        // Let go only once every live member serves this very table (or a later one).
        if self.released < served.version
            && alive_serving().all(|m| {
                m.meta.placement_version > served.version || m.meta.serving().agrees(served)
            })
        {
            return Step::Release;
        }
        let proposes = may_propose(&self.me, members, current.version()).is_ok();
        // Track who is gone (only the leader acts on it, but any node may become leader).
        let live: HashMap<&str, NodeSlots> = others
            .iter()
            .filter(|m| serving(m))
            .map(|m| (m.meta.node.as_str(), super::offered(&m.meta)))
            .chain(std::iter::once((
                self.me.as_str(),
                self.offered(members, current),
            )))
            .collect();
        self.gone_since
            .retain(|node, _| !live.contains_key(node.as_str()));
        for n in current.nodes().iter().filter(|n| n.devices > 0) {
            if !live.contains_key(n.node.as_str()) {
                self.gone_since.entry(n.node.clone()).or_insert(now);
            }
        }
        if !proposes {
            return Step::Idle;
        }
        let mut reasons = Vec::new();
        let mut nodes: Vec<NodeSlots> = Vec::new();
        for n in current.nodes() {
            match live.get(n.node.as_str()) {
                Some(offered) => {
                    if offered.devices != n.devices {
                        reasons.push(format!(
                            "{} serves with {} devices",
                            n.node, offered.devices
                        ));
                    }
                    if offered.devices > 0 {
                        nodes.push(offered.clone());
                    }
                }
                None if n.devices > 0 => {
                    let since = self.gone_since.get(&n.node).copied().unwrap_or(now);
                    if now.duration_since(since) >= self.grace {
                        reasons.push(format!(
                            "{} has been gone {:.1} s",
                            n.node,
                            now.duration_since(since).as_secs_f32()
                        ));
                    } else {
                        // Still within its grace: it keeps its share.
                        nodes.push(n.clone());
                    }
                }
                None => {}
            }
        }
        for m in alive_serving().filter(|m| {
            m.meta.placement_version == served.version && !m.meta.serving().agrees(served)
        }) {
            reasons.push(format!(
                "{} serves version {} as another table (two leaders proposed it, on either \
                 side of a partition)",
                m.meta.node, served.version
            ));
        }
        for (&node, offered) in &live {
            if current.node_index(node).is_none() && offered.devices > 0 {
                reasons.push(format!("{node} joined"));
                nodes.push(offered.clone());
            }
        }
        if reasons.is_empty() {
            return Step::Idle;
        }
        reasons.sort();
        nodes.sort_by(|a, b| a.node.cmp(&b.node));
        Step::Propose {
            nodes,
            why: reasons.join(", "),
        }
    }
}

/// The parts of a node a placement change touches.
pub struct FollowParts {
    pub node_id: String,
    pub membership: Membership,
    pub board: Arc<PlacementBoard>,
    pub dispatcher: Arc<Dispatcher>,
    pub peers: Arc<PeerNodes>,
    pub checkpoint: Arc<Checkpoint>,
    pub model: Arc<ModelConfig>,
    /// This node's API keys as they are now (other nodes' APIs take them).
    pub live: Arc<crate::config::live::LiveSettings>,
    pub grace: Duration,
}

/// How often the follower looks at the membership.
const TICK: Duration = Duration::from_millis(200);

/// Follows placement changes on a thread of its own until `stop` is set.
pub fn follow(parts: FollowParts, stop: Arc<AtomicBool>) {
    let spawned = std::thread::Builder::new()
        .name("moe-node-placement".into())
        .spawn(move || {
            let current = parts.dispatcher.placement();
            let mut follower = Follower::new(&parts.node_id, parts.grace, table_id(&current));
            while !stop.load(Ordering::Relaxed) {
                let current = parts.dispatcher.placement();
                let next = parts.board.next();
                let members = parts.membership.members();
                let step = follower.decide(&members, &current, next.as_deref(), Instant::now());
                if step != Step::Idle {
                    carry_out(&parts, &mut follower, &current, next, step);
                } else {
                    std::thread::sleep(TICK);
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the thread that follows placement changes");
    }
}

fn carry_out(
    parts: &FollowParts,
    follower: &mut Follower,
    current: &Arc<Placement>,
    next: Option<Arc<Placement>>,
    step: Step,
) {
    match step {
        Step::Idle => {}
        Step::Announce { serving, loaded } => {
            tracing::warn!(
                serving = serving.version,
                loaded = loaded.version,
                "this node's gossip lagged what it serves and has loaded: saying it again"
            );
            parts.membership.set_versions(serving, loaded);
            follower.said_at = Instant::now();
        }
        Step::Propose { nodes, why } => match current.revise(&nodes) {
            Ok(placement) => {
                let mine = expert_room(&parts.dispatcher.devices());
                let members = parts.membership.members();
                let short = without_room(current, &placement, &members, &parts.node_id, mine);
                let placement = if short.is_empty() {
                    placement
                } else {
                    let short: Vec<String> = short.iter().map(ToString::to_string).collect();
                    match spread(current, &placement, &nodes, &members, &parts.node_id, mine) {
                        Ok(Some(spread)) => {
                            tracing::warn!(
                                reason = %why,
                                "placement change spread over the nodes with room: {}",
                                short.join("; ")
                            );
                            spread
                        }
                        _ => {
                            tracing::warn!(
                                reason = %why,
                                "placement change refused (no spread fits), tried again in 5 s: {}",
                                short.join("; ")
                            );
                            std::thread::sleep(Duration::from_secs(5));
                            return;
                        }
                    }
                };
                let version = placement.version();
                match parts.board.offer_next(Arc::new(placement)) {
                    Ok(()) => tracing::info!(
                        version,
                        reason = %why,
                        "proposing a new placement (this node leads: lowest serving id)"
                    ),
                    // A rebalance proposed first: this change comes after it.
                    Err(e) => tracing::info!(reason = %why, "not proposing now: {e}"),
                }
            }
            Err(e) => {
                tracing::error!(error = %e, reason = %why, "cannot place the experts anew");
                std::thread::sleep(Duration::from_secs(5));
            }
        },
        Step::Fetch { api, version } => {
            let fetched = fetch_table(api, version, &parts.live.local_api_keys()).and_then(|t| {
                Placement::from_table(t, &parts.model.moe_layers, parts.model.moe.num_experts)
                    .map_err(|e| e.to_string())
            });
            match fetched {
                Ok(placement) => {
                    tracing::info!(version, from = %api, "took the next placement");
                    parts.board.set_next(Arc::new(placement));
                }
                Err(e) => {
                    tracing::warn!(version, from = %api, error = %e, "cannot fetch the next placement; trying again");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
        Step::Load => {
            let Some(next) = next else { return };
            load_share(parts, &next);
            publish_room(parts);
            follower.loaded = table_id(&next);
            parts
                .membership
                .set_versions(table_id(current), follower.loaded);
            follower.said_at = Instant::now();
        }
        Step::Switch => {
            let Some(next) = parts.board.switch() else {
                return;
            };
            let local = next.node_index(&parts.node_id).unwrap_or(u16::MAX);
            parts
                .peers
                .set_nodes(next.nodes().iter().map(|n| n.node.clone()).collect());
            let switch = parts.dispatcher.set_placement(next.clone(), local);
            let pause = switch.pause;
            for (node, reach, renewed) in parts.peers.reach_of_nodes() {
                parts.dispatcher.set_node_reach(node, reach, renewed);
            }
            // Other nodes let go of what the old version put on them once this node says it
            // serves the new one: not before this node's calls routing by the old one end.
            drain(switch, next.version());
            parts.membership.set_serving(table_id(&next));
            follower.said_at = Instant::now();
            tracing::info!(
                version = next.version(),
                experts_here = next.experts_held_by(local),
                pause_us = pause.as_micros() as u64,
                "serving the new placement"
            );
        }
        Step::Release => {
            let local = current.node_index(&parts.node_id).unwrap_or(u16::MAX);
            // The handles as they are now: a device started again by an operator has a new one.
            for device in &parts.dispatcher.devices() {
                let keep: HashSet<(usize, u32)> = current
                    .experts_on(local, device.id as u16)
                    .into_iter()
                    .collect();
                let held = parts.dispatcher.held_by(device.id);
                if held.is_subset(&keep) {
                    continue;
                }
                // The dispatcher stops using them first, then the device lets go.
                parts
                    .dispatcher
                    .set_held_by(device.id, held.intersection(&keep).copied().collect());
                let left = futures::executor::block_on(device.addr.send(ReleaseExperts(keep)));
                tracing::info!(device = device.id, holds = ?left.ok(), "released experts placed elsewhere now");
            }
            follower.released = current.version();
            publish_room(parts);
        }
    }
}

/// Gossips this node's room for experts, as its devices count it now (after a load or a
/// release).
fn publish_room(parts: &FollowParts) {
    let (room, bytes) = expert_room(&parts.dispatcher.devices());
    parts.membership.set_room(room, bytes);
}

/// Loads onto each device the experts `next` gives it that it does not hold yet. Reads
/// happen here, off the device threads, which keep computing meanwhile.
fn load_share(parts: &FollowParts, next: &Placement) {
    let Some(local) = next.node_index(&parts.node_id) else {
        return;
    };
    for device in &parts.dispatcher.devices() {
        let held = parts.dispatcher.held_by(device.id);
        let missing: Vec<(usize, u32)> = next
            .experts_on(local, device.id as u16)
            .into_iter()
            .filter(|e| !held.contains(e))
            .collect();
        if missing.is_empty() {
            continue;
        }
        let started = Instant::now();
        let weights = match load_experts(&parts.checkpoint, &parts.model, &missing) {
            Ok(weights) => weights,
            Err(e) => {
                tracing::error!(device = device.id, error = %e, "cannot load the experts of the new placement: other replicas serve them");
                continue;
            }
        };
        match futures::executor::block_on(device.addr.send(TakeExperts(weights))) {
            Ok(Ok(holds)) => {
                let mut now_held = held;
                now_held.extend(missing.iter().copied());
                parts.dispatcher.set_held_by(device.id, now_held);
                tracing::info!(
                    device = device.id,
                    loaded = missing.len(),
                    holds,
                    seconds = started.elapsed().as_secs_f32(),
                    version = next.version(),
                    "loaded the experts of the next placement"
                );
            }
            Ok(Err(e)) => {
                tracing::error!(device = device.id, error = %e, "cannot take the experts of the new placement: other replicas serve them")
            }
            Err(_) => tracing::warn!(device = device.id, "device stopped while taking experts"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::PlacementSpec;

    fn member(node: &str, state: MemberState, serving: u64, loaded: u64) -> MemberView {
        MemberView::for_test(node, state, serving, loaded)
    }

    fn three() -> Placement {
        let spec = PlacementSpec {
            version: 1,
            replication: 2,
            nodes: ["a", "b", "c"]
                .iter()
                .map(|n| NodeSlots::new(*n, 1))
                .collect(),
        };
        Placement::balanced(&[true], 6, spec).unwrap()
    }

    const GRACE: Duration = Duration::from_secs(10);
    /// Version 1, its table not said (hash 0: as members that gossip no hash).
    const FIRST: TableId = TableId {
        version: 1,
        hash: 0,
    };

    #[test]
    fn the_leader_rereplicates_a_node_gone_past_its_grace_and_only_the_leader() {
        use MemberState::*;
        let p1 = three();
        let t0 = Instant::now();
        let members = [member("b", Alive, 1, 1), member("c", Dead, 1, 1)];
        let mut a = Follower::new("a", GRACE, FIRST);
        assert_eq!(
            a.decide(&members, &p1, None, t0),
            Step::Idle,
            "within grace"
        );
        let later = t0 + GRACE;
        match a.decide(&members, &p1, None, later) {
            Step::Propose { nodes, why } => {
                let ids: Vec<&str> = nodes.iter().map(|n| n.node.as_str()).collect();
                assert_eq!(ids, ["a", "b"]);
                assert!(why.contains("c has been gone"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        // b is not the leader while a serves.
        let mut b = Follower::new("b", GRACE, FIRST);
        let seen_by_b = [member("a", Alive, 1, 1), member("c", Dead, 1, 1)];
        b.decide(&seen_by_b, &p1, None, t0);
        assert_eq!(b.decide(&seen_by_b, &p1, None, later), Step::Idle);
        // A node back within its grace changes nothing.
        let back = [member("b", Alive, 1, 1), member("c", Alive, 1, 1)];
        assert_eq!(a.decide(&back, &p1, None, later), Step::Idle);
    }

    /// The leader was gone long enough for the others to re-place its experts (its entry
    /// kept with no devices), and is back, serving: it gives itself a share again, from the
    /// devices its own gossip offers.
    #[test]
    fn a_leader_back_after_being_re_placed_away_takes_a_share_again() {
        use MemberState::*;
        let p2 = three()
            .revise(&[NodeSlots::new("b", 1), NodeSlots::new("c", 1)])
            .unwrap();
        assert_eq!(p2.nodes()[0].devices, 0, "a re-placed away");
        let me = MemberView {
            is_self: true,
            ..member("a", Alive, 2, 2)
        };
        let members = [me, member("b", Alive, 2, 2), member("c", Alive, 2, 2)];
        let mut a = Follower::new("a", GRACE, table_id(&p2));
        match a.decide(&members, &p2, None, Instant::now()) {
            Step::Propose { nodes, why } => {
                assert!(why.contains("a serves with 1 devices"), "{why}");
                assert_eq!(nodes[0], NodeSlots::new("a", 1));
            }
            other => panic!("{other:?}"),
        }
    }

    /// A leader back from a restart proposed and loaded version 2 before its start-up wrote
    /// "serves 1" to its gossip: no one else can see the load, so it says it again (after
    /// a second, the time its membership has to write what it was told).
    #[test]
    fn a_node_whose_gossip_lags_what_it_loaded_says_it_again() {
        use MemberState::*;
        let p1 = three();
        let p2 = p1
            .revise(&[NodeSlots::new("a", 1), NodeSlots::new("b", 1)])
            .unwrap();
        let t0 = Instant::now();
        let mut a = Follower::new("a", GRACE, table_id(&p1));
        a.loaded = table_id(&p2);
        a.said_at = t0;
        let me = MemberView {
            is_self: true,
            ..member("a", Alive, 1, 1)
        };
        let members = [
            me.clone(),
            member("b", Alive, 1, 1),
            member("c", Alive, 1, 1),
        ];
        // Within the second: waiting for the others to load, as before.
        assert_eq!(a.decide(&members, &p1, Some(&p2), t0), Step::Idle);
        let later = t0 + SAY_AGAIN_AFTER;
        assert_eq!(
            a.decide(&members, &p1, Some(&p2), later),
            Step::Announce {
                serving: table_id(&p1),
                loaded: table_id(&p2)
            }
        );
        // Once its gossip says it, the others fetch and load, and it switches.
        let said = MemberView {
            is_self: true,
            ..member("a", Alive, 1, 2)
        };
        let loaded = [said, member("b", Alive, 1, 2), member("c", Alive, 1, 2)];
        assert_eq!(a.decide(&loaded, &p1, Some(&p2), later), Step::Switch);
    }

    #[test]
    fn a_serving_joiner_gets_a_share_once_the_cluster_is_settled() {
        use MemberState::*;
        let p1 = three();
        let now = Instant::now();
        let mut a = Follower::new("a", GRACE, FIRST);
        // d is still loading (serves no placement): nothing yet.
        let loading = [
            member("b", Alive, 1, 1),
            member("c", Alive, 1, 1),
            member("d", Alive, 0, 0),
        ];
        assert_eq!(a.decide(&loading, &p1, None, now), Step::Idle);
        let serving = [
            member("b", Alive, 1, 1),
            member("c", Alive, 1, 1),
            member("d", Alive, 1, 1),
        ];
        assert!(matches!(
            a.decide(&serving, &p1, None, now),
            Step::Propose { ref why, .. } if why == "d joined"
        ));
        // A change in progress elsewhere: wait for it.
        let changing = [
            member("b", Alive, 1, 2),
            member("c", Alive, 1, 1),
            member("d", Alive, 1, 1),
        ];
        assert!(matches!(
            a.decide(&changing, &p1, None, now),
            Step::Fetch { version: 2, .. }
        ));
    }

    #[test]
    fn only_the_settled_leader_may_propose_and_others_are_told_who_leads() {
        use MemberState::*;
        let settled = [member("b", Alive, 3, 3), member("c", Alive, 3, 3)];
        assert_eq!(may_propose("a", &settled, 3), Ok(()));
        match may_propose("b", &[member("a", Suspect, 3, 3)], 3) {
            Err(NotNow::NotLeader { leader, .. }) => assert_eq!(leader, "a"),
            other => panic!("{other:?}"),
        }
        // A dead or not yet serving node does not lead.
        assert_eq!(
            may_propose("b", &[member("a", Dead, 3, 3), member("0", Alive, 0, 0)], 3),
            Ok(())
        );
        // A change in progress: a member has loaded the next version already.
        let changing = [member("b", Alive, 3, 4)];
        assert!(matches!(
            may_propose("a", &changing, 3),
            Err(NotNow::Unsettled(why)) if why.contains("`b`")
        ));
    }

    #[test]
    fn load_then_switch_when_every_live_member_has_loaded_then_release() {
        use MemberState::*;
        let p1 = three();
        let nodes = |ids: &[&str]| -> Vec<NodeSlots> {
            ids.iter().map(|n| NodeSlots::new(*n, 1)).collect()
        };
        let p2 = p1.revise(&nodes(&["a", "b"])).unwrap();
        let now = Instant::now();
        let mut b = Follower::new("b", GRACE, FIRST);
        let members = [member("a", Alive, 1, 2), member("c", Dead, 1, 1)];
        assert!(matches!(
            b.decide(&members, &p1, None, now),
            Step::Fetch { version: 2, .. }
        ));
        assert_eq!(b.decide(&members, &p1, Some(&p2), now), Step::Load);
        b.loaded = table_id(&p2);
        // Switch: the dead member is not waited for.
        assert_eq!(b.decide(&members, &p1, Some(&p2), now), Step::Switch);
        // A live member that has not loaded yet is waited for.
        let slow = [member("a", Alive, 1, 2), member("c", Alive, 1, 1)];
        assert_eq!(b.decide(&slow, &p1, Some(&p2), now), Step::Idle);
        // After the switch: release once every live member serves version 2.
        let a_behind = [member("a", Alive, 1, 2)];
        assert_eq!(b.decide(&a_behind, &p2, None, now), Step::Idle);
        let a_switched = [member("a", Alive, 2, 2)];
        assert_eq!(b.decide(&a_switched, &p2, None, now), Step::Release);
        b.released = 2;
        assert_eq!(b.decide(&a_switched, &p2, None, now), Step::Idle);
    }
}
