//! The element-wise operations of a transformer block, and the products of one vector with
//! many that attention runs over its cache.

use super::decode::dot_rows;
use super::simd::{hsum16, lanes, madd};

/// `out[j] = x · rows[j * stride..][..x.len()]`: one vector against many, as attention
/// scores a query against every cached key. One call per query, not per key: the per-call
/// cost of a kernel chosen at run time is paid once.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn dot_strided(x: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let fused =
        multiversion::target::target_cfg_f!(any(target_feature = "fma", target_feature = "neon"));
    let k = x.len();
    let whole = k / 16 * 16;
    let tail = |row: &[f32]| (whole..k).map(|i| x[i] * row[i]).sum::<f32>();
    // Four rows at a time: four independent chains of multiply-adds, where one row's chain
    // waits on each step's latency. Each row's sum is made the same way in both loops (its
    // lanes, then the same tree), so a score does not depend on its neighbours.
    let grouped = out.len() / 4 * 4;
    for (j, o) in out[..grouped].chunks_exact_mut(4).enumerate() {
        let row = |t: usize| &rows[(4 * j + t) * stride..][..k];
        let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
        let (mut a0, mut a1, mut a2, mut a3) =
            ([0.0f32; 16], [0.0f32; 16], [0.0f32; 16], [0.0f32; 16]);
        let chunks = lanes(x, whole)
            .zip(lanes(r0, whole))
            .zip(lanes(r1, whole))
            .zip(lanes(r2, whole))
            .zip(lanes(r3, whole));
        for ((((xc, c0), c1), c2), c3) in chunks {
            for l in 0..16 {
                a0[l] = madd(fused, xc[l], c0[l], a0[l]);
                a1[l] = madd(fused, xc[l], c1[l], a1[l]);
                a2[l] = madd(fused, xc[l], c2[l], a2[l]);
                a3[l] = madd(fused, xc[l], c3[l], a3[l]);
            }
        }
        o[0] = hsum16(a0) + tail(r0);
        o[1] = hsum16(a1) + tail(r1);
        o[2] = hsum16(a2) + tail(r2);
        o[3] = hsum16(a3) + tail(r3);
    }
    for (j, o) in out.iter_mut().enumerate().skip(grouped) {
        let row = &rows[j * stride..][..k];
        let mut acc = [0.0f32; 16];
        for (xc, rc) in lanes(x, whole).zip(lanes(row, whole)) {
            for l in 0..16 {
                acc[l] = madd(fused, xc[l], rc[l], acc[l]);
            }
        }
        *o = hsum16(acc) + tail(row);
    }
}

/// `out[i] = Σ_j weights[j] · values[j * stride + i]`, summed in order of `j`: attention's
/// weighted sum of the cached values. The output is made 128 values at a time (eight AVX-512
/// registers), kept in registers across the rows instead of loaded and stored per row.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn weighted_rows(weights: &[f32], values: &[f32], stride: usize, out: &mut [f32]) {
    let fused =
        multiversion::target::target_cfg_f!(any(target_feature = "fma", target_feature = "neon"));
    const BLOCK: usize = 128;
    let whole = out.len() / BLOCK * BLOCK;
    for (c, o) in out[..whole].chunks_exact_mut(BLOCK).enumerate() {
        let mut acc = [0.0f32; BLOCK];
        for (j, &w) in weights.iter().enumerate() {
            let v: &[f32; BLOCK] = values[j * stride + c * BLOCK..][..BLOCK]
                .try_into()
                .expect("a block");
            for l in 0..BLOCK {
                acc[l] = madd(fused, w, v[l], acc[l]);
            }
        }
        o.copy_from_slice(&acc);
    }
    let rest = &mut out[whole..];
    rest.fill(0.0);
    for (j, &w) in weights.iter().enumerate() {
        let v = &values[j * stride + whole..][..rest.len()];
        for (o, &v) in rest.iter_mut().zip(v) {
            *o = madd(fused, w, v, *o);
        }
    }
}

/// Dot product of two equal-length slices (0 for empty ones).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    if a.is_empty() {
        // The row kernel steps through rows of `a.len()` values: none to step through.
        return 0.0;
    }
    let mut out = [0.0];
    dot_rows(a, a.len(), b, &mut out);
    out[0]
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// RMSNorm of each `weight.len()`-wide row of `x`, in place: `x / sqrt(mean(x²) + eps) * w`.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(weight.len()) {
        let mean_square = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
        let scale = 1.0 / (mean_square + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

/// RMSNorm into a new buffer.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm_in_place(&mut out, weight, eps);
    out
}

/// `acc[i] += x[i]`.
pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// Softmax of `x` in place, numerically stable.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}
