//! DeepSeek-V4's routed experts (`layers.N.ffn.experts.E.{w1,w3,w2}`) and the scale format its
//! projections share. Here rather than beside the family's forward pass
//! (`crate::engine::deepseek_v4`) because every holder of experts loads them through
//! [`super::load_expert`]: the engine, a node's CPU device slots, a rebalance or a placement
//! change. An expert's SwiGLU is clamped at `swiglu_limit`. MXFP4 experts (`.weight` two e2m1
//! values a byte, low nibble first, `.scale` one e8m0 exponent per 32) and FP8 ones (`.scale`
//! ue8m0 per 128 x 128 block) are held compressed as published, with the clamp as their
//! activation ([`SwiGluActivation::Clamped`]); bf16 and f32 go through the families' loader
//! (f32 kept f32) and take the clamp on their projections ([`clamp_swiglu`]).

use half::bf16;
use safetensors::tensor::Dtype;

use super::ExpertWeights;
use crate::compute::cpu::{Linear, SwiGlu, WeightElement};
use crate::compute::quant::{QuantLinear, QuantSwiGlu, SwiGluActivation};
use crate::model::config::{DeepseekV4, ModelConfig};
use crate::model::{Checkpoint, ModelError, mxfp4};

/// FP8 block size of the published checkpoints.
pub const FP8_BLOCK: [usize; 2] = [128, 128];

/// A ue8m0 scale as its definition gives it: the byte is the biased exponent of a power of
/// two, `2^(e - 127)`; 255 is NaN.
pub fn ue8m0(byte: u8) -> Option<f32> {
    (byte != 255).then(|| (f32::from(byte) - 127.0).exp2())
}

/// A tensor that does not hold what its name says.
pub fn corrupt(ckpt: &Checkpoint, name: &str, reason: impl std::fmt::Display) -> ModelError {
    ModelError::Corrupt {
        path: ckpt.dir().to_path_buf(),
        reason: format!("`{name}`: {reason}"),
    }
}

/// `{name}.scale` of `shape` as f32 factors: ue8m0 bytes decoded, or stored as floats.
pub fn scales(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
    let scale = format!("{name}.scale");
    if !matches!(ckpt.dtype(&scale), Some(Dtype::F8_E8M0 | Dtype::U8)) {
        return ckpt.read_f32(&scale, shape);
    }
    ckpt.read_bytes(&scale, shape, &[Dtype::F8_E8M0, Dtype::U8])?
        .into_iter()
        .map(|b| ue8m0(b).ok_or_else(|| corrupt(ckpt, &scale, "a scale is 255, e8m0's NaN")))
        .collect()
}

/// `down(silu(min(gate, limit)) * clamp(up, -limit, limit))`: DeepSeek-V4's experts and
/// shared experts.
pub fn clamp_swiglu<W: WeightElement>(block: &mut SwiGlu<W>, limit: f32) {
    block.gate.clamp = Some([f32::NEG_INFINITY, limit]);
    block.up.clamp = Some([-limit, limit]);
}

/// A routed expert's projection `[out, inp]` in bf16: MXFP4 and FP8 widened (exactly: e2m1
/// and e4m3 values times powers of two are bf16 values), bf16 as stored, f32 rounded.
pub fn expert_matrix(
    ckpt: &Checkpoint,
    name: &str,
    out: usize,
    inp: usize,
) -> Result<Vec<bf16>, ModelError> {
    if let Some(matrix) = compressed_matrix(ckpt, name, out, inp)? {
        return Ok(matrix.widen().into_iter().map(bf16::from_f32).collect());
    }
    let weight = format!("{name}.weight");
    match ckpt.dtype(&weight) {
        // MXFP4 rows that are not whole blocks.
        Some(dtype @ (Dtype::F4 | Dtype::I8 | Dtype::U8)) => {
            let (packed, exponents) = mxfp4_parts(ckpt, name, dtype, out, inp)?;
            mxfp4::dequantize(&packed, &exponents, out, inp).map_err(|e| corrupt(ckpt, &weight, e))
        }
        Some(Dtype::BF16) => ckpt.read_bf16(&weight, &[out, inp]),
        _ => Ok(ckpt
            .read_f32(&weight, &[out, inp])?
            .into_iter()
            .map(bf16::from_f32)
            .collect()),
    }
}

/// An MXFP4 projection's packed e2m1 pairs (`.weight` of `dtype`) and its e8m0 exponents
/// (`.scale`, one per 32 weights of a row, the last block of a row possibly partial).
fn mxfp4_parts(
    ckpt: &Checkpoint,
    name: &str,
    dtype: Dtype,
    out: usize,
    inp: usize,
) -> Result<(Vec<u8>, Vec<u8>), ModelError> {
    // F4 counts its values; I8 and U8 count the bytes that pack them.
    let packed_shape = if dtype == Dtype::F4 {
        [out, inp]
    } else {
        [out, inp / 2]
    };
    let packed = ckpt.read_bytes(&format!("{name}.weight"), &packed_shape, &[dtype])?;
    let exponents = ckpt.read_bytes(
        &format!("{name}.scale"),
        &[out, inp.div_ceil(mxfp4::BLOCK)],
        &[Dtype::F8_E8M0, Dtype::U8],
    )?;
    Ok((packed, exponents))
}

/// A routed expert's projection `[out, inp]` held as published: MXFP4 as its blocks and
/// exponents, FP8 as its bytes and block scales. `None` for other dtypes, and for MXFP4 whose
/// rows are not whole 32-weight blocks (never so in a published model: those widen).
fn compressed_matrix(
    ckpt: &Checkpoint,
    name: &str,
    out: usize,
    inp: usize,
) -> Result<Option<QuantLinear>, ModelError> {
    let weight = format!("{name}.weight");
    let quantized = match ckpt.dtype(&weight) {
        Some(dtype @ (Dtype::F4 | Dtype::I8 | Dtype::U8)) if inp.is_multiple_of(mxfp4::BLOCK) => {
            let (packed, exponents) = mxfp4_parts(ckpt, name, dtype, out, inp)?;
            QuantLinear::mxfp4(packed, exponents, out, inp)
        }
        Some(Dtype::F8_E4M3) => {
            let [rows, cols] = FP8_BLOCK;
            let bytes = ckpt.read_fp8(&weight, &[out, inp])?;
            let factors = scales(ckpt, name, &[out.div_ceil(rows), inp.div_ceil(cols)])?;
            QuantLinear::fp8(bytes, factors, out, inp, FP8_BLOCK)
        }
        _ => return Ok(None),
    };
    quantized.map(Some).map_err(|e| corrupt(ckpt, &weight, e))
}

/// Routed expert `expert` of layer `layer`, clamped at `swiglu_limit`: MXFP4 and FP8 ones
/// kept compressed, as published (a Pro expert holds 4.25 bits a weight, not 16); `families`
/// loads the bf16 and f32 ones (the loader every family shares).
pub fn load_expert(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    v4: &DeepseekV4,
    (layer, expert): (usize, usize),
    families: impl FnOnce() -> Result<ExpertWeights, ModelError>,
) -> Result<ExpertWeights, ModelError> {
    let (h, i) = (cfg.hidden_size, cfg.moe.expert_intermediate_size);
    let (prefix, names) = cfg.family.routed_expert(layer, expert);
    let [gate, up, down] = [names.gate, names.up, names.down].map(|n| format!("{prefix}.{n}"));
    let held = [
        compressed_matrix(ckpt, &gate, i, h)?,
        compressed_matrix(ckpt, &up, i, h)?,
        compressed_matrix(ckpt, &down, h, i)?,
    ];
    if let [Some(gate), Some(up), Some(down)] = held {
        return Ok(ExpertWeights::Quantized(QuantSwiGlu {
            gate,
            up,
            down,
            activation: SwiGluActivation::Clamped {
                limit: v4.swiglu_limit,
            },
        }));
    }
    let compressed = matches!(
        ckpt.dtype(&format!("{gate}.weight")),
        Some(Dtype::F4 | Dtype::I8 | Dtype::U8 | Dtype::F8_E4M3)
    );
    let mut expert = if compressed {
        ExpertWeights::Bf16(SwiGlu {
            gate: Linear::without_bias(expert_matrix(ckpt, &gate, i, h)?, i, h),
            up: Linear::without_bias(expert_matrix(ckpt, &up, i, h)?, i, h),
            down: Linear::without_bias(expert_matrix(ckpt, &down, h, i)?, h, i),
        })
    } else {
        families()?
    };
    match &mut expert {
        ExpertWeights::F32(block) => clamp_swiglu(block, v4.swiglu_limit),
        ExpertWeights::Bf16(block) => clamp_swiglu(block, v4.swiglu_limit),
        // Quantized under the config's quantization_config (INT4, say).
        ExpertWeights::Quantized(block) => {
            block.activation = SwiGluActivation::Clamped {
                limit: v4.swiglu_limit,
            }
        }
    }
    Ok(expert)
}
