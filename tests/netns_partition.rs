//! A partition between real processes. Three `moe-node serve` nodes run each in a network
//! namespace of its own that this test makes (a veth pair to a bridge, with `tc netem`
//! delay and loss on every link), and a gateway runs in the test's namespace. One node is
//! cut off longer than `rereplicate_after_ms`, so that both sides re-place the experts and
//! each side's leader proposes a table under the same version. After the heal every node
//! must serve one table without a restart. Then, as in the soak of `tests/gateway.rs`, one
//! node is killed (-9) and restarted, one paused shorter and one longer than the suspicion
//! timeout. Through all of it no stream through the gateway may fail or change. Everything
//! made is removed when the test ends.
//!
//! Needs root and `ip netns`: the test says SKIPPED without them, and fails instead with
//! `MOE_TEST_REQUIRE_NETNS=1` (CI sets it where a namespace can be made).

use std::ffi::OsStr;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use reqwest::blocking::Client;
use serde_json::Value;

mod cluster_harness;
mod common;
mod serve;
use cluster_harness::stream_tokens;
use serve::Process;

const SECRET: &str = "netns-test-secret-0123456789";
const GOSSIP_PORT: u16 = 7946;

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespaces, links and bridge of one test, removed when dropped.
struct Net {
    tag: String,
    subnet: u8,
    nodes: usize,
    /// Whether the links delay and lose packets (`tc netem`), or why not.
    netem: Option<Result<(), String>>,
}

impl Net {
    /// `nodes` namespaces on one bridge, 10.77.S.1.. in them and 10.77.S.254 here.
    fn make(nodes: usize) -> Result<Net, String> {
        let pid = std::process::id();
        let mut net = Net {
            tag: format!("{}", pid % 100_000),
            subnet: (pid % 200) as u8 + 20,
            nodes,
            netem: None,
        };
        let bridge = net.bridge();
        run(&["ip", "link", "add", &bridge, "type", "bridge"])?;
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{}/24", net.host()),
            "dev",
            &bridge,
        ])?;
        run(&["ip", "link", "set", &bridge, "up"])?;
        for i in 1..=nodes {
            let (ns, outer, inner) = (net.ns(i), net.outer(i), format!("mi{}", net.tag));
            run(&["ip", "netns", "add", &ns])?;
            run(&[
                "ip", "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ])?;
            run(&["ip", "link", "set", &inner, "netns", &ns])?;
            let inside = |args: &[&str]| {
                let mut all = vec!["ip", "netns", "exec", &ns];
                all.extend_from_slice(args);
                run(&all)
            };
            inside(&["ip", "link", "set", "lo", "up"])?;
            inside(&[
                "ip",
                "addr",
                "add",
                &format!("{}/24", net.addr(i)),
                "dev",
                &inner,
            ])?;
            inside(&["ip", "link", "set", &inner, "up"])?;
            // Every packet between nodes crosses two netem queues: 2 ms and 0.5% loss each,
            // where the kernel has netem (sch_netem); without it the links are clean.
            net.netem(inside(&[
                "tc", "qdisc", "add", "dev", &inner, "root", "netem", "delay", "2ms", "loss",
                "0.5%",
            ]));
            run(&["ip", "link", "set", &outer, "master", &bridge])?;
            run(&["ip", "link", "set", &outer, "up"])?;
            net.netem(run(&[
                "tc", "qdisc", "add", "dev", &outer, "root", "netem", "delay", "2ms", "loss",
                "0.5%",
            ]));
        }
        Ok(net)
    }

    /// Notes whether a netem queue could be added (the first answer is kept).
    fn netem(&mut self, added: Result<(), String>) {
        if self.netem.is_none() || added.is_err() {
            self.netem = Some(added);
        }
    }

    fn bridge(&self) -> String {
        format!("mb{}", self.tag)
    }

    fn ns(&self, i: usize) -> String {
        format!("moe{}-n{i}", self.tag)
    }

    fn outer(&self, i: usize) -> String {
        format!("mo{}{i}", self.tag)
    }

    fn addr(&self, i: usize) -> String {
        format!("10.77.{}.{i}", self.subnet)
    }

    fn host(&self) -> String {
        format!("10.77.{}.254", self.subnet)
    }

    /// Cuts node `i` off from everyone (its end of the bridge down), or joins it again.
    fn cut(&self, i: usize, off: bool) {
        let state = if off { "down" } else { "up" };
        run(&["ip", "link", "set", &self.outer(i), state]).unwrap();
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 1..=self.nodes {
            let _ = run(&["ip", "netns", "del", &self.ns(i)]);
            let _ = run(&["ip", "link", "del", &self.outer(i)]);
        }
        let _ = run(&["ip", "link", "del", &self.bridge()]);
    }
}

/// The network, or why the test cannot make one (SKIPPED, or a failure with
/// `MOE_TEST_REQUIRE_NETNS=1`).
fn network(nodes: usize) -> Option<Net> {
    match Net::make(nodes) {
        Ok(net) => Some(net),
        Err(why) => {
            assert!(
                std::env::var("MOE_TEST_REQUIRE_NETNS").as_deref() != Ok("1"),
                "MOE_TEST_REQUIRE_NETNS=1 but no network namespace could be made: {why}"
            );
            common::skipped(&format!(
                "the partition test needs root and `ip netns`: {why}"
            ));
            None
        }
    }
}

struct NsNode {
    process: Process,
    client: Client,
}

impl NsNode {
    fn get(&self, path: &str) -> Value {
        let url = format!("{}{path}", self.process.base);
        self.client
            .get(&url)
            .send()
            .or_else(|_| self.client.get(&url).send())
            .and_then(|r| r.json())
            .unwrap_or(Value::Null)
    }

    /// Sends `signal` (`-9`, `-STOP`, `-CONT`) to the node's process (`ip netns exec`
    /// execs it: the child is the node).
    fn signal(&self, signal: &str) {
        let pid = self.process.child.id().to_string();
        run(&["kill", signal, &pid]).unwrap();
    }

    /// Whether its gossip sees every one of `names` alive.
    fn sees_alive(&self, names: &[String]) -> bool {
        let cluster = self.get("/admin/cluster");
        let members = cluster["members"].as_array().cloned().unwrap_or_default();
        names.iter().all(|name| {
            members
                .iter()
                .any(|m| m["node"] == name.as_str() && m["state"] == "alive")
        })
    }

    /// The placement it serves: version and table hash.
    fn serving(&self) -> (Value, Value) {
        let placement = self.get("/admin/placement");
        (
            placement["version"].clone(),
            placement["table_hash"].clone(),
        )
    }
}

fn start_node(net: &Net, i: usize, dir: &std::path::Path) -> NsNode {
    let seeds: Vec<String> = (1..=net.nodes)
        .filter(|&j| j != i)
        .map(|j| format!("\"{}:{GOSSIP_PORT}\"", net.addr(j)))
        .collect();
    let config = dir.join(format!("node{i}.toml"));
    std::fs::write(
        &config,
        format!(
            "[devices]\nbackend = \"cpu\"\ncpu_slots = 1\n\
             [cluster]\nnode_id = \"node{i}\"\nsecrets = [\"{SECRET}\"]\n\
             gossip_listen = \"{addr}:{GOSSIP_PORT}\"\npeer_listen = \"{addr}:0\"\n\
             seeds = [{}]\nexpect_nodes = 3\nreplication = 2\n\
             probe_period_ms = 200\nsuspicion_timeout_ms = 2000\nhedge_after_ms = 100\n\
             join_timeout_seconds = 30\nrereplicate_after_ms = 3000\n",
            seeds.join(", "),
            addr = net.addr(i),
        ),
    )
    .unwrap();
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v3");
    let ns = net.ns(i);
    let listen = format!("{}:0", net.addr(i));
    let process = Process::start_under(
        &[
            OsStr::new("ip"),
            OsStr::new("netns"),
            OsStr::new("exec"),
            OsStr::new(&ns),
        ],
        &[
            OsStr::new("serve"),
            OsStr::new("--listen"),
            OsStr::new(&listen),
            OsStr::new("--config"),
            config.as_os_str(),
            OsStr::new("--model"),
            model.as_os_str(),
        ],
        &[],
    );
    NsNode {
        process,
        client: Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap(),
    }
}

fn wait_ready(node: &NsNode) {
    wait_until(Duration::from_secs(90), "ready", || {
        node.client
            .get(format!("{}/ready", node.process.base))
            .send()
            .is_ok_and(|r| r.status() == StatusCode::OK)
    });
}

/// Cuts `nodes[victim]` off past `rereplicate_after_ms` (each side re-places the experts),
/// heals, and waits until every node serves one table: how long that took after the heal,
/// and the table.
fn partition(net: &Net, nodes: &[NsNode], victim: usize) -> (Duration, (Value, Value)) {
    let (before, _) = nodes[0].serving();
    let survivor = (victim + 1) % nodes.len();
    eprintln!("{}: node{} cut off", utc_now(), victim + 1);
    net.cut(victim + 1, true);
    let next = before.as_u64().unwrap() + 1;
    let replaced = || {
        nodes[survivor]
            .serving()
            .0
            .as_u64()
            .is_some_and(|v| v >= next)
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !replaced() {
        if Instant::now() > deadline {
            // What each node serves and sees, to tell why.
            let views: Vec<String> = nodes
                .iter()
                .map(|n| {
                    let lines = n.process.log_lines();
                    let placement: Vec<&String> = lines
                        .iter()
                        .filter(|l| l.contains("rollout") || l.contains("placement"))
                        .collect();
                    let tail = &placement[placement.len().saturating_sub(25)..];
                    format!("{:?} {}\n{tail:#?}", n.serving(), n.get("/admin/cluster"))
                })
                .collect();
            panic!(
                "node{} cut off: never re-placed on the larger side: {views:#?}",
                victim + 1
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(6));
    net.cut(victim + 1, false);
    eprintln!("{}: node{} joined again", utc_now(), victim + 1);
    let converged = wait_until(Duration::from_secs(90), "converged on one table", || {
        let tables: Vec<_> = nodes.iter().map(NsNode::serving).collect();
        tables[0].1.is_string() && tables.iter().all(|t| *t == tables[0])
    });
    (converged, nodes[0].serving())
}

/// One node killed (-9) and restarted, one paused shorter than the suspicion timeout (2 s),
/// one paused twice as long (declared down, then back): `[killed, short, long]`; each time
/// until every node sees every other alive again.
fn kill_and_pause(net: &Net, nodes: &mut [NsNode], dir: &std::path::Path, victims: [usize; 3]) {
    let names: Vec<String> = (1..=nodes.len()).map(|i| format!("node{i}")).collect();
    let all_back = |nodes: &[NsNode]| {
        wait_until(
            Duration::from_secs(60),
            "every node alive everywhere",
            || nodes.iter().all(|n| n.sees_alive(&names)),
        )
    };
    let [killed, short, long] = victims;
    eprintln!("{}: node{} killed", utc_now(), killed + 1);
    nodes[killed].signal("-9");
    let _ = nodes[killed].process.child.wait();
    std::thread::sleep(Duration::from_millis(500));
    nodes[killed] = start_node(net, killed + 1, dir);
    wait_ready(&nodes[killed]);
    all_back(nodes);
    for (victim, pause) in [(short, 1000), (long, 4000)] {
        eprintln!("{}: node{} paused {pause} ms", utc_now(), victim + 1);
        nodes[victim].signal("-STOP");
        std::thread::sleep(Duration::from_millis(pause));
        nodes[victim].signal("-CONT");
        all_back(nodes);
    }
}

/// The time of day (UTC, as the nodes' logs write it), to set a client's failure beside
/// them.
fn utc_now() -> String {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let s = since.as_secs();
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        s / 3600 % 24,
        s / 60 % 60,
        s % 60,
        since.subsec_millis()
    )
}

fn wait_until(within: Duration, what: &str, mut done: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < within, "never {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
    started.elapsed()
}

/// Greedy stream of `prompt` through `base`: its tokens, or what went wrong.
fn stream(client: &Client, base: &str, prompt: &[u32]) -> Result<Vec<u64>, String> {
    stream_tokens(client, base, prompt, 16)
}

#[test]
fn after_a_partition_heals_the_nodes_serve_one_table_and_no_stream_fails() {
    let Some(net) = network(3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<NsNode> = (1..=3).map(|i| start_node(&net, i, dir.path())).collect();
    for node in &nodes {
        wait_ready(node);
    }
    let gateway_config = dir.path().join("gateway.toml");
    let seeds: Vec<String> = (1..=3)
        .map(|j| format!("\"{}:{GOSSIP_PORT}\"", net.addr(j)))
        .collect();
    std::fs::write(
        &gateway_config,
        format!(
            "[server]\nlisten = \"{host}:0\"\n\
             [cluster]\nnode_id = \"gateway\"\nsecrets = [\"{SECRET}\"]\n\
             gossip_listen = \"{host}:0\"\nseeds = [{}]\n\
             probe_period_ms = 200\nsuspicion_timeout_ms = 2000\n\
             [gateway]\nstall_seconds = 4\nready_poll_ms = 100\n",
            seeds.join(", "),
            host = net.host(),
        ),
    )
    .unwrap();
    let gateway = Process::start(&[
        OsStr::new("gateway"),
        OsStr::new("--config"),
        gateway_config.as_os_str(),
    ]);
    let client = Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    wait_until(Duration::from_secs(30), "saw three ready nodes", || {
        client
            .get(format!("{}/ready", gateway.base))
            .send()
            .and_then(|r| r.json::<Value>())
            .is_ok_and(|v| v["nodes_ready"] == 3)
    });
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| vec![3 + i, 11, 7 + 2 * i, 5]).collect();
    let expected: Vec<Vec<u64>> = prompts
        .iter()
        .map(|p| stream(&client, &gateway.base, p).unwrap())
        .collect();
    let (version, _) = nodes[0].serving();

    let began = Instant::now();
    // Clients stream through the gateway all along.
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let (base, stop) = (gateway.base.clone(), stop.clone());
            let (prompt, want) = (prompts[c].clone(), expected[c].clone());
            std::thread::spawn(move || {
                let at = |what: String| format!("{}: {what}", utc_now());
                let client = Client::builder()
                    .timeout(Duration::from_secs(60))
                    .build()
                    .unwrap();
                let (mut done, mut problems) = (0, Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    match stream(&client, &base, &prompt) {
                        Ok(tokens) if tokens == want => done += 1,
                        Ok(tokens) => problems.push(at(format!("changed: {tokens:?}"))),
                        Err(e) => problems.push(at(e)),
                    }
                }
                (done, problems)
            })
        })
        .collect();

    // node3 cut off past rereplicate_after_ms: each side places the experts again, and
    // each side's leader (node1; node3 alone) proposes the next version.
    std::thread::sleep(Duration::from_secs(1));
    let next = version.as_u64().unwrap() + 1;
    let (converged, after) = partition(&net, &nodes, 2);
    // Both sides proposed the next version, and the leader mended the two tables with the
    // one after (its reason names node3's table, or node3 as a node its table lacks,
    // depending on which gossip reached it first).
    let proposed = |node: &NsNode| {
        node.process.log_lines().iter().any(|l| {
            l.contains("proposing a new placement") && l.contains(&format!("version={next}"))
        })
    };
    assert!(
        proposed(&nodes[0]) && proposed(&nodes[2]),
        "each side proposed version {next}"
    );
    // Mended by a later version: the one after, or more where the leader's first mend did
    // not yet count node3 (its gossip still on its way).
    assert!(after.0.as_u64().unwrap() > next, "{after:?}");
    std::thread::sleep(Duration::from_secs(2));
    // Then the soak's other disruptions, one node at a time, the clients streaming on.
    kill_and_pause(&net, &mut nodes, dir.path(), [1, 0, 2]);
    // Longer (`MOE_NETNS_SOAK_SECONDS`, benches/netns_soak.sh): the same again, each time
    // on other nodes, until the time is up.
    let soak = Duration::from_secs(
        std::env::var("MOE_NETNS_SOAK_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
    );
    let mut heals = vec![converged];
    let started = Instant::now();
    for round in 1.. {
        if started.elapsed() >= soak {
            break;
        }
        heals.push(partition(&net, &nodes, round % 3).0);
        kill_and_pause(
            &net,
            &mut nodes,
            dir.path(),
            [(round + 2) % 3, round % 3, (round + 1) % 3],
        );
    }
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    let mut served = 0;
    for client in clients {
        let (done, problems) = client.join().unwrap();
        assert!(problems.is_empty(), "through the gateway: {problems:?}");
        served += done;
    }
    heals.sort();
    let report = format!(
        "partition with real processes ({}): both sides proposed version {next}; one table \
         {after:?} {:.2} s after the first heal; {} rounds of a partition past \
         rereplicate_after_ms, a kill -9 and restart, a 1 s and a 4 s pause, in {:.0} s; one \
         table after each heal in {:.2} s at the median, {:.2} s at most; {served} streams \
         through the gateway, none failed or changed",
        match &net.netem {
            Some(Ok(())) => "links with netem delay 2 ms and 0.5% loss each way".to_string(),
            Some(Err(why)) => format!("clean links: no netem here ({why})"),
            None => "clean links".to_string(),
        },
        converged.as_secs_f64(),
        heals.len(),
        began.elapsed().as_secs_f64(),
        heals[heals.len() / 2].as_secs_f64(),
        heals[heals.len() - 1].as_secs_f64(),
    );
    eprintln!("{report}");
    if let Ok(path) = std::env::var("MOE_NETNS_SOAK_REPORT") {
        std::fs::write(path, format!("{report}\n")).unwrap();
    }
    assert!(served > 0);
    // Every node answers, with the same tokens, once converged.
    for node in &nodes {
        assert_eq!(
            stream(&client, &node.process.base, &prompts[0]).unwrap(),
            expected[0]
        );
    }
}
