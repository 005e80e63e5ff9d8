//! Quantized layers ([`QuantLinear`], [`QuantSwiGlu`]) and the product they run, which picks
//! the kernel by format and number of input rows: the AMX tiles (BF16, or INT8 for a few
//! rows of INT4), the decode kernels, the few-row tiles, or panels widened for the packed GEMM.

use super::e4m3::{E4m3, widen_e4m3};
use super::format::{GroupScales, QuantFormat};
use super::int4_rows::*;
use super::mxfp4::{self, E2M1, MXFP4_BLOCK, decode_mxfp4, e8m0_to_f32};
use crate::compute::amx::{self, PackedInputs, TileWeights};
use crate::compute::cpu::decode::{FEW_ROWS, dot_rows, few_rows_by_columns};
use crate::compute::cpu::gemm::matmul_widening;
use crate::compute::cpu::ops::silu_mul;
#[cfg(target_arch = "x86_64")]
use crate::compute::cpu::tiles::BroadcastInputs;
use crate::compute::cpu::tiles::{avx2_tiles, dot_tiles, few_rows_widened};

/// INT4 products of at least this many input rows take the AMX-BF16 tiles (the nibbles made
/// bf16, the groups' sums weighed apart); fewer, from 2, the AMX-INT8 kernel (`amx::int4`).
/// Roofline, 128 INT4 experts [3 x 384 x 1024] (groups of 32) on an AMX Xeon, the two
/// alternated in one binary each: at 5 rows 16.5 ms on INT8 against 21.9 on BF16, at 6 rows
/// 20.1, 19.3 against 22.4, 19.0; at 7 rows 24.9, 24.5 against 23.6, 20.0; at 8 rows 28.1
/// against 21.0; at 32 rows BF16 took 31 ms where the dequantized f32 product took 91.
pub(crate) const INT4_BF16_TILES_MIN_ROWS: usize = 7;

/// A quantized `[out_features, in_features]` matrix, as `nn.Linear` lays out its weight, with
/// an optional f32 bias (gpt-oss's experts have one).
#[derive(Debug, Clone)]
pub struct QuantLinear {
    pub format: QuantFormat,
    pub out_features: usize,
    pub in_features: usize,
    pub bias: Option<Vec<f32>>,
}

impl QuantLinear {
    /// An FP8 block-scaled matrix; fails when a length does not match the shape.
    pub fn fp8(
        weights: Vec<u8>,
        scales: Vec<f32>,
        out_features: usize,
        in_features: usize,
        [block_rows, block_cols]: [usize; 2],
    ) -> Result<Self, String> {
        if block_rows == 0 || block_cols == 0 {
            return Err("weight_block_size must be greater than 0".into());
        }
        let expected_scales = out_features.div_ceil(block_rows) * in_features.div_ceil(block_cols);
        if weights.len() != out_features * in_features || scales.len() != expected_scales {
            return Err(format!(
                "{} weights and {} scales do not make a [{out_features}, {in_features}] matrix \
                 in [{block_rows}, {block_cols}] blocks",
                weights.len(),
                scales.len()
            ));
        }
        Ok(QuantLinear {
            format: QuantFormat::Fp8 {
                weights,
                scales,
                block_rows,
                block_cols,
            },
            out_features,
            in_features,
            bias: None,
        })
    }

    /// A packed 4-bit matrix; fails when a length does not match the shape.
    pub fn int4(
        packed: Vec<u32>,
        scales: Vec<f32>,
        out_features: usize,
        in_features: usize,
        group: usize,
    ) -> Result<Self, String> {
        if group == 0 {
            return Err("group_size must be greater than 0".into());
        }
        if packed.len() != out_features * in_features.div_ceil(8)
            || scales.len() != out_features * in_features.div_ceil(group)
        {
            return Err(format!(
                "{} packed words and {} scales do not make a [{out_features}, {in_features}] \
                 matrix in groups of {group}",
                packed.len(),
                scales.len()
            ));
        }
        Ok(QuantLinear {
            format: QuantFormat::Int4 {
                packed,
                scales: GroupScales::new(scales),
                group,
            },
            out_features,
            in_features,
            bias: None,
        })
    }

    /// An MXFP4 matrix (`blocks`: `in_features / 2` bytes a row; `scales`: one E8M0 byte per
    /// 32 weights of a row); fails when a length does not match the shape, `in_features` is
    /// not whole blocks or a scale is E8M0's NaN.
    pub fn mxfp4(
        blocks: Vec<u8>,
        scales: Vec<u8>,
        out_features: usize,
        in_features: usize,
    ) -> Result<Self, String> {
        mxfp4::check(&blocks, &scales, out_features, in_features)?;
        Ok(QuantLinear {
            format: QuantFormat::Mxfp4 { blocks, scales },
            out_features,
            in_features,
            bias: None,
        })
    }

    /// Bytes this matrix holds in memory (weights, scales and bias): what one pass reads.
    pub fn stored_bytes(&self) -> usize {
        let bias = self.bias.as_ref().map_or(0, |b| 4 * b.len());
        bias + match &self.format {
            QuantFormat::Fp8 {
                weights, scales, ..
            } => weights.len() + 4 * scales.len(),
            QuantFormat::Int4 { packed, scales, .. } => 4 * packed.len() + scales.bytes(),
            QuantFormat::Mxfp4 { blocks, scales } => blocks.len() + scales.len(),
        }
    }

    /// Writes row `row` of the dequantized matrix into `out` (`in_features` long).
    #[inline]
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        self.dequantize_span(row, 0, out);
    }

    /// Writes values `from..from + out.len()` of row `row` of the dequantized matrix into
    /// `out`; `from` is a multiple of 8.
    pub fn dequantize_span(&self, row: usize, from: usize, out: &mut [f32]) {
        let (k, len) = (self.in_features, out.len());
        assert!(from.is_multiple_of(8) && from + len <= k, "a span of a row");
        // Weight `from + j` takes scale `(from + j) / size` of the row's; scales from one
        // that starts a block or group on are applied by the decoders themselves.
        let scale_spans = |out: &mut [f32], size: usize, scale: &dyn Fn(usize) -> f32| {
            let mut j = 0;
            while j < len {
                let at = (from + j) / size;
                let end = ((at + 1) * size - from).min(len);
                let s = scale(at);
                for o in &mut out[j..end] {
                    *o *= s;
                }
                j = end;
            }
        };
        match &self.format {
            QuantFormat::Fp8 {
                weights,
                scales,
                block_rows,
                block_cols,
            } => {
                let blocks_per_row = k.div_ceil(*block_cols);
                let scale_row = &scales[row / block_rows * blocks_per_row..][..blocks_per_row];
                let bytes = &weights[row * k + from..][..len];
                if from.is_multiple_of(*block_cols) {
                    decode_fp8(bytes, &scale_row[from / block_cols..], *block_cols, out);
                } else {
                    widen_e4m3(bytes, out);
                    scale_spans(out, *block_cols, &|b| scale_row[b]);
                }
            }
            QuantFormat::Int4 {
                packed,
                scales,
                group,
            } => {
                let (words, groups) = (k.div_ceil(8), k.div_ceil(*group));
                let row_words = &packed[row * words + from / 8..][..len.div_ceil(8)];
                if from.is_multiple_of(*group) {
                    // The span's scales, on the stack for the broadcast tiles' slices (at
                    // most 64 groups of 4): this runs for every slice of every weight row.
                    let count = len.div_ceil(*group);
                    let (mut stack, mut heap) = ([0.0f32; 64], Vec::new());
                    let scale_row = if count <= stack.len() {
                        &mut stack[..count]
                    } else {
                        heap.resize(count, 0.0);
                        &mut heap[..]
                    };
                    scales.read_into(row * groups + from / group, scale_row);
                    decode_int4(row_words, scale_row, *group, out);
                } else {
                    decode_int4(row_words, &[1.0], len.max(1), out);
                    scale_spans(out, *group, &|g| scales.get(row * groups + g));
                }
            }
            QuantFormat::Mxfp4 { blocks, scales } => {
                let per_row = k / MXFP4_BLOCK;
                let row_bytes = &blocks[row * k / 2..][..k / 2];
                let row_scales = &scales[row * per_row..][..per_row];
                let element = |e: usize| {
                    let byte = row_bytes[e / 2];
                    let nibble = if e.is_multiple_of(2) {
                        byte & 0x0F
                    } else {
                        byte >> 4
                    };
                    E2M1[usize::from(nibble)] * e8m0_to_f32(row_scales[e / MXFP4_BLOCK])
                };
                // One by one up to the first whole block and for an odd last element; the
                // whole pairs between from the decoder.
                let head = (from.next_multiple_of(MXFP4_BLOCK) - from).min(len);
                let pairs_end = head + (len - head) / 2 * 2;
                for j in (0..head).chain(pairs_end..len) {
                    out[j] = element(from + j);
                }
                let at = from + head;
                decode_mxfp4(
                    &row_bytes[at / 2..(from + pairs_end) / 2],
                    &row_scales[at / MXFP4_BLOCK..],
                    &mut out[head..pairs_end],
                );
            }
        }
    }

    /// The whole matrix in f32 (`out_features * in_features`).
    pub fn widen(&self) -> Vec<f32> {
        let k = self.in_features;
        let mut out = vec![0.0f32; self.out_features * k];
        if k > 0 {
            for (row, chunk) in out.chunks_exact_mut(k).enumerate() {
                self.dequantize_row(row, chunk);
            }
        }
        out
    }

    /// Whether the AMX-BF16 tiles take this matrix's product by `rows` input rows: FP8 in
    /// blocks of whole 16-row tiles and 32-value steps; INT4 in groups of whole 32-value steps
    /// from [`INT4_BF16_TILES_MIN_ROWS`] rows (fewer take the AMX-INT8 kernel,
    /// [`QuantLinear::int4_on_tiles`]); whole tiles of outputs.
    fn takes_bf16_tiles(&self, rows: usize) -> bool {
        let takes = match &self.format {
            QuantFormat::Fp8 {
                block_rows,
                block_cols,
                ..
            } => amx::takes_scale_blocks(*block_rows, *block_cols),
            QuantFormat::Int4 { group, .. } => {
                rows >= INT4_BF16_TILES_MIN_ROWS && amx::takes_int4_groups(self.in_features, *group)
            }
            QuantFormat::Mxfp4 { .. } => false,
        };
        takes && amx::takes_outputs(self.out_features)
    }

    /// The product on the AMX-BF16 tiles of inputs already split and packed (shared by an
    /// expert's gate and up): the FP8 or INT4 values made bf16 (exactly), each scale block's
    /// or group's sums weighed by its scale. The caller checked
    /// [`QuantLinear::takes_bf16_tiles`].
    fn packed_product(&self, packed: &PackedInputs, out: &mut [f32], parallel: bool) -> bool {
        let n = self.out_features;
        let weights = match &self.format {
            QuantFormat::Fp8 {
                weights,
                scales,
                block_rows,
                block_cols,
            } => TileWeights::E4m3 {
                bytes: weights,
                scales: amx::BlockScales {
                    scales,
                    rows: *block_rows,
                    cols: *block_cols,
                },
            },
            QuantFormat::Int4 {
                packed: words,
                scales,
                group,
            } => TileWeights::Int4 {
                words,
                scales,
                group: *group,
            },
            QuantFormat::Mxfp4 { .. } => return false,
        };
        amx::matmul_transposed(packed, weights, n, out, n, parallel)
    }

    /// [`QuantLinear::packed_product`] where the tiles take it, the inputs packed here; false,
    /// having done nothing, where not.
    fn on_bf16_tiles(&self, x: &[f32], rows: usize, out: &mut [f32], parallel: bool) -> bool {
        if !self.takes_bf16_tiles(rows) {
            return false;
        }
        match PackedInputs::new(x, rows, self.in_features) {
            Some(packed) => self.packed_product(&packed, out, parallel),
            None => false,
        }
    }

    /// The product of INT4 weights by a few rows on the AMX-INT8 tiles, where they run it
    /// (see `amx::int4`); false, having done nothing, where not.
    fn int4_on_tiles(&self, x: &[f32], rows: usize, out: &mut [f32], parallel: bool) -> bool {
        let QuantFormat::Int4 { group, .. } = &self.format else {
            return false;
        };
        let k = self.in_features;
        if !amx::int4::takes(rows, k, *group) {
            return false;
        }
        let Some(digits) = amx::Int4Digits::new(x, rows, k) else {
            return false;
        };
        self.int4_digits_product(&digits, out, parallel)
    }

    /// The product of INT4 weights with inputs already made digits (shared by an expert's
    /// gate and up); false, having done nothing, where the tiles do not take it.
    fn int4_digits_product(
        &self,
        digits: &amx::Int4Digits,
        out: &mut [f32],
        parallel: bool,
    ) -> bool {
        let QuantFormat::Int4 {
            packed,
            scales,
            group,
        } = &self.format
        else {
            return false;
        };
        if !digits.fits(self.in_features, *group) {
            return false;
        }
        amx::int4_product(
            digits,
            packed,
            scales,
            *group,
            self.out_features,
            out,
            parallel,
        );
        true
    }

    /// Whether `rows` input rows of this matrix take [`QuantLinear::int4_decode`]: INT4 in
    /// groups the kernels take, on a CPU with a decode kernel for that many rows.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn int4_decodes(&self, rows: usize) -> bool {
        matches!(&self.format, QuantFormat::Int4 { group, .. }
            if int4_kernel_takes(*group) && Int4Decode::detect_for(rows, *group).is_some())
    }

    /// `out = x · wᵀ` for the input rows given as `inputs` ([`Int4Inputs::for_decode`]), on
    /// the decode kernel they were made for; the caller checked
    /// [`QuantLinear::int4_decodes`].
    #[cfg(target_arch = "x86_64")]
    pub(super) fn int4_decode(&self, inputs: &Int4Inputs, out: &mut [f32], parallel: bool) {
        let QuantFormat::Int4 {
            packed,
            scales,
            group,
        } = &self.format
        else {
            unreachable!("int4_decodes checked the format");
        };
        let k = self.in_features;
        let (words, groups, words_per_group) = (k.div_ceil(8), k.div_ceil(*group), group / 8);
        let weight_rows = |first: usize, out_t: &mut [f32]| {
            let rows = Int4Rows {
                packed,
                scales,
                words,
                groups,
                words_per_group,
            };
            rows.dot(inputs, first, out_t)
        };
        few_rows_by_columns(inputs.rows, k, out, parallel, weight_rows);
    }

    /// `x [rows, in] -> [rows, out]`, the bias added; `parallel = false` keeps the work on
    /// this thread.
    pub fn forward_with(&self, x: &[f32], rows: usize, parallel: bool) -> Vec<f32> {
        let mut out = self.product(x, rows, parallel);
        self.add_bias(&mut out);
        out
    }

    /// Adds the bias, where there is one, to every row of `out`.
    fn add_bias(&self, out: &mut [f32]) {
        if let Some(bias) = &self.bias {
            for row in out.chunks_exact_mut(self.out_features) {
                for (o, b) in row.iter_mut().zip(bias) {
                    *o += b;
                }
            }
        }
    }

    /// `x · wᵀ` without the bias, on the kernel the format and number of rows take.
    fn product(&self, x: &[f32], rows: usize, parallel: bool) -> Vec<f32> {
        let (n, k) = (self.out_features, self.in_features);
        assert_eq!(x.len(), rows * k, "lhs size");
        let mut out = vec![0.0f32; rows * n];
        if rows == 0 || n == 0 || k == 0 {
            return out;
        }
        if self.on_bf16_tiles(x, rows, &mut out, parallel)
            || self.int4_on_tiles(x, rows, &mut out, parallel)
        {
            return out;
        }
        #[cfg(target_arch = "x86_64")]
        if self.int4_decodes(rows) {
            let kernel = Int4Decode::detect().expect("int4_decodes found a kernel");
            self.int4_decode(&Int4Inputs::for_decode(x, rows, kernel), &mut out, parallel);
            return out;
        }
        if rows > FEW_ROWS {
            // 9 to 64 rows on AVX-512: the broadcast tiles, each slice of a weight row
            // dequantized as they take it.
            #[cfg(target_arch = "x86_64")]
            if let Some(inputs) = BroadcastInputs::new(x, rows, k) {
                inputs.run(&mut out, parallel, |row, from, len, panel| {
                    let at = panel.len();
                    panel.resize(at + len, 0.0);
                    self.dequantize_span(row, from, &mut panel[at..]);
                });
                return out;
            }
            // With AVX2 tiles FP8 takes the few-row tiles below up to as many rows as bf16
            // weights do (each tile's bytes widened once for all its input rows); the rest
            // widens the weights for the packed GEMM.
            let fp8 = matches!(self.format, QuantFormat::Fp8 { .. });
            if !(fp8 && avx2_tiles() && rows <= few_rows_widened()) {
                matmul_widening(x, rows, k, n, &mut out, parallel, |first, panel| {
                    for (r, row) in panel.chunks_exact_mut(k).enumerate() {
                        self.dequantize_row(first + r, row);
                    }
                });
                return out;
            }
        }
        if let QuantFormat::Fp8 {
            weights,
            scales,
            block_rows,
            block_cols,
        } = &self.format
        {
            // The bytes are decoded in registers by the same kernel as bf16 weights; each
            // block's scale multiplies the input's columns of that block instead of every
            // weight, once per block of output rows.
            let bytes = E4m3::slice(weights);
            let blocks_per_row = k.div_ceil(*block_cols);
            let weight_rows = |first: usize, out_t: &mut [f32]| {
                let end = first + out_t.len() / rows;
                let mut scaled = vec![0.0f32; rows * k];
                let mut row = first;
                while row < end {
                    // The rows of one block row share their scales.
                    let block = row / block_rows;
                    let block_end = ((block + 1) * block_rows).min(end);
                    let row_scales = &scales[block * blocks_per_row..][..blocks_per_row];
                    scale_by_blocks(x, k, *block_cols, row_scales, &mut scaled);
                    dot_tiles(
                        &scaled,
                        rows,
                        k,
                        &bytes[row * k..block_end * k],
                        &mut out_t[(row - first) * rows..(block_end - first) * rows],
                    );
                    row = block_end;
                }
            };
            few_rows_by_columns(rows, k, &mut out, parallel, weight_rows);
            return out;
        }
        if let QuantFormat::Int4 {
            packed,
            scales,
            group,
        } = &self.format
            && int4_kernel_takes(*group)
        {
            let inputs = Int4Inputs::new(x, rows, k);
            let (words, groups, words_per_group) = (k.div_ceil(8), k.div_ceil(*group), group / 8);
            let weight_rows = |first: usize, out_t: &mut [f32]| {
                // The row's scales, padded with zeros to whole chunks (the padding lanes hold
                // no inputs).
                let mut row_scales = vec![0.0f32; inputs.chunks * INT4_WORDS / words_per_group + 1];
                for (c, column) in out_t.chunks_exact_mut(rows).enumerate() {
                    let row = first + c;
                    scales.read_into(row * groups, &mut row_scales[..groups]);
                    let row_words = &packed[row * words..][..words];
                    inputs.dot(row_words, &row_scales, words_per_group, column);
                }
            };
            few_rows_by_columns(rows, k, &mut out, parallel, weight_rows);
            return out;
        }
        // Each weight row dequantized once, then dotted with every input row.
        let weight_rows = |first: usize, out_t: &mut [f32]| {
            let mut row_buffer = vec![0.0f32; k];
            for (c, column) in out_t.chunks_exact_mut(rows).enumerate() {
                self.dequantize_row(first + c, &mut row_buffer);
                dot_rows(x, k, &row_buffer, column);
            }
        };
        few_rows_by_columns(rows, k, &mut out, parallel, weight_rows);
        out
    }
}

/// `scaled = x` with each row's columns multiplied by the scale of their block (`block_cols`
/// wide) in `row_scales`: an FP8 block row's scales applied to the inputs instead of to every
/// weight.
fn scale_by_blocks(x: &[f32], k: usize, block_cols: usize, row_scales: &[f32], scaled: &mut [f32]) {
    for (to, from) in scaled.chunks_exact_mut(k).zip(x.chunks_exact(k)) {
        for ((to, from), scale) in to
            .chunks_mut(block_cols)
            .zip(from.chunks(block_cols))
            .zip(row_scales)
        {
            for (t, f) in to.iter_mut().zip(from) {
                *t = f * scale;
            }
        }
    }
}

/// `out[j] = e4m3(bytes[j]) * scales[j / block_cols]`: one row of an FP8 matrix, widened by
/// [`widen_e4m3`], then scaled by code compiled for the vector instructions the CPU has
/// (chosen at run time), as the products are.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn decode_fp8(bytes: &[u8], scales: &[f32], block_cols: usize, out: &mut [f32]) {
    widen_e4m3(bytes, out);
    for (out, scale) in out.chunks_mut(block_cols).zip(scales) {
        for o in out {
            *o *= scale;
        }
    }
}

/// `out[j] = (nibble j of words, less 8) * scales[j / group]`: one row of an INT4 matrix.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn decode_int4(words: &[u32], scales: &[f32], group: usize, out: &mut [f32]) {
    let nibble = |word: u32, i: usize| (((word >> (4 * i)) & 0xf) as i32 - 8) as f32;
    let whole = out.len() / 8 * 8;
    let (head, tail) = out.split_at_mut(whole);
    for (chunk, word) in head.chunks_exact_mut(8).zip(words) {
        for (i, o) in chunk.iter_mut().enumerate() {
            *o = nibble(*word, i);
        }
    }
    if let Some(word) = words.get(whole / 8) {
        for (i, o) in tail.iter_mut().enumerate() {
            *o = nibble(*word, i);
        }
    }
    for (out, scale) in out.chunks_mut(group).zip(scales) {
        for o in out {
            *o *= scale;
        }
    }
}

/// A routed expert's SwiGLU block with quantized projections:
/// `down(act(gate(x), up(x)))`, `act` the block's [`SwiGluActivation`].
#[derive(Debug, Clone)]
pub struct QuantSwiGlu {
    pub gate: QuantLinear,
    pub up: QuantLinear,
    pub down: QuantLinear,
    pub activation: SwiGluActivation,
}

/// How a SwiGLU block joins its gate and up projections.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum SwiGluActivation {
    /// `silu(gate) * up`.
    #[default]
    Silu,
    /// gpt-oss's clamped SwiGLU, as transformers computes it:
    /// `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = min(gate, limit)`.
    ClampedGptOss { alpha: f32, limit: f32 },
    /// DeepSeek-V4's clamped SwiGLU: `silu(min(gate, limit)) * clamp(up, -limit, limit)`.
    Clamped { limit: f32 },
}

impl SwiGluActivation {
    /// `gate = act(gate, up)`, element by element.
    pub fn apply(self, gate: &mut [f32], up: &[f32]) {
        match self {
            SwiGluActivation::Silu => silu_mul(gate, up),
            SwiGluActivation::ClampedGptOss { alpha, limit } => {
                for (g, u) in gate.iter_mut().zip(up) {
                    // `f32::clamp` keeps NaN, as torch's clamp does (`min` would not).
                    let g0 = g.clamp(f32::NEG_INFINITY, limit);
                    let glu = g0 / (1.0 + (-(g0 * alpha)).exp());
                    *g = (u.clamp(-limit, limit) + 1.0) * glu;
                }
            }
            SwiGluActivation::Clamped { limit } => {
                for (g, u) in gate.iter_mut().zip(up) {
                    let g0 = g.clamp(f32::NEG_INFINITY, limit);
                    *g = g0 / (1.0 + (-g0).exp()) * u.clamp(-limit, limit);
                }
            }
        }
    }
}

impl QuantSwiGlu {
    pub fn forward_with(&self, x: &[f32], rows: usize, parallel: bool) -> Vec<f32> {
        let k = self.gate.in_features;
        // Gate and up on the AMX-BF16 tiles share one packing of the inputs.
        let packed = (self.gate.takes_bf16_tiles(rows) && self.up.takes_bf16_tiles(rows))
            .then(|| PackedInputs::new(x, rows, k))
            .flatten();
        // INT4 gate and up on the AMX-INT8 tiles share one making of the inputs' digits.
        let digits = match (&self.gate.format, &self.up.format) {
            (QuantFormat::Int4 { .. }, QuantFormat::Int4 { .. }) if packed.is_none() => {
                amx::Int4Digits::new(x, rows, k)
            }
            _ => None,
        };
        // INT4 rows on a decode kernel: gate and up share its planes.
        #[cfg(target_arch = "x86_64")]
        let planes = Int4Decode::detect()
            .filter(|_| self.gate.int4_decodes(rows) && self.up.int4_decodes(rows))
            .map(|kernel| Int4Inputs::for_decode(x, rows, kernel));
        let product = |linear: &QuantLinear| {
            let mut out = vec![0.0f32; rows * linear.out_features];
            #[cfg(target_arch = "x86_64")]
            if let Some(planes) = &planes {
                linear.int4_decode(planes, &mut out, parallel);
                return out;
            }
            if let Some(p) = &packed
                && linear.packed_product(p, &mut out, parallel)
            {
                return out;
            }
            match &digits {
                Some(d) if linear.int4_digits_product(d, &mut out, parallel) => out,
                _ => linear.product(x, rows, parallel),
            }
        };
        let project = |linear: &QuantLinear| {
            let mut out = product(linear);
            linear.add_bias(&mut out);
            out
        };
        let mut gate = project(&self.gate);
        let up = project(&self.up);
        self.activation.apply(&mut gate, &up);
        self.down.forward_with(&gate, rows, parallel)
    }

    /// Bytes of weights and scales this block holds and reads per forward pass.
    pub fn weight_bytes(&self) -> usize {
        self.gate.stored_bytes() + self.up.stored_bytes() + self.down.stored_bytes()
    }
}
