//! Decode step time of the engine alone (no actors, no HTTP) on the demo model at batch 1, 8
//! and 32: with every expert, and with the routed experts replaced by a no-op, which leaves
//! the part of a step that does not depend on which experts the tokens pick (embeddings,
//! attention over each sequence's cache, norms, gates, shared expert, lm head); and with
//! the experts on CPU device actors reached through the dispatcher, as `moe-node serve`
//! runs them (what the node adds to a step before the router and HTTP). The load
//! benchmark's concurrency ratio can be no better than what this shows.
//!
//! `cargo bench --bench engine_step`; `MOE_STEP_ITERS` (default 200), `MOE_STEP_BATCHES`
//! (default 1,8,32), `MOE_STEP_MODEL` (a model directory to time instead of the demo model,
//! e.g. one of a published shape with random weights).

mod common;

use std::sync::Arc;

use moe_node::engine::Engine;
use moe_node::experts::{ExpertError, ExpertExecutor};
use moe_node::model::{Checkpoint, DenseWeights, ModelConfig};
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

fn main() {
    let iters: usize = std::env::var("MOE_STEP_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let dir = match std::env::var_os("MOE_STEP_MODEL") {
        Some(dir) => std::path::PathBuf::from(dir),
        None => common::demo_model(env!("CARGO_BIN_EXE_moe-node")),
    };
    let full = Engine::load(&dir).expect("demo model loads");
    let config = ModelConfig::load(&dir).expect("config");
    let weights = DenseWeights::load(&Checkpoint::open(&dir).expect("checkpoint"), &config)
        .expect("dense weights");
    let hidden = config.hidden_size;
    let dense_only = Engine::new(config, weights, Arc::new(NoExperts(hidden)));
    let (_system, dispatched) = common::dispatched_engine(&dir);
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
        let n = step_ms(&dispatched, batch, iters);
        let tps = batch as f64 / f * 1e3;
        let base_tps = *base.get_or_insert(tps);
        println!(
            "{batch:>6} {f:>12.3} {tps:>12.0} {d:>14.3} {:>16.0} {n:>15.3}   full vs batch 1: {:.2}x",
            batch as f64 / d * 1e3,
            tps / base_tps
        );
    }
}
