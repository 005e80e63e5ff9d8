//! The shape of the tiles, and the inputs of a product split into three bf16 parts and laid
//! out as the tiles take them. Low in the layers: the dense and quantized layers pack their
//! inputs once and hand the packing to every product that shares them.

use half::bf16;

use super::status::enabled;

/// Rows (and output neurons) of a tile.
pub(super) const TILE: usize = 16;
/// Values of `k` a tile covers: 64 bytes of bf16.
pub(super) const TILE_K: usize = 32;
/// The bf16 parts each input is split into.
pub(super) const PARTS: usize = 3;
/// bf16 values in one tile (1 KiB).
pub(super) const TILE_VALUES: usize = TILE * TILE_K;

/// Products of at least this many input rows take the tiles; fewer take the decode kernels
/// and `cpu::dot_tiles`. Measured on one core of an AMX Xeon, experts of 3 x 384 x 1024 in
/// bf16, the two alternated in one process: at 4 rows the AVX-512 tiles (four rows, no lane
/// wasted) took 189 us per expert in cache against 231 on AMX, but 389 against 327 from
/// memory; at 5 rows (a tile and a row left over) 331 against 234 in cache, and at 6, 8 and
/// 12 rows AMX took 61%, 65% and 54% of their time from memory.
pub(crate) const MIN_ROWS: usize = 5;

/// The inputs of a product split into three bf16 parts and laid out as the B tiles take them:
/// per block of 16 rows (the last one padded with zeros), per 32 of `k`, per part, a tile of 16
/// rows of `k` pairs by 16 input rows. Products that share their input (an expert's gate and
/// up) share one packing.
pub struct PackedInputs {
    tiles: Vec<u16>,
    pub(super) rows: usize,
    pub(super) k: usize,
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

    pub(super) fn pack(x: &[f32], rows: usize, k: usize) -> PackedInputs {
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
    pub(super) fn pack_portable(x: &[f32], rows: usize, k: usize, tiles: &mut [u16]) {
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

    pub(super) fn k_blocks(&self) -> usize {
        self.k / TILE_K
    }

    /// The tile of `part` for row block `block` and k block 0 (the k blocks follow, each
    /// `PARTS` tiles on).
    pub(super) fn tile(&self, block: usize, part: usize) -> *const u16 {
        let at = (block * self.k_blocks() * PARTS + part) * TILE_VALUES;
        self.tiles[at..].as_ptr()
    }
}

/// `v` as three bf16 parts (bits), each rounded to nearest from what the ones before left:
/// their sum is `v` to within f32 rounding (exactly, but for values within 2^16 of the
/// smallest normal, whose last part AMX reads as zero).
pub(super) fn split(v: f32) -> [u16; 3] {
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
pub(super) unsafe fn pack_avx512(x: &[f32], rows: usize, k: usize, tiles: &mut [u16]) {
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
