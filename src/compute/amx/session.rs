//! The tile registers: their configuration, a thread's session with them, the products of a
//! block of weight rows by a block of input rows over all of `k`, and writing the sums out.

use half::bf16;

use super::pack::{PARTS, PackedInputs, TILE, TILE_K, TILE_VALUES};
use super::status::{AmxStatus, status};
use crate::compute::cpu::parallel::SharedOut;

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

/// How many tiles along `k` ahead the weight rows are prefetched.
const PREFETCH_TILES: usize = 4;

/// Writes the sums of a block (`sums[c]`: tile `c = neuron half * 2 + row half`, 16 neurons
/// by 16 rows) into `out`, row `r` at `r * n` (the output's stride), leaving out padded rows.
///
/// # Safety
/// No other thread writes these elements of `out` meanwhile; `out` holds the `rows` rows of
/// the block's neurons.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scatter(
    sums: &[[f32; TILE * TILE]; 4],
    out: SharedOut,
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
pub(super) struct TileSession {
    /// Tile state is per thread: the session must end on the thread that started it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl TileSession {
    pub(super) fn start() -> TileSession {
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
    pub(super) fn block(
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
pub(super) enum Scaling<'a> {
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
