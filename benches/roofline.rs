//! A small roofline of this machine's CPU against the engine's products (issue 17): the
//! measured peak of f32 fused multiply-adds on every core (register-resident, no memory
//! traffic), the measured read bandwidth, and beside them what the CPU kernels reach on the
//! shapes a Qwen3-MoE of hidden 1024 runs: the dense projections at prefill (256 rows), the
//! grouped expert products of a 256-token step (128 experts of 384, top-8: 16 rows each; in
//! bf16, FP8 and INT4), and the decode matrix-vector products (1 row), which read their
//! weights once and so are
//! measured against the bandwidth (eight heads in turn, more than a last-level cache holds).
//! Then decode steps through a Kimi K3-like layer's experts held in bf16, FP8 and INT4, one
//! row through 16 experts at a time, against the bandwidth and against bf16 (issue 16).
//! The products are measured against the peak of the widest fused multiply-adds the CPU has:
//! the few-row tiles and the `gemm` crate's packed kernels (its `x86-v4` feature) both use
//! AVX-512 where present. Each figure is the median of several repetitions.
//!
//! `cargo bench --bench roofline`; `MOE_ROOFLINE_REPS` (default 7), `MOE_ROOFLINE_EXPERT_ROWS`
//! (rows per expert group, default 16), `MOE_ROOFLINE_EXPERT_BYTES` (bytes of experts per
//! format in the decode lines, default 768 MiB; a few MiB leave them in cache),
//! `MOE_ROOFLINE_DECODE_ONLY=1` (the bandwidth and the decode steps through the experts only),
//! `MOE_ROOFLINE_DECODE_FORMATS` (of those steps, the formats to run: `bf16,fp8,int4`).

use std::time::Instant;

mod common;

use common::quantize::{quantize, to_bf16, to_fp8, to_int4};
use moe_node::compute::amx;
use moe_node::compute::cpu::{Linear, SwiGlu, matmul_transposed};
use moe_node::compute::cuda::experts::random_bf16;
use moe_node::experts::run_expert_groups;
use moe_node::model::ExpertWeights;
use rayon::prelude::*;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds of each of `reps` runs of `f`, after one warm-up run.
fn timed(reps: usize, mut f: impl FnMut()) -> Vec<f64> {
    f();
    (0..reps)
        .map(|_| {
            let started = Instant::now();
            f();
            started.elapsed().as_secs_f64()
        })
        .collect()
}

/// Multiply-adds per call of [`fma_block`] per thread.
const FMA_ITERS: usize = 1 << 22;
/// Independent accumulators: enough to cover the FMA latency on two ports.
const CHAINS: usize = 12;

/// A function `$name(seed) -> f32` running `FMA_ITERS` rounds of `CHAINS` independent
/// accumulators in registers, `*v = $step(*v)` each (with `$setup` in scope), compiled for
/// `$features`; `$sum(v)` reduces one accumulator at the end.
macro_rules! peak_block {
    ($(#[$doc:meta])* $name:ident, $features:literal, |$seed:ident| $init:expr,
     { $($setup:tt)* }, |$v:ident| $step:expr, |$r:ident| $sum:expr) => {
        $(#[$doc])*
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        fn $name($seed: f32) -> f32 {
            use std::arch::x86_64::*;
            $($setup)*
            let mut acc = [$init; CHAINS];
            for _ in 0..FMA_ITERS {
                for $v in acc.iter_mut() {
                    *$v = $step;
                }
            }
            acc.iter().map(|&$r| $sum).sum()
        }
    };
}

peak_block!(
    /// 8-wide AVX2 fused multiply-adds.
    fma_block_avx2, "avx2,fma", |seed| _mm256_set1_ps(seed),
    { let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7)); },
    |v| _mm256_fmadd_ps(*v, a, b),
    |r| {
        let mut lanes = [0.0f32; 8];
        // SAFETY: lanes holds 8 f32, the width of the store.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), r) };
        lanes.iter().sum::<f32>()
    }
);

peak_block!(
    /// 16-wide AVX-512 fused multiply-adds.
    fma_block_avx512, "avx512f", |seed| _mm512_set1_ps(seed),
    { let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7)); },
    |v| _mm512_fmadd_ps(*v, a, b),
    |r| _mm512_reduce_add_ps(r)
);

peak_block!(
    /// AVX512_BF16 dot products (`vdpbf16ps`: 16 lanes, each adding the products of two bf16
    /// pairs), the native bf16 instruction issue 17 asks about: a product of them would have
    /// to round its f32 inputs to bf16 (or split each into two bf16 halves to stay exact,
    /// twice the instructions), so it pays only where it runs at twice the FMA rate.
    dpbf16_block, "avx512f,avx512bf16", |seed| _mm512_set1_ps(seed),
    {
        let a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.999), _mm512_set1_ps(0.5));
        let b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-7), _mm512_set1_ps(1e-7));
    },
    |v| _mm512_dpbf16_ps(*v, a, b),
    |r| _mm512_reduce_add_ps(r)
);

/// Rounds of [`amx_block`] per call.
const AMX_ITERS: usize = 1 << 20;

/// AMX-BF16 tile products (`tdpbf16ps`, 16 x 16 sums of 32 bf16 products each) on four
/// independent sum tiles, register-resident. Counted as bf16 flops: an exact product of f32
/// inputs (`compute::amx`) issues three of them per weight tile.
fn amx_block(_seed: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        #[repr(C, align(64))]
        struct Config([u8; 16], [u16; 16], [u8; 16]);
        let mut config = Config([0; 16], [0; 16], [0; 16]);
        config.0[0] = 1;
        for t in 0..8 {
            (config.1[t], config.2[t]) = (64, 16);
        }
        let values = [0x3f80u16; 512];
        // SAFETY: only called where compute::amx is enabled (the CPU has AMX-BF16 and Linux
        // granted the tile state); the configuration is a valid palette 1; the loads read
        // 16 rows of 64 bytes from `values` (1 KiB).
        unsafe {
            use std::arch::asm;
            asm!("ldtilecfg [{0}]", in(reg) &config as *const Config);
            asm!("tileloadd tmm4, [{0} + {1}]", in(reg) values.as_ptr(), in(reg) 64usize);
            asm!("tileloadd tmm5, [{0} + {1}]", in(reg) values.as_ptr(), in(reg) 64usize);
            asm!("tileloadd tmm6, [{0} + {1}]", in(reg) values.as_ptr(), in(reg) 64usize);
            asm!("tileloadd tmm7, [{0} + {1}]", in(reg) values.as_ptr(), in(reg) 64usize);
            for _ in 0..AMX_ITERS {
                asm!(
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    options(nostack, nomem)
                );
            }
            asm!("tilerelease");
        }
    }
    0.0
}

/// The AMX block where this process runs AMX tiles.
fn amx_kernel() -> Option<FmaKernel> {
    moe_node::compute::amx::enabled().then_some((
        "AMX-BF16 tdpbf16ps, bf16 flops",
        (AMX_ITERS * 4 * 2 * 16 * 16 * 32) as f64,
        amx_block as fn(f32) -> f32,
    ))
}

/// The same with scalar fused multiply-adds, where AVX2 and FMA are absent.
fn fma_block_portable(seed: f32) -> f32 {
    let mut acc = [seed; CHAINS * 8];
    for _ in 0..FMA_ITERS {
        for v in acc.iter_mut() {
            *v = v.mul_add(0.999_999, 1e-7);
        }
    }
    acc.iter().sum()
}

/// A peak kernel: its name, flops per call per thread, and the register-resident block.
type FmaKernel = (&'static str, f64, fn(f32) -> f32);

/// (name, flops per call per thread, the block) for each width of fused multiply-adds the
/// CPU has: AVX2 with FMA, and AVX-512 (what the products use where the CPU has it); scalar
/// where neither.
fn fma_kernels() -> Vec<FmaKernel> {
    let flops = |lanes: usize| (2 * FMA_ITERS * CHAINS * lanes) as f64;
    let mut kernels: Vec<FmaKernel> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA, the features the function is compiled for.
            kernels.push(("AVX2 FMA, 8 lanes", flops(8), |s| unsafe {
                fma_block_avx2(s)
            }));
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, the feature the function is compiled for.
            kernels.push(("AVX-512 FMA, 16 lanes", flops(16), |s| unsafe {
                fma_block_avx512(s)
            }));
        }
    }
    if kernels.is_empty() {
        kernels.push(("scalar mul_add", flops(8), fma_block_portable));
    }
    kernels
}

/// The AVX512_BF16 block where the CPU has it (two multiply-adds per lane per instruction).
fn bf16_kernel() -> Option<FmaKernel> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bf16") {
        // SAFETY: the CPU has AVX512_BF16 (and so AVX-512F), the function's features.
        return Some((
            "AVX512_BF16 vdpbf16ps, 16 lanes x 2",
            (2 * FMA_ITERS * CHAINS * 32) as f64,
            |s| unsafe { dpbf16_block(s) },
        ));
    }
    None
}

/// `n` reproducible f32 values in `[-scale, scale)` (bf16 values, so that f32 and bf16
/// weights hold the same numbers).
fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    random_bf16(n, seed, scale)
        .iter()
        .map(|v| v.to_f32())
        .collect()
}

fn main() {
    let reps: usize = std::env::var("MOE_ROOFLINE_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let threads = rayon::current_num_threads();
    println!(
        "roofline: {threads} threads, {}",
        moe_node::compute::cpu::kernel_path()
    );

    // Bandwidth: a 1 GiB f32 matrix times one row through the engine's decode kernel, whose
    // one multiply-add per 4 bytes leaves it bound by reading (a plain sum written here
    // compiled for the baseline x86-64, SSE, and read 20-30% less).
    let (bw_rows, bw_k) = (1usize << 18, 1024);
    let buffer: Vec<f32> = (0..bw_rows * bw_k).map(|i| (i % 7) as f32).collect();
    let ones = vec![1.0f32; bw_k];
    let mut sums = vec![0.0f32; bw_rows];
    let bandwidth = median(
        timed(reps, || {
            matmul_transposed(&ones, 1, bw_k, &buffer, bw_rows, &mut sums, true)
        })
        .into_iter()
        .map(|s| (buffer.len() * 4) as f64 / s / 1e9)
        .collect(),
    );
    drop(buffer);
    println!("read bandwidth, all threads: {bandwidth:.1} GB/s");
    if std::env::var_os("MOE_ROOFLINE_DECODE_ONLY").is_some_and(|v| v == "1") {
        expert_decode(reps, bandwidth);
        return;
    }
    // Peak: every thread runs the register-resident block, for each width the CPU has.
    let kernels = fma_kernels();
    let widths = kernels.len();
    let peaks: Vec<(&str, f64)> = kernels
        .into_iter()
        .chain(bf16_kernel())
        .chain(amx_kernel())
        .map(|(name, flops_per_block, block)| {
            let peak = median(
                timed(reps, || {
                    let sum: f32 = (0..threads).into_par_iter().map(|t| block(t as f32)).sum();
                    std::hint::black_box(sum);
                })
                .into_iter()
                .map(|s| flops_per_block * threads as f64 / s / 1e9)
                .collect(),
            );
            println!("peak ({name}), all threads: {peak:.1} GFLOP/s");
            (name, peak)
        })
        .collect();
    // The packed GEMM (dense products) and the few-row tiles run the widest the CPU has.
    let (tile_name, tile_peak) = peaks[widths - 1];
    let peak = tile_peak;
    // Exact products on AMX issue three tile products (one per bf16 part of the inputs).
    let amx_peak = peaks
        .iter()
        .find(|(name, _)| name.starts_with("AMX"))
        .map(|(_, peak)| peak / 3.0);

    println!();
    println!(
        "{:<52} {:>10} {:>12} {:>10}",
        "product", "ms", "GFLOP/s", "of peak"
    );

    // Dense projections at prefill: q_proj [2048, 1024] over 256 rows, f32 and bf16 weights.
    let (m, n, k) = (256, 2048, 1024);
    let x = random(m * k, 1, 1.0);
    let w = random(n * k, 2, 0.05);
    let w_bf16 = random_bf16(n * k, 2, 0.05);
    let mut out = vec![0.0f32; m * n];
    let flops = (2 * m * n * k) as f64;
    // One product's line: time, rate, and the rate against `peak`.
    let product = |name: &str, seconds: Vec<f64>, flops: f64, peak: f64| {
        let s = median(seconds);
        let rate = flops / s / 1e9;
        println!(
            "{name:<52} {:>10.3} {rate:>12.1} {:>9.0}%",
            s * 1e3,
            rate / peak * 100.0
        );
    };
    product(
        "dense [2048 x 1024] f32 weights, 256 rows",
        timed(reps, || matmul_transposed(&x, m, k, &w, n, &mut out, true)),
        flops,
        peak,
    );
    let mut dense_bf16 = |name: &str, peak: f64| {
        product(
            name,
            timed(reps, || {
                matmul_transposed(&x, m, k, &w_bf16, n, &mut out, true)
            }),
            flops,
            peak,
        )
    };
    if let Some(amx_peak) = amx_peak {
        amx::set_aside(true);
        dense_bf16("dense [2048 x 1024] bf16 weights, 256 rows, no AMX", peak);
        amx::set_aside(false);
        dense_bf16("dense [2048 x 1024] bf16 weights, 256 rows, AMX", amx_peak);
    } else {
        dense_bf16("dense [2048 x 1024] bf16 weights, 256 rows", peak);
    }

    // The grouped expert products of a 256-token step: 128 experts of 384, 16 rows each.
    let rows: usize = std::env::var("MOE_ROOFLINE_EXPERT_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let (experts, inter, hidden) = (128, 384, 1024);
    let blocks = common::random_bf16_experts(experts, inter, hidden);
    let inputs: Vec<Vec<f32>> = (0..experts)
        .map(|e| random(rows * hidden, 1000 + e as u64, 1.0))
        .collect();
    // The same experts in FP8 ([128, 128] block scales), as DeepSeek-V3 and Kimi K2 ship.
    let fp8_blocks: Vec<ExpertWeights> = blocks
        .iter()
        .map(|b| ExpertWeights::Quantized(quantize(&b.widened(), to_fp8)))
        .collect();
    // And in INT4 (groups of 32), as Kimi K2 Thinking ships its experts.
    let int4_blocks: Vec<ExpertWeights> = blocks
        .iter()
        .map(|b| ExpertWeights::Quantized(quantize(&b.widened(), to_int4)))
        .collect();
    for (format, blocks) in [
        ("bf16", &blocks),
        ("fp8", &fp8_blocks),
        ("int4", &int4_blocks),
    ] {
        let groups: Vec<(&ExpertWeights, &[f32])> = blocks
            .iter()
            .zip(&inputs)
            .map(|(b, x)| (b, &x[..]))
            .collect();
        let grouped = |name: &str, peak: f64| {
            product(
                &format!("128 experts [3 x 384 x 1024] {format}, {rows} rows each{name}"),
                timed(reps, || {
                    std::hint::black_box(run_expert_groups(&groups, hidden, true));
                }),
                (2 * experts * rows * 3 * inter * hidden) as f64,
                peak,
            )
        };
        // Each weight meets `rows` inputs: 2 * rows flops per weight read, so that below a few
        // hundred rows the products are bound by reading the experts, not by the peak.
        let bytes: usize = blocks.iter().map(ExpertWeights::weight_bytes).sum();
        let roof =
            bandwidth * 1e9 * (2 * experts * rows * 3 * inter * hidden) as f64 / bytes as f64 / 1e9;
        println!(
            "grouped {format} experts read {} MiB of weights: at {rows} rows each, reading them at \
             the bandwidth bounds the products at {roof:.0} GFLOP/s",
            bytes >> 20
        );
        if let Some(amx_peak) = amx_peak {
            println!(
                "against the {tile_name} peak, and on AMX against a third of the AMX peak (three \
                 tile products per exact one):"
            );
            amx::set_aside(true);
            grouped(", no AMX", tile_peak);
            amx::set_aside(false);
            grouped(", AMX", amx_peak);
        } else {
            println!("against the {tile_name} peak:");
            grouped("", tile_peak);
        }
    }
    drop(fp8_blocks);
    drop(int4_blocks);

    // Decode: the output head [32000, 1024] times one row reads its weights once.
    println!();
    println!(
        "{:<52} {:>10} {:>12} {:>10}",
        "matrix-vector product (1 row)", "ms", "GB/s read", "of bw"
    );
    // Several heads, read one after the other, so that the weights come from memory and not
    // from a last-level cache that holds one head (260 MiB on some Xeons).
    let (n, k, heads) = (32000, 1024, 8);
    let w: Vec<Vec<f32>> = (0..heads).map(|h| random(n * k, 3 + h, 0.05)).collect();
    let x = random(k, 4, 1.0);
    let mut out = vec![0.0f32; n];
    let read = |name: &str, seconds: Vec<f64>, bytes: usize| {
        let s = median(seconds);
        let rate = bytes as f64 / s / 1e9;
        println!(
            "{name:<52} {:>10.3} {rate:>12.1} {:>9.0}%",
            s * 1e3 / heads as f64,
            rate / bandwidth * 100.0
        );
    };
    read(
        "lm head [32000 x 1024] f32 weights",
        timed(reps, || {
            for w in &w {
                matmul_transposed(&x, 1, k, w, n, &mut out, true);
            }
        }),
        heads as usize * n * k * 4,
    );
    drop(w);
    let w_bf16: Vec<Vec<_>> = (0..heads)
        .map(|h| random_bf16(n * k, 3 + h, 0.05))
        .collect();
    read(
        "lm head [32000 x 1024] bf16 weights",
        timed(reps, || {
            for w in &w_bf16 {
                matmul_transposed(&x, 1, k, w, n, &mut out, true);
            }
        }),
        heads as usize * n * k * 2,
    );
    drop(w_bf16);
    expert_decode(reps, bandwidth);
}

/// Decode steps through the experts of a Kimi K3-like layer (hidden 1024, expert
/// intermediate 256, top-16): one row through 16 experts at a time on the pool, as a 1-token
/// step runs them, with the experts held in bf16, FP8 e4m3 ([128, 128] block scales) and
/// INT4 (a scale per 32), each format filling 768 MiB so that every step reads its experts
/// from memory. Issue 16's goal: FP8 close to 2x bf16, INT4 close to 4x.
fn expert_decode(reps: usize, bandwidth: f64) {
    const HIDDEN: usize = 1024;
    const INTER: usize = 256;
    const TOP_K: usize = 16;
    let bytes: usize = std::env::var("MOE_ROOFLINE_EXPERT_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(768 << 20);
    println!();
    println!(
        "{:<52} {:>10} {:>12} {:>10} {:>8}",
        "decode step, 1 row through 16 experts", "ms", "GB/s read", "of bw", "vs bf16"
    );
    // A few distinct experts quantized as the published tools do, copied to fill the bytes.
    let distinct: Vec<SwiGlu> = (0..32u64)
        .map(|e| {
            let linear = |o: usize, i: usize, seed: u64| {
                Linear::without_bias(random(o * i, seed, 0.05), o, i)
            };
            SwiGlu {
                gate: linear(INTER, HIDDEN, 100 + 3 * e),
                up: linear(INTER, HIDDEN, 101 + 3 * e),
                down: linear(HIDDEN, INTER, 102 + 3 * e),
            }
        })
        .collect();
    type Hold = fn(&SwiGlu) -> ExpertWeights;
    let formats: [(&str, Hold); 3] = [
        ("bf16", |e| ExpertWeights::Bf16(to_bf16(e))),
        ("fp8", |e| ExpertWeights::Quantized(quantize(e, to_fp8))),
        ("int4", |e| ExpertWeights::Quantized(quantize(e, to_int4))),
    ];
    let x = random(TOP_K * HIDDEN, 5, 1.0);
    // `MOE_ROOFLINE_DECODE_FORMATS=int4` (a comma list) runs only those, e.g. under a profiler.
    let only = std::env::var("MOE_ROOFLINE_DECODE_FORMATS").ok();
    let sets: Vec<(&str, Vec<ExpertWeights>)> = formats
        .iter()
        .filter(|(name, _)| {
            only.as_ref()
                .is_none_or(|o| o.split(',').any(|f| f == *name))
        })
        .map(|(name, hold)| {
            let held: Vec<ExpertWeights> = distinct.iter().map(hold).collect();
            let count = bytes.div_ceil(held[0].weight_bytes()) / TOP_K * TOP_K;
            (*name, held.iter().cycle().take(count).cloned().collect())
        })
        .collect();
    // One pass over every format in turn per repetition, so that each sees the same noise
    // (on a shared machine, others' memory traffic comes and goes).
    let mut seconds = vec![Vec::new(); sets.len()];
    for _ in 0..=reps {
        for ((_, experts), times) in sets.iter().zip(&mut seconds) {
            let started = Instant::now();
            for step in experts.chunks_exact(TOP_K) {
                let groups: Vec<(&ExpertWeights, &[f32])> =
                    step.iter().zip(x.chunks_exact(HIDDEN)).collect();
                std::hint::black_box(run_expert_groups(&groups, HIDDEN, true));
            }
            times.push(started.elapsed().as_secs_f64() / (experts.len() / TOP_K) as f64);
        }
    }
    let steps: Vec<f64> = seconds
        .into_iter()
        .map(|mut times| {
            times.remove(0); // the warm-up pass
            median(times)
        })
        .collect();
    let bf16_step = sets
        .iter()
        .zip(&steps)
        .find(|((name, _), _)| *name == "bf16");
    for ((name, experts), &s) in sets.iter().zip(&steps) {
        let rate = (TOP_K * experts[0].weight_bytes()) as f64 / s / 1e9;
        let against = bf16_step.map_or_else(|| "-".into(), |(_, b)| format!("{:.2}x", b / s));
        println!(
            "{:<52} {:>10.3} {rate:>12.1} {:>9.0}% {against:>8}",
            format!("{} {name} experts [3 x {INTER} x {HIDDEN}]", experts.len()),
            s * 1e3,
            rate / bandwidth * 100.0
        );
    }
}
