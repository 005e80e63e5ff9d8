//! Weights held in a checkpoint's quantized form, and the CPU products that dequantize them as
//! they read them.
//!
//! Two stored forms, as published:
//! - FP8 e4m3 (`float8_e4m3fn`) with one f32 multiplier per `block_rows x block_cols` block
//!   (`weight_scale_inv`; DeepSeek-V3/R1, Kimi K2 Instruct, Qwen3 "-FP8"): 1 byte per weight.
//! - 4-bit symmetric integers packed eight to an int32 with one scale per `group` consecutive
//!   weights of a row (compressed-tensors `pack-quantized`; Kimi K2 Thinking and later):
//!   half a byte per weight.
//!
//! A product with few input rows (decode) is bound by the bytes of weights it reads, so its
//! kernels decode the stored values in registers as they load them and use each for every
//! input row: FP8 bytes through the bf16 kernel (the block scales multiply the inputs), INT4
//! words through the decode kernels (`int4_rows_avx512` at one row, `int4_rows_avx2` at one
//! to 32) or else [`int4_dot_rows`] (the group scales multiply sixteen words' partial sums).
//! With many rows the matrix is widened once to f32 and handed to the packed GEMM, as bf16
//! weights are.

use half::bf16;

use super::amx::{self, PackedInputs, TileWeights};
use super::cpu::{self, FEW_ROWS};

/// The value of an e4m3fn byte. Its exponent and mantissa fields, moved to an f32's
/// positions, give the value times 2^-120 (for the subnormals too); 0x7f/0xff, e4m3fn's NaN,
/// reads as ±480, which no quantizer writes. Branch-free, so it vectorises.
#[inline(always)]
pub fn e4m3_to_f32(byte: u8) -> f32 {
    const TWO_POW_120: f32 = f32::from_bits((127 + 120) << 23);
    // The byte sign-extended and shifted puts its sign at bit 31 and copies of it at bits
    // 27..=30, which the mask clears: three integer operations per lane.
    let bits = ((byte as i8 as i32) << 20) as u32 & 0x87f0_0000;
    f32::from_bits(bits) * TWO_POW_120
}

/// An e4m3fn byte as the few-row kernel reads it, decoded as it is loaded (unscaled).
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
struct E4m3(u8);

impl E4m3 {
    fn slice(bytes: &[u8]) -> &[E4m3] {
        // SAFETY: E4m3 is a transparent wrapper around u8 (same size, alignment and valid
        // values), so the same memory read as E4m3 is the same length of valid values.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<E4m3>(), bytes.len()) }
    }
}

impl cpu::WeightElement for E4m3 {
    const STORED: cpu::Stored = cpu::Stored::E4m3;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        e4m3_to_f32(self.0)
    }

    fn widen(weights: &[E4m3]) -> std::borrow::Cow<'_, [f32]> {
        let mut out = Vec::with_capacity(weights.len());
        Self::extend_widened(weights, &mut out);
        std::borrow::Cow::Owned(out)
    }

    fn extend_widened(weights: &[E4m3], buffer: &mut Vec<f32>) {
        let at = buffer.len();
        buffer.resize(at + weights.len(), 0.0);
        // SAFETY: E4m3 is a transparent wrapper around u8.
        let bytes =
            unsafe { std::slice::from_raw_parts(weights.as_ptr().cast::<u8>(), weights.len()) };
        widen_e4m3(bytes, &mut buffer[at..]);
    }
}

/// `out[j] = e4m3(bytes[j])`. With AVX-512 (F, BW, VL) through the half-precision
/// conversion, which takes e4m3's subnormals as ordinary values; [`e4m3_to_f32`]'s multiply
/// makes them f32 subnormals, which most x86 cores multiply on a slow path (random bytes,
/// one in sixteen subnormal, decoded 10x slower).
pub fn widen_e4m3(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(bytes.len(), out.len(), "one f32 per byte");
    #[cfg(target_arch = "x86_64")]
    if cpu::decode_kernel_available() {
        // SAFETY: the CPU has the kernel's features; the slices are one length.
        unsafe { widen_e4m3_avx512(bytes, out) };
        return;
    }
    for (o, b) in out.iter_mut().zip(bytes) {
        *o = e4m3_to_f32(*b);
    }
}

/// [`widen_e4m3`] with AVX-512, sixteen bytes at a time, the last chunk masked.
///
/// # Safety
/// The CPU has AVX-512F, BW and VL; `bytes` and `out` are one length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn widen_e4m3_avx512(bytes: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    // The f16 route reads each value times 2^-8 (f16's exponent bias is 8 more than e4m3's).
    let scale = _mm512_set1_ps(256.0);
    let sign_exponent_mantissa = _mm256_set1_epi16(0xbf80u16 as i16);
    for at in (0..bytes.len()).step_by(16) {
        let mask: __mmask16 = match bytes.len() - at {
            left if left >= 16 => 0xffff,
            left => ((1u32 << left) - 1) as __mmask16,
        };
        // SAFETY: the mask covers only bytes below the slices' common length.
        unsafe {
            let b = _mm_maskz_loadu_epi8(mask, bytes.as_ptr().add(at).cast());
            // Sign-extended to 16 bits and shifted by 7: the sign lands on f16's sign, the
            // exponent and mantissa on f16's; the mask clears the sign's copies between.
            let half = _mm256_and_si256(
                _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(b)),
                sign_exponent_mantissa,
            );
            let v = _mm512_mul_ps(_mm512_cvtph_ps(half), scale);
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(at), mask, v);
        }
    }
}

/// How a quantized matrix is stored.
#[derive(Debug, Clone)]
pub enum QuantFormat {
    /// One e4m3 byte per weight; `scales[block_row * blocks_per_row + block_col]` multiplies
    /// every weight of its block. Edge blocks may be partial.
    Fp8 {
        weights: Vec<u8>,
        scales: Vec<f32>,
        block_rows: usize,
        block_cols: usize,
    },
    /// Eight 4-bit values per word, lowest nibble first, each stored as value + 8 (so
    /// -8..=7); a row takes `in_features.div_ceil(8)` words. `scales[row * groups + g]`
    /// multiplies weights `g * group .. (g + 1) * group` of the row.
    Int4 {
        packed: Vec<u32>,
        scales: GroupScales,
        group: usize,
    },
}

/// The group scales of an INT4 matrix: bf16 when every scale is a bf16 value (published
/// files store them in bf16: half the bytes, nothing lost), else f32.
#[derive(Debug, Clone)]
pub enum GroupScales {
    Bf16(Vec<bf16>),
    F32(Vec<f32>),
}

impl GroupScales {
    /// `scales` in the narrowest form that holds them exactly.
    pub fn new(scales: Vec<f32>) -> Self {
        let narrow: Vec<bf16> = scales.iter().map(|&s| bf16::from_f32(s)).collect();
        if narrow
            .iter()
            .zip(&scales)
            .all(|(n, s)| n.to_f32().to_bits() == s.to_bits())
        {
            GroupScales::Bf16(narrow)
        } else {
            GroupScales::F32(scales)
        }
    }

    pub fn len(&self) -> usize {
        match self {
            GroupScales::Bf16(s) => s.len(),
            GroupScales::F32(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Scale `i`.
    pub fn get(&self, i: usize) -> f32 {
        match self {
            GroupScales::Bf16(s) => s[i].to_f32(),
            GroupScales::F32(s) => s[i],
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            GroupScales::Bf16(s) => 2 * s.len(),
            GroupScales::F32(s) => 4 * s.len(),
        }
    }

    /// Scales `start..start + out.len()` into `out`.
    pub(crate) fn read_into(&self, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match self {
            GroupScales::Bf16(s) => {
                // bf16 is the top half of an f32: a shift, which vectorises (`to_f32` does
                // not, and this runs for every output row of a few-row product).
                for (o, v) in out.iter_mut().zip(&s[start..end]) {
                    *o = f32::from_bits(u32::from(v.to_bits()) << 16);
                }
            }
            GroupScales::F32(s) => out.copy_from_slice(&s[start..end]),
        }
    }
}

/// INT4 products of at least this many input rows take the AMX-BF16 tiles (the nibbles made
/// bf16, the groups' sums weighed apart); fewer, from 2, the AMX-INT8 kernel (`amx::int4`).
/// Roofline, 128 INT4 experts [3 x 384 x 1024] (groups of 32) on an AMX Xeon, the two
/// alternated in one binary each: at 5 rows 16.5 ms on INT8 against 21.9 on BF16, at 6 rows
/// 20.1, 19.3 against 22.4, 19.0; at 7 rows 24.9, 24.5 against 23.6, 20.0; at 8 rows 28.1
/// against 21.0; at 32 rows BF16 took 31 ms where the dequantized f32 product took 91.
pub(crate) const INT4_BF16_TILES_MIN_ROWS: usize = 7;

/// A quantized `[out_features, in_features]` matrix, as `nn.Linear` lays out its weight.
#[derive(Debug, Clone)]
pub struct QuantLinear {
    pub format: QuantFormat,
    pub out_features: usize,
    pub in_features: usize,
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
        })
    }

    /// Bytes this matrix holds in memory (weights and scales): what one pass reads.
    pub fn stored_bytes(&self) -> usize {
        match &self.format {
            QuantFormat::Fp8 {
                weights, scales, ..
            } => weights.len() + 4 * scales.len(),
            QuantFormat::Int4 { packed, scales, .. } => 4 * packed.len() + scales.bytes(),
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
    fn int4_decodes(&self, rows: usize) -> bool {
        matches!(&self.format, QuantFormat::Int4 { group, .. }
            if int4_kernel_takes(*group) && Int4Decode::detect_for(rows, *group).is_some())
    }

    /// `out = x · wᵀ` for the input rows given as `inputs` ([`Int4Inputs::for_decode`]), on
    /// the decode kernel they were made for; the caller checked
    /// [`QuantLinear::int4_decodes`].
    #[cfg(target_arch = "x86_64")]
    fn int4_decode(&self, inputs: &Int4Inputs, out: &mut [f32], parallel: bool) {
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
        cpu::few_rows_by_columns(inputs.rows, k, out, parallel, weight_rows);
    }

    /// `x [rows, in] -> [rows, out]`; `parallel = false` keeps the work on this thread.
    pub fn forward_with(&self, x: &[f32], rows: usize, parallel: bool) -> Vec<f32> {
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
            if let Some(inputs) = cpu::BroadcastInputs::new(x, rows, k) {
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
            if !(fp8 && cpu::avx2_tiles() && rows <= cpu::few_rows_widened()) {
                cpu::matmul_widening(x, rows, k, n, &mut out, parallel, |first, panel| {
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
                    cpu::dot_tiles(
                        &scaled,
                        rows,
                        k,
                        &bytes[row * k..block_end * k],
                        &mut out_t[(row - first) * rows..(block_end - first) * rows],
                    );
                    row = block_end;
                }
            };
            cpu::few_rows_by_columns(rows, k, &mut out, parallel, weight_rows);
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
            cpu::few_rows_by_columns(rows, k, &mut out, parallel, weight_rows);
            return out;
        }
        // Each weight row dequantized once, then dotted with every input row.
        let weight_rows = |first: usize, out_t: &mut [f32]| {
            let mut row_buffer = vec![0.0f32; k];
            for (c, column) in out_t.chunks_exact_mut(rows).enumerate() {
                self.dequantize_row(first + c, &mut row_buffer);
                cpu::dot_rows(x, k, &row_buffer, column);
            }
        };
        cpu::few_rows_by_columns(rows, k, &mut out, parallel, weight_rows);
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

/// Packed words per chunk of the few-row INT4 kernel: one f32 lane each (128 weights).
const INT4_WORDS: usize = 16;

/// Whether [`int4_dot_rows`] handles groups of `group` weights: whole words, and a chunk's
/// sixteen words in whole groups or a group in whole chunks (8, 16, 32, 64, 128, 256, ...;
/// the published files use 32). Other sizes take the row-by-row path.
fn int4_kernel_takes(group: usize) -> bool {
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
struct Int4Inputs {
    planes: Vec<f32>,
    sums: Vec<f32>,
    chunks: usize,
    rows: usize,
    /// The decode kernel the planes are scaled for ([`Int4Inputs::for_decode`]); `None` for
    /// [`int4_dot_rows`]' unscaled planes.
    #[cfg(target_arch = "x86_64")]
    decode: Option<Int4Decode>,
}

impl Int4Inputs {
    fn new(x: &[f32], rows: usize, k: usize) -> Self {
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
    fn for_decode(x: &[f32], rows: usize, kernel: Int4Decode) -> Self {
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
    fn dot(&self, words: &[u32], row_scales: &[f32], words_per_group: usize, out: &mut [f32]) {
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
struct Int4Rows<'a> {
    packed: &'a [u32],
    scales: &'a GroupScales,
    /// Words and scales per row.
    words: usize,
    groups: usize,
    words_per_group: usize,
}

#[cfg(target_arch = "x86_64")]
impl Int4Rows<'_> {
    /// `out[c * m + r] = x[r] · row (first + c)` for the `m` input rows of `inputs` (made by
    /// [`Int4Inputs::for_decode`]).
    fn dot(&self, inputs: &Int4Inputs, first: usize, out: &mut [f32]) {
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
const INT4_AVX2_MAX_ROWS: usize = 32;

/// The INT4 decode kernels ([`Int4Rows::dot`]) a CPU may run.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Int4Decode {
    /// [`int4_rows_avx512`]: AVX-512 F, BW and VL.
    Avx512,
    /// [`int4_rows_avx2`]: AVX2 and FMA.
    Avx2,
}

#[cfg(target_arch = "x86_64")]
impl Int4Decode {
    /// The widest this CPU runs for one input row (on every INT4 decode product: no
    /// allocation).
    fn detect() -> Option<Int4Decode> {
        if cpu::decode_kernel_available() {
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
    fn detect_for(rows: usize, group: usize) -> Option<Int4Decode> {
        Int4Decode::detect().filter(|kernel| kernel.takes(rows, group))
    }

    /// Whether this kernel takes `rows` input rows of a matrix in groups of `group` weights
    /// (which [`int4_kernel_takes`]): AVX2 reads a group's scale by a shift, so only groups
    /// of a power of two.
    fn takes(self, rows: usize, group: usize) -> bool {
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
    fn all() -> Vec<Int4Decode> {
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
    const HALF: usize = INT4_WORDS / 2;
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
    // The lanes' scales of a half of a whole chunk whose first scale is `at` (`per_half` of
    // them from there), spread over the lanes by `spread` (`B`: bf16).
    //
    // SAFETY (for callers): the CPU has AVX2; the `per_half` scales lie within the row's.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn half_scales<const B: bool>(
        at: *const u8,
        per_half: usize,
        spread: __m256i,
    ) -> __m256 {
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
    // The same for the last chunk of a row whose words end inside it: the half's scales
    // (lane l's the `(first_word + l) >> shift`-th of the row's `groups` from `row`) copied,
    // those past the row's zero.
    //
    // SAFETY (for callers): the CPU has AVX2; `row` points at a row's `groups` scales.
    #[target_feature(enable = "avx2")]
    unsafe fn tail_scales<const B: bool>(
        row: *const u8,
        groups: usize,
        first_word: usize,
        shift: u32,
    ) -> __m256 {
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
                    acc[r][l] = cpu::madd(fused, q[l], p[l], acc[r][l]);
                }
            }
        }
        let scales = scales_of(c);
        for r in 0..R {
            let s = &sums[r][c * INT4_WORDS..][..INT4_WORDS];
            for l in 0..INT4_WORDS {
                let partial = cpu::madd(fused, -8.0, s[l], acc[r][l]);
                total[r][l] = cpu::madd(fused, partial, scales[l], total[r][l]);
            }
        }
    }
    std::array::from_fn(|r| total[r].iter().sum())
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
/// `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct QuantSwiGlu {
    pub gate: QuantLinear,
    pub up: QuantLinear,
    pub down: QuantLinear,
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
        let project = |linear: &QuantLinear| {
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
                _ => linear.forward_with(x, rows, parallel),
            }
        };
        let mut gate = project(&self.gate);
        let up = project(&self.up);
        cpu::silu_mul(&mut gate, &up);
        self.down.forward_with(&gate, rows, parallel)
    }

    /// Bytes of weights and scales this block holds and reads per forward pass.
    pub fn weight_bytes(&self) -> usize {
        self.gate.stored_bytes() + self.up.stored_bytes() + self.down.stored_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::cpu::tests::naive;

    /// The dequantized matrix computed value by value from the stored fields.
    fn by_hand(m: &QuantLinear) -> Vec<f32> {
        let (n, k) = (m.out_features, m.in_features);
        let mut out = Vec::with_capacity(n * k);
        for r in 0..n {
            for c in 0..k {
                out.push(match &m.format {
                    QuantFormat::Fp8 {
                        weights,
                        scales,
                        block_rows,
                        block_cols,
                    } => {
                        let scale =
                            scales[r / block_rows * k.div_ceil(*block_cols) + c / block_cols];
                        e4m3_to_f32(weights[r * k + c]) * scale
                    }
                    QuantFormat::Int4 {
                        packed,
                        scales,
                        group,
                    } => {
                        let word = packed[r * k.div_ceil(8) + c / 8];
                        let value = ((word >> (4 * (c % 8))) & 0xf) as i32 - 8;
                        value as f32 * scales.get(r * k.div_ceil(*group) + c / group)
                    }
                });
            }
        }
        out
    }

    #[test]
    fn e4m3_bytes_decode_to_their_values() {
        // Values from the OCP FP8 spec's e4m3 table.
        for (byte, value) in [
            (0x00u8, 0.0f32),
            (0x80, -0.0),
            (0x38, 1.0),
            (0xb8, -1.0),
            (0x7e, 448.0),
            (0x01, 2f32.powi(-9)),
            (0x07, 7.0 * 2f32.powi(-9)),
            (0x08, 2f32.powi(-6)),
            (0x3c, 1.5),
            (0x40, 2.0),
        ] {
            assert_eq!(e4m3_to_f32(byte), value, "byte {byte:#04x}");
        }
    }

    #[test]
    fn every_e4m3_byte_widens_to_its_value_on_every_path() {
        // Every byte (subnormals, both zeros, and the NaN patterns, which both paths read as
        // ±480), three times over so that the vector path also has a partial last chunk.
        let bytes: Vec<u8> = (0..=255u8).cycle().take(3 * 256 + 7).collect();
        let mut out = vec![f32::NAN; bytes.len()];
        widen_e4m3(&bytes, &mut out);
        for (b, o) in bytes.iter().zip(&out) {
            assert_eq!(o.to_bits(), e4m3_to_f32(*b).to_bits(), "byte {b:#04x}");
        }
        println!(
            "e4m3 widened {}",
            if cpu::decode_kernel_available() {
                "with AVX-512 (f16 conversion)"
            } else {
                "by the portable decoding only (the CPU has no AVX-512 F/BW/VL)"
            }
        );
    }

    #[test]
    fn every_decode_kernel_reads_every_e4m3_byte() {
        // Each byte (no NaN) as a weight of its own: one input row of ones times a matrix
        // whose row j holds byte j at column j % 24 and zeros elsewhere.
        let k = 24;
        let values: Vec<u8> = (0..=255u8).filter(|b| b & 0x7f != 0x7f).collect();
        let n = values.len();
        let mut bytes = vec![0u8; n * k];
        for (j, b) in values.iter().enumerate() {
            bytes[j * k + j % k] = *b;
        }
        let x = vec![1.0f32; k];
        for kernel in cpu::DecodeKernel::all() {
            let mut out = vec![f32::NAN; n];
            kernel.run(&x, 1, k, E4m3::slice(&bytes), &mut out);
            for (b, o) in values.iter().zip(&out) {
                assert_eq!(*o, e4m3_to_f32(*b), "{kernel:?}, byte {b:#04x}");
            }
        }
    }

    #[test]
    fn fp8_blocks_scale_their_own_weights_including_partial_edge_blocks() {
        // 3 x 5 in [2, 2] blocks: 2 x 3 scales, the last row and column blocks partial.
        let (n, k) = (3, 5);
        let weights = vec![0x38u8; n * k]; // 1.0 everywhere
        let scales: Vec<f32> = (1..=6).map(|s| s as f32).collect();
        let m = QuantLinear::fp8(weights, scales, n, k, [2, 2]).unwrap();
        let widened = m.widen();
        #[rustfmt::skip]
        let expected = [
            1.0, 1.0, 2.0, 2.0, 3.0,
            1.0, 1.0, 2.0, 2.0, 3.0,
            4.0, 4.0, 5.0, 5.0, 6.0,
        ];
        assert_eq!(widened, expected);
        assert!(QuantLinear::fp8(vec![0; 15], vec![1.0; 4], n, k, [2, 2]).is_err());
    }

    #[test]
    fn int4_nibbles_are_offset_by_eight_lowest_first_and_scaled_per_group() {
        // One row of 10 values (two words, the second padded), groups of 4.
        let values: [i32; 10] = [-8, -1, 0, 1, 7, 3, -3, 2, 5, -5];
        let mut packed = [0u32; 2];
        for (i, v) in values.iter().enumerate() {
            packed[i / 8] |= ((v + 8) as u32) << (4 * (i % 8));
        }
        let scales = vec![0.5, 2.0, -1.0];
        let m = QuantLinear::int4(packed.to_vec(), scales.clone(), 1, 10, 4).unwrap();
        let expected: Vec<f32> = values
            .iter()
            .enumerate()
            .map(|(i, v)| *v as f32 * scales[i / 4])
            .collect();
        assert_eq!(m.widen(), expected);
        assert!(QuantLinear::int4(packed.to_vec(), vec![1.0; 2], 1, 10, 4).is_err());
    }

    #[test]
    fn int4_scales_are_held_in_bf16_only_when_that_loses_nothing() {
        let exact = GroupScales::new(vec![0.125, -3.0, 0.0]);
        assert!(matches!(exact, GroupScales::Bf16(_)));
        assert_eq!(exact.bytes(), 6);
        assert_eq!(exact.get(1), -3.0);
        let inexact = GroupScales::new(vec![0.125, 0.05]);
        assert!(matches!(inexact, GroupScales::F32(_)));
        assert_eq!((inexact.bytes(), inexact.get(1)), (8, 0.05));
        // A packed matrix reports the bytes it holds.
        let m = QuantLinear::int4(vec![0; 4], vec![0.5; 2], 2, 16, 16).unwrap();
        assert_eq!(m.stored_bytes(), 4 * 4 + 2 * 2);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_int4_decode_kernel_equals_the_widened_product() {
        // 37 weight rows: passes of two, three and four with rows left over; one to nine, 13,
        // 16 and 32 input rows: one group of one to four, then groups of three or four (the
        // last repeating a row for 5, 7 and 13); k = 100 and 300: a partial last chunk (under
        // and over half a chunk), 160: one whole chunk and a partial one, an odd count of
        // groups of 32 (a row's scales start at any multiple of four bytes), 1024: whole
        // chunks; groups of 8 to 256 weights (1 to 32 words
        // to a scale: a half's scales loaded as eight, four, two or one), and of 384 (not a
        // power of two: AVX-512 only); scales held in bf16 (0.125 and its multiples) and in
        // f32 (0.05); every nibble value, the top nibble's too (AVX2 reads it shifted, not in
        // place).
        let kernels = Int4Decode::all();
        println!("INT4 decode kernels on this CPU: {kernels:?}");
        let n = 37;
        for k in [100usize, 160, 300, 1024] {
            let x: Vec<f32> = (0..(INT4_AVX2_MAX_ROWS + 1) * k)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0 + (i / k) as f32 * 0.25)
                .collect();
            for group in [8usize, 16, 32, 64, 128, 256, 384] {
                for unit in [0.125f32, 0.05] {
                    let packed: Vec<u32> = (0..n * k.div_ceil(8))
                        .map(|i| (i as u32 ^ group as u32).wrapping_mul(2_654_435_761))
                        .collect();
                    let scales = (0..n * k.div_ceil(group))
                        .map(|i| unit * (1 + i % 7) as f32)
                        .collect();
                    let matrix = QuantLinear::int4(packed, scales, n, k, group).unwrap();
                    let decodes = kernels.first().is_some_and(|k| k.takes(1, group));
                    assert_eq!(matrix.int4_decodes(1), decodes);
                    for &kernel in &kernels {
                        let some_rows = (1..=9).chain([13, 16, INT4_AVX2_MAX_ROWS]);
                        for m in some_rows.filter(|&m| kernel.takes(m, group)) {
                            let x = &x[..m * k];
                            let expected = naive(x, m, k, &by_hand(&matrix), n);
                            for parallel in [false, true] {
                                let mut got = vec![f32::NAN; m * n];
                                let inputs = Int4Inputs::for_decode(x, m, kernel);
                                matrix.int4_decode(&inputs, &mut got, parallel);
                                for (at, (g, e)) in got.iter().zip(&expected).enumerate() {
                                    assert!(
                                        (g - e).abs() <= 1e-4 * (1.0 + e.abs()),
                                        "{kernel:?} {m} rows k={k} group={group} scale {unit} \
                                         output {at}: {g} vs {e}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn products_equal_the_product_of_the_widened_matrix_for_few_and_many_rows() {
        // k = 100: several 16-wide chunks, scale blocks and groups along a row, and a tail;
        // k = 300: INT4 rows of two whole 16-word chunks and a partial one; (96, 128) and
        // (96, 320): whole AMX tiles (FP8 from 5 rows where the CPU has them: block rows of
        // 16 and a partial one of 96 of 128; with k = 320, a partial block column of 64 of
        // 128); (80, 128): an odd count of 16-neuron blocks, so a lone last block.
        for (n, k) in [(70, 100usize), (70, 300), (96, 128), (96, 320), (80, 128)] {
            products_equal_the_widened_product(n, k);
        }
    }

    #[test]
    fn an_expert_whose_gate_and_up_share_one_packing_equals_the_widened_expert() {
        // Hidden 64, intermediate 96: whole tiles; 9 and 24 rows take the AMX-BF16 tiles
        // where the CPU has them (gate and up from one packing), 3 rows the other kernels.
        let (h, i) = (64, 96);
        let int4 = |n: usize, k: usize, seed: u32| {
            let packed = (0..n * k / 8)
                .map(|j| (j as u32 ^ seed).wrapping_mul(2_654_435_761))
                .collect();
            let scales = (0..n * k / 32).map(|j| 0.125 * (1 + (j + seed as usize) % 5) as f32);
            QuantLinear::int4(packed, scales.collect(), n, k, 32).unwrap()
        };
        let fp8 = |n: usize, k: usize, seed: usize| {
            let bytes = (0..n * k)
                .map(|j| ((j * 37 + seed) % 251) as u8 & 0xfe)
                .collect();
            let scales = (0..n.div_ceil(16) * k.div_ceil(32))
                .map(|j| 0.01 * (1 + j % 3) as f32)
                .collect();
            QuantLinear::fp8(bytes, scales, n, k, [16, 32]).unwrap()
        };
        let experts = [
            QuantSwiGlu {
                gate: int4(i, h, 1),
                up: int4(i, h, 2),
                down: int4(h, i, 3),
            },
            QuantSwiGlu {
                gate: fp8(i, h, 1),
                up: fp8(i, h, 2),
                down: fp8(h, i, 3),
            },
        ];
        for expert in &experts {
            for rows in [3, 9, 24] {
                let x: Vec<f32> = (0..rows * h)
                    .map(|j| ((j * 5 % 11) as f32 - 5.0) / 7.0)
                    .collect();
                let mut gate = naive(&x, rows, h, &by_hand(&expert.gate), i);
                let up = naive(&x, rows, h, &by_hand(&expert.up), i);
                cpu::silu_mul(&mut gate, &up);
                let expected = naive(&gate, rows, i, &by_hand(&expert.down), h);
                let got = expert.forward_with(&x, rows, false);
                // The outputs are sums of large terms that cancel: bounded against the largest.
                let largest = expected.iter().fold(0f32, |m, e| m.max(e.abs()));
                for (g, e) in got.iter().zip(&expected) {
                    assert!(
                        (g - e).abs() <= 1e-5 * largest,
                        "{rows} rows: {g} vs {e} ({largest})"
                    );
                }
            }
        }
    }

    fn products_equal_the_widened_product(n: usize, k: usize) {
        // Both signs; no NaN (0x7f, 0xff).
        let bytes: Vec<u8> = (0..n * k).map(|i| ((i * 37) % 251) as u8 & 0xfe).collect();
        let fp8 = |[rows, cols]: [usize; 2]| {
            let scales: Vec<f32> = (0..n.div_ceil(rows) * k.div_ceil(cols))
                .map(|i| 0.01 * (1 + i % 5) as f32)
                .collect();
            QuantLinear::fp8(bytes.clone(), scales, n, k, [rows, cols]).unwrap()
        };
        let packed: Vec<u32> = (0..n * k.div_ceil(8))
            .map(|i| (i as u32).wrapping_mul(2_654_435_761))
            .collect();
        // Scales that are bf16 values are held in bf16 (as published files store them);
        // 0.05 and its multiples are not, and stay f32.
        let int4_scaled = |group: usize, unit: f32| {
            let scales = (0..n * k.div_ceil(group))
                .map(|i| unit * (1 + i % 7) as f32)
                .collect();
            QuantLinear::int4(packed.clone(), scales, n, k, group).unwrap()
        };
        let int4 = |group: usize| int4_scaled(group, 0.05);
        // FP8 blocks that are whole 16-value chunks and ones that are not; INT4 groups the
        // chunked kernel takes (1 to 16 words to a scale, or 32: two chunks to a scale) and
        // ones it leaves to the row-by-row path (12 and 48 weights).
        let matrices = [
            fp8([16, 8]),
            fp8([128, 32]),
            // On the tiles where k allows: tiles of one 16-row block row each, and two
            // 32-value steps to a scale; the published blocks.
            fp8([16, 64]),
            fp8([128, 128]),
            // Blocks that the broadcast tiles' slices of 256 (9 to 32 rows, AVX-512) start
            // within, rather than at their start.
            fp8([16, 24]),
            int4(32),
            int4(8),
            int4(64),
            int4(128),
            int4(256),
            int4(12),
            int4(48),
            int4_scaled(32, 0.125),
            int4_scaled(12, 0.125),
        ];
        for matrix in matrices {
            let w = by_hand(&matrix);
            assert_eq!(matrix.widen(), w);
            // 9 to 64 rows: the broadcast tiles on AVX-512 (one to four registers of 16);
            // with AVX2 tiles, FP8's few-row tiles to 16 rows and the AVX2 INT4 kernel to 32;
            // 65: dequantized panels and the packed GEMM.
            for m in [1, 2, 3, 8, 9, 16, 32, 40, 64, 65] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
                    .collect();
                let expected = naive(&x, m, k, &w, n);
                for parallel in [false, true] {
                    let got = matrix.forward_with(&x, m, parallel);
                    for (g, e) in got.iter().zip(&expected) {
                        assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "m={m}: {g} vs {e}");
                    }
                }
            }
        }
    }
}
