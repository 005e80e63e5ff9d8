//! INT4 weights (compressed-tensors pack-quantized: eight nibbles a word, each its value plus
//! 8, a scale per group of 32 or more along `k`) times 2 to 8 input rows on AMX-INT8 tiles
//! (from 7 rows `quant.rs` gives them to the AMX-BF16 tiles, faster there): the experts of
//! decode batches and of prefill steps that route a few tokens to each, which the vector
//! kernels run at a fraction of the memory's bandwidth because every weight takes a
//! conversion and a multiply-add per row.
//!
//! The tile unit multiplies bytes: the weights are bytes already once their nibbles are
//! masked apart, and each f32 input becomes four signed 8-bit digits in a power-of-two scale
//! of its row, `x = 2^e (d0 + d1 2^-7 + d2 2^-14 + d3 2^-21)` (the first digit takes the
//! row's magnitude, up to 127; each further one the residual, times 128, rounded). Digits
//! and nibbles multiply exactly into i32 sums, one per group, digit and neuron; the group
//! scales then weigh them in f32. The digits carry every input to within 2^-22 of its row's
//! scale, about 2^-28 of the row's largest value: below the rounding of the f32 sums the
//! other kernels make, so the products stay those of the dequantized f32 matrix within f32
//! rounding (tested against the f64 product, and by the reference tests of the INT4
//! checkpoints).
//!
//! A chunk of 128 `k` is 64 packed bytes of a weight row. Masked, its low nibbles are the
//! even `k` and its high nibbles the odd: two A tiles of 16 neurons by 64 bytes, which hold
//! four groups in their four 16-byte lanes. Against them the B tiles hold the digits of the
//! even and of the odd inputs, block-diagonally: quad row `q` (group `q / 4`) is non-zero only
//! in the columns `4 (q / 4) + p` of its group's digits `p`. So one tile product per half
//! gives, per neuron, a sum per group and digit in the sixteen columns of C, which one vector
//! weighs by the four groups' scales.

use super::pack::TILE;
use super::session::TileSession;

/// Input rows the kernel takes at most (the decode steps of a few sequences).
pub(crate) const MAX_ROWS: usize = 8;
/// Input rows the kernel takes at least. One row stays on the vector decode kernel: one
/// thread, weights in cache, gate-sized (256 x 1024) and down-sized (1024 x 256) products took
/// 14 and 15 us here against 16 and 19 us, but through 16 experts from memory (roofline's
/// decode lines, alternated in one process) 0.66 ms against 0.59 ms; from 2 rows the tiles
/// took 20-22 us against 28-44 us, up to 8 rows 92-118 us against 122-147 us in cache, and a
/// MoE layer of 256 tokens per step (about 5 rows per expert) ran 18-21% faster.
pub(crate) const MIN_ROWS: usize = 2;
/// Values of `k` per chunk: 64 packed bytes of a weight row, one A tile row.
const CHUNK: usize = 128;
/// Values of `k` per scale unit: a quarter of a chunk, one lane of an A tile row.
const SUB_GROUP: usize = 32;
/// Digits per input.
const DIGITS: usize = 4;
/// Bits each digit after the first adds.
const DIGIT_BITS: i32 = 7;
/// Bytes of one tile (16 rows of 64).
const TILE_BYTES: usize = TILE * 64;

/// Whether the CPU has AMX-INT8 besides the AMX-BF16 that [`super::enabled`] checks, and
/// the AVX-512 (BW, VNNI) that the packing and the sums use.
pub(crate) fn int8_enabled() -> bool {
    if !super::status::enabled() {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static INT8: OnceLock<bool> = OnceLock::new();
        *INT8.get_or_init(|| {
            // Leaf 7 exists: the AMX probe read it.
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            edx & (1 << 25) != 0
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the tiles take an INT4 product with groups of `group` over `k` inputs and `rows`
/// input rows.
pub(crate) fn takes(rows: usize, k: usize, group: usize) -> bool {
    (MIN_ROWS..=MAX_ROWS).contains(&rows)
        && k > 0
        && k.is_multiple_of(SUB_GROUP)
        && group > 0
        && group.is_multiple_of(SUB_GROUP)
        && int8_enabled()
}

/// The input rows of an INT4 product as digits laid out in B tiles, made once and shared by
/// the products that take the same input (an expert's gate and up).
pub(crate) struct Int4Digits {
    /// Per row, per chunk: the B tile of the even `k`, then of the odd.
    tiles: Vec<i8>,
    /// Per row, per chunk: 8 times each group's sum of each digit (lane `4 g + p`): the
    /// nibbles hold their values plus 8.
    eights: Vec<i32>,
    /// Per row: the power of two the digits count in.
    scales: Vec<f32>,
    rows: usize,
    k: usize,
}

impl Int4Digits {
    /// `x [rows, k]` as digits; `None` where the tiles do not take the product (see
    /// [`takes`], for groups of 32) or an input is not finite (the other kernels carry it).
    pub(crate) fn new(x: &[f32], rows: usize, k: usize) -> Option<Int4Digits> {
        if !takes(rows, k, SUB_GROUP) || x.len() != rows * k {
            return None;
        }
        let mut digits = Int4Digits::zeroed(rows, k);
        for (r, xr) in x.chunks_exact(k).enumerate() {
            // |v| as bits orders finite values as their magnitudes; NaN and infinities are
            // above every finite value.
            let top = xr
                .iter()
                .map(|v| v.to_bits() & 0x7fff_ffff)
                .max()
                .unwrap_or(0);
            if top >= 0x7f80_0000 {
                return None;
            }
            let e = scale_exponent(f32::from_bits(top));
            digits.scales[r] = pow2(e);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: int8_enabled() (through takes) saw AVX-512 F, BW and VNNI; the row's
            // tiles and eights lie within the buffers `zeroed` made for `rows` rows of `k`.
            unsafe {
                pack_row_avx512(&mut digits, r, xr, pow2(-e))
            };
        }
        Some(digits)
    }

    /// Whether these digits are the inputs of a product over `k` with groups of `group`.
    pub(crate) fn fits(&self, k: usize, group: usize) -> bool {
        self.k == k && takes(self.rows, k, group)
    }

    fn zeroed(rows: usize, k: usize) -> Int4Digits {
        let chunks = k.div_ceil(CHUNK);
        Int4Digits {
            tiles: vec![0; rows * chunks * 2 * TILE_BYTES],
            eights: vec![0; rows * chunks * TILE],
            scales: vec![0.0; rows],
            rows,
            k,
        }
    }

    /// Row `r`'s digits (`xr` times `inverse`, the row's scale inverted) one value at a time:
    /// the reference [`pack_row_avx512`] is tested against.
    #[cfg(test)]
    fn pack_row_portable(&mut self, r: usize, xr: &[f32], inverse: f32) {
        let chunks = self.chunks();
        let half = chunks * CHUNK / 2;
        let mut row_digits = vec![0i8; 2 * DIGITS * half];
        for parity in 0..2 {
            let mut residual: Vec<f32> = (0..half)
                .map(|i| xr.get(2 * i + parity).map_or(0.0, |v| v * inverse))
                .collect();
            split_digits(
                &mut residual,
                &mut row_digits[parity * DIGITS * half..][..DIGITS * half],
            );
        }
        for c in 0..chunks {
            let at = (r * chunks + c) * 2 * TILE_BYTES;
            let eights = &mut self.eights[(r * chunks + c) * TILE..][..TILE];
            for parity in 0..2 {
                let tile = &mut self.tiles[at + parity * TILE_BYTES..][..TILE_BYTES];
                for p in 0..DIGITS {
                    let of_digit = &row_digits[(parity * DIGITS + p) * half..][..half];
                    // Quad row q holds inputs 4q..4q + 4 of this chunk's half (group q / 4) in
                    // column 4 (q / 4) + p.
                    for q in 0..TILE {
                        let column = 4 * (q / 4) + p;
                        let from = &of_digit[c * CHUNK / 2 + 4 * q..][..4];
                        tile[q * 64 + column * 4..][..4].copy_from_slice(from);
                        eights[column] += 8 * from.iter().map(|&d| i32::from(d)).sum::<i32>();
                    }
                }
            }
        }
    }

    fn chunks(&self) -> usize {
        self.k.div_ceil(CHUNK)
    }
}

/// The exponent `e` of the power of two that row digits count in: the least with
/// `largest <= 127 * 2^e` (so the first digit fits a signed byte), within f32's normal range.
fn scale_exponent(largest: f32) -> i32 {
    if largest == 0.0 {
        return 0;
    }
    let mut e = (f64::from(largest) / 127.0).log2().ceil() as i32;
    while f64::from(largest) > 127.0 * 2f64.powi(e) {
        e += 1;
    }
    while f64::from(largest) <= 127.0 * 2f64.powi(e - 1) {
        e -= 1;
    }
    e.clamp(-126, 126)
}

/// 2^e, for e within f32's normal range.
fn pow2(e: i32) -> f32 {
    f32::from_bits(((127 + e) as u32) << 23)
}

/// `digits[p * n + i]` = digit `p` of `y[i]` (`n = y.len()`, every `|y| <= 127`): `y` rounded
/// to nearest (ties to even), then the residual times 128 rounded, three times. Each step is
/// exact in f32 (a value less its nearest integer, times a power of two), so the digits carry
/// `y` to within 2^-22.
#[cfg(test)]
fn split_digits(y: &mut [f32], digits: &mut [i8]) {
    let n = y.len();
    for p in 0..DIGITS {
        for (d, v) in digits[p * n..][..n].iter_mut().zip(y.iter_mut()) {
            let rounded = v.round_ties_even();
            *d = rounded as i8;
            *v = (*v - rounded) * (1 << DIGIT_BITS) as f32;
        }
    }
}

/// Row `r` of `digits` from `xr` (its scale inverted: `inverse`), a chunk of 128 inputs at a
/// time: the even and odd inputs apart (two permutes per 32), four digits each as
/// [`split_digits`] makes them, a 4 x 4 transpose of the digits' words per 16-byte lane
/// (a lane of quad rows per group), each tile row the lane of its group, and the eights
/// summed from the same rows with VNNI.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `digits` was made for at least `r + 1` rows of
/// `xr.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn pack_row_avx512(digits: &mut Int4Digits, r: usize, xr: &[f32], inverse: f32) {
    use std::arch::x86_64::*;
    let k = xr.len();
    let chunks = digits.chunks();
    assert!(k == digits.k && r < digits.rows, "digit rows");
    let even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    let inverse = _mm512_set1_ps(inverse);
    let step = _mm512_set1_ps((1 << DIGIT_BITS) as f32);
    let ones = _mm512_set1_epi8(1);
    for c in 0..chunks {
        // SAFETY: each load is masked to the inputs of the row (those past k read as zero).
        let x: [__m512; 8] = std::array::from_fn(|i| {
            let first = c * CHUNK + 16 * i;
            let left = k.saturating_sub(first).min(16);
            let mask = ((1u32 << left) - 1) as __mmask16;
            unsafe { _mm512_maskz_loadu_ps(mask, xr.as_ptr().wrapping_add(first)) }
        });
        let at = (r * chunks + c) * 2 * TILE_BYTES;
        let mut sums = _mm512_setzero_si512();
        for parity in 0..2 {
            let index = if parity == 0 { even } else { odd };
            // Per quarter h of the chunk's half: inputs 16h..16h + 16 of the parity.
            let mut y: [__m512; 4] = std::array::from_fn(|h| {
                _mm512_mul_ps(
                    _mm512_permutex2var_ps(x[2 * h], index, x[2 * h + 1]),
                    inverse,
                )
            });
            let mut digit = [_mm512_setzero_si512(); DIGITS];
            for d in &mut digit {
                let bytes: [__m128i; 4] = std::array::from_fn(|h| {
                    let rounded = _mm512_roundscale_ps::<
                        { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                    >(y[h]);
                    y[h] = _mm512_mul_ps(_mm512_sub_ps(y[h], rounded), step);
                    _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(rounded))
                });
                *d = _mm512_inserti32x4::<3>(
                    _mm512_inserti32x4::<2>(
                        _mm512_inserti32x4::<1>(_mm512_castsi128_si512(bytes[0]), bytes[1]),
                        bytes[2],
                    ),
                    bytes[3],
                );
            }
            let t0 = _mm512_unpacklo_epi32(digit[0], digit[1]);
            let t1 = _mm512_unpackhi_epi32(digit[0], digit[1]);
            let t2 = _mm512_unpacklo_epi32(digit[2], digit[3]);
            let t3 = _mm512_unpackhi_epi32(digit[2], digit[3]);
            // rows[j], lane g: quad row 4 g + j's four digits' words.
            let rows = [
                _mm512_unpacklo_epi64(t0, t2),
                _mm512_unpackhi_epi64(t0, t2),
                _mm512_unpacklo_epi64(t1, t3),
                _mm512_unpackhi_epi64(t1, t3),
            ];
            let tile = digits.tiles[at + parity * TILE_BYTES..][..TILE_BYTES].as_mut_ptr();
            for (j, row) in rows.iter().enumerate() {
                sums = _mm512_dpbusd_epi32(sums, ones, *row);
                for g in 0..4 {
                    let lane = _mm512_maskz_mov_epi32(0xf << (4 * g), *row);
                    // SAFETY: quad row 4 g + j of the tile, 64 bytes within it.
                    unsafe { _mm512_storeu_si512(tile.add((4 * g + j) * 64).cast(), lane) };
                }
            }
        }
        // SAFETY: chunk c's 16 eights of row r lie within `eights` (asserted above).
        unsafe {
            _mm512_storeu_si512(
                digits
                    .eights
                    .as_mut_ptr()
                    .add((r * chunks + c) * TILE)
                    .cast(),
                _mm512_slli_epi32::<3>(sums),
            )
        };
    }
}

/// Neurons one pass of the kernel takes: two blocks of 16, whose tile products share the
/// input tiles and make two independent chains.
const PAIR: usize = 2 * TILE;

/// `out [rows, n] = x · wᵀ` for the INT4 matrix `w` (`packed`: `n` rows of `k / 8` words;
/// `scales`: `n` rows of `k.div_ceil(group)` group scales, the last group maybe partial) on
/// the tiles, `x` given as `digits`. `parallel` spreads the neurons over the rayon pool.
pub(crate) fn int4_product(
    digits: &Int4Digits,
    packed: &[u32],
    scales: &crate::compute::quant::format::GroupScales,
    group: usize,
    n: usize,
    out: &mut [f32],
    parallel: bool,
) {
    use rayon::prelude::*;
    let (rows, k) = (digits.rows, digits.k);
    assert!(
        takes(rows, k, group),
        "INT4 tile product of {rows} rows, k {k}, group {group}"
    );
    assert_eq!(packed.len(), n * k / 8, "packed size");
    let per_row = k.div_ceil(group);
    assert_eq!(scales.len(), n * per_row, "scale count");
    assert_eq!(out.len(), rows * n, "output size");
    let out_at = crate::compute::cpu::parallel::SharedOut::new(out);
    let pairs = n.div_ceil(PAIR);
    let run = |first_pair: usize, count: usize| {
        let session = TileSession::start();
        let mut pass = Pass::new(digits);
        for pair in first_pair..first_pair + count {
            let first = pair * PAIR;
            let neurons = PAIR.min(n - first);
            pass.scales_of(scales, group, per_row, first, neurons);
            // The next pair's rows are read into the caches while this pair runs.
            let next = (first + neurons) * k / 8;
            let next = &packed[next..(next + PAIR * k / 8).min(packed.len())];
            let own = &packed[first * k / 8..(first + neurons) * k / 8];
            pass.run(&session, digits, own, next, pair == first_pair);
            for t in 0..rows {
                for j in 0..neurons {
                    // SAFETY: this task alone writes neurons first..first + neurons of every
                    // row; `out` holds rows * n values (asserted above) and outlives the tasks.
                    unsafe { *out_at.get().add(t * n + first + j) = pass.total(digits, t, j) };
                }
            }
        }
    };
    if parallel && rows * n * k >= crate::compute::cpu::parallel::PARALLEL_MIN_FLOPS {
        let per_task = pairs.div_ceil(4 * rayon::current_num_threads());
        (0..pairs.div_ceil(per_task))
            .into_par_iter()
            .for_each(|t| run(t * per_task, per_task.min(pairs - t * per_task)));
    } else {
        run(0, pairs);
    }
}

/// A task's buffers for a pair of neuron blocks at a time.
struct Pass {
    /// Per neuron, per 32 of `k` (padded to whole chunks with zeros): its scale.
    scales: Vec<f32>,
    /// Per chunk parity: the A tiles (low and high nibbles of 32 neurons), 64-byte rows.
    nibbles: Box<[Nibbles; 2]>,
    /// Per input row, per chunk parity: C of both blocks, 32 neurons of 16 lanes.
    sums: Vec<[[i32; TILE]; PAIR]>,
    /// Per input row, per neuron: C's lanes less the eights, weighed by their scales, summed
    /// over the chunks.
    totals: Vec<[[f32; TILE]; PAIR]>,
}

#[repr(C, align(64))]
struct Nibbles {
    low: [[u8; 64]; PAIR],
    high: [[u8; 64]; PAIR],
}

impl Pass {
    fn new(digits: &Int4Digits) -> Pass {
        let nibbles = || Nibbles {
            low: [[0; 64]; PAIR],
            high: [[0; 64]; PAIR],
        };
        Pass {
            scales: vec![0.0; PAIR * digits.chunks() * 4],
            nibbles: Box::new([nibbles(), nibbles()]),
            sums: vec![[[0; TILE]; PAIR]; 2 * digits.rows],
            totals: vec![[[0.0; TILE]; PAIR]; digits.rows],
        }
    }

    /// Reads the scales of neurons `first..first + neurons` (`per_row` groups of `group` each),
    /// one per 32 of `k`.
    fn scales_of(
        &mut self,
        scales: &crate::compute::quant::format::GroupScales,
        group: usize,
        per_row: usize,
        first: usize,
        neurons: usize,
    ) {
        let units = self.scales.len() / PAIR;
        for (j, to) in self.scales.chunks_exact_mut(units).enumerate() {
            if j >= neurons {
                to.fill(0.0);
            } else if group == SUB_GROUP {
                // The published files' groups: read as they are (bf16 widened by a shift).
                scales.read_into((first + j) * per_row, &mut to[..per_row]);
                to[per_row..].fill(0.0);
            } else {
                let per_unit = group / SUB_GROUP;
                for (u, s) in to.iter_mut().enumerate() {
                    let g = u / per_unit;
                    *s = if g < per_row {
                        scales.get((first + j) * per_row + g)
                    } else {
                        0.0
                    };
                }
            }
        }
    }

    /// The products of the neurons whose packed rows `packed` holds (at most 32) into
    /// `totals`, prefetching `next` (the rows of the next pair) as it goes, and `packed` first
    /// when `cold` (the first pair of a task, which nothing prefetched).
    fn run(
        &mut self,
        session: &TileSession,
        digits: &Int4Digits,
        packed: &[u32],
        next: &[u32],
        cold: bool,
    ) {
        let _ = session;
        let words = digits.k / 8;
        let neurons = packed.len() / words;
        assert!(
            neurons <= PAIR && packed.len() == neurons * words,
            "weight rows"
        );
        for t in &mut self.totals {
            *t = [[0.0; TILE]; PAIR];
        }
        // Rows past the neurons stay zero (their sums are not read).
        for nibbles in self.nibbles.iter_mut() {
            nibbles.low[neurons..].fill([0; 64]);
            nibbles.high[neurons..].fill([0; 64]);
        }
        #[cfg(target_arch = "x86_64")]
        {
            if cold {
                prefetch(packed, 0, 1);
            }
            // SAFETY: the session configured the tiles on this thread, int8_enabled() saw
            // AVX-512 F and BW, and `packed` holds `neurons` rows of `words` words.
            unsafe { pass_avx512(self, digits, packed, words, neurons, next) };
        }
    }

    /// Output `t` of neuron `j` of the last [`Pass::run`]: the lanes' totals, each digit's
    /// at its weight (2^-7 per place), summed, times the row's scale.
    fn total(&self, digits: &Int4Digits, t: usize, j: usize) -> f32 {
        let lanes = &self.totals[t][j];
        let mut places = [0.0f32; DIGITS];
        for (l, v) in lanes.iter().enumerate() {
            places[l % DIGITS] += v;
        }
        let sum = places
            .iter()
            .rev()
            .fold(0.0f32, |sum, place| sum / (1 << DIGIT_BITS) as f32 + place);
        sum * digits.scales[t]
    }
}

/// Prefetches part `part` of `parts` of the cache lines of `words` into L1: a hint, which
/// never faults.
#[cfg(target_arch = "x86_64")]
fn prefetch(words: &[u32], part: usize, parts: usize) {
    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
    let lines = (words.len() * 4).div_ceil(64);
    let at = words.as_ptr() as *const i8;
    for line in lines * part / parts..lines * (part + 1) / parts {
        // SAFETY: prefetching never faults; the address is within `words`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(at.add(line * 64)) };
    }
}

/// One pass over every chunk for up to 32 neurons, software-pipelined: chunk `c`'s nibbles
/// masked into the A tiles and its tile products (two blocks by two halves per input row)
/// issued before chunk `c - 1`'s C is weighed by the scales into the totals, so that the
/// vector work of one chunk overlaps the tile work of the next.
///
/// # Safety
/// Tiles configured as `CONFIG` on this thread; the CPU has AVX-512 F and BW; `packed` holds
/// `neurons` (at most 32) weight rows of `words` words each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pass_avx512(
    pass: &mut Pass,
    digits: &Int4Digits,
    packed: &[u32],
    words: usize,
    neurons: usize,
    next: &[u32],
) {
    use std::arch::x86_64::*;
    let chunks = digits.chunks();
    let row_bytes = words * 4;
    let units = chunks * 4;
    let nibble = _mm512_set1_epi8(0x0f);
    // Lane 4 g + p takes scale g of its chunk.
    let spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    let rows_at = packed.as_ptr() as *const u8;
    for c in 0..=chunks {
        if c < chunks {
            prefetch(next, c, chunks);
            let bytes = (row_bytes - c * 64).min(64);
            let mask: __mmask64 = if bytes == 64 { !0 } else { (1u64 << bytes) - 1 };
            let nibbles = &mut pass.nibbles[c % 2];
            for j in 0..neurons {
                // SAFETY (this block): row j's chunk c lies within its `row_bytes` (the mask
                // leaves out what does not); the prefetch is a hint and never faults.
                unsafe {
                    let at = rows_at.add(j * row_bytes + c * 64);
                    let z = _mm512_maskz_loadu_epi8(mask, at as *const i8);
                    let low = _mm512_and_si512(z, nibble);
                    let high = _mm512_and_si512(_mm512_srli_epi16::<4>(z), nibble);
                    _mm512_store_si512(nibbles.low[j].as_mut_ptr().cast(), low);
                    _mm512_store_si512(nibbles.high[j].as_mut_ptr().cast(), high);
                }
            }
            // SAFETY: the nibble buffers are 32 rows of 64 bytes; the digit tiles of every row
            // and chunk lie within `digits.tiles`; each C store writes 16 rows of 64 bytes
            // into a 32-row buffer, at its first or seventeenth row.
            unsafe {
                tile!(load 0, nibbles.low.as_ptr(), 64usize);
                tile!(load 1, nibbles.high.as_ptr(), 64usize);
                tile!(load 2, nibbles.low[TILE..].as_ptr(), 64usize);
                tile!(load 3, nibbles.high[TILE..].as_ptr(), 64usize);
                for t in 0..digits.rows {
                    let at = (t * chunks + c) * 2 * TILE_BYTES;
                    tile!(load 6, digits.tiles.as_ptr().add(at), 64usize);
                    tile!(load 7, digits.tiles.as_ptr().add(at + TILE_BYTES), 64usize);
                    tile!(zero 4);
                    tile!(zero 5);
                    tile!(dot_bytes 4, 0, 6);
                    tile!(dot_bytes 5, 2, 6);
                    tile!(dot_bytes 4, 1, 7);
                    tile!(dot_bytes 5, 3, 7);
                    let sums = &mut pass.sums[2 * t + c % 2];
                    tile!(store 4, sums.as_mut_ptr());
                    tile!(store 5, sums[TILE..].as_mut_ptr());
                }
            }
        }
        if c > 0 {
            let done = c - 1;
            for t in 0..digits.rows {
                // SAFETY: the eights hold 16 lanes per row and chunk.
                let eights = unsafe {
                    _mm512_loadu_si512(
                        digits
                            .eights
                            .as_ptr()
                            .add((t * chunks + done) * TILE)
                            .cast(),
                    )
                };
                let sums = &pass.sums[2 * t + done % 2];
                let totals = &mut pass.totals[t];
                for j in 0..neurons {
                    // SAFETY: C's row j is 16 lanes; the pass's scales hold `units` per neuron,
                    // four from chunk `done`'s first.
                    unsafe {
                        let exact =
                            _mm512_sub_epi32(_mm512_loadu_si512(sums[j].as_ptr().cast()), eights);
                        let four = _mm_loadu_ps(pass.scales.as_ptr().add(j * units + done * 4));
                        let scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four));
                        let total = _mm512_loadu_ps(totals[j].as_ptr());
                        let total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, total);
                        _mm512_storeu_ps(totals[j].as_mut_ptr(), total);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::quant::{QuantFormat, QuantLinear};

    #[test]
    fn digits_carry_each_input_to_within_two_to_the_minus_22_of_the_row_scale() {
        let xs = [
            127.0f32, -127.0, 0.5, -0.5, 1.5, 2.5, 63.999_996, 1e-3, -3.25, 0.0,
        ];
        let mut y = xs.to_vec();
        let mut digits = vec![0i8; DIGITS * xs.len()];
        split_digits(&mut y, &mut digits);
        for (i, x) in xs.iter().enumerate() {
            let d: Vec<i8> = (0..DIGITS).map(|p| digits[p * xs.len() + i]).collect();
            assert!(d[0].unsigned_abs() <= 127 && d[1..].iter().all(|d| d.unsigned_abs() <= 64));
            let back: f64 = d
                .iter()
                .enumerate()
                .map(|(p, &d)| f64::from(d) * 2f64.powi(-DIGIT_BITS * p as i32))
                .sum();
            assert!((back - f64::from(*x)).abs() <= 2f64.powi(-22), "{x}: {d:?}");
        }
        assert_eq!(scale_exponent(127.0), 0);
        assert_eq!(scale_exponent(127.5), 1);
        assert_eq!(scale_exponent(1.0), -6);
        assert_eq!(scale_exponent(f32::MAX), 122);
        assert_eq!(scale_exponent(1e-40), -126);
    }

    /// A matrix of `n` rows of `k` INT4 weights (every nibble value), groups of `group`, with
    /// scales of mixed magnitudes.
    fn matrix(n: usize, k: usize, group: usize) -> QuantLinear {
        let packed: Vec<u32> = (0..n * k / 8)
            .map(|i| {
                (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .rotate_left(i as u32 % 32)
            })
            .collect();
        let scales: Vec<f32> = (0..n * k / group)
            .map(|i| ((i * 37 % 101) as f32 + 1.0) * 2f32.powi((i % 7) as i32 - 12))
            .collect();
        QuantLinear::int4(packed, scales, n, k, group).expect("shapes agree")
    }

    #[test]
    fn tile_products_equal_the_f64_product_of_the_dequantized_matrix() {
        if !int8_enabled() {
            crate::compute::skipped(&format!(
                "AMX-INT8 tiles are not used here ({:?})",
                super::super::status()
            ));
            return;
        }
        // Whole and partial chunks (k = 64, 160, 1024), whole and partial neuron blocks, groups
        // of 32, 64 and 128, one to eight rows; inputs of every magnitude, an outlier row.
        for (n, k, group, rows) in [
            (16, 64, 32, 2),
            (40, 160, 32, 3),
            (64, 1024, 32, 2),
            (48, 1024, 128, 8),
            (32, 256, 64, 2),
        ] {
            let m = matrix(n, k, group);
            let x: Vec<f32> = (0..rows * k)
                .map(|i| {
                    let v = ((i * 7919 % 1013) as f32 - 506.0) / 97.0;
                    if i == 5 {
                        3e4
                    } else {
                        v * 10f32.powi((i % 5) as i32 - 2)
                    }
                })
                .collect();
            let wide = m.widen();
            let QuantFormat::Int4 { packed, scales, .. } = &m.format else {
                unreachable!()
            };
            let digits = Int4Digits::new(&x, rows, k).expect("the tiles take it");
            for parallel in [false, true] {
                let mut out = vec![f32::NAN; rows * n];
                int4_product(&digits, packed, scales, group, n, &mut out, parallel);
                for r in 0..rows {
                    for j in 0..n {
                        let terms =
                            (0..k).map(|i| f64::from(x[r * k + i]) * f64::from(wide[j * k + i]));
                        let (want, size): (f64, f64) =
                            terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                        let got = f64::from(out[r * n + j]);
                        assert!(
                            (got - want).abs() <= 1e-6 * size + 1e-30,
                            "({n}, {k}, {group}, {rows}) row {r} neuron {j}: {got} against {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn vector_packing_equals_the_portable_packing() {
        if !int8_enabled() {
            crate::compute::skipped(&format!(
                "AMX-INT8 tiles are not used here ({:?})",
                super::super::status()
            ));
            return;
        }
        for (rows, k) in [(2, 32), (2, 160), (3, 1024)] {
            let x: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 1e-2 * 10f32.powi((i % 7) as i32 - 3))
                .chain([0.5, -2.5, 1.5])
                .take(rows * k)
                .collect();
            let vector = Int4Digits::new(&x, rows, k).expect("the tiles take it");
            let mut portable = Int4Digits::zeroed(rows, k);
            for (r, xr) in x.chunks_exact(k).enumerate() {
                portable.pack_row_portable(r, xr, 1.0 / vector.scales[r]);
            }
            assert_eq!(vector.tiles, portable.tiles, "{rows} x {k}");
            assert_eq!(vector.eights, portable.eights, "{rows} x {k}");
        }
    }

    #[test]
    fn inputs_the_digits_cannot_carry_are_left_to_the_other_kernels() {
        let mut x = vec![1.0; 2 * 64];
        x[70] = f32::NAN;
        assert!(Int4Digits::new(&x, 2, 64).is_none());
        x[70] = f32::NEG_INFINITY;
        assert!(Int4Digits::new(&x, 2, 64).is_none());
        assert!(
            Int4Digits::new(&[1.0; 2 * 48], 2, 48).is_none(),
            "k not whole groups"
        );
        assert!(
            Int4Digits::new(&[1.0; 9 * 64], 9, 64).is_none(),
            "too many rows"
        );
        assert!(Int4Digits::new(&[1.0; 64], 1, 64).is_none(), "one row");
    }
}
