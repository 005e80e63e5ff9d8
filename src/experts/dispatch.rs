//! The router's side of the expert seam: an [`ExpertExecutor`] that hands each step's token
//! groups to the replicas holding the experts, on this node's device actors or on other
//! nodes, and gets every group answered while any replica of its expert lives.
//!
//! A group whose target fails (device gone, link reset, an error) is re-sent to another
//! replica at once. Work sent to another node has a deadline derived from that node's
//! measured latency: a group that misses it is hedged to another replica while the first
//! send stays outstanding, and the first answer wins. (A local device answers in its
//! mailbox's order however long a big step takes; it is not hedged.) The choice of replica is the pure
//! [`assign_groups`]; this file carries it out and keeps the health it is fed. How a share
//! reaches its target is in `sends`, and the rows a dispatch reads (host memory, or GPU
//! memory for a dense part on a GPU) in `input`.

use std::collections::{HashMap, HashSet};

use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, mpsc};
use std::time::{Duration, Instant};

use super::attempts::{Answered, Attempts, NoReplica, Overdue, Policy};
use super::choice::assign_groups_among;
use super::device::DeviceHandle;
use super::health::{Penalties, Reach, ReplicaHealth, TargetHealth, hedge_after};
use super::holdings::{HELD_HERE, Holdings};
use super::target::{Answer, GroupOutputs, GroupRows, RemoteNodes, Target, TargetError};
use super::{DeviceRows, ExpertError, ExpertExecutor};
use crate::config::OnUnavailable;
use crate::moe::DispatchPlan;
use crate::placement::{ExpertLoad, Placement, Replica};
use input::GroupInput;

mod input;
mod sends;

/// Work for one of this node's CPU slots is run from the dispatching thread (the router's),
/// on the whole pool, when it holds at most this many rows: decode-sized work. A slot's
/// own thread computes alone, so handing decode work to the slots used as many cores as
/// the layer's experts had slots, plus two thread wake-ups per slot; the pool uses every
/// core. Measured with `benches/engine_step.rs` on a Qwen3-MoE of hidden 1024 (bf16, 8
/// experts of 384 a token, 2 slots): a decode step at batch 1 through the slots took 16.2-16.6
/// ms against 13.1-13.4 ms this way (the engine without actors: 13.2-14.0), at batch 8
/// 51-53 against 47-48 ms. Larger work (prefill) goes to the slots' threads.
const INLINE_MAX_ROWS: usize = 64;

#[derive(Debug, Clone, Copy)]
pub struct DispatchTiming {
    /// A send to another node is hedged after four times that node's measured latency,
    /// never sooner than this.
    pub hedge_floor: Duration,
    /// A send to another node unanswered after this long counts as failed.
    pub give_up: Duration,
    pub penalties: Penalties,
    pub on_unavailable: OnUnavailable,
    pub wait_for: Duration,
}

impl DispatchTiming {
    /// The cluster's settings (a node alone uses them too, for its own devices).
    pub fn from_config(cluster: &crate::config::ClusterConfig) -> Self {
        DispatchTiming {
            hedge_floor: Duration::from_millis(cluster.hedge_after_ms),
            give_up: Duration::from_millis(cluster.request_timeout_ms),
            on_unavailable: cluster.on_expert_unavailable,
            wait_for: Duration::from_millis(cluster.unavailable_wait_ms),
            ..DispatchTiming::default()
        }
    }
}

impl Default for DispatchTiming {
    fn default() -> Self {
        DispatchTiming {
            hedge_floor: Duration::from_millis(250),
            give_up: Duration::from_secs(10),
            penalties: Penalties {
                slow_for: Duration::from_secs(2),
                down_for: Duration::from_secs(1),
            },
            on_unavailable: OnUnavailable::Fail,
            wait_for: Duration::from_secs(10),
        }
    }
}

/// Counts of what dispatch did to keep steps going.
#[derive(Debug, Default)]
pub struct DispatchCounters {
    /// Groups re-sent after their target failed.
    pub failovers: AtomicU64,
    /// Groups hedged after their target missed its deadline.
    pub hedges: AtomicU64,
    /// Answers that came after another replica's (discarded).
    pub late_answers: AtomicU64,
    /// Token-to-expert choices routed to another expert, the chosen one having no live
    /// replica (`on_expert_unavailable = "reroute"`).
    pub rerouted: AtomicU64,
    /// Bytes of rows that were on a GPU and went through host memory (both ways) for groups
    /// computed elsewhere: a CPU slot, or another node.
    pub staged_bytes: AtomicU64,
}

pub struct Dispatcher {
    /// This node's devices by id; a restarted device replaces its handle.
    devices: RwLock<Vec<DeviceHandle>>,
    holdings: RwLock<Arc<Holdings>>,
    num_experts: usize,
    remote: Option<Arc<dyn RemoteNodes>>,
    served: RwLock<Served>,
    health: Mutex<FxHashMap<Target, TargetHealth>>,
    load: Arc<ExpertLoad>,
    hidden_size: usize,
    timing: DispatchTiming,
    pub counters: DispatchCounters,
    /// Called with each answer's target and time (per-peer latency metrics).
    latency_observer: Option<Box<dyn Fn(Target, Duration) + Send + Sync>>,
    /// Nanoseconds the last placement switch held the placement.
    last_switch_nanos: AtomicU64,
}

/// The placement served, this node's index in it, and the token each layer call routing by
/// it holds until it returns (read together, under one lock).
#[derive(Clone)]
struct Served {
    placement: Arc<Placement>,
    local_node: u16,
    readers: Arc<()>,
}

/// A placement switch done: how long it held the placement, and the token of the calls that
/// routed by the placement before it.
#[must_use = "a switch's old calls must be drained before the copies they route to are released"]
pub struct PlacementSwitch {
    pub pause: Duration,
    old_readers: Arc<()>,
}

impl PlacementSwitch {
    /// Waits until every layer call that read the old placement has returned, or `limit`;
    /// answers whether they all did. Only then may this node say it serves the new version
    /// or let go of copies the old one routed to: a call in flight would find its expert
    /// gone, with no other copy to turn to where the old placement had one.
    pub fn drain(self, limit: Duration) -> bool {
        let started = Instant::now();
        while Arc::strong_count(&self.old_readers) > 1 {
            if started.elapsed() >= limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

impl Dispatcher {
    pub fn new(
        devices: Vec<DeviceHandle>,
        placement: Arc<Placement>,
        local_node: u16,
        load: Arc<ExpertLoad>,
        hidden_size: usize,
        timing: DispatchTiming,
    ) -> Self {
        let num_experts = (0..placement.num_layers())
            .map(|layer| placement.experts_in(layer))
            .max()
            .unwrap_or(0);
        let by_device = (0..devices.len())
            .map(|d| {
                placement
                    .experts_on(local_node, d as u16)
                    .into_iter()
                    .collect()
            })
            .collect();
        let holdings = Holdings::new(by_device, placement.num_layers(), num_experts);
        Dispatcher {
            devices: RwLock::new(devices),
            holdings: RwLock::new(Arc::new(holdings)),
            num_experts,
            remote: None,
            served: RwLock::new(Served {
                placement,
                local_node,
                readers: Arc::new(()),
            }),
            health: Mutex::new(FxHashMap::default()),
            load,
            hidden_size,
            timing,
            counters: DispatchCounters::default(),
            latency_observer: None,
            last_switch_nanos: AtomicU64::new(0),
        }
    }

    /// Reaches other nodes through `remote`.
    pub fn with_remote(mut self, remote: Arc<dyn RemoteNodes>) -> Self {
        self.remote = Some(remote);
        self
    }

    pub fn observe_latency(mut self, f: impl Fn(Target, Duration) + Send + Sync + 'static) -> Self {
        self.latency_observer = Some(Box::new(f));
        self
    }

    pub fn placement(&self) -> Arc<Placement> {
        self.served().placement
    }

    fn served(&self) -> Served {
        self.served
            .read()
            .map(|s| s.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    /// Switches to a new placement: layer calls begun from now on route by it. The answer
    /// says how long the swap held the placement (the pause a layer call starting at that
    /// moment saw), and drains the calls that routed by the old one.
    pub fn set_placement(&self, placement: Arc<Placement>, local_node: u16) -> PlacementSwitch {
        let started = Instant::now();
        let old_readers = {
            let mut served = self.served.write().unwrap_or_else(|e| e.into_inner());
            std::mem::replace(
                &mut *served,
                Served {
                    placement,
                    local_node,
                    readers: Arc::new(()),
                },
            )
            .readers
        };
        let pause = started.elapsed();
        self.last_switch_nanos
            .store(pause.as_nanos() as u64, Ordering::Relaxed);
        PlacementSwitch { pause, old_readers }
    }

    /// How long the last placement switch held the placement.
    pub fn last_switch_pause(&self) -> Duration {
        Duration::from_nanos(self.last_switch_nanos.load(Ordering::Relaxed))
    }

    /// What local device `device` holds now.
    pub fn held_by(&self, device: usize) -> HashSet<(usize, u32)> {
        self.holdings()
            .by_device
            .get(device)
            .cloned()
            .unwrap_or_default()
    }

    /// Records what local device `device` holds now (after it took or released experts).
    pub fn set_held_by(&self, device: usize, held: HashSet<(usize, u32)>) {
        let mut holdings = self.holdings.write().unwrap_or_else(|e| e.into_inner());
        let mut by_device = holdings.by_device.clone();
        if let Some(slot) = by_device.get_mut(device) {
            *slot = held;
        }
        let layers = holdings.replicas.len();
        *holdings = Arc::new(Holdings::new(by_device, layers, self.num_experts));
    }

    fn holdings(&self) -> Arc<Holdings> {
        self.holdings
            .read()
            .map(|h| h.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    fn local_node(&self) -> u16 {
        self.served().local_node
    }

    fn health(&self) -> std::sync::MutexGuard<'_, FxHashMap<Target, TargetHealth>> {
        self.health.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Feeds gossip's verdict on a node into its health. A node `renewed` (restarted, a new
    /// generation) is tried at once, even where it came back before gossip suspected it:
    /// the failures of its old process keep nothing from its new one.
    pub fn set_node_reach(&self, node: u16, reach: crate::experts::Reach, renewed: bool) {
        let mut health = self.health();
        let health = health.entry(Target::Node(node)).or_default();
        if renewed {
            health.renew();
        }
        health.set_gossip(reach);
    }

    /// This node's device handles, as they are now (a restarted device has a new one).
    pub fn devices(&self) -> Vec<DeviceHandle> {
        self.devices
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Puts a restarted device in service under its id: it takes work at the next step.
    pub fn replace_device(&self, handle: DeviceHandle) {
        let id = handle.id;
        let mut devices = self.devices.write().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = devices.get_mut(id) {
            *slot = handle;
            self.health().remove(&Target::Device(id as u16));
        }
    }

    /// This node's index in the placement.
    pub fn local_node_index(&self) -> u16 {
        self.local_node()
    }

    /// Whether each local device can still take work.
    pub fn devices_alive(&self) -> Vec<bool> {
        let devices = self.devices.read().unwrap_or_else(|e| e.into_inner());
        let mut health = self.health();
        devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let h = health.entry(Target::Device(i as u16)).or_default();
                if !h.is_gone() && !d.addr.connected() {
                    h.gone();
                    tracing::warn!(
                        device = i,
                        "device gone: its experts are served by their other replicas where they have one"
                    );
                }
                !h.is_gone()
            })
            .collect()
    }

    /// Health of every target this node has sent work to, for the admin API.
    pub fn targets(&self) -> Vec<(Target, ReplicaHealth)> {
        let now = Instant::now();
        let mut all: Vec<_> = self
            .health()
            .iter()
            .map(|(t, h)| (*t, h.view(now)))
            .collect();
        all.sort_by_key(|(t, _)| *t);
        all
    }

    /// Rows sent to each target so far (every send: hedges and failovers included).
    pub fn rows_sent(&self) -> Vec<(Target, u64)> {
        let mut all: Vec<_> = self
            .health()
            .iter()
            .map(|(t, h)| (*t, h.rows_sent()))
            .collect();
        all.sort_by_key(|(t, _)| *t);
        all
    }

    /// Whether work may go to `target` now, as [`Dispatcher::run_groups`] judges it.
    fn usable(
        &self,
        target: Target,
        health: &FxHashMap<Target, TargetHealth>,
        alive_devices: &[bool],
        now: Instant,
    ) -> bool {
        let reach = health
            .get(&target)
            .map_or(crate::experts::Reach::Up, |h| h.view(now).reach);
        reach != crate::experts::Reach::Down
            && match target {
                Target::Device(d) => alive_devices.get(d as usize).copied().unwrap_or(false),
                Target::Node(_) => self.remote.is_some(),
            }
    }

    fn target_of(&self, replica: Replica, local_node: u16) -> Target {
        if replica.node == local_node {
            Target::Device(replica.device)
        } else {
            Target::Node(replica.node)
        }
    }

    /// Runs groups of rows (`experts[g]` over `group_rows[g]` rows of `input`, in order)
    /// and returns each group's outputs. With `local_only`, only this node's devices are
    /// used (work that came from another node is not sent on). Each group's outputs in a
    /// vector of its own (a reply's groups copied out of it): the executor's own paths use
    /// [`GroupRows`] instead.
    pub fn run_groups(
        &self,
        layer: usize,
        experts: &[u32],
        group_rows: &[usize],
        input: &[f32],
        local_only: bool,
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        let input = GroupInput::new(input, experts, group_rows, self.hidden_size)?;
        let outputs = self.run_input(layer, experts, &input, local_only)?;
        Ok(outputs.into_iter().map(GroupRows::into_vec).collect())
    }

    /// [`Dispatcher::run_groups`] over rows this call may share with the device actors
    /// (another node's request, as decoded): they read their groups there, uncopied. The
    /// outputs come as they were answered (see [`GroupRows`]).
    pub fn run_shared(
        &self,
        layer: usize,
        experts: &[u32],
        group_rows: &[usize],
        input: &Arc<Vec<f32>>,
        local_only: bool,
    ) -> Result<Vec<GroupRows>, ExpertError> {
        let input = GroupInput::shared(input, experts, group_rows, self.hidden_size)?;
        self.run_input(layer, experts, &input, local_only)
    }

    /// [`Dispatcher::run_groups`] over rows in GPU memory: groups for this node's GPUs stay
    /// there (peer copies between GPUs), the others go through the host, and every output
    /// ends up in `rows.output`.
    fn run_resident(
        &self,
        layer: usize,
        experts: &[u32],
        group_rows: &[usize],
        rows: &DeviceRows<'_>,
    ) -> Result<(), ExpertError> {
        let input = GroupInput::resident(
            rows,
            group_rows,
            self.hidden_size,
            &self.counters.staged_bytes,
        );
        let outputs = self.run_input(layer, experts, &input, false);
        // No device may write into the rows' memory once this returns.
        input.wait_for_devices();
        let outputs = outputs?;
        for (g, output) in outputs.iter().enumerate() {
            // Written in place where a GPU of this node ran the group; from the host else.
            if !output.is_empty() {
                rows.staging
                    .upload(input.starts[g], output)
                    .map_err(ExpertError::Staging)?;
                self.counters
                    .staged_bytes
                    .fetch_add((output.len() * 2) as u64, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn run_input(
        &self,
        layer: usize,
        experts: &[u32],
        input: &GroupInput<'_>,
        local_only: bool,
    ) -> Result<Vec<GroupRows>, ExpertError> {
        let group_rows = input.rows;
        if experts.len() != group_rows.len() {
            return Err(ExpertError::Malformed {
                groups: experts.len(),
                rows: group_rows.iter().sum(),
                values: 0,
            });
        }
        self.load.tick();
        let span = crate::telemetry::child_of_current(|| {
            tracing::info_span!(
                "dispatch",
                layer,
                groups = experts.len(),
                rows = group_rows.iter().sum::<usize>()
            )
        });
        let _in_span = span.enter();
        // One snapshot for the whole call; its token tells a switch when the call is done.
        let served = self.served();
        let policy = Policy {
            // Work from another node is never held: its sender has other replicas.
            may_wait: !local_only && self.timing.on_unavailable == OnUnavailable::Wait,
            wait_for: self.timing.wait_for,
            give_up: self.timing.give_up,
        };
        let mut attempts = Attempts::new(experts, group_rows, policy);
        let result = self.drive(&served, layer, experts, input, local_only, &mut attempts);
        // Sends still unanswered (a hedged send whose other replica answered first, sends
        // in flight when the step failed) will be answered to nobody: their rows no longer
        // count as the target's load, or every hedge would leave rows on a slow or paused
        // node for good and it would lose the load comparison from then on.
        let mut health = self.health();
        for (target, rows) in attempts.unanswered() {
            health.entry(target).or_default().answered(rows, None);
        }
        result
    }

    /// Carries out `attempts` until every group is answered: chooses a target for each
    /// pending group, makes the sends, and feeds the answers and the time back.
    fn drive(
        &self,
        served: &Served,
        layer: usize,
        experts: &[u32],
        group_input: &GroupInput<'_>,
        local_only: bool,
        attempts: &mut Attempts<GroupRows>,
    ) -> Result<Vec<GroupRows>, ExpertError> {
        let group_rows = group_input.rows;
        let placement = &served.placement;
        let holdings = self.holdings();
        // Work from another node runs on whichever local device holds its expert now.
        let local_node = if local_only {
            HELD_HERE
        } else {
            served.local_node
        };
        let replicas_of = |expert: u32| {
            if local_only {
                holdings.replicas(layer, expert)
            } else {
                placement.replicas(layer, expert)
            }
        };
        let (done_tx, done_rx) = mpsc::channel::<(usize, GroupOutputs)>();
        // Small work for this node's CPU slots, run on this thread once the rest is sent.
        let mut inline: Vec<(u16, Vec<usize>, Answer)> = Vec::new();

        while !attempts.is_done() {
            if !attempts.pending().is_empty() {
                let now = Instant::now();
                let choices = self.choose(
                    attempts,
                    experts,
                    group_rows,
                    replicas_of,
                    local_node,
                    local_only,
                    now,
                );
                let sends = attempts
                    .place(&choices, now)
                    .map_err(|NoReplica(experts)| ExpertError::NoLiveReplica { layer, experts })?;
                for (target, groups) in sends {
                    let cold = match (target, &self.remote) {
                        (Target::Node(n), Some(remote)) => !remote.link_up(n),
                        _ => false,
                    };
                    let id = attempts.started(target, groups.clone(), cold, now);
                    let rows = attempts.send(id).rows;
                    let tx = done_tx.clone();
                    let answer = Answer::new(move |out| {
                        // The receiver is gone only once the step no longer needs this.
                        let _ = tx.send((id, out));
                    });
                    self.health().entry(target).or_default().sent(rows);
                    // Rows on a GPU go to this node's GPUs at once: their copies and
                    // products run on the devices' streams while this thread stages the
                    // groups for CPU slots and other nodes through the host.
                    let resident_gpu = |d: u16| {
                        group_input.resident.is_some()
                            && self.device(d).is_some_and(|h| h.gpu.is_some())
                    };
                    let sent = match target {
                        Target::Device(d) if rows <= INLINE_MAX_ROWS && !resident_gpu(d) => {
                            // Run after every other send is out, so they overlap it.
                            inline.push((d, groups, answer));
                            Ok(())
                        }
                        Target::Device(d) => {
                            self.send_local(d, layer, &groups, experts, group_input, answer)
                        }
                        Target::Node(n) => self.send_remote(
                            n,
                            layer,
                            placement.version(),
                            &groups,
                            experts,
                            group_input,
                            answer,
                        ),
                    };
                    // A refused send answers through `answer`'s drop, or right here.
                    if let Err(e) = sent {
                        let _ = done_tx.send((id, Err(e)));
                    }
                }
                self.run_inline(layer, &mut inline, experts, group_input);
                if !attempts.pending().is_empty() {
                    // Nothing to send to yet: look again shortly.
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            }

            let wait = attempts.next_wait(Instant::now(), |t| self.hedge_deadline(t));
            let event = done_rx.recv_timeout(wait);
            let now = Instant::now();
            match event {
                Ok((id, result)) => {
                    let answered = attempts.answered(id, result, now);
                    self.take_answer(layer, experts, group_rows, local_only, answered, now);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    for overdue in attempts.tick(now, |t| self.hedge_deadline(t)) {
                        self.take_overdue(layer, overdue, now);
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(ExpertError::AnswersLost);
                }
            }
        }
        Ok(attempts.take_outputs())
    }

    /// A target for each of `attempts`' pending groups (see [`assign_groups_among`]):
    /// devices that are gone, and other nodes when this work may not leave the node, are
    /// down; targets that failed a group are not chosen for it again.
    #[allow(clippy::too_many_arguments)]
    fn choose<'a>(
        &self,
        attempts: &Attempts<GroupRows>,
        experts: &[u32],
        group_rows: &[usize],
        replicas_of: impl Fn(u32) -> &'a [Replica],
        local_node: u16,
        local_only: bool,
        now: Instant,
    ) -> Vec<Option<Target>> {
        let pending = attempts.pending();
        let alive_devices = self.devices_alive();
        let health = self.health();
        assign_groups_among(
            replicas_of,
            &pending.iter().map(|&g| experts[g]).collect::<Vec<_>>(),
            |i| group_rows[pending[i]],
            |r| {
                let target = self.target_of(r, local_node);
                let mut view = health
                    .get(&target)
                    .map(|h| h.view(now))
                    .unwrap_or_else(|| TargetHealth::default().view(now));
                let unusable = match target {
                    Target::Device(d) => !alive_devices.get(d as usize).copied().unwrap_or(false),
                    Target::Node(_) => local_only || self.remote.is_none(),
                };
                if unusable {
                    view.reach = Reach::Down;
                }
                view.local = matches!(target, Target::Device(_));
                view
            },
            |i, r| attempts.excluded(pending[i], self.target_of(r, local_node)),
        )
        .into_iter()
        .map(|chosen| chosen.map(|r| self.target_of(r, local_node)))
        .collect()
    }

    /// Applies what an answer changed: the target's health and latency, the load, the
    /// counters.
    fn take_answer(
        &self,
        layer: usize,
        experts: &[u32],
        group_rows: &[usize],
        local_only: bool,
        answered: Answered,
        now: Instant,
    ) {
        match answered {
            Answered::Stale => {}
            Answered::Delivered {
                target,
                rows,
                took,
                sample,
                new_groups,
                late,
            } => {
                self.health()
                    .entry(target)
                    .or_default()
                    .answered(rows, sample);
                if let Some(observe) = &self.latency_observer {
                    observe(target, took);
                }
                self.counters
                    .late_answers
                    .fetch_add(late as u64, Ordering::Relaxed);
                for g in new_groups {
                    match target {
                        Target::Device(d) if local_only => {
                            self.load.record_run(layer, d as usize, group_rows[g])
                        }
                        Target::Device(d) => {
                            self.load
                                .record(layer, experts[g], d as usize, group_rows[g])
                        }
                        Target::Node(_) => {
                            self.load
                                .record_activation(layer, experts[g], group_rows[g])
                        }
                    }
                }
            }
            Answered::Failed {
                target,
                rows,
                error,
                failovers,
            } => {
                self.target_failed(target, &error, rows, failovers, now);
            }
        }
    }

    /// Applies what a missed deadline changed.
    fn take_overdue(&self, layer: usize, overdue: Overdue, now: Instant) {
        match overdue {
            Overdue::GaveUp {
                target,
                rows,
                error,
                failovers,
            } => {
                self.target_failed(target, &error, rows, failovers, now);
            }
            Overdue::Hedged {
                target,
                waited,
                hedges,
            } => {
                self.health()
                    .entry(target)
                    .or_default()
                    .missed_deadline(now, self.timing.penalties);
                tracing::debug!(
                    ?target,
                    layer,
                    waited_ms = waited.as_millis() as u64,
                    "hedging a late send"
                );
                self.counters
                    .hedges
                    .fetch_add(hedges as u64, Ordering::Relaxed);
            }
        }
    }

    fn hedge_deadline(&self, target: Target) -> Duration {
        let latency = self
            .health()
            .get(&target)
            .map(TargetHealth::latency)
            .unwrap_or_default();
        hedge_after(latency, self.timing.hedge_floor)
    }

    /// `target` failed a send of `rows` rows (an error, or no answer in time): its health
    /// says so, and the `failovers` groups placed again are counted.
    fn target_failed(
        &self,
        target: Target,
        error: &TargetError,
        rows: usize,
        failovers: usize,
        now: Instant,
    ) {
        self.counters
            .failovers
            .fetch_add(failovers as u64, Ordering::Relaxed);
        let mut health = self.health();
        let h = health.entry(target).or_default();
        h.answered(rows, None);
        match (target, error) {
            (Target::Device(d), TargetError::Gone(_)) => {
                if !h.is_gone() {
                    tracing::warn!(
                        device = d,
                        "device gone: its experts are served by their other replicas where they have one"
                    );
                }
                h.gone();
            }
            (_, TargetError::Overloaded) => h.missed_deadline(now, self.timing.penalties),
            _ => {
                tracing::warn!(?target, error = %error, "expert work failed: re-sent to other replicas");
                h.failed(now, self.timing.penalties);
            }
        }
    }

    /// Local device `device`'s handle as it is now.
    fn device(&self, device: u16) -> Option<DeviceHandle> {
        self.devices
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(device as usize)
            .cloned()
    }
}

impl ExpertExecutor for Dispatcher {
    fn avoid(&self, layer: usize) -> Option<Vec<bool>> {
        if self.timing.on_unavailable != OnUnavailable::Reroute {
            return None;
        }
        let Served {
            placement,
            local_node,
            ..
        } = self.served();
        let alive_devices = self.devices_alive();
        let now = Instant::now();
        let health = self.health();
        let mut usable: HashMap<Target, bool> = HashMap::new();
        let avoid = (0..placement.experts_in(layer) as u32)
            .map(|expert| {
                !placement.replicas(layer, expert).iter().any(|&r| {
                    let target = self.target_of(r, local_node);
                    *usable
                        .entry(target)
                        .or_insert_with(|| self.usable(target, &health, &alive_devices, now))
                })
            })
            .collect();
        Some(avoid)
    }

    fn rerouted(&self, layer: usize, choices: usize) {
        self.counters
            .rerouted
            .fetch_add(choices as u64, Ordering::Relaxed);
        tracing::debug!(
            layer,
            choices,
            "tokens rerouted around experts with no live replica"
        );
    }

    fn run(
        &self,
        layer: usize,
        plan: &DispatchPlan,
        grouped_input: &[f32],
    ) -> Result<Vec<f32>, ExpertError> {
        let group_rows: Vec<usize> = (0..plan.experts.len())
            .map(|g| plan.group(g).len())
            .collect();
        let input = GroupInput::new(grouped_input, &plan.experts, &group_rows, self.hidden_size)?;
        let outputs = self.run_input(layer, &plan.experts, &input, false)?;
        // Each group's rows copied once, into place: a reply from another node is read
        // where it was decoded.
        let mut all = Vec::with_capacity(grouped_input.len());
        for output in &outputs {
            all.extend_from_slice(output);
        }
        Ok(all)
    }

    fn run_on_device(
        &self,
        layer: usize,
        experts: &[u32],
        group_rows: &[usize],
        rows: &DeviceRows<'_>,
    ) -> Option<Result<(), ExpertError>> {
        Some(self.run_resident(layer, experts, group_rows, rows))
    }
}
