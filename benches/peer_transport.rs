//! The peer data plane over TCP loopback, against bare TCP and iperf3.
//!
//! `cargo bench --bench peer_transport` prints:
//! 1. throughput of 256 rows × 7168 (a DeepSeek-V3/Kimi hidden size) in f32 and bf16: payload
//!    GB/s (request and reply rows both counted), median of several rounds of 16 requests in
//!    flight, with a bare tokio TCP stream moving the same bytes the same way for the ratio;
//! 2. round-trip latency of 1 row × 7168 f32 (median, p99) through PeerClient from a plain
//!    thread, and a bare tokio TCP ping-pong of the same byte count; the ratio of medians;
//! 3. if `iperf3` is installed, its loopback bandwidth beside ours.
//!
//! The handler hands the request's rows back (no copy), and the requests of a round are built
//! before its clock starts, so this measures the transport, not the experts or the caller.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use moe_node::transport::wire;
use moe_node::transport::{
    Dtype, ExpertOutput, ExpertRequest, Handler, PeerAuth, PeerClient, PeerSecrets, PeerServer,
    PeerStats, Rows, TcpTransport, Transport,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const WIDTH: u32 = 7168;
const BATCH_ROWS: u32 = 256;
const IN_FLIGHT: usize = 16;
const ROUNDS: usize = 9;
const PINGS: usize = 2000;

fn request(rows: u32, dtype: Dtype) -> ExpertRequest {
    ExpertRequest {
        layer: 1,
        placement_version: 1,
        width: WIDTH,
        dtype,
        groups: vec![(5, rows)],
        rows: (0..rows * WIDTH).map(|i| (i % 977) as f32 * 0.01).collect(),
        trace: None,
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let index = ((values.len() as f64 - 1.0) * p).round() as usize;
    values[index]
}

/// Payload GB/s of PeerClient: rounds of IN_FLIGHT requests sent at once.
fn peer_throughput(client: &PeerClient, dtype: Dtype) -> f64 {
    let template = request(BATCH_ROWS, dtype);
    let payload = 2.0 * (template.rows.len() * dtype.size()) as f64;
    let mut rates = Vec::new();
    for round in 0..ROUNDS + 1 {
        let (tx, rx) = mpsc::channel();
        let requests = vec![template.clone(); IN_FLIGHT];
        let start = Instant::now();
        for request in requests {
            let tx = tx.clone();
            client
                .send(
                    request,
                    Box::new(move |result| {
                        let _ = tx.send(result.is_ok());
                    }),
                )
                .expect("queued");
        }
        for _ in 0..IN_FLIGHT {
            assert!(rx.recv().expect("completion"), "request failed");
        }
        let seconds = start.elapsed().as_secs_f64();
        if round > 0 {
            rates.push(payload * IN_FLIGHT as f64 / seconds / 1e9);
        }
    }
    median(&mut rates)
}

/// Payload GB/s of a bare TCP stream moving the same frames to an echo server.
async fn bare_throughput(frame_len: usize, payload: f64) -> f64 {
    let echo = echo_server(frame_len).await;
    let stream = TcpStream::connect(echo).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (mut reader, mut writer) = stream.into_split();
    let frame = vec![7u8; frame_len];
    let mut rates = Vec::new();
    for round in 0..ROUNDS + 1 {
        let start = Instant::now();
        let frame = frame.clone();
        let send = tokio::spawn(async move {
            for _ in 0..IN_FLIGHT {
                writer.write_all(&frame).await.expect("write");
            }
            writer
        });
        let mut back = vec![0u8; frame_len];
        for _ in 0..IN_FLIGHT {
            reader.read_exact(&mut back).await.expect("read");
        }
        writer = send.await.expect("writer");
        let seconds = start.elapsed().as_secs_f64();
        if round > 0 {
            rates.push(payload * IN_FLIGHT as f64 / seconds / 1e9);
        }
    }
    median(&mut rates)
}

/// Echoes fixed-size messages back, one connection at a time.
async fn echo_server(message_len: usize) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let at = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            stream.set_nodelay(true).expect("nodelay");
            tokio::spawn(async move {
                let (mut reader, mut writer) = stream.into_split();
                let mut buffer = vec![0u8; message_len];
                while reader.read_exact(&mut buffer).await.is_ok() {
                    if writer.write_all(&buffer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    at
}

fn peer_latency(client: &PeerClient) -> Vec<f64> {
    let template = request(1, Dtype::F32);
    let mut micros = Vec::with_capacity(PINGS);
    for ping in 0..PINGS + 100 {
        let (tx, rx) = mpsc::channel();
        let start = Instant::now();
        client
            .send(
                template.clone(),
                Box::new(move |result| {
                    let _ = tx.send(result.is_ok());
                }),
            )
            .expect("queued");
        assert!(rx.recv().expect("completion"), "request failed");
        if ping >= 100 {
            micros.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    micros
}

async fn bare_latency(message_len: usize) -> Vec<f64> {
    let echo = echo_server(message_len).await;
    let mut stream = TcpStream::connect(echo).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let message = vec![3u8; message_len];
    let mut back = vec![0u8; message_len];
    let mut micros = Vec::with_capacity(PINGS);
    for ping in 0..PINGS + 100 {
        let start = Instant::now();
        stream.write_all(&message).await.expect("write");
        stream.read_exact(&mut back).await.expect("read");
        if ping >= 100 {
            micros.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    micros
}

/// iperf3 loopback bandwidth in GB/s, if iperf3 is installed.
fn iperf3() -> Option<f64> {
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-p", "5299"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let output = Command::new("iperf3")
        .args(["-c", "127.0.0.1", "-p", "5299", "-t", "3", "-J"])
        .output()
        .ok();
    let _ = server.wait();
    let report: serde_json::Value = serde_json::from_slice(&output?.stdout).ok()?;
    let bits = report["end"]["sum_received"]["bits_per_second"].as_f64()?;
    Some(bits / 8.0 / 1e9)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let auth = Arc::new(PeerAuth {
        node_id: "bench".into(),
        secrets: PeerSecrets::new(vec![b"bench secret".to_vec()]),
        model_fingerprint: 1,
    });
    let stats = Arc::new(PeerStats::default());
    let identity: Handler = Arc::new(|request: ExpertRequest| {
        Ok(ExpertOutput {
            groups: request.groups,
            rows: Rows::one(request.rows),
        })
    });
    let transport: Arc<dyn Transport> = Arc::new(TcpTransport::default());
    let server = PeerServer::start(
        transport.clone(),
        "127.0.0.1:0".parse().expect("addr"),
        auth.clone(),
        stats.clone(),
        identity,
        runtime.handle().clone(),
    )
    .expect("server");
    let client = PeerClient::new(
        transport,
        runtime.handle().clone(),
        server.local_addr(),
        auth,
        stats,
    );

    println!(
        "peer transport over TCP loopback ({} cores)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let mut peer_rates = Vec::new();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let template = request(BATCH_ROWS, dtype);
        let frame_len = wire::encode_request(1, &template).expect("encode").len();
        let payload = 2.0 * (template.rows.len() * dtype.size()) as f64;
        let ours = peer_throughput(&client, dtype);
        let bare = runtime.block_on(bare_throughput(frame_len, payload));
        println!(
            "throughput {BATCH_ROWS}x{WIDTH} {dtype:?}: peer {ours:.2} GB/s, bare tcp {bare:.2} GB/s, ratio {:.2} (payload both ways, median of {ROUNDS} rounds of {IN_FLIGHT} in flight)",
            ours / bare
        );
        peer_rates.push(ours);
    }

    let frame_len = wire::encode_request(1, &request(1, Dtype::F32))
        .expect("encode")
        .len();
    let mut ours = peer_latency(&client);
    let mut bare = runtime.block_on(bare_latency(frame_len));
    let (ours_median, ours_p99) = (median(&mut ours), percentile(&mut ours, 0.99));
    let (bare_median, bare_p99) = (median(&mut bare), percentile(&mut bare, 0.99));
    println!(
        "latency 1x{WIDTH} f32 ({frame_len} bytes each way, {PINGS} round trips): peer median {ours_median:.1} us p99 {ours_p99:.1} us; bare tcp median {bare_median:.1} us p99 {bare_p99:.1} us; ratio of medians {:.2}",
        ours_median / bare_median
    );

    match iperf3() {
        Some(iperf) => println!(
            "iperf3 loopback {iperf:.2} GB/s one way; peer f32 {:.2} GB/s both ways: ratio {:.2}",
            peer_rates[0],
            peer_rates[0] / iperf
        ),
        None => println!("iperf3 not installed: bandwidth comparison skipped"),
    }
}
