//! Frames on a link: reading one as its bytes arrive (rows converted straight from the
//! receive buffer), writing one with its rows converted a chunk at a time, and the shared
//! write half that the client and the server write frames through, from a task or directly
//! from the thread that made the frame.

use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};

use tokio::io::{
    AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt,
};

use super::{PeerStats, lock};
use crate::transport::wire::{
    self, FrameBody, FrameHeader, FrameKind, HEADER_LEN, RowsFrame, WireError, WireLimits,
};
use crate::transport::{DecodedRows, FrameWrite};

/// Bytes of the per-connection buffer rows pass through between the socket and their f32
/// values: small enough to stay in cache, large enough that a 1-row frame is one syscall.
pub(super) const CHUNK_BYTES: usize = 256 << 10;

/// Reads one frame: the header, validated, then the payload. Rows are converted straight
/// from the stream's buffer (a UCX message, or the opened bytes of a sealed record) into the
/// values, as each part arrives, so a large frame is never held twice nor copied before it
/// is converted, or come decoded by the transport ([`DecodedRows`]). `Ok(None)` is a clean
/// end of stream between frames. Public for the wire fuzz target.
pub async fn read_frame<S: AsyncBufRead + DecodedRows + Unpin>(
    stream: &mut S,
    limits: &WireLimits,
    stats: &PeerStats,
) -> Result<Option<(FrameHeader, FrameBody)>, String> {
    let Some(header) = read_header(stream, limits, stats).await? else {
        return Ok(None);
    };
    let body = read_body(stream, &header, stats).await?;
    Ok(Some((header, body)))
}

/// Waits, for as long as it takes, until the next frame begins (the link may idle between
/// frames); `false` at a clean end of stream.
pub(super) async fn frame_begins<S: AsyncBufRead + Unpin>(stream: &mut S) -> Result<bool, String> {
    match stream.fill_buf().await {
        Ok(bytes) => Ok(!bytes.is_empty()),
        Err(error) => Err(format!("read failed: {error}")),
    }
}

/// Runs `read` (a frame, or part of one, that has begun) within `deadline`; past it, the
/// frame stopped half-way: counted, and an error that closes the link.
pub(super) async fn within<T>(
    deadline: std::time::Duration,
    stats: &PeerStats,
    read: impl std::future::Future<Output = Result<T, String>>,
) -> Result<T, String> {
    match tokio::time::timeout(deadline, read).await {
        Ok(result) => result,
        Err(_) => {
            stats
                .frames_rejected
                .stalled
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Err(format!(
                "a frame stopped half-way for longer than {deadline:?}"
            ))
        }
    }
}

/// Reads and validates a frame's header; `Ok(None)` is a clean end of stream.
pub(super) async fn read_header<S: AsyncBufRead + Unpin>(
    stream: &mut S,
    limits: &WireLimits,
    stats: &PeerStats,
) -> Result<Option<FrameHeader>, String> {
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
    wire::decode_header(&header_bytes, limits)
        .map(Some)
        .map_err(|error| {
            stats.reject_frame(&error);
            format!("bad frame: {error}")
        })
}

/// The bytes of f32 rows a frame with this header carries, as the devices take them (what a
/// server connection's byte budget counts); 0 for an error frame.
pub(super) fn rows_bytes(header: &FrameHeader) -> u64 {
    if header.kind == FrameKind::Error {
        return 0;
    }
    let group_bytes = wire::groups_len(header) as u64;
    let row_bytes = u64::from(header.payload_len).saturating_sub(group_bytes);
    row_bytes / header.dtype.size() as u64 * 4
}

/// Reads the payload of the frame `header` starts. Rows are allocated as they arrive
/// (growing fourfold), never from the length the header declares: a header alone costs
/// nothing.
pub(super) async fn read_body<S: AsyncBufRead + DecodedRows + Unpin>(
    stream: &mut S,
    header: &FrameHeader,
    stats: &PeerStats,
) -> Result<FrameBody, String> {
    let header = *header;
    let body = if header.kind == FrameKind::Error {
        // At most 1 + 4 + MAX_ERROR_MESSAGE bytes (checked with the header).
        let mut payload = vec![0u8; header.payload_len as usize];
        read_payload(stream, &mut payload, &header, stats).await?;
        wire::decode_error(&payload).map(FrameBody::Error)
    } else {
        // Bounded by payload_len (checked with the header), and by what arrives.
        let mut group_bytes = vec![0u8; wire::groups_len(&header)];
        read_payload(stream, &mut group_bytes, &header, stats).await?;
        match wire::decode_groups(&header, &group_bytes) {
            Ok(groups) => 'rows: {
                let values = groups.values;
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
                let mut rows = Vec::new();
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
                    let want = whole.max(1);
                    if rows.capacity() - rows.len() < want {
                        // Fourfold growth: at most a third of the rows copied again.
                        let grow = (3 * rows.len()).max(want).min(values - rows.len());
                        rows.reserve_exact(grow);
                    }
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
    Ok(body)
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
/// the buffer goes out in one write. f32 rows are their own wire bytes on a little-endian
/// machine, so a part of at least half the buffer is written from where it is, not through
/// the buffer: the stream's write (a sealed link's record) is its one copy.
pub(super) async fn write_rows_frame<S: AsyncWrite + Unpin>(
    stream: &mut S,
    frame: &RowsFrame,
    scratch: &mut [u8],
) -> std::io::Result<()> {
    let size = frame.dtype.size();
    let half = scratch.len() / 2;
    let direct = |part: &[f32]| {
        cfg!(target_endian = "little")
            && frame.dtype == wire::Dtype::F32
            && part.len() * size >= half
    };
    let mut filled = 0;
    if frame.prefix.len() <= scratch.len() / 2 {
        scratch[..frame.prefix.len()].copy_from_slice(&frame.prefix);
        filled = frame.prefix.len();
    } else {
        stream.write_all(&frame.prefix).await?;
    }
    for part in frame.rows.as_parts() {
        if direct(part) {
            if filled > 0 {
                stream.write_all(&scratch[..filled]).await?;
                filled = 0;
            }
            stream.write_all(bytemuck::cast_slice(part)).await?;
            continue;
        }
        let mut first = 0;
        while first < part.len() {
            let count = ((scratch.len() - filled) / size).min(part.len() - first);
            wire::encode_values(
                &part[first..first + count],
                frame.dtype,
                &mut scratch[filled..filled + count * size],
            );
            first += count;
            filled += count * size;
            if scratch.len() - filled < size {
                stream.write_all(&scratch[..filled]).await?;
                filled = 0;
            }
        }
    }
    if filled > 0 {
        stream.write_all(&scratch[..filled]).await?;
    }
    // A sealed link sends its last record on flush.
    stream.flush().await
}

/// The write half of a connection, shared by the task that writes queued frames and the
/// threads that write directly when nothing is queued.
pub(super) struct WriterSlot {
    /// `None` while there is no connection (or once it is over).
    pub(super) stream: Option<Box<dyn FrameWrite>>,
    /// Frames handed to the writing task and not yet written (or failed): while any is,
    /// nothing is written directly, so frames never interleave.
    pub(super) queued: usize,
    /// Counts connections, so a frame's remainder never goes to a later connection.
    pub(super) generation: u64,
}

/// What [`send_now`] did with a frame.
pub(super) enum SentNow {
    /// Sent whole (this many bytes), or handed over whole to a stream that sends from it.
    All(usize),
    /// The first `written` bytes were taken (all of them, when only the flush waits); the
    /// rest, and the flush, wait for room.
    Part { bytes: Vec<u8>, written: usize },
    /// The stream failed, or there is none.
    Failed(Vec<u8>),
}

/// Sends a whole encoded frame from the calling thread without waiting: handed to a stream
/// that sends from the buffer itself, else written and flushed as far as the stream takes
/// it now (see [`write_now`]).
pub(super) fn send_now(slot: &mut WriterSlot, bytes: Vec<u8>) -> SentNow {
    let Some(stream) = slot.stream.as_mut() else {
        return SentNow::Failed(bytes);
    };
    let len = bytes.len();
    let bytes = match stream.send_owned(bytes) {
        Ok(()) => return SentNow::All(len),
        Err(bytes) => bytes,
    };
    match write_now(slot, &bytes) {
        Some((written, true)) if written == len => SentNow::All(len),
        Some((written, _)) => SentNow::Part { bytes, written },
        None => SentNow::Failed(bytes),
    }
}

/// Writes `bytes` now if the socket takes them, polling with a no-op waker, then flushes
/// (a sealed link's last record): when it cannot, the caller queues the remainder for the
/// writing task, which writes and flushes with its own waker before anything waits on it.
/// Returns how many bytes were taken and whether the flush went through too; `None` when
/// the stream failed or there is none.
fn write_now(slot: &mut WriterSlot, bytes: &[u8]) -> Option<(usize, bool)> {
    let stream = slot.stream.as_mut()?;
    let mut context = Context::from_waker(Waker::noop());
    let mut written = 0;
    while written < bytes.len() {
        match Pin::new(&mut *stream).poll_write(&mut context, &bytes[written..]) {
            Poll::Ready(Ok(sent)) if sent > 0 => written += sent,
            Poll::Ready(_) => return None,
            Poll::Pending => return Some((written, false)),
        }
    }
    match Pin::new(&mut *stream).poll_flush(&mut context) {
        Poll::Ready(Ok(())) => Some((written, true)),
        Poll::Ready(Err(_)) => None,
        Poll::Pending => Some((written, false)),
    }
}

/// The write half behind the link's lock, held only while one poll runs.
pub(super) struct LockedWriter<'a>(pub(super) &'a Mutex<WriterSlot>);

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
