//! SWIM membership over UDP: foca driven by its own OS thread.
//!
//! The thread owns the socket, foca, and a min-heap of foca's timers; it waits on the socket
//! until the next timer is due (at most [`POLL_INTERVAL`], to pick up commands), so heavy
//! compute elsewhere never delays a probe. Every datagram is stamped (sender start and
//! counter, [`super::replay`]) and sealed by the [`Keyring`]; decrypted ones are refused
//! when replayed and screened (wrong model fingerprint: refused) before foca reads them.
//! After every event the [`MemberTable`] is synced from foca's state and, when it changed,
//! the `changes()` counter bumps.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::num::{NonZeroU8, NonZeroUsize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use foca::{AccumulatingRuntime, Foca, NoCustomBroadcast, OwnedNotification, PostcardCodec, Timer};
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::identity::{FocaRng, MAX_NODE_ID_BYTES, MemberMeta, NodeIdentity, TableId};
use super::keyring::{Keyring, OVERHEAD};
use super::replay::{ReplayGuard, STAMP_LEN, Stamp, Stamper};
use super::schedule::{SeedSchedule, SilenceWatch, WARN_PERIOD};
use super::screen::{Refusal, Screened, WarnLimiter, screen};
use super::table::{MemberState, MemberTable, MemberView, TransitionTally};

/// Default probe period: each member probes one other per second (foca's LAN profile).
pub const DEFAULT_PROBE_PERIOD: Duration = Duration::from_secs(1);
/// Default time a member stays Suspect before it is declared Dead: 2 probe periods (the
/// node config's `cluster.suspicion_timeout_ms` default). Measured on three real nodes it
/// declares a killed node dead in 3.4 s median (benches/results/cluster.txt), inside the
/// 4 s goal; 4 s (foca's LAN profile) gave 5.6 s in the simulation. The simulation bench
/// checks that a suspected member still refutes in time at 1% loss (no false deaths).
pub const DEFAULT_SUSPICION_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest datagram sent or accepted (fits a 1500-byte Ethernet MTU with IP/UDP headers).
pub const MAX_DATAGRAM: usize = 1400;
/// How long a Dead member stays known (and listed by `members()`) before it is forgotten.
pub const DOWN_RETENTION: Duration = Duration::from_secs(15 * 60);
/// The longest the thread sleeps before looking at its commands.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How long a node that knows active members may hear nothing from any of them before it
/// announces to them again (members probe each other every period, so silence this long
/// means packets were lost and foca may have stopped speaking; see [`SilenceWatch`]).
const SILENT_PERIODS: u32 = 8;

/// How to join and run membership.
#[derive(Clone, Debug)]
pub struct MembershipConfig {
    /// UDP address to bind (port 0 picks one). When its IP is unspecified (0.0.0.0), the
    /// address advertised to others is the data-plane (`meta.peer`) IP with this port.
    pub bind: SocketAddr,
    /// The host others reach this node at (`cluster.advertise_host`), advertised with the
    /// bound port whatever IP is bound (NAT, a relay). `None`: as `bind` says.
    pub advertise_host: Option<IpAddr>,
    /// Members to announce to on start (and again while this node knows no other member).
    pub seeds: Vec<SocketAddr>,
    /// Cluster secrets: the first seals every datagram, all are tried when opening.
    pub keys: Vec<String>,
    /// How often this node probes a member. Default [`DEFAULT_PROBE_PERIOD`].
    pub probe_period: Duration,
    /// How long Suspect lasts before Dead. Default [`DEFAULT_SUSPICION_TIMEOUT`].
    pub suspicion_timeout: Duration,
    /// What this node says about itself.
    pub meta: MemberMeta,
}

impl MembershipConfig {
    /// A config with the default periods and no seeds.
    pub fn new(bind: SocketAddr, keys: Vec<String>, meta: MemberMeta) -> MembershipConfig {
        MembershipConfig {
            bind,
            advertise_host: None,
            seeds: Vec::new(),
            keys,
            probe_period: DEFAULT_PROBE_PERIOD,
            suspicion_timeout: DEFAULT_SUSPICION_TIMEOUT,
            meta,
        }
    }

    /// The foca configuration the membership thread runs with.
    pub fn foca_config(&self) -> foca::Config {
        foca_config(self.probe_period, self.suspicion_timeout)
    }
}

/// The foca configuration for a probe period and a suspicion timeout: shared by the
/// membership thread and the simulation so that what the simulation measures is what runs.
///
/// - `probe_rtt` = half the probe period: a direct probe unanswered by then goes indirect
///   through 3 members, who get the rest of the period.
/// - `suspect_to_down_after` = `suspicion_timeout`.
/// - `max_transmissions` = 10: each update rides on 10 packets, about `4 log10(n+1)` for
///   clusters up to ~300 members.
/// - `periodic_gossip` every period / 5 to 3 members: updates spread in a fraction of a
///   period instead of riding probes only.
/// - `periodic_announce` every 30 periods (to 1 member) and to down members every 65
///   periods (to 2): the full roster is learned even if an update was lost, and partitions
///   heal.
/// - `remove_down_after` = [`DOWN_RETENTION`]; packets at most [`MAX_DATAGRAM`] stamped
///   and sealed.
pub fn foca_config(probe_period: Duration, suspicion_timeout: Duration) -> foca::Config {
    let probe_period = probe_period.max(Duration::from_millis(10));
    let mut config = foca::Config::simple();
    config.probe_period = probe_period;
    config.probe_rtt = probe_period / 2;
    config.num_indirect_probes = NonZeroUsize::MIN.saturating_add(2);
    config.max_transmissions = NonZeroU8::MIN.saturating_add(9);
    config.suspect_to_down_after = suspicion_timeout.max(Duration::from_millis(10));
    config.remove_down_after = Some(DOWN_RETENTION);
    config.max_packet_size =
        NonZeroUsize::MIN.saturating_add(MAX_DATAGRAM - OVERHEAD - STAMP_LEN - 1);
    config.notify_down_members = true;
    config.periodic_announce = Some(foca::PeriodicParams {
        frequency: probe_period * 30,
        num_members: NonZeroUsize::MIN,
    });
    config.periodic_announce_to_down_members = Some(foca::PeriodicParams {
        frequency: probe_period * 65,
        num_members: NonZeroUsize::MIN.saturating_add(1),
    });
    config.periodic_gossip = Some(foca::PeriodicParams {
        frequency: probe_period / 5,
        num_members: NonZeroUsize::MIN.saturating_add(2),
    });
    config
}

/// Why membership could not start.
#[derive(thiserror::Error, Debug)]
pub enum MembershipError {
    /// The UDP socket could not be bound.
    #[error("cannot bind the gossip socket to {addr}: {source} (is the port in use?)")]
    Bind {
        /// What we tried to bind.
        addr: SocketAddr,
        /// Why it failed.
        source: io::Error,
    },
    /// No cluster secret (or an empty one).
    #[error("no cluster secret: set at least one non-empty key; every member must share it")]
    NoKey,
    /// The node id does not fit in a packet comfortably.
    #[error("node id is {len} bytes; at most {MAX_NODE_ID_BYTES} are allowed")]
    NodeIdTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// Neither the bind address nor the data-plane address says where others reach us.
    #[error(
        "gossip binds {bind} and the data-plane address {peer} is unspecified too: bind \
         gossip to the node's IP so that members can reach it"
    )]
    NoAdvertiseAddress {
        /// The configured bind address.
        bind: SocketAddr,
        /// The data-plane address.
        peer: SocketAddr,
    },
    /// A period is zero.
    #[error(
        "probe_period and suspicion_timeout must be positive (got {probe:?} and {suspicion:?})"
    )]
    Periods {
        /// The probe period.
        probe: Duration,
        /// The suspicion timeout.
        suspicion: Duration,
    },
    /// The socket could not be configured or the thread could not start.
    #[error("cannot start the membership thread: {0}")]
    Start(io::Error),
}

/// Counters of transitions into each state (members other than this node).
#[derive(Debug, Default)]
pub struct TransitionCounters {
    /// Joins and recoveries.
    pub alive: AtomicU64,
    /// Members that became Suspect.
    pub suspect: AtomicU64,
    /// Members that became Dead.
    pub dead: AtomicU64,
}

/// Datagrams dropped before foca read them, by reason.
#[derive(Debug, Default)]
pub struct GossipRejections {
    /// Larger than [`MAX_DATAGRAM`].
    pub oversized: AtomicU64,
    /// No cluster secret in force opens them (a wrong or removed secret, garbage).
    pub unauthenticated: AtomicU64,
    /// Opened, but not a stamped foca packet we can read.
    pub malformed: AtomicU64,
    /// Opened, but its sender's stamp was taken before (a replay) or is of an older run.
    pub replay: AtomicU64,
}

impl GossipRejections {
    /// Every datagram dropped, whatever the reason.
    pub fn total(&self) -> u64 {
        [
            &self.oversized,
            &self.unauthenticated,
            &self.malformed,
            &self.replay,
        ]
        .iter()
        .map(|counter| counter.load(Ordering::Relaxed))
        .sum()
    }

    fn count(&self, why: Rejection) {
        let counter = match why {
            Rejection::Oversized => &self.oversized,
            Rejection::Unauthenticated => &self.unauthenticated,
            Rejection::Malformed => &self.malformed,
            Rejection::Replay => &self.replay,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Membership counters, for metrics.
#[derive(Debug, Default)]
pub struct MembershipStats {
    /// Datagrams dropped before foca read them, by reason.
    pub packets_rejected: GossipRejections,
    /// Datagrams (or gossiped members) refused because they serve another model.
    pub members_refused: AtomicU64,
    /// Transitions seen.
    pub transitions: TransitionCounters,
}

impl MembershipStats {
    fn record_transitions(&self, tally: TransitionTally) {
        self.transitions.alive.store(tally.alive, Ordering::Relaxed);
        self.transitions
            .suspect
            .store(tally.suspect, Ordering::Relaxed);
        self.transitions.dead.store(tally.dead, Ordering::Relaxed);
    }
}

/// What the handle asks of the membership thread.
enum Command {
    /// Gossip new placement versions, served and loaded (identity renewal with the new
    /// metadata).
    SetVersions { serving: TableId, loaded: TableId },
    /// Gossip new expert room (identity renewal).
    SetRoom { room: u64, bytes: u64 },
    /// Seal with the first of these secrets and open with any of them from now on.
    SetKeys(Keyring),
    /// Tell the cluster we leave, then stop.
    Leave,
    /// Stop without telling anyone (as a crash would look).
    Halt,
}

struct Shared {
    local_addr: SocketAddr,
    table: Arc<Mutex<MemberTable>>,
    changes: tokio::sync::watch::Receiver<u64>,
    stats: Arc<MembershipStats>,
    commands: Mutex<mpsc::Sender<Command>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Shared {
    fn stop(&self, command: Command) {
        let _ = lock(&self.commands).send(command);
        let thread = lock(&self.thread).take();
        if let Some(thread) = thread
            && thread.join().is_err()
        {
            tracing::error!("the membership thread panicked");
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.stop(Command::Halt);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Handle to the membership thread; cheap to clone. The thread stops when the last handle
/// is dropped (without leaving: call [`Membership::leave`] for a graceful exit).
#[derive(Clone)]
pub struct Membership {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Membership")
            .field("local_addr", &self.shared.local_addr)
            .finish()
    }
}

impl Membership {
    /// Binds the UDP socket and starts the membership thread (its own OS thread: heavy
    /// compute elsewhere must never starve it); announces to the seeds and keeps
    /// re-announcing to them while it knows no other member.
    pub fn start(config: MembershipConfig) -> Result<Membership, MembershipError> {
        let keyring = Keyring::new(&config.keys).ok_or(MembershipError::NoKey)?;
        if config.meta.node.len() > MAX_NODE_ID_BYTES {
            return Err(MembershipError::NodeIdTooLong {
                len: config.meta.node.len(),
            });
        }
        if config.probe_period.is_zero() || config.suspicion_timeout.is_zero() {
            return Err(MembershipError::Periods {
                probe: config.probe_period,
                suspicion: config.suspicion_timeout,
            });
        }
        let socket = UdpSocket::bind(config.bind).map_err(|source| MembershipError::Bind {
            addr: config.bind,
            source,
        })?;
        let local_addr = socket.local_addr().map_err(MembershipError::Start)?;
        let gossip = advertised(local_addr, config.meta.peer, config.advertise_host).ok_or(
            MembershipError::NoAdvertiseAddress {
                bind: config.bind,
                peer: config.meta.peer,
            },
        )?;
        let identity = NodeIdentity::starting_now(config.meta.clone(), gossip);
        let now = Instant::now();
        let table = Arc::new(Mutex::new(MemberTable::new(&identity, now)));
        let stats = Arc::new(MembershipStats::default());
        let (changes_tx, changes_rx) = tokio::sync::watch::channel(0u64);
        let (commands_tx, commands_rx) = mpsc::channel();
        let foca = Foca::new(
            identity,
            config.foca_config(),
            FocaRng(StdRng::from_os_rng()),
            PostcardCodec,
        );
        let seeds = config
            .seeds
            .iter()
            .copied()
            .filter(|seed| *seed != gossip && *seed != local_addr)
            .collect();
        let driver = Driver {
            socket,
            keyring,
            foca,
            runtime: AccumulatingRuntime::new(),
            timers: BinaryHeap::new(),
            timer_seq: 0,
            table: Arc::clone(&table),
            stats: Arc::clone(&stats),
            changes: changes_tx,
            commands: commands_rx,
            seeds,
            seed_schedule: SeedSchedule::new(config.probe_period, now),
            silence: SilenceWatch::new(config.probe_period * SILENT_PERIODS, now),
            nonce_rng: StdRng::from_os_rng(),
            stamper: Stamper::starting_now(),
            replays: ReplayGuard::default(),
            rejected_log: WarnLimiter::new(WARN_PERIOD, 1024),
            refused_log: WarnLimiter::new(WARN_PERIOD, 1024),
            model: config.meta.model,
        };
        let thread = std::thread::Builder::new()
            .name("membership".into())
            .spawn(move || driver.run())
            .map_err(MembershipError::Start)?;
        Ok(Membership {
            shared: Arc::new(Shared {
                local_addr,
                table,
                changes: changes_rx,
                stats,
                commands: Mutex::new(commands_tx),
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// The bound UDP address.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    /// Every member this node knows, itself first (`is_self`); Dead ones are kept for
    /// [`DOWN_RETENTION`] so operators see them.
    pub fn members(&self) -> Vec<MemberView> {
        lock(&self.shared.table).views()
    }

    /// Bumps on every change (join, state change, metadata change), after the member table
    /// changed.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.shared.changes.clone()
    }

    /// Changes this node's placement_version and gossips it. Done by identity renewal: the
    /// new identity (same address, next generation) replaces the old one on every member,
    /// who see a metadata change (a Rename in foca's terms), not a death.
    pub fn set_serving(&self, serving: TableId) {
        self.set_versions(serving, serving);
    }

    /// Gossips the placement this node serves and the newest one it has loaded (`loaded`
    /// of a version below `serving`'s is taken as `serving`).
    pub fn set_versions(&self, serving: TableId, loaded: TableId) {
        let _ = lock(&self.shared.commands).send(Command::SetVersions {
            serving,
            loaded: loaded.loaded_beside(serving),
        });
    }

    /// Gossips the bytes of experts this node could still take and the bytes one takes
    /// ([`MemberMeta::expert_room`]); counted after it loads or lets go of experts.
    pub fn set_room(&self, room: u64, bytes: u64) {
        let _ = lock(&self.shared.commands).send(Command::SetRoom { room, bytes });
    }

    /// Replaces the cluster secrets (a reload): from the next datagram on, the first seals
    /// and only these open, so a secret removed here is refused at once.
    pub fn set_keys(&self, keys: &[String]) -> Result<(), MembershipError> {
        let keyring = Keyring::new(keys).ok_or(MembershipError::NoKey)?;
        let _ = lock(&self.shared.commands).send(Command::SetKeys(keyring));
        Ok(())
    }

    /// Membership counters.
    pub fn stats(&self) -> Arc<MembershipStats> {
        Arc::clone(&self.shared.stats)
    }

    /// Leaves the cluster gracefully (others mark this node Dead at once) and stops the
    /// thread. Other clones of this handle keep the last view.
    pub fn leave(self) {
        self.shared.stop(Command::Leave);
    }

    /// Stops the thread without telling anyone, as a crash would look to the cluster (for
    /// tests and fault drills). The socket is closed, so the address can be bound again.
    pub fn halt(self) {
        self.shared.stop(Command::Halt);
    }
}

/// The address others reach us at: the advertised host with the bound port when one is
/// set, else the bound address, or the data-plane IP when bound to an unspecified IP.
fn advertised(
    local: SocketAddr,
    peer: SocketAddr,
    advertise_host: Option<IpAddr>,
) -> Option<SocketAddr> {
    if let Some(host) = advertise_host {
        Some(SocketAddr::new(host, local.port()))
    } else if !local.ip().is_unspecified() {
        Some(local)
    } else if !peer.ip().is_unspecified() {
        Some(SocketAddr::new(peer.ip(), local.port()))
    } else {
        None
    }
}

/// Why a datagram was dropped before foca read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// Larger than [`MAX_DATAGRAM`].
    Oversized,
    /// No secret in force opens it.
    Unauthenticated,
    /// Opened, but not a stamped foca packet.
    Malformed,
    /// Its sender's stamp was taken before, or is of an older run.
    Replay,
}

impl Rejection {
    /// The `reason` label of `moe_node_gossip_packets_rejected_total`.
    pub fn label(self) -> &'static str {
        match self {
            Rejection::Oversized => "oversized",
            Rejection::Unauthenticated => "unauthenticated",
            Rejection::Malformed => "malformed",
            Rejection::Replay => "replay",
        }
    }

    fn why(self) -> &'static str {
        match self {
            Rejection::Oversized => "oversized",
            Rejection::Unauthenticated => "no cluster secret opens it (wrong or removed secret?)",
            Rejection::Malformed => "undecodable",
            Rejection::Replay => "replayed (its stamp was seen before, or is of an older run)",
        }
    }
}

/// What every received datagram goes through before foca reads it: the size limit, the
/// keyring (no secret opens it: refused), the sender's stamp (a replay: refused, see
/// [`super::replay`]), and the model screen. A stamp is recorded in `guard` only when the
/// datagram is accepted. Public so that the gossip fuzz target drives the same path.
pub fn open_datagram(
    keyring: &Keyring,
    guard: &mut ReplayGuard,
    our_model: u64,
    datagram: &[u8],
) -> Result<Screened, Rejection> {
    if datagram.len() > MAX_DATAGRAM {
        return Err(Rejection::Oversized);
    }
    let plain = keyring.open(datagram).ok_or(Rejection::Unauthenticated)?;
    let (stamp, packet): (Stamp, &[u8]) = Stamp::split(&plain).ok_or(Rejection::Malformed)?;
    let screened = screen(packet, our_model);
    if let Screened::Accept { sender, .. } = &screened
        && !guard.check(*sender, stamp)
    {
        return Err(Rejection::Replay);
    }
    Ok(screened)
}

type NodeFoca = Foca<NodeIdentity, PostcardCodec, FocaRng<StdRng>, NoCustomBroadcast>;

/// The membership thread's state.
struct Driver {
    socket: UdpSocket,
    keyring: Keyring,
    foca: NodeFoca,
    runtime: AccumulatingRuntime<NodeIdentity>,
    /// Foca's timers by deadline (the sequence number keeps equal deadlines in order).
    timers: BinaryHeap<Reverse<(Instant, u64, Timer<NodeIdentity>)>>,
    timer_seq: u64,
    table: Arc<Mutex<MemberTable>>,
    stats: Arc<MembershipStats>,
    changes: tokio::sync::watch::Sender<u64>,
    commands: mpsc::Receiver<Command>,
    seeds: Vec<SocketAddr>,
    seed_schedule: SeedSchedule,
    silence: SilenceWatch,
    nonce_rng: StdRng,
    stamper: Stamper,
    replays: ReplayGuard,
    rejected_log: WarnLimiter<SocketAddr>,
    refused_log: WarnLimiter<SocketAddr>,
    model: u64,
}

impl Driver {
    fn run(mut self) {
        tracing::info!(
            node = %self.foca.identity().meta.node,
            gossip = %self.foca.identity().gossip,
            seeds = ?self.seeds,
            "membership started"
        );
        let mut buf = vec![0u8; 65536];
        loop {
            match self.commands.try_recv() {
                Ok(Command::SetVersions { serving, loaded }) => self.set_versions(serving, loaded),
                Ok(Command::SetRoom { room, bytes }) => {
                    let meta = self.foca.identity().meta.clone();
                    if (meta.expert_room, meta.expert_bytes) != (room, bytes) {
                        self.renew(MemberMeta {
                            expert_room: room,
                            expert_bytes: bytes,
                            ..meta
                        });
                    }
                }
                Ok(Command::SetKeys(keyring)) => {
                    self.keyring = keyring;
                    tracing::info!("gossip takes the reloaded cluster secrets");
                }
                Ok(Command::Leave) => {
                    if let Err(error) = self.foca.leave_cluster(&mut self.runtime) {
                        tracing::warn!(%error, "leaving the cluster failed");
                    }
                    self.flush(Instant::now());
                    tracing::info!("left the cluster");
                    return;
                }
                Ok(Command::Halt) | Err(mpsc::TryRecvError::Disconnected) => return,
                Err(mpsc::TryRecvError::Empty) => {}
            }
            let now = Instant::now();
            let wait = self
                .timers
                .peek()
                .map(|Reverse((at, _, _))| at.saturating_duration_since(now))
                .unwrap_or(POLL_INTERVAL)
                .clamp(Duration::from_millis(1), POLL_INTERVAL);
            if let Err(error) = self.socket.set_read_timeout(Some(wait)) {
                tracing::warn!(%error, "cannot set the gossip socket timeout");
            }
            match self.socket.recv_from(&mut buf) {
                Ok((len, from)) => {
                    let datagram = buf.get(..len).unwrap_or_default();
                    self.receive(datagram, from, Instant::now());
                }
                Err(error)
                    if matches!(
                        error.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                // ICMP port unreachable from a dead member surfaces here on some systems.
                Err(error) => tracing::debug!(%error, "gossip receive failed"),
            }
            let now = Instant::now();
            self.fire_timers(now);
            self.poll_seeds(now);
            if self.silence.poll(self.foca.num_members() > 0, now) {
                tracing::warn!(
                    members = self.foca.num_members(),
                    "no member heard from for {SILENT_PERIODS} probe periods: announcing to them again"
                );
                self.announce_to_members();
            }
            self.flush(now);
        }
    }

    fn receive(&mut self, datagram: &[u8], from: SocketAddr, now: Instant) {
        match open_datagram(&self.keyring, &mut self.replays, self.model, datagram) {
            Err(why) => self.reject(from, now, why),
            Ok(Screened::Malformed) => self.reject(from, now, Rejection::Malformed),
            Ok(Screened::RefuseSender(refusal)) => self.refuse(&refusal, now),
            Ok(Screened::Accept {
                packet,
                sender,
                refused,
            }) => {
                for refusal in &refused {
                    self.refuse(refusal, now);
                }
                lock(&self.table).heard_from(sender, now);
                self.silence.heard(now);
                match self.foca.handle_data(&packet, &mut self.runtime) {
                    Ok(()) => {}
                    Err(
                        foca::Error::Decode(_)
                        | foca::Error::MalformedPacket
                        | foca::Error::DataTooBig
                        | foca::Error::CustomBroadcast(_),
                    ) => self.reject(from, now, Rejection::Malformed),
                    Err(error) => tracing::debug!(%error, %from, "gossip datagram ignored"),
                }
            }
        }
    }

    fn reject(&mut self, from: SocketAddr, now: Instant, why: Rejection) {
        self.stats.packets_rejected.count(why);
        if self.rejected_log.allow(from, now) {
            tracing::warn!(
                %from,
                why = why.why(),
                "dropped a gossip datagram; more from this address are counted \
                 (packets_rejected) and logged at most once a minute"
            );
        }
    }

    fn refuse(&mut self, refusal: &Refusal, now: Instant) {
        self.stats.members_refused.fetch_add(1, Ordering::Relaxed);
        if self.refused_log.allow(refusal.gossip, now) {
            tracing::warn!(
                node = %refusal.node,
                gossip = %refusal.gossip,
                "refusing member {} at {}: it serves model fingerprint {:#018x}, this node \
                 serves {:#018x}",
                refusal.node,
                refusal.gossip,
                refusal.model,
                self.model
            );
        }
    }

    fn fire_timers(&mut self, now: Instant) {
        while let Some(Reverse((at, _, _))) = self.timers.peek() {
            if *at > now {
                break;
            }
            let Some(Reverse((_, _, timer))) = self.timers.pop() else {
                break;
            };
            if let Err(error) = self.foca.handle_timer(timer, &mut self.runtime) {
                tracing::debug!(%error, "foca timer");
            }
        }
    }

    fn poll_seeds(&mut self, now: Instant) {
        let alone = self.foca.num_members() == 0;
        let actions = self.seed_schedule.poll(alone, now);
        if actions.announce {
            for seed in self.seeds.clone() {
                let target = NodeIdentity::seed(seed, self.model);
                if let Err(error) = self.foca.announce(target, &mut self.runtime) {
                    tracing::debug!(%error, %seed, "announce");
                }
            }
        }
        if actions.warn_alone {
            if self.seeds.is_empty() {
                tracing::info!("no other member known and no seeds configured: alone");
            } else {
                tracing::warn!(
                    seeds = ?self.seeds,
                    "no seed answers: this node is alone; check that the seeds run and share \
                     this node's cluster secret and model"
                );
            }
        }
    }

    fn set_versions(&mut self, serving: TableId, loaded: TableId) {
        let meta = self.foca.identity().meta.clone();
        if (meta.serving(), meta.loaded()) == (serving, loaded) {
            return;
        }
        self.renew(MemberMeta {
            placement_version: serving.version,
            placement_hash: serving.hash,
            loaded_version: loaded.version,
            loaded_hash: loaded.hash,
            ..meta
        });
    }

    /// Gossips `meta` as this node's, under a renewed identity.
    fn renew(&mut self, meta: MemberMeta) {
        let renewed = self.foca.identity().with_meta(meta);
        if let Err(error) = self.foca.change_identity(renewed, &mut self.runtime) {
            tracing::warn!(%error, "cannot gossip this node's new metadata");
            return;
        }
        // Foca addresses what it sends to the identities it knows, and accepts only what is
        // addressed to its own: a member that changed its identity at the same moment (two
        // nodes switch together once each has seen the other load) drops the gossip above,
        // as we drop theirs, and with no probe timer left after the change neither side
        // would speak again. An announce is accepted by address, whatever the identity: its
        // reply reconnects us under the new one.
        self.announce_to_members();
    }

    /// Announces to every member foca counts active (by address: accepted whatever
    /// identity they have now).
    fn announce_to_members(&mut self) {
        let known: Vec<NodeIdentity> = self.foca.iter_members().map(|m| m.id().clone()).collect();
        for member in known {
            if let Err(error) = self.foca.announce(member, &mut self.runtime) {
                tracing::debug!(%error, "announce");
            }
        }
    }

    /// Sends what foca queued, schedules its timers, logs its notifications, and publishes
    /// the member table if it changed.
    fn flush(&mut self, now: Instant) {
        while let Some((to, data)) = self.runtime.to_send() {
            let plain = self.stamper.stamp(&data);
            let Some(sealed) = self.keyring.seal(&plain, &mut self.nonce_rng) else {
                continue;
            };
            if let Err(error) = self.socket.send_to(&sealed, to.gossip) {
                tracing::debug!(%error, to = %to.gossip, "gossip send failed");
            }
        }
        while let Some((after, timer)) = self.runtime.to_schedule() {
            self.timer_seq += 1;
            self.timers
                .push(Reverse((now + after, self.timer_seq, timer)));
        }
        while let Some(notification) = self.runtime.to_notify() {
            log_notification(notification);
        }
        let changed = {
            let mut table = lock(&self.table);
            let local = table.set_local(self.foca.identity(), 0, now);
            let others = table.sync(
                self.foca.iter_membership_state().map(|member| {
                    (
                        member.id(),
                        u64::from(member.incarnation()),
                        MemberState::from(member.state()),
                    )
                }),
                now,
            );
            self.stats.record_transitions(table.transitions());
            local || others
        };
        if changed {
            self.changes.send_modify(|version| *version += 1);
        }
    }
}

fn log_notification(notification: OwnedNotification<NodeIdentity>) {
    match notification {
        OwnedNotification::MemberUp(id) => {
            tracing::info!(node = %id.meta.node, gossip = %id.gossip, "member up")
        }
        OwnedNotification::MemberDown(id) => {
            tracing::warn!(node = %id.meta.node, gossip = %id.gossip, "member down")
        }
        OwnedNotification::Rename(old, new) => tracing::info!(
            node = %new.meta.node,
            gossip = %new.gossip,
            old_generation = old.generation,
            new_generation = new.generation,
            "member renewed its identity"
        ),
        OwnedNotification::Active => tracing::info!("joined the cluster"),
        OwnedNotification::Idle => tracing::warn!("no other active member known"),
        OwnedNotification::Defunct => {
            tracing::error!("this node was declared down and cannot renew its identity")
        }
        OwnedNotification::Rejoin(id) => tracing::warn!(
            generation = id.generation,
            "this node was declared down; rejoined with a new identity"
        ),
        #[allow(unreachable_patterns)]
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn foca_config_follows_the_periods() {
        let config = foca_config(Duration::from_millis(200), Duration::from_millis(900));
        assert_eq!(config.probe_period, Duration::from_millis(200));
        assert_eq!(config.probe_rtt, Duration::from_millis(100));
        assert_eq!(config.suspect_to_down_after, Duration::from_millis(900));
        assert_eq!(
            config.max_packet_size.get() + STAMP_LEN + OVERHEAD,
            MAX_DATAGRAM
        );
        assert_eq!(
            config.periodic_gossip.map(|gossip| gossip.frequency),
            Some(Duration::from_millis(40))
        );
    }

    #[test]
    fn unspecified_binds_advertise_the_data_plane_ip() {
        let any: SocketAddr = "0.0.0.0:7946".parse().expect("addr");
        let peer: SocketAddr = "10.1.2.3:7000".parse().expect("addr");
        assert_eq!(advertised(any, peer, None), "10.1.2.3:7946".parse().ok());
        let bound: SocketAddr = "10.9.9.9:7946".parse().expect("addr");
        assert_eq!(advertised(bound, peer, None), Some(bound));
        let unspecified_peer = "0.0.0.0:7000".parse().expect("addr");
        assert_eq!(advertised(any, unspecified_peer, None), None);
        // An advertised host wins, with the bound port, whatever IP is bound.
        let host = "192.0.2.7".parse().ok();
        for local in [any, bound] {
            assert_eq!(
                advertised(local, unspecified_peer, host),
                "192.0.2.7:7946".parse().ok()
            );
        }
    }
}
