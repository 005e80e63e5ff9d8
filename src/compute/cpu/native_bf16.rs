//! Products with bf16 weights in the CPU's native bf16 arithmetic (`devices.cpu_precision =
//! "bf16"`): the inputs rounded to bf16 (to nearest even, as torch's `.to(torch.bfloat16)`),
//! each pair of bf16 products summed into f32 lanes by AVX512_BF16's `vdpbf16ps`, as
//! llama.cpp's BF16 path and vLLM's CPU backend multiply. Where that instruction runs at the
//! FMA rate (AMD Zen 4 and 5) it does twice the multiply-adds of an f32 FMA per instruction,
//! and the weights are read as they are stored; the price is the inputs' rounding, which the
//! exact products (`"exact"`, the default: bf16 weights widened, f32 products) do not pay.
//!
//! The kernel: register tiles of up to 4 input rows by 4 weight rows, 16 f32 accumulators
//! of 16 lanes each, over `k` in steps of 32 (one `vdpbf16ps` per row pair and step); the
//! inputs' rows are converted once and padded with zeros to whole steps, the weights' last
//! step is read with a mask. Output neurons are spread over the rayon pool in blocks.
//!
//! Every product with bf16 weights takes rounded inputs under `"bf16"`, so a row's result
//! does not depend on the rows batched with it: products of one row (below [`MIN_ROWS`]:
//! bound by reading the weights either way) and every product on a CPU without
//! AVX512_BF16 multiply the rounded inputs with the exact kernels (the same products, summed
//! in another order).

use std::sync::atomic::{AtomicU8, Ordering};

use half::bf16;

/// Which arithmetic CPU products with bf16 weights use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// bf16 weights widened to f32, f32 inputs and products: equal to transformers' f32
    /// reference.
    Exact,
    /// Inputs rounded to bf16, products in the CPU's native bf16 instructions where it has
    /// them (elsewhere the rounded inputs are multiplied in f32: the same products).
    Bf16,
}

static PRECISION: AtomicU8 = AtomicU8::new(0);

/// Sets the precision of the products that follow (the node's `devices.cpu_precision`).
pub fn set_precision(precision: Precision) {
    PRECISION.store(precision as u8, Ordering::Relaxed);
}

/// The precision asked for.
pub fn precision() -> Precision {
    match PRECISION.load(Ordering::Relaxed) {
        0 => Precision::Exact,
        _ => Precision::Bf16,
    }
}

/// Whether this CPU has the instructions of the native bf16 products (AVX512_BF16, with
/// AVX512BW's masked loads).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether products with bf16 weights take bf16-rounded inputs now (natively where the CPU
/// has the instructions, else multiplied exactly: the same products, no faster).
pub(crate) fn in_use() -> bool {
    precision() == Precision::Bf16
}

/// What products with bf16 weights run in, as `moe-node devices` says it.
pub fn describe() -> String {
    describe_for(precision(), available())
}

fn describe_for(precision: Precision, available: bool) -> String {
    match (precision, available) {
        (Precision::Exact, true) => "exact: bf16 weights widened to f32, f32 products \
            (devices.cpu_precision = \"bf16\" would use AVX512_BF16)"
            .to_string(),
        (Precision::Exact, false) => "exact: bf16 weights widened to f32, f32 products".to_string(),
        (Precision::Bf16, true) => "bf16: inputs rounded to bf16, AVX512_BF16 vdpbf16ps \
            products summed in f32"
            .to_string(),
        (Precision::Bf16, false) => "bf16: inputs rounded to bf16, but this CPU has no \
            AVX512_BF16: the rounded inputs multiplied in f32, no faster than exact"
            .to_string(),
    }
}

/// Input rows from which products take the native bf16 instructions. One row is bound by
/// reading the weights, which the exact kernels do as fast (`benches/cpu_precision.rs`:
/// one row through 8 experts 0.93x, a [2048 x 1024] product 1.15x; from 2 rows the native
/// products win, 1.38x at 2 and 2.6x at 4), so it multiplies the rounded inputs exactly
/// (the same products, summed in another order).
pub(crate) const MIN_ROWS: usize = 2;

/// `x` rounded to bf16 (to nearest even), as f32.
pub(crate) fn rounded(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

/// Rows of `x` as bf16, each padded with zeros to `padded` values.
fn round_rows(x: &[f32], m: usize, k: usize, padded: usize) -> Vec<u16> {
    let mut out = vec![0u16; m * padded];
    for (row, dst) in x.chunks_exact(k).zip(out.chunks_exact_mut(padded)) {
        for (d, v) in dst.iter_mut().zip(row) {
            *d = bf16::from_f32(*v).to_bits();
        }
    }
    out
}

/// Output neurons one parallel task takes.
const NEURONS_PER_TASK: usize = 32;

/// `out [m, n] = bf16(x) [m, k] · w [n, k]ᵀ` with f32 sums; false, having done nothing, where
/// the CPU lacks the instructions. `parallel` spreads the output neurons over the rayon pool.
pub(crate) fn matmul_transposed(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[bf16],
    n: usize,
    out: &mut [f32],
    parallel: bool,
) -> bool {
    if !available() {
        return false;
    }
    assert_eq!(x.len(), m * k, "lhs size");
    assert_eq!(w.len(), n * k, "rhs size");
    assert_eq!(out.len(), m * n, "output size");
    #[cfg(target_arch = "x86_64")]
    {
        use rayon::prelude::*;

        use super::parallel::{PARALLEL_MIN_FLOPS, SharedOut};

        let padded = k.next_multiple_of(avx512::STEP);
        let rows = round_rows(x, m, k, padded);
        let out_at = SharedOut::new(out);
        let run = |first: usize| {
            let count = NEURONS_PER_TASK.min(n - first);
            // SAFETY: the CPU has the features (`available`); this task alone writes the
            // columns first..first + count of every row, inside `out` (its size asserted).
            unsafe {
                avx512::columns(&rows, m, padded, w, k, first, count, out_at.get(), n);
            }
        };
        let tasks = (0..n).step_by(NEURONS_PER_TASK);
        if parallel && m * n * k >= PARALLEL_MIN_FLOPS && n > NEURONS_PER_TASK {
            tasks.collect::<Vec<_>>().into_par_iter().for_each(run);
        } else {
            tasks.for_each(run);
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x, m, k, w, n, out, parallel);
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use half::bf16;

    /// 32 bf16 values as `vdpbf16ps` takes them (the same 512 bits).
    #[inline(always)]
    fn as_bh(v: __m512i) -> __m512bh {
        // SAFETY: both are 512 bits of plain data, every bit pattern valid.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// Values of `k` one `vdpbf16ps` takes per row.
    pub(super) const STEP: usize = 32;

    /// Output columns `first..first + count` of every row: `out[r * stride + j] = rows[r] ·
    /// w[j]`, in tiles of up to 4 rows by 4 weight rows.
    ///
    /// # Safety
    /// The CPU has AVX512F, AVX512BW and AVX512_BF16; `rows` holds `m` rows of `padded`
    /// (a multiple of [`STEP`], at least `k`) values, `w` at least `first + count` rows of
    /// `k`, and `out` at least `m` rows of `stride` values with `first + count <= stride`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn columns(
        rows: &[u16],
        m: usize,
        padded: usize,
        w: &[bf16],
        k: usize,
        first: usize,
        count: usize,
        out: *mut f32,
        stride: usize,
    ) {
        // SAFETY: every pointer stays inside the rows, weights and output the caller
        // promised, for rows r..r + tall and columns j..j + wide of each tile.
        unsafe {
            let w = w.as_ptr() as *const u16;
            let mut j = first;
            while j < first + count {
                let wide = (first + count - j).min(4);
                let mut r = 0;
                while r < m {
                    let tall = (m - r).min(4);
                    let x = rows.as_ptr().add(r * padded);
                    let o = out.add(r * stride + j);
                    let wj = w.add(j * k);
                    match (tall, wide) {
                        (4, 4) => tile::<4, 4>(x, padded, wj, k, o, stride),
                        (3, 4) => tile::<3, 4>(x, padded, wj, k, o, stride),
                        (2, 4) => tile::<2, 4>(x, padded, wj, k, o, stride),
                        (1, 4) => tile::<1, 4>(x, padded, wj, k, o, stride),
                        (4, _) => tile::<4, 1>(x, padded, wj, k, o, stride),
                        (3, _) => tile::<3, 1>(x, padded, wj, k, o, stride),
                        (2, _) => tile::<2, 1>(x, padded, wj, k, o, stride),
                        _ => tile::<1, 1>(x, padded, wj, k, o, stride),
                    }
                    r += tall;
                }
                j += if wide == 4 { 4 } else { 1 };
            }
        }
    }

    /// One register tile: `R` input rows (`padded` apart) by `N` weight rows (`k` apart),
    /// each sum reduced into `out[r * stride + c]`.
    ///
    /// # Safety
    /// The CPU has the features; `x` has `R` rows of `padded` values (a multiple of
    /// [`STEP`], at least `k`), `w` `N` rows of `k`, `out` `R` rows of `stride` from it.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile<const R: usize, const N: usize>(
        x: *const u16,
        padded: usize,
        w: *const u16,
        k: usize,
        out: *mut f32,
        stride: usize,
    ) {
        // SAFETY: the pointers cover R rows of `padded` inputs and N rows of `k` weights,
        // and R rows of the output from `out` (`stride` apart), as the caller promised.
        unsafe {
            let mut sums = [[_mm512_setzero_ps(); N]; R];
            let whole = k / STEP * STEP;
            let mut at = 0;
            while at < whole {
                let mut weights = [_mm512_setzero_si512(); N];
                for (c, v) in weights.iter_mut().enumerate() {
                    *v = _mm512_loadu_si512(w.add(c * k + at) as *const _);
                }
                for (r, row) in sums.iter_mut().enumerate() {
                    let input: __m512bh =
                        std::mem::transmute(_mm512_loadu_si512(x.add(r * padded + at) as *const _));
                    for (sum, weight) in row.iter_mut().zip(&weights) {
                        *sum = _mm512_dpbf16_ps(*sum, input, as_bh(*weight));
                    }
                }
                at += STEP;
            }
            if whole < k {
                // The last step's weights, masked to the row's end (the inputs are zero there).
                let mask: __mmask32 = (1u64 << (k - whole)) as u32 - 1;
                let mut weights = [_mm512_setzero_si512(); N];
                for (c, v) in weights.iter_mut().enumerate() {
                    *v = _mm512_maskz_loadu_epi16(mask, w.add(c * k + whole) as *const i16);
                }
                for (r, row) in sums.iter_mut().enumerate() {
                    let input = as_bh(_mm512_loadu_si512(x.add(r * padded + whole) as *const _));
                    for (sum, weight) in row.iter_mut().zip(&weights) {
                        *sum = _mm512_dpbf16_ps(*sum, input, as_bh(*weight));
                    }
                }
            }
            for (r, row) in sums.iter().enumerate() {
                for (c, sum) in row.iter().enumerate() {
                    *out.add(r * stride + c) = _mm512_reduce_add_ps(*sum);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The product of the bf16-rounded inputs with the weights, in f64 (exact but for the
    /// final rounding), and the sum of its terms' magnitudes.
    fn reference(x: &[f32], m: usize, k: usize, w: &[bf16], n: usize) -> Vec<(f64, f64)> {
        let mut out = vec![(0.0, 0.0); m * n];
        for r in 0..m {
            for j in 0..n {
                out[r * n + j] = (0..k)
                    .map(|i| {
                        f64::from(bf16::from_f32(x[r * k + i]).to_f32())
                            * f64::from(w[j * k + i].to_f32())
                    })
                    .fold((0.0, 0.0), |(sum, size), t| (sum + t, size + t.abs()));
            }
        }
        out
    }

    /// Each output is the product of the inputs rounded to bf16 with the weights, to within
    /// f32 summation (so not the product of the unrounded inputs: that differs by far more),
    /// for every tile shape, `k` not a multiple of 32, and one row or many, on one thread or
    /// the pool.
    #[test]
    fn products_are_those_of_the_inputs_rounded_to_bf16() {
        if !available() {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: this CPU has no AVX512_BF16 (the native bf16 products)"
            );
            return;
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for (m, k, n) in [
            (1, 64, 4),
            (3, 50, 7),
            (4, 1024, 64),
            (9, 97, 33),
            (17, 300, 70),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
            let w: Vec<bf16> = (0..n * k)
                .map(|_| bf16::from_f32(rng.random_range(-1.0..1.0)))
                .collect();
            let expected = reference(&x, m, k, &w, n);
            for parallel in [false, true] {
                let mut out = vec![f32::NAN; m * n];
                assert!(matmul_transposed(&x, m, k, &w, n, &mut out, parallel));
                for (i, (&got, &(want, size))) in out.iter().zip(&expected).enumerate() {
                    // Every product is exact in f32; the f32 sums' error is within k
                    // roundings of the terms' magnitudes.
                    let bound = k as f64 * f64::from(f32::EPSILON) * size;
                    assert!(
                        (f64::from(got) - want).abs() <= bound,
                        "m {m} k {k} n {n} output {i}: {got} against {want}"
                    );
                }
            }
            // The unrounded inputs' product is not what came out: the rounding is real.
            let mut out = vec![0.0; m * n];
            matmul_transposed(&x, m, k, &w, n, &mut out, false);
            let exact: f64 = (0..m * n)
                .map(|o| {
                    let (r, j) = (o / n, o % n);
                    let e: f64 = (0..k)
                        .map(|i| f64::from(x[r * k + i]) * f64::from(w[j * k + i].to_f32()))
                        .sum();
                    (e - f64::from(out[o])).abs()
                })
                .fold(0.0, f64::max);
            assert!(exact > 1e-4, "m {m} k {k} n {n}: {exact}");
        }
    }

    #[test]
    fn the_description_says_what_runs() {
        assert!(describe_for(Precision::Bf16, true).starts_with("bf16: inputs rounded"));
        assert!(describe_for(Precision::Bf16, false).contains("no AVX512_BF16"));
        assert!(describe_for(Precision::Bf16, false).starts_with("bf16"));
        assert!(describe_for(Precision::Exact, true).starts_with("exact"));
        assert!(describe_for(Precision::Exact, false).starts_with("exact"));
    }
}
