//! `moe-node gateway` in front of three real nodes (loopback, TCP peers), driven over HTTP
//! as a client would: 16 concurrent streams through the gateway while the node running
//! some of them is killed (`kill -9`, each node in turn) or drained (SIGTERM). Every stream
//! must complete with the tokens one node gives alone, none missing or twice, and usage
//! counting the whole generation.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use reqwest::blocking::Client;
use serde_json::{Value, json};

mod common;
mod serve;
use serve::rss_kib;

mod cluster_harness;
use cluster_harness::*;

const STREAMS: usize = 16;
const MAX_TOKENS: usize = 48;

/// Streams a greedy completion of `prompt` through `base`, with usage; `started` is
/// signalled at its first token. Errors name what was wrong with the stream.
fn stream(
    base: &str,
    prompt: &[u32],
    started: std::sync::mpsc::Sender<()>,
) -> Result<Choices, String> {
    let mut body = greedy_stream(prompt, MAX_TOKENS);
    body["stream_options"] = json!({"include_usage": true});
    stream_choices(base, &body, started)
}

/// What a client of a stream of several choices got: each choice's tokens (by `index`),
/// the usage the stream ended with, and every chunk's `id`.
struct Choices {
    tokens: Vec<Vec<u64>>,
    completion_tokens: u64,
    ids: Vec<String>,
}

/// Streams `body` (token ids returned) through `base`; `started` is signalled at the first
/// token.
fn stream_choices(
    base: &str,
    body: &Value,
    started: std::sync::mpsc::Sender<()>,
) -> Result<Choices, String> {
    let client = Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let response = post_stream(&client, base, body)?;
    let mut got = Choices {
        tokens: Vec::new(),
        completion_tokens: 0,
        ids: Vec::new(),
    };
    let done = read_events(response, |event| {
        got.ids
            .push(event["id"].as_str().unwrap_or_default().to_string());
        if let Some(usage) = event.get("usage").filter(|u| !u.is_null()) {
            got.completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
        }
        for choice in event["choices"].as_array().into_iter().flatten() {
            let index = choice["index"].as_u64().unwrap() as usize;
            if got.tokens.len() <= index {
                got.tokens.resize(index + 1, Vec::new());
            }
            let ids = choice["token_ids"].as_array().into_iter().flatten();
            got.tokens[index].extend(ids.filter_map(Value::as_u64));
            if !got.tokens[index].is_empty() {
                let _ = started.send(());
            }
        }
    })?;
    if !done {
        let lengths: Vec<usize> = got.tokens.iter().map(Vec::len).collect();
        return Err(format!("stream cut after {lengths:?} tokens"));
    }
    Ok(got)
}

/// Three ready nodes, and a gateway that sees them all ready.
fn three_nodes_and_a_gateway() -> (ClusterSpec, Vec<Node>, Gateway) {
    let spec = ClusterSpec::new(3, Transport::Tcp);
    let nodes: Vec<Node> = (0..3).map(|i| spec.start(i)).collect();
    for node in &nodes {
        node.wait_ready();
    }
    let gateway = Gateway::start(&spec);
    gateway.wait_nodes_ready(3);
    (spec, nodes, gateway)
}

fn prompt(i: usize) -> Vec<u32> {
    vec![5 + (i as u32 * 11) % 100, 7 + (i as u32 * 17) % 100, 3, 9]
}

/// Runs [`STREAMS`] streams through the gateway and, once each has its first token, does
/// `disrupt`; checks every stream against `expected`.
fn streams_survive(gateway: &Gateway, expected: &[Vec<u64>], disrupt: impl FnOnce()) {
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let clients: Vec<_> = (0..STREAMS)
        .map(|i| {
            let base = gateway.process.base.clone();
            let started = started_tx.clone();
            std::thread::spawn(move || stream(&base, &prompt(i), started))
        })
        .collect();
    for _ in 0..STREAMS {
        started_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("every stream starts");
    }
    disrupt();
    for (i, client) in clients.into_iter().enumerate() {
        let got = client
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("stream {i}: {e}"));
        assert_eq!(
            got.tokens,
            [expected[i].clone()],
            "stream {i}: tokens missing, repeated or changed"
        );
        assert_eq!(
            got.completion_tokens, MAX_TOKENS as u64,
            "stream {i}: usage"
        );
        assert!(
            got.ids.windows(2).all(|w| w[0] == w[1]),
            "stream {i} changed its id: {:?}",
            got.ids
        );
    }
}

#[test]
fn streams_through_the_gateway_go_on_when_their_node_is_killed_or_drained() {
    let (_spec, mut nodes, gateway) = three_nodes_and_a_gateway();
    // The nodes do not count the gateway as one of them.
    for node in &nodes {
        let members = node.cluster()["members"].as_array().unwrap().len();
        assert_eq!(members, 3, "{}", node.cluster());
    }
    // What one node gives alone; the first also from `moe-node generate`.
    let expected: Vec<Vec<u64>> = (0..STREAMS)
        .map(|i| completion(&nodes[0], &prompt(i), MAX_TOKENS))
        .collect();
    assert_eq!(generate_alone(&prompt(0), MAX_TOKENS), expected[0]);

    // Undisturbed; and a client that did not ask for token ids gets none.
    streams_survive(&gateway, &expected, || {});
    let plain: Value = gateway
        .client
        .post(format!("{}/v1/completions", gateway.process.base))
        .json(&json!({"prompt": prompt(0), "max_tokens": 4, "temperature": 0}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert!(plain["choices"][0].get("token_ids").is_none(), "{plain}");

    // Each node in turn dies under the streams, and comes back.
    for victim in 0..3 {
        let moves = gateway.metric("moe_node_gateway_moves_total");
        streams_survive(&gateway, &expected, || nodes[victim].kill());
        assert!(
            gateway.metric("moe_node_gateway_moves_total") > moves,
            "no stream was on {}",
            nodes[victim].name
        );
        nodes[victim].restart();
        nodes[victim].wait_ready();
        // Back in every view before the next one dies: one death at a time leaves every
        // expert a live copy (replication 2).
        let back = nodes[victim].name.clone();
        for node in &nodes {
            node.wait_member_state(&back, "alive", Duration::from_secs(30));
        }
        gateway.wait_nodes_ready(3);
    }

    // A stream of three sampled choices is split into one stream per choice (choice i
    // seeded seed + i, as a node seeds it), each moved on its own: the client gets what one
    // node gives for the whole request, though a node running some of it dies.
    let body = json!({"prompt": prompt(5), "max_tokens": MAX_TOKENS, "ignore_eos": true,
                      "n": 3, "seed": 1234, "temperature": 1.0, "return_token_ids": true,
                      "stream": true, "stream_options": {"include_usage": true}});
    let (started, _) = std::sync::mpsc::channel();
    let alone = stream_choices(&nodes[0].base, &body, started).unwrap();
    assert_eq!(alone.tokens.len(), 3);
    assert!(alone.tokens[0] != alone.tokens[1], "sampled choices differ");
    let (started, first_token) = std::sync::mpsc::channel();
    let base = gateway.process.base.clone();
    let split = {
        let body = body.clone();
        std::thread::spawn(move || stream_choices(&base, &body, started))
    };
    first_token.recv_timeout(Duration::from_secs(60)).unwrap();
    let moves = gateway.metric("moe_node_gateway_moves_total");
    nodes[2].kill();
    let got = split.join().unwrap().unwrap();
    assert_eq!(
        got.tokens, alone.tokens,
        "choices changed by the split or the move"
    );
    assert_eq!(got.completion_tokens, 3 * MAX_TOKENS as u64, "usage");
    assert!(got.ids.windows(2).all(|w| w[0] == w[1]), "{:?}", got.ids);
    assert!(
        gateway.metric("moe_node_gateway_moves_total") > moves,
        "no choice was on {}",
        nodes[2].name
    );
    nodes[2].restart();
    nodes[2].wait_ready();
    for node in &nodes {
        node.wait_member_state(&nodes[2].name, "alive", Duration::from_secs(30));
    }
    gateway.wait_nodes_ready(3);

    // A node told to stop hands its streams to the gateway at once: they go on elsewhere,
    // and it drains without waiting for them.
    let handed = gateway.metric("moe_node_gateway_moves_total{why=\"error\"}");
    streams_survive(&gateway, &expected, || nodes[1].signal("-TERM"));
    assert!(gateway.metric("moe_node_gateway_moves_total{why=\"error\"}") > handed);
    let deadline = Instant::now() + Duration::from_secs(20);
    while nodes[1].process.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the drained node did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        nodes[1].process.log_contains("drained"),
        "{:?}",
        nodes[1].log()
    );
    assert_eq!(
        gateway.metric("moe_node_gateway_requests_total{outcome=\"failed\"}"),
        0.0
    );
    // One node down at a time, every expert kept a live copy: no node failed a generation
    // for want of one (the gateway would have hidden it by moving the stream).
    assert!(
        !gateway.process.log_contains("no live replica"),
        "{:?}",
        gateway.process.log_lines()
    );
}

/// With no node to forward to, a client gets 503 naming why once the gateway has waited
/// `gateway.wait_ready_seconds` for one, and bad requests get 400 from the gateway itself
/// before any node sees them.
#[test]
fn a_gateway_without_nodes_answers_503_and_refuses_garbage() {
    let spec = ClusterSpec::new(1, Transport::Tcp);
    let gateway = Gateway::start(&spec);
    assert_eq!(gateway.get("/health").status(), StatusCode::OK);
    assert_eq!(
        gateway.get("/ready").status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    let post = |body: &str| {
        gateway
            .client
            .post(format!("{}/v1/chat/completions", gateway.process.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .unwrap()
    };
    let asked = std::time::Instant::now();
    let none = post(r#"{"messages": [{"role": "user", "content": "hi"}]}"#);
    assert_eq!(none.status(), StatusCode::SERVICE_UNAVAILABLE);
    let waited = asked.elapsed();
    assert!(
        waited >= cluster_harness::GATEWAY_WAIT_READY
            && waited < cluster_harness::GATEWAY_WAIT_READY * 3,
        "{waited:?}"
    );
    let body: Value = none.json().unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no node"),
        "{body}"
    );
    for garbage in ["{", "[1, 2]", "\u{0}\u{1}"] {
        assert_eq!(
            post(garbage).status(),
            StatusCode::BAD_REQUEST,
            "{garbage:?}"
        );
    }
    assert_eq!(gateway.get("/nope").status(), StatusCode::NOT_FOUND);
}

/// How long the soak runs: `MOE_GATEWAY_SOAK_SECONDS` (60 in CI; the benchmark
/// `benches/gateway_soak.sh` runs 600).
fn soak_seconds() -> u64 {
    std::env::var("MOE_GATEWAY_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60)
}

/// One disruption of the soak.
#[derive(Debug, Clone, Copy)]
enum Disruption {
    Kill,
    /// SIGSTOP for less than the suspicion timeout (2 s): no one is declared dead.
    ShortPause,
    /// SIGSTOP for twice the suspicion timeout: declared dead, then back.
    LongPause,
}

/// What the clients of the soak saw.
#[derive(Default)]
struct Tally {
    requests: usize,
    failed: Vec<String>,
    changed: usize,
    /// Seconds per request, during the steady part and during the disruptions.
    steady: Vec<f64>,
    disrupted: Vec<f64>,
}

fn p99(seconds: &mut [f64]) -> f64 {
    if seconds.is_empty() {
        return 0.0;
    }
    seconds.sort_by(f64::total_cmp);
    seconds[(seconds.len() * 99 / 100).min(seconds.len() - 1)]
}

/// Brings `node` back into every view after a disruption, so that one node at a time is
/// out (replication 2 keeps a live copy of every expert then).
fn wait_back(nodes: &[Node], back: &str) {
    for node in nodes {
        node.wait_member_state(back, "alive", Duration::from_secs(60));
    }
}

/// Streams through the gateway for [`soak_seconds`] while a node at a time is killed and
/// restarted, or paused shorter or longer than the suspicion timeout. Nothing may fail and
/// no output may change; the report (requests, failures, changed outputs, the gateway's p99
/// latency against the steady part, every process's memory) goes to stderr, and to the file
/// `MOE_GATEWAY_SOAK_REPORT` names.
#[test]
fn a_soak_through_the_gateway_under_kills_restarts_and_pauses_loses_nothing() {
    use rand::{Rng, SeedableRng};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    const CLIENTS: usize = 8;
    const PROMPTS: usize = 8;
    const TOKENS: usize = 32;
    let total = Duration::from_secs(soak_seconds());
    let steady = total / 6;
    let (_spec, nodes, gateway) = three_nodes_and_a_gateway();
    let expected: Arc<Vec<Vec<u64>>> = Arc::new(
        (0..PROMPTS)
            .map(|i| completion(&nodes[0], &prompt(i), TOKENS))
            .collect(),
    );
    let processes = |nodes: &[Node]| -> Vec<(String, u64)> {
        let mut all: Vec<_> = nodes
            .iter()
            .map(|n| (n.name.clone(), rss_kib(n.process.child.id())))
            .collect();
        all.push(("gateway".into(), rss_kib(gateway.process.child.id())));
        all
    };
    let memory_at_start = processes(&nodes);

    let started = Instant::now();
    let disrupting = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (base, expected) = (gateway.process.base.clone(), expected.clone());
            let (tally, disrupting) = (tally.clone(), disrupting.clone());
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(c as u64);
                let client = Client::builder()
                    .timeout(Duration::from_secs(120))
                    .build()
                    .unwrap();
                while started.elapsed() < total {
                    let i = rng.random_range(0..PROMPTS);
                    let during = disrupting.load(Ordering::Relaxed);
                    let asked = Instant::now();
                    let got = stream_tokens(&client, &base, &prompt(i), TOKENS);
                    let seconds = asked.elapsed().as_secs_f64();
                    let mut tally = tally.lock().unwrap();
                    tally.requests += 1;
                    match got {
                        Ok(tokens) if tokens == expected[i] => {}
                        Ok(_) => tally.changed += 1,
                        Err(e) => tally.failed.push(e),
                    }
                    if during || disrupting.load(Ordering::Relaxed) {
                        tally.disrupted.push(seconds);
                    } else {
                        tally.steady.push(seconds);
                    }
                }
            })
        })
        .collect();

    std::thread::sleep(steady);
    disrupting.store(true, Ordering::Relaxed);
    let mut nodes = nodes;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut done: Vec<(Disruption, String)> = Vec::new();
    while started.elapsed() + Duration::from_secs(8) < total {
        let victim = rng.random_range(0..nodes.len());
        // Each kind in turn, so that a short soak has all three.
        let disruption = [
            Disruption::Kill,
            Disruption::ShortPause,
            Disruption::LongPause,
        ][done.len() % 3];
        let name = nodes[victim].name.clone();
        match disruption {
            Disruption::Kill => {
                nodes[victim].kill();
                std::thread::sleep(Duration::from_millis(500));
                nodes[victim].restart();
                nodes[victim].wait_ready();
            }
            Disruption::ShortPause | Disruption::LongPause => {
                let pause = match disruption {
                    Disruption::ShortPause => Duration::from_millis(1000),
                    _ => Duration::from_millis(4000),
                };
                nodes[victim].signal("-STOP");
                std::thread::sleep(pause);
                nodes[victim].signal("-CONT");
            }
        }
        wait_back(&nodes, &name);
        gateway.wait_nodes_ready(3);
        done.push((disruption, name));
        std::thread::sleep(Duration::from_millis(rng.random_range(500..2000)));
    }
    for client in clients {
        client.join().unwrap();
    }
    let memory_at_end = processes(&nodes);
    let mut tally = tally.lock().unwrap();
    let (steady_p99, disrupted_p99) = (p99(&mut tally.steady), p99(&mut tally.disrupted));
    let memory: Vec<String> = memory_at_start
        .iter()
        .zip(&memory_at_end)
        .map(|((name, start), (_, end))| format!("{name} {start} -> {end} KiB"))
        .collect();
    let report = format!(
        "gateway soak: {} s, {CLIENTS} streaming clients, 3 nodes (replication 2)\n\
         disruptions ({}): {:?}\n\
         requests {}, failed {}, changed outputs {}\n\
         gateway p99 latency: steady {steady_p99:.3} s ({} requests), under disruptions \
         {disrupted_p99:.3} s ({} requests)\n\
         moves by why: {}\n\
         memory (RSS; a killed node's is its restarted process's): {}\n",
        total.as_secs(),
        done.len(),
        done,
        tally.requests,
        tally.failed.len(),
        tally.changed,
        tally.steady.len(),
        tally.disrupted.len(),
        gateway
            .get("/metrics")
            .text()
            .unwrap()
            .lines()
            .filter(|l| l.starts_with("moe_node_gateway_moves_total"))
            .collect::<Vec<_>>()
            .join(", "),
        memory.join(", "),
    );
    eprintln!("{report}");
    if let Ok(path) = std::env::var("MOE_GATEWAY_SOAK_REPORT") {
        std::fs::write(path, &report).unwrap();
    }
    assert!(!done.is_empty(), "no disruption happened in {total:?}");
    assert!(tally.failed.is_empty(), "failed: {:?}", tally.failed);
    assert_eq!(tally.changed, 0, "changed outputs");
    assert!(tally.requests > CLIENTS, "{report}");
}

/// Requests that share a prompt prefix go to the node that served it before, where the
/// prefix cache holds it (the gateway's prefix affinity), while distinct prompts spread
/// over the nodes.
#[test]
fn requests_sharing_a_prefix_go_where_it_is_cached() {
    let (_spec, nodes, gateway) = three_nodes_and_a_gateway();
    let complete = |prompt: Vec<u32>| {
        let response = gateway
            .client
            .post(format!("{}/v1/completions", gateway.process.base))
            .json(&json!({"prompt": prompt, "max_tokens": 2, "temperature": 0}))
            .send()
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    };
    let hits = |node: &Node| node.metric_sum("moe_node_prefix_cache_hits_total");
    let before: Vec<f64> = nodes.iter().map(hits).collect();
    let shared: Vec<u32> = (0..120).map(|i| 3 + (i * 7) % 100).collect();
    for suffix in 0..6u32 {
        let mut prompt = shared.clone();
        prompt.extend([5 + suffix, 9, 2 + suffix]);
        complete(prompt);
    }
    let gained: Vec<f64> = nodes
        .iter()
        .zip(&before)
        .map(|(n, b)| hits(n) - b)
        .collect();
    assert_eq!(
        gained.iter().filter(|&&g| g > 0.0).count(),
        1,
        "one node holds the prefix and gets every request after the first: {gained:?}"
    );
    assert!(gained.iter().any(|&g| g >= 5.0), "{gained:?}");
    // Distinct prompts, one at a time: each goes to the least loaded node in turn.
    let served: Vec<f64> = nodes
        .iter()
        .map(|n| n.metric_sum("moe_node_prompt_tokens_total"))
        .collect();
    for i in 0..6u32 {
        complete(vec![60 + i, 17, 40 + 3 * i, 8]);
    }
    let spread = nodes
        .iter()
        .zip(&served)
        .filter(|(n, before)| n.metric_sum("moe_node_prompt_tokens_total") > **before)
        .count();
    assert_eq!(spread, 3, "distinct prompts spread over every node");
}
