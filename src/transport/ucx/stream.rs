//! [`UcxStream`]: one link's UCX endpoint as a tokio byte stream (its bytes carried as UCX
//! active messages), watched by the link's TCP control connection.
//!
//! A write copies the bytes into a send buffer (reused once its send completes) and sends it
//! as one active message itself, in order; writers wait once [`SEND_PENDING_MAX`] bytes are
//! in flight. A whole encoded frame is sent from its own buffer instead, without that copy
//! ([`FrameWrite::send_owned`]). The worker hands each received message to the reader whole
//! and in order (a rendezvous one once fetched into a buffer of its size), and the reader
//! shows its bytes in place ([`AsyncBufRead`]): the peer protocol converts the rows of a
//! frame sent as one message straight out of it.
//! A read that finds nothing progresses the worker before it waits.
//!
//! A frame with many rows goes as two messages ([`FrameWrite::send_rows`]): its header and
//! groups as bytes, then its rows as they are in memory, f32; on the wire in the frame's
//! dtype, bf16 ones converted by UCX fragment by fragment where the link copies anyway
//! (shared memory, [`super::rows`]). The peer's worker decodes them as they arrive and its
//! reader hands them over whole ([`DecodedRows`]). The bytes on the wire are those of the
//! frame as one message would carry them.
//!
//! The stream splits into its two halves ([`PeerStream::into_halves`]) without a lock
//! between them: each takes the endpoint's shared state on its own, and the endpoint closes
//! when both are gone.
//!
//! The link ends when UCX fails the endpoint (its error callback) or when the control
//! connection ends: a peer that exits or drops the link closes that socket at once, whatever
//! UCX's own transports would take to notice. A control connection that ends cleanly reads
//! as the end of the stream; anything else errors reads and writes.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};

use tokio::io::{AsyncBufRead, AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

use super::endpoint::{EpShared, Failure, Payload};
use super::handle::WorkerHandle;
use super::worker::{MESSAGE_MAX, RECV_BUFFERED_MAX, SEND_PENDING_MAX};
use crate::transport::wire::{Dtype, RowsFrame};
use crate::transport::{DecodedRows, FrameRead, FrameWrite, PeerStream, ROWS_APART_MIN};

/// Bytes one write hands over at most (a bigger buffer is taken in several writes): one
/// UCX message, which the peer refuses beyond this.
const WRITE_CHUNK: usize = MESSAGE_MAX;

/// A connected UCX endpoint as a byte stream: its two halves.
pub struct UcxStream {
    reader: UcxReader,
    writer: UcxWriter,
}

/// What both halves hold: the worker, the endpoint and the task watching the control
/// connection. The last half dropped closes the endpoint.
struct Link {
    worker: Option<Arc<WorkerHandle>>,
    ep: u64,
    shared: Arc<EpShared>,
    /// The task watching the control connection (it owns the connection).
    watcher: tokio::task::AbortHandle,
}

impl Link {
    fn worker(&self) -> io::Result<&WorkerHandle> {
        self.worker.as_deref().ok_or_else(super::stopped)
    }
}

impl Drop for Link {
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

/// The read half: the received message being read, in place.
pub struct UcxReader {
    link: Arc<Link>,
    /// The message being read and its first unread byte.
    current: Option<(Vec<u8>, usize)>,
}

/// The write half.
pub struct UcxWriter {
    link: Arc<Link>,
    /// Whether bf16 rows go through the rows datatype on this link ([`super::rows`]).
    packs_rows: bool,
}

impl UcxStream {
    /// Must be called within a tokio runtime (the watcher is a task).
    pub(super) fn new(
        worker: Arc<WorkerHandle>,
        ep: u64,
        shared: Arc<EpShared>,
        packs_rows: bool,
        control: Box<dyn PeerStream>,
    ) -> Self {
        let watcher = tokio::spawn(watch_control(
            control,
            shared.clone(),
            Arc::downgrade(&worker),
            ep,
        ))
        .abort_handle();
        let link = Arc::new(Link {
            worker: Some(worker),
            ep,
            shared,
            watcher,
        });
        UcxStream {
            reader: UcxReader {
                link: link.clone(),
                current: None,
            },
            writer: UcxWriter { link, packs_rows },
        }
    }
}

impl PeerStream for UcxStream {
    fn into_halves(self: Box<Self>) -> (Box<dyn FrameRead>, Box<dyn FrameWrite>) {
        let UcxStream { reader, writer } = *self;
        (Box::new(reader), Box::new(writer))
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

/// A message of rows, decoded, and their wire dtype.
type DecodedRowsMessage = (Vec<f32>, Dtype);

impl UcxReader {
    /// Whether the current message has bytes left to read.
    fn reading(&self) -> bool {
        self.current
            .as_ref()
            .is_some_and(|(buffer, start)| *start < buffer.len())
    }

    /// Makes the next received message current, when the current one is read: `Ready(Ok)`
    /// with one current or at the end of the stream (none), `Pending` until one arrives.
    /// With `rows`, a message of decoded rows is taken instead (`Ready(Ok(Some))`) when it
    /// is the next one; without, one is an error (the peer sent rows where bytes belong).
    fn poll_next_message(
        &mut self,
        context: &mut Context<'_>,
        rows: bool,
    ) -> Poll<io::Result<Option<DecodedRowsMessage>>> {
        if self.reading() {
            return Poll::Ready(Ok(None));
        }
        let link = &self.link;
        let mut state = link.shared.lock();
        if let Some((done, _)) = self.current.take() {
            state.received.recycle(done);
        }
        if state.received.is_empty() && state.failure.is_none() {
            // What arrived since the driver task last ran is found now, not after a wake-up.
            drop(state);
            if let Ok(worker) = link.worker() {
                worker.progress();
            }
            state = link.shared.lock();
        }
        let was_full = state.received.len() >= RECV_BUFFERED_MAX;
        if state.received.rows_next() && !rows {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the peer sent rows where the peer protocol expects a frame's bytes",
            )));
        }
        let Some(message) = state.received.pop_front() else {
            return match &state.failure {
                Some(failure) if failure.closed_by_peer => Poll::Ready(Ok(None)),
                Some(failure) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    failure.message.clone(),
                ))),
                None => {
                    state.read_waker = Some(context.waker().clone());
                    Poll::Pending
                }
            };
        };
        let resume = was_full && state.recv_paused && state.received.len() < RECV_BUFFERED_MAX;
        drop(state);
        if resume && let Ok(worker) = link.worker() {
            worker.resume_recv();
        }
        Poll::Ready(Ok(match message {
            Payload::Bytes(bytes) => {
                self.current = Some((bytes, 0));
                None
            }
            Payload::Rows(values, dtype) => Some((values, dtype)),
        }))
    }
}

impl DecodedRows for UcxReader {
    fn poll_decoded_rows(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        values: usize,
        dtype: Dtype,
    ) -> Poll<io::Result<Option<Vec<f32>>>> {
        let this = self.get_mut();
        match this.poll_next_message(context, true) {
            Poll::Ready(Ok(Some((rows, sent)))) if rows.len() != values || sent != dtype => {
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "the peer sent {} values of {sent:?} rows for a frame of {values} \
                         {dtype:?} values",
                        rows.len()
                    ),
                )))
            }
            Poll::Ready(Ok(rows)) => Poll::Ready(Ok(rows.map(|(rows, _)| rows))),
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncBufRead for UcxReader {
    fn poll_fill_buf(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<&[u8]>> {
        let this = self.get_mut();
        match this.poll_next_message(context, false) {
            Poll::Ready(Ok(_)) => Poll::Ready(Ok(match &this.current {
                Some((buffer, start)) => &buffer[*start..],
                None => &[],
            })),
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn consume(self: Pin<&mut Self>, amount: usize) {
        if let Some((buffer, start)) = &mut self.get_mut().current {
            *start = (*start + amount).min(buffer.len());
        }
    }
}

impl AsyncRead for UcxReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let available = match self.as_mut().poll_fill_buf(context) {
            Poll::Ready(Ok(available)) => available,
            Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
            Poll::Pending => return Poll::Pending,
        };
        let n = available.len().min(buf.remaining());
        buf.put_slice(&available[..n]);
        self.consume(n);
        Poll::Ready(Ok(()))
    }
}

impl UcxWriter {
    fn broken(failure: &Failure) -> io::Error {
        io::Error::new(io::ErrorKind::BrokenPipe, failure.message.clone())
    }

    /// The worker, with `len` more bytes counted in flight, when the link is up and fewer
    /// than [`SEND_PENDING_MAX`] are; `None` otherwise (a write finds out why, or waits for
    /// room).
    fn room_for(&self, len: usize) -> Option<&WorkerHandle> {
        let worker = self.link.worker().ok()?;
        let mut state = self.link.shared.lock();
        if state.failure.is_some() || state.send_pending >= SEND_PENDING_MAX {
            return None;
        }
        state.send_pending += len;
        Some(worker)
    }
}

impl FrameWrite for UcxWriter {
    /// Takes frames of one message at most ([`MESSAGE_MAX`]), while fewer than
    /// [`SEND_PENDING_MAX`] bytes are in flight (past that, the frame is written, and the
    /// writer waits for room as any writer does).
    fn send_owned(&mut self, frame: Vec<u8>) -> Result<(), Vec<u8>> {
        if frame.is_empty() || frame.len() > WRITE_CHUNK {
            return Err(frame);
        }
        match self.room_for(frame.len()) {
            Some(worker) => {
                worker.send(self.link.ep, frame);
                Ok(())
            }
            None => Err(frame),
        }
    }

    /// Takes frames whose rows are more than [`ROWS_APART_MIN`] bytes on the wire and at
    /// most one message: f32 rows on every link (they move as they are), bf16 ones where
    /// the link packs rows ([`super::rows`]); under the same room rule as `send_owned`.
    fn send_rows(&mut self, frame: RowsFrame) -> Result<(), RowsFrame> {
        let rows_len = frame.rows_len();
        let takes = cfg!(target_endian = "little")
            && rows_len > ROWS_APART_MIN
            && rows_len <= MESSAGE_MAX
            && frame.prefix.len() <= WRITE_CHUNK
            && (frame.dtype == Dtype::F32 || self.packs_rows);
        if !takes {
            return Err(frame);
        }
        match self.room_for(frame.len()) {
            Some(worker) => {
                worker.send_rows(self.link.ep, frame);
                Ok(())
            }
            None => Err(frame),
        }
    }
}

impl AsyncWrite for UcxWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let link = &self.link;
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = buf.len().min(WRITE_CHUNK);
        let data = {
            let mut state = link.shared.lock();
            if let Some(failure) = &state.failure {
                return Poll::Ready(Err(Self::broken(failure)));
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
        link.worker()?.send(link.ep, data);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut state = self.link.shared.lock();
        if state.send_pending == 0 {
            return Poll::Ready(Ok(()));
        }
        if let Some(failure) = &state.failure {
            return Poll::Ready(Err(Self::broken(failure)));
        }
        state.write_waker = Some(context.waker().clone());
        Poll::Pending
    }

    /// A UCX link has no half-close: this flushes; dropping both halves closes it.
    fn poll_shutdown(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_flush(context)
    }
}

impl AsyncRead for UcxStream {
    fn poll_read(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().reader).poll_read(context, buf)
    }
}

impl AsyncWrite for UcxStream {
    fn poll_write(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().writer).poll_write(context, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().writer).poll_flush(context)
    }

    fn poll_shutdown(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().writer).poll_shutdown(context)
    }
}
