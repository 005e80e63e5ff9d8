//! The peer protocol over any [`super::Transport`]: [`PeerClient`] (toward one remote node) and
//! [`PeerServer`] (serving this node's experts to the others).
//!
//! A connection starts with the keyed handshake of [`super::handshake`], then carries
//! [`super::wire`] frames: requests from client to server, replies or error frames back,
//! matched by request id. One connection multiplexes every request to a node.
//!
//! The client fails every outstanding completion at once with [`PeerError::LinkDown`] when
//! its connection errors, ends, or [`PeerClient::close`] is called: that is what lets the
//! dispatcher fail over immediately. Each completion is called exactly once.
//!
//! - [`link`]: the handshake driven over a stream, and the choice of what carries the link.
//! - [`frames`]: reading and writing frames on a link, and its shared write half.
//! - [`client`]: [`PeerClient`] and the task that drives its connection.
//! - [`server`]: [`PeerServer`], its accept loop and each connection's reply path.
//!
//! Here: who a node is ([`PeerAuth`]), the tunables, the errors and the counters both
//! sides share.

mod client;
mod frames;
mod link;
pub mod seal;
mod server;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

pub use client::PeerClient;
pub use frames::read_frame;
pub use link::{client_handshake, server_handshake};
pub use server::PeerServer;

use super::handshake::HandshakeError;
use super::wire::{ExpertOutput, ExpertReply, ExpertRequest, RemoteError, WireError, WireLimits};
use crate::config::PeerSection;

/// Who this node is to its peers, and the secrets that prove it belongs to the cluster.
#[derive(Clone)]
pub struct PeerAuth {
    pub node_id: String,
    /// The cluster secrets, shared with the node's reload: the first proves this node, every
    /// one is accepted from a peer.
    pub secrets: PeerSecrets,
    /// A hash of the model this node serves; peers serving another model are refused.
    pub model_fingerprint: u64,
}

impl std::fmt::Debug for PeerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerAuth")
            .field("node_id", &self.node_id)
            .field("secrets", &"<redacted>")
            .field("model_fingerprint", &self.model_fingerprint)
            .finish()
    }
}

/// The cluster secrets of a node's peer links, as they are now: the first is the one this
/// node proves itself with, every one is accepted from a peer, so that secrets rotate without
/// downtime (add the new one everywhere, make it first everywhere, then drop the old). A
/// clone shares the same secrets; [`PeerSecrets::replace`] (a reload) takes effect at the
/// next handshake, on the server and every client at once, and links already up that were
/// made with a secret no longer held close ([`secret_removed`]).
#[derive(Clone)]
pub struct PeerSecrets(Arc<SecretsInner>);

struct SecretsInner {
    secrets: RwLock<Arc<Vec<Vec<u8>>>>,
    /// Bumped by each replacement, for the links to look again.
    generation: tokio::sync::watch::Sender<u64>,
}

impl Default for PeerSecrets {
    fn default() -> Self {
        PeerSecrets::new(Vec::new())
    }
}

impl PeerSecrets {
    pub fn new(secrets: Vec<Vec<u8>>) -> Self {
        PeerSecrets(Arc::new(SecretsInner {
            secrets: RwLock::new(Arc::new(secrets)),
            generation: tokio::sync::watch::Sender::new(0),
        }))
    }

    /// From the configuration's `cluster.secrets`.
    pub fn from_config(secrets: &[String]) -> Self {
        PeerSecrets::new(secrets.iter().map(|s| s.as_bytes().to_vec()).collect())
    }

    /// Replaces every secret (a reload): handshakes from now on prove and accept only these,
    /// and links made with another close.
    pub fn replace(&self, secrets: Vec<Vec<u8>>) {
        *self.0.secrets.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(secrets);
        self.0.generation.send_modify(|g| *g += 1);
    }

    /// The secrets in force now.
    pub fn current(&self) -> Arc<Vec<Vec<u8>>> {
        self.0
            .secrets
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether a secret whose digest ([`crate::transport::handshake::secret_digest`]) is
    /// `digest` is in force.
    fn holds(&self, digest: &[u8; 32]) -> bool {
        self.current()
            .iter()
            .any(|s| crate::transport::handshake::secret_digest(s) == *digest)
    }
}

/// Resolves once the secret a link was made with (its digest, [`LinkKeys::secret`]) is no
/// longer in force: the link then closes, as a handshake with it would be refused.
///
/// [`LinkKeys::secret`]: crate::transport::handshake::LinkKeys::secret
pub(super) async fn secret_removed(secrets: PeerSecrets, digest: [u8; 32]) {
    let mut changes = secrets.0.generation.subscribe();
    while secrets.holds(&digest) {
        if changes.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Why a request to a peer did not get a reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    #[error("cannot connect to peer {0}")]
    Connect(String),
    #[error("peer handshake failed: {0}")]
    Handshake(#[from] HandshakeError),
    #[error("link to peer is down: {0}")]
    LinkDown(String),
    #[error("peer refused the work: {0}")]
    Remote(#[from] RemoteError),
    /// The local send queue toward this peer is full.
    #[error("send queue toward the peer is full")]
    Overloaded,
    /// The client's connection task is gone (its runtime shut down, or the client dropped).
    #[error("peer client is closed")]
    Closed,
    /// The request itself is inconsistent (rows do not match groups × width).
    #[error("request cannot be sent: {0}")]
    BadRequest(WireError),
}

/// Frames and handshakes refused, by reason.
#[derive(Debug, Default)]
pub struct RejectCounters {
    pub bad_magic: AtomicU64,
    pub bad_version: AtomicU64,
    pub too_large: AtomicU64,
    pub malformed: AtomicU64,
    pub auth_failed: AtomicU64,
    pub wrong_model: AtomicU64,
    /// A sealed record that did not open: altered, replayed, reordered or dropped on the way.
    pub integrity: AtomicU64,
    /// A frame or record that stopped half-way for longer than the frame deadline.
    pub stalled: AtomicU64,
    /// A connection over `peer.max_connections` or `peer.max_connections_per_peer`, or a
    /// frame larger than `peer.max_bytes_per_connection`.
    pub over_limit: AtomicU64,
}

/// Traffic and refusal counters of a node's peer links (shared by its clients and server).
#[derive(Debug, Default)]
pub struct PeerStats {
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub frames_rejected: RejectCounters,
    pub handshakes_failed: AtomicU64,
}

impl PeerStats {
    fn add_sent(&self, bytes: usize) {
        self.bytes_sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn add_received(&self, bytes: usize) {
        self.bytes_received
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn reject_frame(&self, error: &WireError) {
        let counters = &self.frames_rejected;
        let counter = match error {
            WireError::BadMagic(_) => &counters.bad_magic,
            WireError::BadVersion { .. } => &counters.bad_version,
            WireError::TooLarge { .. } | WireError::TooManyGroups { .. } => &counters.too_large,
            _ => &counters.malformed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn handshake_failed(&self, error: &HandshakeError) {
        self.handshakes_failed.fetch_add(1, Ordering::Relaxed);
        let counters = &self.frames_rejected;
        let counter = match error {
            HandshakeError::WrongSecret | HandshakeError::RefusedByPeer => &counters.auth_failed,
            HandshakeError::WrongModel { .. } => &counters.wrong_model,
            HandshakeError::BadMagic(_) => &counters.bad_magic,
            HandshakeError::BadVersion { .. } => &counters.bad_version,
            HandshakeError::Protocol(_) | HandshakeError::Truncated => &counters.malformed,
            HandshakeError::NegotiationAltered => &counters.integrity,
            HandshakeError::Timeout(_) | HandshakeError::Io(_) | HandshakeError::NoSecret => {
                return;
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Tunables of the peer protocol (the defaults suit a LAN; `[peer]` in the configuration
/// sets the bounds, see [`PeerConfig::from_section`]).
#[derive(Debug, Clone)]
pub struct PeerConfig {
    pub limits: WireLimits,
    /// Requests queued toward one peer before `send` answers `Overloaded`.
    pub queue_capacity: usize,
    /// Time a handshake may take.
    pub handshake_timeout: Duration,
    /// First wait after a failed connect or a lost link; doubles up to `backoff_max`. While it
    /// runs, new requests fail at once (so the dispatcher fails over instead of waiting).
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Requests one server connection runs at once; more are answered `Overloaded`.
    pub max_inflight_per_connection: usize,
    /// Connections a server holds at once, handshakes included; more are closed at accept.
    pub max_connections: usize,
    /// Authenticated connections from one node id at once; more are closed after the
    /// handshake.
    pub max_connections_per_peer: usize,
    /// Bytes of request rows (as the devices take them, f32) one server connection holds at
    /// once, being read or being worked on: reading stops while they are spent, and a frame
    /// larger than all of them closes the connection. Rows are allocated as they arrive.
    pub max_bytes_per_connection: usize,
    /// Time a frame (or a sealed record) may take to arrive once its first bytes did.
    pub frame_timeout: Duration,
}

impl Default for PeerConfig {
    fn default() -> Self {
        PeerConfig::from_section(&PeerSection::default())
    }
}

impl PeerConfig {
    /// The tunables `[peer]` sets, the rest at their defaults.
    pub fn from_section(section: &PeerSection) -> Self {
        PeerConfig {
            limits: WireLimits::default(),
            queue_capacity: 1024,
            handshake_timeout: Duration::from_secs(5),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            max_inflight_per_connection: section.max_inflight_per_connection,
            max_connections: section.max_connections,
            max_connections_per_peer: section.max_connections_per_peer,
            max_bytes_per_connection: section.max_bytes_per_connection as usize,
            frame_timeout: Duration::from_millis(section.frame_timeout_ms),
        }
    }
}

/// One callback per request; called exactly once, from a transport thread, with the reply or
/// the error. It must be quick (hand the result to a channel): replies of the same peer are
/// delivered one after another.
pub type Completion = Box<dyn FnOnce(Result<ExpertReply, PeerError>) + Send>;

/// Runs expert work on this node: blocks while the local devices compute. Its output is the
/// groups' rows where the devices left them (an [`ExpertReply`] converts with `into`).
pub type Handler = Arc<dyn Fn(ExpertRequest) -> Result<ExpertOutput, RemoteError> + Send + Sync>;

/// Logs a warning at most once per peer address per interval.
#[derive(Debug)]
pub struct WarnLimiter {
    every: Duration,
    last: Mutex<HashMap<IpAddr, Instant>>,
}

/// Addresses remembered by a [`WarnLimiter`] before old entries are dropped.
const WARN_LIMITER_ENTRIES: usize = 4096;

impl WarnLimiter {
    pub fn new(every: Duration) -> Self {
        WarnLimiter {
            every,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a warning about `peer` may be logged at `now` (and if so, records it).
    pub fn allow(&self, peer: IpAddr, now: Instant) -> bool {
        let mut last = lock(&self.last);
        if let Some(&at) = last.get(&peer)
            && now.saturating_duration_since(at) < self.every
        {
            return false;
        }
        if last.len() >= WARN_LIMITER_ENTRIES {
            let every = self.every;
            last.retain(|_, at| now.saturating_duration_since(*at) < every);
        }
        last.insert(peer, now);
        true
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Completions run outside every lock, so a poisoned lock only means plain data.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests;
