//! The peer data plane end to end: each test is written once and runs over TCP on 127.0.0.1,
//! over UCX on 127.0.0.1 (when libucp loads: otherwise the UCX variants print SKIPPED, or fail
//! with `MOE_TEST_REQUIRE_UCX=1`) and over the in-memory network; the link-fault tests (partition, blackhole, cut) run on
//! the in-memory network only. Callers are plain std threads, the runtime lives on its own
//! worker threads, as in the node.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use moe_node::config::{PeerSection, PeerTransport};
use moe_node::transport::handshake::HandshakeError;
use moe_node::transport::peer::seal::SealedWriter;
use moe_node::transport::peer::{PeerConfig, client_handshake};

mod common;
mod sockets;
use moe_node::transport::wire::{self, HEADER_LEN};
use moe_node::transport::{
    Dtype, ExpertOutput, ExpertReply, ExpertRequest, GroupRows, Handler, MemoryNetwork, PeerAuth,
    PeerClient, PeerError, PeerSecrets, PeerServer, PeerStats, PeerStream, Rows, TcpTransport,
    Transport, UcxTransport,
};
use tokio::io::AsyncWriteExt;

/// A stream to a peer server as a test writes to it: before the handshake, or after it.
enum RawStream {
    Plain(Box<dyn PeerStream>),
    Sealed(SealedWriter<Box<dyn PeerStream>>),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Tcp,
    Ucx,
    Memory,
}

/// A UCX transport with its own worker, or `None` (after saying SKIPPED) without libucp.
fn ucx_transport() -> Option<UcxTransport> {
    match moe_node::transport::ucx::Library::load(None, true) {
        Ok(library) => {
            // CI runs these tests again against a second UCX put first on the loader's path:
            // this says it is the one that loaded.
            if let Ok(expected) = std::env::var("MOE_TEST_UCX_VERSION") {
                let loaded = library.version_string();
                assert!(
                    loaded.starts_with(&format!("{expected}.")),
                    "MOE_TEST_UCX_VERSION={expected} but UCX {loaded} loaded from {}",
                    library.file.display()
                );
            }
            Some(UcxTransport::start(library).expect("UCX starts"))
        }
        Err(why) => {
            assert!(
                std::env::var("MOE_TEST_REQUIRE_UCX").as_deref() != Ok("1"),
                "MOE_TEST_REQUIRE_UCX=1 but UCX does not load: {why}"
            );
            common::skipped(&format!("UCX variant: {why}"));
            None
        }
    }
}

const CLIENT_NODE: &str = "10.0.0.1:7000";
const SERVER_NODE: &str = "10.0.0.2:7000";

fn addr(text: &str) -> SocketAddr {
    text.parse().expect("address")
}

/// A runtime on its own threads and a pair of transports (client node, server node).
struct Rig {
    kind: Kind,
    runtime: tokio::runtime::Runtime,
    /// The runtime's threads' name, this rig's own (see [`Rig::cpu_ticks`]).
    thread_name: String,
    network: MemoryNetwork,
    /// Kind::Ucx: the server node's transport and the client node's (two workers).
    ucx: Option<(UcxTransport, UcxTransport)>,
}

impl Rig {
    fn new(kind: Kind) -> Self {
        static RIGS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let thread_name = format!(
            "rig-{}",
            RIGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(&thread_name)
            .enable_all()
            .build()
            .expect("runtime");
        Rig {
            kind,
            runtime,
            thread_name,
            network: MemoryNetwork::new(),
            ucx: None,
        }
    }

    /// A rig for `kind`; `None` for UCX where it does not load (the test is skipped).
    fn try_new(kind: Kind) -> Option<Self> {
        let mut rig = Rig::new(kind);
        if kind == Kind::Ucx {
            rig.ucx = Some((ucx_transport()?, ucx_transport()?));
        }
        Some(rig)
    }

    fn bind_addr(&self) -> SocketAddr {
        match self.kind {
            Kind::Tcp | Kind::Ucx => addr("127.0.0.1:0"),
            Kind::Memory => addr(SERVER_NODE),
        }
    }

    fn server_transport(&self) -> Arc<dyn Transport> {
        match self.kind {
            Kind::Tcp => Arc::new(TcpTransport::default()),
            Kind::Ucx => Arc::new(self.ucx.as_ref().expect("UCX rig").0.clone()),
            Kind::Memory => Arc::new(self.network.transport(addr(SERVER_NODE))),
        }
    }

    fn client_transport(&self) -> Arc<dyn Transport> {
        match self.kind {
            Kind::Tcp => Arc::new(TcpTransport::default()),
            Kind::Ucx => Arc::new(self.ucx.as_ref().expect("UCX rig").1.clone()),
            Kind::Memory => Arc::new(self.network.transport(addr(CLIENT_NODE))),
        }
    }

    /// CPU time (user + system, in clock ticks) this rig's runtime threads have used so far,
    /// and how many of them there are: other tests of this binary run beside it, so the
    /// process's own total would not say what this rig spent.
    fn cpu_ticks(&self) -> (u64, usize) {
        let mut ticks = 0;
        let mut threads = 0;
        for task in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
            let Ok(stat) = std::fs::read_to_string(task.expect("task").path().join("stat")) else {
                continue; // the thread ended meanwhile
            };
            // "tid (comm) state ppid ...": the name sits in parentheses, fields follow it.
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            if stat[open + 1..close] != self.thread_name {
                continue;
            }
            let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
            // utime and stime: fields 14 and 15 of the line, 12 and 13 after the name.
            ticks += fields[11].parse::<u64>().expect("utime")
                + fields[12].parse::<u64>().expect("stime");
            threads += 1;
        }
        (ticks, threads)
    }

    /// Over UCX, both sides moved their link onto UCX (it did not stay on the handshake's
    /// TCP connection).
    fn assert_links_moved(&self) {
        if let Some((server, client)) = &self.ucx {
            assert!(server.links_moved() >= 1, "the server's link stayed on TCP");
            assert!(client.links_moved() >= 1, "the client's link stayed on TCP");
        }
    }

    fn server_at(
        &self,
        at: SocketAddr,
        auth: PeerAuth,
        stats: &Arc<PeerStats>,
        handler: Handler,
    ) -> PeerServer {
        PeerServer::start(
            self.server_transport(),
            at,
            Arc::new(auth),
            stats.clone(),
            handler,
            self.runtime.handle().clone(),
        )
        .expect("server starts")
    }

    fn server(&self, stats: &Arc<PeerStats>, handler: Handler) -> PeerServer {
        self.server_at(
            self.bind_addr(),
            auth("server", b"cluster secret", 7),
            stats,
            handler,
        )
    }

    fn client_with(
        &self,
        server: SocketAddr,
        auth: PeerAuth,
        stats: &Arc<PeerStats>,
    ) -> PeerClient {
        PeerClient::new(
            self.client_transport(),
            self.runtime.handle().clone(),
            server,
            Arc::new(auth),
            stats.clone(),
        )
    }

    fn client(&self, server: SocketAddr, stats: &Arc<PeerStats>) -> PeerClient {
        self.client_with(server, auth("client", b"cluster secret", 7), stats)
    }

    /// A raw, authenticated (or not) stream to the server, for writing bad frames: once
    /// authenticated, what is written goes sealed with the link's keys, as a peer's frames do.
    fn raw(&self, server: SocketAddr, authenticate: bool) -> RawStream {
        let transport = self.client_transport();
        self.runtime.block_on(async move {
            let mut stream = transport.connect(server).await.expect("raw connect");
            if !authenticate {
                return RawStream::Plain(stream);
            }
            let (_, keys) = client_handshake(&mut stream, &auth("raw", b"cluster secret", 7))
                .await
                .expect("raw handshake");
            RawStream::Sealed(SealedWriter::new(stream, &keys.client_to_server))
        })
    }

    fn write_raw(&self, stream: RawStream, bytes: Vec<u8>) {
        self.runtime.block_on(async move {
            let mut stream: Box<dyn tokio::io::AsyncWrite + Unpin + Send> = match stream {
                RawStream::Plain(stream) => Box::new(stream),
                RawStream::Sealed(stream) => Box::new(stream),
            };
            let _ = stream.write_all(&bytes).await;
            let _ = stream.shutdown().await;
            // Keep the stream open a little so the server reads what it was sent.
            tokio::time::sleep(Duration::from_millis(50)).await;
        });
    }
}

fn auth(node_id: &str, secret: &[u8], model_fingerprint: u64) -> PeerAuth {
    PeerAuth {
        node_id: node_id.into(),
        secrets: PeerSecrets::new(vec![secret.to_vec()]),
        model_fingerprint,
    }
}

/// rows × 2 + expert id: checkable, and different per group.
fn double_plus_expert() -> Handler {
    Arc::new(|request: ExpertRequest| {
        let width = request.width as usize;
        // One part per group, as a node's devices answer: the reply frame is encoded from
        // the parts.
        let mut parts = Vec::with_capacity(request.groups.len());
        let mut at = 0;
        for &(expert, count) in &request.groups {
            let values = count as usize * width;
            parts.push(GroupRows::Own(
                request.rows[at..at + values]
                    .iter()
                    .map(|v| v * 2.0 + expert as f32)
                    .collect(),
            ));
            at += values;
        }
        Ok(ExpertOutput {
            groups: request.groups.clone(),
            rows: Rows::parts(parts),
        })
    })
}

fn make_request(seed: u64, dtype: Dtype) -> ExpertRequest {
    let width = 8 + (seed % 5) as u32;
    let groups: Vec<(u32, u32)> = (0..1 + seed % 4)
        .map(|g| {
            (
                (seed * 31 + g * 7) as u32 % 896,
                ((seed + g) % 3) as u32 + 1,
            )
        })
        .collect();
    let total: u32 = groups.iter().map(|g| g.1).sum();
    let rows = (0..total * width)
        .map(|i| ((i as u64 * 2654435761 + seed) % 1000) as f32 / 77.0 - 6.0)
        .collect();
    ExpertRequest {
        layer: 3,
        placement_version: 11,
        width,
        dtype,
        groups,
        rows,
        trace: None,
    }
}

/// What the handler returns, as the client must see it after the trip (bf16 rounds twice).
fn expected_rows(request: &ExpertRequest) -> Vec<f32> {
    let round = |v: f32| match request.dtype {
        Dtype::F32 => v,
        Dtype::Bf16 => half::bf16::from_f32(v).to_f32(),
    };
    let width = request.width as usize;
    let mut out = Vec::new();
    let mut at = 0;
    for &(expert, count) in &request.groups {
        let values = count as usize * width;
        out.extend(
            request.rows[at..at + values]
                .iter()
                .map(|&v| round(round(v) * 2.0 + expert as f32)),
        );
        at += values;
    }
    out
}

fn call(
    client: &PeerClient,
    request: ExpertRequest,
    wait: Duration,
) -> Result<ExpertReply, PeerError> {
    let (tx, rx) = mpsc::channel();
    client.send(
        request,
        Box::new(move |result| {
            let _ = tx.send(result);
        }),
    )?;
    rx.recv_timeout(wait)
        .expect("completion within the deadline")
}

fn assert_reply(request: &ExpertRequest, reply: &ExpertReply) {
    assert_eq!(reply.groups, request.groups);
    let expected = expected_rows(request);
    let bits = |rows: &[f32]| rows.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&reply.rows), bits(&expected), "reply rows differ");
}

fn wait_for(what: &str, deadline: Duration, condition: impl Fn() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

macro_rules! on_every_transport {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn tcp() {
                super::$name(super::Kind::Tcp);
            }
            #[test]
            fn ucx() {
                super::$name(super::Kind::Ucx);
            }
            #[test]
            fn memory() {
                super::$name(super::Kind::Memory);
            }
        }
    )*};
}

on_every_transport!(
    round_trip_f32_bit_exact_and_bf16,
    layer_sized_requests_round_trip_exactly,
    hundred_concurrent_requests_from_four_threads,
    wrong_secret_is_refused_on_both_sides,
    secrets_rotate_without_refusing_a_peer,
    wrong_model_is_refused_on_both_sides,
    server_killed_mid_request_fails_fast_then_reconnects,
    bad_frames_are_counted_and_the_server_keeps_serving,
    a_client_dropped_mid_transfer_leaves_the_server_serving,
);

/// A 256 x 7168 request (3.5 MiB of bf16, 7 MiB of f32): UCX sends it by rendezvous.
fn layer_request(seed: u32, dtype: Dtype) -> ExpertRequest {
    let width = 7168;
    ExpertRequest {
        layer: 7,
        placement_version: 2,
        width,
        dtype,
        groups: vec![(seed % 896, 256)],
        rows: (0..256 * width)
            .map(|i| ((i + seed) % 977) as f32 / 8.0)
            .collect(),
        trace: None,
    }
}

/// A client dropped while its layer-sized requests and their replies are on the wire ends
/// its link cleanly, at several points of the transfers: every completion is called once,
/// the process goes on (over UCX: no worker is destroyed under sends still in flight, which
/// UCX 1.13 answers by aborting the process), and the server serves the next client.
fn a_client_dropped_mid_transfer_leaves_the_server_serving(kind: Kind) {
    let Some(rig) = Rig::try_new(kind) else {
        return;
    };
    let stats = Arc::new(PeerStats::default());
    let server = rig.server(&stats, double_plus_expert());
    let at = server.local_addr();
    for round in 0..4u32 {
        let client = rig.client(at, &stats);
        let warm = make_request(1, Dtype::Bf16);
        let reply = call(&client, warm.clone(), Duration::from_secs(5)).expect("reply");
        assert_reply(&warm, &reply);
        let calls = Arc::new(AtomicUsize::new(0));
        for i in 0..4 {
            let dtype = if i % 2 == 0 { Dtype::Bf16 } else { Dtype::F32 };
            let calls = calls.clone();
            client
                .send(
                    layer_request(round * 4 + i, dtype),
                    Box::new(move |_| {
                        calls.fetch_add(1, Ordering::SeqCst);
                    }),
                )
                .expect("queued");
        }
        std::thread::sleep(Duration::from_millis(u64::from(round) * 3));
        drop(client);
        wait_for("every completion", Duration::from_secs(10), || {
            calls.load(Ordering::SeqCst) == 4
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            calls.load(Ordering::SeqCst),
            4,
            "a completion was called twice"
        );
    }
    let client = rig.client(at, &stats);
    let request = layer_request(99, Dtype::Bf16);
    let reply = call(&client, request.clone(), Duration::from_secs(20)).expect("reply");
    assert_reply(&request, &reply);
    rig.assert_links_moved();
}

fn round_trip_f32_bit_exact_and_bf16(kind: Kind) {
    let Some(rig) = Rig::try_new(kind) else {
        return;
    };
    let stats = Arc::new(PeerStats::default());
    let server = rig.server(&stats, double_plus_expert());
    let client_stats = Arc::new(PeerStats::default());
    let client = rig.client(server.local_addr(), &client_stats);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for seed in 0..5 {
            let mut request = make_request(seed, dtype);
            request.rows[0] = f32::MIN_POSITIVE / 7.0;
            let reply = call(&client, request.clone(), Duration::from_secs(5)).expect("reply");
            assert_reply(&request, &reply);
        }
    }
    assert!(client_stats.bytes_sent.load(Ordering::Relaxed) > 0);
    assert_eq!(
        client_stats.bytes_sent.load(Ordering::Relaxed),
        stats.bytes_received.load(Ordering::Relaxed)
    );
    rig.assert_links_moved();
}

/// Two nodes on one host talk over UCX's shared memory, not its TCP: our endpoints ask for
/// peer-failure reporting, which UCX 1.13 leaves off for shared memory unless told, and
/// without it every same-host link fell back to `tcp/lo` whatever `UCX_TLS` said. Only
/// where `UCX_TLS` leaves shared memory in (unset, or naming `shm`, `sysv` or `posix`).
#[test]
fn ucx_links_on_one_host_use_shared_memory() {
    let tls = std::env::var("UCX_TLS").unwrap_or_default();
    // A list of transports, or (`^a,b`) of transports left out.
    let (excluding, list) = match tls.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, tls.as_str()),
    };
    let names: Vec<&str> = list.split(',').map(str::trim).collect();
    let named = |wanted: &[&str]| names.iter().any(|n| wanted.contains(n));
    let shared_memory = if tls.is_empty() {
        true
    } else if excluding {
        let both = named(&["sysv"]) && named(&["posix"]);
        !(named(&["sm", "shm", "mm"]) || both)
    } else {
        named(&["all", "sm", "shm", "mm", "sysv", "posix"])
    };
    if !shared_memory {
        common::skipped(&format!("UCX_TLS={tls} leaves out shared memory"));
        return;
    }
    let Some(rig) = Rig::try_new(Kind::Ucx) else {
        return;
    };
    let stats = Arc::new(PeerStats::default());
    let server = rig.server(&stats, double_plus_expert());
    let client = rig.client(server.local_addr(), &stats);
    let request = make_request(1, Dtype::Bf16);
    let reply = call(&client, request.clone(), Duration::from_secs(5)).expect("reply");
    assert_reply(&request, &reply);
    rig.assert_links_moved();
    let (server_side, client_side) = rig.ucx.as_ref().expect("UCX rig");
    for (side, transport) in [("server", server_side), ("client", client_side)] {
        let used = transport.transports_used();
        assert!(
            used.iter()
                .any(|t| t.starts_with("sysv/") || t.starts_with("posix/")),
            "the {side}'s link uses {used:?}, no shared memory"
        );
    }
}

/// A UCX link nobody uses costs no CPU: once a transfer is done, each side's driver sleeps on
/// its worker's event fd (waking at most every 100 ms for UCX's timers) instead of polling.
/// A layer-sized request first, so the links have moved large messages (rendezvous) and
/// small ones before they go idle.
#[test]
fn an_idle_ucx_link_spends_no_cpu() {
    let Some(rig) = Rig::try_new(Kind::Ucx) else {
        return;
    };
    let stats = Arc::new(PeerStats::default());
    let server = rig.server(&stats, double_plus_expert());
    let client = rig.client(server.local_addr(), &stats);
    for request in [layer_request(0, Dtype::Bf16), make_request(1, Dtype::Bf16)] {
        let reply = call(&client, request.clone(), Duration::from_secs(20)).expect("reply");
        assert_reply(&request, &reply);
    }
    rig.assert_links_moved();
    std::thread::sleep(Duration::from_millis(300));
    let (before, threads) = rig.cpu_ticks();
    assert!(threads >= 2, "found {threads} of the rig's runtime threads");
    std::thread::sleep(Duration::from_secs(2));
    let (after, _) = rig.cpu_ticks();
    // Clock ticks are 10 ms: a driver polling without sleeping would spend about 200.
    assert!(
        after - before <= 20,
        "the idle rig's threads used {} ticks of CPU in 2 s",
        after - before
    );
    // The links still work after sleeping.
    let request = make_request(3, Dtype::Bf16);
    let reply = call(&client, request.clone(), Duration::from_secs(5)).expect("reply");
    assert_reply(&request, &reply);
}

/// The UCX context says what memory it moves (`ucp_context_query`): host memory always, and
/// CUDA memory only where the loaded UCX has its CUDA module (`ucx/libuct_cuda.so*` beside
/// libucp; Debian's libucx0 has none, PyPI's libucx-cu13 has it). A UCX that cannot move CUDA
/// memory must never be handed a device pointer: the node's transport selection
/// (`transport::select::choose`, what `serve` logs) then says GPU rows travel through pinned
/// host memory. With Debian's UCX, as CI has, that is what a user must see.
#[test]
fn a_ucx_without_cuda_moves_gpu_rows_through_host_memory() {
    let Some(transport) = ucx_transport() else {
        return;
    };
    let types = transport.memory_types();
    assert!(types.names().contains(&"host"), "{:?}", types.names());
    let modules = transport
        .library()
        .file
        .parent()
        .expect("libucp's folder")
        .join("ucx");
    let has_cuda_module = std::fs::read_dir(&modules)
        .map(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("libuct_cuda"))
        })
        .unwrap_or(false);
    let peer = PeerSection {
        transport: PeerTransport::Ucx,
        ..PeerSection::default()
    };
    let chosen = moe_node::transport::select::choose(&peer).expect("UCX is chosen");
    assert_eq!(chosen.name, "ucx", "{}", chosen.why);
    let host_staged = "no GPU memory: GPU rows travel through pinned host memory";
    if has_cuda_module {
        // A UCX with CUDA (and a driver to load) may move GPU memory: the selection says so
        // exactly when UCX lists CUDA memory.
        let lists_cuda = types.names().contains(&"cuda");
        assert_eq!(
            chosen.why.contains(host_staged),
            !lists_cuda,
            "UCX lists {:?}, the selection says: {}",
            types.names(),
            chosen.why
        );
        return;
    }
    assert_eq!(
        (types.names(), transport.takes_cuda_memory()),
        (vec!["host"], false),
        "UCX claims more than host memory without a CUDA module in {}",
        modules.display()
    );
    assert!(
        chosen.why.contains(
            "memory types host (no GPU memory: GPU rows travel through pinned host memory)"
        ),
        "a UCX without CUDA must send GPU rows through host memory, the selection says: {}",
        chosen.why
    );
}

/// Requests of one MoE layer's size and beyond, each way, and of a few rows: over UCX a
/// frame's rows go apart from its header as one message (bf16 ones converted by UCX as it
/// moves them over shared memory), by rendezvous or, for a few rows, eagerly; frames past
/// one message go as several of the writer's chunks, which must reach the reader whole and in
/// order. The rows come back bit for bit.
fn layer_sized_requests_round_trip_exactly(kind: Kind) {
    let Some(rig) = Rig::try_new(kind) else {
        return;
    };
    let stats = Arc::new(PeerStats::default());
    let server = rig.server(&stats, double_plus_expert());
    let client = rig.client(server.local_addr(), &stats);
    let width = 7168u32;
    // 3.5 MiB of bf16; 8.4 MiB of f32 (more than one UCX write); 3 groups of odd sizes;
    // 7 MiB of f32 (one message); rows of 42 and 56 KiB (eager); 14 KiB (with the header).
    for (dtype, groups) in [
        (Dtype::Bf16, vec![(5, 256)]),
        (Dtype::F32, vec![(1, 100), (700, 93), (895, 107)]),
        (Dtype::F32, vec![(3, 128), (4, 128)]),
        (Dtype::Bf16, vec![(6, 1), (7, 2)]),
        (Dtype::F32, vec![(8, 2)]),
        (Dtype::Bf16, vec![(2, 1)]),
    ] {
        let total: u32 = groups.iter().map(|g| g.1).sum();
        let rows = (0..total * width)
            .map(|i| (i % 4099) as f32 / 64.0 - 30.0)
            .collect();
        let request = ExpertRequest {
            layer: 7,
            placement_version: 2,
            width,
            dtype,
            groups,
            rows,
            trace: None,
        };
        let reply = call(&client, request.clone(), Duration::from_secs(20)).expect("reply");
        assert_reply(&request, &reply);
    }
    rig.assert_links_moved();
}

fn hundred_concurrent_requests_from_four_threads(kind: Kind) {
    let Some(rig) = Rig::try_new(kind) else {
        return;
    };
    let stats = Arc::new(PeerStats::default());
    let server = rig.server(&stats, double_plus_expert());
    let client = Arc::new(rig.client(server.local_addr(), &stats));
    let (tx, rx) = mpsc::channel();
    let threads: Vec<_> = (0..4u64)
        .map(|thread| {
            let client = client.clone();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for i in 0..25 {
                    let seed = thread * 100 + i;
                    let dtype = if i % 2 == 0 { Dtype::F32 } else { Dtype::Bf16 };
                    let request = make_request(seed, dtype);
                    let tx = tx.clone();
                    let sent = request.clone();
                    client
                        .send(
                            request,
                            Box::new(move |result| {
                                let _ = tx.send((sent, result));
                            }),
                        )
                        .expect("queued");
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("sender thread");
    }
    for _ in 0..100 {
        let (request, result) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("every request answered");
        assert_reply(&request, &result.expect("reply"));
    }
    assert!(
        rx.recv_timeout(Duration::from_millis(100)).is_err(),
        "a completion was called twice"
    );
}

fn wrong_secret_is_refused_on_both_sides(kind: Kind) {
    let Some(rig) = Rig::try_new(kind) else {
        return;
    };
    let server_stats = Arc::new(PeerStats::default());
    let server = rig.server(&server_stats, double_plus_expert());
    let client_stats = Arc::new(PeerStats::default());
    let intruder = rig.client_with(
        server.local_addr(),
        auth("intruder", b"guessed", 7),
        &client_stats,
    );
    let result = call(
        &intruder,
        make_request(1, Dtype::F32),
        Duration::from_secs(5),
    );
    // The client proves itself first: the server refuses it before proving anything.
    assert_eq!(
        result,
        Err(PeerError::Handshake(HandshakeError::RefusedByPeer))
    );
    let counted = |stats: &PeerStats| {
        stats.frames_rejected.auth_failed.load(Ordering::Relaxed) >= 1
            && stats.handshakes_failed.load(Ordering::Relaxed) >= 1
    };
    assert!(counted(&client_stats));
    wait_for(
        "the server to count the refusal",
        Duration::from_secs(2),
        || counted(&server_stats),
    );
    // The server keeps serving members.
    let member = rig.client(server.local_addr(), &Arc::new(PeerStats::default()));
    let request = make_request(2, Dtype::F32);
    assert_reply(
        &request,
        &call(&member, request.clone(), Duration::from_secs(5)).expect("reply"),
    );
}

/// Mid-rotation (every node holds both secrets, some already prove themselves with the new
/// one) peers accept each other in every combination; a node that still holds only the old
/// secret is served by nodes that accept it; once the old secret is gone from a node, a
/// peer holding only that is refused.
fn secrets_rotate_without_refusing_a_peer(kind: Kind) {
    let with = |id: &str, secret: &[u8], accepted: &[&[u8]]| PeerAuth {
        secrets: PeerSecrets::new(
            std::iter::once(secret)
                .chain(accepted.iter().copied())
                .map(<[u8]>::to_vec)
                .collect(),
        ),
        ..auth(id, secret, 7)
    };
    let (old, new): (&[u8], &[u8]) = (b"old secret", b"new secret");
    let request = make_request(3, Dtype::F32);
    if Rig::try_new(kind).is_none() {
        return;
    }
    let call_with = |server: PeerAuth, client: PeerAuth| {
        let rig = Rig::try_new(kind).expect("loaded before");
        let stats = Arc::new(PeerStats::default());
        let server = rig.server_at(rig.bind_addr(), server, &stats, double_plus_expert());
        let client = rig.client_with(server.local_addr(), client, &stats);
        call(&client, request.clone(), Duration::from_secs(5))
    };
    for (server, client) in [
        (with("s", new, &[old]), with("c", old, &[new])),
        (with("s", old, &[new]), with("c", new, &[old])),
        (with("s", old, &[]), with("c", new, &[old])),
        (with("s", new, &[old]), with("c", new, &[])),
    ] {
        let what = format!("{server:?} / {client:?}");
        let reply = call_with(server, client).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_reply(&request, &reply);
    }
    // The old secret dropped: a peer with only the old one is refused.
    assert_eq!(
        call_with(with("s", new, &[]), with("c", old, &[])).err(),
        Some(PeerError::Handshake(HandshakeError::RefusedByPeer))
    );
}

fn wrong_model_is_refused_on_both_sides(kind: Kind) {
    let Some(rig) = Rig::try_new(kind) else {
        return;
    };
    let server_stats = Arc::new(PeerStats::default());
    let server = rig.server(&server_stats, double_plus_expert());
    let client_stats = Arc::new(PeerStats::default());
    let other = rig.client_with(
        server.local_addr(),
        auth("other", b"cluster secret", 8),
        &client_stats,
    );
    let result = call(&other, make_request(1, Dtype::F32), Duration::from_secs(5));
    assert_eq!(
        result,
        Err(PeerError::Handshake(HandshakeError::WrongModel {
            ours: 8,
            theirs: 7
        }))
    );
    let message = result.expect_err("refused").to_string();
    assert!(message.contains("different model"), "{message}");
    assert_eq!(
        client_stats
            .frames_rejected
            .wrong_model
            .load(Ordering::Relaxed),
        1
    );
    wait_for(
        "the server to count the refusal",
        Duration::from_secs(2),
        || {
            server_stats
                .frames_rejected
                .wrong_model
                .load(Ordering::Relaxed)
                == 1
                && server_stats.handshakes_failed.load(Ordering::Relaxed) == 1
        },
    );
}

fn server_killed_mid_request_fails_fast_then_reconnects(kind: Kind) {
    let Some(rig) = Rig::try_new(kind) else {
        return;
    };
    let stats = Arc::new(PeerStats::default());
    let (started_tx, started_rx) = mpsc::channel::<()>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let started_tx = Mutex::new(started_tx);
    let release_rx = Mutex::new(release_rx);
    let stuck: Handler = Arc::new(move |_request| {
        let _ = started_tx.lock().expect("lock").send(());
        // Blocks like a device that never finishes, until the test lets go.
        let _ = release_rx
            .lock()
            .expect("lock")
            .recv_timeout(Duration::from_secs(10));
        Err(moe_node::transport::RemoteError::Overloaded)
    });
    let server = rig.server(&stats, stuck);
    let at = server.local_addr();
    let client = rig.client(at, &stats);
    let calls = Arc::new(AtomicUsize::new(0));
    let (done_tx, done_rx) = mpsc::channel();
    for seed in 0..3 {
        let (calls, done_tx) = (calls.clone(), done_tx.clone());
        client
            .send(
                make_request(seed, Dtype::F32),
                Box::new(move |result| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let _ = done_tx.send(result);
                }),
            )
            .expect("queued");
    }
    started_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the handler runs");
    let killed = Instant::now();
    drop(server);
    for _ in 0..3 {
        let result = done_rx
            .recv_timeout(Duration::from_secs(1))
            .expect("failed promptly");
        assert!(matches!(result, Err(PeerError::LinkDown(_))), "{result:?}");
    }
    assert!(killed.elapsed() < Duration::from_secs(1));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "a completion was called twice"
    );
    drop(release_tx);

    // The server comes back on the same address; a later send reconnects.
    let _server = rig.server_at(
        at,
        auth("server", b"cluster secret", 7),
        &stats,
        double_plus_expert(),
    );
    let start = Instant::now();
    loop {
        let request = make_request(9, Dtype::Bf16);
        match call(&client, request.clone(), Duration::from_secs(5)) {
            Ok(reply) => {
                assert_reply(&request, &reply);
                break;
            }
            Err(error) => {
                assert!(
                    start.elapsed() < Duration::from_secs(5),
                    "no reconnect: {error}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn bad_frames_are_counted_and_the_server_keeps_serving(kind: Kind) {
    let Some(rig) = Rig::try_new(kind) else {
        return;
    };
    let stats = Arc::new(PeerStats::default());
    let server = rig.server(&stats, double_plus_expert());
    let at = server.local_addr();
    let member = rig.client(at, &Arc::new(PeerStats::default()));
    let still_serving = || {
        let request = make_request(5, Dtype::F32);
        assert_reply(
            &request,
            &call(&member, request.clone(), Duration::from_secs(5)).expect("reply"),
        );
    };
    still_serving();
    let rejected = &stats.frames_rejected;

    // Garbage instead of a handshake.
    rig.write_raw(
        rig.raw(at, false),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
    );
    wait_for("bad_magic", Duration::from_secs(2), || {
        rejected.bad_magic.load(Ordering::Relaxed) == 1
    });
    still_serving();

    let frame = wire::encode_request(1, &make_request(3, Dtype::F32)).expect("encode");
    // Garbage after a good handshake.
    let mut garbage = frame.clone();
    garbage[..4].copy_from_slice(b"XXXX");
    rig.write_raw(rig.raw(at, true), garbage);
    wait_for("bad_magic after handshake", Duration::from_secs(2), || {
        rejected.bad_magic.load(Ordering::Relaxed) == 2
    });
    // A truncated frame.
    rig.write_raw(rig.raw(at, true), frame[..HEADER_LEN + 5].to_vec());
    wait_for("malformed", Duration::from_secs(2), || {
        rejected.malformed.load(Ordering::Relaxed) == 1
    });
    // An oversized length.
    let mut oversized = frame[..HEADER_LEN].to_vec();
    oversized[40..44].copy_from_slice(&u32::MAX.to_le_bytes());
    rig.write_raw(rig.raw(at, true), oversized);
    wait_for("too_large", Duration::from_secs(2), || {
        rejected.too_large.load(Ordering::Relaxed) == 1
    });
    // A wrong version.
    let mut wrong_version = frame.clone();
    wrong_version[4] = 2;
    rig.write_raw(rig.raw(at, true), wrong_version);
    wait_for("bad_version", Duration::from_secs(2), || {
        rejected.bad_version.load(Ordering::Relaxed) == 1
    });
    still_serving();
}

// ---- In-memory network only: link faults ----

fn memory_rig() -> (Rig, Arc<PeerStats>, PeerServer) {
    let rig = Rig::new(Kind::Memory);
    let stats = Arc::new(PeerStats::default());
    let server = rig.server(&stats, double_plus_expert());
    (rig, stats, server)
}

#[test]
fn partition_holds_existing_links_and_refuses_new_ones_until_healed() {
    let (rig, stats, server) = memory_rig();
    let client = rig.client(server.local_addr(), &stats);
    let request = make_request(1, Dtype::F32);
    assert_reply(
        &request,
        &call(&client, request.clone(), Duration::from_secs(5)).expect("reply"),
    );

    rig.network
        .partition(&[&[addr(CLIENT_NODE)], &[addr(SERVER_NODE)]]);
    // The existing connection goes silent: the request is held, not failed.
    let (tx, rx) = mpsc::channel();
    let held = make_request(2, Dtype::Bf16);
    client
        .send(
            held.clone(),
            Box::new(move |result| {
                let _ = tx.send(result);
            }),
        )
        .expect("queued");
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "a reply crossed the partition"
    );
    // A new connection across the partition fails at once.
    let fresh = rig.client(server.local_addr(), &stats);
    let result = call(&fresh, make_request(3, Dtype::F32), Duration::from_secs(1));
    assert!(matches!(result, Err(PeerError::Connect(_))), "{result:?}");

    rig.network.heal();
    let reply = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("delivered after heal");
    assert_reply(&held, &reply.expect("reply"));
    // The fresh client reconnects once its backoff has passed.
    std::thread::sleep(Duration::from_millis(100));
    let request = make_request(4, Dtype::F32);
    assert_reply(
        &request,
        &call(&fresh, request.clone(), Duration::from_secs(5)).expect("reply"),
    );
}

#[test]
fn blackhole_never_answers_until_close_fails_the_request() {
    let (rig, stats, server) = memory_rig();
    let client = rig.client(server.local_addr(), &stats);
    let request = make_request(1, Dtype::F32);
    assert_reply(
        &request,
        &call(&client, request.clone(), Duration::from_secs(5)).expect("reply"),
    );

    rig.network.blackhole(server.local_addr());
    let (tx, rx) = mpsc::channel();
    client
        .send(
            make_request(2, Dtype::F32),
            Box::new(move |result| {
                let _ = tx.send(result);
            }),
        )
        .expect("queued");
    assert!(
        rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "a blackholed node answered"
    );
    let closed = Instant::now();
    client.close();
    let result = rx
        .recv_timeout(Duration::from_secs(1))
        .expect("close fails it");
    assert!(matches!(result, Err(PeerError::LinkDown(_))), "{result:?}");
    assert!(closed.elapsed() < Duration::from_millis(500));
    assert!(
        rx.recv_timeout(Duration::from_millis(100)).is_err(),
        "called twice"
    );
}

#[test]
fn cut_fails_every_outstanding_request_exactly_once() {
    let rig = Rig::new(Kind::Memory);
    let stats = Arc::new(PeerStats::default());
    let inner = double_plus_expert();
    let slow: Handler = Arc::new(move |request| {
        std::thread::sleep(Duration::from_millis(20));
        inner(request)
    });
    let server = rig.server(&stats, slow);
    let client = rig.client(server.local_addr(), &stats);
    let calls: Arc<Mutex<HashMap<u64, usize>>> = Arc::default();
    let outcomes = Arc::new(AtomicU64::new(0));
    for seed in 0..200u64 {
        let (calls, outcomes) = (calls.clone(), outcomes.clone());
        let request = make_request(seed, Dtype::F32);
        let expected = request.clone();
        client
            .send(
                request,
                Box::new(move |result| {
                    match result {
                        Ok(reply) => assert_reply(&expected, &reply),
                        Err(PeerError::LinkDown(_)) => {}
                        Err(other) => panic!("unexpected {other}"),
                    }
                    *calls.lock().expect("lock").entry(seed).or_default() += 1;
                    outcomes.fetch_add(1, Ordering::SeqCst);
                }),
            )
            .expect("queued");
        if seed == 100 {
            std::thread::sleep(Duration::from_millis(30));
            rig.network.cut(addr(CLIENT_NODE), server.local_addr());
        }
    }
    wait_for("every completion", Duration::from_secs(10), || {
        outcomes.load(Ordering::SeqCst) == 200
    });
    std::thread::sleep(Duration::from_millis(200));
    let calls = calls.lock().expect("lock");
    assert_eq!(calls.len(), 200);
    assert!(
        calls.values().all(|&count| count == 1),
        "a completion was called twice"
    );
}

#[test]
fn full_queue_is_overloaded_at_once_and_close_fails_the_rest() {
    let (rig, stats, server) = memory_rig();
    let config = PeerConfig {
        queue_capacity: 2,
        ..PeerConfig::default()
    };
    let client = PeerClient::with_config(
        rig.client_transport(),
        rig.runtime.handle().clone(),
        server.local_addr(),
        Arc::new(auth("client", b"cluster secret", 7)),
        stats.clone(),
        config,
    );
    let request = make_request(1, Dtype::F32);
    assert_reply(
        &request,
        &call(&client, request.clone(), Duration::from_secs(5)).expect("reply"),
    );
    rig.network.blackhole(server.local_addr());
    // 1 MiB requests fill the held pipes, then the queue.
    let big = ExpertRequest {
        layer: 0,
        placement_version: 0,
        width: 1024,
        dtype: Dtype::F32,
        groups: vec![(0, 256)],
        rows: vec![1.0; 256 * 1024],
        trace: None,
    };
    let (tx, rx) = mpsc::channel();
    let mut queued = 0;
    let mut overloaded = false;
    for _ in 0..64 {
        let tx = tx.clone();
        let start = Instant::now();
        match client.send(
            big.clone(),
            Box::new(move |result| {
                let _ = tx.send(result);
            }),
        ) {
            Ok(()) => queued += 1,
            Err(PeerError::Overloaded) => {
                assert!(start.elapsed() < Duration::from_millis(100), "send blocked");
                overloaded = true;
                break;
            }
            Err(other) => panic!("unexpected {other}"),
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(overloaded, "the queue never filled");
    client.close();
    for _ in 0..queued {
        let result = rx
            .recv_timeout(Duration::from_secs(2))
            .expect("every queued request fails");
        assert!(matches!(result, Err(PeerError::LinkDown(_))), "{result:?}");
    }
}

#[test]
fn inconsistent_or_oversized_requests_are_refused_locally() {
    let (rig, stats, server) = memory_rig();
    let config = PeerConfig {
        limits: wire::WireLimits {
            max_payload: 1 << 10,
            ..wire::WireLimits::default()
        },
        ..PeerConfig::default()
    };
    let client = PeerClient::with_config(
        rig.client_transport(),
        rig.runtime.handle().clone(),
        server.local_addr(),
        Arc::new(auth("client", b"cluster secret", 7)),
        stats.clone(),
        config,
    );
    let mut short = make_request(1, Dtype::F32);
    short.rows.pop();
    let refused = client.send(short, Box::new(|_| panic!("never called")));
    assert!(
        matches!(refused, Err(PeerError::BadRequest(_))),
        "{refused:?}"
    );
    let big = ExpertRequest {
        groups: vec![(0, 64)],
        rows: vec![0.0; 64 * 8],
        width: 8,
        ..make_request(2, Dtype::F32)
    };
    let refused = client.send(big, Box::new(|_| panic!("never called")));
    assert!(
        matches!(refused, Err(PeerError::BadRequest(_))),
        "{refused:?}"
    );
    let request = make_request(3, Dtype::F32);
    assert_reply(
        &request,
        &call(&client, request.clone(), Duration::from_secs(5)).expect("reply"),
    );
}

/// Junk (random bytes, an HTTP request, a truncated handshake, 64 KiB of 0xff, an empty
/// connection) at the peer port and at every TCP port this process listens on once a link
/// is over UCX (UCX's own transports listen too: `ss -ltnp` shows them) kills nothing: the
/// link keeps working and a new one comes up. Runs in a child process of its own, so the
/// junk reaches no other test's ports and an abort inside UCX shows as the child's signal.
#[test]
fn junk_at_every_listening_port_leaves_ucx_links_working() {
    if Rig::try_new(Kind::Ucx).is_none() {
        return;
    }
    let child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "junk_child", "--nocapture", "--test-threads=1"])
        .env("MOE_TEST_JUNK_CHILD", "1")
        .env("RUST_LOG", "warn")
        .output()
        .expect("child runs");
    let output = String::from_utf8_lossy(&child.stdout).into_owned()
        + &String::from_utf8_lossy(&child.stderr);
    eprintln!("{output}");
    assert!(
        child.status.success(),
        "child: {:?}\n{output}",
        child.status
    );
    assert!(
        output.contains("junk_child ... ok") || output.contains("1 passed"),
        "{output}"
    );
}

/// The child of [`junk_at_every_listening_port_leaves_ucx_links_working`]; a no-op unless
/// started by it.
#[test]
fn junk_child() {
    if std::env::var("MOE_TEST_JUNK_CHILD").as_deref() != Ok("1") {
        return;
    }
    let rig = Rig::try_new(Kind::Ucx).expect("UCX loads in the child");
    let stats = Arc::new(PeerStats::default());
    let server = rig.server(&stats, double_plus_expert());
    let client = rig.client(server.local_addr(), &stats);
    let request = make_request(1, Dtype::F32);
    assert_reply(
        &request,
        &call(&client, request.clone(), Duration::from_secs(5)).expect("reply"),
    );
    rig.assert_links_moved();
    let ports = sockets::listening(std::process::id());
    eprintln!("listening: {ports:?} (peer port {})", server.local_addr());
    assert!(ports.contains(&server.local_addr()), "{ports:?}");
    // MOE_TEST_JUNK_ROUNDS=200 throws 200 different random buffers (and the rest) at each.
    let rounds = std::env::var("MOE_TEST_JUNK_ROUNDS")
        .ok()
        .and_then(|rounds| rounds.parse().ok())
        .unwrap_or(1);
    for port in &ports {
        let accepted = sockets::throw_junk(*port, rounds);
        eprintln!("junk to {port}: {accepted} connections");
    }
    std::thread::sleep(Duration::from_millis(500));
    assert_reply(
        &request,
        &call(&client, request.clone(), Duration::from_secs(5)).expect("old link"),
    );
    let fresh = rig.client(server.local_addr(), &stats);
    assert_reply(
        &request,
        &call(&fresh, request.clone(), Duration::from_secs(5)).expect("new link"),
    );
    let (server_side, client_side) = rig.ucx.as_ref().expect("UCX rig");
    assert!(server_side.links_moved() >= 2 && client_side.links_moved() >= 2);
    assert!(
        stats.handshakes_failed.load(Ordering::Relaxed) >= 1,
        "the peer port saw the junk"
    );
}

/// A cluster whose nodes disagree on `peer.transport`: a TCP client at a UCX node, and a UCX
/// client at a TCP node, both work, over TCP (the UCX side offers UCX, the TCP side offers
/// nothing, so the link stays on the handshake's connection).
#[test]
fn mixed_transports_talk_over_tcp() {
    let Some(rig) = Rig::try_new(Kind::Ucx) else {
        return;
    };
    let stats = Arc::new(PeerStats::default());
    let ucx_server = rig.server(&stats, double_plus_expert());
    let tcp_server = PeerServer::start(
        Arc::new(TcpTransport::default()),
        addr("127.0.0.1:0"),
        Arc::new(auth("server", b"cluster secret", 7)),
        stats.clone(),
        double_plus_expert(),
        rig.runtime.handle().clone(),
    )
    .expect("TCP server starts");
    let tcp_client = PeerClient::new(
        Arc::new(TcpTransport::default()),
        rig.runtime.handle().clone(),
        ucx_server.local_addr(),
        Arc::new(auth("client", b"cluster secret", 7)),
        stats.clone(),
    );
    let ucx_client = rig.client(tcp_server.local_addr(), &stats);
    for (what, client) in [("TCP to UCX", &tcp_client), ("UCX to TCP", &ucx_client)] {
        let request = make_request(1, Dtype::F32);
        let reply = call(client, request.clone(), Duration::from_secs(10));
        assert_reply(&request, &reply.unwrap_or_else(|e| panic!("{what}: {e:?}")));
    }
    let (server, client) = rig.ucx.as_ref().expect("UCX rig");
    assert_eq!((server.links_moved(), client.links_moved()), (0, 0));
}
