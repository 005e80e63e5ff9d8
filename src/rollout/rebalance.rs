//! Live rebalancing: toward a balanced placement for the recent activation window, by
//! copies of hot experts in the devices' spare slots (`placement.redundant_slots_per_device`)
//! and by moving experts, in placement versions that each load at most
//! `placement.max_move_mib` ([`Placement::migrate`]).
//!
//! Copy, then switch, then release, for each version in turn, while the node serves:
//! 1. each device loads the copies the version adds (read from the checkpoint off the device
//!    threads; the device keeps computing and takes them in one message);
//! 2. the dispatcher switches to the version at its next layer call (a call reads one
//!    placement);
//! 3. once every call that may have routed by the previous version has finished, the copies
//!    the version no longer holds are released.
//!
//! No step waits on weights: the only pause is the dispatcher swapping one pointer. Every
//! version is a valid placement (every expert keeps its copies), so nothing fails between
//! two of them.
//!
//! Across a cluster the placement is the cluster's, and so is the change: the leader (the
//! lowest serving id, the node that proposes every placement change, so that two nodes never
//! publish two placements under one version) adds up the recent windows of every live
//! member (each counts the tokens its own router routed), computes the versions and offers
//! them on its placement board one at a time. Each travels like any change
//! (`rollout/follow.rs`): every node fetches it, loads its new copies from its own
//! checkpoint, switches at a step boundary once every live member has loaded, and releases
//! what it no longer holds once every live member serves it; the leader offers the next
//! once every member has. A node that is not the leader refuses and names the leader.
//!
//! The node provides what a rebalance drives ([`RebalanceParts`]: its dispatcher, which keeps
//! the devices and what each holds, its load window, checkpoint and placement board) and
//! holds the [`Rebalancer`]; `POST /admin/rebalance` and [`rebalance_periodically`] call it.

use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Metric;
use serde::Serialize;

use crate::cluster::{MemberState, MemberView, Membership};
use crate::config::live::LiveSettings;
use crate::experts::Dispatcher;
use crate::experts::device::{ReleaseExperts, TakeExperts, load_experts};
use crate::model::{Checkpoint, ExpertWeights, ModelConfig, ModelError};
use crate::placement::migrate::copies_per_version;
use crate::placement::profile::fingerprint_hex;
use crate::placement::replicate::imbalance;
use crate::placement::{ExpertLoad, Migration, Placement, PlacementError, Profile};
use crate::rollout::board::PlacementBoard;
use crate::rollout::bootstrap::fetch_profile;
use crate::rollout::drain;
use crate::rollout::follow::{NotNow, may_propose};

/// Why a rebalance did not happen.
#[derive(Debug, thiserror::Error)]
pub enum RebalanceError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// Refused or failed as a rebalance (no spare slots, a device stopped, the cluster not
    /// settled, not every member switched in time).
    #[error("rebalance: {0}")]
    Refused(String),
    /// Another node proposes the cluster's placement changes.
    #[error("rebalance: {0}")]
    NotLeader(String),
    /// The profile given does not fit the model served.
    #[error("rebalance: {0}")]
    BadProfile(String),
}

/// The parts of a node that a rebalance drives: its devices and what each holds (both kept
/// by the dispatcher, which also switches placements), its recent load, the checkpoint new
/// copies are read from, and its placement board. The node provides them
/// (`crate::node`), the rebalance never reaches the node itself.
pub struct RebalanceParts {
    /// The model as served.
    pub model: Arc<ModelConfig>,
    /// What new copies are read from.
    pub checkpoint: Arc<Checkpoint>,
    /// The node's devices, what each holds, and the placement it routes by.
    pub dispatcher: Arc<Dispatcher>,
    /// The recent activation window this node's router counted.
    pub load: Arc<ExpertLoad>,
    /// The placement served and the next one, as other nodes fetch them; a rebalance in a
    /// cluster offers its placement here.
    pub board: Arc<PlacementBoard>,
    /// This node's API keys as they are now (a reload changes them): other nodes' APIs take
    /// them (reading their load).
    pub live: Arc<LiveSettings>,
    /// Spare expert slots per device and layer (`placement.redundant_slots_per_device`).
    pub spare_slots: usize,
    /// Bytes of one expert's weights, as the model's sizes give them.
    pub expert_bytes: u64,
    /// Expert weights one placement version of a rebalance loads at most, over all nodes
    /// (`placement.max_move_mib`; 0: no bound).
    pub max_move_bytes: u64,
    /// This node's part in a cluster; `None` when it serves alone.
    pub cluster: Option<ClusterPart>,
}

/// What a rebalance across a cluster reads of it.
pub struct ClusterPart {
    /// This node's id in the cluster.
    pub node_id: String,
    pub membership: Membership,
}

/// Where the rebalance series are registered (the node's Prometheus registry).
pub trait SeriesRegistry {
    /// Adds one series another part of the node updates.
    fn add_series(&self, name: &str, help: &str, metric: impl Metric);
}

/// What one rebalance did.
#[derive(Debug, Clone, Serialize)]
pub struct RebalanceReport {
    /// The placement version served now.
    pub version: u64,
    /// Placement versions the rebalance went through (0: the placement served was
    /// balanced enough; see [`crate::placement::migrate::GOOD_ENOUGH`]).
    pub versions: usize,
    pub copies_loaded: usize,
    pub copies_released: usize,
    pub bytes_loaded: u64,
    /// Worst layer's imbalance over the recent window, under the placement before: as the
    /// devices measured it on a node serving alone; across a cluster, the merged window
    /// laid over the old placement's devices (every node's) like `imbalance_after`.
    pub imbalance_before: f64,
    /// The same window's load laid over the new placement (each expert's load split over
    /// its copies): what the devices will see if the workload stays as it was.
    pub imbalance_after: f64,
    pub seconds: f64,
    /// How long the switch held the placement on this node: the only pause a step sees.
    pub switch_pause_seconds: f64,
    /// Nodes whose recent window went into the loads (1 on a node serving alone; 0 when a
    /// profile was given).
    pub nodes_profiled: usize,
}

/// Series a rebalance updates.
#[derive(Debug, Clone)]
pub struct RebalanceMetrics {
    rebalances: Counter,
    bytes_loaded: Counter,
    duration: Histogram,
    imbalance_before: Gauge<f64, AtomicU64>,
    imbalance_after: Gauge<f64, AtomicU64>,
}

impl RebalanceMetrics {
    pub fn register(metrics: &impl SeriesRegistry) -> Self {
        let m = RebalanceMetrics {
            rebalances: Counter::default(),
            bytes_loaded: Counter::default(),
            // 1 ms .. ~65 s.
            duration: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            imbalance_before: Gauge::default(),
            imbalance_after: Gauge::default(),
        };
        metrics.add_series(
            "rebalances",
            "Live rebalances done (placement versions computed from the recent window and switched to)",
            m.rebalances.clone(),
        );
        metrics.add_series(
            "rebalance_loaded_bytes",
            "Bytes of expert weights loaded by rebalances (copies of hot experts, experts moved)",
            m.bytes_loaded.clone(),
        );
        metrics.add_series(
            "rebalance_duration_seconds",
            "From the start of a rebalance to the release of the last version's dropped copies",
            m.duration.clone(),
        );
        metrics.add_series(
            "rebalance_imbalance_before",
            "Worst layer's recent imbalance under the placement before the last rebalance",
            m.imbalance_before.clone(),
        );
        metrics.add_series(
            "rebalance_imbalance_after",
            "The same load laid over the placement the last rebalance switched to",
            m.imbalance_after.clone(),
        );
        m
    }
}

/// How long a rebalance across a cluster waits for every live member to serve the new
/// placement before it answers that the change goes on without it.
const CLUSTER_SWITCH_LIMIT: Duration = Duration::from_secs(120);

/// A node's live rebalancing: one at a time, over the parts the node provides.
pub struct Rebalancer {
    parts: RebalanceParts,
    /// Held while rebalancing: one at a time.
    one_at_a_time: Mutex<()>,
    metrics: RebalanceMetrics,
}

impl Rebalancer {
    pub fn new(parts: RebalanceParts, metrics: RebalanceMetrics) -> Self {
        Rebalancer {
            parts,
            one_at_a_time: Mutex::new(()),
            metrics,
        }
    }

    /// Spare expert slots per device and layer: with none, a rebalance has nowhere to put a
    /// copy.
    pub fn spare_slots(&self) -> usize {
        self.parts.spare_slots
    }

    /// Rebalances for the recent window through placement versions (see the module doc).
    /// One at a time; blocks while loading. In a cluster only the leader rebalances
    /// ([`RebalanceError::NotLeader`] elsewhere), through the cluster's placement versions,
    /// and blocks until every live member serves the last one.
    pub fn rebalance(&self, profile: Option<&Profile>) -> Result<RebalanceReport, RebalanceError> {
        let _one_at_a_time = self.one_at_a_time.lock().unwrap_or_else(|e| e.into_inner());
        if self.parts.spare_slots == 0 {
            return Err(RebalanceError::Refused(
                "no spare slots: set placement.redundant_slots_per_device".into(),
            ));
        }
        let given = profile.map(|p| self.profile_loads(p)).transpose()?;
        if let Some(cluster) = &self.parts.cluster {
            return self.rebalance_cluster(cluster, given);
        }
        let started = Instant::now();
        let current = self.parts.dispatcher.placement();
        let model = &self.parts.model;
        let (loads, before) = match given {
            Some(loads) => {
                let before = predicted_imbalance(&current, &loads);
                (loads, before)
            }
            None => {
                let mut loads = vec![None; model.num_layers];
                let mut before = 0.0f64;
                for layer in (0..model.num_layers).filter(|&l| model.moe_layers[l]) {
                    let (recent, _) = self.parts.load.recent(layer);
                    before = before.max(recent.imbalance());
                    loads[layer] = Some(recent.activations.iter().map(|&a| a as f64).collect());
                }
                (loads, before)
            }
        };
        let migration = self.migration(&current, &loads)?;
        let after = predicted_imbalance(migration.target().unwrap_or(&current), &loads);
        let mut switched = Switched::default();
        let versions = migration.versions.len();
        for next in migration.versions {
            let done = self.switch_to(next)?;
            switched.copies_loaded += done.copies_loaded;
            switched.copies_released += done.copies_released;
            switched.bytes_loaded += done.bytes_loaded;
            switched.pause = switched.pause.max(done.pause);
        }
        Ok(self.rebalanced(RebalanceReport {
            version: self.parts.dispatcher.placement().version(),
            versions,
            copies_loaded: switched.copies_loaded,
            copies_released: switched.copies_released,
            bytes_loaded: switched.bytes_loaded,
            imbalance_before: before,
            imbalance_after: after,
            seconds: started.elapsed().as_secs_f64(),
            switch_pause_seconds: switched.pause.as_secs_f64(),
            nodes_profiled: 1,
        }))
    }

    /// A profile's loads per layer, checked against the model served (its layers, experts
    /// and, where the profile names one, its fingerprint).
    fn profile_loads(&self, profile: &Profile) -> Result<Vec<Option<Vec<f64>>>, RebalanceError> {
        let model = &self.parts.model;
        let ours = fingerprint_hex(self.parts.checkpoint.fingerprint());
        if let Some(theirs) = profile.fingerprint.as_deref()
            && theirs != ours
        {
            return Err(RebalanceError::BadProfile(format!(
                "the profile was measured on another model (fingerprint {theirs}, this node \
                 serves {ours})"
            )));
        }
        profile
            .loads_for(&model.moe_layers, model.moe.num_experts)
            .map_err(|e| RebalanceError::BadProfile(e.to_string()))
    }

    /// The versions from `current` to a placement balanced for `loads`, each loading at
    /// most `placement.max_move_mib` of expert weights.
    fn migration(
        &self,
        current: &Placement,
        loads: &[Option<Vec<f64>>],
    ) -> Result<Migration, RebalanceError> {
        let spare = vec![self.parts.spare_slots; current.devices().len()];
        Ok(current.migrate(
            loads,
            &spare,
            copies_per_version(self.parts.max_move_bytes, self.parts.expert_bytes),
        )?)
    }

    /// One version on a node serving alone: copy what it adds, switch, wait for the calls
    /// that routed by the old placement, release what it drops.
    fn switch_to(&self, next: Placement) -> Result<Switched, RebalanceError> {
        let model = &self.parts.model;
        // Copy.
        let mut copies_loaded = 0;
        let mut bytes_loaded = 0u64;
        for device in self.parts.dispatcher.devices() {
            let mut held = self.parts.dispatcher.held_by(device.id);
            let missing: Vec<(usize, u32)> = next
                .experts_on(0, device.id as u16)
                .into_iter()
                .filter(|e| !held.contains(e))
                .collect();
            if missing.is_empty() {
                continue;
            }
            let weights = load_experts(&self.parts.checkpoint, model, &missing)?;
            let bytes: usize = weights.values().map(ExpertWeights::weight_bytes).sum();
            futures::executor::block_on(device.addr.send(TakeExperts(weights)))
                .map_err(|_| {
                    RebalanceError::Refused(format!("device {} stopped while loading", device.id))
                })?
                .map_err(|e| RebalanceError::Refused(e.to_string()))?;
            held.extend(missing.iter().copied());
            self.parts.dispatcher.set_held_by(device.id, held);
            copies_loaded += missing.len();
            bytes_loaded += bytes as u64;
        }

        // Switch.
        let next = Arc::new(next);
        self.parts.board.set_current(next.clone());
        let switch = self.parts.dispatcher.set_placement(next.clone(), 0);
        let pause = switch.pause;
        drain(switch, next.version());

        // Release.
        let mut copies_released = 0;
        for device in self.parts.dispatcher.devices() {
            let keep: HashSet<(usize, u32)> =
                next.experts_on(0, device.id as u16).into_iter().collect();
            let held = self.parts.dispatcher.held_by(device.id);
            if held.is_subset(&keep) {
                continue;
            }
            copies_released += held.difference(&keep).count();
            self.parts
                .dispatcher
                .set_held_by(device.id, held.intersection(&keep).copied().collect());
            let _ = futures::executor::block_on(device.addr.send(ReleaseExperts(keep)));
        }
        Ok(Switched {
            copies_loaded,
            copies_released,
            bytes_loaded,
            pause,
        })
    }

    /// Counts a rebalance done and logs it.
    fn rebalanced(&self, report: RebalanceReport) -> RebalanceReport {
        let m = &self.metrics;
        m.rebalances.inc();
        m.bytes_loaded.inc_by(report.bytes_loaded);
        m.duration.observe(report.seconds);
        m.imbalance_before.set(report.imbalance_before);
        m.imbalance_after.set(report.imbalance_after);
        tracing::info!(
            version = report.version,
            copies_loaded = report.copies_loaded,
            copies_released = report.copies_released,
            bytes_loaded = report.bytes_loaded,
            imbalance_before = report.imbalance_before,
            imbalance_after = report.imbalance_after,
            seconds = report.seconds,
            switch_pause_us = (report.switch_pause_seconds * 1e6) as u64,
            nodes_profiled = report.nodes_profiled,
            "rebalanced: placement versions switched to"
        );
        report
    }

    /// The leader's rebalance of the cluster's placement (see the module doc). Blocks until
    /// every live member serves the new version, or [`CLUSTER_SWITCH_LIMIT`].
    fn rebalance_cluster(
        &self,
        cluster: &ClusterPart,
        given: Option<Vec<Option<Vec<f64>>>>,
    ) -> Result<RebalanceReport, RebalanceError> {
        let started = Instant::now();
        let current = self.parts.dispatcher.placement();
        let members = cluster.membership.members();
        may_propose(&cluster.node_id, &members, current.version()).map_err(|e| match e {
            NotNow::NotLeader { .. } => RebalanceError::NotLeader(e.to_string()),
            NotNow::Unsettled(_) => RebalanceError::Refused(e.to_string()),
        })?;
        let (loads, nodes_profiled) = match given {
            Some(loads) => (loads, 0),
            None => self.cluster_loads(cluster, &members),
        };
        let migration = self.migration(&current, &loads)?;
        let before = predicted_imbalance(&current, &loads);
        let after = predicted_imbalance(migration.target().unwrap_or(&current), &loads);
        let versions = migration.versions.len();
        let (copies_loaded, copies_released) =
            (migration.copies_loaded(), migration.copies_released());
        for (next, moves) in migration.versions.into_iter().zip(&migration.moves) {
            let version = next.version();
            if version > current.version() + 1 {
                // The previous version is served everywhere; the next waits until every
                // member has released what it dropped and says so.
                self.wait_for(cluster, version - 1, started, |members| {
                    may_propose(&cluster.node_id, members, version - 1).is_ok()
                })?;
            }
            self.parts
                .board
                .offer_next(Arc::new(next))
                .map_err(RebalanceError::Refused)?;
            tracing::info!(
                version,
                of = versions,
                copies_loaded = moves.copies_loaded,
                copies_released = moves.copies_released,
                nodes_profiled,
                "proposing the next placement of a rebalance to the cluster (this node leads: \
                 lowest serving id)"
            );
            // The follower thread carries it out here as on every node: wait for the switch.
            self.wait_for(cluster, version, started, |members| {
                members.iter().all(|m| {
                    m.is_self
                        || m.state != MemberState::Alive
                        || m.meta.placement_version == 0
                        || m.meta.placement_version >= version
                })
            })?;
        }
        let bytes_loaded = copies_loaded as u64 * self.parts.expert_bytes;
        Ok(self.rebalanced(RebalanceReport {
            version: self.parts.dispatcher.placement().version(),
            versions,
            copies_loaded,
            copies_released,
            bytes_loaded,
            imbalance_before: before,
            imbalance_after: after,
            seconds: started.elapsed().as_secs_f64(),
            switch_pause_seconds: self.parts.dispatcher.last_switch_pause().as_secs_f64(),
            nodes_profiled,
        }))
    }

    /// Waits until this node serves `version` and `done` holds for the cluster's members,
    /// for at most [`CLUSTER_SWITCH_LIMIT`] after `started`'s version was proposed.
    fn wait_for(
        &self,
        cluster: &ClusterPart,
        version: u64,
        started: Instant,
        done: impl Fn(&[MemberView]) -> bool,
    ) -> Result<(), RebalanceError> {
        let waiting = Instant::now();
        while self.parts.dispatcher.placement().version() < version
            || !done(&cluster.membership.members())
        {
            if waiting.elapsed() > CLUSTER_SWITCH_LIMIT {
                return Err(RebalanceError::Refused(format!(
                    "placement version {version} was proposed, but not every live member \
                     serves it after {} s ({:.0} s into the rebalance); the change goes on \
                     as members load it (see GET /admin/cluster)",
                    CLUSTER_SWITCH_LIMIT.as_secs(),
                    started.elapsed().as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// This node's recent window plus every other live serving member's (each counts the
    /// tokens its own router routed, so the sum counts each token once). A member that does
    /// not answer is left out, with a warning: the copies follow the others' load.
    fn cluster_loads(
        &self,
        cluster: &ClusterPart,
        members: &[MemberView],
    ) -> (Vec<Option<Vec<f64>>>, usize) {
        let model = &self.parts.model;
        let mut loads: Vec<Option<Vec<f64>>> = vec![None; model.num_layers];
        for layer in (0..model.num_layers).filter(|&l| model.moe_layers[l]) {
            let (recent, _) = self.parts.load.recent(layer);
            loads[layer] = Some(recent.activations.iter().map(|&a| a as f64).collect());
        }
        let mut profiled = 1;
        let fingerprint = fingerprint_hex(self.parts.checkpoint.fingerprint());
        let mut asked: Vec<&str> = Vec::new();
        for m in members.iter().filter(|m| {
            !m.is_self
                && m.state == MemberState::Alive
                && m.meta.placement_version > 0
                && m.meta.node != cluster.node_id
        }) {
            if asked.contains(&m.meta.node.as_str()) {
                continue;
            }
            asked.push(&m.meta.node);
            let theirs =
                fetch_profile(m.meta.api, &self.parts.live.local_api_keys()).and_then(|p| {
                    if p.fingerprint.as_deref().is_some_and(|f| f != fingerprint) {
                        return Err(format!("measured on another model ({:?})", p.fingerprint));
                    }
                    p.loads_for(&model.moe_layers, model.moe.num_experts)
                        .map_err(|e| e.to_string())
                });
            match theirs {
                Ok(theirs) => {
                    for (mine, theirs) in loads.iter_mut().zip(theirs) {
                        if let (Some(mine), Some(theirs)) = (mine.as_mut(), theirs) {
                            for (a, b) in mine.iter_mut().zip(theirs) {
                                *a += b;
                            }
                        }
                    }
                    profiled += 1;
                }
                Err(e) => tracing::warn!(
                    node = %m.meta.node,
                    error = %e,
                    "cannot read a member's recent load: rebalancing without it"
                ),
            }
        }
        (loads, profiled)
    }
}

/// With `placement.rebalance_interval_seconds`, rebalances for the recent window that
/// often, on the calling thread (the loader's: it has nothing else to do once the model is
/// served). The interval is read from `live` as it is now (a reload may change it; 0
/// pauses). `served` gives the node's rebalancer while the model is served; the loop ends
/// when it gives none, and at once when the node has no spare slots.
pub fn rebalance_periodically<'a>(
    live: &LiveSettings,
    served: impl Fn() -> Option<&'a Rebalancer>,
) {
    if served().is_none_or(|rebalancer| rebalancer.spare_slots() == 0) {
        return;
    }
    let mut last = Instant::now();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let interval = live.rebalance_interval_seconds();
        if interval == 0 || last.elapsed() < Duration::from_secs(interval) {
            continue;
        }
        let Some(rebalancer) = served() else {
            return;
        };
        match rebalancer.rebalance(None) {
            Ok(_) => {}
            // In a cluster only the leader rebalances; the others follow its placement.
            Err(e @ RebalanceError::NotLeader(_)) => {
                tracing::debug!(error = %e, "periodic rebalance left to the leader")
            }
            Err(e) => tracing::warn!(
                error = %e,
                "periodic rebalance failed; the placement stays as it was"
            ),
        }
        last = Instant::now();
    }
}

/// What switching to one version did on a node serving alone.
#[derive(Default)]
struct Switched {
    copies_loaded: usize,
    copies_released: usize,
    bytes_loaded: u64,
    pause: Duration,
}

/// Worst layer's imbalance with `loads` split over `placement`'s copies, over the devices
/// of every node it places experts on.
fn predicted_imbalance(placement: &Placement, loads: &[Option<Vec<f64>>]) -> f64 {
    let mut worst = 0.0f64;
    for (layer, layer_loads) in loads.iter().enumerate() {
        let Some(layer_loads) = layer_loads else {
            continue;
        };
        let per_device = placement.device_loads(layer, layer_loads);
        worst = worst.max(imbalance(&per_device));
    }
    worst
}
