//! Activation profiles from a real server: the skewed demo model (`demo-model --skew`)
//! routes tokens to a few hot experts, the node exports what it measured
//! (`/admin/experts?format=profile`, `moe-node profile`), and `moe-node plan` reads it.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

mod serve;
use serve::{BIN, Server};

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
    let prompts = [
        "The quick brown fox",
        "Hello there",
        "MoE load balance",
        "1 2 3 4 5",
    ];
    let before: Vec<Value> = prompts.iter().map(|p| greedy(&server, p)).collect();

    // Clients keep the node busy from here to the end; every request must succeed.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let base = server.base.clone();
    let clients: Vec<_> = (0..3)
        .map(|c| {
            let stop = stop.clone();
            let base = base.clone();
            std::thread::spawn(move || {
                let client = reqwest::blocking::Client::new();
                let (mut ok, mut failed) = (0, Vec::new());
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let resp = client
                        .post(format!("{base}/v1/completions"))
                        .json(&json!({"prompt": format!("client {c} says {ok}"),
                                      "max_tokens": 8, "ignore_eos": true}))
                        .send();
                    match resp {
                        Ok(r) if r.status().is_success() => ok += 1,
                        Ok(r) => {
                            failed.push(format!("{}: {}", r.status(), r.text().unwrap_or_default()))
                        }
                        Err(e) => failed.push(e.to_string()),
                    }
                }
                (ok, failed)
            })
        })
        .collect();

    // A full window of skewed load under the layout the node started with.
    std::thread::sleep(std::time::Duration::from_secs(4));
    let imbalance_before = recent_imbalance(&server);
    let report = server.post_ok("/admin/rebalance", &json!({}));
    assert!(report["copies_loaded"].as_u64().unwrap() > 0, "{report}");
    assert!(report["bytes_loaded"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["version"], 2);
    let predicted = report["imbalance_after"].as_f64().unwrap();
    assert!(
        predicted < report["imbalance_before"].as_f64().unwrap(),
        "{report}"
    );
    // A full window under the new placement: the devices' measured load evens out.
    std::thread::sleep(std::time::Duration::from_secs(4));
    let imbalance_after = recent_imbalance(&server);

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut served = 0;
    for client in clients {
        let (ok, failed) = client.join().unwrap();
        assert!(failed.is_empty(), "requests failed: {failed:?}");
        served += ok;
    }
    assert!(served > 10, "only {served} requests ran under load");
    eprintln!(
        "rebalance under load: {served} requests, recent imbalance {imbalance_before:.3} -> \
         {imbalance_after:.3}; report {report}"
    );
    assert!(
        imbalance_after < imbalance_before,
        "recent imbalance {imbalance_before:.3} before, {imbalance_after:.3} after: {report}"
    );
    // Copies compute exactly what the originals do.
    let after: Vec<Value> = prompts.iter().map(|p| greedy(&server, p)).collect();
    assert_eq!(before, after);
    assert_eq!(server.metric("moe_node_rebalances_total"), 1.0);
    let placement: Value = server.get("/admin/placement").json().unwrap();
    assert_eq!(placement["version"], 2);
    // A second rebalance on the same workload loads little or nothing new.
    let again = server.post_ok("/admin/rebalance", &json!({}));
    assert_eq!(again["version"], 3);
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
