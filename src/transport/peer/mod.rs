//! The peer protocol over any [`Transport`]: [`PeerClient`] (toward one remote node) and
//! [`PeerServer`] (serving this node's experts to the others).
//!
//! A connection starts with the keyed handshake of [`super::handshake`], then carries
//! [`super::wire`] frames: requests from client to server, replies or error frames back,
//! matched by request id. One connection multiplexes every request to a node.
//!
//! The client fails every outstanding completion at once with [`PeerError::LinkDown`] when
//! its connection errors, ends, or [`PeerClient::close`] is called: that is what lets the
//! dispatcher fail over immediately. Each completion is called exactly once.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tokio::io::{
    AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt,
};
use tokio::runtime::Handle;
use tokio::sync::{Notify, mpsc, watch};

use super::handshake::{self, HandshakeError, Hello, LinkOffer, MAC_LEN, Status};
use super::wire::{
    self, Dtype, ExpertReply, ExpertRequest, FrameBody, FrameHeader, FrameKind, HEADER_LEN,
    RemoteError, RowsFrame, WireError, WireLimits,
};
use super::{
    DecodedRows, FrameRead, FrameWrite, PeerListener, PeerStream, ROWS_APART_MIN, Transport,
};

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

fn io_error(error: std::io::Error) -> HandshakeError {
    if error.kind() == std::io::ErrorKind::UnexpectedEof {
        HandshakeError::Truncated
    } else {
        HandshakeError::Io(error.to_string())
    }
}

async fn read_array<const N: usize, S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<[u8; N], HandshakeError> {
    let mut bytes = [0u8; N];
    stream.read_exact(&mut bytes).await.map_err(io_error)?;
    Ok(bytes)
}

async fn read_hello<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Hello, HandshakeError> {
    let fixed = read_array::<{ handshake::HELLO_FIXED_LEN }, _>(stream).await?;
    let (model_fingerprint, nonce, id_len) = handshake::parse_hello_fixed(&fixed)?;
    let mut id = vec![0u8; id_len];
    stream.read_exact(&mut id).await.map_err(io_error)?;
    Ok(Hello {
        node_id: handshake::parse_id(id)?,
        model_fingerprint,
        nonce,
    })
}

async fn write<S: AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8]) -> Result<(), HandshakeError> {
    stream.write_all(bytes).await.map_err(io_error)?;
    stream.flush().await.map_err(io_error)
}

fn our_hello(auth: &PeerAuth) -> Hello {
    Hello {
        node_id: auth.node_id.clone(),
        model_fingerprint: auth.model_fingerprint,
        nonce: rand::random(),
    }
}

/// The client half of the handshake, offering no other path (the frames stay on `stream`);
/// returns the server's node id. Public so that tests and tools can speak raw frames to a
/// server.
pub async fn client_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    auth: &PeerAuth,
) -> Result<String, HandshakeError> {
    let server_id = client_authenticate(stream, auth).await?;
    exchange_offers(stream, &LinkOffer::Stay).await?;
    Ok(server_id)
}

/// The server half of the handshake, offering no other path; returns the client's node id.
/// Public for the handshake fuzz target.
pub async fn server_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    auth: &PeerAuth,
) -> Result<String, HandshakeError> {
    let client_id = server_authenticate(stream, auth).await?;
    exchange_offers(stream, &LinkOffer::Stay).await?;
    Ok(client_id)
}

/// Sends our link offer and reads the peer's.
async fn exchange_offers<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    ours: &LinkOffer,
) -> Result<LinkOffer, HandshakeError> {
    write(stream, &handshake::encode_link_offer(ours)).await?;
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(stream).await?;
    handshake::check_preamble(&preamble, handshake::message::LINK_OFFER)?;
    let fixed = read_array::<{ handshake::LINK_OFFER_FIXED_LEN }, _>(stream).await?;
    let (kind, len) = handshake::parse_link_offer_fixed(&fixed)?;
    let mut address = vec![0u8; len];
    stream.read_exact(&mut address).await.map_err(io_error)?;
    Ok(handshake::link_offer(kind, address))
}

/// After both sides authenticated: each offers what else could carry the link, and the link
/// moves there when both offer it and both make their end; otherwise it stays on `stream`.
/// Returns the link's stream and the name of its path ("tcp" when it stays).
async fn negotiate_link(
    mut stream: Box<dyn PeerStream>,
    transport: &dyn Transport,
    peer: SocketAddr,
) -> Result<(Box<dyn PeerStream>, &'static str), HandshakeError> {
    let upgrade = transport.upgrade().await.unwrap_or_else(|error| {
        tracing::warn!(%peer, %error, "cannot offer this peer link UCX: it stays on TCP");
        None
    });
    let ours = match &upgrade {
        Some(upgrade) => LinkOffer::Ucx(upgrade.address().to_vec()),
        None => LinkOffer::Stay,
    };
    let theirs = exchange_offers(&mut stream, &ours).await?;
    let (mut upgrade, address) = match (upgrade, theirs) {
        (Some(upgrade), LinkOffer::Ucx(address)) => (upgrade, address),
        (Some(upgrade), LinkOffer::Stay) => {
            tracing::info!(
                %peer,
                "peer link stays on TCP: the peer offers no {} (its peer.transport is \"tcp\", or UCX does not load there)",
                upgrade.name()
            );
            return Ok((stream, "tcp"));
        }
        (None, _) => return Ok((stream, "tcp")),
    };
    let made = upgrade.connect(&address).await;
    write(&mut stream, &handshake::encode_link_ready(made.is_ok())).await?;
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(&mut stream).await?;
    handshake::check_preamble(&preamble, handshake::message::LINK_READY)?;
    let [ready] = read_array::<1, _>(&mut stream).await?;
    let theirs_ready = handshake::parse_link_ready(ready)?;
    match made {
        Ok(()) if theirs_ready => {
            let name = upgrade.name();
            Ok((upgrade.into_stream(stream), name))
        }
        Ok(()) => {
            tracing::warn!(
                %peer,
                "peer link stays on TCP: the peer could not reach this node's {} address (see its log)",
                upgrade.name()
            );
            Ok((stream, "tcp"))
        }
        Err(error) => {
            tracing::warn!(
                %peer,
                %error,
                "peer link stays on TCP: cannot reach the peer's {} address",
                upgrade.name()
            );
            Ok((stream, "tcp"))
        }
    }
}

async fn client_authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    auth: &PeerAuth,
) -> Result<String, HandshakeError> {
    let ours = our_hello(auth);
    write(stream, &handshake::encode_client_hello(&ours)).await?;
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(stream).await?;
    handshake::check_preamble(&preamble, handshake::message::SERVER_HELLO)?;
    let [status] = read_array::<1, _>(stream).await?;
    let status = handshake::parse_status(status)?;
    let theirs = read_hello(stream).await?;
    let mac = read_array::<MAC_LEN, _>(stream).await?;
    if status == Status::WrongModel || theirs.model_fingerprint != auth.model_fingerprint {
        return Err(HandshakeError::WrongModel {
            ours: auth.model_fingerprint,
            theirs: theirs.model_fingerprint,
        });
    }
    if status != Status::Ok {
        return Err(HandshakeError::Protocol(
            "server hello with an unexpected status".into(),
        ));
    }
    // The server proved itself with one of our secrets: we answer with the same one.
    let Some(shared) = auth
        .secrets()
        .find(|secret| handshake::verify_server_mac(secret, &ours, &theirs, &mac))
    else {
        // Tell the server why we hang up, so both sides report the same cause.
        let _ = write(
            stream,
            &handshake::encode_client_proof(Status::AuthFailed, &[0; MAC_LEN]),
        )
        .await;
        return Err(HandshakeError::WrongSecret);
    };
    let proof = handshake::client_mac(shared, &ours, &theirs);
    write(stream, &handshake::encode_client_proof(Status::Ok, &proof)).await?;
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(stream).await?;
    handshake::check_preamble(&preamble, handshake::message::VERDICT)?;
    let [verdict] = read_array::<1, _>(stream).await?;
    match handshake::parse_status(verdict)? {
        Status::Ok => Ok(theirs.node_id),
        Status::AuthFailed => Err(HandshakeError::RefusedByPeer),
        Status::WrongModel => Err(HandshakeError::Protocol(
            "verdict with an unexpected status".into(),
        )),
    }
}

async fn server_authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    auth: &PeerAuth,
) -> Result<String, HandshakeError> {
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(stream).await?;
    handshake::check_preamble(&preamble, handshake::message::CLIENT_HELLO)?;
    let theirs = read_hello(stream).await?;
    let ours = our_hello(auth);
    if theirs.model_fingerprint != auth.model_fingerprint {
        let refusal = handshake::ServerHello {
            status: Status::WrongModel,
            hello: ours,
            mac: [0; MAC_LEN],
        };
        let _ = write(stream, &handshake::encode_server_hello(&refusal)).await;
        return Err(HandshakeError::WrongModel {
            ours: auth.model_fingerprint,
            theirs: theirs.model_fingerprint,
        });
    }
    let mac = handshake::server_mac(&auth.secret, &theirs, &ours);
    let answer = handshake::ServerHello {
        status: Status::Ok,
        hello: ours.clone(),
        mac,
    };
    write(stream, &handshake::encode_server_hello(&answer)).await?;
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(stream).await?;
    handshake::check_preamble(&preamble, handshake::message::CLIENT_PROOF)?;
    let [status] = read_array::<1, _>(stream).await?;
    let proof = read_array::<MAC_LEN, _>(stream).await?;
    match handshake::parse_status(status)? {
        Status::Ok => {}
        Status::AuthFailed => return Err(HandshakeError::RefusedByPeer),
        Status::WrongModel => {
            return Err(HandshakeError::Protocol(
                "client proof with an unexpected status".into(),
            ));
        }
    }
    if !auth
        .secrets()
        .any(|secret| handshake::verify_client_mac(secret, &theirs, &ours, &proof))
    {
        let _ = write(stream, &handshake::encode_verdict(Status::AuthFailed)).await;
        return Err(HandshakeError::WrongSecret);
    }
    write(stream, &handshake::encode_verdict(Status::Ok)).await?;
    Ok(theirs.node_id)
}

/// Bytes of the per-connection buffer rows pass through between the socket and their f32
/// values: small enough to stay in cache, large enough that a 1-row frame is one syscall.
const CHUNK_BYTES: usize = 256 << 10;

/// Reads one frame: the header, validated, then the payload. Rows are converted straight
/// from the stream's buffer (a UCX message, or a socket's read buffer) into the values, as
/// each part arrives, so a large frame is never held twice nor copied before it is
/// converted, or come decoded by the transport ([`DecodedRows`]). `Ok(None)` is a clean end
/// of stream between frames. Public for the wire fuzz target.
pub async fn read_frame<S: AsyncBufRead + DecodedRows + Unpin>(
    stream: &mut S,
    limits: &WireLimits,
    stats: &PeerStats,
) -> Result<Option<(FrameHeader, FrameBody)>, String> {
    let mut header_bytes = [0u8; HEADER_LEN];
    let mut filled = 0;
    while filled < HEADER_LEN {
        match stream.read(&mut header_bytes[filled..]).await {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => {
                stats.reject_frame(&WireError::Truncated {
                    needed: HEADER_LEN as u64,
                    got: filled as u64,
                });
                return Err("connection closed inside a frame header".into());
            }
            Ok(read) => filled += read,
            Err(error) => return Err(format!("read failed: {error}")),
        }
    }
    let header = wire::decode_header(&header_bytes, limits).map_err(|error| {
        stats.reject_frame(&error);
        format!("bad frame: {error}")
    })?;
    let body = if header.kind == FrameKind::Error {
        // At most 1 + 4 + MAX_ERROR_MESSAGE bytes (checked with the header).
        let mut payload = vec![0u8; header.payload_len as usize];
        read_payload(stream, &mut payload, &header, stats).await?;
        wire::decode_error(&payload).map(FrameBody::Error)
    } else {
        // Bounded by payload_len (checked with the header).
        let mut group_bytes = vec![0u8; header.group_count as usize * 8];
        read_payload(stream, &mut group_bytes, &header, stats).await?;
        match wire::decode_groups(&header, &group_bytes) {
            Ok((groups, values)) => 'rows: {
                if values > 0 {
                    let decoded = std::future::poll_fn(|context| {
                        Pin::new(&mut *stream).poll_decoded_rows(context, values, header.dtype)
                    })
                    .await;
                    match decoded {
                        Ok(Some(rows)) => break 'rows Ok(wire::rows_body(&header, groups, rows)),
                        Ok(None) => {}
                        Err(error) if error.kind() == std::io::ErrorKind::InvalidData => {
                            break 'rows Err(WireError::Malformed(error.to_string()));
                        }
                        Err(error) => return Err(format!("read failed: {error}")),
                    }
                }
                // Filled as the bytes arrive, never zeroed first.
                let mut rows = Vec::with_capacity(values);
                let size = header.dtype.size();
                while rows.len() < values {
                    let available = match stream.fill_buf().await {
                        Ok(available) => available,
                        Err(error) => return Err(format!("read failed: {error}")),
                    };
                    if available.is_empty() {
                        stats.reject_frame(&WireError::Truncated {
                            needed: u64::from(header.payload_len),
                            got: 0,
                        });
                        return Err("connection closed inside a frame payload".into());
                    }
                    let whole = (available.len() / size).min(values - rows.len());
                    if whole == 0 {
                        // A value split between two receives: its bytes gathered first.
                        let mut value = [0u8; 4];
                        read_payload(stream, &mut value[..size], &header, stats).await?;
                        wire::decode_values_append(&value[..size], header.dtype, &mut rows);
                    } else {
                        let bytes = &available[..whole * size];
                        wire::decode_values_append(bytes, header.dtype, &mut rows);
                        stream.consume(whole * size);
                    }
                }
                Ok(wire::rows_body(&header, groups, rows))
            }
            Err(error) => Err(error),
        }
    };
    let body = body.map_err(|error| {
        stats.reject_frame(&error);
        format!("bad frame: {error}")
    })?;
    stats.add_received(HEADER_LEN + header.payload_len as usize);
    Ok(Some((header, body)))
}

/// Fills `bytes` from the payload of the frame `header` starts.
async fn read_payload<S: AsyncRead + Unpin>(
    stream: &mut S,
    bytes: &mut [u8],
    header: &FrameHeader,
    stats: &PeerStats,
) -> Result<(), String> {
    match stream.read_exact(bytes).await {
        Ok(_) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
            stats.reject_frame(&WireError::Truncated {
                needed: u64::from(header.payload_len),
                got: 0,
            });
            Err("connection closed inside a frame payload".into())
        }
        Err(error) => Err(format!("read failed: {error}")),
    }
}

/// Writes a frame, its rows converted into `scratch` a chunk at a time: a frame that fits
/// the buffer goes out in one write.
async fn write_rows_frame<S: AsyncWrite + Unpin>(
    stream: &mut S,
    frame: &RowsFrame,
    scratch: &mut [u8],
) -> std::io::Result<()> {
    let mut filled = 0;
    if frame.prefix.len() <= scratch.len() / 2 {
        scratch[..frame.prefix.len()].copy_from_slice(&frame.prefix);
        filled = frame.prefix.len();
    } else {
        stream.write_all(&frame.prefix).await?;
    }
    let mut first = 0;
    loop {
        let written = frame.write_values(first, &mut scratch[filled..]);
        first += written;
        filled += written * frame.dtype.size();
        if filled > 0 {
            stream.write_all(&scratch[..filled]).await?;
        }
        filled = 0;
        if first >= frame.rows.len() {
            return Ok(());
        }
    }
}

// ---------------------------------------------------------------------------------------
// Client

/// A request on its way to the driver.
enum Outgoing {
    /// Checked and its header encoded on the caller's thread; large f32 frames' rows are
    /// converted as they are written, other frames come encoded (see `PeerClient::send`).
    Fresh {
        request_id: u64,
        frame: Result<RowsFrame, Vec<u8>>,
        expect: Expect,
        done: Completion,
    },
    /// The rest of a frame the caller began writing on connection `generation` (its
    /// completion is already pending).
    Remainder {
        bytes: Vec<u8>,
        written: usize,
        generation: u64,
    },
}

impl Outgoing {
    /// Answers a request that will not be sent (a remainder's request is failed with the
    /// rest of its connection's).
    fn fail(self, error: &PeerError) {
        if let Outgoing::Fresh { done, .. } = self {
            done(Err(error.clone()));
        }
    }
}

/// What the reply to a request must look like.
struct Expect {
    width: u32,
    groups: Vec<(u32, u32)>,
}

struct Pending {
    expect: Expect,
    done: Completion,
}

type PendingMap = Arc<Mutex<HashMap<u64, Pending>>>;

fn fail_all(pending: &PendingMap, error: &PeerError) {
    let taken = std::mem::take(&mut *lock(pending));
    for (_, entry) in taken {
        (entry.done)(Err(error.clone()));
    }
}

struct ClientShared {
    next_request_id: AtomicU64,
    close: Notify,
    link: Mutex<WriterSlot>,
    pending: PendingMap,
    stats: Arc<PeerStats>,
}

impl ClientShared {
    /// The driver is done with one queued item.
    fn dequeued(&self) {
        let mut link = lock(&self.link);
        link.queued = link.queued.saturating_sub(1);
    }
}

/// The client side toward ONE remote node: connects lazily, reconnects (after a short
/// backoff) after a failure, multiplexes requests by request id on one connection.
pub struct PeerClient {
    addr: SocketAddr,
    limits: WireLimits,
    shared: Arc<ClientShared>,
    queue: mpsc::Sender<Outgoing>,
}

impl PeerClient {
    /// A client toward the node listening on `addr`, with the default [`PeerConfig`].
    pub fn new(
        transport: Arc<dyn Transport>,
        runtime: Handle,
        addr: SocketAddr,
        auth: Arc<PeerAuth>,
        stats: Arc<PeerStats>,
    ) -> Self {
        PeerClient::with_config(transport, runtime, addr, auth, stats, PeerConfig::default())
    }

    /// A client with explicit tunables.
    pub fn with_config(
        transport: Arc<dyn Transport>,
        runtime: Handle,
        addr: SocketAddr,
        auth: Arc<PeerAuth>,
        stats: Arc<PeerStats>,
        config: PeerConfig,
    ) -> Self {
        let limits = config.limits;
        let (queue, receiver) = mpsc::channel(config.queue_capacity.max(1));
        let pending: PendingMap = Arc::new(Mutex::new(HashMap::new()));
        let shared = Arc::new(ClientShared {
            next_request_id: AtomicU64::new(1),
            close: Notify::new(),
            link: Mutex::new(WriterSlot {
                stream: None,
                queued: 0,
                generation: 0,
            }),
            pending: pending.clone(),
            stats: stats.clone(),
        });
        let driver = Driver {
            transport,
            addr,
            auth,
            stats,
            config,
            shared: shared.clone(),
            queue: receiver,
            pending,
        };
        runtime.spawn(driver.run());
        PeerClient {
            addr,
            limits,
            shared,
            queue,
        }
    }

    /// The remote node's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether a connection is up now (after its handshake): a request sent while not waits
    /// for the connect and handshake first.
    pub fn is_linked(&self) -> bool {
        lock(&self.shared.link).stream.is_some()
    }

    /// Non-blocking: checks the request on the calling thread and queues it. A full queue
    /// answers `Err(PeerError::Overloaded)` at once. On `Err`, `done` is dropped uncalled
    /// (the error is the answer); on `Ok`, `done` is called exactly once. Callable from any
    /// thread, including threads that are not runtime threads.
    pub fn send(&self, request: ExpertRequest, done: Completion) -> Result<(), PeerError> {
        let request_id = self.shared.next_request_id.fetch_add(1, Ordering::Relaxed);
        let expect = Expect {
            width: request.width,
            groups: request.groups.clone(),
        };
        let frame = wire::request_frame(request_id, request).map_err(PeerError::BadRequest)?;
        // The peer would drop the whole connection over a frame past the limits (both nodes
        // are expected to run the same limits), so refuse it here, alone.
        wire::decode_header(&frame.prefix, &self.limits).map_err(PeerError::BadRequest)?;
        let permit = self.queue.try_reserve().map_err(|error| match error {
            mpsc::error::TrySendError::Full(()) => PeerError::Overloaded,
            mpsc::error::TrySendError::Closed(()) => PeerError::Closed,
        })?;
        let shared = &self.shared;
        // Large rows go as they are where the link's transport takes them (UCX), from this
        // thread when the link is up and idle.
        let frame = if frame.rows_len() > ROWS_APART_MIN {
            let mut link = lock(&shared.link);
            let idle = link.queued == 0;
            match link.stream.as_mut() {
                Some(stream) if idle => {
                    // Held while the frame goes, so its reply finds it.
                    let mut pending = lock(&shared.pending);
                    let len = frame.len();
                    match stream.send_rows(frame) {
                        Ok(()) => {
                            pending.insert(request_id, Pending { expect, done });
                            shared.stats.add_sent(len);
                            return Ok(());
                        }
                        Err(frame) => frame,
                    }
                }
                _ => frame,
            }
        } else {
            frame
        };
        // Small frames, and bf16 ones whole, are encoded here, on the caller's thread (it has
        // the time; the runtime's workers carry every connection); large f32 ones as the
        // driver writes them (their conversion is a plain copy).
        let frame = if frame.len() <= CHUNK_BYTES || frame.dtype == Dtype::Bf16 {
            Err(frame.to_bytes())
        } else {
            Ok(frame)
        };
        let mut link = lock(&shared.link);
        let frame = match frame {
            // The link is up and idle: sent from this thread, sparing the hand-off to the
            // driver task (most of a small request's round trip).
            Err(bytes) if link.queued == 0 && link.stream.is_some() => {
                lock(&shared.pending).insert(request_id, Pending { expect, done });
                let (bytes, written) = match send_now(&mut link, bytes) {
                    SentNow::All(len) => {
                        shared.stats.add_sent(len);
                        return Ok(());
                    }
                    SentNow::Part { bytes, written } => (bytes, written),
                    // The socket is full, or failed: the driver writes the rest, or finds out.
                    SentNow::Failed(bytes) => (bytes, 0),
                };
                link.queued += 1;
                let generation = link.generation;
                permit.send(Outgoing::Remainder {
                    bytes,
                    written,
                    generation,
                });
                return Ok(());
            }
            frame => frame,
        };
        link.queued += 1;
        permit.send(Outgoing::Fresh {
            request_id,
            frame,
            expect,
            done,
        });
        Ok(())
    }

    /// The remote node is known gone (gossip said dead): every outstanding and queued
    /// completion fails with `LinkDown` now and the connection is dropped. A later `send`
    /// connects again.
    pub fn close(&self) {
        self.shared.close.notify_one();
    }
}

/// How a connection ended.
enum LinkEnd {
    Lost(String),
    ClosedByCaller,
    ClientDropped,
}

/// The task behind a [`PeerClient`]: owns the queue's receiving end and the connection.
struct Driver {
    transport: Arc<dyn Transport>,
    addr: SocketAddr,
    auth: Arc<PeerAuth>,
    stats: Arc<PeerStats>,
    config: PeerConfig,
    shared: Arc<ClientShared>,
    queue: mpsc::Receiver<Outgoing>,
    pending: PendingMap,
}

impl Drop for Driver {
    /// The task is gone (client dropped, or runtime shut down): nothing may stay uncalled.
    fn drop(&mut self) {
        fail_all(&self.pending, &PeerError::Closed);
        self.queue.close();
        lock(&self.shared.link).stream = None;
        while let Ok(outgoing) = self.queue.try_recv() {
            self.shared.dequeued();
            outgoing.fail(&PeerError::Closed);
        }
    }
}

impl Driver {
    async fn run(mut self) {
        let mut backoff = self.config.backoff_min;
        loop {
            let first = tokio::select! {
                item = self.queue.recv() => match item {
                    Some(item @ Outgoing::Fresh { .. }) => item,
                    // Its connection is gone, and its request failed with it.
                    Some(Outgoing::Remainder { .. }) => {
                        self.shared.dequeued();
                        continue;
                    }
                    None => return,
                },
                // A close while idle has nothing to fail.
                () = self.shared.close.notified() => continue,
            };
            let connected = tokio::select! {
                result = self.connect() => result,
                () = self.shared.close.notified() => {
                    Err(PeerError::LinkDown("closed while connecting".into()))
                }
            };
            let error = match connected {
                Ok(stream) => {
                    backoff = self.config.backoff_min;
                    let end = self.run_connection(stream, first).await;
                    let error = match end {
                        LinkEnd::Lost(reason) => {
                            tracing::debug!(peer = %self.addr, %reason, "peer link lost");
                            PeerError::LinkDown(reason)
                        }
                        LinkEnd::ClosedByCaller => {
                            PeerError::LinkDown("closed: the peer was declared gone".into())
                        }
                        LinkEnd::ClientDropped => return,
                    };
                    fail_all(&self.pending, &error);
                    error
                }
                Err(error) => {
                    tracing::debug!(peer = %self.addr, %error, "peer connect failed");
                    self.shared.dequeued();
                    first.fail(&error);
                    let wait = backoff;
                    backoff = (backoff * 2).min(self.config.backoff_max);
                    self.fail_queued(&error);
                    if !self.fail_for(wait, &error).await {
                        return;
                    }
                    continue;
                }
            };
            self.fail_queued(&error);
            if !self.fail_for(self.config.backoff_min, &error).await {
                return;
            }
        }
    }

    async fn connect(&self) -> Result<Box<dyn PeerStream>, PeerError> {
        let mut stream = self
            .transport
            .connect(self.addr)
            .await
            .map_err(|error| PeerError::Connect(format!("{}: {error}", self.addr)))?;
        let timeout = self.config.handshake_timeout;
        let handshake = async {
            let server_id = client_authenticate(&mut stream, &self.auth).await?;
            let (stream, path) = negotiate_link(stream, &*self.transport, self.addr).await?;
            Ok((server_id, stream, path))
        };
        let result = tokio::time::timeout(timeout, handshake)
            .await
            .unwrap_or(Err(HandshakeError::Timeout(timeout)));
        match result {
            Ok((server_id, stream, path)) => {
                tracing::info!(peer = %self.addr, %server_id, path, "peer link up");
                Ok(stream)
            }
            Err(error) => {
                self.stats.handshake_failed(&error);
                tracing::warn!(peer = %self.addr, %error, "peer handshake failed");
                Err(PeerError::Handshake(error))
            }
        }
    }

    /// Fails everything already queued.
    fn fail_queued(&mut self, error: &PeerError) {
        while let Ok(outgoing) = self.queue.try_recv() {
            self.shared.dequeued();
            outgoing.fail(error);
        }
    }

    /// Fails every request that arrives during `wait`; false when the client is gone.
    async fn fail_for(&mut self, wait: Duration, error: &PeerError) -> bool {
        let until = tokio::time::Instant::now() + wait;
        loop {
            tokio::select! {
                item = self.queue.recv() => match item {
                    Some(outgoing) => {
                        self.shared.dequeued();
                        outgoing.fail(error);
                    }
                    None => return false,
                },
                () = tokio::time::sleep_until(until) => return true,
            }
        }
    }

    async fn run_connection(&mut self, stream: Box<dyn PeerStream>, first: Outgoing) -> LinkEnd {
        let (read_half, write_half) = stream.into_halves();
        let generation = {
            let mut link = lock(&self.shared.link);
            link.stream = Some(write_half);
            link.generation += 1;
            link.generation
        };
        let mut reader = tokio::spawn(read_replies(
            read_half,
            self.pending.clone(),
            self.stats.clone(),
            self.config.limits,
        ));
        let mut next = Some(first);
        let mut scratch = vec![0u8; CHUNK_BYTES];
        let shared = self.shared.clone();
        let end = loop {
            let outgoing = match next.take() {
                Some(outgoing) => outgoing,
                None => tokio::select! {
                    reason = &mut reader => {
                        break LinkEnd::Lost(reason.unwrap_or_else(|error| format!("reader stopped: {error}")));
                    }
                    () = self.shared.close.notified() => break LinkEnd::ClosedByCaller,
                    item = self.queue.recv() => match item {
                        Some(outgoing) => outgoing,
                        None => break LinkEnd::ClientDropped,
                    },
                },
            };
            let mut stream = LockedWriter(&shared.link);
            let (written, len) = match outgoing {
                Outgoing::Fresh {
                    request_id,
                    frame,
                    expect,
                    done,
                } => {
                    lock(&self.pending).insert(request_id, Pending { expect, done });
                    let write = async {
                        match &frame {
                            Ok(rows) => {
                                let written = write_rows_frame(&mut stream, rows, &mut scratch);
                                (written.await, rows.len())
                            }
                            Err(bytes) => (stream.write_all(bytes).await, bytes.len()),
                        }
                    };
                    tokio::select! {
                        written = write => written,
                        reason = &mut reader => {
                            self.shared.dequeued();
                            break LinkEnd::Lost(reason.unwrap_or_else(|error| format!("reader stopped: {error}")));
                        }
                        () = self.shared.close.notified() => {
                            self.shared.dequeued();
                            break LinkEnd::ClosedByCaller;
                        }
                    }
                }
                Outgoing::Remainder {
                    bytes,
                    written,
                    generation: of,
                } => {
                    if of != generation {
                        self.shared.dequeued();
                        continue;
                    }
                    let write = stream.write_all(&bytes[written..]);
                    tokio::select! {
                        written = write => (written, bytes.len()),
                        reason = &mut reader => {
                            self.shared.dequeued();
                            break LinkEnd::Lost(reason.unwrap_or_else(|error| format!("reader stopped: {error}")));
                        }
                        () = self.shared.close.notified() => {
                            self.shared.dequeued();
                            break LinkEnd::ClosedByCaller;
                        }
                    }
                }
            };
            self.shared.dequeued();
            match written {
                Ok(()) => self.stats.add_sent(len),
                Err(error) => break LinkEnd::Lost(format!("write failed: {error}")),
            }
        };
        reader.abort();
        // Before the pending requests are failed, so none written directly is missed.
        lock(&self.shared.link).stream = None;
        end
    }
}

/// Reads replies until the connection fails; returns why it ended.
async fn read_replies(
    mut stream: Box<dyn FrameRead>,
    pending: PendingMap,
    stats: Arc<PeerStats>,
    limits: WireLimits,
) -> String {
    loop {
        let (header, body) = match read_frame(&mut stream, &limits, &stats).await {
            Ok(Some(frame)) => frame,
            Ok(None) => return "the peer closed the connection".into(),
            Err(reason) => return reason,
        };
        if header.kind == FrameKind::Request {
            stats.reject_frame(&WireError::Malformed("request from a server".into()));
            return "the peer sent a request on a client connection".into();
        }
        let Some(entry) = lock(&pending).remove(&header.request_id) else {
            // Not ours (never sent, or already failed by close): drop it, keep the link.
            tracing::debug!(
                request_id = header.request_id,
                "reply to no outstanding request"
            );
            continue;
        };
        let result = match body {
            FrameBody::Reply(reply) => {
                if header.width == entry.expect.width && reply.groups == entry.expect.groups {
                    Ok(reply)
                } else {
                    Err(PeerError::Remote(RemoteError::Malformed(
                        "the reply's groups or width do not match the request".into(),
                    )))
                }
            }
            FrameBody::Error(error) => Err(PeerError::Remote(error)),
            FrameBody::Request(_) => Err(PeerError::LinkDown("protocol violation".into())),
        };
        (entry.done)(result);
    }
}

// ---------------------------------------------------------------------------------------
// Server

struct ServerContext {
    /// Offers each authenticated connection its faster path, if it has one.
    transport: Arc<dyn Transport>,
    auth: Arc<PeerAuth>,
    stats: Arc<PeerStats>,
    handler: Handler,
    config: PeerConfig,
    warnings: WarnLimiter,
}

impl ServerContext {
    fn warn(&self, peer: SocketAddr, what: &str, reason: &dyn std::fmt::Display) {
        if self.warnings.allow(peer.ip(), Instant::now()) {
            tracing::warn!(%peer, %reason, "{what} (further warnings about this address are muted for a minute)");
        }
    }
}

/// The server side: accepts connections, authenticates them, runs each request through the
/// handler on a blocking thread and writes replies back on the same connection (in any
/// order, matched by request id). Stops on drop or [`PeerServer::stop`].
pub struct PeerServer {
    local_addr: SocketAddr,
    /// Dropping the sender tells the accept loop and every connection to stop.
    _shutdown: watch::Sender<()>,
}

impl PeerServer {
    /// Binds `addr` and serves. Blocks the calling thread until bound: from async code on a
    /// current-thread runtime use [`PeerServer::start_async`].
    pub fn start(
        transport: Arc<dyn Transport>,
        addr: SocketAddr,
        auth: Arc<PeerAuth>,
        stats: Arc<PeerStats>,
        handler: Handler,
        runtime: Handle,
    ) -> std::io::Result<PeerServer> {
        PeerServer::start_with_config(
            transport,
            addr,
            auth,
            stats,
            handler,
            runtime,
            PeerConfig::default(),
        )
    }

    /// [`PeerServer::start`] with explicit tunables.
    pub fn start_with_config(
        transport: Arc<dyn Transport>,
        addr: SocketAddr,
        auth: Arc<PeerAuth>,
        stats: Arc<PeerStats>,
        handler: Handler,
        runtime: Handle,
        config: PeerConfig,
    ) -> std::io::Result<PeerServer> {
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let binding = transport.clone();
        runtime.spawn(async move {
            let _ = bound_tx.send(binding.bind(addr).await);
        });
        let receive = || {
            bound_rx.recv().map_err(|_| {
                std::io::Error::other("the runtime stopped before the peer server was bound")
            })
        };
        let listener = match Handle::try_current() {
            Err(_) => receive()??,
            Ok(current) => match current.runtime_flavor() {
                tokio::runtime::RuntimeFlavor::MultiThread => {
                    tokio::task::block_in_place(receive)??
                }
                _ => {
                    return Err(std::io::Error::other(
                        "PeerServer::start would block a current-thread runtime: use start_async",
                    ));
                }
            },
        };
        Ok(PeerServer::serve(
            transport, listener, auth, stats, handler, &runtime, config,
        ))
    }

    /// Binds `addr` and serves, from async code.
    pub async fn start_async(
        transport: Arc<dyn Transport>,
        addr: SocketAddr,
        auth: Arc<PeerAuth>,
        stats: Arc<PeerStats>,
        handler: Handler,
        config: PeerConfig,
    ) -> std::io::Result<PeerServer> {
        let listener = transport.bind(addr).await?;
        Ok(PeerServer::serve(
            transport,
            listener,
            auth,
            stats,
            handler,
            &Handle::current(),
            config,
        ))
    }

    fn serve(
        transport: Arc<dyn Transport>,
        listener: Box<dyn PeerListener>,
        auth: Arc<PeerAuth>,
        stats: Arc<PeerStats>,
        handler: Handler,
        runtime: &Handle,
        config: PeerConfig,
    ) -> PeerServer {
        let local_addr = listener.local_addr();
        let (shutdown, stopped) = watch::channel(());
        let context = Arc::new(ServerContext {
            transport,
            auth,
            stats,
            handler,
            config,
            warnings: WarnLimiter::new(Duration::from_secs(60)),
        });
        runtime.spawn(accept_loop(listener, context, stopped));
        PeerServer {
            local_addr,
            _shutdown: shutdown,
        }
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting and drops every connection (outstanding requests fail on the
    /// clients with `LinkDown`).
    pub fn stop(self) {}
}

async fn accept_loop(
    mut listener: Box<dyn PeerListener>,
    context: Arc<ServerContext>,
    mut stopped: watch::Receiver<()>,
) {
    loop {
        tokio::select! {
            _ = stopped.changed() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    tokio::spawn(serve_connection(stream, peer, context.clone(), stopped.clone()));
                }
                Err(error) => {
                    tracing::warn!(%error, "peer listener accept failed");
                    if error.kind() == std::io::ErrorKind::NotConnected {
                        return;
                    }
                    // Out of descriptors and the like: do not spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

async fn serve_connection(
    mut stream: Box<dyn PeerStream>,
    peer: SocketAddr,
    context: Arc<ServerContext>,
    mut stopped: watch::Receiver<()>,
) {
    let timeout = context.config.handshake_timeout;
    let handshake = async {
        let client_id = server_authenticate(&mut stream, &context.auth).await?;
        let (stream, path) = negotiate_link(stream, &*context.transport, peer).await?;
        Ok((client_id, stream, path))
    };
    let handshake = tokio::select! {
        result = tokio::time::timeout(timeout, handshake) => {
            result.unwrap_or(Err(HandshakeError::Timeout(timeout)))
        }
        _ = stopped.changed() => return,
    };
    let (client_id, stream, path) = match handshake {
        Ok(accepted) => accepted,
        Err(error) => {
            context.stats.handshake_failed(&error);
            context.warn(peer, "peer handshake refused", &error);
            return;
        }
    };
    tracing::debug!(%peer, %client_id, path, "peer connection accepted");
    let (read_half, write_half) = stream.into_halves();
    let (outbox, queued) = mpsc::unbounded_channel();
    let link = Arc::new(ReplyLink {
        state: Mutex::new(WriterSlot {
            stream: Some(write_half),
            queued: 0,
            generation: 0,
        }),
        outbox,
        stats: context.stats.clone(),
    });
    let writer = tokio::spawn(write_replies(link.clone(), queued));
    let ended = tokio::select! {
        ended = serve_requests(read_half, &link, &context) => ended,
        _ = stopped.changed() => Ok(()),
    };
    writer.abort();
    // Handlers still running hold the link: they must not keep the connection open.
    lock(&link.state).stream = None;
    if let Err(reason) = ended {
        context.warn(peer, "peer connection dropped", &reason);
    }
}

/// Reads requests and hands each to the handler; `Err` when the peer misbehaved.
async fn serve_requests(
    mut stream: Box<dyn FrameRead>,
    link: &Arc<ReplyLink>,
    context: &Arc<ServerContext>,
) -> Result<(), String> {
    let inflight = Arc::new(AtomicUsize::new(0));
    loop {
        let limits = &context.config.limits;
        let (header, body) = match read_frame(&mut stream, limits, &context.stats).await? {
            Some(frame) => frame,
            None => return Ok(()),
        };
        let FrameBody::Request(request) = body else {
            context
                .stats
                .reject_frame(&WireError::Malformed("reply sent to a server".into()));
            return Err("a client sent a reply or error frame".into());
        };
        let request_id = header.request_id;
        // The counter bounds the frames waiting in the link's unbounded outbox.
        if inflight.load(Ordering::Acquire) >= context.config.max_inflight_per_connection {
            link.send(OutFrame::Bytes(wire::encode_error(
                request_id,
                &RemoteError::Overloaded,
            )));
            continue;
        }
        inflight.fetch_add(1, Ordering::AcqRel);
        let handler = context.handler.clone();
        let link = link.clone();
        let inflight = inflight.clone();
        tokio::task::spawn_blocking(move || {
            link.send(run_handler(&handler, request_id, request));
            inflight.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

/// Runs the handler and frames its answer; a panic or a reply that does not fit the
/// request becomes an error frame, so the client always hears back.
fn run_handler(handler: &Handler, request_id: u64, request: ExpertRequest) -> OutFrame {
    let (layer, placement_version, width, dtype) = (
        request.layer,
        request.placement_version,
        request.width,
        request.dtype,
    );
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(request)));
    let error = match outcome {
        Ok(Ok(reply)) => {
            match wire::reply_frame(request_id, layer, placement_version, width, dtype, reply) {
                Ok(frame) => return OutFrame::Rows(frame),
                Err(error) => RemoteError::DeviceFailed(format!(
                    "the expert output does not fit the request: {error}"
                )),
            }
        }
        Ok(Err(error)) => error,
        Err(_) => RemoteError::DeviceFailed("the expert handler panicked".into()),
    };
    OutFrame::Bytes(wire::encode_error(request_id, &error))
}

/// A frame for the client: encoded bytes (the first `written` already sent), or a reply
/// whose rows are converted as they are written.
enum OutFrame {
    Bytes(Vec<u8>),
    Partial { bytes: Vec<u8>, written: usize },
    Rows(RowsFrame),
}

/// The sending side of a server connection. A reply is written straight from the thread
/// that produced it when nothing is queued ahead of it and the socket takes it whole (no
/// hand-off to the writer task, the common case for small replies); otherwise it goes
/// through the outbox to the writer task, in order.
struct ReplyLink {
    state: Mutex<WriterSlot>,
    outbox: mpsc::UnboundedSender<OutFrame>,
    stats: Arc<PeerStats>,
}

/// The write half of a connection, shared by the task that writes queued frames and the
/// threads that write directly when nothing is queued.
struct WriterSlot {
    /// `None` while there is no connection (or once it is over).
    stream: Option<Box<dyn FrameWrite>>,
    /// Frames handed to the writing task and not yet written (or failed): while any is,
    /// nothing is written directly, so frames never interleave.
    queued: usize,
    /// Counts connections, so a frame's remainder never goes to a later connection.
    generation: u64,
}

/// What [`send_now`] did with a frame.
enum SentNow {
    /// Sent whole (this many bytes), or handed over whole to a stream that sends from it.
    All(usize),
    /// The first `written` bytes went out; the rest wait for room.
    Part { bytes: Vec<u8>, written: usize },
    /// The stream failed, or there is none.
    Failed(Vec<u8>),
}

/// Sends a whole encoded frame from the calling thread without waiting: handed to a stream
/// that sends from the buffer itself (UCX), else written as far as the stream takes it now
/// (see [`write_now`]).
fn send_now(slot: &mut WriterSlot, bytes: Vec<u8>) -> SentNow {
    let Some(stream) = slot.stream.as_mut() else {
        return SentNow::Failed(bytes);
    };
    let len = bytes.len();
    let bytes = match stream.send_owned(bytes) {
        Ok(()) => return SentNow::All(len),
        Err(bytes) => bytes,
    };
    match write_now(slot, &bytes) {
        Some(written) if written == len => SentNow::All(len),
        Some(written) => SentNow::Part { bytes, written },
        None => SentNow::Failed(bytes),
    }
}

/// Writes `bytes` now if the socket takes them, polling with a no-op waker: when it does not,
/// the caller queues the remainder for the writing task, which polls again with its own
/// waker before anything waits on it. Returns how many bytes went out; `None` when the
/// stream failed or there is none.
fn write_now(slot: &mut WriterSlot, bytes: &[u8]) -> Option<usize> {
    let stream = slot.stream.as_mut()?;
    let mut context = Context::from_waker(Waker::noop());
    let mut written = 0;
    while written < bytes.len() {
        match Pin::new(&mut *stream).poll_write(&mut context, &bytes[written..]) {
            Poll::Ready(Ok(sent)) if sent > 0 => written += sent,
            Poll::Ready(_) => return None,
            Poll::Pending => break,
        }
    }
    Some(written)
}

impl ReplyLink {
    fn send(&self, frame: OutFrame) {
        // Large rows go as they are where the link's transport takes them (UCX), when
        // nothing is queued ahead.
        let frame = match frame {
            OutFrame::Rows(rows) if rows.rows_len() > ROWS_APART_MIN => {
                let mut state = lock(&self.state);
                let idle = state.queued == 0;
                match state.stream.as_mut() {
                    Some(stream) if idle => {
                        let len = rows.len();
                        match stream.send_rows(rows) {
                            Ok(()) => {
                                self.stats.add_sent(len);
                                return;
                            }
                            Err(rows) => OutFrame::Rows(rows),
                        }
                    }
                    _ => OutFrame::Rows(rows),
                }
            }
            other => other,
        };
        let frame = match frame {
            // bf16 is converted here, on the handler's thread, rather than on a runtime
            // worker by the writer task (f32 conversion is a plain copy either way).
            OutFrame::Rows(rows) if rows.len() <= CHUNK_BYTES || rows.dtype == Dtype::Bf16 => {
                OutFrame::Bytes(rows.to_bytes())
            }
            other => other,
        };
        let mut state = lock(&self.state);
        let frame = match frame {
            OutFrame::Bytes(bytes) if state.queued == 0 => match send_now(&mut state, bytes) {
                SentNow::All(len) => {
                    self.stats.add_sent(len);
                    return;
                }
                SentNow::Part { bytes, written } => OutFrame::Partial { bytes, written },
                SentNow::Failed(_) => {
                    // Broken (the reader sees it too and ends the connection), or over.
                    state.stream = None;
                    return;
                }
            },
            other => other,
        };
        state.queued += 1;
        // Sent under the lock, so frames keep their order.
        let _ = self.outbox.send(frame);
    }
}

/// The write half behind the link's lock, held only while one poll runs.
struct LockedWriter<'a>(&'a Mutex<WriterSlot>);

impl AsyncWrite for LockedWriter<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match lock(self.0).stream.as_mut() {
            Some(stream) => Pin::new(stream).poll_write(context, bytes),
            None => Poll::Ready(Err(std::io::ErrorKind::NotConnected.into())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match lock(self.0).stream.as_mut() {
            Some(stream) => Pin::new(stream).poll_flush(context),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match lock(self.0).stream.as_mut() {
            Some(stream) => Pin::new(stream).poll_shutdown(context),
            None => Poll::Ready(Ok(())),
        }
    }
}

async fn write_replies(link: Arc<ReplyLink>, mut queued: mpsc::UnboundedReceiver<OutFrame>) {
    let mut scratch = vec![0u8; CHUNK_BYTES];
    let mut stream = LockedWriter(&link.state);
    while let Some(frame) = queued.recv().await {
        let (written, len) = match &frame {
            OutFrame::Bytes(bytes) => (stream.write_all(bytes).await, bytes.len()),
            OutFrame::Partial { bytes, written } => {
                (stream.write_all(&bytes[*written..]).await, bytes.len())
            }
            OutFrame::Rows(rows) => (
                write_rows_frame(&mut stream, rows, &mut scratch).await,
                rows.len(),
            ),
        };
        lock(&link.state).queued -= 1;
        if written.is_err() {
            return;
        }
        link.stats.add_sent(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warn_limiter_allows_once_per_address_per_interval() {
        let limiter = WarnLimiter::new(Duration::from_secs(60));
        let now = Instant::now();
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        assert!(limiter.allow(a, now));
        assert!(!limiter.allow(a, now + Duration::from_secs(59)));
        assert!(limiter.allow(b, now));
        assert!(limiter.allow(a, now + Duration::from_secs(61)));
    }

    /// Frames read as the stream delivers them, whatever the size of its reads (values split
    /// between two reads among them), are the frames encoded; a frame cut short is refused.
    #[test]
    fn frames_read_in_pieces_of_any_size_are_the_frames_sent() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        for dtype in [Dtype::Bf16, Dtype::F32] {
            let request = ExpertRequest {
                layer: 3,
                placement_version: 7,
                width: 5,
                dtype,
                groups: vec![(1, 2), (4, 1)],
                rows: (0..15).map(|i| i as f32 * 0.75 - 4.0).collect(),
            };
            let mut bytes = wire::encode_request(11, &request).expect("encode");
            let reply = ExpertReply {
                groups: vec![(4, 1)],
                rows: vec![2.5; 5],
            };
            let reply = wire::reply_frame(12, 3, 7, 5, dtype, reply).expect("reply");
            bytes.extend(reply.to_bytes());
            let stats = PeerStats::default();
            for read_size in [1, 2, 3, 7, 64, 4096] {
                let mut stream = tokio::io::BufReader::with_capacity(read_size, &bytes[..]);
                let limits = WireLimits::default();
                let read = |stream: &mut tokio::io::BufReader<&[u8]>| {
                    runtime.block_on(read_frame(stream, &limits, &stats))
                };
                let Ok(Some((header, FrameBody::Request(got)))) = read(&mut stream) else {
                    panic!("{dtype:?} in reads of {read_size}: no request");
                };
                // The rows are exact in bf16.
                assert_eq!((header.request_id, &got), (11, &request));
                let Ok(Some((header, FrameBody::Reply(got)))) = read(&mut stream) else {
                    panic!("{dtype:?} in reads of {read_size}: no reply");
                };
                assert_eq!((header.request_id, got.rows), (12, vec![2.5; 5]));
                assert!(matches!(read(&mut stream), Ok(None)), "then the clean end");
                let cut = &bytes[..bytes.len() - 3];
                let mut stream = tokio::io::BufReader::with_capacity(read_size, cut);
                assert!(read(&mut stream).is_ok());
                assert!(read(&mut stream).is_err(), "a frame cut short is refused");
            }
        }
    }

    #[test]
    fn stats_count_rejections_by_reason() {
        let stats = PeerStats::default();
        stats.reject_frame(&WireError::BadMagic(*b"GET "));
        stats.reject_frame(&WireError::TooLarge { len: 1, max: 0 });
        stats.handshake_failed(&HandshakeError::WrongSecret);
        stats.handshake_failed(&HandshakeError::Timeout(Duration::ZERO));
        let counters = &stats.frames_rejected;
        assert_eq!(counters.bad_magic.load(Ordering::Relaxed), 1);
        assert_eq!(counters.too_large.load(Ordering::Relaxed), 1);
        assert_eq!(counters.auth_failed.load(Ordering::Relaxed), 1);
        assert_eq!(stats.handshakes_failed.load(Ordering::Relaxed), 2);
    }
}
