//! Experts held as checkpoints store them, for the benchmarks that compare formats
//! (`moe_layer`, `roofline`, `moe_layer_gpu`) and the GPU kernels' tests: bf16, FP8 e4m3 in
//! [128, 128] blocks, INT4 in groups of 32 (other blocks and groups for the tests) and MXFP4,
//! quantized from f32 weights as the published tools do.

use half::bf16;
use moe_node::compute::cpu::{Linear, SwiGlu};
use moe_node::compute::quant::{E2M1, QuantLinear, QuantSwiGlu, e4m3_to_f32, e8m0_to_f32};

pub fn quantize(block: &SwiGlu, format: impl Fn(&Linear) -> QuantLinear) -> QuantSwiGlu {
    QuantSwiGlu {
        gate: format(&block.gate),
        up: format(&block.up),
        down: format(&block.down),
        activation: Default::default(),
    }
}

/// Block-scaled e4m3 in [128, 128] blocks (amax / 448), as published FP8 checkpoints are.
pub fn to_fp8(l: &Linear) -> QuantLinear {
    to_fp8_blocks(l, [128, 128])
}

/// Block-scaled e4m3 in `[rows, cols]` blocks (amax / 448).
pub fn to_fp8_blocks(l: &Linear, [block_rows, block_cols]: [usize; 2]) -> QuantLinear {
    // Every non-negative finite e4m3 value, ascending, to round to the nearest.
    let table: Vec<(f32, u8)> = (0u8..0x7f).map(|b| (e4m3_to_f32(b), b)).collect();
    let encode = |v: f32| -> u8 {
        let at = table
            .partition_point(|(t, _)| *t < v.abs())
            .min(table.len() - 1);
        let below = at.saturating_sub(1);
        let nearest = if (table[at].0 - v.abs()).abs() < (v.abs() - table[below].0).abs() {
            at
        } else {
            below
        };
        table[nearest].1 | if v < 0.0 { 0x80 } else { 0 }
    };
    let (n, k) = (l.out_features, l.in_features);
    let blocks_per_row = k.div_ceil(block_cols);
    let block = |r: usize, c: usize| r / block_rows * blocks_per_row + c / block_cols;
    let mut scales = vec![0.0f32; n.div_ceil(block_rows) * blocks_per_row];
    for r in 0..n {
        for c in 0..k {
            let s = &mut scales[block(r, c)];
            *s = s.max(l.weight[r * k + c].abs() / 448.0);
        }
    }
    let weights = (0..n * k)
        .map(|i| {
            let s = scales[block(i / k, i % k)];
            encode(if s > 0.0 { l.weight[i] / s } else { 0.0 })
        })
        .collect();
    QuantLinear::fp8(weights, scales, n, k, [block_rows, block_cols]).expect("shapes match")
}

/// Symmetric 4-bit in groups of 32 (amax / 7.5, as compressed-tensors computes it).
pub fn to_int4(l: &Linear) -> QuantLinear {
    to_int4_groups(l, 32)
}

/// Symmetric 4-bit in groups of `group` (amax / 7.5), scales in bf16.
pub fn to_int4_groups(l: &Linear, group: usize) -> QuantLinear {
    let (n, k) = (l.out_features, l.in_features);
    let groups = k.div_ceil(group);
    let mut scales = vec![0.0f32; n * groups];
    let mut packed = vec![0u32; n * k.div_ceil(8)];
    for r in 0..n {
        let row = &l.weight[r * k..(r + 1) * k];
        for (g, chunk) in row.chunks(group).enumerate() {
            let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
            // In bf16, as compressed-tensors writes them for a bf16 model (held in bf16).
            scales[r * groups + g] =
                bf16::from_f32(if amax > 0.0 { amax / 7.5 } else { 1.0 }).to_f32();
        }
        for (c, v) in row.iter().enumerate() {
            let q = (v / scales[r * groups + c / group])
                .round()
                .clamp(-8.0, 7.0) as i32;
            packed[r * k.div_ceil(8) + c / 8] |= ((q + 8) as u32) << (4 * (c % 8));
        }
    }
    QuantLinear::int4(packed, scales, n, k, group).expect("shapes match")
}

/// MXFP4 as gpt-oss publishes it: e2m1 values with a power-of-two (E8M0) scale per 32 of a
/// row, the scale the smallest that puts the block's largest magnitude within 6, each value
/// rounded to the nearest e2m1 (`in_features` a multiple of 32).
pub fn to_mxfp4(l: &Linear) -> QuantLinear {
    let (n, k) = (l.out_features, l.in_features);
    let magnitudes = &E2M1[..8];
    let mut blocks = vec![0u8; n * k / 2];
    let mut scales = Vec::with_capacity(n * k / 32);
    for (b, chunk) in l.weight.chunks_exact(32).enumerate() {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let exponent = if amax > 0.0 {
            (amax / 6.0).log2().ceil().clamp(-127.0, 127.0) as i32
        } else {
            0
        };
        scales.push((exponent + 127) as u8);
        let scale = e8m0_to_f32((exponent + 127) as u8);
        for (j, v) in chunk.iter().enumerate() {
            let m = (v.abs() / scale).min(6.0);
            let nearest = (0..8)
                .min_by(|&a, &b| {
                    (magnitudes[a] - m)
                        .abs()
                        .total_cmp(&(magnitudes[b] - m).abs())
                })
                .unwrap() as u8;
            let code = nearest | if *v < 0.0 { 8 } else { 0 };
            blocks[(b * 32 + j) / 2] |= code << (4 * (j % 2));
        }
    }
    QuantLinear::mxfp4(blocks, scales, n, k).expect("shapes match")
}

pub fn to_bf16(block: &SwiGlu) -> SwiGlu<bf16> {
    let narrow = |l: &Linear| {
        Linear::without_bias(
            l.weight.iter().map(|&w| bf16::from_f32(w)).collect(),
            l.out_features,
            l.in_features,
        )
    };
    SwiGlu {
        gate: narrow(&block.gate),
        up: narrow(&block.up),
        down: narrow(&block.down),
    }
}
