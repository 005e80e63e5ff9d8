//! `moe-node plan`, run as a user runs it: the real binary on a Kimi K3-shaped config.json
//! (896 experts, top-16, 61 layers; no weights needed).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use moe_node::placement::profile::zipf_probabilities;
use serde_json::{Value, json};

fn moe_node(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .args(args)
        .output()
        .unwrap()
}

/// A model directory holding only a Kimi K3-shaped config.json.
fn k3(dir: &Path) -> PathBuf {
    let model = dir.join("k3");
    std::fs::create_dir_all(&model).unwrap();
    let config = json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_routed_experts": 896, "n_shared_experts": 1,
        "num_experts_per_tok": 16, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
        "routed_scaling_factor": 2.827, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
        "rope_theta": 50000.0, "tie_word_embeddings": false, "eos_token_id": 163586,
        "torch_dtype": "bfloat16"
    });
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    model
}

/// The K3 shape stored as DeepSeek's FP8 checkpoints are: e4m3 weights, f32 scales per
/// 128 x 128 block.
fn k3_fp8(dir: &Path) -> PathBuf {
    let model = k3(dir);
    let path = model.join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["quantization_config"] = json!({
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]
    });
    std::fs::write(&path, config.to_string()).unwrap();
    model
}

/// A skewed profile for the K3 shape: Zipf-like counts, hot experts at shuffled ids.
fn skewed_profile(dir: &Path, skew: f64) -> PathBuf {
    let by_rank = zipf_probabilities(896, 16, skew);
    let layers: serde_json::Map<String, Value> = (1..61)
        .map(|layer: usize| {
            let counts: Vec<u64> = (0..896)
                .map(|e: usize| (by_rank[(e * 337 + layer * 101) % 896] * 10_000.0) as u64)
                .collect();
            (layer.to_string(), json!(counts))
        })
        .collect();
    let path = dir.join(format!("profile-{skew}.json"));
    let profile = json!({"layers": layers, "window_seconds": 60.0});
    std::fs::write(&path, profile.to_string()).unwrap();
    path
}

/// `plan` arguments for `model` over 8 nodes of 8 devices, `replication` copies of each
/// expert.
fn eight_nodes_of_eight<'a>(model: &'a str, replication: &'a str) -> Vec<&'a str> {
    vec![
        "--model",
        model,
        "--nodes",
        "8",
        "--devices-per-node",
        "8",
        "--replication",
        replication,
    ]
}

fn plan_json(args: &[&str]) -> (Value, Output) {
    let mut all = vec!["plan", "--json"];
    all.extend_from_slice(args);
    let out = moe_node(&all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr)));
    (report, out)
}

#[test]
fn k3_over_8_workers_and_64_cards_places_as_serve_would_and_counts_failures() {
    let dir = tempfile::tempdir().unwrap();
    let model = k3(dir.path());
    let model = model.to_str().unwrap();
    // 896 experts over 8 workers (one device each), replication 1: 112 each, and a worker
    // failing takes its 112 experts of every one of the 60 MoE layers with it.
    let (report, out) = plan_json(&[
        "--model",
        model,
        "--nodes",
        "8",
        "--devices-per-node",
        "1",
        "--replication",
        "1",
    ]);
    // Replication 1: any worker failing leaves experts without a copy, so the verdict is
    // "not ready" until the operator accepts that.
    assert_eq!(out.status.code(), Some(1), "{}", report["verdict"]);
    assert_eq!(report["verdict"]["ok"], false);
    let problems = report["verdict"]["problems"].as_array().unwrap();
    assert_eq!(problems.len(), 8, "one per worker: {problems:?}");
    let first = problems[0].as_str().unwrap();
    assert!(
        first.contains("node 0 failing leaves 6720 (layer, expert) pairs without a copy")
            && first.contains("layer 1 expert 0")
            && first.contains("requests needing them fail (503)"),
        "{first}"
    );
    let devices = report["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 8);
    for d in devices {
        let held = d["experts"].as_object().unwrap();
        assert_eq!(held.len(), 60, "every MoE layer, not the dense first one");
        assert!(held.values().all(|n| n == 112), "{held:?}");
        assert_eq!(d["expert_bytes"], 112 * 60 * 3 * 7168 * 2048 * 2u64);
    }
    let placement = report["placement"]["1"].as_array().unwrap();
    assert_eq!(placement.len(), 896);
    for f in report["failures"].as_array().unwrap() {
        assert_eq!(f["experts_losing_a_replica"], 112 * 60);
        assert_eq!(f["unavailable_experts"], 112 * 60);
        assert_eq!(f["unavailable"].as_array().unwrap().len(), 112 * 60);
        assert_eq!(f["token_share_affected"], Value::Null, "no profile given");
    }
    // Accepted: ready, the risk still said, in the JSON and the text.
    let accepting = [
        "--model",
        model,
        "--nodes",
        "8",
        "--devices-per-node",
        "1",
        "--replication",
        "1",
        "--accept-unavailable-on-failure",
    ];
    let (report, out) = plan_json(&accepting);
    assert!(out.status.success(), "{}", report["verdict"]);
    assert_eq!(report["verdict"]["ok"], true);
    assert_eq!(report["verdict"]["accepted"].as_array().unwrap().len(), 8);
    let mut text_args = vec!["plan"];
    text_args.extend_from_slice(&accepting);
    let out = moe_node(&text_args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("accepted risks"), "{text}");
    assert!(text.contains("node 7 failing leaves 6720"), "{text}");

    // Over 64 cards (8 nodes of 8), replication 2: 28 copies per card per layer, the two
    // copies of an expert on distinct nodes, so no node failure leaves an expert without
    // one.
    let (report, out) = plan_json(&eight_nodes_of_eight(model, "2"));
    assert!(out.status.success());
    for d in report["devices"].as_array().unwrap() {
        assert!(d["experts"].as_object().unwrap().values().all(|n| n == 28));
    }
    for copies in report["placement"]["7"].as_array().unwrap() {
        let copies: Vec<u64> = copies
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap())
            .collect();
        assert_eq!(copies.len(), 2);
        assert_ne!(
            copies[0] / 8,
            copies[1] / 8,
            "copies on one node: {copies:?}"
        );
    }
    for f in report["failures"].as_array().unwrap() {
        assert_eq!(f["unavailable_experts"], 0);
        // A node holds a quarter of all copies: 896 × 2 × 60 / 8.
        assert_eq!(f["experts_losing_a_replica"], 896 * 2 * 60 / 8);
    }
    assert_eq!(report["verdict"]["ok"], true);
}

#[test]
fn a_skewed_profile_shows_hot_experts_and_spare_slots_cut_the_imbalance() {
    let dir = tempfile::tempdir().unwrap();
    let model = k3(dir.path());
    let profile = skewed_profile(dir.path(), 1.0);
    let args = |slots: &'static str| {
        vec![
            "--model".to_string(),
            model.display().to_string(),
            "--nodes".into(),
            "8".into(),
            "--devices-per-node".into(),
            "8".into(),
            "--replication".into(),
            "1".into(),
            "--profile".into(),
            profile.display().to_string(),
            "--redundant-slots".into(),
            slots.into(),
            "--accept-unavailable-on-failure".into(),
        ]
    };
    let run = |slots| {
        let owned = args(slots);
        let refs: Vec<&str> = owned.iter().map(String::as_str).collect();
        plan_json(&refs)
    };
    let (without, out) = run("0");
    // Hot experts overload their devices: the verdict fails, naming the layers.
    assert_eq!(out.status.code(), Some(1));
    let problems = without["verdict"]["problems"].as_array().unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p.as_str().unwrap().contains("imbalance")),
        "{problems:?}"
    );
    let layer = &without["layers"]["5"];
    assert!(layer["hot_experts"].as_array().unwrap().len() > 10);
    assert_eq!(layer["imbalance"], layer["imbalance_unreplicated"]);
    assert!(layer["imbalance"].as_f64().unwrap() > 2.0, "{layer}");

    let (with, out) = run("1");
    assert!(out.status.success(), "{}", with["verdict"]);
    for (name, layer) in with["layers"].as_object().unwrap() {
        let after = layer["imbalance"].as_f64().unwrap();
        let before = layer["imbalance_unreplicated"].as_f64().unwrap();
        assert!(after < before, "layer {name}: {after} vs {before}");
        // A live rebalance moves experts as well as filling spare slots: it reaches the
        // balanced placement, within 2% (it stops within 1% of the mean).
        let balanced = layer["imbalance_balanced"].as_f64().unwrap();
        assert!(
            after <= 1.02 * balanced,
            "layer {name}: {after} vs {balanced}"
        );
        assert!(after <= 1.011, "layer {name}: {after}");
        assert!(layer["copies_added"].as_u64().unwrap() > 0);
        assert!(
            layer["copies_loaded"].as_u64().unwrap() >= layer["copies_added"].as_u64().unwrap()
        );
    }
    // It goes there in versions of at most placement.max_move_mib (4096 MiB by default)
    // each; the copies they load add up to the layers'.
    let rebalance = &with["rebalance"];
    let expert_bytes = with["model"]["sizes"]["expert_bytes"].as_u64().unwrap();
    assert_eq!(rebalance["max_move_bytes"], 4096u64 << 20);
    let versions = rebalance["versions"].as_array().unwrap();
    assert!(versions.len() > 1, "{rebalance}");
    let per_version = (4096u64 << 20) / expert_bytes;
    let mut loaded = 0;
    for (i, v) in versions.iter().enumerate() {
        assert_eq!(v["version"], i as u64 + 2);
        let n = v["copies_loaded"].as_u64().unwrap();
        assert!(n <= per_version.max(2), "{v}");
        loaded += n;
    }
    let layers_loaded: u64 = with["layers"]
        .as_object()
        .unwrap()
        .values()
        .map(|l| l["copies_loaded"].as_u64().unwrap())
        .sum();
    assert_eq!(rebalance["copies_loaded"], loaded);
    assert!(loaded >= layers_loaded, "{loaded} vs {layers_loaded}");
    assert_eq!(rebalance["bytes_loaded"], loaded * expert_bytes);
    eprintln!(
        "rebalance: {} versions, {} copies loaded, {} released, {} bytes",
        versions.len(),
        loaded,
        rebalance["copies_released"],
        rebalance["bytes_loaded"]
    );
    // The copies are in the placement: some expert has more than one.
    let placement = with["placement"]["5"].as_array().unwrap();
    assert!(placement.iter().any(|c| c.as_array().unwrap().len() > 1));
    for f in with["failures"].as_array().unwrap() {
        let share = f["token_share_affected"].as_f64().unwrap();
        assert!((0.0..1.0).contains(&share), "{f}");
    }
}

#[test]
fn the_readable_report_answers_the_deployment_questions() {
    let dir = tempfile::tempdir().unwrap();
    let model = k3(dir.path());
    let profile = skewed_profile(dir.path(), 0.8);
    let out = moe_node(&[
        "plan",
        "--model",
        model.to_str().unwrap(),
        "--nodes",
        "4",
        "--devices-per-node",
        "2",
        "--replication",
        "2",
        "--profile",
        profile.to_str().unwrap(),
        "--redundant-slots",
        "2",
        "--device-memory-gib",
        "141",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "896 experts per layer",
        "Devices",
        "Node failures",
        "Layers",
        "EPLB",
        "verdict:",
    ] {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }
    // 896 × 2 copies × 60 layers over 8 devices of 141 GiB: 1.1 TiB each does not fit.
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("of work area do not fit in 126.9 GiB (90% of 141.0 GiB"),
        "{text}"
    );
}

/// A device's fit counts what `serve`'s start-up check counts: the experts' stored bytes, the
/// work area beside them (for FP8 experts, the bf16 copies a step widens them into) and
/// `devices.gpu_memory_fraction` of the memory given.
#[test]
fn a_device_fits_only_with_room_for_its_work_area_within_the_usable_share() {
    let dir = tempfile::tempdir().unwrap();
    let model = k3_fp8(dir.path());
    let model = model.to_str().unwrap();
    let host_dense = dir.path().join("node.toml");
    std::fs::write(&host_dense, "[devices]\ndense_on_gpu = false\n").unwrap();
    let device = |memory_gib: f64| {
        let memory = format!("--device-memory-gib={memory_gib}");
        let mut args = eight_nodes_of_eight(model, "1");
        args.extend([memory.as_str(), "--config", host_dense.to_str().unwrap()]);
        let (report, _) = plan_json(&args);
        // Device 1 of node 0: experts only (the dense part is on the host).
        let d = report["devices"][1].clone();
        assert_eq!(
            (d["node"].as_u64(), d["device"].as_u64()),
            (Some(0), Some(1))
        );
        d
    };
    let roomy = device(1000.0);
    // 14 FP8 experts (1 byte a weight, f32 block scales) per layer, 60 layers.
    let expert = 3 * 7168 * 2048 + 4 * 3 * 16 * 56u64;
    assert_eq!(roomy["expert_bytes"], 14 * 60 * expert);
    let (weights, work) = (
        roomy["expert_bytes"].as_f64().unwrap(),
        roomy["work_bytes"].as_f64().unwrap(),
    );
    // At least 12 experts widened to bf16 at a time (1 GiB of them), plus the rows.
    assert!(work >= 12.0 * 2.0 * (3 * 7168 * 2048) as f64, "{work}");
    assert_eq!(roomy["fits"], true);
    let gib = (1u64 << 30) as f64;
    let tight = device((weights + work / 2.0) / 0.9 / gib);
    assert_eq!(
        tight["fits"], false,
        "weights fit, the work area does not: {tight}"
    );
    let enough = device((weights + work) / 0.9 / gib + 0.01);
    assert_eq!(enough["fits"], true, "{enough}");
    let whole = device((weights + work) / gib + 0.01);
    assert_eq!(
        whole["fits"], false,
        "only 90% of the memory is usable: {whole}"
    );
}

#[test]
fn bad_input_exits_78_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let model = k3(dir.path());
    let model = model.to_str().unwrap();
    let wrong = dir.path().join("wrong.json");
    std::fs::write(&wrong, r#"{"layers": {"0": [1, 2], "3": [5]}}"#).unwrap();
    let garbage = dir.path().join("garbage.json");
    std::fs::write(&garbage, "not a profile").unwrap();
    let missing = dir.path().join("nowhere");
    for (args, expected) in [
        (
            vec!["--profile", wrong.to_str().unwrap()],
            "layer 0 is a dense layer",
        ),
        (
            vec!["--profile", wrong.to_str().unwrap()],
            "layer 3 has 1 counts, the model has 896 experts",
        ),
        (
            vec!["--profile", garbage.to_str().unwrap()],
            "is not a profile",
        ),
        (vec!["--nodes", "0"], "at least 1"),
        (vec!["--replication", "3"], "replication 3"),
        (vec!["--device-memory-gib=-1"], "--device-memory-gib"),
        (vec!["--max-imbalance", "0.5"], "--max-imbalance"),
    ] {
        let mut all = vec!["plan", "--model", model];
        all.extend(args.iter().copied());
        let out = moe_node(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let out = moe_node(&["plan", "--model", missing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));
}

/// The device that holds the dense part holds the KV caches too: what `batching.kv_cache_mib`
/// sets (counted in the fit), or, as `serve` sizes it at start-up, 90% of what the weights
/// and work area leave (the GPU's pool of cache blocks); in whole blocks of 16 positions of
/// 70,272 bytes (K3's MLA cache in bf16: 61 layers × (512 latent + 64 rotary) × 2 bytes). Here with the dense part on
/// device 0 alone (`--dense-replicas 1`); the next test has a replica on every device.
#[test]
fn the_kv_cache_holds_what_the_dense_device_leaves_or_what_the_config_sets() {
    let dir = tempfile::tempdir().unwrap();
    let model = k3_fp8(dir.path());
    let shape = |memory_gib: &str, config: Option<&Path>| {
        let memory = format!("--device-memory-gib={memory_gib}");
        let mut args = eight_nodes_of_eight(model.to_str().unwrap(), "1");
        // Replication 1 is this test's shape: the risk is accepted, the KV cache checked.
        args.extend([
            "--redundant-slots",
            "0",
            &memory,
            "--accept-unavailable-on-failure",
            "--dense-replicas",
            "1",
        ]);
        if let Some(config) = config {
            args.extend(["--config", config.to_str().unwrap()]);
        }
        plan_json(&args).0
    };
    let position = 61 * (512 + 64) * 4u64;
    // On the GPU the cache is bf16.
    let block = 16 * position / 2;
    let report = shape("141", None);
    assert_eq!(report["model"]["sizes"]["kv_bytes_per_position"], position);
    assert_eq!(
        report["model"]["sizes"]["gpu_kv_bytes_per_position"],
        position / 2
    );
    let dense = &report["devices"][0];
    let experts_only = &report["devices"][1];
    assert_eq!(experts_only["kv_cache_bytes"], Value::Null);
    let held = ["expert_bytes", "dense_bytes", "work_bytes"]
        .iter()
        .map(|k| dense[k].as_u64().unwrap())
        .sum::<u64>();
    let kv = ((141u64 << 30) - held) / 10 * 9;
    assert_eq!(dense["kv_cache_bytes"], kv, "{dense}");
    assert_eq!(dense["kv_positions"], kv / block * 16);
    assert!(kv / block * 16 > 100_000, "{dense}");
    assert_eq!(report["verdict"]["ok"], true, "{}", report["verdict"]);

    // 512 MiB set in the config: 477 blocks, fewer positions than one 8192-token prompt.
    let config = dir.path().join("node.toml");
    std::fs::write(&config, "[batching]\nkv_cache_mib = 512\n").unwrap();
    let report = shape("141", Some(&config));
    let dense = &report["devices"][0];
    assert_eq!(dense["kv_cache_bytes"], 1u64 << 29);
    assert_eq!(dense["kv_positions"], 477 * 16);
    let problems = report["verdict"]["problems"].to_string();
    assert!(
        problems.contains(
            "holds 7632 positions, fewer than one prompt of batching.max_prompt_tokens (8192)"
        ),
        "{problems}"
    );
    // The budget set is counted in the device's fit. Where the dense device would be short
    // of it with its share of experts, it holds fewer and the other devices the rest.
    let gib = (1u64 << 30) as f64;
    let experts = |d: &Value| d["experts"]["1"].as_u64().unwrap();
    let tight = format!("{}", (held as f64 + 0.25 * gib) / 0.9 / gib);
    let report = shape(&tight, Some(&config));
    let (dense, other) = (&report["devices"][0], &report["devices"][1]);
    assert_eq!(dense["fits"], true, "{dense}");
    assert!(experts(dense) < experts(other), "{dense} {other}");
    // Without room for it even with no experts, it does not fit (every device is short:
    // each holds as many experts past its room as the others).
    let bare = ["dense_bytes", "work_bytes"]
        .iter()
        .map(|k| dense[k].as_u64().unwrap())
        .sum::<u64>();
    let tight = format!("{}", (bare as f64 + 0.25 * gib) / 0.9 / gib);
    let report = shape(&tight, Some(&config));
    let (dense, other) = (&report["devices"][0], &report["devices"][1]);
    assert!(experts(dense) < experts(other), "{dense} {other}");
    assert_eq!(dense["fits"], false);
    let problems = report["verdict"]["problems"].to_string();
    assert!(
        problems.contains("0.5 GiB of KV cache (batching.kv_cache_mib) do not fit"),
        "{problems}"
    );
}

/// The plan of Kimi K2 (FP8) on `nodes` nodes of 8 x 141 GiB with two copies of every
/// expert and `--dense-replicas replicas`.
fn kimi_k2_on_h200s(nodes: &str, replicas: &str) -> (Value, Output) {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/configs/kimi_k2");
    plan_json(&[
        "--model",
        model,
        "--nodes",
        nodes,
        "--devices-per-node",
        "8",
        "--replication",
        "2",
        "--device-memory-gib",
        "141",
        "--dense-replicas",
        replicas,
    ])
}

/// Kimi K2 (FP8, 61 layers, 384 experts) on 3 nodes of 8 x 141 GiB with two copies of every
/// expert: with a dense replica on every GPU (the default, `devices.dense_replicas = 0`) every
/// GPU holds the dense part and a KV cache of more than 100k positions, and the plan is
/// ready. With the dense part on GPU 0 alone, GPUs 1-7 hold no KV cache at all.
#[test]
fn kimi_k2_on_three_nodes_runs_attention_on_every_gpu_with_room_for_long_contexts() {
    let shape = |replicas: &str| kimi_k2_on_h200s("3", replicas).0;
    let every = shape("0");
    assert_eq!(every["verdict"]["ok"], true, "{}", every["verdict"]);
    let devices = every["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 24);
    for d in devices {
        assert!(d["dense_bytes"].as_u64().unwrap() > 20 << 30, "{d}");
        let positions = d["kv_positions"].as_u64().unwrap();
        assert!(positions >= 100_000, "{d}");
        assert_eq!(d["fits"], true, "{d}");
    }
    let first = shape("1");
    let devices = first["devices"].as_array().unwrap();
    let with_kv = devices
        .iter()
        .filter(|d| d["kv_positions"].is_u64())
        .count();
    assert_eq!(with_kv, 3, "one KV cache per node: {first}");
}

/// Kimi K2 on 2 nodes of 8 x 141 GiB with two copies of every expert and the dense part on
/// GPU 0 of each node (`--dense-replicas 1`): an even share of experts (48 a layer) would
/// leave GPU 0 a KV cache of 16 positions. GPU 0 takes fewer experts instead, the others
/// the rest, and every dense GPU keeps room for a long context: the plan is ready.
#[test]
fn kimi_k2_on_two_nodes_gives_the_gpu_carrying_the_dense_part_fewer_experts() {
    let (report, output) = kimi_k2_on_h200s("2", "1");
    assert_eq!(output.status.code(), Some(0), "{}", report["verdict"]);
    let devices = report["devices"].as_array().unwrap();
    let experts = |d: &Value| d["experts"]["1"].as_u64().unwrap();
    let mut copies = 0;
    for d in devices {
        assert_eq!(d["fits"], true, "{d}");
        copies += experts(d);
        if d["device"] == 0 {
            assert!(d["kv_positions"].as_u64().unwrap() >= 100_000, "{d}");
            assert!(experts(d) < 48, "{d}");
        } else {
            assert!(experts(d) > 48, "{d}");
            assert!(d["kv_positions"].is_null(), "{d}");
        }
    }
    assert_eq!(copies, 2 * 384);
}
