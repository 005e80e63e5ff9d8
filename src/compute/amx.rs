//! Products of many input rows with bf16 (or FP8) weights on Intel AMX tiles (Sapphire Rapids
//! and later), exact to f32.
//!
//! An AMX-BF16 tile product multiplies bf16 pairs and accumulates in f32, at about fifteen
//! times the rate of AVX-512 f32 multiply-adds (`benches/roofline.rs` measures both). The
//! weights are bf16 already, exactly as stored (FP8 e4m3 values are exact in bf16 too). The inputs are f32: each is split
//! into three bf16 parts, `x = hi + mid + lo` (each part the residual of the ones before,
//! rounded to bf16), which carry its 24 significant bits, so every product of a weight and a
//! part is exact in f32 and the sums are f32 sums, as in the other kernels. Rounding the
//! inputs to bf16 instead (what llama.cpp's BF16 path does) is what takes its tokens away from
//! transformers'; three tile products per weight tile are the price of not drifting.
//!
//! Tiles: `C[16 neurons][16 rows] += A[16 neurons][32 k] · B[16 k pairs][16 rows][2]`. A is
//! read straight from the row-major weights (`k` apart), B is the inputs' parts transposed into
//! pairs once per product ([`PackedInputs`]), and C is written back transposed. Each thread
//! configures the tiles before its products and releases them after ([`TileSession`]).
//!
//! Linux hands a process the AMX tile state only when asked (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
//! where the CPU reports AMX but the kernel refuses (or a virtual machine hides the state),
//! products take the AVX-512 and AVX2 kernels, and [`status`] says why.

use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;

use super::quant::GroupScales;

/// Rows (and output neurons) of a tile.
const TILE: usize = 16;
/// Values of `k` a tile covers: 64 bytes of bf16.
const TILE_K: usize = 32;
/// The bf16 parts each input is split into.
const PARTS: usize = 3;
/// bf16 values in one tile (1 KiB).
const TILE_VALUES: usize = TILE * TILE_K;
/// Input rows whose packed parts one pass over the weights keeps: 8 row blocks, 24 KiB of
/// parts per 32 of `k` (768 KiB at k = 1024), so that they stay in L2 while every weight tile
/// of the pass is multiplied with them.
const ROWS_PER_PASS: usize = 8 * TILE;
/// How many tiles along `k` ahead the weight rows are prefetched.
const PREFETCH_TILES: usize = 4;
/// Output neurons one parallel task takes at least.
const NEURONS_PER_TASK: usize = 4 * TILE;

/// Products of at least this many input rows take the tiles; fewer take the decode kernels
/// and `cpu::dot_tiles`. Measured on one core of an AMX Xeon, experts of 3 x 384 x 1024 in
/// bf16, the two alternated in one process: at 4 rows the AVX-512 tiles (four rows, no lane
/// wasted) took 189 us per expert in cache against 231 on AMX, but 389 against 327 from
/// memory; at 5 rows (a tile and a row left over) 331 against 234 in cache, and at 6, 8 and
/// 12 rows AMX took 61%, 65% and 54% of their time from memory.
pub(crate) const MIN_ROWS: usize = 5;

/// Whether this process runs AMX tiles, and why not where it does not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AmxStatus {
    /// The CPU has AMX-TILE and AMX-BF16 and Linux granted the tile state.
    Enabled,
    /// Not used, for the reason given.
    Unavailable(String),
}

/// This process's AMX status, probed once: the CPU's feature bits, then the kernel's grant.
pub fn status() -> &'static AmxStatus {
    static STATUS: OnceLock<AmxStatus> = OnceLock::new();
    STATUS.get_or_init(probe)
}

/// Whether products may take the AMX tiles.
pub fn enabled() -> bool {
    *status() == AmxStatus::Enabled && !is_set_aside()
}

/// Whether [`set_aside`] turned the tiles off.
pub fn is_set_aside() -> bool {
    SET_ASIDE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Set by [`set_aside`].
static SET_ASIDE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Products leave the AMX tiles alone (`true`) or take them again where granted (`false`):
/// `devices.cpu_amx`, and benchmarks that compare the kernels side by side in one process.
pub fn set_aside(aside: bool) {
    SET_ASIDE.store(aside, std::sync::atomic::Ordering::Relaxed);
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn probe() -> AmxStatus {
    use std::arch::x86_64::__cpuid_count;
    // Leaf 0 gives the highest leaf.
    let highest = __cpuid_count(0, 0).eax;
    if highest < 7 {
        return AmxStatus::Unavailable("the CPU has no AMX".into());
    }
    let features = __cpuid_count(7, 0).edx;
    let (tile, bf16) = (features & (1 << 24) != 0, features & (1 << 22) != 0);
    if !(tile && bf16) {
        return AmxStatus::Unavailable("the CPU has no AMX-BF16".into());
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and changes only which
    // register state this process may use; it fails cleanly where the kernel will not.
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if granted != 0 {
        let error = std::io::Error::last_os_error();
        return AmxStatus::Unavailable(format!(
            "the CPU reports AMX-BF16 but Linux refused its tile state ({error})"
        ));
    }
    AmxStatus::Enabled
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn probe() -> AmxStatus {
    AmxStatus::Unavailable("AMX tiles are used on x86_64 Linux only".into())
}

/// The inputs of a product split into three bf16 parts and laid out as the B tiles take them:
/// per block of 16 rows (the last one padded with zeros), per 32 of `k`, per part, a tile of 16
/// rows of `k` pairs by 16 input rows. Products that share their input (an expert's gate and
/// up) share one packing.
pub struct PackedInputs {
    tiles: Vec<u16>,
    rows: usize,
    k: usize,
}

impl PackedInputs {
    /// `x [rows, k]`, split and packed; `None` where the tiles do not apply (AMX not
    /// enabled, fewer than [`MIN_ROWS`] rows, or `k` not a multiple of 32).
    pub fn new(x: &[f32], rows: usize, k: usize) -> Option<PackedInputs> {
        if !enabled() || rows < MIN_ROWS || k == 0 || !k.is_multiple_of(TILE_K) {
            return None;
        }
        Some(Self::pack(x, rows, k))
    }

    fn pack(x: &[f32], rows: usize, k: usize) -> PackedInputs {
        assert_eq!(x.len(), rows * k, "input size");
        let mut tiles = vec![0u16; rows.div_ceil(TILE) * (k / TILE_K) * PARTS * TILE_VALUES];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU has AVX-512 F and BW; `tiles` holds every tile of `rows` x `k`
            // inputs, and `x` holds `rows` rows of `k`.
            unsafe { pack_avx512(x, rows, k, &mut tiles) };
            return PackedInputs { tiles, rows, k };
        }
        Self::pack_portable(x, rows, k, &mut tiles);
        PackedInputs { tiles, rows, k }
    }

    /// [`PackedInputs::pack`] one value at a time (`split`): where AVX-512 BW is absent,
    /// and the reference its vector form is tested against.
    fn pack_portable(x: &[f32], rows: usize, k: usize, tiles: &mut [u16]) {
        assert_eq!(x.len(), rows * k, "input size");
        let k_blocks = k / TILE_K;
        // One tile per (row block, k block, part); within it, value j of pair q of row r is at
        // q * 32 + r * 2 + j.
        for (r, row) in x.chunks_exact(k).enumerate() {
            let (block, within) = (r / TILE, r % TILE);
            for (kb, values) in row.chunks_exact(TILE_K).enumerate() {
                let first = (block * k_blocks + kb) * PARTS * TILE_VALUES + within * 2;
                for (i, &v) in values.iter().enumerate() {
                    let at = first + (i / 2) * 2 * TILE + i % 2;
                    let parts = split(v);
                    for (p, part) in parts.into_iter().enumerate() {
                        tiles[at + p * TILE_VALUES] = part;
                    }
                }
            }
        }
    }

    fn k_blocks(&self) -> usize {
        self.k / TILE_K
    }

    /// The tile of `part` for row block `block` and k block 0 (the k blocks follow, each
    /// `PARTS` tiles on).
    fn tile(&self, block: usize, part: usize) -> *const u16 {
        let at = (block * self.k_blocks() * PARTS + part) * TILE_VALUES;
        self.tiles[at..].as_ptr()
    }
}

/// `v` as three bf16 parts (bits), each rounded to nearest from what the ones before left:
/// their sum is `v` to within f32 rounding (exactly, but for values within 2^16 of the
/// smallest normal, whose last part AMX reads as zero).
fn split(v: f32) -> [u16; 3] {
    let hi = bf16::from_f32(v);
    let rest = v - hi.to_f32();
    let mid = bf16::from_f32(rest);
    let lo = bf16::from_f32(rest - mid.to_f32());
    [hi.to_bits(), mid.to_bits(), lo.to_bits()]
}

/// [`PackedInputs::pack`] with AVX-512: for each pair `q` of a k block, the pairs of the 16
/// rows of a row block are gathered (two gathers of 8 pairs), split into parts in f32 lanes
/// (rounding to bf16 with integer arithmetic, to nearest even, as `split`), and the parts'
/// upper halves compacted into one tile row per part.
///
/// # Safety
/// The CPU has AVX-512 F and BW; `x` holds `rows` rows of `k` (a multiple of 32) and `tiles`
/// every tile of them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_avx512(x: &[f32], rows: usize, k: usize, tiles: &mut [u16]) {
    use std::arch::x86_64::*;
    let k_blocks = k / TILE_K;
    assert!(
        x.len() >= rows * k && tiles.len() >= rows.div_ceil(TILE) * k_blocks * PARTS * TILE_VALUES
    );
    // Rounds each lane's f32 to the nearest bf16 (ties to even), kept in the upper half.
    let round = |bits: __m512i| {
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let biased = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
        _mm512_and_si512(biased, _mm512_set1_epi32(0xffff_0000u32 as i32))
    };
    // The upper 16 bits of every 32-bit lane of two vectors, in order: the bf16 values.
    let upper_halves = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19,
        17, 15, 13, 11, 9, 7, 5, 3, 1,
    );
    let row_bytes = (k * 4) as i32;
    let first_eight = _mm256_mullo_epi32(
        _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0),
        _mm256_set1_epi32(row_bytes),
    );
    let next_eight = _mm256_add_epi32(first_eight, _mm256_set1_epi32(8 * row_bytes));
    for block in 0..rows.div_ceil(TILE) {
        let valid = TILE.min(rows - block * TILE);
        let mask =
            |from: usize| -> __mmask8 { ((1u32 << valid.saturating_sub(from).min(8)) - 1) as u8 };
        let (low_mask, high_mask) = (mask(0), mask(8));
        // SAFETY: row block `block` starts inside `x`; every gathered lane is a row below
        // `rows` (the masks leave the others out) at a pair below `k`.
        let rows_at = unsafe { x.as_ptr().add(block * TILE * k) };
        for kb in 0..k_blocks {
            let out = (block * k_blocks + kb) * PARTS * TILE_VALUES;
            for q in 0..TILE {
                let pair = unsafe { rows_at.add(kb * TILE_K + 2 * q) } as *const u8;
                let low = unsafe {
                    _mm512_mask_i32gather_epi64::<1>(
                        _mm512_setzero_si512(),
                        low_mask,
                        first_eight,
                        pair as *const i64,
                    )
                };
                let high = unsafe {
                    _mm512_mask_i32gather_epi64::<1>(
                        _mm512_setzero_si512(),
                        high_mask,
                        next_eight,
                        pair as *const i64,
                    )
                };
                let mut rest = [low, high];
                for part in 0..PARTS {
                    let rounded = rest.map(round);
                    for (r, p) in rest.iter_mut().zip(rounded) {
                        *r = _mm512_castps_si512(_mm512_sub_ps(
                            _mm512_castsi512_ps(*r),
                            _mm512_castsi512_ps(p),
                        ));
                    }
                    let words = _mm512_permutex2var_epi16(rounded[0], upper_halves, rounded[1]);
                    // SAFETY: tile `part` of this block lies inside `tiles` (asserted above).
                    unsafe {
                        _mm512_storeu_si512(
                            tiles
                                .as_mut_ptr()
                                .add(out + part * TILE_VALUES + q * 2 * TILE)
                                as *mut __m512i,
                            words,
                        )
                    };
                }
            }
        }
    }
}

/// Whether the tiles take products of `n` output neurons (whole tiles of 16).
pub(crate) fn takes_outputs(n: usize) -> bool {
    n > 0 && n.is_multiple_of(TILE)
}

/// The weights of a product on the tiles, `[n, k]` row-major: bf16, read as they are; FP8
/// e4m3 bytes, whose values bf16 holds exactly (a 4-bit significand and an exponent within
/// bf16's); or INT4 nibbles (compressed-tensors pack-quantized: eight a word, each its value
/// plus 8), whose values -8..7 bf16 holds exactly. FP8 and INT4 are made bf16 one pair of
/// 16-row blocks at a time, their products summed apart per scale block or group and weighed
/// by its scale.
#[derive(Clone, Copy)]
pub(crate) enum TileWeights<'a> {
    Bf16(&'a [bf16]),
    E4m3 {
        bytes: &'a [u8],
        scales: BlockScales<'a>,
    },
    Int4 {
        words: &'a [u32],
        /// A scale per neuron and group: `scales[neuron * k / group + group index]`.
        scales: &'a GroupScales,
        group: usize,
    },
}

/// Whether the tiles take INT4 weights in groups of `group` over `k` inputs: whole 32-value
/// steps per group.
pub(crate) fn takes_int4_groups(k: usize, group: usize) -> bool {
    group > 0 && group.is_multiple_of(TILE_K) && k.is_multiple_of(group)
}

/// A scale per block of `rows` x `cols` weights, `scales[block row * k.div_ceil(cols) + block
/// column]`. On the tiles each block column's products are summed apart, then weighed by its
/// scale: the inputs are packed once for the whole product.
#[derive(Clone, Copy)]
pub(crate) struct BlockScales<'a> {
    pub scales: &'a [f32],
    pub rows: usize,
    pub cols: usize,
}

/// Whether the tiles take weights scaled in blocks of `rows` x `cols`: each 16-neuron tile
/// within one block row, each block column whole 32-value steps.
pub(crate) fn takes_scale_blocks(rows: usize, cols: usize) -> bool {
    takes_outputs(rows) && cols > 0 && cols.is_multiple_of(TILE_K)
}

impl TileWeights<'_> {
    fn len(self) -> usize {
        match self {
            TileWeights::Bf16(w) => w.len(),
            TileWeights::E4m3 { bytes, .. } => bytes.len(),
            TileWeights::Int4 { words, .. } => 8 * words.len(),
        }
    }
}

/// `out [rows, n] = inputs · w [n, k]ᵀ` on AMX tiles, output row `r` at `out[r * out_stride..]`
/// (a product may fill some of the columns of a wider output); false, having done nothing,
/// where `n` is not a multiple of 16 (the caller takes another kernel). `parallel` spreads
/// the output neurons over the rayon pool.
pub(crate) fn matmul_transposed(
    inputs: &PackedInputs,
    weights: TileWeights,
    n: usize,
    out: &mut [f32],
    out_stride: usize,
    parallel: bool,
) -> bool {
    let (rows, k) = (inputs.rows, inputs.k);
    if !takes_outputs(n) {
        return false;
    }
    assert_eq!(weights.len(), n * k, "weight size");
    assert!(
        n <= out_stride && out.len() >= (rows - 1) * out_stride + n,
        "output size"
    );
    match weights {
        TileWeights::Bf16(_) => {}
        TileWeights::E4m3 { scales, .. } => {
            assert!(takes_scale_blocks(scales.rows, scales.cols), "scale blocks");
            assert!(
                scales.scales.len() >= n.div_ceil(scales.rows) * k.div_ceil(scales.cols),
                "scale count"
            );
        }
        TileWeights::Int4 { scales, group, .. } => {
            assert!(takes_int4_groups(k, group), "INT4 groups");
            assert!(scales.len() >= n * (k / group), "scale count");
        }
    }
    let out_at = super::cpu::SharedOut::new(out);
    let neuron_blocks = n / TILE;
    let run = |first_block: usize, blocks: usize| {
        let session = TileSession::start();
        // FP8 or INT4 rows made bf16, one pair of blocks at a time, and INT4's scales of
        // those rows.
        let mut widened = Vec::new();
        let mut neuron_scales = Vec::new();
        for first_row in (0..rows).step_by(ROWS_PER_PASS) {
            let pass_rows = ROWS_PER_PASS.min(rows - first_row);
            for nb in (first_block..first_block + blocks).step_by(2) {
                let neuron_pair = 2.min(first_block + blocks - nb);
                let (w, first, scaled) = match weights {
                    TileWeights::Bf16(w) => (w, nb, None),
                    TileWeights::E4m3 { bytes, scales } => {
                        let span = nb * TILE * k..(nb + neuron_pair) * TILE * k;
                        e4m3_to_bf16(&bytes[span], &mut widened);
                        // Each neuron block's row of block scales.
                        let per_row = k.div_ceil(scales.cols);
                        let row_of = |a: usize| {
                            let block_row = (nb + a.min(neuron_pair - 1)) * TILE / scales.rows;
                            &scales.scales[block_row * per_row..][..per_row]
                        };
                        let scaling = Scaling::PerBlock([row_of(0), row_of(1)]);
                        (&widened[..], 0, Some((scaling, scales.cols)))
                    }
                    TileWeights::Int4 {
                        words,
                        scales,
                        group,
                    } => {
                        let row_words = k / 8;
                        let span = nb * TILE * row_words..(nb + neuron_pair) * TILE * row_words;
                        int4_to_bf16(&words[span], &mut widened);
                        let groups = k / group;
                        let per_block = TILE * groups;
                        neuron_scales.resize(neuron_pair * per_block, 0.0);
                        scales.read_into(nb * per_block, &mut neuron_scales);
                        let last = &neuron_scales[(neuron_pair - 1) * per_block..];
                        let scaling =
                            Scaling::PerNeuron([&neuron_scales[..per_block], last], groups);
                        (&widened[..], 0, Some((scaling, group)))
                    }
                };
                for rb in (first_row / TILE..(first_row + pass_rows).div_ceil(TILE)).step_by(2) {
                    let row_pair = 2.min(rows.div_ceil(TILE) - rb);
                    let w = &w[first * TILE * k..];
                    let sums = session.block(inputs, w, rb, neuron_pair, row_pair, scaled);
                    // SAFETY: this task alone writes neurons of blocks first_block..+blocks,
                    // of every row, and `out` outlives the tasks (its size asserted above).
                    unsafe {
                        scatter(
                            &sums,
                            out_at,
                            rows,
                            out_stride,
                            nb,
                            rb,
                            neuron_pair,
                            row_pair,
                        )
                    };
                }
            }
        }
    };
    let flops = rows * n * k;
    if parallel && flops >= super::cpu::PARALLEL_MIN_FLOPS {
        let per_task = (neuron_blocks.div_ceil(4 * rayon::current_num_threads()))
            .max(NEURONS_PER_TASK / TILE)
            .next_multiple_of(2);
        (0..neuron_blocks.div_ceil(per_task))
            .into_par_iter()
            .for_each(|t| run(t * per_task, per_task.min(neuron_blocks - t * per_task)));
    } else {
        run(0, neuron_blocks);
    }
    true
}

/// `bytes` (FP8 e4m3) as bf16 in `out`, exactly: e4m3's 3 mantissa bits fit bf16's 7 and its
/// exponents bf16's.
fn e4m3_to_bf16(bytes: &[u8], out: &mut Vec<bf16>) {
    out.clear();
    out.reserve(bytes.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bw") {
        let whole = bytes.len() / 32 * 32;
        // SAFETY: the CPU has AVX-512 F and BW; `out` has room for every byte's value.
        unsafe {
            e4m3_to_bf16_avx512(&bytes[..whole], out.spare_capacity_mut());
            out.set_len(whole);
        }
        out.extend(bytes[whole..].iter().map(|&b| e4m3_bf16(b)));
        return;
    }
    out.extend(bytes.iter().map(|&b| e4m3_bf16(b)));
}

/// INT4 `words` (eight nibbles each, lowest first, each its value plus 8) as bf16 in `out`,
/// exactly: the values -8..7.
fn int4_to_bf16(words: &[u32], out: &mut Vec<bf16>) {
    out.clear();
    out.reserve(8 * words.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bw") {
        let whole = words.len() / 4 * 4;
        // SAFETY: the CPU has AVX-512 F and BW; `out` has room for every word's values.
        unsafe {
            int4_to_bf16_avx512(&words[..whole], out.spare_capacity_mut());
            out.set_len(8 * whole);
        }
        out.extend(words[whole..].iter().flat_map(|&w| int4_values(w)));
        return;
    }
    out.extend(words.iter().flat_map(|&w| int4_values(w)));
}

/// The eight values of an INT4 word, as bf16.
fn int4_values(word: u32) -> [bf16; 8] {
    std::array::from_fn(|j| bf16::from_f32(((word >> (4 * j)) & 0xf) as f32 - 8.0))
}

/// [`int4_to_bf16`] with AVX-512, four words (32 values) at a time: the nibbles masked apart
/// and interleaved (low nibble first), widened to words, and looked up in a 16-entry table of
/// the bf16 of `nibble - 8`.
///
/// # Safety
/// The CPU has AVX-512 F and BW; `words.len()` is a multiple of 4 and `out` has room for
/// eight values per word.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn int4_to_bf16_avx512(words: &[u32], out: &mut [std::mem::MaybeUninit<half::bf16>]) {
    use std::arch::x86_64::*;
    assert!(words.len().is_multiple_of(4) && out.len() >= 8 * words.len());
    let table: [u16; 32] =
        std::array::from_fn(|i| half::bf16::from_f32((i % 16) as f32 - 8.0).to_bits());
    // SAFETY (the whole body): the assert bounds every load and store; `table` is 64 bytes.
    unsafe {
        let table = _mm512_loadu_si512(table.as_ptr().cast());
        let low4 = _mm_set1_epi8(0x0f);
        for (i, at) in (0..words.len()).step_by(4).enumerate() {
            let bytes = _mm_loadu_si128(words.as_ptr().add(at).cast());
            let low = _mm_and_si128(bytes, low4);
            let high = _mm_and_si128(_mm_srli_epi16::<4>(bytes), low4);
            // Byte b holds values 2b (low nibble) and 2b + 1 (high).
            let first = _mm_unpacklo_epi8(low, high);
            let second = _mm_unpackhi_epi8(low, high);
            let nibbles = _mm256_set_m128i(second, first);
            let values = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nibbles), table);
            _mm512_storeu_si512(out.as_mut_ptr().add(32 * i).cast(), values);
        }
    }
}

/// One e4m3 byte as bf16 (the upper half of its f32 value, which it holds exactly).
fn e4m3_bf16(byte: u8) -> bf16 {
    bf16::from_bits((super::quant::e4m3_to_f32(byte).to_bits() >> 16) as u16)
}

/// The bf16 bits of the 128 unsigned e4m3 values, in the four 32-word registers the
/// two-register word permutes read.
fn e4m3_bf16_table() -> &'static [[u16; 32]; 4] {
    static TABLE: OnceLock<[[u16; 32]; 4]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = [[0u16; 32]; 4];
        for byte in 0..128u8 {
            table[byte as usize / 32][byte as usize % 32] = e4m3_bf16(byte).to_bits();
        }
        table
    })
}

/// [`e4m3_to_bf16`] with AVX-512, 32 bytes at a time: the low 7 bits of each byte look up its
/// magnitude (two table permutes, one per half of the table, and a blend on bit 6), the sign
/// moves to bit 15. About 8 instructions for 32 values, against the f32 route's 2 x 5 and a
/// narrowing.
///
/// # Safety
/// The CPU has AVX-512 F and BW; `bytes.len()` is a multiple of 32 and `out` has room for it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn e4m3_to_bf16_avx512(bytes: &[u8], out: &mut [std::mem::MaybeUninit<bf16>]) {
    use std::arch::x86_64::*;
    assert!(bytes.len().is_multiple_of(32) && out.len() >= bytes.len());
    let table = e4m3_bf16_table();
    // SAFETY (the whole body): the assert bounds every load and store; the table's rows are
    // 64 bytes each.
    unsafe {
        let t = table.map(|row| _mm512_loadu_si512(row.as_ptr().cast()));
        let low7 = _mm512_set1_epi16(0x7f);
        let bit6 = _mm512_set1_epi16(0x40);
        let sign = _mm512_set1_epi16(0x80);
        for at in (0..bytes.len()).step_by(32) {
            let b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(bytes.as_ptr().add(at).cast()));
            let index = _mm512_and_si512(b, low7);
            // Bits 0-5 pick a word of the register pair (bit 5: which register).
            let first = _mm512_permutex2var_epi16(t[0], index, t[1]);
            let second = _mm512_permutex2var_epi16(t[2], index, t[3]);
            let magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, bit6), first, second);
            let signs = _mm512_slli_epi16::<8>(_mm512_and_si512(b, sign));
            _mm512_storeu_si512(
                out.as_mut_ptr().add(at).cast(),
                _mm512_or_si512(magnitude, signs),
            );
        }
    }
}

/// Writes the sums of a block (`sums[c]`: tile `c = neuron half * 2 + row half`, 16 neurons
/// by 16 rows) into `out`, row `r` at `r * n` (the output's stride), leaving out padded rows.
///
/// # Safety
/// No other thread writes these elements of `out` meanwhile; `out` holds the `rows` rows of
/// the block's neurons.
#[allow(clippy::too_many_arguments)]
unsafe fn scatter(
    sums: &[[f32; TILE * TILE]; 4],
    out: super::cpu::SharedOut,
    rows: usize,
    n: usize,
    nb: usize,
    rb: usize,
    neuron_pair: usize,
    row_pair: usize,
) {
    for a in 0..neuron_pair {
        for b in 0..row_pair {
            let tile = &sums[a * 2 + b];
            let first_row = (rb + b) * TILE;
            for r in 0..TILE.min(rows - first_row) {
                for c in 0..TILE {
                    // SAFETY: row first_row + r < rows and neuron (nb + a) * 16 + c < n.
                    unsafe {
                        *out.get().add((first_row + r) * n + (nb + a) * TILE + c) =
                            tile[c * TILE + r]
                    };
                }
            }
        }
    }
}

/// The tile configuration every product uses (palette 1): tiles 0-3 hold sums (16 rows of 16
/// f32), 4-5 weights (16 rows of 32 bf16), 6-7 input parts (16 rows of 16 bf16 pairs); all are
/// 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

static CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// The tiles configured on this thread, released when dropped. Only made where AMX is enabled.
struct TileSession {
    /// Tile state is per thread: the session must end on the thread that started it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl TileSession {
    fn start() -> TileSession {
        assert_eq!(
            status(),
            &AmxStatus::Enabled,
            "AMX tiles used where Linux did not grant them"
        );
        // SAFETY: enabled() saw AMX-TILE and the kernel's grant of the tile state; CONFIG is a
        // valid palette-1 configuration (8 tiles of at most 16 rows of 64 bytes).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("ldtilecfg [{0}]", in(reg) &CONFIG as *const TileConfig, options(nostack, readonly));
        }
        TileSession {
            _not_send: std::marker::PhantomData,
        }
    }

    /// The sums of `neuron_pair` (1 or 2) blocks of 16 weight rows from the start of `w` by
    /// `row_pair` (1 or 2) blocks of 16 input rows from block `rb`, over all of `k`; with
    /// `scaled` (the scales, one per `cols` of `k` for a neuron block or for each neuron),
    /// each block column's sums weighed by its scale.
    fn block(
        &self,
        inputs: &PackedInputs,
        w: &[bf16],
        rb: usize,
        neuron_pair: usize,
        row_pair: usize,
        scaled: Option<(Scaling<'_>, usize)>,
    ) -> [[f32; TILE * TILE]; 4] {
        let k = inputs.k;
        if let Some((scales, cols)) = scaled {
            assert!(cols.is_multiple_of(TILE_K), "scale block columns");
            let columns = k.div_ceil(cols);
            match scales {
                Scaling::PerBlock(s) => assert!(s.iter().all(|s| s.len() >= columns), "scales"),
                Scaling::PerNeuron(s, per_neuron) => assert!(
                    per_neuron >= columns && s.iter().all(|s| s.len() >= TILE * per_neuron),
                    "scales"
                ),
            }
        }
        assert!(neuron_pair * TILE * k <= w.len(), "weight blocks");
        assert!(rb + row_pair <= inputs.rows.div_ceil(TILE), "row blocks");
        let mut sums = [[0.0f32; TILE * TILE]; 4];
        // SAFETY: the session configured the tiles on this thread; the asserts above keep
        // every weight tile (16 rows of 64 bytes, k * 2 bytes apart) inside `w`, and every
        // input tile inside the packing, which holds all row blocks for every k block.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            let weights = w.as_ptr();
            let inputs_at = [inputs.tile(rb, 0), inputs.tile(rb + row_pair - 1, 0)];
            let at = TileOperands {
                weights,
                k,
                inputs: inputs_at,
            };
            match (neuron_pair, row_pair, scaled) {
                (2, 2, None) => tile_block::<2, 2>(at, &mut sums),
                (2, _, None) => tile_block::<2, 1>(at, &mut sums),
                (_, 2, None) => tile_block::<1, 2>(at, &mut sums),
                (_, _, None) => tile_block::<1, 1>(at, &mut sums),
                (2, 2, Some((scales, cols))) => {
                    tile_block_scaled::<2, 2>(at, scales, cols / TILE_K, &mut sums)
                }
                (2, _, Some((scales, cols))) => {
                    tile_block_scaled::<2, 1>(at, scales, cols / TILE_K, &mut sums)
                }
                (_, 2, Some((scales, cols))) => {
                    tile_block_scaled::<1, 2>(at, scales, cols / TILE_K, &mut sums)
                }
                (_, _, Some((scales, cols))) => {
                    tile_block_scaled::<1, 1>(at, scales, cols / TILE_K, &mut sums)
                }
            }
        }
        sums
    }
}

impl Drop for TileSession {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured on this thread (TileSession is not Send);
        // releasing returns them to their initial state.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem));
        }
    }
}

/// The tile instructions, each naming its tile registers (which the compiler does not
/// allocate: they are written into the instruction).
#[cfg(target_arch = "x86_64")]
macro_rules! tile {
    (zero $t:literal) => {
        std::arch::asm!(concat!("tilezero tmm", $t), options(nostack, nomem))
    };
    (load $t:literal, $at:expr, $stride:expr) => {
        std::arch::asm!(concat!("tileloadd tmm", $t, ", [{0} + {1}]"),
            in(reg) $at, in(reg) $stride, options(nostack, readonly))
    };
    (store $t:literal, $at:expr) => {
        std::arch::asm!(concat!("tilestored [{0} + {1}], tmm", $t),
            in(reg) $at, in(reg) 4 * TILE, options(nostack))
    };
    (dot $c:literal, $a:literal, $b:literal) => {
        std::arch::asm!(concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem))
    };
    // Unsigned bytes of A times signed bytes of B, four at a time, summed into i32.
    (dot_bytes $c:literal, $a:literal, $b:literal) => {
        std::arch::asm!(concat!("tdpbusd tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem))
    };
}

/// Where a block's tile operands are: `NB * 16` weight rows of `k` bf16 from `weights`, and
/// the packed tiles of up to two input row blocks (all k blocks) from `inputs[0]`, `inputs[1]`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct TileOperands {
    weights: *const bf16,
    k: usize,
    inputs: [*const u16; 2],
}

/// Sums of `NB` weight blocks (tiles 4, 5) by `RB` input row blocks (tiles 6, 7) into tiles
/// 0-3 (sum `a * 2 + b` of weight block `a` and row block `b`), over every k block and part,
/// stored into `sums`.
///
/// # Safety
/// Tiles configured as [`CONFIG`] on this thread; `at` bounds every weight and input tile.
#[cfg(target_arch = "x86_64")]
unsafe fn tile_block<const NB: usize, const RB: usize>(
    at: TileOperands,
    sums: &mut [[f32; TILE * TILE]; 4],
) {
    // SAFETY (the whole body): the caller's contract.
    unsafe {
        tile!(zero 0);
        tile!(zero 1);
        tile!(zero 2);
        tile!(zero 3);
        tile_steps::<NB, RB>(at, 0..at.k / TILE_K);
        store_sums(sums);
    }
}

/// As [`tile_block`], with the sums of every `steps` k blocks (a block column of the scales)
/// made apart and added into `sums` weighed by that column's scales.
///
/// # Safety
/// As [`tile_block`]; `scales` holds a scale per `steps` k blocks (checked by `block`).
#[cfg(target_arch = "x86_64")]
unsafe fn tile_block_scaled<const NB: usize, const RB: usize>(
    at: TileOperands,
    scales: Scaling,
    steps: usize,
    sums: &mut [[f32; TILE * TILE]; 4],
) {
    let k_blocks = at.k / TILE_K;
    let mut column_sums = [[0.0f32; TILE * TILE]; 4];
    *sums = [[0.0; TILE * TILE]; 4];
    for (column, first) in (0..k_blocks).step_by(steps).enumerate() {
        // SAFETY: the caller's contract.
        unsafe {
            tile!(zero 0);
            tile!(zero 1);
            tile!(zero 2);
            tile!(zero 3);
            tile_steps::<NB, RB>(at, first..(first + steps).min(k_blocks));
            store_sums(&mut column_sums);
        }
        for a in 0..NB {
            // The scale of each of the block's 16 neurons (the rows of its sum tiles).
            let neuron_scales: [f32; TILE] = match scales {
                Scaling::PerBlock(s) => [s[a][column]; TILE],
                Scaling::PerNeuron(s, per_neuron) => {
                    std::array::from_fn(|c| s[a][c * per_neuron + column])
                }
            };
            for b in 0..RB {
                add_scaled(
                    &mut sums[a * 2 + b],
                    &column_sums[a * 2 + b],
                    &neuron_scales,
                );
            }
        }
    }
}

/// The scales of a product whose sums are weighed per block column (see `block`).
#[derive(Clone, Copy)]
enum Scaling<'a> {
    /// One scale per column for all 16 neurons of weight block `a`: `[a][column]` (FP8).
    PerBlock([&'a [f32]; 2]),
    /// A scale per neuron and column: `[a][neuron * .1 + column]` (INT4 groups).
    PerNeuron([&'a [f32]; 2], usize),
}

/// `sum += scale * part`, each sum tile row (a neuron) by its own scale, with AVX-512 where
/// the CPU has it (every CPU with AMX does).
#[cfg(target_arch = "x86_64")]
fn add_scaled(sum: &mut [f32; TILE * TILE], part: &[f32; TILE * TILE], scales: &[f32; TILE]) {
    fn each(sum: &mut [f32; TILE * TILE], part: &[f32; TILE * TILE], scales: &[f32; TILE]) {
        for ((s, p), &scale) in sum
            .chunks_exact_mut(TILE)
            .zip(part.chunks_exact(TILE))
            .zip(scales)
        {
            for (s, p) in s.iter_mut().zip(p) {
                *s += scale * p;
            }
        }
    }
    #[target_feature(enable = "avx512f")]
    fn wide(sum: &mut [f32; TILE * TILE], part: &[f32; TILE * TILE], scales: &[f32; TILE]) {
        use std::arch::x86_64::*;
        for (c, &scale) in scales.iter().enumerate() {
            // SAFETY: row c of both tiles is 16 f32 inside them.
            unsafe {
                let at = sum.as_mut_ptr().add(c * TILE);
                let p = _mm512_loadu_ps(part.as_ptr().add(c * TILE));
                let s = _mm512_loadu_ps(at);
                _mm512_storeu_ps(at, _mm512_fmadd_ps(_mm512_set1_ps(scale), p, s));
            }
        }
    }
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512 F.
        unsafe { wide(sum, part, scales) }
    } else {
        each(sum, part, scales)
    }
}

/// Tiles 0-3 into `sums`.
///
/// # Safety
/// Tiles configured as [`CONFIG`] on this thread.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_sums(sums: &mut [[f32; TILE * TILE]; 4]) {
    // SAFETY: each sum holds a 16 x 16 f32 tile.
    unsafe {
        tile!(store 0, sums[0].as_mut_ptr());
        tile!(store 1, sums[1].as_mut_ptr());
        tile!(store 2, sums[2].as_mut_ptr());
        tile!(store 3, sums[3].as_mut_ptr());
    }
}

/// Adds the products of k blocks `k_blocks` into tiles 0-3.
///
/// # Safety
/// As [`tile_block`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_steps<const NB: usize, const RB: usize>(
    at: TileOperands,
    k_blocks: std::ops::Range<usize>,
) {
    let (k, inputs) = (at.k, at.inputs);
    // SAFETY (the whole body): the caller's contract bounds every address below.
    unsafe {
        for kb in k_blocks {
            let a = at.weights.add(kb * TILE_K);
            // The weight rows' lines PREFETCH_TILES tiles on: a tile load that misses the
            // caches waits on its 16 lines.
            if kb + PREFETCH_TILES < k / TILE_K {
                for row in 0..NB * TILE {
                    let ahead = a.add(row * k + PREFETCH_TILES * TILE_K) as *const i8;
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ahead);
                }
            }
            tile!(load 4, a, 2 * k);
            if NB == 2 {
                tile!(load 5, a.add(TILE * k), 2 * k);
            }
            for part in 0..PARTS {
                let at = (kb * PARTS + part) * TILE_VALUES;
                tile!(load 6, inputs[0].add(at), 4 * TILE);
                if RB == 2 {
                    tile!(load 7, inputs[1].add(at), 4 * TILE);
                }
                tile!(dot 0, 4, 6);
                if RB == 2 {
                    tile!(dot 1, 4, 7);
                }
                if NB == 2 {
                    tile!(dot 2, 5, 6);
                }
                if NB == 2 && RB == 2 {
                    tile!(dot 3, 5, 7);
                }
            }
        }
    }
}

pub(crate) mod int4;
pub(crate) use int4::{Int4Digits, int4_product};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::cpu::tests::naive;

    #[test]
    fn int4_words_become_their_values_in_bf16() {
        // Every nibble in every position, in a run long enough for the four-word vector steps
        // and a tail of three.
        let words: Vec<u32> = (0..23u32)
            .map(|i| (0..8).fold(0, |w, j| w | (((i + 3 * j) % 16) << (4 * j))))
            .collect();
        let mut out = Vec::new();
        int4_to_bf16(&words, &mut out);
        assert_eq!(out.len(), 8 * words.len());
        for (i, v) in out.iter().enumerate() {
            let nibble = (words[i / 8] >> (4 * (i % 8))) & 0xf;
            assert_eq!(v.to_f32(), nibble as f32 - 8.0, "value {i}");
        }
    }

    #[test]
    fn every_e4m3_byte_becomes_its_bf16_value() {
        // Every byte, in a run long enough for the 32-byte vector steps and a tail.
        let bytes: Vec<u8> = (0..=255u8).chain(0..=40).collect();
        let mut out = Vec::new();
        e4m3_to_bf16(&bytes, &mut out);
        assert_eq!(out.len(), bytes.len());
        for (&b, v) in bytes.iter().zip(&out) {
            let expected = crate::compute::quant::e4m3_to_f32(b);
            assert_eq!(v.to_f32().to_bits(), expected.to_bits(), "byte {b:#04x}");
        }
    }

    #[test]
    fn three_parts_carry_every_bit_of_an_f32() {
        for v in [
            1.0f32,
            -2.718_281_7,
            1e-20,
            6.5e4,
            0.1,
            -0.333_333_34,
            123_456.79,
        ] {
            let [hi, mid, lo] = split(v).map(|b| bf16::from_bits(b).to_f32() as f64);
            assert_eq!(hi + mid + lo, v as f64, "{v}");
        }
    }

    #[test]
    fn vector_packing_equals_the_portable_packing() {
        #[cfg(target_arch = "x86_64")]
        {
            if !std::arch::is_x86_feature_detected!("avx512bw") {
                crate::compute::skipped("this CPU has no AVX-512 BW");
                return;
            }
            // Partial row blocks (5, 21 rows), values of every magnitude and sign, ties.
            for (rows, k) in [(5, 32), (21, 96), (16, 64)] {
                let x: Vec<f32> = (0..rows * k)
                    .map(|i| {
                        let v = ((i * 7919 % 1013) as f32 - 506.0) * 1.37e-3;
                        v * 10f32.powi((i % 9) as i32 - 4)
                    })
                    .chain([1.0 + 2f32.powi(-8), -(1.0 + 3.0 * 2f32.powi(-8))])
                    .take(rows * k)
                    .collect();
                let size = rows.div_ceil(TILE) * (k / TILE_K) * PARTS * TILE_VALUES;
                let (mut vector, mut portable) = (vec![7u16; size], vec![0u16; size]);
                // SAFETY: the CPU has AVX-512 BW (checked above); the sizes match.
                unsafe { pack_avx512(&x, rows, k, &mut vector) };
                PackedInputs::pack_portable(&x, rows, k, &mut portable);
                assert_eq!(vector, portable, "{rows} x {k}");
            }
        }
    }

    #[test]
    fn amx_products_match_the_naive_product_at_every_edge() {
        if !enabled() {
            crate::compute::skipped(&format!("AMX tiles are not used here ({:?})", status()));
            return;
        }
        // Row blocks whole, partial and odd in number (5, 17, 33, 40, 200 rows: 200 is more
        // than one pass); neuron blocks even and odd (16, 48, 64); k of one and many blocks.
        for (m, k, n) in [
            (5, 32, 16),
            (17, 64, 48),
            (33, 96, 64),
            (40, 1024, 48),
            (200, 128, 32),
        ] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.3 + (i as f32 * 1e-3).sin())
                .collect();
            let w: Vec<bf16> = (0..n * k)
                .map(|i| bf16::from_f32(((i * 5 % 19) as f32 - 9.0) / 16.0))
                .collect();
            let wide: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            let expected = naive(&x, m, k, &wide, n);
            let inputs = PackedInputs::new(&x, m, k).expect("AMX applies");
            for parallel in [false, true] {
                let mut out = vec![f32::NAN; m * n];
                assert!(matmul_transposed(
                    &inputs,
                    TileWeights::Bf16(&w),
                    n,
                    &mut out,
                    n,
                    parallel
                ));
                for (i, (got, want)) in out.iter().zip(&expected).enumerate() {
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "({m}, {k}, {n}) at {i}: {got} against {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn shapes_the_tiles_do_not_cover_are_left_to_other_kernels() {
        if !enabled() {
            crate::compute::skipped(&format!("AMX tiles are not used here ({:?})", status()));
            return;
        }
        assert!(
            PackedInputs::new(&[0.0; 8 * 40], 8, 40).is_none(),
            "k not whole tiles"
        );
        assert!(
            PackedInputs::new(&[0.0; 4 * 32], 4, 32).is_none(),
            "too few rows"
        );
        let inputs = PackedInputs::new(&[1.0; 8 * 32], 8, 32).expect("AMX applies");
        let mut out = vec![0.0; 8 * 20];
        let weights = TileWeights::Bf16(&[bf16::ONE; 20 * 32]);
        assert!(!matmul_transposed(
            &inputs, weights, 20, &mut out, 20, false
        ));
    }
}
