//! `--load-format dummy`: a model known only by its config.json, served and run with random
//! weights, as a user measuring a published shape without its weights runs it.

mod serve;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};
use serve::Server;

fn moe_node(args: &[&str]) -> Output {
    Command::new(serve::BIN)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("the binary runs")
}

/// A directory holding only the config.json of fixture `name`.
fn config_only(dir: &Path, name: &str) -> PathBuf {
    let model = dir.join(name);
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
            .join("config.json"),
        model.join("config.json"),
    )
    .unwrap();
    model
}

fn generate(model: &Path, extra: &[&str]) -> Output {
    generate_tokens(model, 6, extra)
}

/// `moe-node generate --json` of `max_tokens` after the prompt 3,17,42,7.
fn generate_tokens(model: &Path, max_tokens: usize, extra: &[&str]) -> Output {
    let max_tokens = max_tokens.to_string();
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        "3,17,42,7",
        "--max-tokens",
        &max_tokens,
        "--json",
    ];
    args.extend_from_slice(extra);
    moe_node(&args)
}

#[test]
fn dummy_weights_need_only_the_config_and_give_the_same_tokens_every_run() {
    let dir = tempfile::tempdir().unwrap();
    // Kimi K2's layout (MLA, sigmoid routing with a correction bias, a shared expert),
    // Qwen3-MoE's (GQA with q/k norms, softmax routing, a dense layer among MoE ones) and
    // GLM-4.5's (GQA with partial rotary and q/k norms, Kimi's gate).
    for name in ["kimi_k2", "qwen3_moe", "glm4_moe"] {
        let model = config_only(dir.path(), name);
        let without = generate(&model, &[]);
        assert!(!without.status.success(), "{name}: no weights, no model");
        assert!(
            String::from_utf8_lossy(&without.stderr).contains("no weights"),
            "{name}: {}",
            String::from_utf8_lossy(&without.stderr)
        );

        let runs: Vec<Value> = (0..2)
            .map(|_| {
                let out = generate(&model, &["--load-format", "dummy", "--num-layers", "2"]);
                assert!(
                    out.status.success(),
                    "{name}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                serde_json::from_slice(&out.stdout).unwrap()
            })
            .collect();
        assert_eq!(runs[0], runs[1], "{name}: the same weights every run");
        let ids = runs[0]["token_ids"].as_array().unwrap();
        assert_eq!(ids.len(), 6, "{name}");
        let logits: Vec<f64> = runs[0]["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let mean = logits.iter().sum::<f64>() / logits.len() as f64;
        let spread = logits.iter().map(|l| (l - mean).abs()).fold(0.0, f64::max);
        assert!(
            logits.iter().all(|l| l.is_finite()) && spread > 0.1,
            "{name}: finite, distinct logits (spread {spread})"
        );

        // All layers give other logits than the first two.
        let all: Value =
            serde_json::from_slice(&generate(&model, &["--load-format", "dummy"]).stdout).unwrap();
        assert_ne!(all["last_logits"], runs[0]["last_logits"], "{name}");
    }
}

#[test]
fn layer_counts_outside_the_model_and_dummy_without_a_model_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = config_only(dir.path(), "kimi_k2");
    for layers in ["0", "4"] {
        let out = generate(&model, &["--load-format", "dummy", "--num-layers", layers]);
        assert_eq!(out.status.code(), Some(78), "--num-layers {layers}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("--num-layers {layers}: the model has 3 layers")),
            "{err}"
        );
    }
    let out = moe_node(&["serve", "--listen", "127.0.0.1:0", "--load-format", "dummy"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("dummy needs model.path"), "{err}");
    let out = generate(&model, &["--load-format", "random"]);
    assert_eq!(out.status.code(), Some(2), "clap refuses an unknown format");
}

#[test]
fn a_node_serves_a_dummy_model_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let model = config_only(dir.path(), "kimi_k2");
    let server = Server::start_with(
        "",
        &[
            "--model",
            model.to_str().unwrap(),
            "--load-format",
            "dummy",
            "--num-layers",
            "2",
        ],
    );
    server.wait_ready();
    assert!(server.log_contains("the weights are random"));
    let reply = server.post_ok(
        "/v1/completions",
        &json!({"prompt": [3, 17, 42, 7], "max_tokens": 5, "temperature": 0,
                "ignore_eos": true, "return_token_ids": true}),
    );
    assert_eq!(reply["usage"]["completion_tokens"], 5, "{reply}");
    assert_eq!(reply["usage"]["prompt_tokens"], 4, "{reply}");
    // The node and `generate` load the same weights: the same greedy tokens.
    let alone: Value = serde_json::from_slice(
        &generate_tokens(&model, 5, &["--load-format", "dummy", "--num-layers", "2"]).stdout,
    )
    .unwrap();
    assert_eq!(
        reply["choices"][0]["token_ids"], alone["token_ids"],
        "{reply}"
    );
}
