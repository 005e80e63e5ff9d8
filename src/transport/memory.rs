//! [`MemoryTransport`]: an in-memory network for tests, built on `tokio::io::duplex`, whose
//! links a shared [`MemoryNetwork`] controller can cut, partition, delay and blackhole.
//!
//! Every endpoint is a node address (a `SocketAddr`; fake addresses such as 10.0.0.1:7000 are
//! fine). A [`MemoryTransport`] belongs to one node: its connections originate from that
//! node, and the listeners it binds are owned by it. Controller calls take node addresses
//! (a listening address is mapped to the node that bound it).
//!
//! Each connection is two duplex pipes joined by one pump task per direction; the pumps ask
//! the controller, chunk by chunk, whether bytes may be delivered. The behaviours:
//!
//! - `cut(a, b)`: every existing connection between `a` and `b` is reset now (both ends read
//!   EOF, writes fail with `BrokenPipe`). New connections are allowed.
//! - `partition(groups)`: nodes in different groups cannot reach each other. A connect across
//!   the partition fails at once with `TimedOut` (a deterministic stand-in for a SYN that is
//!   never answered). Existing connections across it go silent: bytes (and EOF) are held, as
//!   in a real partition, and flow again on `heal()`. Nodes in no group are unaffected.
//! - `delay(a, b, d)`: every chunk between `a` and `b` is held for `d` before delivery (one
//!   chunk at a time, so throughput drops too; the model is latency per write, not a link).
//! - `blackhole(addr)`: a SIGSTOPped process. Connects to it succeed and its listener still
//!   accepts, but no bytes to or from it are delivered (they are held) until `restore(addr)`
//!   or `heal()`.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, ReadHalf, WriteHalf};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use super::{PeerListener, PeerStream, Transport};

/// Bytes buffered in each direction of each pipe.
const PIPE_BUFFER: usize = 256 * 1024;
/// Largest chunk a pump moves at once.
const CHUNK: usize = 64 * 1024;
/// Connections waiting to be accepted per listener.
const BACKLOG: usize = 128;
/// First port handed out for port-0 binds.
const FIRST_EPHEMERAL_PORT: u16 = 40_000;

/// The controller of an in-memory network; clone it freely.
#[derive(Clone, Default)]
pub struct MemoryNetwork {
    net: Arc<Net>,
}

struct Net {
    state: Mutex<NetState>,
    /// Bumped on every policy change; held pumps wait on it.
    changed: watch::Sender<u64>,
}

impl Default for Net {
    fn default() -> Self {
        Net {
            state: Mutex::new(NetState::default()),
            changed: watch::channel(0).0,
        }
    }
}

#[derive(Default)]
struct NetState {
    listeners: HashMap<SocketAddr, ListenerEntry>,
    next_port: u16,
    next_connection: u64,
    connections: HashMap<u64, Connection>,
    partition_group: HashMap<SocketAddr, usize>,
    delays: HashMap<(SocketAddr, SocketAddr), Duration>,
    blackholed: HashSet<SocketAddr>,
}

struct ListenerEntry {
    owner: SocketAddr,
    incoming: mpsc::Sender<(Box<dyn PeerStream>, SocketAddr)>,
}

struct Connection {
    client: SocketAddr,
    server: SocketAddr,
    pumps: [AbortHandle; 2],
}

enum Verdict {
    Deliver(Duration),
    Hold,
}

fn pair(a: SocketAddr, b: SocketAddr) -> (SocketAddr, SocketAddr) {
    if a <= b { (a, b) } else { (b, a) }
}

impl NetState {
    fn node_of(&self, addr: SocketAddr) -> SocketAddr {
        self.listeners.get(&addr).map_or(addr, |entry| entry.owner)
    }

    fn partitioned(&self, a: SocketAddr, b: SocketAddr) -> bool {
        match (self.partition_group.get(&a), self.partition_group.get(&b)) {
            (Some(x), Some(y)) => x != y,
            _ => false,
        }
    }

    fn verdict(&self, from: SocketAddr, to: SocketAddr) -> Verdict {
        if self.blackholed.contains(&from)
            || self.blackholed.contains(&to)
            || self.partitioned(from, to)
        {
            return Verdict::Hold;
        }
        Verdict::Deliver(
            self.delays
                .get(&pair(from, to))
                .copied()
                .unwrap_or_default(),
        )
    }
}

impl Net {
    fn lock(&self) -> MutexGuard<'_, NetState> {
        // A panic while holding the lock leaves plain data behind; keep using it.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn policy_changed(&self) {
        self.changed.send_modify(|generation| *generation += 1);
    }

    /// Waits until bytes from `from` to `to` may be delivered, including the link delay.
    async fn wait_deliverable(&self, from: SocketAddr, to: SocketAddr) -> bool {
        let mut changes = self.changed.subscribe();
        loop {
            changes.borrow_and_update();
            let verdict = self.lock().verdict(from, to);
            match verdict {
                Verdict::Deliver(delay) => {
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    return true;
                }
                Verdict::Hold => {
                    if changes.changed().await.is_err() {
                        return false;
                    }
                }
            }
        }
    }
}

impl MemoryNetwork {
    /// An empty network.
    pub fn new() -> Self {
        MemoryNetwork::default()
    }

    /// The transport of node `node`: connects originate from it, binds belong to it.
    pub fn transport(&self, node: SocketAddr) -> MemoryTransport {
        MemoryTransport {
            net: self.net.clone(),
            node,
        }
    }

    /// Resets every existing connection between nodes `a` and `b`.
    pub fn cut(&self, a: SocketAddr, b: SocketAddr) {
        let mut state = self.net.lock();
        let (a, b) = (state.node_of(a), state.node_of(b));
        let target = pair(a, b);
        state.connections.retain(|_, connection| {
            if pair(connection.client, connection.server) == target {
                connection.pumps.iter().for_each(AbortHandle::abort);
                false
            } else {
                true
            }
        });
    }

    /// Splits the listed nodes into groups that cannot reach each other (replaces any
    /// previous partition).
    pub fn partition(&self, groups: &[&[SocketAddr]]) {
        {
            let mut state = self.net.lock();
            let mut assignment = HashMap::new();
            for (index, group) in groups.iter().enumerate() {
                for &addr in group.iter() {
                    assignment.insert(state.node_of(addr), index);
                }
            }
            state.partition_group = assignment;
        }
        self.net.policy_changed();
    }

    /// Ends the partition and every blackhole; held bytes flow again. Delays stay.
    pub fn heal(&self) {
        {
            let mut state = self.net.lock();
            state.partition_group.clear();
            state.blackholed.clear();
        }
        self.net.policy_changed();
    }

    /// Holds every chunk between `a` and `b` for `delay` (zero removes the delay).
    pub fn delay(&self, a: SocketAddr, b: SocketAddr, delay: Duration) {
        {
            let mut state = self.net.lock();
            let key = pair(state.node_of(a), state.node_of(b));
            if delay.is_zero() {
                state.delays.remove(&key);
            } else {
                state.delays.insert(key, delay);
            }
        }
        self.net.policy_changed();
    }

    /// Freezes node `addr` like a SIGSTOPped process: connects succeed, nothing comes back.
    pub fn blackhole(&self, addr: SocketAddr) {
        {
            let mut state = self.net.lock();
            let node = state.node_of(addr);
            state.blackholed.insert(node);
        }
        self.net.policy_changed();
    }

    /// Thaws a blackholed node (SIGCONT): held bytes are delivered.
    pub fn restore(&self, addr: SocketAddr) {
        {
            let mut state = self.net.lock();
            let node = state.node_of(addr);
            state.blackholed.remove(&node);
        }
        self.net.policy_changed();
    }
}

/// One node's view of a [`MemoryNetwork`].
#[derive(Clone)]
pub struct MemoryTransport {
    net: Arc<Net>,
    node: SocketAddr,
}

impl MemoryTransport {
    /// The node this transport belongs to.
    pub fn node(&self) -> SocketAddr {
        self.node
    }
}

fn refused(addr: SocketAddr) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        format!("nothing listens on {addr} in the memory network"),
    )
}

impl Transport for MemoryTransport {
    fn connect(
        &self,
        addr: SocketAddr,
    ) -> BoxFuture<'static, std::io::Result<Box<dyn PeerStream>>> {
        let net = self.net.clone();
        let client = self.node;
        async move {
            let mut state = net.lock();
            let (server, incoming) = match state.listeners.get(&addr) {
                Some(entry) => (entry.owner, entry.incoming.clone()),
                None => return Err(refused(addr)),
            };
            if state.partitioned(client, server) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("{addr} is across a network partition from {client}"),
                ));
            }
            let (client_end, client_pipe) = tokio::io::duplex(PIPE_BUFFER);
            let (server_end, server_pipe) = tokio::io::duplex(PIPE_BUFFER);
            incoming
                .try_send((Box::new(server_end), client))
                .map_err(|_| refused(addr))?;
            let (client_read, client_write) = tokio::io::split(client_pipe);
            let (server_read, server_write) = tokio::io::split(server_pipe);
            let upstream =
                tokio::spawn(pump(net.clone(), client_read, server_write, client, server));
            let downstream =
                tokio::spawn(pump(net.clone(), server_read, client_write, server, client));
            state
                .connections
                .retain(|_, connection| connection.pumps.iter().any(|pump| !pump.is_finished()));
            let id = state.next_connection;
            state.next_connection += 1;
            state.connections.insert(
                id,
                Connection {
                    client,
                    server,
                    pumps: [upstream.abort_handle(), downstream.abort_handle()],
                },
            );
            Ok(Box::new(client_end) as Box<dyn PeerStream>)
        }
        .boxed()
    }

    fn bind(&self, addr: SocketAddr) -> BoxFuture<'static, std::io::Result<Box<dyn PeerListener>>> {
        let net = self.net.clone();
        let owner = self.node;
        async move {
            let mut state = net.lock();
            let mut local_addr = addr;
            if addr.port() == 0 {
                if state.next_port < FIRST_EPHEMERAL_PORT {
                    state.next_port = FIRST_EPHEMERAL_PORT;
                }
                loop {
                    local_addr.set_port(state.next_port);
                    state.next_port = state
                        .next_port
                        .checked_add(1)
                        .unwrap_or(FIRST_EPHEMERAL_PORT);
                    if !state.listeners.contains_key(&local_addr) {
                        break;
                    }
                }
            } else if state.listeners.contains_key(&addr) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("{addr} is already bound in the memory network"),
                ));
            }
            let (incoming, accepted) = mpsc::channel(BACKLOG);
            state
                .listeners
                .insert(local_addr, ListenerEntry { owner, incoming });
            Ok(Box::new(MemoryListener {
                net: net.clone(),
                local_addr,
                accepted,
            }) as Box<dyn PeerListener>)
        }
        .boxed()
    }
}

async fn pump(
    net: Arc<Net>,
    mut source: ReadHalf<DuplexStream>,
    mut sink: WriteHalf<DuplexStream>,
    from: SocketAddr,
    to: SocketAddr,
) {
    let mut buffer = vec![0u8; CHUNK];
    loop {
        let read = match source.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if !net.wait_deliverable(from, to).await {
            return;
        }
        if sink.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
    // The end of the stream is held by a partition like any byte.
    if net.wait_deliverable(from, to).await {
        let _ = sink.shutdown().await;
    }
}

struct MemoryListener {
    net: Arc<Net>,
    local_addr: SocketAddr,
    accepted: mpsc::Receiver<(Box<dyn PeerStream>, SocketAddr)>,
}

impl PeerListener for MemoryListener {
    fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    fn accept(&mut self) -> BoxFuture<'_, std::io::Result<(Box<dyn PeerStream>, SocketAddr)>> {
        async move {
            self.accepted.recv().await.ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::NotConnected, "memory listener closed")
            })
        }
        .boxed()
    }
}

impl Drop for MemoryListener {
    fn drop(&mut self) {
        self.net.lock().listeners.remove(&self.local_addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn addr(text: &str) -> SocketAddr {
        text.parse().expect("address")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bytes_flow_are_delayed_held_and_cut() {
        let network = MemoryNetwork::new();
        let (a, b) = (addr("10.0.0.1:7000"), addr("10.0.0.2:7000"));
        let mut listener = network.transport(b).bind(b).await.expect("bind");
        assert!(
            network
                .transport(a)
                .connect(addr("10.0.0.9:1"))
                .await
                .is_err()
        );
        let mut client = network.transport(a).connect(b).await.expect("connect");
        let (mut server, from) = listener.accept().await.expect("accept");
        assert_eq!(from, a);

        network.delay(a, b, Duration::from_millis(50));
        let start = Instant::now();
        client.write_all(b"ping").await.expect("write");
        let mut got = [0u8; 4];
        server.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"ping");
        assert!(start.elapsed() >= Duration::from_millis(50));
        network.delay(a, b, Duration::ZERO);

        network.partition(&[&[a], &[b]]);
        assert!(network.transport(a).connect(b).await.is_err());
        server.write_all(b"pong").await.expect("write");
        let held =
            tokio::time::timeout(Duration::from_millis(100), client.read_exact(&mut got)).await;
        assert!(held.is_err(), "bytes crossed a partition");
        network.heal();
        client.read_exact(&mut got).await.expect("read after heal");
        assert_eq!(&got, b"pong");

        network.cut(a, b);
        let mut rest = Vec::new();
        let read =
            tokio::time::timeout(Duration::from_secs(1), client.read_to_end(&mut rest)).await;
        assert!(matches!(read, Ok(Ok(0))), "cut did not reset: {read:?}");
    }
}
