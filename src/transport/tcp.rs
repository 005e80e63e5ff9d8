//! [`TcpTransport`]: plain TCP, the transport every node has. Nagle is off on every socket
//! (a 1-row request must not wait for an ACK), and connects give up after a timeout.

use std::net::SocketAddr;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::net::{TcpListener, TcpStream};

use super::{PeerListener, PeerStream, Transport};

/// Default time a connect may take before it fails with `TimedOut`.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// TCP over the host network.
#[derive(Debug, Clone)]
pub struct TcpTransport {
    connect_timeout: Duration,
}

impl Default for TcpTransport {
    fn default() -> Self {
        TcpTransport::new(DEFAULT_CONNECT_TIMEOUT)
    }
}

impl TcpTransport {
    /// A transport whose connects fail after `connect_timeout`.
    pub fn new(connect_timeout: Duration) -> Self {
        TcpTransport { connect_timeout }
    }
}

impl Transport for TcpTransport {
    fn connect(
        &self,
        addr: SocketAddr,
    ) -> BoxFuture<'static, std::io::Result<Box<dyn PeerStream>>> {
        let timeout = self.connect_timeout;
        async move {
            let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
                .await
                .map_err(|_| {
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("connect to {addr} timed out after {timeout:?}"),
                    )
                })??;
            stream.set_nodelay(true)?;
            Ok(Box::new(stream) as Box<dyn PeerStream>)
        }
        .boxed()
    }

    fn bind(&self, addr: SocketAddr) -> BoxFuture<'static, std::io::Result<Box<dyn PeerListener>>> {
        async move {
            let listener = TcpListener::bind(addr).await?;
            let local_addr = listener.local_addr()?;
            Ok(Box::new(TcpPeerListener {
                listener,
                local_addr,
            }) as Box<dyn PeerListener>)
        }
        .boxed()
    }
}

struct TcpPeerListener {
    listener: TcpListener,
    local_addr: SocketAddr,
}

impl PeerListener for TcpPeerListener {
    fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    fn accept(&mut self) -> BoxFuture<'_, std::io::Result<(Box<dyn PeerStream>, SocketAddr)>> {
        async move {
            let (stream, peer) = self.listener.accept().await?;
            stream.set_nodelay(true)?;
            Ok((Box::new(stream) as Box<dyn PeerStream>, peer))
        }
        .boxed()
    }
}
