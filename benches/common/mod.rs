//! What the load and engine-step benchmarks share: the demo model they run, and the
//! engine's own decode step, so that `load` can quote the server against it in one run.

#![allow(dead_code)]

pub mod quantize;

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

/// The engine as `moe-node serve` builds it, without the router and HTTP: the demo
/// model's experts on the default number of CPU device actors, reached through the
/// dispatcher. The returned system runs the device actors; keep it while using the engine.
pub fn dispatched_engine(model: &Path) -> (actix::SystemRunner, Engine) {
    use std::sync::Arc;

    use moe_node::config::DevicesConfig;
    use moe_node::experts::device::{DeviceTarget, start_device};
    use moe_node::experts::{DispatchTiming, Dispatcher};
    use moe_node::model::{Checkpoint, DenseWeights, ModelConfig};
    use moe_node::placement::Placement;
    use moe_node::placement::load::ExpertLoad;

    let system = actix::System::new();
    let engine = system.block_on(async {
        let devices_config = DevicesConfig::default();
        let slots = devices_config.cpu_slots;
        let config = Arc::new(ModelConfig::load(model).expect("demo config"));
        let checkpoint = Arc::new(Checkpoint::open(model).expect("demo checkpoint"));
        let placement = Arc::new(
            Placement::single_node(
                &config.moe_layers,
                config.moe.num_experts,
                slots,
                devices_config.replication,
            )
            .expect("placement"),
        );
        let devices = (0..slots)
            .map(|id| {
                start_device(
                    id,
                    DeviceTarget::Cpu,
                    checkpoint.clone(),
                    config.clone(),
                    placement.experts_on(0, id as u16),
                )
                .expect("CPU slot starts")
            })
            .collect();
        let load = Arc::new(ExpertLoad::new(
            config.num_layers,
            config.moe.num_experts,
            slots,
        ));
        let dispatcher = Dispatcher::new(
            devices,
            placement,
            0,
            load,
            config.hidden_size,
            DispatchTiming::default(),
        );
        let weights = DenseWeights::load(&checkpoint, &config).expect("dense weights");
        Engine::new((*config).clone(), weights, Arc::new(dispatcher))
    });
    (system, engine)
}

/// The benchmarks' prompts take ids 1 to this (at most 250, within the model's vocabulary).
pub fn token_range(engine: &Engine) -> usize {
    engine.config().vocab_size.saturating_sub(1).clamp(1, 250)
}

/// Milliseconds of each of `iters` decode steps for `batch` sequences with 16-token
/// prompts (the load benchmark's prompts).
pub fn decode_steps_ms(engine: &Engine, batch: usize, iters: usize) -> Vec<f64> {
    let mut caches: Vec<_> = (0..batch).map(|_| engine.new_cache()).collect();
    let top = token_range(engine);
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..16)
                .map(|i| ((b * 31 + i * 7) % top + 1) as u32)
                .collect()
        })
        .collect();
    let mut prefill: Vec<SequenceStep> = caches
        .iter_mut()
        .zip(&prompts)
        .map(|(cache, tokens)| SequenceStep::new(cache, tokens))
        .collect();
    engine.forward(&mut prefill).expect("prefill");
    let mut tokens: Vec<[u32; 1]> = (0..batch).map(|b| [((b * 13) % top + 1) as u32]).collect();
    (0..iters)
        .map(|_| {
            let mut step: Vec<SequenceStep> = caches
                .iter_mut()
                .zip(&tokens)
                .map(|(cache, tokens)| SequenceStep::new(cache, tokens))
                .collect();
            let started = Instant::now();
            let logits = engine.forward(&mut step).expect("decode step");
            let took = started.elapsed().as_secs_f64() * 1e3;
            // Each sequence goes on with its greedy token, as a served decode does: a step
            // fed the same token again would route to the same experts every time and find
            // their weights in cache, which no real decode does.
            for (token, logits) in tokens.iter_mut().zip(&logits) {
                token[0] = argmax(logits);
            }
            took
        })
        .collect()
}

/// The index of the largest of `values` (the greedy token of a row of logits).
fn argmax(values: &[f32]) -> u32 {
    values
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 { (i, v) } else { best }
        })
        .0 as u32
}

/// `count` SwiGLU experts of `inter` x `hidden` with random bf16 weights (scale 0.05), expert
/// `e`'s gate, up and down seeded `10 + 3e`, `11 + 3e` and `12 + 3e` (the CPU kernel benches'
/// experts: `roofline`, `cpu_precision`).
pub fn random_bf16_experts(
    count: usize,
    inter: usize,
    hidden: usize,
) -> Vec<moe_node::model::ExpertWeights> {
    use moe_node::compute::cpu::{Linear, SwiGlu};
    use moe_node::compute::cuda::experts::random_bf16;
    (0..count)
        .map(|e| {
            let linear = |o: usize, i: usize, seed: u64| {
                Linear::without_bias(random_bf16(o * i, seed, 0.05), o, i)
            };
            moe_node::model::ExpertWeights::Bf16(SwiGlu {
                gate: linear(inter, hidden, 10 + 3 * e as u64),
                up: linear(inter, hidden, 11 + 3 * e as u64),
                down: linear(hidden, inter, 12 + 3 * e as u64),
            })
        })
        .collect()
}

/// The median of `values` (NaN when empty).
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}
