//! The few-row INT4 kernels: the inputs laid out in planes against sixteen packed words, the
//! AVX-512 and AVX2 decode kernels, and the portable kernel, which decode the nibbles in
//! registers as they load them.

use super::format::GroupScales;
use crate::compute::cpu::decode::decode_kernel_available;
use crate::compute::cpu::simd::madd;

/// Packed words per chunk of the few-row INT4 kernel: one f32 lane each (128 weights).
pub(super) const INT4_WORDS: usize = 16;

/// Whether [`int4_dot_rows`] handles groups of `group` weights: whole words, and a chunk's
/// sixteen words in whole groups or a group in whole chunks (8, 16, 32, 64, 128, 256, ...;
/// the published files use 32). Other sizes take the row-by-row path.
pub(super) fn int4_kernel_takes(group: usize) -> bool {
    let words_per_group = group / 8;
    group >= 8
        && group.is_multiple_of(8)
        && (INT4_WORDS.is_multiple_of(words_per_group)
            || words_per_group.is_multiple_of(INT4_WORDS))
}

/// The input rows of a few-row INT4 product, laid out for [`int4_dot_rows`]: nibble `i` of
/// sixteen consecutive words multiplies sixteen contiguous inputs. For input row `r` and
/// chunk `c`: `planes[(r * chunks + c) * 128 + i * 16 + l] = x[r][(16c + l) * 8 + i]`, and
/// `sums[(r * chunks + c) * 16 + l]` is the sum of word `16c + l`'s eight inputs (each nibble
/// holds its value plus 8; the kernel takes 8 times this sum off). Inputs past the row's end
/// are zero.
pub(super) struct Int4Inputs {
    planes: Vec<f32>,
    sums: Vec<f32>,
    pub(super) chunks: usize,
    pub(super) rows: usize,
    /// The decode kernel the planes are scaled for ([`Int4Inputs::for_decode`]); `None` for
    /// [`int4_dot_rows`]' unscaled planes.
    #[cfg(target_arch = "x86_64")]
    decode: Option<Int4Decode>,
}

impl Int4Inputs {
    pub(super) fn new(x: &[f32], rows: usize, k: usize) -> Self {
        let chunks = k.div_ceil(8 * INT4_WORDS);
        let per_row = chunks * INT4_WORDS * 8;
        let mut planes = vec![0.0f32; rows * per_row];
        let mut sums = vec![0.0f32; rows * chunks * INT4_WORDS];
        for (r, xr) in x.chunks_exact(k).enumerate() {
            for (j, v) in xr.iter().enumerate() {
                let (word, i) = (j / 8, j % 8);
                let (c, l) = (word / INT4_WORDS, word % INT4_WORDS);
                planes[r * per_row + c * 8 * INT4_WORDS + i * INT4_WORDS + l] = *v;
                sums[r * chunks * INT4_WORDS + word] += v;
            }
        }
        Int4Inputs {
            planes,
            sums,
            chunks,
            rows,
            #[cfg(target_arch = "x86_64")]
            decode: None,
        }
    }

    /// `rows` input rows as `kernel` reads them, in one pass: plane `i` of each chunk scaled
    /// by the power of two the kernel reads nibble `i` with ([`Int4Decode::plane_scale`]); the
    /// sums as [`Int4Inputs::new`] makes them.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn for_decode(x: &[f32], rows: usize, kernel: Int4Decode) -> Self {
        let k = x.len() / rows;
        let chunks = k.div_ceil(8 * INT4_WORDS);
        let mut planes = vec![0.0f32; rows * chunks * 8 * INT4_WORDS];
        let mut sums = vec![0.0f32; rows * chunks * INT4_WORDS];
        let scales: [f32; 8] = std::array::from_fn(|i| kernel.plane_scale(i));
        for (r, xr) in x.chunks_exact(k).enumerate() {
            let planes = &mut planes[r * chunks * 8 * INT4_WORDS..];
            let sums = &mut sums[r * chunks * INT4_WORDS..];
            for (word, values) in xr.chunks(8).enumerate() {
                let (c, l) = (word / INT4_WORDS, word % INT4_WORDS);
                let mut sum = 0.0f32;
                for (i, v) in values.iter().enumerate() {
                    planes[c * 8 * INT4_WORDS + i * INT4_WORDS + l] = v * scales[i];
                    sum += v;
                }
                sums[word] = sum;
            }
        }
        Int4Inputs {
            planes,
            sums,
            chunks,
            rows,
            decode: Some(kernel),
        }
    }

    /// `out[r] = x[r] · row` for one packed row whose group scales are `row_scales` (padded
    /// to whole chunks), `words_per_group` words to a scale.
    pub(super) fn dot(
        &self,
        words: &[u32],
        row_scales: &[f32],
        words_per_group: usize,
        out: &mut [f32],
    ) {
        // One lane per word, so each lane has one scale; the arrangement of a chunk's
        // sixteen scales is fixed by the group size, given here as a constant.
        macro_rules! with_groups_of {
            ($($wpg:literal)*) => {
                match words_per_group {
                    $($wpg => int4_dot_rows(self, words, |c| {
                        std::array::from_fn(|l| row_scales[(c * INT4_WORDS + l) / $wpg])
                    }, out),)*
                    wpg => int4_dot_rows(self, words, |c| {
                        [row_scales[c * INT4_WORDS / wpg]; INT4_WORDS]
                    }, out),
                }
            };
        }
        with_groups_of!(1 2 4 8);
    }
}

/// A packed INT4 matrix as the decode kernel [`int4_rows_avx512`] reads it.
#[cfg(target_arch = "x86_64")]
pub(super) struct Int4Rows<'a> {
    pub(super) packed: &'a [u32],
    pub(super) scales: &'a GroupScales,
    /// Words and scales per row.
    pub(super) words: usize,
    pub(super) groups: usize,
    pub(super) words_per_group: usize,
}

#[cfg(target_arch = "x86_64")]
impl Int4Rows<'_> {
    /// `out[c * m + r] = x[r] · row (first + c)` for the `m` input rows of `inputs` (made by
    /// [`Int4Inputs::for_decode`]).
    pub(super) fn dot(&self, inputs: &Int4Inputs, first: usize, out: &mut [f32]) {
        let (chunks, m) = (inputs.chunks, inputs.rows);
        let kernel = inputs.decode.expect("planes made for a decode kernel");
        assert!(
            kernel.takes(m, self.words_per_group * 8)
                && inputs.planes.len() == m * chunks * 8 * INT4_WORDS
                && inputs.sums.len() == m * chunks * INT4_WORDS
                && out.len().is_multiple_of(m)
                && self.words <= chunks * INT4_WORDS
                && self.words > (chunks - 1) * INT4_WORDS
                && (first + out.len() / m) * self.words <= self.packed.len()
                && (first + out.len() / m) * self.groups <= self.scales.len()
                && self.groups == self.words.div_ceil(self.words_per_group),
            "INT4 decode inputs"
        );
        let (scales, bf16_scales) = match self.scales {
            GroupScales::Bf16(s) => (s.as_ptr().cast::<u8>(), true),
            GroupScales::F32(s) => (s.as_ptr().cast::<u8>(), false),
        };
        // Measured on an AVX2 machine with the matrix in L2 (G weights x rows a second, one
        // thread): one row three packed rows a pass, each chain split between even and odd
        // nibbles (14, against 12 with two a pass); more rows two a pass in groups of up to
        // four (2 rows 18, 4 rows 23, 8 rows 20; one a pass 17 at 4 rows), their
        // accumulators spilling past three rows but each input plane loaded once for both.
        macro_rules! avx2 {
            ($bf16:literal) => {
                match m {
                    1 => int4_rows_avx2::<$bf16, 3, 1, 2>,
                    2 => int4_rows_avx2::<$bf16, 2, 2, 1>,
                    // Groups of three where they are as few as of four.
                    m if m.div_ceil(3) == m.div_ceil(4) => int4_rows_avx2::<$bf16, 2, 3, 1>,
                    _ => int4_rows_avx2::<$bf16, 2, 4, 1>,
                }
            };
        }
        // SAFETY: the planes were made for `kernel`, which `Int4Decode::detect_for` found on
        // this CPU for `m` rows; the assert above bounds every load (the kernels' contract);
        // `scales` points at the matrix's own scales, bf16 where `bf16_scales`.
        unsafe {
            match (kernel, bf16_scales) {
                (Int4Decode::Avx512, true) => {
                    int4_rows_avx512::<true>(self, inputs, scales, first, out)
                }
                (Int4Decode::Avx512, false) => {
                    int4_rows_avx512::<false>(self, inputs, scales, first, out)
                }
                (Int4Decode::Avx2, true) => avx2!(true)(self, inputs, scales, first, out),
                (Int4Decode::Avx2, false) => avx2!(false)(self, inputs, scales, first, out),
            }
        }
    }
}

/// `out[c] = x · row (first + c)` for packed INT4 rows, four a pass (the last pass repeats
/// its last row where fewer are left), with AVX-512. Each lane holds a word; nibble `i` of
/// sixteen words is masked in place (no shift) and converted as its value times 16^i, against
/// the input plane `i` scaled by 2^-4i. Each chunk's sums, less 8 times its inputs' sums, are
/// multiplied by the lanes' group scales, read from the matrix's own scales (`BF16`: bf16
/// values, else f32; `scales` points at the first row's) into the row's total; the pass's
/// four totals are summed across their lanes together.
///
/// Everything a pass does not change is set up once per call: one call takes all the rows a
/// task has, so a product of short rows (a down projection: 256 inputs, two chunks) is not
/// dominated by each pass's set-up.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VL; `scales` points at `matrix`'s own scales (bf16 when
/// `BF16`, else f32); the rest is what [`Int4Rows::dot`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn int4_rows_avx512<const BF16: bool>(
    matrix: &Int4Rows<'_>,
    inputs: &Int4Inputs,
    scales: *const u8,
    first: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    const PASS: usize = 4;
    let (words, groups, words_per_group) = (matrix.words, matrix.groups, matrix.words_per_group);
    let chunks = inputs.chunks;
    // Lane l takes scale l / words_per_group of its chunk's (0 for a group of whole chunks);
    // a chunk reads `per_chunk` scales from its first.
    let lanes: [i32; INT4_WORDS] = std::array::from_fn(|l| (l / words_per_group) as i32);
    // SAFETY: `lanes` holds 16 i32, the width of the load.
    let lane_scale = unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) };
    let per_chunk = INT4_WORDS.div_ceil(words_per_group);
    let tail = words - (chunks - 1) * INT4_WORDS;
    let last_mask: __mmask16 = if tail == INT4_WORDS {
        0xffff
    } else {
        ((1u32 << tail) - 1) as __mmask16
    };
    let eight = _mm512_set1_ps(8.0);
    // Scales `start..start + count` (count <= 16) of the matrix, as f32, the rest zero.
    let load_scales = |start: usize, count: usize| -> __m512 {
        let mask = ((1u32 << count) - 1) as __mmask16;
        if BF16 {
            // SAFETY: the mask covers only scales of the rows (the contract); bf16 is the top
            // half of an f32.
            let half =
                unsafe { _mm256_maskz_loadu_epi16(mask, scales.cast::<u16>().add(start).cast()) };
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half)))
        } else {
            // SAFETY: as above.
            unsafe { _mm512_maskz_loadu_ps(mask, scales.cast::<f32>().add(start)) }
        }
    };
    let planes = inputs.planes.as_ptr();
    let sums = inputs.sums.as_ptr();
    for at in (0..out.len()).step_by(PASS) {
        let count = (out.len() - at).min(PASS);
        let row: [usize; PASS] = std::array::from_fn(|j| first + at + j.min(count - 1));
        let w_rows: [*const u32; PASS] =
            std::array::from_fn(|j| matrix.packed.as_ptr().wrapping_add(row[j] * words));
        let mut total = [_mm512_setzero_ps(); PASS];
        for c in 0..chunks {
            let mask = if c + 1 == chunks { last_mask } else { 0xffff };
            // SAFETY: the mask covers only the words of each row.
            let w: [__m512i; PASS] = std::array::from_fn(|j| unsafe {
                _mm512_maskz_loadu_epi32(mask, w_rows[j].add(c * INT4_WORDS).cast())
            });
            // The same line two passes on (rows 8 further in the matrix): a hint, which never
            // faults. One pass on read 10% slower, none 40% (roofline's INT4 decode line).
            for w_row in w_rows {
                let ahead = w_row.wrapping_add(8 * words + c * INT4_WORDS);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            }
            // Two accumulators per row (even and odd nibbles): eight chains of multiply-adds.
            let mut acc = [[_mm512_setzero_ps(); 2]; PASS];
            for i in 0..8 {
                // SAFETY: plane i of chunk c lies within the planes (the contract).
                let p = unsafe { _mm512_loadu_ps(planes.add((c * 8 + i) * INT4_WORDS)) };
                let nibble = _mm512_set1_epi32((0xf_u32 << (4 * i)) as i32);
                for j in 0..PASS {
                    let q = _mm512_cvtepu32_ps(_mm512_and_si512(w[j], nibble));
                    acc[j][i % 2] = _mm512_fmadd_ps(q, p, acc[j][i % 2]);
                }
            }
            // SAFETY: chunk c's sums lie within the sums.
            let s = unsafe { _mm512_loadu_ps(sums.add(c * INT4_WORDS)) };
            let start = c * INT4_WORDS / words_per_group;
            let count = per_chunk.min(groups - start);
            for j in 0..PASS {
                let partial = _mm512_fnmadd_ps(eight, s, _mm512_add_ps(acc[j][0], acc[j][1]));
                let scale =
                    _mm512_permutexvar_ps(lane_scale, load_scales(row[j] * groups + start, count));
                total[j] = _mm512_fmadd_ps(partial, scale, total[j]);
            }
        }
        // The four totals summed across their lanes at once: pairs interleaved and added,
        // then the pairs' halves, then the 128-bit lanes.
        let ab = _mm512_add_ps(
            _mm512_unpacklo_ps(total[0], total[1]),
            _mm512_unpackhi_ps(total[0], total[1]),
        );
        let cd = _mm512_add_ps(
            _mm512_unpacklo_ps(total[2], total[3]),
            _mm512_unpackhi_ps(total[2], total[3]),
        );
        let abcd = _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(ab, cd),
            _mm512_shuffle_ps::<0b11_10_11_10>(ab, cd),
        );
        let halves = _mm256_add_ps(
            _mm512_castps512_ps256(abcd),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(abcd))),
        );
        let sum = _mm_add_ps(
            _mm256_castps256_ps128(halves),
            _mm256_extractf128_ps::<1>(halves),
        );
        // SAFETY: `count` outputs from `at` lie within `out`.
        unsafe {
            _mm_mask_storeu_ps(
                out.as_mut_ptr().add(at),
                ((1u32 << count) - 1) as __mmask8,
                sum,
            )
        };
    }
}

/// Which INT4 decode kernel takes how many input rows on this CPU, as `moe-node devices`
/// names it (the rest of the INT4 products: [`int4_dot_rows`], the AMX tiles, or widening).
#[cfg(target_arch = "x86_64")]
pub(crate) fn int4_decode_path() -> String {
    match Int4Decode::detect() {
        Some(Int4Decode::Avx512) => "AVX-512 at one row, four packed rows a pass".into(),
        Some(Int4Decode::Avx2) => format!(
            "AVX2 at one to {INT4_AVX2_MAX_ROWS} rows (groups of a power of two weights), three \
             packed rows a pass for one, two for more"
        ),
        None => "none (the portable kernel)".into(),
    }
}

/// The most input rows [`int4_rows_avx2`] takes: up to here it beats widening the weights to
/// f32 for the packed GEMM, which on AVX2 spends longer widening INT4 than multiplying (128
/// grouped experts [3 x 384 x 1024] on an AMD EPYC, ms, widened against the kernel: 9 rows 92
/// against 41, 16 rows 101 against 60, 24 rows 116 against 92, 32 rows 133 against 123, 64
/// rows 191 against 265).
#[cfg(target_arch = "x86_64")]
pub(super) const INT4_AVX2_MAX_ROWS: usize = 32;

/// The INT4 decode kernels ([`Int4Rows::dot`]) a CPU may run.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Int4Decode {
    /// [`int4_rows_avx512`]: AVX-512 F, BW and VL.
    Avx512,
    /// [`int4_rows_avx2`]: AVX2 and FMA.
    Avx2,
}

#[cfg(target_arch = "x86_64")]
impl Int4Decode {
    /// The widest this CPU runs for one input row (on every INT4 decode product: no
    /// allocation).
    pub(super) fn detect() -> Option<Int4Decode> {
        if decode_kernel_available() {
            Some(Int4Decode::Avx512)
        } else {
            Int4Decode::avx2_available().then_some(Int4Decode::Avx2)
        }
    }

    /// The kernel this CPU runs for `rows` input rows of a matrix in groups of `group`
    /// weights (which [`int4_kernel_takes`]): for more than one row, [`int4_rows_avx2`] on a
    /// CPU without AVX-512, up to [`INT4_AVX2_MAX_ROWS`] (with AVX-512, more rows take the
    /// AMX-INT8 tiles where the CPU has them, else [`int4_dot_rows`] in 16 lanes or the
    /// broadcast tiles).
    pub(super) fn detect_for(rows: usize, group: usize) -> Option<Int4Decode> {
        Int4Decode::detect().filter(|kernel| kernel.takes(rows, group))
    }

    /// Whether this kernel takes `rows` input rows of a matrix in groups of `group` weights
    /// (which [`int4_kernel_takes`]): AVX2 reads a group's scale by a shift, so only groups
    /// of a power of two.
    pub(super) fn takes(self, rows: usize, group: usize) -> bool {
        match self {
            Int4Decode::Avx512 => rows == 1,
            Int4Decode::Avx2 => (1..=INT4_AVX2_MAX_ROWS).contains(&rows) && group.is_power_of_two(),
        }
    }

    fn avx2_available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }

    /// Every kernel this CPU runs, widest first (an AVX-512 CPU runs the AVX2 one too).
    #[cfg(test)]
    pub(super) fn all() -> Vec<Int4Decode> {
        let mut kernels: Vec<Int4Decode> = Int4Decode::detect().into_iter().collect();
        if kernels == [Int4Decode::Avx512] && Int4Decode::avx2_available() {
            kernels.push(Int4Decode::Avx2);
        }
        kernels
    }

    /// The power of two input plane `i` is multiplied by (exactly): the kernels read nibble
    /// `i` of a word in place, masked but not shifted, as its value times 16^i; AVX2 has no
    /// unsigned conversion, so its top nibble (which would read as negative) is shifted down
    /// to its value.
    fn plane_scale(self, i: usize) -> f32 {
        let exponent = match (self, i) {
            (Int4Decode::Avx2, 7) => 0,
            _ => 4 * i as u32,
        };
        f32::from_bits((127 - exponent) << 23)
    }
}

/// [`int4_rows_avx512`] with AVX2, for one to [`INT4_AVX2_MAX_ROWS`] input rows in groups of
/// `R`: `PASS` packed rows a pass (the last pass repeats the last row where fewer are left),
/// each pass's words (in L1 after the first group) decoded in registers for every group of
/// input rows; the last group repeats the last input row where fewer than `R` are left (its
/// outputs not written). Each chunk's sixteen words are taken as two halves of eight lanes.
/// Nibble `i` is masked in place (the top one shifted down) and converted against the input
/// plane scaled by [`Int4Decode::plane_scale`], into `S` accumulators a row taking the
/// nibbles in turn (more independent chains of multiply-adds where `PASS * R` are few); each
/// half's sums, less 8 times its inputs' sums, are multiplied by the lanes' group scales
/// into the row's total.
///
/// Groups are a power of two words (the caller's contract), so a half's first scale is
/// `(16c + 8h) >> log2(words_per_group)`, and it reads exactly its own (eight, four, two or
/// one), spread over its lanes by a permutation; the last chunk of a row whose words end
/// inside it copies its scales.
///
/// # Safety
/// The CPU has AVX2 and FMA; `inputs` were made by [`Int4Inputs::for_decode`] for
/// [`Int4Decode::Avx2`]; `words_per_group` is a power of two; `scales` points at `matrix`'s
/// own scales (bf16 when `BF16`, else f32); the rest is what [`Int4Rows::dot`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn int4_rows_avx2<const BF16: bool, const PASS: usize, const R: usize, const S: usize>(
    matrix: &Int4Rows<'_>,
    inputs: &Int4Inputs,
    scales: *const u8,
    first: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    const PLANE: usize = 8 * INT4_WORDS;
    const PREFETCH_ROWS: usize = 8;
    let (words, groups) = (matrix.words, matrix.groups);
    let shift = matrix.words_per_group.trailing_zeros();
    let (chunks, m) = (inputs.chunks, inputs.rows);
    let n = out.len() / m;
    let size = if BF16 { 2 } else { 4 };
    // Chunks whose sixteen words (and so whose scales) all lie within the row.
    let whole_chunks = words / INT4_WORDS;
    // A half's scales: `per_half` from its first, lane l taking the (l >> shift)-th.
    let per_half = (HALF >> shift).max(1);
    let lanes: [i32; HALF] = std::array::from_fn(|l| (l >> shift.min(3)) as i32);
    // SAFETY: `lanes` holds 8 i32, the width of the load.
    let spread = unsafe { _mm256_loadu_si256(lanes.as_ptr().cast()) };
    // The last chunk's words: a lane mask per half (all lanes where its words are whole).
    let tail = words - (chunks - 1) * INT4_WORDS;
    let tail_masks: [__m256i; 2] = std::array::from_fn(|h| {
        let valid: [i32; HALF] = std::array::from_fn(|l| -i32::from(h * HALF + l < tail));
        // SAFETY: `valid` holds 8 i32, the width of the load.
        unsafe { _mm256_loadu_si256(valid.as_ptr().cast()) }
    });
    let eight = _mm256_set1_ps(8.0);
    let planes = inputs.planes.as_ptr();
    let sums = inputs.sums.as_ptr();
    for at in (0..n).step_by(PASS) {
        let count = (n - at).min(PASS);
        let mut w_rows = [std::ptr::null::<u32>(); PASS];
        let mut s_rows = [std::ptr::null::<u8>(); PASS];
        for j in 0..PASS {
            let row = first + at + j.min(count - 1);
            w_rows[j] = matrix.packed.as_ptr().wrapping_add(row * words);
            s_rows[j] = scales.wrapping_add(row * groups * size);
        }
        for g in 0..m.div_ceil(R) {
            // Input row `r` of the group (the last repeated past `m`).
            let mut input = [0usize; R];
            for (r, x) in input.iter_mut().enumerate() {
                *x = (g * R + r).min(m - 1);
            }
            let mut total = [[_mm256_setzero_ps(); R]; PASS];
            for c in 0..chunks {
                let whole = c < whole_chunks;
                if g == 0 {
                    // The same words a few passes on: a hint, which never faults.
                    for w_row in w_rows {
                        let ahead = w_row.wrapping_add(PREFETCH_ROWS * words + c * INT4_WORDS);
                        _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                    }
                }
                for (h, tail_mask) in tail_masks.iter().enumerate() {
                    // Loops, not `array::from_fn`: a closure is compiled without the
                    // function's target features, and the inliner gives up on some (their
                    // intrinsics then become calls).
                    let first_word = c * INT4_WORDS + h * HALF;
                    let mut w = [_mm256_setzero_si256(); PASS];
                    let mut scale = [_mm256_setzero_ps(); PASS];
                    for j in 0..PASS {
                        // SAFETY: a whole chunk's 16 words and its scales lie within each
                        // row; the last chunk's lanes past the row's words are masked.
                        unsafe {
                            let at = w_rows[j].add(first_word).cast::<i32>();
                            if whole {
                                w[j] = _mm256_loadu_si256(at.cast());
                                let at = s_rows[j].add((first_word >> shift) * size);
                                scale[j] = half_scales::<BF16>(at, per_half, spread);
                            } else {
                                w[j] = _mm256_maskload_epi32(at, *tail_mask);
                                scale[j] =
                                    tail_scales::<BF16>(s_rows[j], groups, first_word, shift);
                            }
                        }
                    }
                    let mut acc = [[[_mm256_setzero_ps(); S]; R]; PASS];
                    for i in 0..8 {
                        let nibble = _mm256_set1_epi32((0xf_u32 << (4 * i)) as i32);
                        let mut q = [_mm256_setzero_ps(); PASS];
                        for j in 0..PASS {
                            q[j] = _mm256_cvtepi32_ps(if i == 7 {
                                _mm256_srli_epi32::<28>(w[j])
                            } else {
                                _mm256_and_si256(w[j], nibble)
                            });
                        }
                        for (r, x) in input.iter().enumerate() {
                            let plane = (x * chunks + c) * PLANE + i * INT4_WORDS + h * HALF;
                            // SAFETY: plane i of chunk c of the input row lies within the
                            // planes.
                            let p = unsafe { _mm256_loadu_ps(planes.add(plane)) };
                            for j in 0..PASS {
                                let a = &mut acc[j][r][i % S];
                                *a = _mm256_fmadd_ps(q[j], p, *a);
                            }
                        }
                    }
                    for (r, x) in input.iter().enumerate() {
                        // SAFETY: chunk c's sums of the input row lie within the sums.
                        let s = unsafe {
                            _mm256_loadu_ps(sums.add((x * chunks + c) * INT4_WORDS + h * HALF))
                        };
                        for j in 0..PASS {
                            let mut sum = acc[j][r][0];
                            for a in &acc[j][r][1..] {
                                sum = _mm256_add_ps(sum, *a);
                            }
                            let partial = _mm256_fnmadd_ps(eight, s, sum);
                            total[j][r] = _mm256_fmadd_ps(partial, scale[j], total[j][r]);
                        }
                    }
                }
            }
            for (j, total) in total.iter().enumerate().take(count) {
                for (r, total) in total.iter().enumerate().take(m - g * R) {
                    let quad = _mm_add_ps(
                        _mm256_castps256_ps128(*total),
                        _mm256_extractf128_ps::<1>(*total),
                    );
                    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
                    let one = _mm_add_ss(pair, _mm_movehdup_ps(pair));
                    out[(at + j) * m + g * R + r] = _mm_cvtss_f32(one);
                }
            }
        }
    }
}

/// Half of a chunk's words: one AVX2 register of eight lanes.
#[cfg(target_arch = "x86_64")]
const HALF: usize = INT4_WORDS / 2;

/// The lanes' scales of a half of a whole chunk whose first scale is `at` (`per_half` of
/// them from there), spread over the lanes by `spread` (`B`: bf16).
///
/// # Safety
/// The CPU has AVX2; the `per_half` scales lie within the row's.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn half_scales<const B: bool>(
    at: *const u8,
    per_half: usize,
    spread: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract bounds the load; bf16 is the top half of an f32.
    let loaded = unsafe {
        if B {
            let half = match per_half {
                8 => _mm_loadu_si128(at.cast()),
                4 => _mm_loadl_epi64(at.cast()),
                2 => _mm_cvtsi32_si128(at.cast::<i32>().read_unaligned()),
                _ => _mm_cvtsi32_si128(i32::from(at.cast::<u16>().read_unaligned())),
            };
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(half)))
        } else {
            match per_half {
                8 => _mm256_loadu_ps(at.cast()),
                4 => _mm256_zextps128_ps256(_mm_loadu_ps(at.cast())),
                // Not `_mm_load_sd`, which wants 8-byte alignment.
                2 => _mm256_zextps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64(at.cast()))),
                _ => _mm256_zextps128_ps256(_mm_load_ss(at.cast())),
            }
        }
    };
    _mm256_permutevar8x32_ps(loaded, spread)
}

/// The same for the last chunk of a row whose words end inside it: the half's scales
/// (lane l's the `(first_word + l) >> shift`-th of the row's `groups` from `row`) copied,
/// those past the row's zero.
///
/// # Safety
/// The CPU has AVX2; `row` points at a row's `groups` scales.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn tail_scales<const B: bool>(
    row: *const u8,
    groups: usize,
    first_word: usize,
    shift: u32,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let lanes: [f32; HALF] = std::array::from_fn(|l| {
        let group = (first_word + l) >> shift;
        if group >= groups {
            return 0.0;
        }
        // SAFETY: scale `group` is one of the row's.
        unsafe {
            if B {
                f32::from_bits(u32::from(*row.cast::<u16>().add(group)) << 16)
            } else {
                *row.cast::<f32>().add(group)
            }
        }
    });
    // SAFETY: `lanes` holds 8 f32, the width of the load.
    unsafe { _mm256_loadu_ps(lanes.as_ptr()) }
}

/// The few-row INT4 kernel: `out[r] = x[r] · row`, the row's words decoded in registers as
/// they are loaded. Each lane holds one word; nibble `i` of sixteen words times plane `i` of
/// the inputs accumulates in f32, and each chunk's sixteen partial sums, less 8 times their
/// inputs' sums, are multiplied by their words' scales (`scales_of(chunk)`).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn int4_dot_rows<S: Fn(usize) -> [f32; INT4_WORDS]>(
    inputs: &Int4Inputs,
    words: &[u32],
    scales_of: S,
    out: &mut [f32],
) {
    let fused =
        multiversion::target::target_cfg_f!(any(target_feature = "fma", target_feature = "neon"));
    let mut r = 0;
    while r + 2 <= inputs.rows {
        let sums: [f32; 2] = int4_pass(inputs, r, words, &scales_of, fused);
        out[r..r + 2].copy_from_slice(&sums);
        r += 2;
    }
    while r < inputs.rows {
        let [sum]: [f32; 1] = int4_pass(inputs, r, words, &scales_of, fused);
        out[r] = sum;
        r += 1;
    }
}

/// [`int4_dot_rows`] for input rows `first..first + R`, sharing each decoded word. R is at
/// most 2: with four rows the accumulators outgrow AVX2's sixteen registers, and the spills
/// made the MoE layer at 256 tokens per step (about five rows per expert) 3x slower.
#[inline(always)]
fn int4_pass<const R: usize, S: Fn(usize) -> [f32; INT4_WORDS]>(
    inputs: &Int4Inputs,
    first: usize,
    words: &[u32],
    scales_of: &S,
    fused: bool,
) -> [f32; R] {
    const PLANE: usize = 8 * INT4_WORDS;
    let chunks = inputs.chunks;
    let planes: [&[f32]; R] =
        std::array::from_fn(|r| &inputs.planes[(first + r) * chunks * PLANE..][..chunks * PLANE]);
    let sums: [&[f32]; R] = std::array::from_fn(|r| {
        &inputs.sums[(first + r) * chunks * INT4_WORDS..][..chunks * INT4_WORDS]
    });
    let mut total = [[0.0f32; INT4_WORDS]; R];
    for c in 0..chunks {
        let w: [u32; INT4_WORDS] = match words.get(c * INT4_WORDS..(c + 1) * INT4_WORDS) {
            Some(whole) => whole.try_into().expect("a chunk is INT4_WORDS long"),
            None => std::array::from_fn(|l| words.get(c * INT4_WORDS + l).copied().unwrap_or(0)),
        };
        let mut acc = [[0.0f32; INT4_WORDS]; R];
        for i in 0..8 {
            let q: [f32; INT4_WORDS] =
                std::array::from_fn(|l| ((w[l] >> (4 * i)) & 0xf) as i32 as f32);
            for r in 0..R {
                let p = &planes[r][c * PLANE + i * INT4_WORDS..][..INT4_WORDS];
                for l in 0..INT4_WORDS {
                    acc[r][l] = madd(fused, q[l], p[l], acc[r][l]);
                }
            }
        }
        let scales = scales_of(c);
        for r in 0..R {
            let s = &sums[r][c * INT4_WORDS..][..INT4_WORDS];
            for l in 0..INT4_WORDS {
                let partial = madd(fused, -8.0, s[l], acc[r][l]);
                total[r][l] = madd(fused, partial, scales[l], total[r][l]);
            }
        }
    }
    std::array::from_fn(|r| total[r].iter().sum())
}
