//! A node's membership of a cluster: its peer server (expert work from other nodes), its
//! gossip membership, the peer clients toward the others, and the thread that feeds gossip's
//! verdicts to the dispatcher. [`join`] runs before the node loads its experts (it decides
//! which), [`Joined::serve`] once the dispatcher exists.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::cluster::{MemberMeta, Membership, MembershipConfig, MembershipError};
use crate::config::live::LiveSettings;
use crate::config::{ClusterConfig, PeerSection};
use crate::experts::Dispatcher;
use crate::experts::remote::{PeerNodes, serve_remote_work};
use crate::placement::PlacementSpec;
use crate::rollout::bootstrap::{BootstrapError, Start, await_placement, fetch_table};
use crate::rollout::follow::{FollowParts, follow};
use crate::rollout::rebalance::ClusterPart;
use crate::transport::peer::{PeerAuth, PeerConfig, PeerSecrets, PeerServer, PeerStats};
use crate::transport::select;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster membership: {0}")]
    Membership(#[from] MembershipError),
    #[error("cannot listen for peers on {addr}: {source}")]
    PeerBind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start the peer runtime: {0}")]
    Runtime(std::io::Error),
    #[error("{0}")]
    Bootstrap(#[from] BootstrapError),
    #[error("{0}")]
    Transport(String),
    #[error("cluster.{key}: `{value}` is not an address")]
    Address { key: &'static str, value: String },
}

pub struct Joined {
    pub node_id: String,
    pub membership: Membership,
    pub peers: Arc<PeerNodes>,
    pub stats: Arc<PeerStats>,
    pub peer_addr: SocketAddr,
    /// The cluster secrets the peer links prove and accept (a reload replaces them).
    peer_secrets: PeerSecrets,
    /// Kept for its life: dropping it stops serving other nodes.
    _server: PeerServer,
    dispatcher: Arc<OnceLock<Arc<Dispatcher>>>,
    /// This node's API keys as they are now: other nodes' APIs take them (fetching a
    /// placement).
    live: Arc<LiveSettings>,
    rereplicate_after: Duration,
    /// Tells the threads that follow the cluster to end.
    stopping: Arc<AtomicBool>,
    /// The peer links' own runtime: their I/O never waits on the HTTP or router threads.
    /// Always `Some` until dropped.
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Joined {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
        // Dropping a runtime blocks, which panics on an async thread: let it go in the
        // background instead.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// The devices a node offers the cluster.
#[derive(Debug, Clone)]
pub struct OfferedDevices {
    pub count: usize,
    /// They are GPUs (rows to them travel as bf16).
    pub gpus: bool,
    /// Experts of one layer each has memory for ([`crate::plan::expert_slots`]); empty: no
    /// bound.
    pub slots: Vec<u32>,
}

fn parse(key: &'static str, value: &str) -> Result<SocketAddr, ClusterError> {
    value.parse().map_err(|_| ClusterError::Address {
        key,
        value: value.to_string(),
    })
}

/// The newest placement version a live member serves, when the local member (`is_self`)
/// has neither loaded nor served it.
fn newer_placement_served(members: &[crate::cluster::MemberView]) -> Option<u64> {
    let ours = members
        .iter()
        .find(|m| m.is_self)
        .map_or(0, |m| m.meta.loaded_version.max(m.meta.placement_version));
    members
        .iter()
        .filter(|m| !m.is_self && m.state == crate::cluster::MemberState::Alive)
        .map(|m| m.meta.placement_version)
        .max()
        .filter(|&newest| newest > ours)
}

/// How this member gossips, as `[cluster]` says: its address, seeds and periods; `meta` is
/// what it says about itself. Nodes and gateways join the same way.
pub fn gossip_config(
    config: &ClusterConfig,
    secrets: Vec<String>,
    meta: MemberMeta,
) -> Result<MembershipConfig, ClusterError> {
    let mut gossip = MembershipConfig::new(
        parse("gossip_listen", &config.gossip_listen)?,
        secrets,
        meta,
    );
    gossip.seeds = config
        .seeds
        .iter()
        .map(|s| parse("seeds", s))
        .collect::<Result<_, _>>()?;
    gossip.advertise_host = config.advertise_host.parse::<IpAddr>().ok();
    gossip.probe_period = Duration::from_millis(config.probe_period_ms);
    gossip.suspicion_timeout = Duration::from_millis(config.suspicion_timeout_ms);
    Ok(gossip)
}

/// Starts the peer server and gossip, then waits until it knows how to get the placement
/// this node serves under.
pub fn join(
    config: &ClusterConfig,
    peer: &PeerSection,
    model_fingerprint: u64,
    devices: OfferedDevices,
    width: usize,
    api: SocketAddr,
    live: Arc<LiveSettings>,
) -> Result<(Joined, Start), ClusterError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("moe-node-peer")
        .enable_all()
        .build()
        .map_err(ClusterError::Runtime)?;
    // As last read: a reload while the node loads has put its secrets there.
    let secrets = live.cluster_secrets();
    let peer_secrets = PeerSecrets::from_config(&secrets);
    let auth = Arc::new(PeerAuth {
        node_id: config.node_id.clone(),
        secrets: peer_secrets.clone(),
        model_fingerprint,
    });
    let stats = Arc::new(PeerStats::default());
    let chosen = select::choose(peer).map_err(ClusterError::Transport)?;
    tracing::info!(transport = chosen.name, "peer transport: {}", chosen.why);
    let transport = chosen.transport;
    let dispatcher = Arc::new(OnceLock::new());
    let peer_listen = parse("peer_listen", &config.peer_listen)?;
    let server = PeerServer::start_with_config(
        transport.clone(),
        peer_listen,
        auth.clone(),
        stats.clone(),
        serve_remote_work(dispatcher.clone(), width),
        runtime.handle().clone(),
        PeerConfig::from_section(peer),
    )
    .map_err(|source| ClusterError::PeerBind {
        addr: peer_listen,
        source,
    })?;
    let advertise = |addr: SocketAddr| -> SocketAddr {
        let host = config.advertise_host.parse::<IpAddr>().unwrap_or(addr.ip());
        SocketAddr::new(host, addr.port())
    };
    let peer_addr = advertise(server.local_addr());
    let meta = MemberMeta {
        node: config.node_id.clone(),
        peer: peer_addr,
        api: advertise(api),
        devices: devices.count as u32,
        rows_bf16: devices.gpus,
        model: model_fingerprint,
        placement_version: 0,
        loaded_version: 0,
        placement_hash: 0,
        loaded_hash: 0,
        expert_room: u64::MAX,
        expert_bytes: 0,
        expert_slots: devices.slots.clone(),
    };
    let membership = Membership::start(gossip_config(config, secrets.to_vec(), meta)?)?;
    tracing::info!(
        node = %config.node_id,
        gossip = %membership.local_addr(),
        peer = %peer_addr,
        seeds = ?config.seeds,
        "joining the cluster"
    );
    let start = await_placement(
        &membership,
        &config.node_id,
        config.expect_nodes,
        config.replication,
        Duration::from_secs(config.join_timeout_seconds),
        |member| {
            fetch_table(
                member.meta.api,
                member.meta.placement_version,
                &live.local_api_keys(),
            )
        },
    )?;
    let spec: &PlacementSpec = match &start {
        Start::Create(spec) => spec,
        Start::Take(table) => &table.spec,
    };
    let peers = Arc::new(
        PeerNodes::new(
            transport,
            runtime.handle().clone(),
            auth,
            stats.clone(),
            Arc::new(membership.clone()),
            spec.nodes.iter().map(|n| n.node.clone()).collect(),
            width,
        )
        .with_config(PeerConfig::from_section(peer)),
    );
    Ok((
        Joined {
            node_id: config.node_id.clone(),
            membership,
            peers,
            stats,
            peer_addr,
            peer_secrets,
            _server: server,
            dispatcher,
            live,
            rereplicate_after: Duration::from_millis(config.rereplicate_after_ms),
            stopping: Arc::new(AtomicBool::new(false)),
            runtime: Some(runtime),
        },
        start,
    ))
}

impl Joined {
    /// The newest placement version a live member serves, when this node has neither
    /// loaded nor served it: the cluster moved on while this node was cut off, and until it
    /// has loaded and switched too, its calls to experts the others let go of fail. (In an
    /// ordinary change every node has loaded the next version before any switches.) Its
    /// `/ready` says so, so that gateways and load balancers send it nothing meanwhile.
    pub fn behind(&self) -> Option<u64> {
        newer_placement_served(&self.membership.members())
    }

    /// What a rebalance across the cluster reads of it: this node's id and the membership.
    pub fn rebalance_part(&self) -> ClusterPart {
        ClusterPart {
            node_id: self.node_id.clone(),
            membership: self.membership.clone(),
        }
    }

    /// Replaces the cluster secrets of the peer links (a reload): the next handshake, as
    /// server or client, proves with the first and accepts only these; a secret removed is
    /// refused at once. Links already up keep the keys their handshake gave them.
    pub fn set_peer_secrets(&self, secrets: &[String]) {
        self.peer_secrets
            .replace(secrets.iter().map(|s| s.as_bytes().to_vec()).collect());
    }

    /// Takes expert work from other nodes from now on, tells the cluster which placement
    /// this node serves, feeds gossip's verdicts on the nodes to the dispatcher, and
    /// follows the cluster's placement changes (see [`crate::rollout::follow`]).
    pub fn serve(&self, node: ServeParts) {
        let ServeParts {
            dispatcher,
            checkpoint,
            model,
            board,
        } = node;
        let serving = crate::rollout::table_id(&dispatcher.placement());
        let (room, bytes) = crate::experts::device::expert_room(&dispatcher.devices());
        let _ = self.dispatcher.set(dispatcher.clone());
        // Gossip says what this node serves before its follower may act (a leader back
        // from a restart proposes at once): a later write would undo what it loads.
        self.membership.set_serving(serving);
        self.membership.set_room(room, bytes);
        follow(
            FollowParts {
                node_id: self.node_id.clone(),
                membership: self.membership.clone(),
                board,
                dispatcher: dispatcher.clone(),
                peers: self.peers.clone(),
                checkpoint,
                model,
                live: self.live.clone(),
                grace: self.rereplicate_after,
            },
            self.stopping.clone(),
        );
        let update = {
            let peers = self.peers.clone();
            move || {
                for (node, reach, renewed) in peers.reach_of_nodes() {
                    dispatcher.set_node_reach(node, reach, renewed);
                }
            }
        };
        update();
        let mut changes = self.membership.changes();
        let spawned = std::thread::Builder::new()
            .name("moe-node-health".into())
            .spawn(move || {
                // Ends when the membership is gone (the node is stopping).
                while futures::executor::block_on(changes.changed()).is_ok() {
                    update();
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the thread that follows membership");
        }
        tracing::info!(
            node = %self.node_id,
            peer = %self.peer_addr,
            placement_version = serving.version,
            "serving expert work for the cluster"
        );
    }
}

/// The parts of a loaded node its cluster membership works with.
pub struct ServeParts {
    pub dispatcher: Arc<Dispatcher>,
    pub checkpoint: Arc<crate::model::Checkpoint>,
    pub model: Arc<crate::model::ModelConfig>,
    pub board: Arc<crate::rollout::board::PlacementBoard>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{MemberState, MemberView};

    #[test]
    fn a_node_is_behind_only_when_the_others_serve_a_version_it_never_loaded() {
        let me = |serving, loaded| MemberView {
            is_self: true,
            ..MemberView::for_test("a", MemberState::Alive, serving, loaded)
        };
        let other = |state, serving| MemberView::for_test("b", state, serving, serving);
        // Settled.
        assert_eq!(
            newer_placement_served(&[me(3, 3), other(MemberState::Alive, 3)]),
            None
        );
        // An ordinary change: this node loaded version 4 before the other switched.
        assert_eq!(
            newer_placement_served(&[me(3, 4), other(MemberState::Alive, 4)]),
            None
        );
        // Back from a partition: the others serve 5, this node never loaded it.
        assert_eq!(
            newer_placement_served(&[me(3, 3), other(MemberState::Alive, 5)]),
            Some(5)
        );
        // A dead member's word does not count.
        assert_eq!(
            newer_placement_served(&[me(3, 3), other(MemberState::Dead, 5)]),
            None
        );
    }
}
