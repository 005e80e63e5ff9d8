//! Sealed records: every byte a peer link carries after its handshake, in both directions,
//! travels in records sealed with AES-256-GCM under the link's key for that direction
//! ([`crate::transport::handshake::link_keys`]).
//!
//! ```text
//! record  len u32 (little-endian, 1..=RECORD_MAX)  ciphertext[len]  tag[16]
//! nonce   the record's number in its direction (u64, little-endian, from 0), 4 zero bytes
//! aad     the 4 length bytes
//! ```
//!
//! The nonce is never sent: each side counts the records it seals and the records it opens.
//! So a record altered (any bit of length, ciphertext or tag), replayed, moved, dropped or
//! taken from another link (other keys) fails its tag, and a stream cut inside a record ends
//! in a truncated record: each closes the link (counted in
//! `moe_node_peer_frames_rejected_total{reason}`), whose outstanding requests then fail over
//! to another replica. A frame is never handed on unless every record it spans opened.
//!
//! Why AES-256-GCM through aws-lc-rs (already in the tree as rustls' provider): on a 1 MiB
//! frame it seals at 14 GB/s on this project's build machines (AES-NI, VAES), against 1.35
//! GB/s for RustCrypto's AES-GCM and 1.33 GB/s for its ChaCha20-Poly1305
//! (benches/results/peer_security.txt); the link must keep up with loopback TCP.
//!
//! Copies: a record is read straight from the socket into the reader's buffer and opened in
//! place, and the frame reader converts rows from the opened bytes, as it did from a plain
//! socket's buffer. The writer copies each chunk it is given into its record buffer (at most
//! [`RECORD_MAX`] at a time, so in cache) and seals it there: for f32 rows written from
//! where they are (`frames::write_rows_frame`), that is their one copy on the way out.
//!
//! Bounds: a record holds at most [`RECORD_MAX`] bytes, so a connection's reader holds at
//! most two records' bytes, allocated as they arrive, and a record begun must end within the
//! link's frame deadline.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use tokio::io::{AsyncBufRead, AsyncRead, AsyncWrite, ReadBuf};

use super::PeerStats;
use crate::transport::handshake::{KEY_LEN, LinkKeys};
use crate::transport::{DecodedRows, FrameRead, FrameWrite, PeerStream};

/// Largest plaintext of one record: the frame writer's chunk, so a chunk is one record.
pub const RECORD_MAX: usize = 256 << 10;
/// Bytes before a record's ciphertext (its length).
pub const RECORD_HEADER: usize = 4;
/// Bytes of a record's tag.
pub const TAG_LEN: usize = 16;
/// Room for two whole records: one being read, the next one's first bytes.
const READ_CAPACITY: usize = 2 * (RECORD_HEADER + RECORD_MAX + TAG_LEN);

/// Which end of a link this is: it seals with one key and opens with the other.
pub use crate::transport::handshake::Side;

/// One direction's key and record counter.
struct Direction {
    key: LessSafeKey,
    next: u64,
}

impl Direction {
    fn new(key: &[u8; KEY_LEN]) -> Self {
        // A 32-byte key is what AES-256-GCM takes, so this never fails.
        let key = UnboundKey::new(&AES_256_GCM, key).expect("a 32-byte AES-256-GCM key");
        Direction {
            key: LessSafeKey::new(key),
            next: 0,
        }
    }

    /// The next record's nonce; `None` once 2^64 records went (never, in practice).
    fn nonce(&mut self) -> Option<Nonce> {
        let number = self.next;
        self.next = self.next.checked_add(1)?;
        let mut nonce = [0u8; 12];
        nonce[..8].copy_from_slice(&number.to_le_bytes());
        Some(Nonce::assume_unique_for_key(nonce))
    }
}

/// A link's halves sealed with `keys`, as `side` uses them: what the peer client and server
/// read frames from and write frames to once the handshake is over. Every transport's
/// stream is split as a plain byte stream (a UCX link then carries sealed records as its
/// bytes, sparing no copy). Public for tests and tools that speak frames of their own.
pub fn sealed_halves(
    stream: Box<dyn PeerStream>,
    keys: &LinkKeys,
    side: Side,
    stats: Arc<PeerStats>,
    deadline: Duration,
) -> (Box<dyn FrameRead>, Box<dyn FrameWrite>) {
    let (seal, open) = match side {
        Side::Client => (&keys.client_to_server, &keys.server_to_client),
        Side::Server => (&keys.server_to_client, &keys.client_to_server),
    };
    let (read, write) = tokio::io::split(stream);
    (
        Box::new(OpenedReader::new(read, open, stats, deadline)),
        Box::new(SealedWriter::new(write, seal)),
    )
}

/// Seals what is written to it into records. A record accepted by `poll_write` may still be
/// partly unsent: `poll_flush` (or the next write) sends the rest, so a frame is flushed
/// when written whole.
pub struct SealedWriter<W> {
    inner: W,
    direction: Direction,
    /// The sealed record being sent, and how much of it went.
    record: Vec<u8>,
    sent: usize,
    failed: bool,
}

impl<W: AsyncWrite + Unpin> SealedWriter<W> {
    pub fn new(inner: W, key: &[u8; KEY_LEN]) -> Self {
        SealedWriter {
            inner,
            direction: Direction::new(key),
            record: Vec::new(),
            sent: 0,
            failed: false,
        }
    }

    /// The stream written to (what the records went into, for tests and fuzzing).
    pub fn into_inner(self) -> W {
        self.inner
    }

    /// Sends what is left of the last record.
    fn poll_drain(&mut self, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while self.sent < self.record.len() {
            match ready!(Pin::new(&mut self.inner).poll_write(context, &self.record[self.sent..])) {
                Ok(0) => {
                    self.failed = true;
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                Ok(written) => self.sent += written,
                Err(error) => {
                    self.failed = true;
                    return Poll::Ready(Err(error));
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Seals `plain` (at most [`RECORD_MAX`] bytes) as the next record.
    fn seal(&mut self, plain: &[u8]) -> std::io::Result<()> {
        let nonce = self
            .direction
            .nonce()
            .ok_or_else(|| std::io::Error::other("2^64 records sealed on one link"))?;
        self.record.clear();
        self.record.reserve(RECORD_HEADER + plain.len() + TAG_LEN);
        // At most RECORD_MAX, which fits a u32.
        let header = (plain.len() as u32).to_le_bytes();
        self.record.extend_from_slice(&header);
        self.record.extend_from_slice(plain);
        let tag = self
            .direction
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(header), &mut self.record[RECORD_HEADER..])
            .map_err(|_| std::io::Error::other("sealing a record failed"))?;
        self.record.extend_from_slice(tag.as_ref());
        self.sent = 0;
        Ok(())
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for SealedWriter<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()));
        }
        ready!(this.poll_drain(context))?;
        let take = bytes.len().min(RECORD_MAX);
        if take == 0 {
            return Poll::Ready(Ok(0));
        }
        this.seal(&bytes[..take])?;
        // The record is taken: send what the stream takes now, the rest on the next poll.
        if let Poll::Ready(Err(error)) = this.poll_drain(context) {
            return Poll::Ready(Err(error));
        }
        Poll::Ready(Ok(take))
    }

    fn poll_flush(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(context))?;
        Pin::new(&mut this.inner).poll_flush(context)
    }

    fn poll_shutdown(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(context))?;
        Pin::new(&mut this.inner).poll_shutdown(context)
    }
}

impl<W: AsyncWrite + Send + Unpin + 'static> FrameWrite for SealedWriter<W> {}

/// Opens the records read from the inner stream; shows their plaintext as an
/// [`AsyncBufRead`]. A record that does not open, a bad length, a stream cut inside a
/// record or a record that stops for longer than the deadline is an error, counted, and
/// every read after it fails too.
pub struct OpenedReader<R> {
    inner: R,
    direction: Direction,
    stats: Arc<PeerStats>,
    /// Bytes read: `[plain_start, plain_end)` is opened plaintext not yet consumed,
    /// `[record_start, filled)` the next record's bytes read so far.
    buffer: Vec<u8>,
    plain_start: usize,
    plain_end: usize,
    record_start: usize,
    filled: usize,
    /// Runs while a record is partly read.
    deadline: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    failed: Option<(std::io::ErrorKind, &'static str)>,
}

impl<R: AsyncRead + Unpin> OpenedReader<R> {
    pub fn new(inner: R, key: &[u8; KEY_LEN], stats: Arc<PeerStats>, deadline: Duration) -> Self {
        OpenedReader {
            inner,
            direction: Direction::new(key),
            stats,
            buffer: Vec::new(),
            plain_start: 0,
            plain_end: 0,
            record_start: 0,
            filled: 0,
            deadline,
            timer: None,
            failed: None,
        }
    }

    fn fail(
        &mut self,
        kind: std::io::ErrorKind,
        message: &'static str,
    ) -> Poll<std::io::Result<()>> {
        self.failed = Some((kind, message));
        self.timer = None;
        Poll::Ready(Err(std::io::Error::new(kind, message)))
    }

    /// The length of the record at `record_start`, once its header is read.
    fn record_len(&self) -> Option<usize> {
        let header = self
            .buffer
            .get(self.record_start..self.record_start + RECORD_HEADER)?;
        if self.filled < self.record_start + RECORD_HEADER {
            return None;
        }
        Some(u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize)
    }

    /// Reads and opens the next record; `Ready(Ok)` with nothing opened is a clean end.
    fn poll_record(&mut self, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if let Some((kind, message)) = self.failed {
            return Poll::Ready(Err(std::io::Error::new(kind, message)));
        }
        // Whole records always fit after record_start while it is in the first half; past
        // it, the bytes read of the next record move to the front.
        if self.record_start > READ_CAPACITY / 2 {
            self.buffer.copy_within(self.record_start..self.filled, 0);
            self.filled -= self.record_start;
            self.record_start = 0;
        }
        loop {
            let need = match self.record_len() {
                None => RECORD_HEADER,
                Some(0) => {
                    self.stats
                        .frames_rejected
                        .malformed
                        .fetch_add(1, Ordering::Relaxed);
                    return self.fail(std::io::ErrorKind::InvalidData, "an empty sealed record");
                }
                Some(len) if len > RECORD_MAX => {
                    self.stats
                        .frames_rejected
                        .malformed
                        .fetch_add(1, Ordering::Relaxed);
                    return self.fail(
                        std::io::ErrorKind::InvalidData,
                        "a sealed record over the length limit",
                    );
                }
                Some(len) => RECORD_HEADER + len + TAG_LEN,
            };
            if self.filled - self.record_start >= need {
                return self.open(need);
            }
            // Read as much as arrived (up to the next record's room), into the buffer
            // grown as the bytes come.
            if self.buffer.len() < READ_CAPACITY {
                let grow = (self.record_start + need)
                    .max(self.buffer.len() * 2)
                    .max(64 << 10);
                self.buffer.resize(grow.min(READ_CAPACITY), 0);
            }
            let mut read = ReadBuf::new(&mut self.buffer[self.filled..]);
            match Pin::new(&mut self.inner).poll_read(context, &mut read) {
                Poll::Ready(Ok(())) if read.filled().is_empty() => {
                    if self.filled == self.record_start {
                        self.timer = None;
                        return Poll::Ready(Ok(()));
                    }
                    self.stats
                        .frames_rejected
                        .malformed
                        .fetch_add(1, Ordering::Relaxed);
                    return self.fail(
                        std::io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection inside a sealed record",
                    );
                }
                Poll::Ready(Ok(())) => self.filled += read.filled().len(),
                Poll::Ready(Err(error)) => {
                    self.failed = Some((error.kind(), "read failed"));
                    return Poll::Ready(Err(error));
                }
                Poll::Pending => {
                    // The clock starts when a record is seen waiting half-read (a record
                    // that arrives whole never starts it).
                    if self.filled > self.record_start && self.timer.is_none() {
                        let deadline = tokio::time::Instant::now() + self.deadline;
                        self.timer = Some(Box::pin(tokio::time::sleep_until(deadline)));
                    }
                    if let Some(timer) = self.timer.as_mut()
                        && timer.as_mut().poll(context).is_ready()
                    {
                        self.stats
                            .frames_rejected
                            .stalled
                            .fetch_add(1, Ordering::Relaxed);
                        return self.fail(
                            std::io::ErrorKind::TimedOut,
                            "a sealed record stopped half-way past the frame deadline",
                        );
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    /// Opens the whole record of `len` bytes at `record_start` in place.
    fn open(&mut self, len: usize) -> Poll<std::io::Result<()>> {
        let start = self.record_start;
        let Some(nonce) = self.direction.nonce() else {
            return self.fail(std::io::ErrorKind::InvalidData, "2^64 records on one link");
        };
        let (header, body) = self.buffer[start..start + len].split_at_mut(RECORD_HEADER);
        let aad = Aad::from([header[0], header[1], header[2], header[3]]);
        match self.direction.key.open_in_place(nonce, aad, body) {
            Ok(plain) => {
                let plain_len = plain.len();
                self.plain_start = start + RECORD_HEADER;
                self.plain_end = self.plain_start + plain_len;
                self.record_start = start + len;
                // A record that arrived whole stops the clock; the next one starts its own.
                self.timer = None;
                Poll::Ready(Ok(()))
            }
            Err(_) => {
                self.stats
                    .frames_rejected
                    .integrity
                    .fetch_add(1, Ordering::Relaxed);
                self.fail(
                    std::io::ErrorKind::InvalidData,
                    "a sealed record did not open (altered, replayed, reordered or dropped on \
                     the way, or sealed with another key)",
                )
            }
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncBufRead for OpenedReader<R> {
    fn poll_fill_buf(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<std::io::Result<&[u8]>> {
        let this = self.get_mut();
        if this.plain_start == this.plain_end {
            ready!(this.poll_record(context))?;
        }
        Poll::Ready(Ok(&this.buffer[this.plain_start..this.plain_end]))
    }

    fn consume(self: Pin<&mut Self>, amount: usize) {
        let this = self.get_mut();
        this.plain_start = (this.plain_start + amount).min(this.plain_end);
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for OpenedReader<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let available = ready!(self.as_mut().poll_fill_buf(context))?;
        let take = available.len().min(out.remaining());
        out.put_slice(&available[..take]);
        self.consume(take);
        Poll::Ready(Ok(()))
    }
}

impl<R> DecodedRows for OpenedReader<R> {}

#[cfg(test)]
mod tests;
