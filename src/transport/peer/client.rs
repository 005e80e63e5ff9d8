//! [`PeerClient`]: the side toward one remote node. Requests are checked and encoded on the
//! caller's thread and sent from it when the link is up and idle; otherwise a driver task
//! connects (handshake and link negotiation), writes what is queued, and a reader task
//! matches replies to requests by id. A lost link fails every outstanding request at once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::runtime::Handle;
use tokio::sync::{Notify, mpsc};

use super::frames::{
    CHUNK_BYTES, LockedWriter, SentNow, WriterSlot, frame_begins, read_body, read_header, send_now,
    within, write_rows_frame,
};
use super::link::{client_authenticate, negotiate_link};
use super::seal::{Side, sealed_halves};
use super::{Completion, PeerAuth, PeerConfig, PeerError, PeerStats, lock, secret_removed};
use crate::transport::handshake::{HandshakeError, LinkKeys};
use crate::transport::wire::{
    self, Dtype, ExpertRequest, FrameBody, FrameKind, RemoteError, RequestHead, Rows, RowsFrame,
    WireError, WireLimits,
};
use crate::transport::{FrameRead, PeerStream, ROWS_APART_MIN, Transport};

/// Flushes after a frame: a sealed link's last record goes on flush.
async fn write_frame<W: tokio::io::AsyncWrite + Unpin>(
    stream: &mut W,
    bytes: &[u8],
) -> std::io::Result<()> {
    stream.write_all(bytes).await?;
    stream.flush().await
}

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
        self.check_limits(&frame.prefix)?;
        let permit = self.reserve()?;
        self.send_frame(permit, request_id, expect, frame, done)
    }

    /// [`PeerClient::send`] of a request whose rows are given per group, where the caller
    /// holds them: the frame is encoded from them, which is their one copy on this side
    /// (a large f32 frame, which the connection task converts as it writes it, is gathered
    /// into one buffer instead). Frames encoded here are not offered to a transport that
    /// takes rows apart ([`crate::transport::FrameWrite::send_rows`]); the sealed link
    /// every peer connection is takes none.
    pub fn send_parts(
        &self,
        head: RequestHead,
        parts: &[&[f32]],
        done: Completion,
    ) -> Result<(), PeerError> {
        let request_id = self.shared.next_request_id.fetch_add(1, Ordering::Relaxed);
        let values: usize = parts.iter().map(|part| part.len()).sum();
        let prefix =
            wire::request_head_prefix(request_id, &head, values).map_err(PeerError::BadRequest)?;
        self.check_limits(&prefix)?;
        let permit = self.reserve()?;
        let dtype = head.dtype;
        let expect = Expect {
            width: head.width,
            groups: head.groups,
        };
        if dtype == Dtype::F32 && prefix.len() + values * dtype.size() > CHUNK_BYTES {
            let mut rows = Vec::with_capacity(values);
            for part in parts {
                rows.extend_from_slice(part);
            }
            let frame = RowsFrame {
                prefix,
                rows: Rows::one(rows),
                dtype,
            };
            return self.send_frame(permit, request_id, expect, frame, done);
        }
        let mut bytes = prefix;
        bytes.reserve_exact(values * dtype.size());
        for part in parts {
            wire::encode_values_append(part, dtype, &mut bytes);
        }
        self.send_queued(permit, request_id, expect, Err(bytes), done);
        Ok(())
    }

    /// The peer would drop the whole connection over a frame past the limits (both nodes
    /// are expected to run the same limits), so a request's is refused here, alone.
    fn check_limits(&self, prefix: &[u8]) -> Result<(), PeerError> {
        wire::decode_header(prefix, &self.limits)
            .map(drop)
            .map_err(PeerError::BadRequest)
    }

    /// A place in the queue toward the driver; a full queue is `Overloaded`.
    fn reserve(&self) -> Result<mpsc::Permit<'_, Outgoing>, PeerError> {
        self.queue.try_reserve().map_err(|error| match error {
            mpsc::error::TrySendError::Full(()) => PeerError::Overloaded,
            mpsc::error::TrySendError::Closed(()) => PeerError::Closed,
        })
    }

    fn send_frame(
        &self,
        permit: mpsc::Permit<'_, Outgoing>,
        request_id: u64,
        expect: Expect,
        frame: RowsFrame,
        done: Completion,
    ) -> Result<(), PeerError> {
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
        self.send_queued(permit, request_id, expect, frame, done);
        Ok(())
    }

    /// Sends an encoded frame from this thread when the link is up and idle, else hands it
    /// (or a frame whose rows the driver converts as it writes them) to the driver.
    fn send_queued(
        &self,
        permit: mpsc::Permit<'_, Outgoing>,
        request_id: u64,
        expect: Expect,
        frame: Result<RowsFrame, Vec<u8>>,
        done: Completion,
    ) {
        let shared = &self.shared;
        let mut link = lock(&shared.link);
        let frame = match frame {
            // The link is up and idle: sent from this thread, sparing the hand-off to the
            // driver task (most of a small request's round trip).
            Err(bytes) if link.queued == 0 && link.stream.is_some() => {
                lock(&shared.pending).insert(request_id, Pending { expect, done });
                let (bytes, written) = match send_now(&mut link, bytes) {
                    SentNow::All(len) => {
                        shared.stats.add_sent(len);
                        return;
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
                return;
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
                Ok((stream, keys)) => {
                    backoff = self.config.backoff_min;
                    let end = self.run_connection(stream, &keys, first).await;
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

    async fn connect(&self) -> Result<(Box<dyn PeerStream>, LinkKeys), PeerError> {
        let mut stream = self
            .transport
            .connect(self.addr)
            .await
            .map_err(|error| PeerError::Connect(format!("{}: {error}", self.addr)))?;
        let timeout = self.config.handshake_timeout;
        let handshake = async {
            let (server_id, keys) = client_authenticate(&mut stream, &self.auth).await?;
            let (stream, path) =
                negotiate_link(stream, &*self.transport, self.addr, &keys, Side::Client).await?;
            Ok((server_id, keys, stream, path))
        };
        let result = tokio::time::timeout(timeout, handshake)
            .await
            .unwrap_or(Err(HandshakeError::Timeout(timeout)));
        match result {
            Ok((server_id, keys, stream, path)) => {
                tracing::info!(peer = %self.addr, %server_id, path, "peer link up");
                Ok((stream, keys))
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

    async fn run_connection(
        &mut self,
        stream: Box<dyn PeerStream>,
        keys: &LinkKeys,
        first: Outgoing,
    ) -> LinkEnd {
        let deadline = self.config.frame_timeout;
        let (read_half, write_half) =
            sealed_halves(stream, keys, Side::Client, self.stats.clone(), deadline);
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
            deadline,
        ));
        let mut next = Some(first);
        let mut scratch = vec![0u8; CHUNK_BYTES];
        let shared = self.shared.clone();
        let removed = secret_removed(self.auth.secrets.clone(), keys.secret);
        tokio::pin!(removed);
        let end = loop {
            let outgoing = match next.take() {
                Some(outgoing) => outgoing,
                None => tokio::select! {
                    reason = &mut reader => {
                        break LinkEnd::Lost(reason.unwrap_or_else(|error| format!("reader stopped: {error}")));
                    }
                    () = &mut removed => {
                        tracing::info!(peer = %self.addr, "peer link closed: the secret it was made with was removed by a reload");
                        break LinkEnd::Lost("the secret it was made with was removed by a reload".into());
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
                            Err(bytes) => (write_frame(&mut stream, bytes).await, bytes.len()),
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
                    let write = write_frame(&mut stream, &bytes[written..]);
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

/// Reads replies until the connection fails; returns why it ended. A reply that has begun
/// must arrive within `deadline`.
async fn read_replies(
    mut stream: Box<dyn FrameRead>,
    pending: PendingMap,
    stats: Arc<PeerStats>,
    limits: WireLimits,
    deadline: Duration,
) -> String {
    loop {
        let frame = async {
            if !frame_begins(&mut stream).await? {
                return Ok(None);
            }
            within(deadline, &stats, async {
                let Some(header) = read_header(&mut stream, &limits, &stats).await? else {
                    return Ok(None);
                };
                let body = read_body(&mut stream, &header, &stats).await?;
                Ok(Some((header, body)))
            })
            .await
        };
        let (header, body) = match frame.await {
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
