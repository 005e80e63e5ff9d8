//! Weights held in a checkpoint's quantized form, and the CPU products that dequantize them as
//! they read them.
//!
//! Three stored forms, as published:
//! - FP8 e4m3 (`float8_e4m3fn`) with one f32 multiplier per `block_rows x block_cols` block
//!   (`weight_scale_inv`; DeepSeek-V3/R1, Kimi K2 Instruct, Qwen3 "-FP8"): 1 byte per weight.
//! - 4-bit symmetric integers packed eight to an int32 with one scale per `group` consecutive
//!   weights of a row (compressed-tensors `pack-quantized`; Kimi K2 Thinking and later):
//!   half a byte per weight.
//! - MXFP4 (OCP microscaling; gpt-oss's experts): 4-bit e2m1 values with one power-of-two
//!   scale per 32 consecutive weights of a row: 4.25 bits per weight.
//!
//! A product with few input rows (decode) is bound by the bytes of weights it reads, so its
//! kernels decode the stored values in registers as they load them and use each for every
//! input row: FP8 bytes through the bf16 kernel (the block scales multiply the inputs), INT4
//! words through the decode kernels (`int4_rows_avx512` at one row, `int4_rows_avx2` at one
//! to 32) or else [`int4_dot_rows`] (the group scales multiply sixteen words' partial sums);
//! MXFP4 rows are widened exactly (each nibble made an f32 by bit arithmetic, times the block's
//! power of two) into a row buffer dotted with every input row.
//! With many rows the matrix is widened once to f32 and handed to the packed GEMM, as bf16
//! weights are.
//!
//! The files form layers, each importing only from those below it: `e4m3`, `mxfp4` and
//! `format` (the stored forms, on the CPU's weight elements); `int4_rows` (the INT4 decode
//! kernels); then
//! the AMX tiles, which read the stored forms; `linear` (the layers and the choice among the
//! kernels) on top.

pub(super) mod e4m3;
pub(super) mod format;
mod int4_rows;
mod linear;
pub(crate) mod mxfp4;

pub use e4m3::{e4m3_to_f32, widen_e4m3};
pub use format::{GroupScales, QuantFormat};
pub use linear::{QuantLinear, QuantSwiGlu, SwiGluActivation};
pub use mxfp4::{E2M1, MXFP4_BLOCK, e8m0_to_f32};

#[cfg(target_arch = "x86_64")]
pub(crate) use int4_rows::int4_decode_path;
#[cfg(target_arch = "x86_64")]
pub(crate) use linear::INT4_BF16_TILES_MIN_ROWS;

#[cfg(test)]
pub(crate) mod tests;
