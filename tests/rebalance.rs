//! Activation profiles from a real server: the skewed demo model (`demo-model --skew`)
//! routes tokens to a few hot experts, the node exports what it measured
//! (`/admin/experts?format=profile`, `moe-node profile`), and `moe-node plan` reads it.

use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod serve;
use serve::{BIN, Server};

#[path = "../benches/common/replication.rs"]
#[allow(dead_code)]
mod replication;

/// The demo model with a gate skewed at `skew`, written once per skew for this binary.
fn skewed_model(skew: &str) -> PathBuf {
    serve::demo_model_variant(&format!("demo-model-skew-{skew}"), &["--skew", skew])
}

/// Serves `model` on two CPU slots and runs a few greedy completions through it.
fn serve_some(model: &Path) -> Server {
    let server = Server::start_with(
        "[devices]\nbackend = \"cpu\"\ncpu_slots = 2\n",
        &["--model", model.to_str().unwrap()],
    );
    server.wait_ready();
    for prompt in [
        "The quick brown fox",
        "Hello there",
        "MoE load balance",
        "1 2 3 4 5",
    ] {
        server.post_ok(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": true}),
        );
    }
    server
}

/// Share of a layer's activations taken by its 45 most activated experts (5% of 896).
fn top_share(counts: &[u64]) -> f64 {
    let mut sorted = counts.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let total: u64 = sorted.iter().sum();
    sorted[..45].iter().sum::<u64>() as f64 / total.max(1) as f64
}

fn counts(profile: &Value, layer: &str) -> Vec<u64> {
    profile["layers"][layer]
        .as_array()
        .unwrap_or_else(|| panic!("layer {layer} missing: {profile}"))
        .iter()
        .map(|c| c.as_u64().unwrap())
        .collect()
}

#[test]
fn a_skewed_gate_concentrates_activations_and_the_profile_shows_it() {
    let flat = serve_some(&skewed_model("0"));
    let profile: Value = flat.get("/admin/experts?format=profile").json().unwrap();
    let flat_share = top_share(&counts(&profile, "2"));
    drop(flat);

    let model = skewed_model("1");
    let server = serve_some(&model);
    let profile: Value = server.get("/admin/experts?format=profile").json().unwrap();
    assert!(profile["fingerprint"].as_str().unwrap().starts_with("0x"));
    assert!(profile["window_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(
        profile["layers"].as_object().unwrap().len(),
        3,
        "the demo model's 3 MoE layers"
    );
    for layer in ["1", "2", "3"] {
        let share = top_share(&counts(&profile, layer));
        assert!(
            // The unbiased demo gate is uneven already (few, similar prompts): about half
            // the activations go to its top 5%; the skewed gate takes most of the rest.
            share > 0.6 && share > flat_share + 0.2,
            "layer {layer}: the top 5% of experts take {share:.2} of activations (unskewed: {flat_share:.2})"
        );
    }
    // Since start, the same counts (nothing has left the window yet).
    let all: Value = server
        .get("/admin/experts?format=profile&window=all")
        .json()
        .unwrap();
    assert_eq!(all["layers"], profile["layers"]);
    let bad = server.get("/admin/experts?format=csv");
    assert_eq!(bad.status(), 400);

    // `moe-node profile` saves it; `plan` reads it and sees the hot experts.
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("profile.json");
    let out = Command::new(BIN)
        .args(["profile", "--url", &server.base, "--out"])
        .arg(&saved)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(BIN)
        .args(["plan", "--json", "--devices-per-node", "2", "--model"])
        .arg(&model)
        .arg("--profile")
        .arg(&saved)
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert!(report["model"]["profiled"].as_bool().unwrap());
    assert!(
        !report["layers"]["2"]["hot_experts"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}

/// Clients sending completions to some nodes until finished.
struct Load {
    stop: Arc<AtomicBool>,
    clients: Vec<std::thread::JoinHandle<(usize, Vec<String>)>>,
}

impl Load {
    /// `per_node` clients for each API base URL in `bases`.
    fn start(bases: &[&str], per_node: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let clients = bases
            .iter()
            .flat_map(|base| (0..per_node).map(move |c| (base.to_string(), c)))
            .map(|(base, c)| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let client = reqwest::blocking::Client::builder()
                        .timeout(Duration::from_secs(120))
                        .build()
                        .unwrap();
                    let (mut ok, mut failed) = (0, Vec::new());
                    while !stop.load(Ordering::Relaxed) {
                        let resp = client
                            .post(format!("{base}/v1/completions"))
                            .json(&json!({"prompt": format!("client {c} says {ok}"),
                                          "max_tokens": 8, "ignore_eos": true}))
                            .send();
                        match resp {
                            Ok(r) if r.status().is_success() => ok += 1,
                            Ok(r) => failed.push(format!(
                                "{base}: {}: {}",
                                r.status(),
                                r.text().unwrap_or_default()
                            )),
                            Err(e) => failed.push(format!("{base}: {e}")),
                        }
                    }
                    (ok, failed)
                })
            })
            .collect();
        Load { stop, clients }
    }

    /// Stops the clients; asserts every request succeeded; returns how many ran.
    fn finish(self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        let mut served = 0;
        for client in self.clients {
            let (ok, failed) = client.join().unwrap();
            assert!(failed.is_empty(), "requests failed: {failed:?}");
            served += ok;
        }
        assert!(served > 10, "only {served} requests ran under load");
        served
    }
}

/// The worst layer's `moe_node_layer_imbalance_recent`.
fn recent_imbalance(server: &Server) -> f64 {
    let text = server.get("/metrics").text().unwrap();
    text.lines()
        .filter(|l| l.starts_with("moe_node_layer_imbalance_recent{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, f64::max)
}

fn greedy(server: &Server, prompt: &str) -> Value {
    server.post_ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true,
                "return_token_ids": true}),
    )["choices"][0]["token_ids"]
        .clone()
}

/// `got` within `range`, the band the measured figure for `what` is held to.
#[track_caller]
fn assert_within(what: &str, got: f64, range: std::ops::RangeInclusive<f64>, report: &Value) {
    assert!(
        range.contains(&got),
        "{what} {got:.3}, outside {range:?}: {report}"
    );
}

#[test]
fn a_node_under_skewed_load_rebalances_live_without_failing_or_changing_a_request() {
    let model = skewed_model("1");
    let server = Server::start_with(
        "[server]\nadmin_actions = true\n\
         [devices]\nbackend = \"cpu\"\ncpu_slots = 4\n\
         [placement]\nredundant_slots_per_device = 24\nwindow_seconds = 3\n",
        &["--model", model.to_str().unwrap()],
    );
    server.wait_ready();
    // The KV cache budget leaves the host memory the spare slots will take once a rebalance
    // fills them: 24 slots on each of 4 CPU slots in every MoE layer.
    let config = moe_node::model::ModelConfig::load(&model).unwrap();
    let moe_layers = config.moe_layers.iter().filter(|&&moe| moe).count() as u64;
    let expert_bytes = moe_node::plan::sizes::ModelSizes::of(&config).expert_bytes;
    let spare = 24 * 4 * moe_layers * expert_bytes;
    assert!(
        server.log_contains(&format!("spare_slot_bytes={spare}")),
        "{:?}",
        server.process.log_lines()
    );
    // And what a version holds twice while it switches: placement.max_move_mib (4 GiB),
    // or every expert once on each of the 4 slots where that is less (this small model).
    let all_experts = config.moe.num_experts as u64 * moe_layers * 4 * expert_bytes;
    let reserve = (4096u64 << 20).min(all_experts);
    assert!(
        server.log_contains(&format!("move_reserve_bytes={reserve}")),
        "{:?}",
        server.process.log_lines()
    );
    let prompts = [
        "The quick brown fox",
        "Hello there",
        "MoE load balance",
        "1 2 3 4 5",
    ];
    let before: Vec<Value> = prompts.iter().map(|p| greedy(&server, p)).collect();

    // Clients keep the node busy from here to the end; every request must succeed.
    let load = Load::start(&[&server.base], 3);

    // A full window of skewed load under the layout the node started with.
    std::thread::sleep(Duration::from_secs(4));
    let imbalance_before = recent_imbalance(&server);
    let report = server.post_ok("/admin/rebalance", &json!({}));
    assert!(report["copies_loaded"].as_u64().unwrap() > 0, "{report}");
    assert!(report["bytes_loaded"].as_u64().unwrap() > 0, "{report}");
    // One version per 4 GiB loaded (placement.max_move_mib): the demo's copies fit in one.
    assert_eq!(report["versions"], 1, "{report}");
    assert_eq!(report["version"], 2);
    let predicted = report["imbalance_after"].as_f64().unwrap();
    assert!(
        predicted < report["imbalance_before"].as_f64().unwrap(),
        "{report}"
    );
    // A full window under the new placement: the devices' measured load evens out.
    std::thread::sleep(Duration::from_secs(4));
    let imbalance_after = recent_imbalance(&server);

    let served = load.finish();
    eprintln!(
        "rebalance under load: {served} requests, recent imbalance {imbalance_before:.3} -> \
         {imbalance_after:.3}; report {report}"
    );
    assert!(
        imbalance_after < imbalance_before,
        "recent imbalance {imbalance_before:.3} before, {imbalance_after:.3} after: {report}"
    );
    // The figures runs measured, within bands: the window holds whatever requests the
    // clients got through in its seconds (1130 to 1479 in six runs), so they are not exact.
    // Measured (2026-12-06, 2 shared cores): recent imbalance 1.481-1.491 before; after,
    // 1.065-1.174 in six runs when a rebalance only filled spare slots, 1.036-1.039 in two
    // since it also moves experts (16-17 copies loaded and as many released, against 35-41
    // loaded before); the plan itself predicts 1.007-1.009 on its window (it stops within
    // 1% of the mean). The bands are wide: a window that holds fewer requests (a loaded CI
    // machine) is noisier.
    assert_within(
        "recent imbalance before",
        imbalance_before,
        1.30..=1.60,
        &report,
    );
    assert_within(
        "recent imbalance after",
        imbalance_after,
        1.0..=1.35,
        &report,
    );
    assert_within("predicted imbalance after", predicted, 1.0..=1.01, &report);
    // Copies compute exactly what the originals do.
    let after: Vec<Value> = prompts.iter().map(|p| greedy(&server, p)).collect();
    assert_eq!(before, after);
    assert_eq!(server.metric("moe_node_rebalances_total"), 1.0);
    let placement: Value = server.get("/admin/placement").json().unwrap();
    assert_eq!(placement["version"], 2);
    // A second rebalance: a version for each change it makes, none where the devices are
    // within 2% of the mean. This window is a few seconds of a few clients, so its noise
    // alone reads 1.03-1.06 and moves a dozen copies again (a 60 s window of a busy node
    // reads within 2%).
    let again = server.post_ok("/admin/rebalance", &json!({}));
    let versions = again["versions"].as_u64().unwrap();
    assert_eq!(again["version"], 2 + versions, "{again}");
    let predicted = again["imbalance_after"].as_f64().unwrap();
    assert_within(
        "predicted after a second rebalance",
        predicted,
        1.0..=1.02,
        &again,
    );
}

#[test]
fn rebalance_is_refused_without_spare_slots_or_admin_actions() {
    let model = skewed_model("1");
    let server = Server::start_with(
        "[server]\nadmin_actions = true\n[devices]\nbackend = \"cpu\"\ncpu_slots = 2\n",
        &["--model", model.to_str().unwrap()],
    );
    server.wait_ready();
    let resp = server.post("/admin/rebalance", &json!({}));
    assert_eq!(resp.status(), 409);
    assert!(resp.text().unwrap().contains("redundant_slots_per_device"));
    drop(server);
    let server = Server::start_with(
        "[devices]\nbackend = \"cpu\"\ncpu_slots = 2\n[placement]\nredundant_slots_per_device = 2\n",
        &["--model", model.to_str().unwrap()],
    );
    server.wait_ready();
    assert_eq!(server.post("/admin/rebalance", &json!({})).status(), 403);
}

#[test]
fn a_node_rebalances_on_its_own_every_interval_under_load() {
    let model = skewed_model("1");
    let server = Server::start_with(
        "[devices]\nbackend = \"cpu\"\ncpu_slots = 4\n\
         [placement]\nredundant_slots_per_device = 24\nwindow_seconds = 2\n\
         rebalance_interval_seconds = 3\n",
        &["--model", model.to_str().unwrap()],
    );
    server.wait_ready();
    let prompts = ["The quick brown fox", "MoE load balance"];
    // Two runs of the interval before the first: taken before any rebalance.
    let before: Vec<Value> = prompts.iter().map(|p| greedy(&server, p)).collect();
    assert_eq!(server.metric("moe_node_rebalances_total"), 0.0);
    let load = Load::start(&[&server.base], 3);
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.metric("moe_node_rebalances_total") < 2.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(250));
    }
    let served = load.finish();
    let rebalances = server.metric("moe_node_rebalances_total");
    let placement: Value = server.get("/admin/placement").json().unwrap();
    eprintln!(
        "periodic rebalance under load: {served} requests, {rebalances} rebalances, \
         placement version {}",
        placement["version"]
    );
    assert!(rebalances >= 2.0, "{rebalances} rebalances in 60 s");
    assert!(
        placement["version"].as_u64().unwrap() >= 2,
        "{}",
        placement["version"]
    );
    assert!(server.metric("moe_node_rebalance_loaded_bytes_total") > 0.0);
    let after: Vec<Value> = prompts.iter().map(|p| greedy(&server, p)).collect();
    assert_eq!(before, after);
}

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Two nodes of one cluster serving `model`, each with two CPU slots and spare slots for
/// hot copies; every expert has one copy (replication 1), so the skew piles on devices.
fn two_node_cluster(model: &Path) -> [Server; 2] {
    let ports = [free_udp_port(), free_udp_port()];
    let start = |i: usize| {
        let config = format!(
            "[server]\nadmin_actions = true\n\
             [devices]\nbackend = \"cpu\"\ncpu_slots = 2\n\
             [batching]\nmax_sequences = 32\n\
             [placement]\nredundant_slots_per_device = 24\nwindow_seconds = 3\n\
             max_move_mib = 0.25\n\
             [cluster]\nnode_id = \"node{}\"\nsecrets = [\"rebalance-test-secret-0123456789\"]\n\
             gossip_listen = \"127.0.0.1:{}\"\npeer_listen = \"127.0.0.1:0\"\n\
             seeds = [\"127.0.0.1:{}\"]\nexpect_nodes = 2\nreplication = 1\n\
             probe_period_ms = 200\nsuspicion_timeout_ms = 4000\nhedge_after_ms = 500\n\
             join_timeout_seconds = 10\nrereplicate_after_ms = 600000\n",
            i + 1,
            ports[i],
            ports[1 - i]
        );
        Server::start_with(&config, &["--model", model.to_str().unwrap()])
    };
    let nodes = [start(0), start(1)];
    for node in &nodes {
        node.wait_ready();
    }
    nodes
}

/// The worst of the nodes' `moe_node_layer_imbalance_recent` (each over its own devices,
/// counting the work other nodes sent them).
fn worst_recent_imbalance(nodes: &[Server]) -> f64 {
    nodes.iter().map(recent_imbalance).fold(0.0, f64::max)
}

#[test]
fn a_cluster_under_skewed_load_rebalances_live_through_its_placement_versions() {
    let model = skewed_model("1");
    let nodes = two_node_cluster(&model);
    let prompts = ["The quick brown fox", "Hello there", "MoE load balance"];
    let before: Vec<Vec<Value>> = nodes
        .iter()
        .map(|n| prompts.iter().map(|p| greedy(n, p)).collect())
        .collect();
    assert_eq!(before[0], before[1], "both nodes compute the same tokens");
    let start: Value = nodes[0].get("/admin/placement").json().unwrap();
    for node in &nodes {
        let placement: Value = node.get("/admin/placement").json().unwrap();
        assert_eq!(placement["version"], 1);
        assert_eq!(placement["layers"], start["layers"]);
    }

    let load = Load::start(&[&nodes[0].base, &nodes[1].base], 2);
    // A full window of skewed load under the layout the cluster started with.
    std::thread::sleep(Duration::from_secs(4));
    let imbalance_before = worst_recent_imbalance(&nodes);

    // node2 does not lead (node1 has the lowest id): it refuses and names the leader.
    let refused = nodes[1].post("/admin/rebalance", &json!({}));
    assert_eq!(refused.status(), 409);
    let text = refused.text().unwrap();
    assert!(
        text.contains("node1") && text.contains(&nodes[0].base[7..]),
        "{text}"
    );

    let report = nodes[0].post_ok("/admin/rebalance", &json!({}));
    // 0.25 MiB per version (placement.max_move_mib) is five of the demo's experts: the
    // rebalance goes through several versions, each copied, switched to and released on
    // both nodes while the clients keep asking.
    let versions = report["versions"].as_u64().unwrap();
    assert!(versions >= 2, "{report}");
    assert_eq!(report["version"], 1 + versions, "{report}");
    assert_eq!(report["nodes_profiled"], 2, "both nodes' windows: {report}");
    assert!(report["copies_loaded"].as_u64().unwrap() > 0, "{report}");
    assert!(
        report["imbalance_after"].as_f64().unwrap() < report["imbalance_before"].as_f64().unwrap(),
        "{report}"
    );
    // Both nodes serve the last version, with the same copies; experts moved from one
    // node to the other, not only copied into spare slots.
    let placements: Vec<Value> = nodes
        .iter()
        .map(|n| n.get("/admin/placement").json().unwrap())
        .collect();
    for p in &placements {
        assert_eq!(p["version"], report["version"]);
        assert_eq!(p["layers"], placements[0]["layers"]);
    }
    let on_nodes = |copies: &Value| -> Vec<String> {
        let mut nodes: Vec<String> = copies
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["node"].as_str().unwrap().to_string())
            .collect();
        nodes.sort();
        nodes.dedup();
        nodes
    };
    let mut across_nodes = 0;
    for (layer, was) in placements[0]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .zip(start["layers"].as_array().unwrap())
    {
        for (copies, was) in layer["experts"]
            .as_array()
            .unwrap()
            .iter()
            .zip(was["experts"].as_array().unwrap())
        {
            let list = copies.as_array().unwrap();
            let mut distinct = list.clone();
            distinct.sort_by_key(|c| c.to_string());
            distinct.dedup();
            assert_eq!(distinct.len(), list.len(), "one copy per device: {list:?}");
            if on_nodes(copies) != on_nodes(was) {
                across_nodes += 1;
            }
        }
    }
    assert!(across_nodes > 0, "no expert's copies changed node");
    // A full window under the new placement: the devices' measured load evens out.
    std::thread::sleep(Duration::from_secs(4));
    let imbalance_after = worst_recent_imbalance(&nodes);
    let served = load.finish();
    eprintln!(
        "cluster rebalance under load: {served} requests, worst recent imbalance \
         {imbalance_before:.3} -> {imbalance_after:.3}, {across_nodes} experts changed node; \
         report {report}"
    );
    assert!(
        imbalance_after < imbalance_before,
        "recent imbalance {imbalance_before:.3} before, {imbalance_after:.3} after: {report}"
    );
    // The figures runs measured, within bands (not exact: the windows hold whatever the
    // clients got through, 1016 to 2306 requests). Measured (2026-12-06, 2 shared cores):
    // worst recent imbalance 1.405-1.419 before; after, 1.087-1.257 in seven runs when a
    // rebalance only filled spare slots, 1.059-1.064 in two since it moves experts too (4
    // versions of at most 0.25 MiB, 16-17 copies loaded, 6-8 experts changed node); 1.008
    // predicted by the plan. The bands leave room for a loaded CI machine.
    assert_within(
        "worst recent imbalance before",
        imbalance_before,
        1.25..=1.60,
        &report,
    );
    assert_within(
        "worst recent imbalance after",
        imbalance_after,
        1.0..=1.35,
        &report,
    );
    let predicted = report["imbalance_after"].as_f64().unwrap();
    assert_within("predicted imbalance after", predicted, 1.0..=1.01, &report);
    // Copies compute exactly what the originals do, on either node.
    for (node, before) in nodes.iter().zip(&before) {
        let after: Vec<Value> = prompts.iter().map(|p| greedy(node, p)).collect();
        assert_eq!(&after, before);
    }
    assert_eq!(nodes[0].metric("moe_node_rebalances_total"), 1.0);
    // The next rebalance (the same workload) goes through the same versioning, where it
    // moves anything: the layers within 1% of the mean move nothing.
    let again = nodes[0].post_ok("/admin/rebalance", &json!({}));
    let last = report["version"].as_u64().unwrap() + again["versions"].as_u64().unwrap();
    assert_eq!(again["version"], last, "{again}");
    for node in &nodes {
        let placement: Value = node.get("/admin/placement").json().unwrap();
        assert_eq!(placement["version"], last);
    }
    eprintln!("second cluster rebalance: {again}");
}

/// The replication table docs/load-balance-and-plan.md quotes (from
/// `benches/results/rebalance.txt`): the profiles are seeded and the algorithms
/// deterministic, so each figure must come out as printed, to its three decimals.
#[test]
fn replication_on_64_devices_gives_the_figures_the_docs_quote() {
    // (skew, spare slots per device): mean imbalance over the 61 layers with no copies,
    // EPLB, moe-node, filling spare slots only, the live rebalance; copies it loads.
    let quoted = [
        (0.6, 1, [2.676, 1.001, 1.000, 1.041, 1.009], 5716),
        (0.8, 1, [4.640, 1.001, 1.000, 1.069, 1.009], 9193),
        (1.0, 1, [4.881, 1.001, 1.000, 1.096, 1.009], 10114),
        (1.0, 2, [4.881, 1.000, 1.000, 1.018, 1.009], 12153),
        (1.0, 0, [4.881, 3.942, 3.940, 4.881, 4.881], 0),
    ];
    let placement = replication::serving_placement();
    for (skew, spare, want, loaded) in quoted {
        let row = replication::row(&placement, skew, spare);
        let got = [
            row.none.mean(),
            row.eplb.mean(),
            row.ours.mean(),
            row.live.mean(),
            row.moved.mean(),
        ];
        eprintln!(
            "skew {skew} spare {spare}: {got:.4?}, worst live {:.4}",
            row.live.worst
        );
        let names = [
            "no copies",
            "EPLB",
            "moe-node",
            "fill spare only",
            "live rebalance",
        ];
        for (name, (got, want)) in names.iter().zip(got.iter().zip(want)) {
            // Printed to three decimals: within half of the last one.
            assert!(
                (got - want).abs() <= 0.0005 + 1e-12,
                "skew {skew}, {spare} spare: {name} {got:.4}, docs/load-balance-and-plan.md says {want}"
            );
        }
        assert_eq!(
            row.worse, 0,
            "skew {skew}, {spare} spare: moe-node above EPLB in {} layers",
            row.worse
        );
        assert_eq!(
            row.moved_copies, loaded,
            "skew {skew}, {spare} spare: copies loaded"
        );
        if spare > 0 {
            // Every layer within 2% of the balanced placement (it stops within 1% of the
            // mean).
            assert!(
                row.moved.worst <= 1.011,
                "worst layer {:.4}",
                row.moved.worst
            );
        }
        if (skew, spare) == (1.0, 1) {
            // "worst layer 1.18 at skew 1.0 with one slot"
            assert!(
                (row.live.worst - 1.18).abs() <= 0.005,
                "worst live layer {:.4}, docs/load-balance-and-plan.md says 1.18",
                row.live.worst
            );
        }
    }
}

/// A node whose experts are on (emulated) GPUs rebalances live too: its GPUs take the hot
/// experts' copies while serving (into spare slots' memory), the switch routes to them, and
/// greedy answers stay what they were.
#[test]
fn a_node_on_gpus_takes_hot_copies_while_serving_and_answers_alike() {
    if moe_node::compute::cuda::emulated_runtime(moe_node::compute::cuda::EmulatedGpus {
        count: 2,
        bytes: 4 << 30,
    })
    .is_err()
    {
        assert!(
            std::env::var_os("MOE_TEST_REQUIRE_GXX").is_none(),
            "MOE_TEST_REQUIRE_GXX is set, but GPUs could not be emulated"
        );
        eprintln!("SKIPPED: a live rebalance on GPUs needs g++ to emulate them");
        return;
    }
    let model = skewed_model("1");
    let server = Server::start_with(
        "[server]\nadmin_actions = true\n\
         [devices]\nbackend = \"cuda-emulated\"\nemulated_gpus = 2\n\
         [placement]\nredundant_slots_per_device = 16\nwindow_seconds = 30\n",
        &["--model", model.to_str().unwrap()],
    );
    server.wait_ready();
    let prompts = ["The quick brown fox", "Hello there", "MoE load balance"];
    let before: Vec<Value> = prompts.iter().map(|p| greedy(&server, p)).collect();
    let held = || -> f64 {
        let text = server.get("/metrics").text().unwrap();
        text.lines()
            .filter(|l| l.starts_with("moe_node_device_experts{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let held_before = held();
    let report = server.post_ok("/admin/rebalance", &json!({}));
    assert!(report["copies_loaded"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["version"], 2, "{report}");
    // The GPUs took the copies loaded and let go of the ones released.
    let held_after = held();
    let loaded = report["copies_loaded"].as_f64().unwrap();
    let released = report["copies_released"].as_f64().unwrap();
    assert_eq!(
        held_after,
        held_before + loaded - released,
        "the GPUs hold {held_after} experts after the rebalance, {held_before} before: {report}"
    );
    let after: Vec<Value> = prompts.iter().map(|p| greedy(&server, p)).collect();
    assert_eq!(before, after, "{report}");
}

/// A skewed profile of `model` (Zipf 1.0 by rank, ranks shuffled per layer): what an
/// operator saved with `moe-node profile`, without a fingerprint.
fn zipf_profile(model: &Path) -> Value {
    let config = moe_node::model::ModelConfig::load(model).unwrap();
    let experts = config.moe.num_experts;
    let by_rank = moe_node::placement::profile::zipf_probabilities(experts, config.moe.top_k, 1.0);
    let layers: serde_json::Map<String, Value> = (0..config.num_layers)
        .filter(|&l| config.moe_layers[l])
        .map(|layer| {
            let counts: Vec<u64> = (0..experts)
                .map(|e| (by_rank[(e * 7 + layer * 3) % experts] * 10_000.0) as u64)
                .collect();
            (layer.to_string(), json!(counts))
        })
        .collect();
    json!({"layers": layers, "window_seconds": 60.0})
}

/// The placement of `placement` (as `GET /admin/placement` answers) as `plan --json`
/// writes it: per layer, each expert's copies by global device index (nodes in name order,
/// `per_node` devices each), sorted.
fn as_plan_placement(placement: &Value, per_node: u64) -> Vec<Vec<Vec<u64>>> {
    let mut names: Vec<String> = placement["layers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l["experts"].as_array().unwrap())
        .flat_map(|copies| copies.as_array().unwrap())
        .map(|c| c["node"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names.dedup();
    placement["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| !l["experts"].as_array().unwrap().is_empty())
        .map(|l| {
            l["experts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|copies| {
                    let mut global: Vec<u64> = copies
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|c| {
                            let node = names
                                .iter()
                                .position(|n| n == c["node"].as_str().unwrap())
                                .unwrap() as u64;
                            node * per_node + c["device"].as_u64().unwrap()
                        })
                        .collect();
                    global.sort();
                    global
                })
                .collect()
        })
        .collect()
}

/// What `plan` says a rebalance for a profile reaches is what a live cluster rebalanced for
/// that profile serves: the same versions, the same copies loaded, the same placement, while
/// clients keep asking and get what they got before. A profile that does not fit the model,
/// or a request with a field it does not know, is refused with 400 and changes nothing.
#[test]
fn a_cluster_rebalanced_for_a_profile_serves_the_placement_plan_prints() {
    let model = skewed_model("1");
    let dir = tempfile::tempdir().unwrap();
    let profile = zipf_profile(&model);
    let profile_path = dir.path().join("profile.json");
    std::fs::write(&profile_path, profile.to_string()).unwrap();
    // The cluster's shape: 2 nodes of 2 CPU slots, replication 1, 24 spare slots, 0.25 MiB
    // per version (two_node_cluster).
    let out = Command::new(BIN)
        .args(["plan", "--model", model.to_str().unwrap()])
        .args([
            "--nodes",
            "2",
            "--devices-per-node",
            "2",
            "--replication",
            "1",
        ])
        .args(["--redundant-slots", "24", "--max-move-mib", "0.25"])
        .args(["--accept-unavailable-on-failure", "--json", "--profile"])
        .arg(&profile_path)
        .output()
        .unwrap();
    let plan: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let planned_versions = plan["rebalance"]["versions"].as_array().unwrap().len() as u64;
    assert!(planned_versions >= 2, "{}", plan["rebalance"]);

    let nodes = two_node_cluster(&model);
    let prompts = ["The quick brown fox", "Hello there"];
    let before: Vec<Value> = prompts.iter().map(|p| greedy(&nodes[0], p)).collect();
    // Bad requests first: each refused, the placement untouched.
    let mut short = profile.clone();
    short["layers"]["1"].as_array_mut().unwrap().pop();
    let mut foreign = profile.clone();
    foreign["fingerprint"] = json!("0x0000000000000001");
    for (bad, says) in [
        (json!({"profile": short}), "counts"),
        (json!({"profile": foreign}), "another model"),
        (json!({"profile": profile, "dry_run": true}), "dry_run"),
        (json!({"profile": {"layers": 3}}), "expected a map"),
    ] {
        let resp = nodes[0].post("/admin/rebalance", &bad);
        assert_eq!(resp.status(), 400);
        let text = resp.text().unwrap();
        assert!(text.contains(says), "{says}: {text}");
    }
    let placement: Value = nodes[0].get("/admin/placement").json().unwrap();
    assert_eq!(placement["version"], 1);

    let load = Load::start(&[&nodes[0].base, &nodes[1].base], 2);
    let report = nodes[0].post_ok("/admin/rebalance", &json!({"profile": profile}));
    let served = load.finish();
    eprintln!("rebalance for a profile under load: {served} requests; report {report}");
    assert_eq!(report["versions"], planned_versions, "{report}");
    assert_eq!(report["version"], 1 + planned_versions, "{report}");
    assert_eq!(report["copies_loaded"], plan["rebalance"]["copies_loaded"]);
    assert_eq!(report["nodes_profiled"], 0);
    let predicted = report["imbalance_after"].as_f64().unwrap();
    let planned_worst = plan["layers"]
        .as_object()
        .unwrap()
        .values()
        .map(|l| l["imbalance"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(
        (predicted - planned_worst).abs() < 1e-9,
        "{predicted} vs {planned_worst}"
    );
    let want: Vec<Vec<Vec<u64>>> = plan["placement"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(layer, experts)| (layer.parse::<usize>().unwrap(), experts))
        .collect::<std::collections::BTreeMap<_, _>>()
        .into_values()
        .map(|experts| {
            experts
                .as_array()
                .unwrap()
                .iter()
                .map(|copies| {
                    let mut c: Vec<u64> = copies
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|d| d.as_u64().unwrap())
                        .collect();
                    c.sort();
                    c
                })
                .collect()
        })
        .collect();
    for node in &nodes {
        let placement: Value = node.get("/admin/placement").json().unwrap();
        assert_eq!(placement["version"], report["version"]);
        assert!(
            as_plan_placement(&placement, 2) == want,
            "the cluster serves another placement than plan printed"
        );
    }
    for node in &nodes {
        let after: Vec<Value> = prompts.iter().map(|p| greedy(node, p)).collect();
        assert_eq!(after, before);
    }
}
