//! How activations travel between nodes: the [`Transport`] seam (TCP, and an in-memory twin
//! for tests), the framed wire format, and the peer client and server that speak it.
//!
//! - [`wire`]: the data-plane frame format (pure, fuzzable).
//! - [`handshake`]: the keyed peer handshake messages and proofs (pure).
//! - [`tcp`]: [`TcpTransport`], the transport every node has.
//! - [`ucx`]: [`UcxTransport`], UCX (shared memory, RDMA, TCP) when libucp loads.
//! - [`select`]: which of the two `peer.transport` and the machine give.
//! - [`memory`]: [`MemoryTransport`], an in-memory network whose links tests can cut,
//!   partition, delay and blackhole.
//! - [`peer`]: [`PeerClient`] and [`PeerServer`], the protocol over any transport.
//!
//! Adding a transport: implement [`Transport`] (`connect` and `bind` give byte streams, on
//! which the peer handshake authenticates both sides) and [`PeerStream`] for its stream. The
//! peer protocol reads and writes every link as one byte stream of sealed records
//! (`peer/seal.rs`), so a transport's own halves (`into_halves`, and the copies
//! [`FrameRead`] and [`FrameWrite`] let it spare) are not used by sealed links. A transport whose fast path needs
//! the peer authenticated first (as UCX's does) keeps `connect`/`bind` on TCP and offers the
//! path from [`Transport::upgrade`]: a [`LinkUpgrade`] of a new [`LinkKind`], whose code and
//! address the handshake carries as they are. Then say when to choose it in [`select`], and
//! add it to `on_every_transport!` in `tests/transport.rs`, which runs the whole peer
//! protocol suite over each transport.

pub mod handshake;
mod memory;
pub mod peer;
pub mod select;
mod tcp;
pub mod ucx;
pub mod wire;

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tokio::io::{AsyncBufRead, AsyncRead, AsyncWrite, BufReader, WriteHalf};

pub use memory::{MemoryNetwork, MemoryTransport};
pub use peer::{
    Completion, Handler, PeerAuth, PeerClient, PeerConfig, PeerError, PeerSecrets, PeerServer,
    PeerStats,
};
pub use tcp::TcpTransport;
pub use ucx::UcxTransport;
pub use wire::{
    Dtype, ExpertOutput, ExpertReply, ExpertRequest, GroupRows, RemoteError, Rows, RowsFrame,
    WIRE_VERSION,
};

/// A connected byte stream to a peer.
pub trait PeerStream: AsyncRead + AsyncWrite + Send + Unpin + 'static {
    /// The stream's halves as the peer protocol drives them once the handshake is over: a
    /// reader that shows received bytes in place, and a writer that may take whole frames.
    fn into_halves(self: Box<Self>) -> (Box<dyn FrameRead>, Box<dyn FrameWrite>);
}

/// A link's read half: frames are decoded from the bytes where they were received (a UCX
/// message's buffer; a buffer of [`READ_BUFFER`] bytes over a socket), or their rows come
/// already decoded by the transport ([`DecodedRows`]).
pub trait FrameRead: AsyncBufRead + DecodedRows + Send + Unpin + 'static {}

impl<T: AsyncBufRead + DecodedRows + Send + Unpin + 'static> FrameRead for T {}

/// A read half whose transport may hand over a frame's rows already decoded (UCX decodes
/// them as it receives them, see [`FrameWrite::send_rows`]).
pub trait DecodedRows {
    /// Once a frame's header and groups are read: its `values` rows, in `dtype` on the
    /// wire, as the transport decoded them (`Ready(Ok(Some))`), or `Ready(Ok(None))` when
    /// they follow as bytes in the stream (always, over a socket). An `InvalidData` error
    /// when the peer sent rows of another length or dtype.
    fn poll_decoded_rows(
        self: Pin<&mut Self>,
        _context: &mut Context<'_>,
        _values: usize,
        _dtype: Dtype,
    ) -> Poll<std::io::Result<Option<Vec<f32>>>> {
        Poll::Ready(Ok(None))
    }
}

impl<T: AsyncRead> DecodedRows for BufReader<T> {}

impl<T: DecodedRows + Unpin + ?Sized> DecodedRows for Box<T> {
    fn poll_decoded_rows(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        values: usize,
        dtype: Dtype,
    ) -> Poll<std::io::Result<Option<Vec<f32>>>> {
        Pin::new(&mut **self.get_mut()).poll_decoded_rows(context, values, dtype)
    }
}

/// A link's write half.
pub trait FrameWrite: AsyncWrite + Send + Unpin + 'static {
    /// Sends a whole encoded frame from `frame` itself, sparing the copy a write makes, where
    /// the stream can (UCX), without waiting; gives it back untouched where it cannot (or
    /// the link failed), to be written. A frame taken is sent as a write's bytes would be:
    /// in order, its failure the link's.
    fn send_owned(&mut self, frame: Vec<u8>) -> Result<(), Vec<u8>> {
        Err(frame)
    }

    /// Sends a frame with its rows as they are, converted to the wire dtype by the
    /// transport as it moves them and handed to the peer's reader decoded
    /// ([`DecodedRows`]), where the stream can (UCX, for frames whose rows are larger than
    /// [`ROWS_APART_MIN`]), without waiting; gives it back untouched where it cannot, to be
    /// encoded and written. As for [`FrameWrite::send_owned`], a frame taken is sent in
    /// order, its failure the link's.
    fn send_rows(&mut self, frame: RowsFrame) -> Result<(), RowsFrame> {
        Err(frame)
    }
}

/// Wire bytes of rows past which a frame's rows go apart from its header
/// ([`FrameWrite::send_rows`]): for fewer, one message for the whole frame costs less than
/// two (one token of a 7168-wide model, 14 KiB in bf16, goes whole).
pub const ROWS_APART_MIN: usize = 32 << 10;

impl<T: AsyncWrite + Send + Unpin + 'static> FrameWrite for WriteHalf<T> {}

/// Bytes a socket's read half reads at once (the peer protocol decodes rows from them).
pub const READ_BUFFER: usize = 256 << 10;

/// `stream`'s halves over tokio's split, the reader buffered (for streams that have no
/// halves of their own).
fn buffered_halves<T: PeerStream>(stream: T) -> (Box<dyn FrameRead>, Box<dyn FrameWrite>) {
    let (read, write) = tokio::io::split(stream);
    (
        Box::new(BufReader::with_capacity(READ_BUFFER, read)),
        Box::new(write),
    )
}

impl PeerStream for tokio::net::TcpStream {
    fn into_halves(self: Box<Self>) -> (Box<dyn FrameRead>, Box<dyn FrameWrite>) {
        buffered_halves(*self)
    }
}

impl PeerStream for tokio::io::DuplexStream {
    fn into_halves(self: Box<Self>) -> (Box<dyn FrameRead>, Box<dyn FrameWrite>) {
        buffered_halves(*self)
    }
}

/// How to get a byte stream to a peer.
///
/// Every link starts on the stream `connect` and `bind` give (TCP for the TCP and UCX
/// transports), where the peer handshake authenticates both sides. A transport with a faster
/// path then offers [`Transport::upgrade`]: when both sides offer one, the link's frames move
/// to it (see [`handshake`]).
pub trait Transport: Send + Sync + 'static {
    /// Opens a stream to `addr` (the transport applies its own connect timeout).
    fn connect(&self, addr: SocketAddr)
    -> BoxFuture<'static, std::io::Result<Box<dyn PeerStream>>>;
    /// Listens on `addr` (port 0 picks a free port; see [`PeerListener::local_addr`]).
    fn bind(&self, addr: SocketAddr) -> BoxFuture<'static, std::io::Result<Box<dyn PeerListener>>>;
    /// Another path this transport could move an authenticated link to: `Ok(None)` when it
    /// has none (the default), `Err` when it has one but cannot offer it now (said in the log;
    /// the link stays on its stream).
    fn upgrade(&self) -> BoxFuture<'static, std::io::Result<Option<Box<dyn LinkUpgrade>>>> {
        Box::pin(async { Ok(None) })
    }
}

/// The paths a link can move to after its handshake, each with the byte that names it in a
/// link offer ([`handshake::LinkOffer`]). The handshake carries a path's kind and address
/// without knowing what they mean; a link moves only when both sides offer the same kind.
///
/// A transport with a new path adds its kind here, with a code no other kind has (0 is
/// taken: "stay on the handshake's stream"), and returns it from [`LinkUpgrade::kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkKind {
    /// UCX, reached at a worker's address (`ucp_worker_get_address`).
    Ucx,
}

impl LinkKind {
    /// Every kind, for reading a code back.
    const ALL: [LinkKind; 1] = [LinkKind::Ucx];

    /// The kind's byte in a link offer (never 0).
    pub fn code(self) -> u8 {
        match self {
            LinkKind::Ucx => 1,
        }
    }

    /// The kind a link offer's byte names, if this build knows it.
    pub fn from_code(code: u8) -> Option<LinkKind> {
        LinkKind::ALL.into_iter().find(|kind| kind.code() == code)
    }

    /// The path's name, for logs ("ucx").
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::Ucx => "ucx",
        }
    }
}

/// One side's offer of another path for one link, made before the peer answered.
pub trait LinkUpgrade: Send {
    /// Which path this is: the peer must offer the same kind for the link to move.
    fn kind(&self) -> LinkKind;
    /// What the peer needs to reach this side (a UCX worker address).
    fn address(&self) -> &[u8];
    /// Creates this side's end toward the peer's `address`.
    fn connect(&mut self, address: &[u8]) -> BoxFuture<'_, std::io::Result<()>>;
    /// The link's stream, once both sides' ends are made. `control` is the handshake's
    /// stream: nothing more travels on it, and its end (the peer exited or dropped the link)
    /// ends the link.
    fn into_stream(self: Box<Self>, control: Box<dyn PeerStream>) -> Box<dyn PeerStream>;
}

/// A bound listening endpoint.
pub trait PeerListener: Send {
    /// The address peers connect to.
    fn local_addr(&self) -> SocketAddr;
    /// Waits for the next incoming stream and the peer's address.
    fn accept(&mut self) -> BoxFuture<'_, std::io::Result<(Box<dyn PeerStream>, SocketAddr)>>;
}
