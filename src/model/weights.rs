//! Tensors of a checkpoint, by the names each family publishes them under, loaded into the
//! typed blocks the forward pass runs.

use std::borrow::Cow;

use half::bf16;
use safetensors::tensor::Dtype;

use super::config::{AttentionConfig, ExpertActivation, ModelConfig};
use super::dummy::DummyFill;
use super::family::ExpertNames;
use super::quant::Quantization;
use super::{Checkpoint, ModelError};
use crate::compute::cpu::{Linear, SwiGlu, WeightElement, add_in_place};
use crate::compute::expert::clamped_swiglu;
use crate::compute::quant::{QuantLinear, QuantSwiGlu, SwiGluActivation};

pub use crate::compute::expert::ExpertWeights;
use fused::{fused_expert, fused_layout};
pub use indexer::{IndexerWeights, KEY_NORM_EPS as INDEXER_KEY_NORM_EPS};
pub use linear_attention::LinearAttentionWeights;

/// The gated DeltaNet layers' weights and how each family stores them.
/// Routed experts stored fused, a layer's in two tensors.
pub(crate) mod deepseek_v4;
mod fused;
mod indexer;
mod linear_attention;

/// A dense projection held as the checkpoint stores it, as the experts are: bf16 kept bf16
/// (every product widens it exactly as it reads, so outputs are those of f32 weights, and a
/// decode step reads half the bytes), FP8 or INT4 kept quantized, anything else in f32.
#[derive(Debug, Clone)]
pub enum StoredLinear {
    F32(Linear<f32>),
    Bf16(Linear<bf16>),
    Quantized {
        matrix: QuantLinear,
        bias: Option<Vec<f32>>,
    },
}

impl StoredLinear {
    /// `x [rows, in] -> [rows, out]`, using all cores when the product is large enough.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.forward_with(x, rows, true)
    }

    /// As [`StoredLinear::forward`]; `parallel = false` keeps the work on this thread.
    pub fn forward_with(&self, x: &[f32], rows: usize, parallel: bool) -> Vec<f32> {
        match self {
            StoredLinear::F32(l) => l.forward_with(x, rows, parallel),
            StoredLinear::Bf16(l) => l.forward_with(x, rows, parallel),
            StoredLinear::Quantized { matrix, bias } => {
                let mut out = matrix.forward_with(x, rows, parallel);
                if let Some(bias) = bias {
                    for row in out.chunks_exact_mut(matrix.out_features) {
                        add_in_place(row, bias);
                    }
                }
                out
            }
        }
    }

    pub fn out_features(&self) -> usize {
        match self {
            StoredLinear::F32(l) => l.out_features,
            StoredLinear::Bf16(l) => l.out_features,
            StoredLinear::Quantized { matrix, .. } => matrix.out_features,
        }
    }

    pub fn in_features(&self) -> usize {
        match self {
            StoredLinear::F32(l) => l.in_features,
            StoredLinear::Bf16(l) => l.in_features,
            StoredLinear::Quantized { matrix, .. } => matrix.in_features,
        }
    }

    pub fn bias(&self) -> Option<&[f32]> {
        match self {
            StoredLinear::F32(l) => l.bias.as_deref(),
            StoredLinear::Bf16(l) => l.bias.as_deref(),
            StoredLinear::Quantized { bias, .. } => bias.as_deref(),
        }
    }

    /// Bytes held in memory (weights, scales and bias): what one pass reads.
    pub fn stored_bytes(&self) -> usize {
        let bias = self.bias().map_or(0, |b| 4 * b.len());
        bias + match self {
            StoredLinear::F32(l) => 4 * l.weight.len(),
            StoredLinear::Bf16(l) => 2 * l.weight.len(),
            StoredLinear::Quantized { matrix, .. } => matrix.stored_bytes(),
        }
    }

    /// Appends row `row` of the weight, in f32, to `out` (an embedding lookup).
    pub fn extend_with_row(&self, row: usize, out: &mut Vec<f32>) {
        let k = self.in_features();
        match self {
            StoredLinear::F32(l) => out.extend_from_slice(&l.weight[row * k..][..k]),
            StoredLinear::Bf16(l) => {
                out.extend(l.weight[row * k..][..k].iter().map(|w| w.to_f32()))
            }
            StoredLinear::Quantized { matrix, .. } => {
                let start = out.len();
                out.resize(start + k, 0.0);
                matrix.dequantize_row(row, &mut out[start..]);
            }
        }
    }

    /// The weight in f32 (borrowed where it is f32 already): for a backend that keeps its
    /// own precision.
    pub fn widened(&self) -> Cow<'_, [f32]> {
        match self {
            StoredLinear::F32(l) => Cow::Borrowed(&l.weight),
            StoredLinear::Bf16(l) => bf16::widen(&l.weight),
            StoredLinear::Quantized { matrix, .. } => Cow::Owned(matrix.widen()),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Vec<f32>,
    pub eps: f32,
}

/// Projection to queries in MLA: direct, or through a low-rank bottleneck with a norm.
#[derive(Debug, Clone)]
pub enum QueryProjection {
    Direct(StoredLinear),
    LowRank {
        down: StoredLinear,
        norm: RmsNorm,
        up: StoredLinear,
    },
}

#[derive(Debug, Clone)]
pub enum AttentionWeights {
    Gqa {
        q: StoredLinear,
        k: StoredLinear,
        v: StoredLinear,
        o: StoredLinear,
        q_norm: Option<RmsNorm>,
        k_norm: Option<RmsNorm>,
    },
    Mla {
        q: QueryProjection,
        /// `kv_a_proj_with_mqa`: hidden -> latent (kv_lora_rank) + shared rope key.
        kv_down: StoredLinear,
        kv_norm: RmsNorm,
        /// `kv_b_proj`: latent -> per head (k_nope, v), `[heads * (nope + v), kv_lora_rank]`.
        /// Held in f32: attention multiplies by its blocks head by head, keys absorbed into
        /// the queries (Kimi K2: 8.4 M weights per layer, 16 MiB more than bf16).
        kv_up: Linear,
        o: StoredLinear,
    },
}

impl AttentionWeights {
    /// What a linear-attention layer holds in place of attention: GQA projections of no
    /// size. Nothing runs them (the engine runs the layer's `linear_attention`), and the GPU's
    /// dense part refuses hybrid models before it would read them.
    pub fn absent() -> Self {
        let none = || StoredLinear::F32(Linear::without_bias(Vec::new(), 0, 0));
        AttentionWeights::Gqa {
            q: none(),
            k: none(),
            v: none(),
            o: none(),
            q_norm: None,
            k_norm: None,
        }
    }
}

/// The gate of an MoE layer and its always-on parts. The routed experts are held apart (see
/// [`crate::experts::ExpertExecutor`]) so that they can live on other devices or nodes.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// `[num_experts, hidden]`.
    pub router: StoredLinear,
    pub correction_bias: Option<Vec<f32>>,
    /// Held in its stored form, as the routed experts are.
    pub shared_expert: Option<ExpertWeights>,
    /// `[hidden]`, in f32: the shared expert's output is scaled by the sigmoid of this row's
    /// dot product with the input (`shared_expert_gate`: Qwen3-Next, Qwen3.5).
    pub shared_expert_gate: Option<Vec<f32>>,
}

#[derive(Debug, Clone)]
pub enum FeedForward {
    /// Held in its stored form, as the experts are.
    Dense(ExpertWeights),
    Moe(MoeWeights),
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub input_norm: RmsNorm,
    /// On a linear-attention layer (`linear_attention` is set) a placeholder without
    /// projections ([`AttentionWeights::absent`]); the layer's token mixer is that instead.
    pub attention: AttentionWeights,
    /// The gated DeltaNet of a hybrid model's linear-attention layer.
    pub linear_attention: Option<LinearAttentionWeights>,
    /// gpt-oss's attention sink logit per query head (`self_attn.sinks`).
    pub sinks: Option<Vec<f32>>,
    /// The lightning indexer of a layer that runs its own (DeepSeek Sparse Attention).
    pub indexer: Option<IndexerWeights>,
    pub post_attention_norm: RmsNorm,
    pub feed_forward: FeedForward,
}

/// Everything but the routed experts: what every router runs (data-parallel attention).
#[derive(Debug, Clone)]
pub struct DenseWeights {
    /// `[vocab, hidden]`, one row per token.
    pub embed_tokens: StoredLinear,
    pub layers: Vec<LayerWeights>,
    pub final_norm: RmsNorm,
    /// `[vocab, hidden]`; `None` when the model ties it to the embeddings.
    lm_head: Option<StoredLinear>,
}

impl DenseWeights {
    pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig) -> Result<Self, ModelError> {
        let h = cfg.hidden_size;
        let quant = &cfg.quantization;
        let embed_tokens = linear(ckpt, quant, "model.embed_tokens", cfg.vocab_size, h)?;
        let lm_head = if cfg.tie_word_embeddings && !ckpt.contains("lm_head.weight") {
            None
        } else {
            Some(linear(ckpt, quant, "lm_head", cfg.vocab_size, h)?)
        };
        let layers = (0..cfg.num_layers)
            .map(|l| {
                crate::progress::layer(l, cfg.num_layers);
                load_layer(ckpt, cfg, l)
            })
            .collect::<Result<_, _>>()?;
        if cfg.linear_attention.is_some() && !ckpt.is_dummy() && ckpt.contains(MTP_PROBE) {
            tracing::info!(
                "the checkpoint's multi-token-prediction layers (`mtp.*`) are not served"
            );
        }
        Ok(DenseWeights {
            embed_tokens,
            layers,
            final_norm: model_norm(ckpt, cfg, "model.norm", h)?,
            lm_head,
        })
    }

    /// The output projection to vocabulary logits.
    pub fn lm_head(&self) -> &StoredLinear {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }
}

/// Layer `l`'s attention projections and norms.
fn attention(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    l: usize,
) -> Result<AttentionWeights, ModelError> {
    let h = cfg.hidden_size;
    let quant = &cfg.quantization;
    let eps = cfg.rms_norm_eps;
    let p = format!("model.layers.{l}");
    let heads = cfg.num_heads;
    Ok(match cfg.attention {
        AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            qk_norm,
            output_gate,
            ..
        } => {
            let a = format!("{p}.self_attn");
            let norm_widths = qk_norm.widths(heads, num_kv_heads, head_dim);
            // With an output gate each head's query is followed by its gate.
            let q_width = heads * head_dim * if output_gate { 2 } else { 1 };
            AttentionWeights::Gqa {
                q: linear(ckpt, quant, &format!("{a}.q_proj"), q_width, h)?,
                k: linear(
                    ckpt,
                    quant,
                    &format!("{a}.k_proj"),
                    num_kv_heads * head_dim,
                    h,
                )?,
                v: linear(
                    ckpt,
                    quant,
                    &format!("{a}.v_proj"),
                    num_kv_heads * head_dim,
                    h,
                )?,
                o: linear(ckpt, quant, &format!("{a}.o_proj"), h, heads * head_dim)?,
                q_norm: norm_widths
                    .map(|(q, _)| model_norm(ckpt, cfg, &format!("{a}.q_norm"), q))
                    .transpose()?,
                k_norm: norm_widths
                    .map(|(_, k)| model_norm(ckpt, cfg, &format!("{a}.k_norm"), k))
                    .transpose()?,
            }
        }
        AttentionConfig::Mla {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            ..
        } => {
            let a = format!("{p}.self_attn");
            let q_dim = heads * (qk_nope_head_dim + qk_rope_head_dim);
            let q = match q_lora_rank {
                None => {
                    QueryProjection::Direct(linear(ckpt, quant, &format!("{a}.q_proj"), q_dim, h)?)
                }
                Some(rank) => QueryProjection::LowRank {
                    down: linear(ckpt, quant, &format!("{a}.q_a_proj"), rank, h)?,
                    norm: norm(ckpt, &format!("{a}.q_a_layernorm"), rank, eps)?,
                    up: linear(ckpt, quant, &format!("{a}.q_b_proj"), q_dim, rank)?,
                },
            };
            AttentionWeights::Mla {
                q,
                kv_down: linear(
                    ckpt,
                    quant,
                    &format!("{a}.kv_a_proj_with_mqa"),
                    kv_lora_rank + qk_rope_head_dim,
                    h,
                )?,
                kv_norm: norm(ckpt, &format!("{a}.kv_a_layernorm"), kv_lora_rank, eps)?,
                kv_up: linear_f32(
                    ckpt,
                    quant,
                    &format!("{a}.kv_b_proj"),
                    heads * (qk_nope_head_dim + v_head_dim),
                    kv_lora_rank,
                )?,
                o: linear(ckpt, quant, &format!("{a}.o_proj"), h, heads * v_head_dim)?,
            }
        }
    })
}

/// A tensor every Qwen3-Next and Qwen3.5 checkpoint with its multi-token-prediction layers
/// holds.
const MTP_PROBE: &str = "mtp.fc.weight";

fn load_layer(ckpt: &Checkpoint, cfg: &ModelConfig, l: usize) -> Result<LayerWeights, ModelError> {
    let h = cfg.hidden_size;
    let quant = &cfg.quantization;
    let p = format!("model.layers.{l}");
    let heads = cfg.num_heads;
    let (attention, linear_attention) = match &cfg.linear_attention {
        Some(linear) if linear.is_linear(l) => (
            AttentionWeights::absent(),
            Some(linear_attention::load(ckpt, cfg, linear, l)?),
        ),
        _ => (attention(ckpt, cfg, l)?, None),
    };
    let mlp = cfg.family.mlp_prefix(l);
    let feed_forward = if cfg.moe_layers[l] {
        let shared_expert = (cfg.moe.shared_intermediate_size > 0)
            .then(|| {
                expert_block(
                    ckpt,
                    quant,
                    &cfg.family.shared_experts(l),
                    ExpertNames::PROJ,
                    h,
                    cfg.moe.shared_intermediate_size,
                )
            })
            .transpose()?;
        let correction_bias = match cfg.family.correction_bias_name(l) {
            Some(name) if ckpt.contains(&name) => {
                Some(ckpt.read_f32(&name, &[cfg.moe.num_experts])?)
            }
            _ => None,
        };
        // Beside the shared expert, as Qwen2-MoE named it: `mlp.shared_expert_gate`.
        let shared_expert_gate = (cfg.moe.shared_expert_gate && shared_expert.is_some())
            .then(|| {
                let name = format!("{}_gate", cfg.family.shared_experts(l));
                linear_f32(ckpt, quant, &name, 1, h).map(|gate| gate.weight)
            })
            .transpose()?;
        FeedForward::Moe(MoeWeights {
            router: linear(ckpt, quant, &cfg.family.router(l), cfg.moe.num_experts, h)?,
            correction_bias,
            shared_expert,
            shared_expert_gate,
        })
    } else {
        FeedForward::Dense(expert_block(
            ckpt,
            quant,
            &mlp,
            ExpertNames::PROJ,
            h,
            cfg.intermediate_size,
        )?)
    };
    let sinks = match cfg.attention {
        AttentionConfig::Gqa { sinks: true, .. } => {
            Some(ckpt.read_f32(&format!("{p}.self_attn.sinks"), &[heads])?)
        }
        _ => None,
    };
    let indexer = match &cfg.attention {
        AttentionConfig::Mla {
            indexer: Some(indexer),
            q_lora_rank: Some(rank),
            ..
        } if indexer.has_own(l) => Some(indexer::load(ckpt, cfg, indexer, *rank, l)?),
        _ => None,
    };
    Ok(LayerWeights {
        input_norm: model_norm(ckpt, cfg, &format!("{p}.input_layernorm"), h)?,
        attention,
        linear_attention,
        sinks,
        indexer,
        post_attention_norm: model_norm(ckpt, cfg, &format!("{p}.post_attention_layernorm"), h)?,
        feed_forward,
    })
}

/// Loads routed expert `expert` of layer `layer` (DeepSeek-V4's clamped and widened: see
/// [`deepseek_v4::load_expert`]).
pub fn load_expert(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    layer: usize,
    expert: usize,
) -> Result<ExpertWeights, ModelError> {
    let (h, i) = (cfg.hidden_size, cfg.moe.expert_intermediate_size);
    if let Some((prefix, fused)) = fused_layout(ckpt, cfg, layer) {
        let block = fused_expert(ckpt, &prefix, fused, expert, [cfg.moe.num_experts, h, i])?;
        return Ok(match cfg.moe.activation {
            ExpertActivation::Silu => block,
            // MXFP4 stays as stored, the activation applied after its products; other forms
            // are held in f32 with the activation folded into their weights.
            ExpertActivation::ClampedSwiglu { alpha, limit } => match block {
                ExpertWeights::Quantized(mut q) => {
                    q.activation = SwiGluActivation::ClampedGptOss { alpha, limit };
                    ExpertWeights::Quantized(q)
                }
                other => ExpertWeights::F32(clamped_swiglu(other.widened(), alpha, limit)),
            },
        });
    }
    let (prefix, names) = cfg.family.routed_expert(layer, expert);
    let families = || expert_block(ckpt, &cfg.quantization, &prefix, names, h, i);
    match &cfg.deepseek_v4 {
        Some(v4) => deepseek_v4::load_expert(ckpt, cfg, v4, (layer, expert), families),
        None => families(),
    }
}

/// How a dummy checkpoint makes routed expert `expert` of `layer`: its gate, up and down
/// weights, in that order (`None` when the checkpoint is not dummy). A GPU makes them on the
/// device from this rather than uploading what [`load_expert`] would make on the host.
pub fn dummy_expert(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    layer: usize,
    expert: usize,
) -> Option<[DummyFill; 3]> {
    if fused_layout(ckpt, cfg, layer).is_some() {
        return None;
    }
    let (prefix, names) = cfg.family.routed_expert(layer, expert);
    let (h, i) = (cfg.hidden_size, cfg.moe.expert_intermediate_size);
    let fill =
        |name: &str, shape: [usize; 2]| ckpt.dummy_fill(&format!("{prefix}.{name}.weight"), &shape);
    Some([
        fill(names.gate, [i, h])?,
        fill(names.up, [i, h])?,
        fill(names.down, [h, i])?,
    ])
}

/// The SwiGLU block under `prefix` in its stored form: quantized as stored, bf16 kept bf16,
/// anything else widened to f32. Routed and shared experts are read alike.
fn expert_block(
    ckpt: &Checkpoint,
    quant: &Quantization,
    prefix: &str,
    names: ExpertNames,
    h: usize,
    i: usize,
) -> Result<ExpertWeights, ModelError> {
    let gate_prefix = format!("{prefix}.{}", names.gate);
    if let Some(gate) = quantized(ckpt, quant, &gate_prefix, i, h)? {
        let also = |name: &str, out, inp| {
            let module = format!("{prefix}.{name}");
            quantized(ckpt, quant, &module, out, inp)?.ok_or_else(|| ModelError::Corrupt {
                path: ckpt.dir().to_path_buf(),
                reason: format!(
                    "`{}` is quantized but `{}` is not: an expert's projections are \
                     stored alike",
                    ckpt.stored_name(&gate_prefix),
                    ckpt.stored_name(&module)
                ),
            })
        };
        return Ok(ExpertWeights::Quantized(QuantSwiGlu {
            gate,
            up: also(names.up, i, h)?,
            down: also(names.down, h, i)?,
            activation: SwiGluActivation::Silu,
        }));
    }
    let gate_name = format!("{gate_prefix}.weight");
    if ckpt.dtype(&gate_name) == Some(Dtype::BF16) {
        let read = |name: &str, out, inp| -> Result<Linear<bf16>, ModelError> {
            let weight = ckpt.read_bf16(&format!("{prefix}.{name}.weight"), &[out, inp])?;
            Ok(Linear::without_bias(weight, out, inp))
        };
        return Ok(ExpertWeights::Bf16(SwiGlu {
            gate: read(names.gate, i, h)?,
            up: read(names.up, i, h)?,
            down: read(names.down, h, i)?,
        }));
    }
    Ok(ExpertWeights::F32(swiglu(
        ckpt, quant, prefix, names, h, i,
    )?))
}

/// Loads every routed expert of every MoE layer: `[layer][expert]`, empty for dense layers.
pub fn load_all_experts(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
) -> Result<Vec<Vec<ExpertWeights>>, ModelError> {
    (0..cfg.num_layers)
        .map(|l| {
            if !cfg.moe_layers[l] {
                return Ok(Vec::new());
            }
            (0..cfg.moe.num_experts)
                .map(|e| load_expert(ckpt, cfg, l, e))
                .collect()
        })
        .collect()
}

fn swiglu(
    ckpt: &Checkpoint,
    quant: &Quantization,
    prefix: &str,
    names: ExpertNames,
    hidden: usize,
    intermediate: usize,
) -> Result<SwiGlu, ModelError> {
    Ok(SwiGlu {
        gate: linear_f32(
            ckpt,
            quant,
            &format!("{prefix}.{}", names.gate),
            intermediate,
            hidden,
        )?,
        up: linear_f32(
            ckpt,
            quant,
            &format!("{prefix}.{}", names.up),
            intermediate,
            hidden,
        )?,
        down: linear_f32(
            ckpt,
            quant,
            &format!("{prefix}.{}", names.down),
            hidden,
            intermediate,
        )?,
    })
}

/// `{prefix}.weight` of shape `[out, in]` in its stored form (quantized as stored, bf16 kept
/// bf16, anything else widened to f32), and `{prefix}.bias` when the checkpoint has one.
fn linear(
    ckpt: &Checkpoint,
    quant: &Quantization,
    prefix: &str,
    out: usize,
    inp: usize,
) -> Result<StoredLinear, ModelError> {
    let bias = read_bias(ckpt, prefix, out)?;
    if let Some(matrix) = quantized(ckpt, quant, prefix, out, inp)? {
        return Ok(StoredLinear::Quantized { matrix, bias });
    }
    let weight_name = format!("{prefix}.weight");
    Ok(if ckpt.dtype(&weight_name) == Some(Dtype::BF16) {
        StoredLinear::Bf16(Linear {
            weight: ckpt.read_bf16(&weight_name, &[out, inp])?,
            bias,
            out_features: out,
            in_features: inp,
            clamp: None,
        })
    } else {
        StoredLinear::F32(Linear {
            weight: ckpt.read_f32(&weight_name, &[out, inp])?,
            bias,
            out_features: out,
            in_features: inp,
            clamp: None,
        })
    })
}

/// As [`linear`], widened to f32 whatever its stored form.
fn linear_f32(
    ckpt: &Checkpoint,
    quant: &Quantization,
    prefix: &str,
    out: usize,
    inp: usize,
) -> Result<Linear, ModelError> {
    let stored = linear(ckpt, quant, prefix, out, inp)?;
    Ok(Linear {
        weight: stored.widened().into_owned(),
        bias: stored.bias().map(<[f32]>::to_vec),
        out_features: out,
        in_features: inp,
        clamp: None,
    })
}

/// `{prefix}.bias` of `out` values, when the checkpoint has one.
fn read_bias(ckpt: &Checkpoint, prefix: &str, out: usize) -> Result<Option<Vec<f32>>, ModelError> {
    let bias_name = format!("{prefix}.bias");
    if ckpt.contains(&bias_name) {
        Ok(Some(ckpt.read_f32(&bias_name, &[out])?))
    } else {
        Ok(None)
    }
}

/// Linear layer `prefix` in its quantized form, or `None` where the checkpoint stores it
/// unquantized: FP8 where `{prefix}.weight` is e4m3 (with `weight_scale_inv`); INT4 where
/// `{prefix}.weight_packed` is present or `{prefix}.weight` is absent, unless the config's
/// `ignore` list names the module (compressed-tensors quantizes `nn.Linear` layers only, so a
/// router stored as a plain `weight` is read as it is).
fn quantized(
    ckpt: &Checkpoint,
    q: &Quantization,
    prefix: &str,
    out: usize,
    inp: usize,
) -> Result<Option<QuantLinear>, ModelError> {
    let corrupt = |reason: String| ModelError::Corrupt {
        path: ckpt.dir().to_path_buf(),
        reason: format!("`{}`: {reason}", ckpt.stored_name(prefix)),
    };
    match q {
        // MXFP4 holds only gpt-oss's fused experts (read by `mxfp4_expert`).
        Quantization::None | Quantization::Mxfp4 => Ok(None),
        Quantization::Fp8 { block } => {
            let weight_name = format!("{prefix}.weight");
            if ckpt.dtype(&weight_name) != Some(Dtype::F8_E4M3) {
                return Ok(None);
            }
            let [rows, cols] = *block;
            let weights = ckpt.read_fp8(&weight_name, &[out, inp])?;
            let scales = ckpt.read_f32(
                &format!("{prefix}.weight_scale_inv"),
                &[out.div_ceil(rows), inp.div_ceil(cols)],
            )?;
            QuantLinear::fp8(weights, scales, out, inp, *block)
                .map(Some)
                .map_err(corrupt)
        }
        Quantization::PackedInt4 { group_size, ignore } => {
            let packed_name = format!("{prefix}.weight_packed");
            if ignore.contains(&ckpt.stored_name(prefix))
                || (!ckpt.contains(&packed_name) && ckpt.contains(&format!("{prefix}.weight")))
            {
                return Ok(None);
            }
            let packed = ckpt.read_i32_bits(&packed_name, &[out, inp.div_ceil(8)])?;
            let scales = ckpt.read_f32(
                &format!("{prefix}.weight_scale"),
                &[out, inp.div_ceil(*group_size)],
            )?;
            let shape_name = format!("{prefix}.weight_shape");
            if ckpt.contains(&shape_name) {
                let shape = ckpt.read_int(&shape_name, &[2])?;
                if shape != [out as i64, inp as i64] {
                    return Err(corrupt(format!(
                        "weight_shape says {shape:?}, the config needs [{out}, {inp}]"
                    )));
                }
            }
            QuantLinear::int4(packed, scales, out, inp, *group_size)
                .map(Some)
                .map_err(corrupt)
        }
    }
}

fn norm(ckpt: &Checkpoint, prefix: &str, width: usize, eps: f32) -> Result<RmsNorm, ModelError> {
    Ok(RmsNorm {
        weight: ckpt.read_f32(&format!("{prefix}.weight"), &[width])?,
        eps,
    })
}

/// One of the model's RMSNorms (the layers', the final one, q/k norms) with the model's
/// epsilon, its weight made whole where the family stores it as an offset from 1.
fn model_norm(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    prefix: &str,
    width: usize,
) -> Result<RmsNorm, ModelError> {
    let mut norm = norm(ckpt, prefix, width, cfg.rms_norm_eps)?;
    if cfg.centered_norms {
        norm.weight.iter_mut().for_each(|w| *w += 1.0);
    }
    Ok(norm)
}
