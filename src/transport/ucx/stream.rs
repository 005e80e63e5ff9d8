//! [`UcxStream`]: one UCX endpoint as a tokio byte stream (UCX's stream API), and
//! [`UcxListener`], the endpoints a `ucp_listener` accepts.
//!
//! Writes copy the bytes and hand them to the worker thread, which sends them in order;
//! writers wait once [`SEND_PENDING_MAX`] bytes are in flight. The thread keeps a receive
//! posted and appends what arrives for the reader. An endpoint the peer closed reads as the
//! end of the stream; one that failed (UCX's error callback) errors reads and writes.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;

use super::worker::{
    Accepted, Command, EpShared, RECV_BUFFERED_MAX, SEND_PENDING_MAX, WorkerHandle,
};
use crate::transport::{PeerListener, PeerStream};

/// Bytes one write hands over at most (a bigger buffer is taken in several writes).
const WRITE_CHUNK: usize = 8 << 20;

/// A connected UCX endpoint as a byte stream.
pub struct UcxStream {
    worker: Arc<WorkerHandle>,
    ep: u64,
    shared: Arc<EpShared>,
}

impl UcxStream {
    pub(super) fn new(worker: Arc<WorkerHandle>, ep: u64, shared: Arc<EpShared>) -> Self {
        UcxStream { worker, ep, shared }
    }
}

impl Drop for UcxStream {
    fn drop(&mut self) {
        // Flushes what was written, then closes. A stopped thread has closed it already.
        let _ = self.worker.send(Command::CloseEp { ep: self.ep });
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
        let n = buf.remaining().min(state.received.len());
        let (front, back) = state.received.as_slices();
        let from_front = n.min(front.len());
        buf.put_slice(&front[..from_front]);
        buf.put_slice(&back[..n - from_front]);
        state.received.drain(..n);
        let resume = was_full && state.recv_paused && state.received.len() < RECV_BUFFERED_MAX;
        drop(state);
        if resume {
            // A stopped thread fails the next read instead.
            let _ = this.worker.send(Command::ResumeRecv { ep: this.ep });
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
        {
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
        }
        this.worker.send(Command::Send {
            ep: this.ep,
            data: buf[..n].to_vec(),
        })?;
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

    /// UCX streams have no half-close: this flushes; dropping the stream closes it.
    fn poll_shutdown(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_flush(context)
    }
}

/// A `ucp_listener` bound to an address; its connections come as [`UcxStream`]s.
pub struct UcxListener {
    pub(super) worker: Arc<WorkerHandle>,
    pub(super) id: u64,
    pub(super) local_addr: SocketAddr,
    pub(super) accepted: mpsc::Receiver<Accepted>,
}

impl Drop for UcxListener {
    fn drop(&mut self) {
        let _ = self.worker.send(Command::CloseListener { id: self.id });
    }
}

impl PeerListener for UcxListener {
    fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    fn accept(&mut self) -> BoxFuture<'_, io::Result<(Box<dyn PeerStream>, SocketAddr)>> {
        async move {
            let Accepted { ep, shared, peer } = self.accepted.recv().await.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the UCX worker thread has stopped",
                )
            })?;
            let stream = UcxStream::new(self.worker.clone(), ep, shared);
            Ok((Box::new(stream) as Box<dyn PeerStream>, peer))
        }
        .boxed()
    }
}
