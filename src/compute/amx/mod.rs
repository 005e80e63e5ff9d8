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
//!
//! The files form layers, each importing only from those below it: `status`; `pack` (the
//! tiles' shape and the packed inputs) and `to_bf16`; `session` (the tile registers) and
//! `int4` (the AMX-INT8 kernel); this module (which weights the tiles take, and the product).

use half::bf16;
use rayon::prelude::*;

use crate::compute::cpu::parallel::{PARALLEL_MIN_FLOPS, SharedOut};
use crate::compute::quant::format::GroupScales;
use session::{Scaling, TileSession, scatter};
use to_bf16::{e4m3_to_bf16, int4_to_bf16};

mod pack;
#[macro_use]
mod session;
mod status;
mod to_bf16;

pub(crate) mod int4;

pub(crate) use int4::{Int4Digits, int4_product};
pub(crate) use pack::MIN_ROWS;
pub use pack::PackedInputs;
use pack::{TILE, TILE_K};
pub use status::{AmxStatus, enabled, is_set_aside, set_aside, status};

/// Input rows whose packed parts one pass over the weights keeps: 8 row blocks, 24 KiB of
/// parts per 32 of `k` (768 KiB at k = 1024), so that they stay in L2 while every weight tile
/// of the pass is multiplied with them.
const ROWS_PER_PASS: usize = 8 * TILE;

/// Output neurons one parallel task takes at least.
const NEURONS_PER_TASK: usize = 4 * TILE;

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
    let out_at = SharedOut::new(out);
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
    if parallel && flops >= PARALLEL_MIN_FLOPS {
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

#[cfg(test)]
mod tests;
