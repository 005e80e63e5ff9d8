//! How a quantized matrix is stored: its format and its INT4 group scales. Plain data, low in
//! the layers, which the AMX tiles and the GPU's storage read as the CPU products do.

use half::bf16;

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
    /// MXFP4 (gpt-oss's experts): two e2m1 values a byte, lowest nibble first, a row taking
    /// `in_features / 32` blocks of 16 bytes; `scales[row * blocks + b]` is block `b`'s E8M0
    /// exponent, `2^(scale - 127)` ([`super::mxfp4`]).
    Mxfp4 { blocks: Vec<u8>, scales: Vec<u8> },
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
