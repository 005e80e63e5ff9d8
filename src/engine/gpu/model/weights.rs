//! The dense weights as the GPU holds them: projections in bf16 (an MLP's gate and up
//! stacked into one product), norms and biases in f32, uploaded once at load.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use half::bf16;

use crate::compute::cpu::SwiGlu;
use crate::compute::cuda::CudaError;
use crate::compute::cuda::experts::Buffer;
use crate::model::weights::{
    AttentionWeights, DenseWeights, FeedForward, LinearAttentionWeights, QueryProjection, RmsNorm,
    StoredLinear,
};

/// A projection: bf16 `[out, in]` and its f32 bias.
pub(super) struct Matrix {
    pub(super) weight: Buffer,
    pub(super) bias: Option<Buffer>,
    pub(super) out: usize,
    pub(super) inp: usize,
}

pub(super) struct Norm {
    pub(super) weight: Buffer,
    pub(super) eps: f32,
}

/// A SwiGLU block with gate and up stacked into one `[2·I, H]` product.
pub(super) struct Mlp {
    pub(super) gate_up: Matrix,
    pub(super) down: Matrix,
}

// One per layer: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
pub(super) enum Query {
    Direct(Matrix),
    LowRank {
        down: Matrix,
        norm: Norm,
        up: Matrix,
    },
}

pub(super) enum Attention {
    Gqa {
        q: Matrix,
        k: Matrix,
        v: Matrix,
        o: Matrix,
        q_norm: Option<Norm>,
        k_norm: Option<Norm>,
        /// gpt-oss's sink logit per head (f32).
        sinks: Option<Buffer>,
    },
    Mla {
        q: Query,
        kv_down: Matrix,
        kv_norm: Norm,
        /// `kv_b_proj` as bf16 `[heads · (nope + v), kv_lora_rank]`, used per head.
        kv_up: Buffer,
        o: Matrix,
    },
    /// Gated DeltaNet, a hybrid model's linear attention.
    Linear(LinearLayer),
}

/// A gated DeltaNet layer: its projections in bf16, the rest in f32 (see
/// [`LinearAttentionWeights`]).
pub(super) struct LinearLayer {
    pub(super) qkv: Matrix,
    pub(super) z: Matrix,
    pub(super) b: Matrix,
    pub(super) a: Matrix,
    /// `[channels, kernel]`.
    pub(super) conv: Buffer,
    pub(super) dt_bias: Buffer,
    pub(super) decay_scale: Buffer,
    pub(super) norm: Norm,
    pub(super) out: Matrix,
}

pub(super) struct Layer {
    pub(super) input_norm: Norm,
    pub(super) attention: Attention,
    pub(super) post_norm: Norm,
    /// The dense MLP, or the shared expert of an MoE layer.
    pub(super) mlp: Option<Mlp>,
    /// The shared expert's gate (`[1, H]`), where its output is scaled by the sigmoid of it.
    pub(super) shared_gate: Option<Matrix>,
    pub(super) moe: bool,
}

/// Everything [`upload`] puts on the GPU.
pub(super) struct Uploaded {
    pub(super) layers: Vec<Layer>,
    pub(super) final_norm: Norm,
    pub(super) lm_head: Matrix,
}

/// Everything the weights will take on the GPU, in bytes.
pub(super) fn weight_bytes(weights: &DenseWeights) -> usize {
    fn linear(l: &StoredLinear) -> usize {
        l.out_features() * l.in_features() * 2 + l.bias().map_or(0, |b| b.len() * 4)
    }
    let norm = |n: &RmsNorm| n.weight.len() * 4;
    let layers: usize = weights
        .layers
        .iter()
        .map(|l| {
            let attention = match (&l.linear_attention, &l.attention) {
                (Some(w), _) => {
                    linear(&w.qkv)
                        + linear(&w.z)
                        + linear(&w.b)
                        + linear(&w.a)
                        + linear(&w.out)
                        + (w.conv.len() + w.dt_bias.len() + w.decay_scale.len()) * 4
                        + norm(&w.norm)
                }
                (
                    None,
                    AttentionWeights::Gqa {
                        q,
                        k,
                        v,
                        o,
                        q_norm,
                        k_norm,
                    },
                ) => {
                    linear(q)
                        + linear(k)
                        + linear(v)
                        + linear(o)
                        + q_norm.as_ref().map_or(0, norm)
                        + k_norm.as_ref().map_or(0, norm)
                }
                (
                    None,
                    AttentionWeights::Mla {
                        q,
                        kv_down,
                        kv_norm,
                        kv_up,
                        o,
                    },
                ) => {
                    let q = match q {
                        QueryProjection::Direct(p) => linear(p),
                        QueryProjection::LowRank { down, norm: n, up } => {
                            linear(down) + norm(n) + linear(up)
                        }
                    };
                    q + linear(kv_down) + norm(kv_norm) + kv_up.weight.len() * 2 + linear(o)
                }
            };
            let ff = match &l.feed_forward {
                FeedForward::Dense(m) => m.parameters() * 2,
                // The router is uploaded too, for routing on the GPU.
                FeedForward::Moe(moe) => {
                    moe.shared_expert.as_ref().map_or(0, |e| e.parameters() * 2)
                        + moe.shared_expert_gate.as_ref().map_or(0, |g| g.len() * 2)
                        + linear(&moe.router)
                        + moe.correction_bias.as_ref().map_or(0, |b| b.len() * 4)
                }
            };
            let sinks = l.sinks.as_ref().map_or(0, |s| s.len() * 4);
            attention + sinks + ff + norm(&l.input_norm) + norm(&l.post_attention_norm)
        })
        .sum();
    layers + linear(weights.lm_head()) + norm(&weights.final_norm)
}

fn to_bf16(values: &[f32]) -> Vec<bf16> {
    values.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// `l` as a bf16 product on the GPU.
pub(super) fn matrix_of(stream: &Arc<CudaStream>, l: &StoredLinear) -> Result<Matrix, CudaError> {
    Ok(Matrix {
        weight: Buffer::from_host(stream, &to_bf16(&l.widened()))?,
        bias: l.bias().map(|b| Buffer::from_host(stream, b)).transpose()?,
        out: l.out_features(),
        inp: l.in_features(),
    })
}

/// A gated DeltaNet layer on the GPU.
fn linear_layer(
    stream: &Arc<CudaStream>,
    w: &LinearAttentionWeights,
) -> Result<LinearLayer, CudaError> {
    let matrix = |l: &StoredLinear| matrix_of(stream, l);
    Ok(LinearLayer {
        qkv: matrix(&w.qkv)?,
        z: matrix(&w.z)?,
        b: matrix(&w.b)?,
        a: matrix(&w.a)?,
        conv: Buffer::from_host(stream, &w.conv)?,
        dt_bias: Buffer::from_host(stream, &w.dt_bias)?,
        decay_scale: Buffer::from_host(stream, &w.decay_scale)?,
        norm: Norm {
            weight: Buffer::from_host(stream, &w.norm.weight)?,
            eps: w.norm.eps,
        },
        out: matrix(&w.out)?,
    })
}

/// Uploads the dense weights (as bf16 where they are products), layer by layer.
pub(super) fn upload(
    stream: &Arc<CudaStream>,
    weights: &DenseWeights,
) -> Result<Uploaded, CudaError> {
    let upload_matrix =
        |weight: &[f32], bias: Option<&[f32]>, out, inp| -> Result<Matrix, CudaError> {
            Ok(Matrix {
                weight: Buffer::from_host(stream, &to_bf16(weight))?,
                bias: bias.map(|b| Buffer::from_host(stream, b)).transpose()?,
                out,
                inp,
            })
        };
    let matrix = |l: &StoredLinear| matrix_of(stream, l);
    let norm = |n: &RmsNorm| -> Result<Norm, CudaError> {
        Ok(Norm {
            weight: Buffer::from_host(stream, &n.weight)?,
            eps: n.eps,
        })
    };
    let mlp = |m: &SwiGlu| -> Result<Mlp, CudaError> {
        if m.gate.bias.is_some() || m.up.bias.is_some() {
            return Err(CudaError::Unsupported(
                "biases on an MLP's gate or up projection".into(),
            ));
        }
        let mut stacked = to_bf16(&m.gate.weight);
        stacked.extend(to_bf16(&m.up.weight));
        Ok(Mlp {
            gate_up: Matrix {
                weight: Buffer::from_host(stream, &stacked)?,
                bias: None,
                out: m.gate.out_features + m.up.out_features,
                inp: m.gate.in_features,
            },
            down: upload_matrix(
                &m.down.weight,
                m.down.bias.as_deref(),
                m.down.out_features,
                m.down.in_features,
            )?,
        })
    };
    let mut layers = Vec::with_capacity(weights.layers.len());
    for l in &weights.layers {
        let attention = match (&l.linear_attention, &l.attention) {
            (Some(w), _) => Attention::Linear(linear_layer(stream, w)?),
            (
                None,
                AttentionWeights::Gqa {
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                },
            ) => Attention::Gqa {
                q: matrix(q)?,
                k: matrix(k)?,
                v: matrix(v)?,
                o: matrix(o)?,
                q_norm: q_norm.as_ref().map(norm).transpose()?,
                k_norm: k_norm.as_ref().map(norm).transpose()?,
                sinks: l
                    .sinks
                    .as_ref()
                    .map(|s| Buffer::from_host(stream, s))
                    .transpose()?,
            },
            (
                None,
                AttentionWeights::Mla {
                    q,
                    kv_down,
                    kv_norm,
                    kv_up,
                    o,
                },
            ) => Attention::Mla {
                q: match q {
                    QueryProjection::Direct(p) => Query::Direct(matrix(p)?),
                    QueryProjection::LowRank { down, norm: n, up } => Query::LowRank {
                        down: matrix(down)?,
                        norm: norm(n)?,
                        up: matrix(up)?,
                    },
                },
                kv_down: matrix(kv_down)?,
                kv_norm: norm(kv_norm)?,
                kv_up: Buffer::from_host(stream, &to_bf16(&kv_up.weight))?,
                o: matrix(o)?,
            },
        };
        let (ff, shared_gate, moe) = match &l.feed_forward {
            FeedForward::Dense(m) => (Some(mlp(&m.widened())?), None, false),
            FeedForward::Moe(w) => (
                w.shared_expert
                    .as_ref()
                    .map(|e| mlp(&e.widened()))
                    .transpose()?,
                w.shared_expert_gate
                    .as_ref()
                    .map(|g| upload_matrix(g, None, 1, g.len()))
                    .transpose()?,
                true,
            ),
        };
        layers.push(Layer {
            input_norm: norm(&l.input_norm)?,
            attention,
            post_norm: norm(&l.post_attention_norm)?,
            mlp: ff,
            shared_gate,
            moe,
        });
        // Each layer's host copies go before the next layer's are made.
        stream.synchronize()?;
    }
    Ok(Uploaded {
        layers,
        final_norm: norm(&weights.final_norm)?,
        lm_head: matrix(weights.lm_head())?,
    })
}
