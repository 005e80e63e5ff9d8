//! The peer transport over UCX between two processes, beside `ucx_perftest` on the same UCX
//! transports and beside the TCP transport, in one run.
//!
//! `cargo bench --bench ucx` runs, for UCX shared memory (`UCX_TLS=shm,tcp`: the connection
//! manager needs tcp; the data goes over shared memory), UCX TCP (`UCX_TLS=tcp`) and the TCP
//! transport:
//! 1. one MoE layer's dispatch+combine for 256 tokens × 7168 bf16 (3.5 MiB each way): a
//!    request through `PeerClient` to a server process that hands the rows back; median
//!    round trip over 30, and payload GB/s (both directions counted);
//! 2. the same for 1 token (`MOE_BENCH_UCX_TOKENS`: that many): median and p99 round trip
//!    over 2000;
//! 3. `ucx_perftest` (Debian `ucx-utils`) on the same `UCX_TLS`: `ucp_am_bw` with 3.5 MiB
//!    messages and `ucp_am_lat` with 14 KiB (the links' bytes are active messages), each
//!    with endpoints that report peer failure (`-e`, as ours do) and without (`-e` costs
//!    shared memory its zero-copy `cma` lane in UCX 1.13), and the ratios (ours / perftest
//!    bandwidth; our round trip / perftest's, which reports half a round trip, times two);
//!    and `ucp_am_lat` with 3.5 MiB, the like-for-like reference for a layer: a ping-pong of
//!    one message each way, not a stream of them (ratio: its round trip / ours);
//! 4. which UCX transports our links' endpoints used (`ucp_ep_print_info`'s lanes);
//! 5. what the layer's row conversions cost alone, in this process: the f32 rows encoded to
//!    bf16 and decoded back, once per direction, as the peer protocol does (`ucx_perftest`
//!    moves bytes it never converts), into buffers already touched (the floor of that work),
//!    and our bandwidth once that time is taken out of the round trip (an upper bound), for
//!    the links that convert before and after the transfer (over shared memory UCX converts
//!    bf16 rows as it moves them, fragment by fragment: there the conversions overlap the
//!    transfer, and nothing is taken out).
//!
//! Without libucp or ucx_perftest it says SKIP for what it cannot run. The same binary is
//! the server and client processes (`MOE_BENCH_UCX_ROLE`). `MOE_BENCH_UCX_THREADS` sets their
//! runtimes' worker threads (default 2); `MOE_BENCH_UCX_LAYER_ROUNDS` the layer round trips
//! timed (default 30); `MOE_BENCH_UCX_DTYPE=f32` sends the rows in f32 instead of bf16 (the
//! sizes of the perftest runs follow; f32's "conversions" are copies).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use moe_node::transport::ucx::{Library, packs_rows};
use moe_node::transport::wire;
use moe_node::transport::{
    Dtype, ExpertOutput, ExpertRequest, Handler, PeerAuth, PeerClient, PeerSecrets, PeerServer,
    PeerStats, Rows, TcpTransport, Transport, UcxTransport,
};

const WIDTH: u32 = 7168;
const LAYER_TOKENS: u32 = 256;
const LAYER_ROUNDS: usize = 30;
const PINGS: usize = 2000;
const ROLE: &str = "MOE_BENCH_UCX_ROLE";
const KIND: &str = "MOE_BENCH_UCX_TRANSPORT";
const ADDR: &str = "MOE_BENCH_UCX_ADDR";

fn main() {
    match std::env::var(ROLE).as_deref() {
        Ok("server") => serve(),
        Ok("client") => client(),
        _ => compare(),
    }
}

/// The transport `kind` names, and the UCX one itself (to ask what it used) when it is UCX.
fn transport(kind: &str) -> (Arc<dyn Transport>, Option<UcxTransport>) {
    match kind {
        "ucx" => {
            let library = Library::load(None, true).expect("libucp loads");
            let ucx = UcxTransport::start(library).expect("UCX starts");
            (Arc::new(ucx.clone()), Some(ucx))
        }
        _ => (Arc::new(TcpTransport::default()), None),
    }
}

fn auth(node: &str) -> Arc<PeerAuth> {
    Arc::new(PeerAuth {
        node_id: node.into(),
        secrets: PeerSecrets::new(vec![b"bench secret 0123456789".to_vec()]),
        model_fingerprint: 1,
    })
}

/// Each process's runtime: `MOE_BENCH_UCX_THREADS` worker threads (default 2; `ucx_perftest`
/// runs one thread a process).
fn runtime() -> tokio::runtime::Runtime {
    let threads = std::env::var("MOE_BENCH_UCX_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(2);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The server process: hands every request's rows back; prints its address, runs until
/// its stdin closes.
fn serve() {
    let kind = std::env::var(KIND).unwrap_or_default();
    let runtime = runtime();
    let echo: Handler = Arc::new(|request: ExpertRequest| {
        Ok(ExpertOutput {
            groups: request.groups,
            rows: Rows::one(request.rows),
        })
    });
    let server = PeerServer::start(
        transport(&kind).0,
        "127.0.0.1:0".parse().expect("address"),
        auth("server"),
        Arc::new(PeerStats::default()),
        echo,
        runtime.handle().clone(),
    )
    .expect("server starts");
    println!("ADDR {}", server.local_addr());
    std::io::stdout().flush().expect("stdout");
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {}
}

/// The rows' wire dtype: bf16 (the figure), or f32 with `MOE_BENCH_UCX_DTYPE=f32`
/// (what a CPU node asks of its peers).
fn dtype() -> Dtype {
    match std::env::var("MOE_BENCH_UCX_DTYPE").as_deref() {
        Ok("f32") => Dtype::F32,
        _ => Dtype::Bf16,
    }
}

/// The rows of the small round trip: 1 token, or `MOE_BENCH_UCX_TOKENS` (a decode step's
/// share of a node: a few to a few dozen rows).
fn small_tokens() -> u32 {
    std::env::var("MOE_BENCH_UCX_TOKENS")
        .ok()
        .and_then(|t| t.parse().ok())
        .filter(|&t| t > 0)
        .unwrap_or(1)
}

fn request(tokens: u32) -> ExpertRequest {
    ExpertRequest {
        layer: 1,
        placement_version: 1,
        width: WIDTH,
        dtype: dtype(),
        groups: vec![(3, tokens)],
        rows: (0..tokens * WIDTH)
            .map(|i| (i % 977) as f32 * 0.01)
            .collect(),
        trace: None,
    }
}

fn round_trip(client: &PeerClient, request: ExpertRequest) -> Duration {
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    client
        .send(
            request,
            Box::new(move |result| {
                let _ = tx.send(result.is_ok());
            }),
        )
        .expect("queued");
    assert!(
        rx.recv_timeout(Duration::from_secs(30)).expect("reply"),
        "request failed"
    );
    start.elapsed()
}

fn sorted_micros(mut times: Vec<Duration>) -> Vec<f64> {
    let mut micros: Vec<f64> = times.drain(..).map(|t| t.as_secs_f64() * 1e6).collect();
    micros.sort_by(f64::total_cmp);
    micros
}

/// The client process: prints `LAYER <median us> <GB/s>`, `TOKEN <median us> <p99 us>` and,
/// over UCX, `TRANSPORTS <what the link's endpoint used>`.
fn client() {
    let kind = std::env::var(KIND).unwrap_or_default();
    let addr: SocketAddr = std::env::var(ADDR)
        .expect("server address")
        .parse()
        .expect("address");
    let runtime = runtime();
    let (transport, ucx) = transport(&kind);
    let client = PeerClient::new(
        transport,
        runtime.handle().clone(),
        addr,
        auth("client"),
        Arc::new(PeerStats::default()),
    );
    let layer = request(LAYER_TOKENS);
    let bytes = 2.0 * (layer.rows.len() * dtype().size()) as f64;
    for _ in 0..3 {
        round_trip(&client, layer.clone());
    }
    let rounds: usize = std::env::var("MOE_BENCH_UCX_LAYER_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(LAYER_ROUNDS);
    let times = (0..rounds)
        .map(|_| round_trip(&client, layer.clone()))
        .collect();
    let layer_us = sorted_micros(times)[rounds / 2];
    println!("LAYER {layer_us:.1} {:.3}", bytes / layer_us / 1e3);
    let token = request(small_tokens());
    for _ in 0..100 {
        round_trip(&client, token.clone());
    }
    let times = (0..PINGS)
        .map(|_| round_trip(&client, token.clone()))
        .collect();
    let micros = sorted_micros(times);
    println!(
        "TOKEN {:.1} {:.1}",
        micros[PINGS / 2],
        micros[PINGS * 99 / 100]
    );
    if let Some(ucx) = ucx {
        println!("TRANSPORTS {}", ucx.transports_used().join(","));
    }
}

/// Figures of one transport: layer round trip (us), layer GB/s, token median, token p99.
struct Figures {
    layer_us: f64,
    layer_gbps: f64,
    token_us: f64,
    token_p99_us: f64,
    /// The UCX transports the link used ("" over TCP).
    transports: String,
}

fn spawn_self(role: &str, kind: &str, tls: Option<&str>, addr: Option<SocketAddr>) -> Child {
    let mut command = Command::new(std::env::current_exe().expect("own path"));
    command.env(ROLE, role).env(KIND, kind);
    if let Some(tls) = tls {
        command.env("UCX_TLS", tls);
    }
    if let Some(addr) = addr {
        command.env(ADDR, addr.to_string());
    }
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn")
}

fn measure(kind: &str, tls: Option<&str>) -> Figures {
    let mut server = spawn_self("server", kind, tls, None);
    let mut lines = BufReader::new(server.stdout.take().expect("stdout")).lines();
    let addr: SocketAddr = lines
        .next()
        .and_then(Result::ok)
        .and_then(|l| l.strip_prefix("ADDR ").map(str::to_string))
        .expect("server address")
        .parse()
        .expect("address");
    let client = spawn_self("client", kind, tls, Some(addr));
    let out = client.wait_with_output().expect("client");
    assert!(out.status.success(), "client failed");
    drop(server.stdin.take());
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    let numbers = |tag: &str| -> Vec<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(tag))
            .expect("figures")
            .split_whitespace()
            .map(|n| n.parse().expect("number"))
            .collect()
    };
    let (layer, token) = (numbers("LAYER "), numbers("TOKEN "));
    let transports = text
        .lines()
        .find_map(|l| l.strip_prefix("TRANSPORTS "))
        .unwrap_or_default()
        .to_string();
    Figures {
        layer_us: layer[0],
        layer_gbps: layer[1],
        token_us: token[0],
        token_p99_us: token[1],
        transports,
    }
}

/// `ucx_perftest` on `tls`: the `Final:` figures of one test (typical latency in us and
/// average bandwidth in MB/s); `peer_failure` makes its endpoints report peer failure (`-e`).
fn perftest(
    tls: &str,
    test: &str,
    size: usize,
    iterations: usize,
    port: u16,
    peer_failure: bool,
) -> Option<(f64, f64)> {
    let run = |args: &[String]| {
        let mut command = Command::new("ucx_perftest");
        if peer_failure && std::env::var_os("UCX_MM_ERROR_HANDLING").is_none() {
            // What the node sets for its own endpoints (else `-e` leaves shared memory out).
            command.env("UCX_MM_ERROR_HANDLING", "y");
        }
        command
            .args(args)
            .env("UCX_TLS", tls)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()
    };
    let mut port_arg = vec!["-p".to_string(), port.to_string()];
    if peer_failure {
        port_arg.push("-e".to_string());
    }
    let mut server = run(&port_arg)?;
    std::thread::sleep(Duration::from_millis(500));
    let mut args = vec!["127.0.0.1".to_string()];
    args.extend(port_arg);
    args.extend(
        [
            "-t",
            test,
            "-s",
            &size.to_string(),
            "-n",
            &iterations.to_string(),
        ]
        .map(str::to_string),
    );
    let out = run(&args)?.wait_with_output().ok()?;
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with("Final:"))?;
    let fields: Vec<f64> = last
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // iterations, 50%ile, average, overall latency; average, overall bandwidth; rates.
    Some((*fields.get(1)?, *fields.get(4)?))
}

/// Median time of the arithmetic the peer protocol does to one layer's rows besides moving
/// them, over a round trip: per direction, the f32 rows encoded to bf16 and decoded back to
/// f32 a chunk at a time (as `read_frame` reads a frame). Into buffers already touched: the
/// floor of that work, without the page faults fresh buffers add (which depend on the
/// allocator's state), so "less the conversions" is an upper bound on the moving rate.
fn conversions_us() -> f64 {
    const CHUNK_VALUES: usize = 128 << 10;
    let rows = request(LAYER_TOKENS).rows;
    let mut bytes = vec![0u8; rows.len() * dtype().size()];
    let mut back = vec![0.0f32; rows.len()];
    let times = (0..LAYER_ROUNDS)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..2 {
                wire::encode_values(&rows, dtype(), &mut bytes);
                for (back, bytes) in back
                    .chunks_mut(CHUNK_VALUES)
                    .zip(bytes.chunks(CHUNK_VALUES * dtype().size()))
                {
                    wire::decode_values(bytes, dtype(), back);
                }
                std::hint::black_box(&back);
            }
            start.elapsed()
        })
        .collect();
    sorted_micros(times)[LAYER_ROUNDS / 2]
}

fn compare() {
    if let Err(why) = Library::load(None, true) {
        println!("SKIP: UCX does not load ({why}); only the TCP transport would run");
        return;
    }
    let perftest_found = Command::new("ucx_perftest")
        .arg("-h")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    let layer_bytes = (LAYER_TOKENS * WIDTH) as usize * dtype().size();
    let name = format!("{:?}", dtype()).to_lowercase();
    let small = small_tokens();
    let token_bytes = small as usize * WIDTH as usize * dtype().size();
    println!(
        "one layer: {LAYER_TOKENS} tokens x {WIDTH} {name} ({:.2} MiB each way); {small} token(s): \
         {} KiB",
        layer_bytes as f64 / (1 << 20) as f64,
        token_bytes / 1024
    );
    let conversions = conversions_us();
    println!(
        "row conversions alone (f32 -> {name} -> f32 both ways, warm buffers, this process): {conversions:.1} us"
    );
    let mut port = 13_400;
    for (label, kind, tls) in [
        ("UCX shared memory", "ucx", Some("shm,tcp")),
        ("UCX tcp", "ucx", Some("tcp")),
        ("TCP transport", "tcp", None),
    ] {
        let ours = measure(kind, tls);
        println!(
            "{label:18} layer {:8.1} us  {:6.2} GB/s | {small} token(s) {:7.1} us (p99 {:7.1})",
            ours.layer_us, ours.layer_gbps, ours.token_us, ours.token_p99_us
        );
        // The round trip less the conversions: what moving the bytes took, where the
        // conversions come before and after the transfer (not where the rows move as they
        // are, f32 over UCX, or UCX converts them as it moves them: there they overlap it).
        let transports: Vec<String> = ours.transports.split(',').map(str::to_string).collect();
        let converted_in_flight =
            tls.is_some() && (dtype() == Dtype::F32 || packs_rows(&transports));
        let moving_us = ours.layer_us - conversions;
        let moving_gbps = (moving_us > 0.0 && !converted_in_flight)
            .then(|| 2.0 * layer_bytes as f64 / moving_us / 1e3);
        match moving_gbps {
            Some(gbps) => println!(
                "{:18} less the conversions {moving_us:8.1} us  {gbps:6.2} GB/s",
                ""
            ),
            None if converted_in_flight => println!(
                "{:18} rows moved as they are or converted by UCX as it moves them (nothing to take out)",
                ""
            ),
            None => println!("{:18} less the conversions: nothing left (noise)", ""),
        }
        // "(x% less the conversions)", where that means something.
        let less = |percent: f64| match moving_gbps {
            Some(_) => format!(" ({percent:.0}% less the conversions)"),
            None => String::new(),
        };
        let Some(tls) = tls else { continue };
        println!("{:18} our links used {}", "", ours.transports);
        if !perftest_found {
            println!("{:18} SKIP: ucx_perftest not found (Debian ucx-utils)", "");
            continue;
        }
        for (peer_failure, how) in [(true, "-e (as ours)"), (false, "no -e")] {
            port += 1;
            let bw = perftest(tls, "ucp_am_bw", layer_bytes, 200, port, peer_failure);
            port += 1;
            let lat = perftest(tls, "ucp_am_lat", token_bytes, 2000, port, peer_failure);
            port += 1;
            let layer_lat = perftest(tls, "ucp_am_lat", layer_bytes, 100, port, peer_failure);
            match (bw, lat, layer_lat) {
                (Some((_, mbps)), Some((half_rtt_us, _)), Some((layer_half_rtt_us, _))) => {
                    println!(
                        "{:18} ucx_perftest {how:12} am_bw {:6.2} GB/s, am_lat {:6.1} us one way \
                         -> ours/perftest bandwidth {:.0}%{}, round trip {:.1}x",
                        "",
                        mbps * 1.048_576 / 1e3,
                        half_rtt_us,
                        100.0 * ours.layer_gbps / (mbps * 1.048_576 / 1e3),
                        less(100.0 * moving_gbps.unwrap_or(0.0) / (mbps * 1.048_576 / 1e3)),
                        ours.token_us / (2.0 * half_rtt_us)
                    );
                    // A layer's dispatch+combine is one message each way, the second sent
                    // when the first arrived: a ping-pong of the layer's size, not a stream.
                    let pong_us = 2.0 * layer_half_rtt_us;
                    println!(
                        "{:18} {:25} am_lat at the layer's size {pong_us:8.1} us a round trip \
                         -> ours/perftest ping-pong {:.0}%{}",
                        "",
                        "",
                        100.0 * pong_us / ours.layer_us,
                        less(100.0 * pong_us / moving_us)
                    );
                }
                _ => println!("{:18} ucx_perftest {how} gave no figures", ""),
            }
        }
    }
}
