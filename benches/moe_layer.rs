//! One MoE layer at a Kimi K3-like shape (896 experts, top-16, one shared expert, hidden 1024,
//! expert intermediate 256, f32 arithmetic), through the same code the engine runs
//! (`moe_forward` with `LocalExperts`), at 1, 16 and 256 tokens per step, with the experts
//! held in f32, in bf16 (as a bf16 checkpoint loads them), in FP8 e4m3 with [128, 128]
//! block scales, in INT4 with a scale per 32 and in MXFP4 (e2m1 with a power-of-two scale per
//! 32; as FP8, compressed-tensors and gpt-oss checkpoints load them, dequantized as the kernel
//! reads them); side by side with
//! transformers' DeepseekV3MoE block on the same machine and thread count, in f32 and bf16,
//! with each experts implementation transformers offers (benches/moe_layer_reference.py).
//!
//!     cargo bench --bench moe_layer
//!
//! Environment: MOE_BENCH_TOKENS (default 1,16,256), MOE_BENCH_SECONDS (time budget per
//! point, default 3), MOE_BENCH_PYTHON (default python3; set to "" to skip the reference),
//! MOE_BENCH_EXPERT_FORMATS (default f32,bf16,fp8,int4,mxfp4), MOE_BENCH_CPU_AMX (default 1; 0 sets
//! the AMX tiles aside, as `devices.cpu_amx = false` does, for a side-by-side run).
//! Prints medians; each iteration gets fresh inputs so that it routes to other experts and
//! reads their weights from memory, as decoding does.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::quantize::{quantize, to_bf16, to_fp8, to_int4, to_mxfp4};
use moe_node::compute::cpu::{Linear, SwiGlu, dot};
use moe_node::engine::moe_layer::moe_forward;
use moe_node::experts::LocalExperts;
use moe_node::model::config::{ExpertActivation, GatingConfig, MoeConfig};
use moe_node::model::weights::{ExpertWeights, MoeWeights, StoredLinear};
use moe_node::moe::{DispatchPlan, route};
use rayon::prelude::*;

const HIDDEN: usize = 1024;
const INTERMEDIATE: usize = 256;
const EXPERTS: usize = 896;
const TOP_K: usize = 16;

/// A fast deterministic generator for bench weights (quality is irrelevant here).
struct XorShift(u64);

impl XorShift {
    fn next(&mut self, scale: f32) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }

    fn linear(&mut self, out: usize, inp: usize, scale: f32) -> Linear {
        Linear {
            weight: (0..out * inp).map(|_| self.next(scale)).collect(),
            bias: None,
            out_features: out,
            in_features: inp,
            clamp: None,
        }
    }

    fn swiglu(&mut self) -> SwiGlu {
        SwiGlu {
            gate: self.linear(INTERMEDIATE, HIDDEN, 0.03),
            up: self.linear(INTERMEDIATE, HIDDEN, 0.03),
            down: self.linear(HIDDEN, INTERMEDIATE, 0.06),
        }
    }
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Times `f` with a fresh input per iteration: at least 5 runs, more within the budget.
fn time_runs(budget: Duration, mut f: impl FnMut(usize)) -> Duration {
    f(0);
    let start = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < 5 || (start.elapsed() < budget && samples.len() < 200) {
        let t = Instant::now();
        f(samples.len() + 1);
        samples.push(t.elapsed());
    }
    median(samples)
}

/// Memory bandwidth of this machine with the pool's threads, over 2 GiB (far beyond the
/// last-level cache): `(read, copy)` in bytes/s. Read is one pass of the engine's own
/// vectorised, prefetching loop (each 256 KiB chunk dotted with itself, so read once);
/// copy is memcpy, counting the bytes read and written. The buffer holds varied values: one
/// of a single repeated value read at half the speed here.
fn memory_bandwidth() -> (f64, f64) {
    let buffer: Vec<f32> = (0..512usize << 20).map(|i| (i % 7) as f32).collect();
    let mut target = vec![0.0f32; buffer.len()];
    let bytes = (buffer.len() * 4) as f64;
    let read = median(
        (0..5)
            .map(|_| {
                let t = Instant::now();
                let sum: f32 = buffer.par_chunks(1 << 16).map(|c| dot(c, c)).sum();
                std::hint::black_box(sum);
                t.elapsed()
            })
            .collect(),
    );
    let copy = median(
        (0..5)
            .map(|_| {
                let t = Instant::now();
                target
                    .par_chunks_mut(1 << 16)
                    .zip(buffer.par_chunks(1 << 16))
                    .for_each(|(to, from)| to.copy_from_slice(from));
                std::hint::black_box(&target);
                t.elapsed()
            })
            .collect(),
    );
    (bytes / read.as_secs_f64(), 2.0 * bytes / copy.as_secs_f64())
}

struct ReferencePoint {
    implementation: String,
    median_s: f64,
}

fn run_reference(
    python: &str,
    threads: usize,
    tokens: &[usize],
    seconds: f64,
    dtype: &str,
) -> Vec<(usize, ReferencePoint)> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/moe_layer_reference.py"
    );
    let token_list: Vec<String> = tokens.iter().map(usize::to_string).collect();
    let output = Command::new(python)
        .args([script, "--threads", &threads.to_string()])
        .args(["--tokens", &token_list.join(","), "--dtype", dtype])
        .args(["--seconds", &seconds.to_string()])
        .output();
    let output = match output {
        Ok(o) if o.status.success() => o,
        Ok(o) => {
            eprintln!("reference failed: {}", String::from_utf8_lossy(&o.stderr));
            return Vec::new();
        }
        Err(e) => {
            eprintln!("reference not run ({python}: {e}); pip install torch transformers");
            return Vec::new();
        }
    };
    let mut points = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(t), Some(s), Some(i)) = (
            v["tokens"].as_u64(),
            v["median_s"].as_f64(),
            v["implementation"].as_str(),
        ) else {
            continue;
        };
        let implementation = format!("{i} {dtype}");
        println!(
            "  transformers {implementation:<15} {t:>4} tokens/step: {:>9.1} tokens/s",
            t as f64 / s
        );
        points.push((
            t as usize,
            ReferencePoint {
                implementation,
                median_s: s,
            },
        ));
    }
    points
}

/// Times `moe_forward` with the given experts at each token count; returns median seconds.
fn run_ours(
    label: &str,
    cfg: &MoeConfig,
    weights: &MoeWeights,
    experts: &LocalExperts,
    tokens: &[usize],
    budget: Duration,
    bandwidth: f64,
) -> Vec<(usize, f64)> {
    let expert_bytes = experts.expert(0, 0).map_or(0, ExpertWeights::weight_bytes);
    let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
    let mut results = Vec::new();
    for &t in tokens {
        let inputs: Vec<Vec<f32>> = (0..64)
            .map(|_| (0..t * HIDDEN).map(|_| rng.next(1.7)).collect())
            .collect();
        let time = time_runs(budget, |i| {
            let x = &inputs[i % inputs.len()];
            let out = moe_forward(cfg, weights, experts, 0, x, t, &mut [])
                .expect("all experts are local");
            std::hint::black_box(out);
        });
        let distinct: usize = inputs
            .iter()
            .map(|x| {
                let logits = weights.router.forward(x, t);
                let bias = weights.correction_bias.as_deref();
                let routing = route(&cfg.gating, &logits, EXPERTS, TOP_K, bias);
                DispatchPlan::new(&routing, EXPERTS).experts.len()
            })
            .sum();
        let distinct = distinct as f64 / inputs.len() as f64;
        let rate = t as f64 / time.as_secs_f64();
        let read = distinct * expert_bytes as f64 / time.as_secs_f64();
        println!(
            "  moe-node {label:<19} {t:>4} tokens/step: {rate:>9.1} tokens/s  ({distinct:.0} experts/step, {:.2} MiB of routed expert weights read per token, at {:.1} GB/s = {:.0}% of bandwidth)",
            distinct * expert_bytes as f64 / t as f64 / (1u64 << 20) as f64,
            read / 1e9,
            100.0 * read / bandwidth
        );
        results.push((t, time.as_secs_f64()));
    }
    results
}

fn main() {
    if std::env::var_os("MOE_BENCH_CPU_AMX").is_some_and(|v| v == "0") {
        moe_node::compute::amx::set_aside(true);
    }
    let tokens: Vec<usize> = std::env::var("MOE_BENCH_TOKENS")
        .unwrap_or_else(|_| "1,16,256".into())
        .split(',')
        .filter_map(|t| t.trim().parse().ok())
        .collect();
    let seconds: f64 = std::env::var("MOE_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let python = std::env::var("MOE_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let threads = rayon::current_num_threads();
    let budget = Duration::from_secs_f64(seconds);

    println!(
        "MoE layer: {EXPERTS} experts, top-{TOP_K}, 1 shared (held like the routed experts; bf16 beside INT4), router bf16 (f32 beside f32 experts), hidden {HIDDEN}, intermediate {INTERMEDIATE}, f32 arithmetic, {threads} threads"
    );
    let (bandwidth, copy_bandwidth) = memory_bandwidth();
    println!(
        "memory bandwidth: read {:.1} GB/s, memcpy {:.1} GB/s (read + write)",
        bandwidth / 1e9,
        copy_bandwidth / 1e9
    );

    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let cfg = MoeConfig {
        num_experts: EXPERTS,
        top_k: TOP_K,
        expert_intermediate_size: INTERMEDIATE,
        shared_intermediate_size: INTERMEDIATE,
        gating: GatingConfig::SigmoidGrouped {
            n_group: 1,
            topk_group: 1,
            normalize: true,
            routed_scaling_factor: 2.827,
        },
        weight_input: false,
        shared_expert_gate: false,
        activation: ExpertActivation::Silu,
    };
    let router = rng.linear(EXPERTS, HIDDEN, 0.05);
    let correction_bias: Vec<f32> = (0..EXPERTS).map(|_| rng.next(0.01)).collect();
    let shared = rng.swiglu();

    // The same experts held five ways: f32; bf16 (what a bf16 checkpoint loads to); FP8, INT4
    // and MXFP4 as quantized checkpoints store them. Arithmetic stays f32.
    let formats = std::env::var("MOE_BENCH_EXPERT_FORMATS")
        .unwrap_or_else(|_| "f32,bf16,fp8,int4,mxfp4".into());
    let formats: Vec<&str> = formats.split(',').map(str::trim).collect();
    let mut ours = Vec::new();
    let f32_experts: Vec<SwiGlu> = (0..EXPERTS).map(|_| rng.swiglu()).collect();
    for (format, label) in [
        ("f32", "f32 experts"),
        ("bf16", "bf16 experts"),
        ("fp8", "fp8 experts"),
        ("int4", "int4 experts"),
        ("mxfp4", "mxfp4 experts"),
    ] {
        if !formats.contains(&format) {
            continue;
        }
        // The last format's experts are freed; hand their pages back so that this format's
        // resident memory is its own and not the freed heap reused.
        #[cfg(target_env = "gnu")]
        // SAFETY: malloc_trim only returns free heap memory to the system.
        unsafe {
            libc::malloc_trim(0);
        }
        let resident_before = resident_bytes();
        let hold = |e: &SwiGlu| match format {
            "f32" => ExpertWeights::F32(e.clone()),
            "bf16" => ExpertWeights::Bf16(to_bf16(e)),
            "fp8" => ExpertWeights::Quantized(quantize(e, to_fp8)),
            "int4" => ExpertWeights::Quantized(quantize(e, to_int4)),
            _ => ExpertWeights::Quantized(quantize(e, to_mxfp4)),
        };
        let layer: Vec<ExpertWeights> = f32_experts.iter().map(hold).collect();
        // The shared expert as such a checkpoint stores it: FP8 like the routed experts
        // (DeepSeek-V3, Kimi K2 Instruct); bf16 beside INT4 experts (Kimi K2 Thinking's
        // `ignore` list names the shared experts). The router is bf16, as the published
        // checkpoints store it and the node keeps it (f32 beside f32 experts); before
        // 2026-12-04 it was f32 in every format, which read twice its bytes per token (at
        // this hidden size a 3.5 MiB f32 router weighed half as much as 16 INT4 experts).
        let shared_expert = match format {
            "int4" | "mxfp4" => ExpertWeights::Bf16(to_bf16(&shared)),
            _ => hold(&shared),
        };
        let weights = MoeWeights {
            router: match format {
                "f32" => StoredLinear::F32(router.clone()),
                _ => StoredLinear::Bf16(Linear::without_bias(
                    router
                        .weight
                        .iter()
                        .map(|&w| half::bf16::from_f32(w))
                        .collect(),
                    EXPERTS,
                    HIDDEN,
                )),
            },
            correction_bias: Some(correction_bias.clone()),
            shared_expert: Some(shared_expert),
            shared_expert_gate: None,
        };
        let held: usize = layer.iter().map(ExpertWeights::weight_bytes).sum();
        // Resident memory the layer's experts added (Linux; 0 elsewhere).
        let resident = resident_bytes().saturating_sub(resident_before);
        println!(
            "  {label}: {EXPERTS} experts hold {:.1} MiB ({:.3} bytes per weight); resident memory grew {:.1} MiB",
            held as f64 / (1u64 << 20) as f64,
            held as f64 / (EXPERTS * 3 * HIDDEN * INTERMEDIATE) as f64,
            resident as f64 / (1u64 << 20) as f64
        );
        let experts = LocalExperts::new(vec![layer], HIDDEN);
        let results = run_ours(label, &cfg, &weights, &experts, &tokens, budget, bandwidth);
        ours.push((label, results));
    }
    drop(f32_experts);

    let mut reference = Vec::new();
    if !python.is_empty() {
        for dtype in ["f32", "bf16"] {
            reference.extend(run_reference(&python, threads, &tokens, seconds, dtype));
        }
    }
    println!(
        "\nsummary (medians; ratio = moe-node tokens/s over the fastest transformers run, any implementation or dtype)"
    );
    for (label, results) in ours {
        for (t, ours_s) in results {
            let best = reference
                .iter()
                .filter(|(rt, _)| *rt == t)
                .map(|(_, p)| p)
                .min_by(|a, b| a.median_s.total_cmp(&b.median_s));
            let rate = t as f64 / ours_s;
            match best {
                Some(best) => println!(
                    "  {t:>4} tokens/step: moe-node {label} {rate:>9.1} tokens/s, transformers ({}) {:>9.1} tokens/s, ratio {:.2}x",
                    best.implementation,
                    t as f64 / best.median_s,
                    best.median_s / ours_s
                ),
                None => println!(
                    "  {t:>4} tokens/step: moe-node {label} {rate:>9.1} tokens/s (no reference)"
                ),
            }
        }
    }
}

/// This process's resident set in bytes, from /proc/self/statm (0 where there is none).
fn resident_bytes() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * 4096)
}
