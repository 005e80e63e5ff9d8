//! Products of a few input rows that read each weight row once: the decode kernels (AVX-512,
//! AVX2) that decode bf16 and FP8 weights in registers, the portable row kernel, and the
//! frame that spreads a few-row product's output columns over the pool.

use rayon::prelude::*;

use super::element::{Stored, WeightElement};
use super::parallel::PARALLEL_MIN_FLOPS;
use super::simd::{hsum16, lanes, madd, prefetch_ahead};

/// Up to this many rows, products stream the weights once and reuse each weight row for
/// every input row from L1 ([`matmul_few_rows`]); above it the packed GEMM wins.
pub(crate) const FEW_ROWS: usize = 8;

/// Output columns per parallel task in [`matmul_few_rows`].
pub(super) const COLUMNS_PER_TASK: usize = 32;

/// `out_t[c * m + r] = x[r] · w[c]` for the few input rows the explicit kernel the CPU runs
/// takes ([`DecodeKernel::max_rows`]: decode), where the weights are f32, bf16 or FP8; false,
/// having done nothing, where not.
pub(super) fn dot_few_rows<W: WeightElement>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    out_t: &mut [f32],
) -> bool {
    let Some(kernel) = DecodeKernel::detect() else {
        return false;
    };
    if W::STORED == Stored::Other || !(1..=kernel.max_rows()).contains(&m) {
        return false;
    }
    kernel.run(x, m, k, w, out_t);
    true
}

/// The explicit decode kernels (one to three input rows) this CPU can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DecodeKernel {
    /// [`rows_avx512`]: AVX-512 F, BW and VL.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// [`rows_avx2`]: AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl DecodeKernel {
    /// Every decode kernel the CPU can run (an AVX-512 CPU runs the AVX2 one too), for tests.
    #[cfg(test)]
    pub(crate) fn all() -> Vec<DecodeKernel> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if decode_kernel_available() {
                kernels.push(DecodeKernel::Avx512);
            }
            if avx2_decode_available() {
                kernels.push(DecodeKernel::Avx2);
            }
        }
        if kernels.is_empty() {
            crate::compute::skipped(
                "this CPU has no explicit decode kernel (x86-64 AVX2 or AVX-512)",
            );
        }
        kernels
    }

    pub(super) fn detect() -> Option<DecodeKernel> {
        #[cfg(target_arch = "x86_64")]
        {
            if decode_kernel_available() {
                return Some(DecodeKernel::Avx512);
            }
            if avx2_decode_available() {
                return Some(DecodeKernel::Avx2);
            }
        }
        None
    }

    /// As `moe-node devices` names it.
    pub(super) fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx512 => "AVX-512, four weight rows a pass",
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx2 => "AVX2, three weight rows a pass (two from four input rows)",
        }
    }

    /// The most input rows the kernel takes: three on AVX-512 (more go to the tiles), up to
    /// [`FEW_ROWS`] on AVX2, which decodes each pass's weights in registers for every group
    /// of input rows rather than widening them into a buffer for [`dot_tiles`].
    pub(super) fn max_rows(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx512 => 3,
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx2 => FEW_ROWS,
        }
    }

    /// `out_t[c * m + r] = x[r] · w[c]` for `m` of 1 to [`DecodeKernel::max_rows`] and
    /// weights of a [`Stored`] form other than `Other`.
    pub(crate) fn run<W: WeightElement>(
        self,
        x: &[f32],
        m: usize,
        k: usize,
        w: &[W],
        out_t: &mut [f32],
    ) {
        assert!(
            (1..=self.max_rows()).contains(&m) && W::STORED != Stored::Other,
            "a decode product"
        );
        let n = out_t.len() / m;
        assert!(
            x.len() >= m * k && w.len() >= n * k,
            "few-row product sizes"
        );
        // SAFETY: detect() or all() saw the kernel's features; the asserts bound the rows it
        // reads, and it writes only `out_t`.
        match self {
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx512 => match m {
                1 => unsafe { rows_avx512::<W, 1>(x, k, w, out_t) },
                2 => unsafe { rows_avx512::<W, 2>(x, k, w, out_t) },
                _ => unsafe { rows_avx512::<W, 3>(x, k, w, out_t) },
            },
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx2 => match m {
                1 => unsafe { rows_avx2::<W, 3, 1>(x, m, k, w, out_t) },
                2 => unsafe { rows_avx2::<W, 3, 2>(x, m, k, w, out_t) },
                3 => unsafe { rows_avx2::<W, 3, 3>(x, m, k, w, out_t) },
                _ => unsafe { rows_avx2::<W, 2, 4>(x, m, k, w, out_t) },
            },
        }
    }
}

/// What the decode kernels settle before their passes.
struct DecodePlan {
    /// The factor of the vector sums: the half-precision route reads an e4m3 value times
    /// 2^-8 (f16's exponent bias is 8 more than e4m3's), so FP8 sums are scaled back, exactly.
    scale: f32,
    /// Elements ahead to prefetch: the same place in the rows of a pass at least 4 KiB on.
    ahead: usize,
    /// Chunks per cache line (a chunk of narrow weights is less than a line): one prefetch
    /// each.
    line_chunks: usize,
}

impl DecodePlan {
    fn new<W: WeightElement>(columns: usize, k: usize, lanes: usize) -> Self {
        let size = std::mem::size_of::<W>();
        DecodePlan {
            scale: if W::STORED == Stored::E4m3 {
                256.0
            } else {
                1.0
            },
            ahead: columns * k * (4096usize).div_ceil(columns * k * size),
            line_chunks: (64 / (lanes * size)).max(1),
        }
    }

    /// The weight rows of the pass from row `first` (of `n`, `k` apart): the last pass
    /// repeats the last row where fewer than `C` are left.
    fn rows<W, const C: usize>(
        &self,
        w: *const W,
        first: usize,
        n: usize,
        k: usize,
    ) -> [*const W; C] {
        std::array::from_fn(|c| w.wrapping_add((first + c).min(n - 1) * k))
    }
}

/// Whether the CPU runs [`rows_avx2`].
#[cfg(target_arch = "x86_64")]
fn avx2_decode_available() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// [`DecodeKernel::Avx2`]: [`rows_avx512`] with 8 lanes and `COLUMNS` weight rows a pass, for
/// one to [`FEW_ROWS`] input rows in groups of `R` (`COLUMNS` x `R` accumulators of the 16
/// registers): each pass's weight rows (in L1 after the first group) are decoded in registers
/// for every group; the last group repeats the last input row where fewer than `R` are left
/// (its outputs not written). The last partial chunk of each row is summed in scalars.
///
/// Three weight rows a pass for one to three input rows, two for four to eight in groups of
/// four: fewer groups decode each pass's weights fewer times (8 rows: 2 groups, against 3 of
/// three), and one weight row a pass with all eight inputs (decoded once) was no faster, its
/// eight input rows (32 KiB at k = 1024) no longer held in L1 beside the weights.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `x` holds `m` rows of `k` and `w` the `out_t.len() / m`
/// rows of `k`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2<W: WeightElement, const COLUMNS: usize, const R: usize>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    out_t: &mut [f32],
) {
    use std::arch::x86_64::*;
    let n = out_t.len() / m;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let plan = DecodePlan::new::<W>(COLUMNS, k, 8);
    // Eight weights from `$p` (see rows_avx512 for the FP8 route).
    macro_rules! load_w {
        ($p:expr) => {
            match W::STORED {
                Stored::F32 => _mm256_loadu_ps($p.cast::<f32>()),
                Stored::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128($p.cast())),
                )),
                _ => _mm256_cvtph_ps(_mm_and_si128(
                    _mm_slli_epi16::<7>(_mm_cvtepi8_epi16(_mm_loadl_epi64($p.cast()))),
                    _mm_set1_epi16(0xbf80u16 as i16),
                )),
            }
        };
    }
    let whole = k / 8 * 8;
    for first in (0..n).step_by(COLUMNS) {
        let rows: [*const W; COLUMNS] = plan.rows(wp, first, n, k);
        for r0 in (0..m).step_by(R) {
            let inputs: [*const f32; R] =
                std::array::from_fn(|r| xp.wrapping_add((r0 + r).min(m - 1) * k));
            let mut acc = [[_mm256_setzero_ps(); R]; COLUMNS];
            for at in (0..whole).step_by(8) {
                if r0 == 0 && (at / 8).is_multiple_of(plan.line_chunks) {
                    for row in rows {
                        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(plan.ahead + at).cast::<i8>());
                    }
                }
                // SAFETY: every row holds `k` values (the caller's contract) and the chunk at
                // `at` ends at or before `whole <= k`.
                let wv: [__m256; COLUMNS] =
                    std::array::from_fn(|c| unsafe { load_w!(rows[c].add(at)) });
                // SAFETY: as above, for the input rows.
                let xv: [__m256; R] =
                    std::array::from_fn(|r| unsafe { _mm256_loadu_ps(inputs[r].add(at)) });
                for (acc, wv) in acc.iter_mut().zip(wv) {
                    for (acc, xv) in acc.iter_mut().zip(xv) {
                        *acc = _mm256_fmadd_ps(xv, wv, *acc);
                    }
                }
            }
            for (c, acc) in acc.iter().enumerate().take(n - first) {
                for (r, acc) in acc.iter().enumerate().take(m - r0) {
                    let half = _mm_add_ps(
                        _mm256_castps256_ps128(*acc),
                        _mm256_extractf128_ps::<1>(*acc),
                    );
                    let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
                    let sum = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
                    let tail: f32 = (whole..k)
                        .map(|i| x[(r0 + r) * k + i] * w[(first + c) * k + i].to_f32())
                        .sum();
                    out_t[(first + c) * m + r0 + r] = sum * plan.scale + tail;
                }
            }
        }
    }
}

/// Whether the CPU runs [`rows_avx512`].
pub(crate) fn decode_kernel_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`dot_few_rows`] for `R` input rows: four weight rows per pass, each decoded from its
/// stored form in registers as it is loaded (bf16 by a shift; FP8 through the half-precision
/// conversion, which takes e4m3's subnormals without the slow path that f32 subnormals take)
/// and used for every input row, in 4 x `R` independent accumulators. The pass's weight rows
/// are read as four streams, with the next pass's prefetched.
///
/// # Safety
/// The CPU has AVX-512F, BW and VL; `x` holds `R` rows of `k` and `w` the `out_t.len() / R`
/// rows of `k`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn rows_avx512<W: WeightElement, const R: usize>(
    x: &[f32],
    k: usize,
    w: &[W],
    out_t: &mut [f32],
) {
    use std::arch::x86_64::*;
    const COLUMNS: usize = 4;
    let n = out_t.len() / R;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let plan = DecodePlan::new::<W>(COLUMNS, k, 16);
    // Sixteen weights from `$p`, the lanes outside `$mask` zero.
    macro_rules! load_w {
        ($p:expr, $mask:expr) => {
            match W::STORED {
                Stored::F32 => _mm512_maskz_loadu_ps($mask, $p.cast::<f32>()),
                Stored::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16($mask, $p.cast::<i16>())),
                )),
                // Sign-extended to 16 bits and shifted by 7, the byte's sign lands on the
                // f16 sign and its exponent and mantissa on f16's low exponent bits and high
                // mantissa bits; the mask clears the copies of the sign between them.
                _ => _mm512_cvtph_ps(_mm256_and_si256(
                    _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(
                        $mask,
                        $p.cast::<i8>(),
                    ))),
                    _mm256_set1_epi16(0xbf80u16 as i16),
                )),
            }
        };
    }
    let whole = k / 16 * 16;
    let tail: __mmask16 = ((1u32 << (k - whole)) - 1) as __mmask16;
    for first in (0..n).step_by(COLUMNS) {
        let rows: [*const W; COLUMNS] = plan.rows(wp, first, n, k);
        let mut acc = [[_mm512_setzero_ps(); R]; COLUMNS];
        // One chunk of 16 lanes at `$at` of every row, read through `$mask`.
        macro_rules! chunk {
            ($at:expr, $mask:expr) => {{
                // SAFETY: every row holds `k` values (the caller's contract) and `$mask`
                // covers only lanes below `k`. (A prefetch is a hint that never faults.)
                if ($at / 16).is_multiple_of(plan.line_chunks) {
                    for row in rows {
                        _mm_prefetch::<_MM_HINT_T0>(
                            row.wrapping_add(plan.ahead + $at).cast::<i8>(),
                        );
                    }
                }
                let wv: [__m512; COLUMNS] =
                    std::array::from_fn(|c| unsafe { load_w!(rows[c].add($at), $mask) });
                for r in 0..R {
                    let xv = unsafe { _mm512_maskz_loadu_ps($mask, xp.add(r * k + $at)) };
                    for c in 0..COLUMNS {
                        acc[c][r] = _mm512_fmadd_ps(xv, wv[c], acc[c][r]);
                    }
                }
            }};
        }
        // FP8 takes 32 bytes a step: one sign extension, shift and mask for both halves
        // (16-20% faster than two 16-byte steps with the weights in cache).
        let mut at = 0;
        if W::STORED == Stored::E4m3 {
            while at + 32 <= whole {
                if (at / 16).is_multiple_of(plan.line_chunks) {
                    for row in rows {
                        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(plan.ahead + at).cast::<i8>());
                    }
                }
                let halves: [[__m512; 2]; COLUMNS] = std::array::from_fn(|c| {
                    // SAFETY: 32 values from `at` lie within every row (at + 32 <= k).
                    let bytes = unsafe { _mm256_loadu_si256(rows[c].add(at).cast()) };
                    let h = _mm512_and_si512(
                        _mm512_slli_epi16::<7>(_mm512_cvtepi8_epi16(bytes)),
                        _mm512_set1_epi16(0xbf80u16 as i16),
                    );
                    [
                        _mm512_cvtph_ps(_mm512_castsi512_si256(h)),
                        _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h)),
                    ]
                });
                // SAFETY: as above, for the input rows.
                let xs: [[__m512; 2]; R] = std::array::from_fn(|r| unsafe {
                    [0, 16].map(|offset| _mm512_loadu_ps(xp.add(r * k + at + offset)))
                });
                for (acc, halves) in acc.iter_mut().zip(&halves) {
                    for (acc, xs) in acc.iter_mut().zip(&xs) {
                        *acc = _mm512_fmadd_ps(xs[0], halves[0], *acc);
                        *acc = _mm512_fmadd_ps(xs[1], halves[1], *acc);
                    }
                }
                at += 32;
            }
        }
        while at < whole {
            chunk!(at, 0xffff);
            at += 16;
        }
        if whole < k {
            chunk!(whole, tail);
        }
        for (c, acc) in acc.iter().enumerate().take(n - first) {
            for (r, acc) in acc.iter().enumerate() {
                out_t[(first + c) * R + r] = _mm512_reduce_add_ps(*acc) * plan.scale;
            }
        }
    }
}

/// The frame of a few-row product `out [m, n]` with `k`-wide inputs: `columns(first, block)`
/// computes output columns `first..` into `block`, output-transposed (`[column][row]`) so that
/// parallel tasks own disjoint memory; the blocks are scattered into `out` at the end.
pub(crate) fn few_rows_by_columns(
    m: usize,
    k: usize,
    out: &mut [f32],
    parallel: bool,
    columns: impl Fn(usize, &mut [f32]) + Sync,
) {
    let n = out.len() / m;
    let mut out_t = vec![0.0f32; n * m];
    if parallel && m * n * k >= PARALLEL_MIN_FLOPS {
        out_t
            .par_chunks_mut(COLUMNS_PER_TASK * m)
            .enumerate()
            .for_each(|(task, block)| columns(task * COLUMNS_PER_TASK, block));
    } else {
        columns(0, &mut out_t);
    }
    for (j, column) in out_t.chunks_exact(m).enumerate() {
        for (i, v) in column.iter().enumerate() {
            out[i * n + j] = *v;
        }
    }
}

/// `out[i] = x[i] · w` for each of the `out.len()` rows of `x` (each `k` wide).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn dot_rows<W: WeightElement>(x: &[f32], k: usize, w: &[W], out: &mut [f32]) {
    const LANES: usize = 16;
    let fused =
        multiversion::target::target_cfg_f!(any(target_feature = "fma", target_feature = "neon"));
    let whole = k / LANES * LANES;
    let tail = |xr: &[f32]| (whole..k).map(|i| xr[i] * w[i].to_f32()).sum::<f32>();
    let mut rows = x.chunks_exact(k);
    let mut left = out.len();
    let mut outs = out.iter_mut();
    // Four input rows at a time share each load of the weight row.
    while left >= 4 {
        let (Some(x0), Some(x1), Some(x2), Some(x3)) =
            (rows.next(), rows.next(), rows.next(), rows.next())
        else {
            break;
        };
        let (mut a0, mut a1, mut a2, mut a3) =
            ([0.0f32; LANES], [0.0; LANES], [0.0; LANES], [0.0; LANES]);
        for (((wc, c0), c1), (c2, c3)) in lanes(w, whole)
            .zip(lanes(x0, whole))
            .zip(lanes(x1, whole))
            .zip(lanes(x2, whole).zip(lanes(x3, whole)))
        {
            prefetch_ahead(wc);
            let wc: [f32; LANES] = std::array::from_fn(|l| wc[l].to_f32());
            for l in 0..LANES {
                a0[l] = madd(fused, c0[l], wc[l], a0[l]);
                a1[l] = madd(fused, c1[l], wc[l], a1[l]);
                a2[l] = madd(fused, c2[l], wc[l], a2[l]);
                a3[l] = madd(fused, c3[l], wc[l], a3[l]);
            }
        }
        for (a, xr) in [(a0, x0), (a1, x1), (a2, x2), (a3, x3)] {
            if let Some(o) = outs.next() {
                *o = hsum16(a) + tail(xr);
            }
        }
        left -= 4;
    }
    // The rows left over (fewer than four), one at a time, in two accumulators: one chain of
    // multiply-adds would wait on its own latency at every chunk.
    for (xr, o) in rows.zip(outs) {
        let (mut even, mut odd) = ([0.0f32; LANES], [0.0f32; LANES]);
        let pairs = whole / (2 * LANES) * (2 * LANES);
        for (xc, wc) in xr[..pairs]
            .chunks_exact(2 * LANES)
            .zip(w[..pairs].chunks_exact(2 * LANES))
        {
            prefetch_ahead(wc);
            for l in 0..LANES {
                even[l] = madd(fused, xc[l], wc[l].to_f32(), even[l]);
                odd[l] = madd(fused, xc[LANES + l], wc[LANES + l].to_f32(), odd[l]);
            }
        }
        if pairs < whole {
            for l in 0..LANES {
                even[l] = madd(fused, xr[pairs + l], w[pairs + l].to_f32(), even[l]);
            }
        }
        *o = hsum16(std::array::from_fn(|l| even[l] + odd[l])) + tail(xr);
    }
}
