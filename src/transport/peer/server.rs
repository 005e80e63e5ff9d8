//! [`PeerServer`]: accepts connections, authenticates them, runs each request through the
//! handler on a blocking thread, and writes each reply back as soon as it is ready (from the
//! handler's thread when nothing is queued ahead of it), matched to its request by id.
//!
//! What a peer can make the server hold is bounded ([`PeerConfig`]): connections in all and
//! per node, requests in flight and bytes of rows per connection (reading waits while they
//! are spent; rows are allocated as they arrive), and the time a frame that has begun may
//! take to arrive.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::runtime::Handle;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};

use super::frames::{
    CHUNK_BYTES, LockedWriter, SentNow, WriterSlot, frame_begins, read_body, read_header,
    rows_bytes, send_now, within, write_rows_frame,
};
use super::link::{negotiate_link, server_authenticate};
use super::seal::{Side, sealed_halves};
use super::{Handler, PeerAuth, PeerConfig, PeerStats, WarnLimiter, lock, secret_removed};
use crate::transport::handshake::HandshakeError;
use crate::transport::wire::{
    self, Dtype, ExpertRequest, FrameBody, RemoteError, RowsFrame, WireError,
};
use crate::transport::{FrameRead, PeerListener, PeerStream, ROWS_APART_MIN, Transport};

struct ServerContext {
    /// Offers each authenticated connection its faster path, if it has one.
    transport: Arc<dyn Transport>,
    auth: Arc<PeerAuth>,
    stats: Arc<PeerStats>,
    handler: Handler,
    config: PeerConfig,
    warnings: WarnLimiter,
    /// One permit per connection held, handshakes included (`max_connections`).
    connections: Arc<Semaphore>,
    /// Authenticated connections per node id (`max_connections_per_peer`).
    per_peer: Mutex<HashMap<String, usize>>,
}

/// A node's place among the connections of one node id; given back on drop.
struct PeerSlot<'a> {
    context: &'a ServerContext,
    node_id: String,
}

impl Drop for PeerSlot<'_> {
    fn drop(&mut self) {
        let mut per_peer = lock(&self.context.per_peer);
        if let Some(count) = per_peer.get_mut(&self.node_id) {
            *count -= 1;
            if *count == 0 {
                per_peer.remove(&self.node_id);
            }
        }
    }
}

impl ServerContext {
    /// Takes a place for one more connection of `node_id`; `None` at the cap.
    fn peer_slot(&self, node_id: &str) -> Option<PeerSlot<'_>> {
        let mut per_peer = lock(&self.per_peer);
        let count = per_peer.entry(node_id.to_string()).or_insert(0);
        if *count >= self.config.max_connections_per_peer {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            context: self,
            node_id: node_id.to_string(),
        })
    }

    fn over_limit(&self) {
        self.stats
            .frames_rejected
            .over_limit
            .fetch_add(1, Ordering::Relaxed);
    }

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
            connections: Arc::new(Semaphore::new(config.max_connections.max(1))),
            per_peer: Mutex::new(HashMap::new()),
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
                    let Ok(permit) = context.connections.clone().try_acquire_owned() else {
                        // Closed at once: the cap bounds what unauthenticated peers hold too.
                        context.over_limit();
                        context.warn(peer, "peer connection refused", &format_args!(
                            "{} connections already open (peer.max_connections)",
                            context.config.max_connections
                        ));
                        drop(stream);
                        continue;
                    };
                    tokio::spawn(serve_connection(stream, peer, context.clone(), stopped.clone(), permit));
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
    _permit: OwnedSemaphorePermit,
) {
    let timeout = context.config.handshake_timeout;
    let handshake = async {
        let (client_id, keys) = server_authenticate(&mut stream, &context.auth).await?;
        let (stream, path) =
            negotiate_link(stream, &*context.transport, peer, &keys, Side::Server).await?;
        Ok((client_id, keys, stream, path))
    };
    let handshake = tokio::select! {
        result = tokio::time::timeout(timeout, handshake) => {
            result.unwrap_or(Err(HandshakeError::Timeout(timeout)))
        }
        _ = stopped.changed() => return,
    };
    let (client_id, keys, stream, path) = match handshake {
        Ok(accepted) => accepted,
        Err(error) => {
            context.stats.handshake_failed(&error);
            context.warn(peer, "peer handshake refused", &error);
            return;
        }
    };
    let Some(_slot) = context.peer_slot(&client_id) else {
        context.over_limit();
        context.warn(
            peer,
            "peer connection refused",
            &format_args!(
                "node {client_id} already has {} connections (peer.max_connections_per_peer)",
                context.config.max_connections_per_peer
            ),
        );
        return;
    };
    tracing::debug!(%peer, %client_id, path, "peer connection accepted");
    let (read_half, write_half) = sealed_halves(
        stream,
        &keys,
        Side::Server,
        context.stats.clone(),
        context.config.frame_timeout,
    );
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
        () = secret_removed(context.auth.secrets.clone(), keys.secret) => {
            Err("closed: the secret it was made with was removed by a reload".to_string())
        }
    };
    writer.abort();
    // Handlers still running hold the link: they must not keep the connection open.
    lock(&link.state).stream = None;
    if let Err(reason) = ended {
        context.warn(peer, "peer connection dropped", &reason);
    }
}

/// Reads requests and hands each to the handler; `Err` when the peer misbehaved. A request
/// holds its rows' bytes of the connection's budget until its reply is sent: while they are
/// spent, the next request is not read (its sender waits on the socket).
async fn serve_requests(
    mut stream: Box<dyn FrameRead>,
    link: &Arc<ReplyLink>,
    context: &Arc<ServerContext>,
) -> Result<(), String> {
    let inflight = Arc::new(AtomicUsize::new(0));
    let config = &context.config;
    let stats = &context.stats;
    // Counted in KiB, so that a budget of up to 4 TiB fits the semaphore's u32 permits.
    let budget_kib =
        u32::try_from(config.max_bytes_per_connection.div_ceil(1024).max(1)).unwrap_or(u32::MAX);
    let budget = Arc::new(Semaphore::new(budget_kib as usize));
    loop {
        if !frame_begins(&mut stream).await? {
            return Ok(());
        }
        let header = match within(config.frame_timeout, stats, async {
            read_header(&mut stream, &config.limits, stats).await
        })
        .await?
        {
            Some(header) => header,
            None => return Ok(()),
        };
        let rows = rows_bytes(&header);
        if rows > config.max_bytes_per_connection as u64 {
            context.over_limit();
            return Err(format!(
                "a frame of {rows} bytes of rows is over peer.max_bytes_per_connection ({})",
                config.max_bytes_per_connection
            ));
        }
        // Not timed: this is the connection's own backpressure, not the peer stalling.
        let kib = u32::try_from(rows.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .min(budget_kib);
        let permit = budget
            .clone()
            .acquire_many_owned(kib)
            .await
            .map_err(|_| "the connection's byte budget is gone".to_string())?;
        // The deadline restarts once the budget is there: the frame resumes only then.
        let body = within(config.frame_timeout, stats, async {
            read_body(&mut stream, &header, stats).await
        })
        .await?;
        let FrameBody::Request(request) = body else {
            stats.reject_frame(&WireError::Malformed("reply sent to a server".into()));
            return Err("a client sent a reply or error frame".into());
        };
        let request_id = header.request_id;
        // The counter bounds the frames waiting in the link's unbounded outbox.
        if inflight.load(Ordering::Acquire) >= config.max_inflight_per_connection {
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
            drop(permit);
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

async fn write_replies(link: Arc<ReplyLink>, mut queued: mpsc::UnboundedReceiver<OutFrame>) {
    let mut scratch = vec![0u8; CHUNK_BYTES];
    let mut stream = LockedWriter(&link.state);
    while let Some(frame) = queued.recv().await {
        let (written, len) = match &frame {
            OutFrame::Bytes(bytes) => (write_flushed(&mut stream, bytes).await, bytes.len()),
            OutFrame::Partial { bytes, written } => (
                write_flushed(&mut stream, &bytes[*written..]).await,
                bytes.len(),
            ),
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

/// Writes a frame and flushes it (a sealed link's last record goes on flush).
async fn write_flushed(stream: &mut LockedWriter<'_>, bytes: &[u8]) -> std::io::Result<()> {
    stream.write_all(bytes).await?;
    stream.flush().await
}
