//! One routed expert's weights as the kernels take them: a SwiGLU block in one of the
//! stored forms. The model builds them from a checkpoint (`crate::model::weights`); the CPU
//! device slots run them, and the GPU uploads them.

use half::bf16;

use super::cpu::{Linear, SwiGlu, WeightElement};
use super::quant::{QuantLinear, QuantSwiGlu, SwiGluActivation};

/// One expert's FFN, a SwiGLU block of `moe_intermediate_size`, held in the checkpoint's
/// precision when that is bf16 (exact, and half the bytes each token reads) or quantized
/// (FP8, INT4 or MXFP4 as stored, dequantized as the kernel reads it), else in f32.
#[derive(Debug, Clone)]
pub enum ExpertWeights {
    F32(SwiGlu<f32>),
    Bf16(SwiGlu<bf16>),
    Quantized(QuantSwiGlu),
}

impl ExpertWeights {
    pub fn forward_with(&self, x: &[f32], rows: usize, parallel: bool) -> Vec<f32> {
        match self {
            ExpertWeights::F32(block) => block.forward_with(x, rows, parallel),
            ExpertWeights::Bf16(block) => block.forward_with(x, rows, parallel),
            ExpertWeights::Quantized(block) => block.forward_with(x, rows, parallel),
        }
    }

    /// The block with f32 weights (a copy, or a clone where it is f32 already): for a
    /// backend that keeps its own precision. A quantized block's clamped activation is
    /// folded into its weights ([`clamped_swiglu`]), as f32 blocks hold it.
    pub fn widened(&self) -> SwiGlu {
        fn widen<W: WeightElement>(l: &Linear<W>) -> Linear {
            Linear {
                weight: W::widen(&l.weight).into_owned(),
                bias: l.bias.clone(),
                out_features: l.out_features,
                in_features: l.in_features,
                clamp: l.clamp,
            }
        }
        fn dequantize(l: &QuantLinear) -> Linear {
            Linear {
                bias: l.bias.clone(),
                ..Linear::without_bias(l.widen(), l.out_features, l.in_features)
            }
        }
        match self {
            ExpertWeights::F32(block) => block.clone(),
            ExpertWeights::Bf16(b) => SwiGlu {
                gate: widen(&b.gate),
                up: widen(&b.up),
                down: widen(&b.down),
            },
            ExpertWeights::Quantized(b) => {
                let block = SwiGlu {
                    gate: dequantize(&b.gate),
                    up: dequantize(&b.up),
                    down: dequantize(&b.down),
                };
                match b.activation {
                    SwiGluActivation::Silu => block,
                    SwiGluActivation::ClampedGptOss { alpha, limit } => {
                        clamped_swiglu(block, alpha, limit)
                    }
                    SwiGluActivation::Clamped { limit } => {
                        let mut block = block;
                        block.gate.clamp = Some([f32::NEG_INFINITY, limit]);
                        block.up.clamp = Some([-limit, limit]);
                        block
                    }
                }
            }
        }
    }

    /// How many weights the block has (whatever their form).
    pub fn parameters(&self) -> usize {
        let (gate, down) = match self {
            ExpertWeights::F32(b) => (b.gate.weight.len(), b.down.weight.len()),
            ExpertWeights::Bf16(b) => (b.gate.weight.len(), b.down.weight.len()),
            ExpertWeights::Quantized(b) => (
                b.gate.out_features * b.gate.in_features,
                b.down.out_features * b.down.in_features,
            ),
        };
        // gate and up have the same shape.
        2 * gate + down
    }

    /// Bytes of weights one pass reads.
    pub fn weight_bytes(&self) -> usize {
        match self {
            ExpertWeights::F32(block) => block.weight_bytes(),
            ExpertWeights::Bf16(block) => block.weight_bytes(),
            ExpertWeights::Quantized(block) => block.weight_bytes(),
        }
    }
}

/// gpt-oss's expert `down((clamp(u, -l, l) + 1) * g * sigmoid(alpha * g))`, `g = min(gate, l)`,
/// as the SwiGLU block `down(silu(g') * u')` that computes it: `g' = alpha * g` (so
/// `silu(g') = alpha * g * sigmoid(alpha * g)`), clamped at `alpha * l`, and
/// `u' = (u + 1) / alpha`, clamped to `[(1 - l) / alpha, (1 + l) / alpha]`. In f32: the
/// scaled weights are not bf16 values. Equal to [`SwiGluActivation::ClampedGptOss`] on the
/// unscaled block up to f32 rounding (the weights are scaled before the products, not after).
pub fn clamped_swiglu(mut block: SwiGlu, alpha: f32, limit: f32) -> SwiGlu {
    let scale = |l: &mut Linear, by: f32| {
        l.weight.iter_mut().for_each(|w| *w *= by);
        if let Some(b) = &mut l.bias {
            b.iter_mut().for_each(|b| *b *= by);
        }
    };
    scale(&mut block.gate, alpha);
    block.gate.clamp = Some([f32::NEG_INFINITY, alpha * limit]);
    let up_bias = block
        .up
        .bias
        .get_or_insert_with(|| vec![0.0; block.up.out_features]);
    up_bias.iter_mut().for_each(|b| *b += 1.0);
    scale(&mut block.up, 1.0 / alpha);
    block.up.clamp = Some([(1.0 - limit) / alpha, (1.0 + limit) / alpha]);
    block
}
