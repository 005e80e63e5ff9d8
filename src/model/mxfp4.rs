//! MXFP4 (OCP Microscaling, FP4 e2m1 elements): how gpt-oss publishes its experts. A matrix
//! `[rows, cols]` is stored as `blocks` `[rows, cols / 32, 16]` bytes, two 4-bit elements a
//! byte (the low nibble first), and `scales` `[rows, cols / 32]` bytes, one power-of-two
//! exponent (E8M0, biased by 127) for each block of 32. An element is one of ±{0, 0.5, 1,
//! 1.5, 2, 3, 4, 6} times its block's 2^(scale − 127): every value is exact in bf16. Routed
//! experts are held as stored (`compute::quant`); what else is stored so is widened here.

use half::bf16;

pub use crate::compute::quant::MXFP4_BLOCK as BLOCK;
use crate::compute::quant::{E2M1, e8m0_to_f32, mxfp4};

/// The `[rows, cols]` matrix that `blocks` and `scales` hold, in bf16; an error when their
/// sizes do not fit `rows × cols` or a scale is E8M0's NaN (255). Routed experts are held as
/// stored instead (`crate::compute::quant::QuantFormat::Mxfp4`).
pub fn dequantize(
    blocks: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<bf16>, String> {
    mxfp4::check(blocks, scales, rows, cols)?;
    let mut out = Vec::with_capacity(rows * cols);
    for (block, &scale) in blocks.chunks_exact(BLOCK / 2).zip(scales) {
        let factor = e8m0_to_f32(scale);
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
