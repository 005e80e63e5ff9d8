//! The engine against Hugging Face transformers, on every backend this machine has: each
//! fixture under tests/fixtures/ was made by make_fixtures.py, which recorded transformers'
//! greedy continuation and the logits after the last prompt token (computed in f32 from the
//! saved weights). The CPU backend is held to transformers; the GPU backend (experts in
//! bf16 on GPU 0, where CUDA is usable) to the CPU backend.

use std::path::{Path, PathBuf};

use moe_node::compute::cuda;
use moe_node::engine::{Engine, GenerateRequest, Generation, SamplingParams, generate};

/// Largest absolute logit difference accepted on the CPU. Both sides compute in f32 from the
/// same weights; only summation order differs (absorbed MLA, blocked GEMM). Measured: at most
/// 1e-5 on logits of magnitude ~5.
const LOGIT_TOLERANCE: f32 = 1e-4;

/// Largest absolute logit difference accepted between the GPU backend and the CPU backend.
/// The GPU holds experts in bf16 and rounds their inputs, gate|up outputs and activations to
/// bf16 (accumulating in f32). The same rounding emulated on the CPU moved these fixtures'
/// logits (magnitude ~6) by at most 0.039 and changed no greedy token.
const BF16_LOGIT_TOLERANCE: f32 = 0.1;

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

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        // NaN sticks: f32::max would drop it.
        .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m })
}

fn run(engine: &Engine, reference: &Reference) -> Generation {
    generate(
        engine,
        &GenerateRequest {
            prompt: reference.prompt_ids.clone(),
            max_tokens: reference.token_ids.len(),
            sampling: SamplingParams::default(),
            stop_at_eos: false,
        },
    )
    .unwrap()
}

fn check(name: &str) {
    let dir = fixture(name);
    let reference: Reference =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let engine = Engine::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let generation = run(&engine, &reference);
    let max_diff = max_difference(&generation.last_logits, &reference.last_logits);
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

    // The GPU backend, where this machine has one; `tests/gpu/run.sh` runs this file there.
    match cuda::runtime(None) {
        Err(e) if std::env::var_os("MOE_TEST_REQUIRE_GPU").is_some() => {
            panic!("MOE_TEST_REQUIRE_GPU is set: {e}")
        }
        Err(e) => eprintln!("{name}: GPU backend not checked: {e}"),
        Ok(_) => {
            let gpu_engine = cuda::load::engine_on_gpu(&dir, 0, None, None)
                .unwrap_or_else(|e| panic!("{name} on GPU 0: {e}"));
            let on_gpu = run(&gpu_engine, &reference);
            let gpu_diff = max_difference(&on_gpu.last_logits, &generation.last_logits);
            eprintln!("{name}: GPU max logit difference from the CPU {gpu_diff:e}");
            assert!(
                gpu_diff <= BF16_LOGIT_TOLERANCE,
                "{name}: GPU logits differ from the CPU's by up to {gpu_diff}"
            );
            assert_eq!(
                on_gpu.token_ids, generation.token_ids,
                "{name}: GPU greedy tokens differ from the CPU's (logit diff {gpu_diff})"
            );
        }
    }
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
