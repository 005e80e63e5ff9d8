//! Other nodes as the dispatcher reaches them: one peer client per member, found by the node
//! id the placement names, and the peer server's handler that runs work from other nodes on
//! this node's devices.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use tokio::runtime::Handle;

use crate::cluster::{MemberState, MemberView, Membership};
use crate::experts::ExpertError;
use crate::experts::Reach;
use crate::experts::{
    Answer, Dispatcher, FailCause, GoneCause, GroupRows, RemoteNodes, RemoteWork, TargetError,
};
use crate::transport::peer::{Handler, PeerAuth, PeerClient, PeerConfig, PeerStats};
use crate::transport::wire::RequestHead;
use crate::transport::{
    Dtype, ExpertOutput, ExpertReply, ExpertRequest, RemoteError, Rows, Transport,
};

/// Where a node is reached, what gossip says of it, and how rows travel to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerEntry {
    pub addr: SocketAddr,
    pub state: MemberState,
    /// The dtype its devices consume: bf16 for GPUs, f32 for CPU slots.
    pub rows: Dtype,
    /// Its identity's generation: grows when it restarts.
    pub generation: u64,
}

/// Where a node id is reached and what gossip says of it.
pub trait PeerDirectory: Send + Sync {
    fn lookup(&self, node: &str) -> Option<PeerEntry>;
}

impl PeerDirectory for Membership {
    fn lookup(&self, node: &str) -> Option<PeerEntry> {
        best_member(&self.members(), node).map(|m| PeerEntry {
            addr: m.meta.peer,
            state: m.state,
            generation: m.generation,
            rows: if m.meta.rows_bf16 {
                Dtype::Bf16
            } else {
                Dtype::F32
            },
        })
    }
}

/// Peer clients toward the nodes of the placement, made when first needed and remade when
/// a member's peer address changes.
pub struct PeerNodes {
    transport: Arc<dyn Transport>,
    runtime: Handle,
    auth: Arc<PeerAuth>,
    pub stats: Arc<PeerStats>,
    directory: Arc<dyn PeerDirectory>,
    /// Placement node index → node id (indices only grow: see `Placement::revise`).
    placement_nodes: RwLock<Vec<String>>,
    /// Per node id: the client and the dtype rows travel in to it.
    clients: Mutex<HashMap<String, (Arc<PeerClient>, Dtype)>>,
    /// Per node id: the generation gossip last said it has (a restart makes a new one).
    generations: Mutex<HashMap<String, u64>>,
    width: usize,
    /// The clients' tunables (`[peer]`: queue, timeouts, backoff, wire limits).
    config: PeerConfig,
}

impl PeerNodes {
    pub fn new(
        transport: Arc<dyn Transport>,
        runtime: Handle,
        auth: Arc<PeerAuth>,
        stats: Arc<PeerStats>,
        directory: Arc<dyn PeerDirectory>,
        placement_nodes: Vec<String>,
        width: usize,
    ) -> Self {
        PeerNodes {
            transport,
            runtime,
            auth,
            stats,
            directory,
            placement_nodes: RwLock::new(placement_nodes),
            clients: Mutex::new(HashMap::new()),
            generations: Mutex::new(HashMap::new()),
            width,
            config: PeerConfig::default(),
        }
    }

    /// The clients made from now on take `config` (the node's `[peer]` section).
    pub fn with_config(mut self, config: PeerConfig) -> Self {
        self.config = config;
        self
    }

    fn node_id(&self, node: u16) -> Option<String> {
        self.nodes().get(node as usize).cloned()
    }

    fn nodes(&self) -> Vec<String> {
        self.placement_nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The node ids of a new placement, by index.
    pub fn set_nodes(&self, nodes: Vec<String>) {
        *self
            .placement_nodes
            .write()
            .unwrap_or_else(|e| e.into_inner()) = nodes;
    }

    /// The client toward `id`'s current peer address; `None` when no live member has it.
    /// The client toward `id`: the one made earlier (membership changes drop it when the
    /// node dies or moves, see [`PeerNodes::reach_of_nodes`]), so a send reads the member
    /// table only when there is none.
    fn client(&self, id: &str) -> Option<(Arc<PeerClient>, Dtype)> {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = clients.get(id) {
            return Some(client.clone());
        }
        let entry = self.directory.lookup(id)?;
        if entry.state == MemberState::Dead {
            return None;
        }
        let client = Arc::new(PeerClient::with_config(
            self.transport.clone(),
            self.runtime.clone(),
            entry.addr,
            self.auth.clone(),
            self.stats.clone(),
            self.config.clone(),
        ));
        clients.insert(id.to_string(), (client.clone(), entry.rows));
        Some((client, entry.rows))
    }

    /// Gossip's view of every placement node, for the dispatcher's health, and whether it
    /// restarted since the last look (a new generation: what was measured of it before is
    /// history, see [`crate::experts::Dispatcher::set_node_reach`]). The links of nodes
    /// declared dead are closed, failing what is outstanding on them at once, and the
    /// client of a node now at another address (a restart on a new port) is dropped.
    pub fn reach_of_nodes(&self) -> Vec<(u16, Reach, bool)> {
        let nodes = self.nodes();
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        let mut generations = self.generations.lock().unwrap_or_else(|e| e.into_inner());
        nodes
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let member = self.directory.lookup(id);
                let reach = match member.map(|m| m.state) {
                    Some(MemberState::Alive) => Reach::Up,
                    Some(MemberState::Suspect) => Reach::Suspect,
                    Some(MemberState::Dead) | None => Reach::Down,
                };
                // A restart may bring another address or other devices.
                let moved = member.is_some_and(|m| {
                    clients
                        .get(id)
                        .is_some_and(|(c, rows)| c.addr() != m.addr || *rows != m.rows)
                });
                if (reach == Reach::Down || moved)
                    && let Some((client, _)) = clients.remove(id)
                {
                    client.close();
                }
                let renewed = member.is_some_and(|m| {
                    let before = generations.insert(id.clone(), m.generation);
                    before.is_some_and(|g| m.generation > g.saturating_add(RENEWAL_JUMP))
                });
                (i as u16, reach, renewed)
            })
            .collect()
    }
}

/// A member's generation grows by one with each change of its metadata (a new placement
/// version), and jumps to the wall clock in microseconds when it starts again or rejoins
/// after being declared down: a jump larger than this is a new process (or one back), whose
/// health starts afresh.
const RENEWAL_JUMP: u64 = 1000;

/// The entry that speaks for node `id`: a live one before a suspect one before a dead one,
/// the newest generation among equals (a restarted node has a dead old identity).
pub fn best_member<'a>(members: &'a [MemberView], id: &str) -> Option<&'a MemberView> {
    let rank = |s: MemberState| match s {
        MemberState::Alive => 2,
        MemberState::Suspect => 1,
        MemberState::Dead => 0,
    };
    members
        .iter()
        .filter(|m| m.meta.node == id)
        .max_by_key(|m| (rank(m.state), m.generation))
}

/// A reply's rows as its groups' ranges of the one buffer they were decoded into, checking
/// they are the groups asked for.
fn split_reply(
    reply: ExpertReply,
    asked: &[(u32, u32)],
    width: usize,
) -> Result<Vec<GroupRows>, TargetError> {
    let rows: usize = asked.iter().map(|&(_, r)| r as usize).sum();
    if reply.groups != asked || reply.rows.len() != rows * width {
        return Err(TargetError::Failed(FailCause::WrongReply));
    }
    let rows = Arc::new(reply.rows);
    let mut out = Vec::with_capacity(asked.len());
    let mut at = 0;
    for &(_, r) in asked {
        let len = r as usize * width;
        out.push(GroupRows::Shared(rows.clone(), at..at + len));
        at += len;
    }
    Ok(out)
}

impl RemoteNodes for PeerNodes {
    fn send(&self, node: u16, work: RemoteWork<'_>, answer: Answer) -> Result<(), TargetError> {
        let id = self
            .node_id(node)
            .ok_or(TargetError::Gone(GoneCause::NoNode { node }))?;
        let (client, dtype) = self
            .client(&id)
            .ok_or_else(|| TargetError::Gone(GoneCause::MemberDead { node: id.clone() }))?;
        let asked = work.groups.clone();
        let width = self.width;
        // Open until the reply comes; the node that does the work records it under this.
        let span = crate::telemetry::child_of_current(
            || tracing::info_span!("peer_call", peer = %id, groups = asked.len()),
        );
        let trace = crate::telemetry::context_of(&span);
        let request = RequestHead {
            layer: work.layer as u32,
            placement_version: work.placement_version,
            width: width as u32,
            // What the node's devices consume: f32 keeps a CPU slot's result exact; a GPU
            // rounds rows to bf16 itself, so bf16 on the wire changes nothing but the bytes.
            dtype,
            groups: work.groups,
            trace,
        };
        // On a refused send the client drops its completion uncalled: the answer is kept
        // here so that the real error, not "dropped", is what the dispatcher hears.
        let slot = Arc::new(Mutex::new(Some(answer)));
        let completion_slot = slot.clone();
        // The frame is encoded from the groups' rows where the dispatch holds them.
        let sent = client.send_parts(
            request,
            &work.rows,
            Box::new(move |result| {
                drop(span);
                let answer = completion_slot
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                if let Some(answer) = answer {
                    answer.send(
                        result
                            .map_err(TargetError::from_peer)
                            .and_then(|reply| split_reply(reply, &asked, width)),
                    );
                }
            }),
        );
        if let Err(e) = sent {
            let answer = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(answer) = answer {
                answer.send(Err(TargetError::from_peer(e)));
            }
        }
        Ok(())
    }

    fn link_up(&self, node: u16) -> bool {
        let Some(id) = self.node_id(node) else {
            return false;
        };
        self.clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .is_some_and(|(client, _)| client.is_linked())
    }
}

/// How long work from another node waits for this node to finish loading its experts.
const LOADING_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

fn wait_for<T>(cell: &OnceLock<T>, patience: std::time::Duration) -> Option<&T> {
    let start = std::time::Instant::now();
    loop {
        if let Some(value) = cell.get() {
            return Some(value);
        }
        if start.elapsed() >= patience {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The peer server's handler: runs another node's groups on this node's devices. Work
/// that arrives while this node still loads waits for it (the nodes of a cluster start
/// together and warm up through each other), then is answered overloaded so the sender
/// uses another replica.
pub fn serve_remote_work(dispatcher: Arc<OnceLock<Arc<Dispatcher>>>, width: usize) -> Handler {
    Arc::new(move |request: ExpertRequest| {
        let Some(dispatcher) = wait_for(&dispatcher, LOADING_PATIENCE) else {
            return Err(RemoteError::Overloaded);
        };
        if request.width as usize != width {
            return Err(RemoteError::Malformed(format!(
                "rows of width {}, this model's are {width}",
                request.width
            )));
        }
        let experts: Vec<u32> = request.groups.iter().map(|&(e, _)| e).collect();
        let rows: Vec<usize> = request.groups.iter().map(|&(_, r)| r as usize).collect();
        let layer = request.layer as usize;
        // A traced call: this work is recorded as its child, in the caller's trace.
        let span = match request.trace {
            Some(parent) if crate::telemetry::enabled() => {
                let span = tracing::info_span!("expert_call", layer, groups = experts.len());
                crate::telemetry::set_remote_parent(&span, parent);
                span
            }
            _ => tracing::Span::none(),
        };
        let _in_span = span.enter();
        // The rows as decoded, shared with the device actors that run the groups.
        let input = Arc::new(request.rows);
        let run = |local_only| dispatcher.run_shared(layer, &experts, &rows, &input, local_only);
        // The outputs go into the reply frame from where the devices left them.
        let ran = match run(true) {
            // The caller routes by an older placement than this node, which has let go of
            // experts that placement put here (a node back from a partition, until it has
            // loaded and switched to the cluster's): this node sends them where its own
            // placement puts them. One hop per newer version: the call it makes carries its
            // version, and only a node serving a newer one would send it on again.
            Err(ExpertError::NotHeld { expert, .. })
                if request.placement_version < dispatcher.placement().version() =>
            {
                tracing::debug!(
                    layer,
                    expert,
                    caller_version = request.placement_version,
                    "a call by an older placement for experts let go of: sent where they are now"
                );
                run(false)
            }
            ran => ran,
        };
        match ran {
            Ok(outputs) => Ok(ExpertOutput {
                groups: request.groups,
                rows: Rows::parts(outputs),
            }),
            Err(ExpertError::NotHeld { layer, expert }) => Err(RemoteError::NotHeld {
                layer: layer as u32,
                expert,
            }),
            Err(e) => Err(RemoteError::DeviceFailed(e.to_string())),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_split_into_the_groups_asked_for() {
        let asked = [(3, 1), (7, 2)];
        let reply = ExpertReply {
            groups: asked.to_vec(),
            rows: (0..6).map(|v| v as f32).collect(),
        };
        let groups = split_reply(reply, &asked, 2).unwrap();
        let slices: Vec<&[f32]> = groups.iter().map(|g| &**g).collect();
        assert_eq!(slices, vec![&[0.0, 1.0][..], &[2.0, 3.0, 4.0, 5.0][..]]);
        // One buffer for the reply, each group a range of it.
        let buffers: Vec<*const f32> = groups
            .iter()
            .map(|g| match g {
                GroupRows::Shared(rows, _) => rows.as_ptr(),
                GroupRows::Own(_) => std::ptr::null(),
            })
            .collect();
        assert_eq!(buffers[0], buffers[1]);
        assert!(!buffers[0].is_null());
        let wrong = ExpertReply {
            groups: vec![(3, 1)],
            rows: vec![0.0; 2],
        };
        assert!(split_reply(wrong, &asked, 2).is_err());
        let short = ExpertReply {
            groups: asked.to_vec(),
            rows: vec![0.0; 5],
        };
        assert!(split_reply(short, &asked, 2).is_err());
    }
}
