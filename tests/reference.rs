//! The engine against Hugging Face transformers: each fixture under tests/fixtures/ was made
//! by make_fixtures.py, which recorded transformers' greedy continuation and the logits after
//! the last prompt token (computed in f32 from the saved weights).

use std::path::{Path, PathBuf};

use moe_node::engine::{Engine, GenerateRequest, SamplingParams, generate};

/// Largest absolute logit difference accepted. Both sides compute in f32 from the same
/// weights; only summation order differs (absorbed MLA, blocked GEMM). Measured: at most
/// 1e-5 on logits of magnitude ~5.
const LOGIT_TOLERANCE: f32 = 1e-4;

#[derive(serde::Deserialize)]
struct Reference {
    prompt_ids: Vec<u32>,
    token_ids: Vec<u32>,
    last_logits: Vec<f32>,
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn check(name: &str) {
    let dir = fixture(name);
    let reference: Reference =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let engine = Engine::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let generation = generate(
        &engine,
        &GenerateRequest {
            prompt: reference.prompt_ids.clone(),
            max_tokens: reference.token_ids.len(),
            sampling: SamplingParams::default(),
            stop_at_eos: false,
        },
    )
    .unwrap();
    let max_diff = generation
        .last_logits
        .iter()
        .zip(&reference.last_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("{name}: max logit difference from transformers {max_diff:e}");
    assert_eq!(generation.last_logits.len(), reference.last_logits.len());
    assert!(
        max_diff <= LOGIT_TOLERANCE,
        "{name}: logits differ from transformers by up to {max_diff}"
    );
    assert_eq!(
        generation.token_ids, reference.token_ids,
        "{name}: greedy tokens differ from transformers (logit diff {max_diff})"
    );
}

#[test]
fn qwen3_moe_matches_transformers() {
    check("qwen3_moe");
}

#[test]
fn qwen3_moe_bf16_matches_transformers() {
    check("qwen3_moe_bf16");
}

#[test]
fn mixtral_matches_transformers() {
    check("mixtral");
}

#[test]
fn deepseek_v3_matches_transformers() {
    check("deepseek_v3");
}

#[test]
fn kimi_k2_matches_transformers() {
    check("kimi_k2");
}

#[test]
fn mixtral_sliding_window_matches_transformers() {
    check("mixtral_sliding");
}
