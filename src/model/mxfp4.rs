//! MXFP4 (OCP Microscaling, FP4 e2m1 elements): how gpt-oss publishes its experts. A matrix
//! `[rows, cols]` is stored as `blocks` `[rows, cols / 32, 16]` bytes, two 4-bit elements a
//! byte (the low nibble first), and `scales` `[rows, cols / 32]` bytes, one power-of-two
//! exponent (E8M0, biased by 127) for each block of 32. An element is one of ±{0, 0.5, 1,
//! 1.5, 2, 3, 4, 6} times its block's 2^(scale − 127): every value is exact in bf16, which is
//! how they are held (as transformers holds them where it has no MXFP4 kernel).

use half::bf16;

/// Elements in one scaled block.
pub const BLOCK: usize = 32;

/// The sixteen values of an FP4 e2m1 element (sign, two exponent bits, one mantissa bit).
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The `[rows, cols]` matrix that `blocks` and `scales` hold, in bf16; an error when their
/// sizes do not fit `rows × cols` or a scale is E8M0's NaN (255).
pub fn dequantize(
    blocks: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<bf16>, String> {
    if !cols.is_multiple_of(BLOCK) {
        return Err(format!(
            "{cols} columns is not a whole number of {BLOCK}-element blocks"
        ));
    }
    let per_row = cols / BLOCK;
    if blocks.len() != rows * per_row * BLOCK / 2 || scales.len() != rows * per_row {
        return Err(format!(
            "{} block bytes and {} scales for a [{rows}, {cols}] matrix (expected {} and {})",
            blocks.len(),
            scales.len(),
            rows * per_row * BLOCK / 2,
            rows * per_row
        ));
    }
    if let Some(at) = scales.iter().position(|&s| s == 0xFF) {
        return Err(format!("scale {at} is 255, E8M0's NaN"));
    }
    let mut out = Vec::with_capacity(rows * cols);
    for (block, &scale) in blocks.chunks_exact(BLOCK / 2).zip(scales) {
        let factor = (f32::from(scale) - 127.0).exp2();
        for &byte in block {
            out.push(bf16::from_f32(E2M1[usize::from(byte & 0x0F)] * factor));
            out.push(bf16::from_f32(E2M1[usize::from(byte >> 4)] * factor));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_take_their_blocks_scale_low_nibble_first() {
        // One row of 64: block 0 scaled by 2^0, block 1 by 2^-3.
        let mut blocks = vec![0u8; 32];
        blocks[0] = 0x72; // 1.0 then 6.0
        blocks[16] = 0x9F; // -6.0 then -0.5
        let scales = [127, 124];
        let out = dequantize(&blocks, &scales, 1, 64).unwrap();
        assert_eq!(out.len(), 64);
        assert_eq!(out[0].to_f32(), 1.0);
        assert_eq!(out[1].to_f32(), 6.0);
        assert_eq!(out[32].to_f32(), -6.0 / 8.0);
        assert_eq!(out[33].to_f32(), -0.5 / 8.0);
        assert!(out[2..32].iter().all(|v| v.to_f32() == 0.0));
    }

    #[test]
    fn sizes_that_do_not_fit_and_nan_scales_are_refused() {
        assert!(
            dequantize(&[0; 16], &[127], 1, 48)
                .unwrap_err()
                .contains("48")
        );
        assert!(
            dequantize(&[0; 15], &[127], 1, 32)
                .unwrap_err()
                .contains("15")
        );
        assert!(
            dequantize(&[0; 16], &[255], 1, 32)
                .unwrap_err()
                .contains("NaN")
        );
    }
}
