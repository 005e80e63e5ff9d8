//! A deterministic simulation of a membership cluster: foca instances with the real
//! identity type, codec and [`foca_config`], a virtual clock, and in-memory links that drop
//! and delay packets from a seeded RNG. Same seed, same run. Packets are not encrypted
//! (sealing does not change what foca decides).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use foca::{AccumulatingRuntime, Foca, NoCustomBroadcast, OwnedNotification, PostcardCodec, Timer};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::identity::{FocaRng, MemberMeta, NodeIdentity};
use super::membership::{DEFAULT_PROBE_PERIOD, DEFAULT_SUSPICION_TIMEOUT, foca_config};
use super::table::MemberState;

/// The shape of a simulated cluster.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Number of members.
    pub members: usize,
    /// Probability that any one packet is lost.
    pub loss: f64,
    /// Seed of every random choice (links and foca's own).
    pub seed: u64,
    /// Foca probe period.
    pub probe_period: Duration,
    /// Foca suspicion timeout.
    pub suspicion_timeout: Duration,
    /// One-way delay, drawn uniformly in this range per packet.
    pub latency: (Duration, Duration),
}

impl SimConfig {
    /// `members` members, 1% loss, LAN latency (0.1-2 ms) and the default periods.
    pub fn new(members: usize, seed: u64) -> SimConfig {
        SimConfig {
            members,
            loss: 0.01,
            seed,
            probe_period: DEFAULT_PROBE_PERIOD,
            suspicion_timeout: DEFAULT_SUSPICION_TIMEOUT,
            latency: (Duration::from_micros(100), Duration::from_millis(2)),
        }
    }
}

/// `observer` saw `target` declared down at virtual time `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DownReport {
    /// Virtual time since the start.
    pub at: Duration,
    /// The member that noticed.
    pub observer: usize,
    /// The member declared down.
    pub target: usize,
}

/// How the live members learned that one member is down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Detection {
    /// Time from the crash to the first live member marking it down.
    pub first: Option<Duration>,
    /// Time from the crash to the last live member marking it down (None: some never did).
    pub last: Option<Duration>,
    /// Live members that have not marked it down.
    pub missing: usize,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Deliver {
        to: usize,
        data: Vec<u8>,
    },
    Timer {
        node: usize,
        timer: Timer<NodeIdentity>,
    },
}

type SimFoca = Foca<NodeIdentity, PostcardCodec, FocaRng<ChaCha8Rng>, NoCustomBroadcast>;

struct SimNode {
    foca: SimFoca,
    up: bool,
    /// When it next announces to the seed if it still knows nobody.
    next_announce: Duration,
}

/// A simulated cluster.
pub struct Simulation {
    config: SimConfig,
    now: Duration,
    nodes: Vec<SimNode>,
    by_addr: HashMap<SocketAddr, usize>,
    queue: BinaryHeap<Reverse<(Duration, u64, Event)>>,
    seq: u64,
    rng: ChaCha8Rng,
    runtime: AccumulatingRuntime<NodeIdentity>,
    reports: Vec<DownReport>,
    next_announce: Duration,
    packets_sent: u64,
    packets_lost: u64,
}

/// The gossip address of simulated member `index`.
pub fn sim_addr(index: usize) -> SocketAddr {
    let index = u32::try_from(index).unwrap_or(u32::MAX);
    let ip = Ipv4Addr::from(0x0a00_0000u32 | (index & 0x00ff_ffff));
    SocketAddr::new(ip.into(), 7946)
}

impl Simulation {
    /// Starts every member at time 0; each announces to member 0 (the seed).
    pub fn new(config: SimConfig) -> Simulation {
        let foca_config = foca_config(config.probe_period, config.suspicion_timeout);
        let mut nodes = Vec::with_capacity(config.members);
        let mut by_addr = HashMap::with_capacity(config.members);
        for index in 0..config.members {
            let gossip = sim_addr(index);
            let identity = NodeIdentity {
                meta: MemberMeta {
                    node: format!("node-{index}"),
                    peer: SocketAddr::new(gossip.ip(), 7000),
                    api: SocketAddr::new(gossip.ip(), 8000),
                    devices: 8,
                    rows_bf16: false,
                    model: 0x5eed,
                    placement_version: 1,
                    loaded_version: 1,
                    placement_hash: 0,
                    loaded_hash: 0,
                    expert_room: u64::MAX,
                    expert_bytes: 0,
                    expert_slots: Vec::new(),
                },
                gossip,
                generation: 1,
            };
            let rng = ChaCha8Rng::seed_from_u64(
                config.seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            nodes.push(SimNode {
                foca: Foca::new(identity, foca_config.clone(), FocaRng(rng), PostcardCodec),
                up: true,
                next_announce: Duration::ZERO,
            });
            by_addr.insert(gossip, index);
        }
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
        // Members start at random moments within the first probe period, so their probe
        // cycles are out of phase as in a real cluster.
        let period_nanos = u64::try_from(config.probe_period.as_nanos()).unwrap_or(u64::MAX);
        for node in nodes.iter_mut().skip(1) {
            node.next_announce = Duration::from_nanos(rng.random_range(0..period_nanos.max(1)));
        }
        let mut simulation = Simulation {
            config,
            now: Duration::ZERO,
            nodes,
            by_addr,
            queue: BinaryHeap::new(),
            seq: 0,
            rng,
            runtime: AccumulatingRuntime::new(),
            reports: Vec::new(),
            next_announce: Duration::ZERO,
            packets_sent: 0,
            packets_lost: 0,
        };
        simulation.announce_lonely();
        simulation
    }

    /// Virtual time since the start.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// Number of members (up or crashed).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the simulation has no member.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Packets sent and packets the links lost so far.
    pub fn packets(&self) -> (u64, u64) {
        (self.packets_sent, self.packets_lost)
    }

    /// Whether member `index` runs.
    pub fn is_up(&self, index: usize) -> bool {
        self.nodes.get(index).is_some_and(|node| node.up)
    }

    /// Every "declared down" any member observed so far.
    pub fn down_reports(&self) -> &[DownReport] {
        &self.reports
    }

    /// Down reports about members that never crashed (false positives).
    pub fn false_downs(&self) -> Vec<DownReport> {
        self.reports
            .iter()
            .filter(|report| self.is_up(report.target))
            .copied()
            .collect()
    }

    /// What `observer` believes about `target` (None: unknown to it).
    pub fn state_of(&self, observer: usize, target: usize) -> Option<MemberState> {
        let gossip = sim_addr(target);
        self.nodes
            .get(observer)?
            .foca
            .iter_membership_state()
            .find(|member| member.id().gossip == gossip)
            .map(|member| MemberState::from(member.state()))
    }

    /// Whether every live member knows every other live member as active.
    pub fn converged(&self) -> bool {
        let live = self.nodes.iter().filter(|node| node.up).count();
        self.nodes
            .iter()
            .filter(|node| node.up)
            .all(|node| node.foca.num_members() + 1 == live)
    }

    /// Runs until converged (checked every 100 ms) or `limit` passes; true if converged.
    pub fn run_until_converged(&mut self, limit: Duration) -> bool {
        let end = self.now + limit;
        while self.now < end {
            if self.converged() {
                return true;
            }
            self.run_for(Duration::from_millis(100));
        }
        self.converged()
    }

    /// Stops member `index` without a word (its packets and timers vanish).
    pub fn crash(&mut self, index: usize) {
        if let Some(node) = self.nodes.get_mut(index) {
            node.up = false;
        }
    }

    /// How the live members learned of `target`'s crash at `crashed_at`.
    pub fn detection(&self, target: usize, crashed_at: Duration) -> Detection {
        let mut first_seen: HashMap<usize, Duration> = HashMap::new();
        for report in &self.reports {
            if report.target == target && report.at >= crashed_at && self.is_up(report.observer) {
                first_seen.entry(report.observer).or_insert(report.at);
            }
        }
        let live_observers = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(index, node)| node.up && *index != target)
            .count();
        let missing = live_observers.saturating_sub(first_seen.len());
        let first = first_seen.values().min().map(|at| *at - crashed_at);
        let last = if missing == 0 {
            first_seen.values().max().map(|at| *at - crashed_at)
        } else {
            None
        };
        Detection {
            first,
            last,
            missing,
        }
    }

    /// Advances the virtual clock by `duration`, delivering packets and firing timers.
    pub fn run_for(&mut self, duration: Duration) {
        let end = self.now + duration;
        loop {
            let next_at = match self.queue.peek() {
                Some(Reverse((at, _, _))) => *at,
                None => end,
            };
            // Lonely members re-announce to the seed every probe period, as the real
            // thread does.
            if self.next_announce <= next_at.min(end) {
                self.now = self.next_announce;
                self.announce_lonely();
                continue;
            }
            if next_at > end {
                break;
            }
            let Some(Reverse((at, _, event))) = self.queue.pop() else {
                break;
            };
            self.now = at;
            match event {
                Event::Deliver { to, data } => {
                    if let Some(node) = self.nodes.get_mut(to)
                        && node.up
                    {
                        let _ = node.foca.handle_data(&data, &mut self.runtime);
                        self.drain(to);
                    }
                }
                Event::Timer { node: index, timer } => {
                    if let Some(node) = self.nodes.get_mut(index)
                        && node.up
                    {
                        let _ = node.foca.handle_timer(timer, &mut self.runtime);
                        self.drain(index);
                    }
                }
            }
        }
        self.now = end;
    }

    /// Members that know nobody announce to the seed once per probe period (checked every
    /// 1/20 period).
    fn announce_lonely(&mut self) {
        self.next_announce = self.now + self.config.probe_period / 20;
        let Some(seed) = self.nodes.first().map(|node| node.foca.identity().clone()) else {
            return;
        };
        for index in 1..self.nodes.len() {
            let node = &mut self.nodes[index];
            if node.up && node.next_announce <= self.now && node.foca.num_members() == 0 {
                node.next_announce = self.now + self.config.probe_period;
                let _ = node.foca.announce(seed.clone(), &mut self.runtime);
                self.drain(index);
            }
        }
    }

    fn push(&mut self, at: Duration, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq, event)));
    }

    /// Carries out what member `index` asked for: sends, timers, notifications.
    fn drain(&mut self, index: usize) {
        while let Some((to, data)) = self.runtime.to_send() {
            self.packets_sent += 1;
            if self.rng.random::<f64>() < self.config.loss {
                self.packets_lost += 1;
                continue;
            }
            let Some(&to) = self.by_addr.get(&to.gossip) else {
                continue;
            };
            let (low, high) = self.config.latency;
            let delay = self.rng.random_range(low..=high.max(low));
            self.push(
                self.now + delay,
                Event::Deliver {
                    to,
                    data: data.to_vec(),
                },
            );
        }
        while let Some((after, timer)) = self.runtime.to_schedule() {
            self.push(self.now + after, Event::Timer { node: index, timer });
        }
        while let Some(notification) = self.runtime.to_notify() {
            if let OwnedNotification::MemberDown(id) = notification
                && let Some(&target) = self.by_addr.get(&id.gossip)
            {
                self.reports.push(DownReport {
                    at: self.now,
                    observer: index,
                    target,
                });
            }
        }
    }
}
