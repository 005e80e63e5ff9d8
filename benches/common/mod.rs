//! What the load and engine-step benchmarks share: the demo model they run, and the
//! engine's own decode step, so that `load` can quote the server against it in one run.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use moe_node::engine::{Engine, SequenceStep};

/// The demo model under cargo's scratch folder for benchmarks, written by `bin` if absent.
pub fn demo_model(bin: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-demo-model");
    if !dir.join("config.json").exists() {
        let status = Command::new(bin)
            .args(["demo-model", "--out"])
            .arg(&dir)
            .stderr(Stdio::null())
            .status()
            .expect("demo-model runs");
        assert!(status.success(), "demo model written");
    }
    dir
}

/// Milliseconds of each of `iters` decode steps for `batch` sequences with 16-token
/// prompts (the load benchmark's prompts).
pub fn decode_steps_ms(engine: &Engine, batch: usize, iters: usize) -> Vec<f64> {
    let mut caches: Vec<_> = (0..batch).map(|_| engine.new_cache()).collect();
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..16)
                .map(|i| ((b * 31 + i * 7) % 250 + 1) as u32)
                .collect()
        })
        .collect();
    let mut prefill: Vec<SequenceStep> = caches
        .iter_mut()
        .zip(&prompts)
        .map(|(cache, tokens)| SequenceStep::new(cache, tokens))
        .collect();
    engine.forward(&mut prefill).expect("prefill");
    let tokens: Vec<[u32; 1]> = (0..batch).map(|b| [(b as u32 * 13) % 250 + 1]).collect();
    (0..iters)
        .map(|_| {
            let mut step: Vec<SequenceStep> = caches
                .iter_mut()
                .zip(&tokens)
                .map(|(cache, tokens)| SequenceStep::new(cache, tokens))
                .collect();
            let started = Instant::now();
            engine.forward(&mut step).expect("decode step");
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect()
}

/// The median of `values` (NaN when empty).
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}
