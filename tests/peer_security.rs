//! The peer link against an attacker on the network and a peer that misbehaves, over real
//! TCP sockets on loopback: a relay between a client and a server that alters, replays,
//! reorders and cuts the sealed records after the handshake (knowing their layout), or
//! changes a link offer inside it; a client
//! without the secret, which must get nothing computed from the secret and its nonce; peers
//! that declare huge frames, hold frames half-way and open many connections, against the
//! server's caps; and a secret dropped while the server runs.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use moe_node::config::PeerSection;
use moe_node::transport::handshake::{
    self, HELLO_FIXED_LEN, HandshakeError, Hello, MAC_LEN, NONCE_LEN, PREAMBLE_LEN, Status,
};
use moe_node::transport::peer::seal::{RECORD_HEADER, SealedWriter, TAG_LEN};
use moe_node::transport::peer::{PeerConfig, client_handshake};
use moe_node::transport::wire::{self, HEADER_LEN};
use moe_node::transport::{
    Dtype, ExpertOutput, ExpertReply, ExpertRequest, Handler, PeerAuth, PeerClient, PeerError,
    PeerSecrets, PeerServer, PeerStats, Rows, TcpTransport, Transport,
};
use tokio::io::AsyncWriteExt;

const SECRET: &[u8] = b"peer-security-test-secret-0123456789";
const FINGERPRINT: u64 = 7;
/// Wide rows, as a DeepSeek-V3 layer's: 16 of them in f32 span two sealed records.
const WIDTH: u32 = 7168;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn auth(node_id: &str, secrets: &[&[u8]]) -> PeerAuth {
    PeerAuth {
        node_id: node_id.into(),
        secrets: PeerSecrets::new(secrets.iter().map(|s| s.to_vec()).collect()),
        model_fingerprint: FINGERPRINT,
    }
}

/// rows × 2 + expert id.
fn double_plus_expert() -> Handler {
    Arc::new(|request: ExpertRequest| {
        let (expert, _) = request.groups[0];
        Ok(ExpertOutput {
            groups: request.groups.clone(),
            rows: Rows::one(
                request
                    .rows
                    .iter()
                    .map(|v| v * 2.0 + expert as f32)
                    .collect(),
            ),
        })
    })
}

fn request(rows: u32, seed: u32) -> ExpertRequest {
    ExpertRequest {
        layer: 1,
        placement_version: 1,
        width: WIDTH,
        dtype: Dtype::F32,
        groups: vec![(5, rows)],
        rows: (0..rows * WIDTH)
            .map(|i| ((i + seed) % 977) as f32 * 0.01 - 4.0)
            .collect(),
        trace: None,
    }
}

fn right_answer(request: &ExpertRequest) -> Vec<f32> {
    request.rows.iter().map(|v| v * 2.0 + 5.0).collect()
}

fn call(client: &PeerClient, request: ExpertRequest) -> Result<ExpertReply, PeerError> {
    let (tx, rx) = mpsc::channel();
    client.send(
        request,
        Box::new(move |result| {
            let _ = tx.send(result);
        }),
    )?;
    rx.recv_timeout(Duration::from_secs(10))
        .expect("an answer within 10 s")
}

fn wait_for(what: &str, within: Duration, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

struct Rig {
    runtime: tokio::runtime::Runtime,
    server: PeerServer,
    server_stats: Arc<PeerStats>,
}

impl Rig {
    fn new(config: PeerConfig, secrets: PeerSecrets) -> Rig {
        let runtime = runtime();
        let server_stats = Arc::new(PeerStats::default());
        let server = PeerServer::start_with_config(
            Arc::new(TcpTransport::default()),
            "127.0.0.1:0".parse().expect("addr"),
            Arc::new(PeerAuth {
                secrets,
                ..auth("server", &[])
            }),
            server_stats.clone(),
            double_plus_expert(),
            runtime.handle().clone(),
            config,
        )
        .expect("server");
        Rig {
            runtime,
            server,
            server_stats,
        }
    }

    fn client(&self, to: SocketAddr, auth: PeerAuth, stats: &Arc<PeerStats>) -> PeerClient {
        PeerClient::new(
            Arc::new(TcpTransport::default()),
            self.runtime.handle().clone(),
            to,
            Arc::new(auth),
            stats.clone(),
        )
    }
}

// ---- An on-path relay ----

/// What the relay does to the records of one direction of its first connection (later
/// connections pass untouched, as a path that healed).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Tamper {
    Pass,
    /// Flips the sign bit of a byte in the middle of the first record's ciphertext.
    Alter,
    /// Sends the first record twice.
    Replay,
    /// Sends the second record before the first.
    Reorder,
    /// Sends half of the first record, then closes both connections.
    Truncate,
    /// Replaces the link offer (stay on TCP) with an offer of a UCX path at an address of
    /// the relay's choosing.
    OfferUcx,
}

/// The bytes of the handshake in each direction, read as the layout says (the relay knows the
/// protocol, not the secret).
fn forward_handshake(
    from: &mut TcpStream,
    to: &mut TcpStream,
    client_side: bool,
    tamper: Tamper,
) -> bool {
    // Copies `len` bytes; `offer` marks the link offer, which `Tamper::OfferUcx` replaces.
    let mut copy = |len: usize, offer: bool| -> Option<Vec<u8>> {
        let mut bytes = vec![0u8; len];
        from.read_exact(&mut bytes).ok()?;
        if offer && tamper == Tamper::OfferUcx {
            bytes[PREAMBLE_LEN] = 1;
            bytes[PREAMBLE_LEN + 1..].copy_from_slice(&4u32.to_le_bytes());
            bytes.extend_from_slice(&[127, 0, 0, 1]);
        }
        to.write_all(&bytes).ok()?;
        Some(bytes)
    };
    let done = (|| {
        if client_side {
            let hello = copy(PREAMBLE_LEN + HELLO_FIXED_LEN, false)?;
            copy(u16::from_le_bytes([hello[30], hello[31]]) as usize, false)?;
            let proof = copy(PREAMBLE_LEN + 2, false)?;
            copy(proof[7] as usize * MAC_LEN, false)?;
        } else {
            let hello = copy(PREAMBLE_LEN + 1 + HELLO_FIXED_LEN, false)?;
            copy(u16::from_le_bytes([hello[31], hello[32]]) as usize, false)?;
            copy(PREAMBLE_LEN + 1 + MAC_LEN, false)?;
        }
        // The link offer (stay on TCP: kind 0, no address), then the confirmation of the
        // negotiation.
        copy(PREAMBLE_LEN + 5, true)?;
        copy(PREAMBLE_LEN + MAC_LEN, false)
    })();
    done.is_some()
}

fn read_record(from: &mut TcpStream) -> Option<Vec<u8>> {
    let mut record = vec![0u8; RECORD_HEADER];
    from.read_exact(&mut record).ok()?;
    let len = u32::from_le_bytes(record[..4].try_into().ok()?) as usize;
    record.resize(RECORD_HEADER + len + TAG_LEN, 0);
    from.read_exact(&mut record[RECORD_HEADER..]).ok()?;
    Some(record)
}

/// Copies one direction, tampering with its records after the handshake; returns when either
/// side closes.
fn pump(mut from: TcpStream, mut to: TcpStream, client_side: bool, tamper: Tamper) {
    if forward_handshake(&mut from, &mut to, client_side, tamper) {
        let mut held: Option<Vec<u8>> = None;
        let mut index = 0;
        while let Some(mut record) = read_record(&mut from) {
            let sent = match (tamper, index) {
                (Tamper::Alter, 0) => {
                    let middle = RECORD_HEADER + (record.len() - RECORD_HEADER - TAG_LEN) / 2;
                    record[middle] ^= 0x80;
                    to.write_all(&record)
                }
                (Tamper::Replay, 0) => to.write_all(&record).and_then(|()| to.write_all(&record)),
                (Tamper::Reorder, 0) => {
                    held = Some(record);
                    Ok(())
                }
                (Tamper::Reorder, 1) => to
                    .write_all(&record)
                    .and_then(|()| to.write_all(&held.take().unwrap_or_default())),
                (Tamper::Truncate, 0) => {
                    let _ = to.write_all(&record[..record.len() / 2]);
                    break;
                }
                _ => to.write_all(&record),
            };
            if sent.is_err() {
                break;
            }
            index += 1;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// A relay in front of `server`: its address, and whether the client closed the first
/// connection (the client's side of it ended).
fn relay(
    server: SocketAddr,
    to_client: Tamper,
    to_server: Tamper,
) -> (SocketAddr, Arc<AtomicBool>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("relay bind");
    let addr = listener.local_addr().expect("relay addr");
    let client_closed = Arc::new(AtomicBool::new(false));
    let closed = client_closed.clone();
    std::thread::spawn(move || {
        for (first, client) in listener.incoming().enumerate() {
            let Ok(client) = client else { return };
            let Ok(upstream) = TcpStream::connect(server) else {
                return;
            };
            let (up, down) = if first == 0 {
                (to_server, to_client)
            } else {
                (Tamper::Pass, Tamper::Pass)
            };
            let (client2, upstream2) = (
                client.try_clone().expect("clone"),
                upstream.try_clone().expect("clone"),
            );
            let closed = closed.clone();
            std::thread::spawn(move || {
                pump(client2, upstream2, true, up);
                if first == 0 {
                    closed.store(true, Ordering::SeqCst);
                }
            });
            std::thread::spawn(move || pump(upstream, client, false, down));
        }
    });
    (addr, client_closed)
}

/// Every tampering of the replies is refused by the client: the request fails (the
/// dispatcher then sends it to another replica, or answers 503), the link is closed and the
/// refusal counted; never a changed answer. The next request, on a fresh link, is answered
/// exactly.
#[test]
fn a_relay_that_alters_replays_reorders_or_cuts_replies_never_changes_an_answer() {
    let rig = Rig::new(
        PeerConfig::default(),
        PeerSecrets::new(vec![SECRET.to_vec()]),
    );
    for tamper in [
        Tamper::Alter,
        Tamper::Replay,
        Tamper::Reorder,
        Tamper::Truncate,
    ] {
        let (addr, client_closed) = relay(rig.server.local_addr(), tamper, Tamper::Pass);
        let stats = Arc::new(PeerStats::default());
        let client = rig.client(addr, auth("client", &[SECRET]), &stats);
        // 16 rows of 7168 f32: each way, two records.
        let sent = request(16, 3);
        let result = call(&client, sent.clone());
        match &result {
            Err(PeerError::LinkDown(reason)) => {
                let expected = if tamper == Tamper::Truncate {
                    "closed the connection inside a sealed record"
                } else {
                    "did not open"
                };
                assert!(reason.contains(expected), "{tamper:?}: {reason}");
            }
            other => panic!("{tamper:?}: the request must fail, got {other:?}"),
        }
        let rejected = &stats.frames_rejected;
        let (integrity, malformed) = (
            rejected.integrity.load(Ordering::Relaxed),
            rejected.malformed.load(Ordering::Relaxed),
        );
        if tamper == Tamper::Truncate {
            assert_eq!((integrity, malformed), (0, 1), "{tamper:?}");
        } else {
            assert_eq!((integrity, malformed), (1, 0), "{tamper:?}");
        }
        assert!(!client.is_linked(), "{tamper:?}: the link is closed");
        wait_for(
            "the client to close its side",
            Duration::from_secs(5),
            || client_closed.load(Ordering::SeqCst),
        );
        // A fresh link (the relay passes it untouched) answers exactly.
        std::thread::sleep(Duration::from_millis(100));
        let again = request(16, 4);
        let reply = call(&client, again.clone()).expect("a fresh link answers");
        assert_eq!(reply.rows, right_answer(&again), "{tamper:?}");
    }
}

/// Tampering with the requests is refused by the server, which closes the link: the request
/// is answered exactly (its records arrived untouched before the tampering) or fails, never
/// changed; the server keeps serving.
#[test]
fn a_relay_that_alters_or_replays_requests_is_refused_by_the_server() {
    let rig = Rig::new(
        PeerConfig::default(),
        PeerSecrets::new(vec![SECRET.to_vec()]),
    );
    for tamper in [Tamper::Alter, Tamper::Replay, Tamper::Reorder] {
        let before = rig
            .server_stats
            .frames_rejected
            .integrity
            .load(Ordering::Relaxed);
        let (addr, _) = relay(rig.server.local_addr(), Tamper::Pass, tamper);
        let stats = Arc::new(PeerStats::default());
        let client = rig.client(addr, auth("client", &[SECRET]), &stats);
        let sent = request(16, 5);
        match call(&client, sent.clone()) {
            Ok(reply) => assert_eq!(reply.rows, right_answer(&sent), "{tamper:?}"),
            Err(PeerError::LinkDown(_)) => {}
            Err(other) => panic!("{tamper:?}: {other}"),
        }
        wait_for(
            "the server to refuse the record",
            Duration::from_secs(5),
            || {
                rig.server_stats
                    .frames_rejected
                    .integrity
                    .load(Ordering::Relaxed)
                    == before + 1
            },
        );
        // Past the client's short backoff after a lost link.
        std::thread::sleep(Duration::from_millis(100));
        let again = request(2, 6);
        let reply = call(&client, again.clone()).expect("a fresh link answers");
        assert_eq!(reply.rows, right_answer(&again), "{tamper:?}");
    }
}

/// A relay that changes a link offer during the handshake (to steer the link onto a path,
/// or off one) is found by both sides' confirmation before any frame travels: the link is
/// refused and counted as `integrity` on both sides, and a link the relay leaves alone
/// answers exactly.
#[test]
fn a_relay_that_changes_a_link_offer_is_refused_before_any_frame() {
    let rig = Rig::new(
        PeerConfig::default(),
        PeerSecrets::new(vec![SECRET.to_vec()]),
    );
    for (to_client, to_server) in [
        (Tamper::OfferUcx, Tamper::Pass),
        (Tamper::Pass, Tamper::OfferUcx),
    ] {
        let server_before = rig
            .server_stats
            .frames_rejected
            .integrity
            .load(Ordering::Relaxed);
        let (addr, _) = relay(rig.server.local_addr(), to_client, to_server);
        let stats = Arc::new(PeerStats::default());
        let client = rig.client(addr, auth("client", &[SECRET]), &stats);
        match call(&client, request(2, 7)) {
            Err(PeerError::Handshake(HandshakeError::NegotiationAltered)) => {}
            other => panic!("{to_client:?}/{to_server:?}: must be refused, got {other:?}"),
        }
        assert_eq!(stats.frames_rejected.integrity.load(Ordering::Relaxed), 1);
        wait_for(
            "the server to refuse the changed offer",
            Duration::from_secs(5),
            || {
                rig.server_stats
                    .frames_rejected
                    .integrity
                    .load(Ordering::Relaxed)
                    == server_before + 1
            },
        );
        assert!(!client.is_linked());
        // Past the client's backoff after a failed handshake.
        std::thread::sleep(Duration::from_millis(300));
        let again = request(2, 8);
        let reply = call(&client, again.clone()).expect("an untouched link answers");
        assert_eq!(reply.rows, right_answer(&again));
    }
}

// ---- A client without the secret ----

/// Reads everything the server sends until it closes (or goes quiet for `quiet`).
fn read_all(stream: &mut TcpStream, quiet: Duration) -> Vec<u8> {
    stream.set_read_timeout(Some(quiet)).expect("timeout");
    let mut out = Vec::new();
    let mut buffer = [0u8; 4096];
    while let Ok(read) = stream.read(&mut buffer) {
        if read == 0 {
            break;
        }
        out.extend_from_slice(&buffer[..read]);
    }
    out
}

/// A client that does not hold the secret gets the server's hello (its fresh nonce, its id,
/// the fingerprint) and, after a proof that does not verify, a refusal with no MAC: nothing
/// computed from the secret, so no guess of it can be checked offline. What it gets does not
/// depend on its own nonce.
#[test]
fn a_client_without_the_secret_gets_nothing_that_depends_on_its_nonce() {
    let rig = Rig::new(
        PeerConfig::default(),
        PeerSecrets::new(vec![SECRET.to_vec()]),
    );
    let hello_len = PREAMBLE_LEN + 1 + HELLO_FIXED_LEN + "server".len();
    let mut seen = Vec::new();
    for nonce in [[1u8; NONCE_LEN], [2u8; NONCE_LEN]] {
        let mut stream = TcpStream::connect(rig.server.local_addr()).expect("connect");
        let ours = Hello {
            node_id: "guesser".into(),
            model_fingerprint: FINGERPRINT,
            nonce,
        };
        stream
            .write_all(&handshake::encode_client_hello(&ours))
            .expect("hello");
        // Before any proof, the server says its hello and nothing more.
        let hello = read_all(&mut stream, Duration::from_millis(300));
        assert_eq!(hello.len(), hello_len, "the server hello and nothing else");
        assert_eq!(hello[PREAMBLE_LEN], 0, "status Ok");
        let proof = handshake::encode_client_proof(Status::Ok, &[[0x5a; MAC_LEN]]);
        stream.write_all(&proof).expect("proof");
        let verdict = read_all(&mut stream, Duration::from_secs(2));
        assert_eq!(
            verdict,
            handshake::encode_verdict(Status::AuthFailed, &[0; MAC_LEN]),
            "a refusal with no MAC, then the connection closes"
        );
        // The hello with the server's nonce masked: the same whatever the client's nonce.
        let mut masked = hello.clone();
        let nonce_at = PREAMBLE_LEN + 1 + 8;
        masked[nonce_at..nonce_at + NONCE_LEN].fill(0);
        seen.push((masked, verdict));
    }
    assert_eq!(seen[0], seen[1]);
    // Counted as the server's task ends, which may be just after the client read its verdict.
    let counted = || {
        rig.server_stats
            .frames_rejected
            .auth_failed
            .load(Ordering::Relaxed)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while counted() < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(counted(), 2);
}

// ---- Bounded peers ----

/// This process's virtual and resident memory, in bytes.
fn memory() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map_or(0, |kib| kib * 1024)
    };
    (field("VmSize:"), field("VmRSS:"))
}

/// An authenticated raw connection that sends a frame header declaring `payload_len`
/// bytes of bf16 rows, and nothing after it; kept open until dropped.
fn header_only(
    rig: &Rig,
    node_id: &str,
    payload_len: u32,
) -> SealedWriter<Box<dyn moe_node::transport::PeerStream>> {
    let transport = TcpTransport::default();
    let at = rig.server.local_addr();
    rig.runtime.block_on(async move {
        let mut stream = transport.connect(at).await.expect("connect");
        let (_, keys) = client_handshake(&mut stream, &auth(node_id, &[SECRET]))
            .await
            .expect("handshake");
        let rows = (payload_len - 8) / 2;
        let full = ExpertRequest {
            layer: 1,
            placement_version: 1,
            width: 1,
            dtype: Dtype::Bf16,
            groups: vec![(0, rows)],
            rows: Vec::new(),
            trace: None,
        };
        // The header and groups of a frame with that many rows, without building the rows.
        let mut frame = wire::encode_request(
            1,
            &ExpertRequest {
                groups: vec![(0, 0)],
                ..full.clone()
            },
        )
        .expect("encode");
        frame[40..44].copy_from_slice(&payload_len.to_le_bytes());
        frame[HEADER_LEN + 4..HEADER_LEN + 8].copy_from_slice(&rows.to_le_bytes());
        let mut writer = SealedWriter::new(stream, &keys.client_to_server);
        writer.write_all(&frame).await.expect("header");
        writer.flush().await.expect("flush");
        writer
    })
}

/// Peers that declare the largest frames and send only their headers leave the server's
/// memory where it was (rows are allocated as they arrive); the server closes them at the
/// frame deadline; connections past the caps are closed; a frame larger than a
/// connection's byte budget closes its connection; and the server serves its member
/// throughout.
#[test]
fn header_only_frames_and_many_connections_stay_within_the_caps() {
    let section = PeerSection {
        max_connections: 24,
        max_connections_per_peer: 20,
        max_bytes_per_connection: 1 << 30,
        frame_timeout_ms: 4000,
        ..PeerSection::default()
    };
    let rig = Rig::new(
        PeerConfig::from_section(&section),
        PeerSecrets::new(vec![SECRET.to_vec()]),
    );
    let member_stats = Arc::new(PeerStats::default());
    let member = rig.client(
        rig.server.local_addr(),
        auth("member", &[SECRET]),
        &member_stats,
    );
    let served = || {
        let sent = request(4, 9);
        let reply = call(&member, sent.clone()).expect("the member is served");
        assert_eq!(reply.rows, right_answer(&sent));
    };
    served();
    let (size_before, resident_before) = memory();

    // 20 connections (the per-peer cap), each declaring 256 MiB of bf16 rows (512 MiB as
    // f32): 10 GiB if reserved from the header.
    let held: Vec<_> = (0..20)
        .map(|_| header_only(&rig, "flood", wire::DEFAULT_MAX_PAYLOAD))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let (size, resident) = memory();
    let grown = |after: u64, before: u64| after.saturating_sub(before) >> 20;
    assert!(
        grown(size, size_before) < 512,
        "virtual memory grew by {} MiB",
        grown(size, size_before)
    );
    assert!(
        grown(resident, resident_before) < 64,
        "resident memory grew by {} MiB",
        grown(resident, resident_before)
    );
    served();
    let rejected = &rig.server_stats.frames_rejected;
    // One more from the same node: over the per-peer cap.
    let _over_peer = header_only(&rig, "flood", 1024);
    wait_for("the per-peer cap", Duration::from_secs(3), || {
        rejected.over_limit.load(Ordering::Relaxed) >= 1
    });
    // Past the total cap (24 = member + 20 + room for 3): closed at accept.
    let extra: Vec<_> = (0..6)
        .filter_map(|_| TcpStream::connect(rig.server.local_addr()).ok())
        .collect();
    wait_for("the total cap", Duration::from_secs(3), || {
        rejected.over_limit.load(Ordering::Relaxed) >= 2
    });
    drop(extra);
    // The frame deadline closes the frames stopped half-way.
    wait_for("the frame deadline", Duration::from_secs(10), || {
        rejected.stalled.load(Ordering::Relaxed) >= 20
    });
    drop(held);
    served();

    // A frame larger than a connection's budget closes its connection.
    let small = PeerSection {
        max_bytes_per_connection: 16 << 20,
        ..PeerSection::default()
    };
    let rig = Rig::new(
        PeerConfig::from_section(&small),
        PeerSecrets::new(vec![SECRET.to_vec()]),
    );
    let _large = header_only(&rig, "flood", wire::DEFAULT_MAX_PAYLOAD);
    wait_for("the byte budget", Duration::from_secs(3), || {
        rig.server_stats
            .frames_rejected
            .over_limit
            .load(Ordering::Relaxed)
            == 1
    });
}

// ---- Secrets replaced while running ----

/// A secret removed from a running server's secrets is refused at the next handshake;
/// links already up keep working; the secret kept is accepted.
#[test]
fn a_removed_secret_is_refused_at_once() {
    const OLD: &[u8] = b"old-secret-0123456789abcdef";
    let secrets = PeerSecrets::new(vec![SECRET.to_vec(), OLD.to_vec()]);
    let rig = Rig::new(PeerConfig::default(), secrets.clone());
    let stats = Arc::new(PeerStats::default());
    let old_client = rig.client(rig.server.local_addr(), auth("old", &[OLD]), &stats);
    let sent = request(1, 1);
    assert_eq!(
        call(&old_client, sent.clone()).expect("accepted").rows,
        right_answer(&sent)
    );
    secrets.replace(vec![SECRET.to_vec()]);
    let late = rig.client(rig.server.local_addr(), auth("late", &[OLD]), &stats);
    assert_eq!(
        call(&late, sent.clone()).err(),
        Some(PeerError::Handshake(HandshakeError::RefusedByPeer))
    );
    let new_client = rig.client(rig.server.local_addr(), auth("new", &[SECRET]), &stats);
    assert!(call(&new_client, sent.clone()).is_ok());
    assert_eq!(
        rig.server_stats
            .frames_rejected
            .auth_failed
            .load(Ordering::Relaxed),
        1
    );
}
