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
mod server;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use client::PeerClient;
pub use frames::read_frame;
pub use link::{client_handshake, server_handshake};
pub use server::PeerServer;

use super::handshake::HandshakeError;
use super::wire::{ExpertReply, ExpertRequest, RemoteError, WireError, WireLimits};

/// Who this node is to its peers, and the secret that proves it belongs to the cluster.
#[derive(Clone)]
pub struct PeerAuth {
    pub node_id: String,
    /// The secret this node proves itself with as a server.
    pub secret: Vec<u8>,
    /// Older (or newer) secrets also accepted from a peer, so that secrets rotate without
    /// downtime: add the new one everywhere, make it first everywhere, then drop the old.
    pub accepted: Vec<Vec<u8>>,
    /// A hash of the model this node serves; peers serving another model are refused.
    pub model_fingerprint: u64,
}

impl PeerAuth {
    /// Every secret accepted, the one this node proves itself with first.
    fn secrets(&self) -> impl Iterator<Item = &[u8]> {
        std::iter::once(self.secret.as_slice()).chain(self.accepted.iter().map(Vec::as_slice))
    }
}

impl std::fmt::Debug for PeerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerAuth")
            .field("node_id", &self.node_id)
            .field("secret", &"<redacted>")
            .field("model_fingerprint", &self.model_fingerprint)
            .finish()
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
            HandshakeError::Timeout(_) | HandshakeError::Io(_) => return,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Tunables of the peer protocol (the defaults suit a LAN).
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
}

impl Default for PeerConfig {
    fn default() -> Self {
        PeerConfig {
            limits: WireLimits::default(),
            queue_capacity: 1024,
            handshake_timeout: Duration::from_secs(5),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            max_inflight_per_connection: 4096,
        }
    }
}

/// One callback per request; called exactly once, from a transport thread, with the reply or
/// the error. It must be quick (hand the result to a channel): replies of the same peer are
/// delivered one after another.
pub type Completion = Box<dyn FnOnce(Result<ExpertReply, PeerError>) + Send>;

/// Runs expert work on this node: blocks while the local devices compute.
pub type Handler = Arc<dyn Fn(ExpertRequest) -> Result<ExpertReply, RemoteError> + Send + Sync>;

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
