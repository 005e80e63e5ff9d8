//! Gossip against someone on the path, with real processes: two `moe-node serve` nodes on
//! loopback, node2 reaching node1's gossip port through a UDP relay in this test (node1
//! advertises 127.0.0.2 with its port, where the relay stands). The relay keeps a copy of
//! everything node2 sends node1.
//!
//! - node2 is killed and its captured datagrams are replayed to node1 without pause: node1
//!   refuses every one (`reason="replay"`) and declares node2 dead on time. (Foca's probe
//!   numbers are 8 bits: the capture spans more than 256 of node1's probes, so without the
//!   replay check node2's old acks answer every probe and keep it alive.)
//! - node2 restarts while the replay goes on: its new run is taken at once.
//! - node1 drops the secret node2 seals with and reloads (SIGHUP): node2's datagrams are
//!   refused at once (`reason="unauthenticated"`) and it is declared dead, no restart needed.

use std::ffi::OsStr;
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use reqwest::blocking::Client;
use serde_json::Value;

mod serve;
use serve::Process;

const OLD_SECRET: &str = "replay-test-old-secret-0123456789";
const NEW_SECRET: &str = "replay-test-new-secret-0123456789";
const PROBE_MS: u64 = 50;
const SUSPICION_MS: u64 = 2000;
/// Probe and suspicion, and room for a test machine whose two cores are shared with
/// compilers.
const DETECTION_LIMIT: Duration = Duration::from_secs(10);

fn free_udp_port(ip: &str) -> u16 {
    UdpSocket::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A UDP relay standing at `front`: forwards what arrives to `member`, keeping a copy while
/// capturing; while replaying it also sends its copies to `member` again, round after round.
struct Relay {
    captured: Arc<Mutex<Vec<Vec<u8>>>>,
    capturing: Arc<AtomicBool>,
    replaying: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Relay {
    fn start(front: SocketAddr, member: SocketAddr) -> Relay {
        let socket = UdpSocket::bind(front).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(1)))
            .unwrap();
        let relay = Relay {
            captured: Arc::default(),
            capturing: Arc::new(AtomicBool::new(true)),
            replaying: Arc::default(),
            stop: Arc::default(),
        };
        let (captured, capturing, replaying, stop) = (
            relay.captured.clone(),
            relay.capturing.clone(),
            relay.replaying.clone(),
            relay.stop.clone(),
        );
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            let mut next = 0usize;
            while !stop.load(Ordering::Relaxed) {
                if let Ok((len, _)) = socket.recv_from(&mut buf) {
                    let _ = socket.send_to(&buf[..len], member);
                    if capturing.load(Ordering::Relaxed) {
                        captured.lock().unwrap().push(buf[..len].to_vec());
                    }
                }
                if replaying.load(Ordering::Relaxed) {
                    let copy = {
                        let captured = captured.lock().unwrap();
                        next = (next + 1) % captured.len().max(1);
                        captured.get(next).cloned()
                    };
                    if let Some(datagram) = copy {
                        let _ = socket.send_to(&datagram, member);
                    }
                }
            }
        });
        relay
    }

    /// Stops capturing and starts replaying what it holds.
    fn replay(&self) -> usize {
        self.capturing.store(false, Ordering::Relaxed);
        self.replaying.store(true, Ordering::Relaxed);
        self.captured.lock().unwrap().len()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

struct Node {
    process: Process,
    client: Client,
}

/// Writes node `name`'s config into `dir`: gossip on 127.0.0.1:`gossip`, its peer port
/// and API on `host`, which it advertises.
fn write_config(
    dir: &Path,
    name: &str,
    host: &str,
    gossip: u16,
    seed: SocketAddr,
    secrets: &[&str],
) -> PathBuf {
    let secrets: Vec<String> = secrets.iter().map(|s| format!("\"{s}\"")).collect();
    let text = format!(
        "[devices]\nbackend = \"cpu\"\ncpu_slots = 1\n\
         [cluster]\nnode_id = \"{name}\"\nsecrets = [{}]\n\
         gossip_listen = \"127.0.0.1:{gossip}\"\npeer_listen = \"{host}:0\"\n\
         advertise_host = \"{host}\"\nseeds = [\"{seed}\"]\nexpect_nodes = 2\nreplication = 2\n\
         probe_period_ms = {PROBE_MS}\nsuspicion_timeout_ms = {SUSPICION_MS}\n\
         join_timeout_seconds = 30\nrereplicate_after_ms = 600000\n",
        secrets.join(", ")
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

impl Node {
    fn start(config: &Path, host: &str) -> Node {
        let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v3");
        let listen = format!("{host}:0");
        let process = Process::start(&[
            OsStr::new("serve"),
            OsStr::new("--listen"),
            OsStr::new(&listen),
            OsStr::new("--config"),
            config.as_os_str(),
            OsStr::new("--model"),
            model.as_os_str(),
        ]);
        let client = Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap();
        Node { process, client }
    }

    fn get(&self, path: &str) -> reqwest::blocking::Response {
        self.client
            .get(format!("{}{path}", self.process.base))
            .send()
            .unwrap()
    }

    fn wait_ready(&self) {
        wait_until(Duration::from_secs(90), "ready", || {
            self.get("/ready").status() == StatusCode::OK
        });
    }

    /// The state of `node` as this node's gossip sees it (its liveliest entry: a restarted
    /// node has its dead old self listed beside it).
    fn member_state(&self, node: &str) -> Option<String> {
        let cluster: Value = self.get("/admin/cluster").json().unwrap();
        let rank = |s: &str| match s {
            "alive" => 2,
            "suspect" => 1,
            _ => 0,
        };
        cluster["members"]
            .as_array()?
            .iter()
            .filter(|m| m["node"] == node && m["self"] != true)
            .filter_map(|m| m["state"].as_str().map(str::to_string))
            .max_by_key(|s| rank(s))
    }

    /// `moe_node_gossip_packets_rejected_total{reason="REASON"}`.
    fn rejected(&self, reason: &str) -> f64 {
        let series = format!("moe_node_gossip_packets_rejected_total{{reason=\"{reason}\"}} ");
        let text = self.get("/metrics").text().unwrap();
        text.lines()
            .find_map(|line| line.strip_prefix(&series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in /metrics"))
    }

    fn hang_up(&self) {
        let pid = self.process.child.id().to_string();
        let status = std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

/// Polls `done` every 50 ms for at most `within`; returns how long it took.
fn wait_until(within: Duration, what: &str, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < within, "not {what} within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

#[test]
fn replayed_gossip_keeps_no_dead_node_alive_and_a_removed_secret_is_refused_on_reload() {
    let dir = tempfile::tempdir().unwrap();
    let (port1, port2) = (free_udp_port("127.0.0.1"), free_udp_port("127.0.0.1"));
    let front = SocketAddr::from(([127, 0, 0, 2], port1));
    let node1_gossip = SocketAddr::from(([127, 0, 0, 1], port1));
    // node1 seals with the new secret, node2 with the old; each opens both.
    let config1 = write_config(
        dir.path(),
        "node1",
        "127.0.0.2",
        port1,
        SocketAddr::from(([127, 0, 0, 1], port2)),
        &[NEW_SECRET, OLD_SECRET],
    );
    let config2 = write_config(
        dir.path(),
        "node2",
        "127.0.0.1",
        port2,
        front,
        &[OLD_SECRET, NEW_SECRET],
    );
    let relay = Relay::start(front, node1_gossip);
    let node1 = Node::start(&config1, "127.0.0.2");
    let mut node2 = Node::start(&config2, "127.0.0.1");
    node1.wait_ready();
    node2.wait_ready();
    let alive = |node: &Node| node.member_state("node2").as_deref() == Some("alive");
    wait_until(Duration::from_secs(30), "node2 alive on node1", || {
        alive(&node1)
    });

    // Capture past 256 of node1's probes (300 probe periods), then kill node2 and replay.
    std::thread::sleep(Duration::from_millis(PROBE_MS * 300));
    assert_eq!(node1.rejected("replay"), 0.0, "nothing replayed yet");
    let _ = node2.process.child.kill();
    let _ = node2.process.child.wait();
    let captured = relay.replay();
    assert!(captured > 300, "captured only {captured} datagrams");
    let took = wait_until(DETECTION_LIMIT, "node2 declared dead on node1", || {
        node1.member_state("node2").as_deref() == Some("dead")
    });
    let replays = node1.rejected("replay");
    eprintln!(
        "node2 declared dead {:.1} s after its kill while {captured} captured datagrams were \
         replayed ({replays} refused as replays)",
        took.as_secs_f64()
    );
    assert!(replays > 100.0, "only {replays} replays refused");
    // Still dead after more replaying.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(node1.member_state("node2").as_deref(), Some("dead"));
    assert_eq!(node1.get("/ready").status(), StatusCode::OK);

    // Restarted, node2 is taken at once although its old run's datagrams keep coming.
    node2 = Node::start(&config2, "127.0.0.1");
    let back = wait_until(
        Duration::from_secs(30),
        "node2 alive again on node1",
        || alive(&node1),
    );
    eprintln!(
        "restarted node2 alive on node1 {:.1} s after it started",
        back.as_secs_f64()
    );
    assert!(node1.rejected("replay") > replays, "the replay goes on");
    relay.replaying.store(false, Ordering::Relaxed);
    node2.wait_ready();

    // node1 drops the secret node2 seals with: refused at once, node2 declared dead.
    write_config(
        dir.path(),
        "node1",
        "127.0.0.2",
        port1,
        SocketAddr::from(([127, 0, 0, 1], port2)),
        &[NEW_SECRET],
    );
    let before = node1.rejected("unauthenticated");
    node1.hang_up();
    let refused = wait_until(
        Duration::from_secs(5),
        "old-secret datagrams refused",
        || node1.rejected("unauthenticated") > before,
    );
    assert!(
        node1
            .process
            .log_contains("gossip takes the reloaded cluster secrets"),
        "{:?}",
        node1.process.log_lines()
    );
    let dead = wait_until(
        DETECTION_LIMIT,
        "node2 declared dead after the reload",
        || node1.member_state("node2").as_deref() == Some("dead"),
    );
    eprintln!(
        "after the reload: node2's datagrams refused within {:.1} s, node2 dead within {:.1} s",
        refused.as_secs_f64(),
        (refused + dead).as_secs_f64()
    );
}
