//! MXFP4 (OCP Microscaling, FP4 e2m1 elements), as gpt-oss publishes its experts: a row of
//! `cols` weights is `cols / 32` blocks, each 16 bytes of two 4-bit elements (the low nibble
//! first) and one E8M0 byte, the power of two `2^(scale - 127)` that multiplies the block.
//! An element is one of ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}: element times scale is exact in f32
//! (and in bf16) for every scale but 255 (E8M0's NaN, refused), so widening loses nothing.

/// Elements in one scaled block.
pub const MXFP4_BLOCK: usize = 32;

/// The sixteen values of an FP4 e2m1 element (sign, two exponent bits, one mantissa bit).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `2^(scale - 127)`, exactly (scale 0 is the subnormal 2^-127); `scale` is not 255.
#[inline]
pub fn e8m0_to_f32(scale: u8) -> f32 {
    if scale == 0 {
        f32::from_bits(1 << 22)
    } else {
        f32::from_bits(u32::from(scale) << 23)
    }
}

/// Checks that `blocks` and `scales` hold a `[rows, cols]` matrix and no scale is NaN.
pub(crate) fn check(blocks: &[u8], scales: &[u8], rows: usize, cols: usize) -> Result<(), String> {
    if !cols.is_multiple_of(MXFP4_BLOCK) {
        return Err(format!(
            "{cols} columns is not a whole number of {MXFP4_BLOCK}-element blocks"
        ));
    }
    let per_row = cols / MXFP4_BLOCK;
    if blocks.len() != rows * per_row * MXFP4_BLOCK / 2 || scales.len() != rows * per_row {
        return Err(format!(
            "{} block bytes and {} scales for a [{rows}, {cols}] matrix (expected {} and {})",
            blocks.len(),
            scales.len(),
            rows * per_row * MXFP4_BLOCK / 2,
            rows * per_row
        ));
    }
    if let Some(at) = scales.iter().position(|&s| s == 0xFF) {
        return Err(format!("scale {at} is 255, E8M0's NaN"));
    }
    Ok(())
}

/// The e2m1 value of the low nibble of `n`, computed rather than looked up so that the decoder
/// vectorises: magnitudes 2 to 7 (exponent field 1 to 3) are the f32 whose exponent and top
/// mantissa bit are the nibble's, rebiased by 126; 0 and 1 are 0 and 0.5; bit 3 is the sign.
#[inline(always)]
fn e2m1(n: u32) -> f32 {
    let magnitude = n & 7;
    let value = if magnitude < 2 {
        0.5 * magnitude as f32
    } else {
        f32::from_bits((magnitude << 22) + (126 << 23))
    };
    f32::from_bits(value.to_bits() | ((n & 8) << 28))
}

/// `out[j] = e2m1(element j) * 2^(scales[j / 32] - 127)` for the elements `bytes` hold (two a
/// byte, `out.len()` of them, an even number); the first element starts a block. Compiled for
/// the vector instructions the CPU has (chosen at run time), as the other decoders are.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn decode_mxfp4(bytes: &[u8], scales: &[u8], out: &mut [f32]) {
    for ((out, bytes), &scale) in out
        .chunks_mut(MXFP4_BLOCK)
        .zip(bytes.chunks(MXFP4_BLOCK / 2))
        .zip(scales)
    {
        let factor = e8m0_to_f32(scale);
        for (pair, &byte) in out.chunks_exact_mut(2).zip(bytes) {
            pair[0] = e2m1(u32::from(byte)) * factor;
            pair[1] = e2m1(u32::from(byte >> 4)) * factor;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_are_exact_powers_of_two() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(130), 8.0);
        assert_eq!(e8m0_to_f32(1), 2f32.powi(-126));
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
    }

    #[test]
    fn every_nibble_computes_its_table_value() {
        for n in 0..16u32 {
            assert_eq!(e2m1(n).to_bits(), E2M1[n as usize].to_bits(), "nibble {n}");
        }
    }

    #[test]
    fn elements_take_their_blocks_scale_low_nibble_first() {
        let mut bytes = vec![0u8; 32];
        bytes[0] = 0x72; // 1.0 then 6.0
        bytes[16] = 0x9F; // -6.0 then -0.5
        let mut out = vec![f32::NAN; 64];
        decode_mxfp4(&bytes, &[127, 124], &mut out);
        assert_eq!(&out[..2], &[1.0, 6.0]);
        assert_eq!(&out[32..34], &[-6.0 / 8.0, -0.5 / 8.0]);
        assert!(out[2..32].iter().all(|&v| v == 0.0));
    }
}
