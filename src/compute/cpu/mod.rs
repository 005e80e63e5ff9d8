//! CPU kernels: matrix products through the `gemm` crate (packed, SIMD, multi-threaded),
//! a hand-written matrix-vector product for single rows (where packing costs more than it
//! saves), and the element-wise operations of a transformer block.
//!
//! The files form layers, each importing only from those below it: `element`, `parallel` and
//! `simd` (nothing of the kernels); `decode`, `gemm` and `tiles` (the kernels); then the AMX
//! tiles (`compute::amx`) and the quantized formats' kernels (`compute::quant`), which build
//! on those; `linear` (the dense layers and the choice among the kernels) and, here, the
//! report of what runs on this machine.

pub(super) mod decode;
pub(super) mod element;
pub(super) mod gemm;
mod linear;
pub mod native_bf16;
pub(super) mod ops;
pub(super) mod parallel;
pub(super) mod simd;
pub(super) mod tiles;

#[cfg(test)]
pub(crate) mod tests;

pub use element::{Stored, WeightElement};
pub use gemm::{matmul, matmul_strided, matmul_transposed_strided, matmul_widening};
pub use linear::{Linear, SwiGlu, matmul_transposed};
pub use ops::{
    add_in_place, dot, dot_strided, rms_norm, rms_norm_in_place, silu_mul, softmax_in_place,
    weighted_rows,
};

#[cfg(target_arch = "x86_64")]
use crate::compute::amx;
#[cfg(target_arch = "x86_64")]
use decode::DecodeKernel;
#[cfg(target_arch = "x86_64")]
use tiles::TileKernel;

/// The instruction set the CPU kernels run with on this machine, as their run-time dispatch
/// (`multiversion`, the first of the kernels' targets whose features the CPU has) picks it,
/// the register tiles of products of 4 to 32 rows (`dot_tiles`), the decode kernels, and
/// whether products of many rows with bf16 weights run on AMX tiles (`compute::amx`). Other
/// products widen bf16, FP8 and INT4 weights to f32 and accumulate in f32. AVX512_BF16's
/// `vdpbf16ps`, which rounds its inputs to bf16, runs only where `devices.cpu_precision =
/// "bf16"` asks for that rounding ([`native_bf16`], which says what runs).
pub fn kernel_path() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        // The kernels' targets, in their order of preference.
        let path = if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            "AVX-512 with FMA"
        } else if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            "AVX2 with FMA"
        } else {
            "portable (no AVX2 and FMA: the compiler's baseline x86_64)"
        };
        let tiles = TileKernel::detect().map_or("none: one weight row at a time", TileKernel::name);
        let decode = DecodeKernel::detect().map_or("one weight row at a time", DecodeKernel::name);
        format!(
            "{path}; few-row tiles {tiles}; decode rows {decode}; INT4 decode rows {}; {}; other \
             weights widened to f32 as they are loaded",
            crate::compute::quant::int4_decode_path(),
            amx_path()
        )
    }
    #[cfg(target_arch = "aarch64")]
    {
        "NEON with FMA; weights widened to f32 as they are loaded".to_string()
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "portable (the compiler's baseline)".to_string()
    }
}

/// What products of many rows with bf16 weights run on, as [`kernel_path`] says it.
#[cfg(target_arch = "x86_64")]
fn amx_path() -> String {
    match amx::status() {
        amx::AmxStatus::Enabled if amx::is_set_aside() => {
            "AMX tiles not used (devices.cpu_amx = false)".to_string()
        }
        amx::AmxStatus::Enabled => {
            let int4_tiles = crate::compute::quant::INT4_BF16_TILES_MIN_ROWS;
            let int4 = if amx::int4::int8_enabled() {
                format!(
                    "; INT4 weights by {} to {} rows on AMX-INT8 tiles (inputs as four 8-bit \
                     digits: to within 2^-28 of each row's largest)",
                    amx::int4::MIN_ROWS,
                    int4_tiles - 1
                )
            } else {
                String::new()
            };
            format!(
                "products of {} or more rows with bf16 or FP8 weights, and of {int4_tiles} or \
                 more with INT4, on AMX-BF16 tiles (inputs split into three bf16 parts: exact \
                 to f32){int4}",
                amx::MIN_ROWS
            )
        }
        amx::AmxStatus::Unavailable(why) => format!("no AMX tiles ({why})"),
    }
}
