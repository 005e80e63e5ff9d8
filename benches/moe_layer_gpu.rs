//! One MoE layer on the GPU at Kimi shapes (hidden 7168, expert intermediate 2048): Kimi K2
//! (384 experts, top-8) and Kimi K3 (896 experts, top-16), with experts held in bf16, FP8
//! ([128, 128] blocks) and INT4 (groups of 32) as published checkpoints store them, at 1 to
//! 4096 tokens a pass. Prints the median time of a pass, the HBM bandwidth it achieves (bytes of the
//! distinct experts read, at small batch) and its TFLOP/s (at large batch), against the
//! card's own copy bandwidth and bf16 GEMM rate measured first in the same run. Where every
//! expert gets at most 8 rows, the same pass is also timed with the grouped GEMV kernel in
//! place of cuBLAS's grouped GEMM. "host ms" times the same expert groups the way a node's
//! device actor runs them today: f32 rows from host memory through `GpuExperts::run` (staged
//! into pinned memory, converted, the two grouped products, and back to the host), which is
//! what a step pays per MoE layer when its rows are not already on the GPU.
//!
//!     cargo bench --bench moe_layer_gpu
//!
//! `MOE_GPU_BENCH_OUT=FILE` also writes one JSON object per line (the PyPI-torch reference,
//! benches/moe_layer_gpu_reference.py, reads it and prints the side-by-side ratios);
//! `MOE_GPU_BENCH_TOKENS=1,64,4096`, `MOE_GPU_BENCH_SHAPES=k2` and
//! `MOE_GPU_BENCH_FORMATS=bf16,fp8,int4` narrow the run. For quantized experts "ms" is the
//! grouped GEMM on bf16 copies made for the pass, "GEMV ms" the kernel that reads them as
//! stored; bandwidth counts the stored bytes. Without a
//! usable GPU it says why and exits.

use std::io::Write;
use std::time::Instant;

use cudarc::driver::{CudaContext, DevicePtr, result};
use moe_node::compute::cpu::{Linear, SwiGlu};
use moe_node::compute::cuda::blas::{self, Gemm, Output};
use moe_node::compute::cuda::experts::{ExpertShape, GEMV_MAX_ROWS, random_bf16};
use moe_node::compute::cuda::layer::{Gate, GpuMoeLayer};
use moe_node::compute::cuda::storage::ExpertStorage;
use moe_node::compute::cuda::{self, GpuInfo};
use moe_node::model::ExpertWeights;
use moe_node::model::config::GatingConfig;

mod common;
use common::quantize::{quantize, to_bf16, to_fp8, to_int4};

const HIDDEN: usize = 7168;
const INTERMEDIATE: usize = 2048;

struct Shape {
    name: &'static str,
    experts: usize,
    top_k: usize,
}

const SHAPES: &[Shape] = &[
    Shape {
        name: "k2",
        experts: 384,
        top_k: 8,
    },
    Shape {
        name: "k3",
        experts: 896,
        top_k: 16,
    },
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `f` (which must synchronise) a few times after a warm-up; median seconds.
fn time<F: FnMut()>(mut f: F, budget_s: f64, max_iters: usize) -> f64 {
    for _ in 0..2 {
        f();
    }
    let started = Instant::now();
    let mut times = Vec::new();
    while times.len() < 5 || (times.len() < max_iters && started.elapsed().as_secs_f64() < budget_s)
    {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    median(times)
}

/// The card's device-to-device copy bandwidth (bytes read + written per second).
fn copy_bandwidth(ctx: &std::sync::Arc<CudaContext>) -> f64 {
    let stream = ctx.default_stream();
    let bytes = 4usize << 30;
    let src = stream.alloc_zeros::<u8>(bytes).unwrap();
    let mut dst = stream.alloc_zeros::<u8>(bytes).unwrap();
    let (s, _g1) = src.device_ptr(&stream);
    let (d, _g2) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dst, &stream);
    let t = time(
        || {
            unsafe { result::memcpy_dtod_async(d, s, bytes, stream.cu_stream()) }.unwrap();
            stream.synchronize().unwrap();
        },
        2.0,
        20,
    );
    2.0 * bytes as f64 / t
}

/// The card's bf16 GEMM rate (FLOP/s) on an 8192³ product through cuBLAS.
fn gemm_rate(ctx: &std::sync::Arc<CudaContext>) -> f64 {
    let stream = ctx.default_stream();
    let blas_handle = cudarc::cublas::CudaBlas::new(stream.clone()).unwrap();
    let n = 8192usize;
    let a = stream.alloc_zeros::<half::bf16>(n * n).unwrap();
    let b = stream.alloc_zeros::<half::bf16>(n * n).unwrap();
    let mut c = stream.alloc_zeros::<half::bf16>(n * n).unwrap();
    let (pa, _g1) = a.device_ptr(&stream);
    let (pb, _g2) = b.device_ptr(&stream);
    let (pc, _g3) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut c, &stream);
    let shape = Gemm {
        a_transposed: false,
        m: n,
        n,
        k: n,
        lda: n,
        ldb: n,
        ldc: n,
    };
    let t = time(
        || {
            // SAFETY: three n × n bf16 matrices.
            unsafe { blas::gemm(&blas_handle, shape, pa, pb, pc, Output::Bf16) }.unwrap();
            stream.synchronize().unwrap();
        },
        2.0,
        20,
    );
    2.0 * (n * n * n) as f64 / t
}

/// One random expert of the bench's shape in `format`, and the form a device holds it in.
fn random_expert(format: &str) -> (ExpertStorage, ExpertWeights) {
    let linear = |rows: usize, cols: usize, seed: u64| {
        let values = random_bf16(rows * cols, seed, (cols as f32).powf(-0.5));
        Linear::without_bias(values.into_iter().map(f32::from).collect(), rows, cols)
    };
    let block = SwiGlu {
        gate: linear(INTERMEDIATE, HIDDEN, 21),
        up: linear(INTERMEDIATE, HIDDEN, 22),
        down: linear(HIDDEN, INTERMEDIATE, 23),
    };
    let weights = match format {
        "bf16" => ExpertWeights::Bf16(to_bf16(&block)),
        "fp8" => ExpertWeights::Quantized(quantize(&block, to_fp8)),
        "int4" => ExpertWeights::Quantized(quantize(&block, to_int4)),
        other => panic!("MOE_GPU_BENCH_FORMATS: unknown format {other} (bf16, fp8, int4)"),
    };
    (ExpertStorage::of(&weights, HIDDEN, INTERMEDIATE).0, weights)
}

fn list(var: &str) -> Option<Vec<String>> {
    std::env::var(var)
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect())
}

fn main() {
    let gpu: GpuInfo = match cuda::runtime(None) {
        Ok(rt) => {
            cuda::log_runtime(rt);
            rt.gpus[0].clone()
        }
        Err(e) => {
            println!("moe_layer_gpu: no usable GPU ({e}); nothing measured");
            return;
        }
    };
    let tokens: Vec<usize> = list("MOE_GPU_BENCH_TOKENS")
        .map(|v| v.iter().map(|t| t.parse().expect("token counts")).collect())
        .unwrap_or_else(|| vec![1, 4, 16, 64, 256, 1024, 4096]);
    let shapes: Vec<&Shape> = match list("MOE_GPU_BENCH_SHAPES") {
        Some(names) => SHAPES
            .iter()
            .filter(|s| names.iter().any(|n| n == s.name))
            .collect(),
        None => SHAPES.iter().collect(),
    };
    let mut out = std::env::var_os("MOE_GPU_BENCH_OUT")
        .map(|p| std::fs::File::create(p).expect("MOE_GPU_BENCH_OUT is writable"));

    let ctx = CudaContext::new(gpu.ordinal).unwrap();
    let bandwidth = copy_bandwidth(&ctx);
    let flops = gemm_rate(&ctx);
    drop(ctx);
    println!(
        "{} ({}): copy bandwidth {:.0} GB/s, bf16 GEMM {:.0} TFLOP/s (cuBLAS 8192³)",
        gpu.name,
        gpu.sm(),
        bandwidth / 1e9,
        flops / 1e12
    );
    if let Some(f) = &mut out {
        writeln!(
            f,
            "{}",
            serde_json::json!({"kind": "card", "gpu": gpu.name, "copy_bytes_per_s": bandwidth, "gemm_flops": flops})
        )
        .unwrap();
    }

    let formats = list("MOE_GPU_BENCH_FORMATS")
        .unwrap_or_else(|| ["bf16", "fp8", "int4"].map(String::from).to_vec());
    let max_tokens = *tokens.iter().max().unwrap();
    for format in &formats {
        let (storage, expert) = random_expert(format);
        let slot = storage.pack(&expert, HIDDEN, INTERMEDIATE).unwrap();
        for shape in &shapes {
            let expert_shape = ExpertShape {
                hidden: HIDDEN,
                intermediate: INTERMEDIATE,
                num_experts: shape.experts,
                max_rows: max_tokens * shape.top_k,
                host_io: true,
                storage,
                activation: Default::default(),
                biases: false,
            };
            // Kimi K2's router: sigmoid scores, one group, normalised, scaled.
            let gate = Gate {
                router: random_bf16(shape.experts * HIDDEN, 11, (HIDDEN as f32).powf(-0.5)),
                correction_bias: Some(vec![0.0; shape.experts]),
                gating: GatingConfig::SigmoidGrouped {
                    n_group: 1,
                    topk_group: 1,
                    normalize: true,
                    routed_scaling_factor: 2.827,
                },
                top_k: shape.top_k,
            };
            let started = Instant::now();
            let mut layer = GpuMoeLayer::new(&gpu, expert_shape, gate, max_tokens, 0.95, None)
                .unwrap_or_else(|e| panic!("{}: {e}", shape.name));
            layer.experts.fill_repeated(&slot).unwrap();
            layer
                .set_input(&random_bf16(max_tokens * HIDDEN, 9, 1.0))
                .unwrap();
            println!(
                "\n{} {}: {} experts, top-{}, {:.1} GB of experts ready in {:.1} s",
                shape.name,
                storage.describe(),
                shape.experts,
                shape.top_k,
                layer.experts.weight_bytes() as f64 / 1e9,
                started.elapsed().as_secs_f64()
            );
            println!(
                "{:>6} {:>10} {:>8} {:>9} {:>7} {:>9} {:>7} {:>10} {:>7} {:>8}",
                "tokens",
                "ms",
                "experts",
                "GB/s",
                "of copy",
                "TFLOP/s",
                "of GEMM",
                "GEMV ms",
                "of copy",
                "host ms"
            );
            // Rows as the router would hand them over: f32 in host memory.
            let host_rows: Vec<f32> = random_bf16(max_tokens * shape.top_k * HIDDEN, 13, 1.0)
                .into_iter()
                .map(f32::from)
                .collect();
            for &t in &tokens {
                layer.experts.gemv_rows = 0;
                let seconds = time(|| layer.forward(t).unwrap(), 1.5, 50);
                let active = layer.last_active_experts;
                let expert_bytes = expert_shape.slot_bytes();
                let bytes = active * expert_bytes + shape.experts * HIDDEN * 2;
                let flop = 2.0 * (t * shape.top_k) as f64 * (3 * HIDDEN * INTERMEDIATE) as f64
                    + 2.0 * (t * shape.experts * HIDDEN) as f64;
                let achieved_bw = bytes as f64 / seconds;
                let achieved_flops = flop / seconds;
                // The grouped GEMV kernel, where every expert got at most GEMV_MAX_ROWS rows.
                let gemv_seconds = (layer.last_max_rows <= GEMV_MAX_ROWS).then(|| {
                    layer.experts.gemv_rows = GEMV_MAX_ROWS;
                    let s = time(|| layer.forward(t).unwrap(), 1.5, 50);
                    layer.experts.gemv_rows = 0;
                    s
                });
                let (gemv_ms, gemv_share) = match gemv_seconds {
                    Some(s) => (
                        format!("{:.3}", s * 1e3),
                        format!("{:.0}%", 100.0 * bytes as f64 / s / bandwidth),
                    ),
                    None => ("-".into(), "-".into()),
                };
                // The same groups from host rows, as a device actor runs them.
                let ids = layer.routing(t).unwrap().ids;
                let mut counts = vec![0usize; shape.experts];
                for &e in &ids {
                    counts[e as usize] += 1;
                }
                let mut groups = Vec::new();
                let mut at = 0;
                for (e, &c) in counts.iter().enumerate() {
                    if c > 0 {
                        groups.push((e as u32, &host_rows[at * HIDDEN..(at + c) * HIDDEN]));
                        at += c;
                    }
                }
                let host_seconds = time(
                    || {
                        layer.experts.run(0, &groups).unwrap();
                    },
                    1.5,
                    50,
                );
                println!(
                    "{:>6} {:>10.3} {:>8} {:>9.0} {:>6.0}% {:>9.1} {:>6.0}% {:>10} {:>7} {:>8.3}",
                    t,
                    seconds * 1e3,
                    active,
                    achieved_bw / 1e9,
                    100.0 * achieved_bw / bandwidth,
                    achieved_flops / 1e12,
                    100.0 * achieved_flops / flops,
                    gemv_ms,
                    gemv_share,
                    host_seconds * 1e3
                );
                if let Some(f) = &mut out {
                    writeln!(
                        f,
                        "{}",
                        serde_json::json!({
                            "kind": "layer", "shape": shape.name, "format": format,
                            "experts": shape.experts,
                            "top_k": shape.top_k, "tokens": t, "seconds": seconds,
                            "active_experts": active, "bytes_per_s": achieved_bw,
                            "flops": achieved_flops, "gemv_seconds": gemv_seconds,
                            "host_rows_seconds": host_seconds,
                        })
                    )
                    .unwrap();
                }
            }
        }
    }
}
