//! `devices.cpu_precision` side by side (issue 53): the CPU products of the llama.cpp
//! comparison's random Qwen3-MoE (hidden 1024, 128 experts of 384, top-8) with bf16 weights,
//! `"exact"` (weights widened, f32 products) against `"bf16"` (inputs rounded to bf16,
//! AVX512_BF16's `vdpbf16ps`), alternating the two on the same weights and inputs:
//!
//! - a dense projection, [2048 x 1024] (the attention's q projection), from 1 row (decode)
//!   to 512 (a 512-token prefill);
//! - the grouped expert products of a 512-token prefill step: 128 experts, 32 rows each;
//! - a decode step's experts: one row through 8 experts;
//! - 8 streams' step: 8 rows, each through 8 experts of the 128.
//!
//! `cargo bench --bench cpu_precision`; `MOE_PRECISION_REPS` (default 9). Prints the median
//! milliseconds of each and `exact/bf16` (above 1: bf16 is faster). On a CPU without
//! AVX512_BF16 it says so and stops: `"bf16"` runs the exact products there.

use std::time::Instant;

mod common;

use moe_node::compute::cpu::Linear;
use moe_node::compute::cpu::native_bf16::{self, Precision};
use moe_node::compute::cuda::experts::random_bf16;
use moe_node::experts::run_expert_groups;
use moe_node::model::ExpertWeights;

fn random(n: usize, seed: u64) -> Vec<f32> {
    random_bf16(n, seed, 1.0)
        .iter()
        .map(|v| v.to_f32())
        .collect()
}

/// Median milliseconds of `f` under each precision, the two alternating run by run.
fn side_by_side(reps: usize, mut f: impl FnMut()) -> (f64, f64) {
    let mut times = [Vec::new(), Vec::new()];
    for rep in 0..=reps {
        for (slot, precision) in [Precision::Exact, Precision::Bf16].into_iter().enumerate() {
            native_bf16::set_precision(precision);
            let started = Instant::now();
            f();
            // The first round warms both up.
            if rep > 0 {
                times[slot].push(started.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    native_bf16::set_precision(Precision::Exact);
    let [mut exact, mut bf16] = times;
    (common::median(&mut exact), common::median(&mut bf16))
}

fn report(name: &str, (exact, bf16): (f64, f64)) {
    println!(
        "{name:<52} exact {exact:>9.3} ms   bf16 {bf16:>9.3} ms   exact/bf16 {:.2}x",
        exact / bf16
    );
}

fn main() {
    if !native_bf16::available() {
        println!("this CPU has no AVX512_BF16: devices.cpu_precision = \"bf16\" runs exact here");
        return;
    }
    let reps: usize = std::env::var("MOE_PRECISION_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(9);
    let (experts, inter, hidden) = (128, 384, 1024);
    println!(
        "cpu_precision: {} rayon threads, median of {reps} alternating runs each",
        rayon::current_num_threads()
    );

    let dense = Linear::without_bias(random_bf16(2048 * hidden, 7, 0.05), 2048, hidden);
    for rows in [1, 2, 4, 8, 16, 64, 512] {
        let x = random(rows * hidden, 8);
        report(
            &format!("dense [2048 x 1024], {rows} rows"),
            side_by_side(reps, || {
                std::hint::black_box(dense.forward(&x, rows));
            }),
        );
    }

    let blocks = common::random_bf16_experts(experts, inter, hidden);
    for (name, groups, rows) in [
        (
            "128 experts [3 x 384 x 1024], 32 rows each (prefill)",
            experts,
            32,
        ),
        ("8 experts, 1 row each (decode)", 8, 1),
        ("64 experts, 1 row each (8 streams)", 64, 1),
    ] {
        let inputs: Vec<Vec<f32>> = (0..groups)
            .map(|e| random(rows * hidden, 1000 + e as u64))
            .collect();
        let work: Vec<(&ExpertWeights, &[f32])> = blocks
            .iter()
            .zip(&inputs)
            .map(|(b, x)| (b, &x[..]))
            .collect();
        report(
            name,
            side_by_side(reps, || {
                std::hint::black_box(run_expert_groups(&work, hidden, true));
            }),
        );
    }
}
