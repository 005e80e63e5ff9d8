//! Decode step time of the engine alone (no actors, no HTTP) on the demo model at batch 1, 8
//! and 32: with every expert, and with the routed experts replaced by a no-op, which leaves
//! the part of a step that does not depend on which experts the tokens pick (embeddings,
//! attention over each sequence's cache, norms, gates, shared expert, lm head); and with
//! the experts on CPU device actors reached through the dispatcher, as `moe-node serve`
//! runs them (what the node adds to a step before the router and HTTP). The load
//! benchmark's concurrency ratio can be no better than what this shows.
//!
//! With `MOE_STEP_PREFILL` (prompt lengths, e.g. `64,512`) it also times the prefill of one
//! sequence of each length in one step, full and without experts, and prints what a sequence
//! keeps whatever its length (a hybrid model's recurrent states) beside its bytes per position.
//!
//! `cargo bench --bench engine_step`; `MOE_STEP_ITERS` (default 200), `MOE_STEP_BATCHES`
//! (default 1,8,32), `MOE_STEP_MODEL` (a model directory to time instead of the demo model,
//! e.g. one of a published shape with random weights: `benches/random_qwen3_moe.py`,
//! `benches/random_qwen3_5_moe.py`), `MOE_STEP_PREFILL` (default none),
//! `MOE_STEP_PREFILL_ITERS` (default 5), `MOE_STEP_GPU` (a GPU's ordinal: the whole model on
//! that GPU, experts and dense part, as `generate --backend cuda` runs it, and the no-experts
//! engine's dense part there too; the dispatched column is then not timed; `emulated` runs
//! it on one GPU emulated on the CPU, which checks the path and times nothing of a GPU).

mod common;

use std::sync::Arc;

use std::time::Instant;

use moe_node::compute::cuda::{self, EmulatedGpus, GpuInfo};
use moe_node::engine::gpu::engine_on_gpu;
use moe_node::engine::{Engine, KvCache, SequenceStep};
use moe_node::experts::{ExpertError, ExpertExecutor};
use moe_node::model::{Checkpoint, DenseWeights, ModelConfig, ModelSource};
use moe_node::moe::DispatchPlan;

/// Routed experts that cost nothing: every expert output is zero.
struct NoExperts(usize);

impl ExpertExecutor for NoExperts {
    fn run(&self, _: usize, plan: &DispatchPlan, _: &[f32]) -> Result<Vec<f32>, ExpertError> {
        Ok(vec![0.0; plan.len() * self.0])
    }
}

/// Median milliseconds of a decode step for `batch` sequences with 16-token prompts.
fn step_ms(engine: &Engine, batch: usize, iters: usize) -> f64 {
    common::median(&mut common::decode_steps_ms(engine, batch, iters))
}

/// Median milliseconds of a prefill of `tokens` prompt tokens for one sequence, in one step.
fn prefill_ms(engine: &Engine, tokens: usize, iters: usize) -> f64 {
    let top = common::token_range(engine);
    let prompt: Vec<u32> = (0..tokens).map(|i| ((i * 7919) % top + 1) as u32).collect();
    let mut times: Vec<f64> = (0..iters)
        .map(|_| {
            let mut cache = engine.new_cache();
            let mut step = [SequenceStep::new(&mut cache, &prompt)];
            let started = Instant::now();
            engine.forward(&mut step).expect("prefill");
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    common::median(&mut times)
}

/// Prefill tokens/s, full and without experts, for each length in `MOE_STEP_PREFILL`.
fn prefill(full: &Engine, dense_only: &Engine) {
    let Ok(lengths) = std::env::var("MOE_STEP_PREFILL") else {
        return;
    };
    let iters: usize = std::env::var("MOE_STEP_PREFILL_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let config = full.config();
    println!(
        "per sequence: {} bytes of state whatever its length, {} bytes per position ({} in a \
         GPU's pool)",
        KvCache::state_bytes(config),
        KvCache::bytes_per_position(config),
        KvCache::gpu_bytes_per_position(config)
    );
    println!("prefill of one sequence in one step, median of {iters}");
    println!(
        "{:>7} {:>10} {:>10} {:>14} {:>16}",
        "tokens", "full ms", "full tok/s", "no-experts ms", "no-experts tok/s"
    );
    for tokens in lengths.split(',').filter_map(|t| t.trim().parse().ok()) {
        let f = prefill_ms(full, tokens, iters);
        let d = prefill_ms(dense_only, tokens, iters);
        println!(
            "{tokens:>7} {f:>10.1} {:>10.0} {d:>14.1} {:>16.0}",
            tokens as f64 / f * 1e3,
            tokens as f64 / d * 1e3
        );
    }
}

/// The GPU `MOE_STEP_GPU` names, if any.
fn gpu() -> Option<&'static GpuInfo> {
    let wanted = std::env::var("MOE_STEP_GPU").ok()?;
    let (runtime, ordinal) = match wanted.trim() {
        "emulated" => (
            cuda::emulated_runtime(EmulatedGpus {
                count: 1,
                bytes: 4 << 30,
            }),
            0,
        ),
        n => (
            cuda::runtime(None),
            n.parse()
                .expect("MOE_STEP_GPU: a GPU's ordinal or `emulated`"),
        ),
    };
    let runtime = runtime.expect("MOE_STEP_GPU is set: CUDA");
    Some(
        runtime
            .gpus
            .get(ordinal)
            .expect("MOE_STEP_GPU: no such GPU"),
    )
}

fn main() {
    let iters: usize = std::env::var("MOE_STEP_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let dir = match std::env::var_os("MOE_STEP_MODEL") {
        Some(dir) => std::path::PathBuf::from(dir),
        None => common::demo_model(env!("CARGO_BIN_EXE_moe-node")),
    };
    let gpu = gpu();
    let full = match gpu {
        Some(g) => engine_on_gpu(&ModelSource::files(&dir), g.ordinal, true, None, None)
            .expect("the model loads on the GPU"),
        None => Engine::load(&dir).expect("the model loads"),
    };
    let config = ModelConfig::load(&dir).expect("config");
    let weights = DenseWeights::load(&Checkpoint::open(&dir).expect("checkpoint"), &config)
        .expect("dense weights");
    let hidden = config.hidden_size;
    let mut dense_only = Engine::new(config, weights, Arc::new(NoExperts(hidden)));
    if let Some(g) = gpu {
        dense_only
            .place_dense_on_gpu(g, 0.9, None)
            .expect("the dense part loads on the GPU");
        println!("on GPU {} ({})", g.ordinal, g.name);
    }
    prefill(&full, &dense_only);
    if std::env::var("MOE_STEP_BATCHES").is_ok_and(|b| b.trim().is_empty()) {
        return;
    }
    let dispatched = gpu.is_none().then(|| common::dispatched_engine(&dir));
    println!(
        "engine decode step on {}, median of {iters} steps",
        dir.display()
    );
    println!(
        "{:>6} {:>12} {:>12} {:>14} {:>16} {:>15}",
        "batch", "full ms", "full tok/s", "no-experts ms", "no-experts tok/s", "dispatched ms"
    );
    let mut base = None;
    let batches: Vec<usize> = std::env::var("MOE_STEP_BATCHES")
        .unwrap_or_else(|_| "1,8,32".into())
        .split(',')
        .filter_map(|b| b.trim().parse().ok())
        .collect();
    for batch in batches {
        let f = step_ms(&full, batch, iters);
        let d = step_ms(&dense_only, batch, iters);
        let n = dispatched
            .as_ref()
            .map_or(f64::NAN, |(_, engine)| step_ms(engine, batch, iters));
        let tps = batch as f64 / f * 1e3;
        let base_tps = *base.get_or_insert(tps);
        println!(
            "{batch:>6} {f:>12.3} {tps:>12.0} {d:>14.3} {:>16.0} {n:>15.3}   full vs batch 1: {:.2}x",
            batch as f64 / d * 1e3,
            tps / base_tps
        );
    }
}
