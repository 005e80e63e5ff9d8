//! [`UcxStream`]: one link's UCX endpoint as a tokio byte stream (its bytes carried as UCX
//! active messages), watched by the link's TCP control connection.
//!
//! A write copies the bytes into a send buffer (reused once its send completes) and sends it
//! as one active message itself, in order; writers wait once [`SEND_PENDING_MAX`] bytes are
//! in flight. The worker hands each received message to the reader whole and in order (a
//! rendezvous one once fetched into a buffer of its size), so a read copies the bytes once,
//! out of that buffer; a read that finds nothing progresses the worker before it waits.
//!
//! The link ends when UCX fails the endpoint (its error callback) or when the control
//! connection ends: a peer that exits or drops the link closes that socket at once, whatever
//! UCX's own transports would take to notice. A control connection that ends cleanly reads
//! as the end of the stream; anything else errors reads and writes.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

use super::worker::{
    EpShared, Failure, MESSAGE_MAX, RECV_BUFFERED_MAX, SEND_PENDING_MAX, WorkerHandle,
};
use crate::transport::PeerStream;

/// Bytes one write hands over at most (a bigger buffer is taken in several writes): one
/// UCX message, which the peer refuses beyond this.
const WRITE_CHUNK: usize = MESSAGE_MAX;

/// A connected UCX endpoint as a byte stream.
pub struct UcxStream {
    worker: Option<Arc<WorkerHandle>>,
    ep: u64,
    shared: Arc<EpShared>,
    /// The task watching the control connection (it owns the connection).
    watcher: tokio::task::AbortHandle,
}

impl UcxStream {
    /// Must be called within a tokio runtime (the watcher is a task).
    pub(super) fn new(
        worker: Arc<WorkerHandle>,
        ep: u64,
        shared: Arc<EpShared>,
        control: Box<dyn PeerStream>,
    ) -> Self {
        let watcher = tokio::spawn(watch_control(
            control,
            shared.clone(),
            Arc::downgrade(&worker),
            ep,
        ))
        .abort_handle();
        UcxStream {
            worker: Some(worker),
            ep,
            shared,
            watcher,
        }
    }

    fn worker(&self) -> io::Result<&WorkerHandle> {
        self.worker.as_deref().ok_or_else(super::stopped)
    }
}

/// Waits for the control connection to end (nothing is sent on it after the handshake), then
/// fails the link and closes its endpoint.
async fn watch_control(
    mut control: Box<dyn PeerStream>,
    shared: Arc<EpShared>,
    worker: Weak<WorkerHandle>,
    ep: u64,
) {
    let mut byte = [0u8; 1];
    let failure = match control.read(&mut byte).await {
        Ok(0) => Failure {
            closed_by_peer: true,
            message: "the peer closed the link".into(),
        },
        Ok(_) => Failure {
            closed_by_peer: false,
            message: "the peer sent bytes on the link's control connection".into(),
        },
        Err(error) => Failure {
            closed_by_peer: false,
            message: format!("the link's control connection failed: {error}"),
        },
    };
    shared.fail(failure);
    if let Some(worker) = worker.upgrade() {
        worker.close_ep(ep, true);
        super::off_runtime(worker);
    }
}

impl Drop for UcxStream {
    fn drop(&mut self) {
        // Flushes what was written, then closes; the control connection closes with the
        // watcher, which tells the peer.
        if let Some(worker) = self.worker.take() {
            worker.close_ep(self.ep, false);
            super::off_runtime(worker);
        }
        self.watcher.abort();
    }
}

impl AsyncRead for UcxStream {
    fn poll_read(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let mut state = this.shared.lock();
        if state.received.is_empty() && state.failure.is_none() {
            // What arrived since the driver task last ran is found now, not after a wake-up.
            drop(state);
            if let Ok(worker) = this.worker() {
                worker.progress();
            }
            state = this.shared.lock();
        }
        if state.received.is_empty() {
            return match &state.failure {
                Some(failure) if failure.closed_by_peer => Poll::Ready(Ok(())),
                Some(failure) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    failure.message.clone(),
                ))),
                None => {
                    state.read_waker = Some(context.waker().clone());
                    Poll::Pending
                }
            };
        }
        let was_full = state.received.len() >= RECV_BUFFERED_MAX;
        state.received.read_into(buf);
        let resume = was_full && state.recv_paused && state.received.len() < RECV_BUFFERED_MAX;
        drop(state);
        if resume && let Ok(worker) = this.worker() {
            worker.resume_recv();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for UcxStream {
    fn poll_write(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = buf.len().min(WRITE_CHUNK);
        let data = {
            let mut state = this.shared.lock();
            if let Some(failure) = &state.failure {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    failure.message.clone(),
                )));
            }
            if state.send_pending >= SEND_PENDING_MAX {
                state.write_waker = Some(context.waker().clone());
                return Poll::Pending;
            }
            state.send_pending += n;
            let mut data = state.spare_send.pop().unwrap_or_default();
            data.clear();
            data.extend_from_slice(&buf[..n]);
            data
        };
        this.worker()?.send(this.ep, data);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut state = self.shared.lock();
        if state.send_pending == 0 {
            return Poll::Ready(Ok(()));
        }
        if let Some(failure) = &state.failure {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                failure.message.clone(),
            )));
        }
        state.write_waker = Some(context.waker().clone());
        Poll::Pending
    }

    /// A UCX link has no half-close: this flushes; dropping the stream closes it.
    fn poll_shutdown(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_flush(context)
    }
}
