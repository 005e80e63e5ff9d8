//! DeepSeek-V4's dense tensors by their published names (no `model.` prefix), read into f32
//! blocks (bf16 and f16 widened), shapes checked against the config. The routed experts load
//! through the family's names (`layers.N.ffn.experts.E.{w1,w3,w2}`) with `swiglu_limit` set on
//! their gate and up ([`clamp_swiglu`]). FP8 projections (a `.scale` beside the weight) are
//! refused naming the tensor: they are not read yet.

use crate::compute::cpu::{Linear, SwiGlu};
use crate::compute::expert::ExpertWeights;
use crate::model::config::{DeepseekV4, V4LayerKind};
use crate::model::weights::load_expert;
use crate::model::{Checkpoint, ModelConfig, ModelError};

/// A pooling compressor's projections, position bias and norm.
pub struct CompressorWeights {
    /// `[series * width, hidden]` each.
    pub wkv: Linear,
    pub wgate: Linear,
    /// `[ratio, series * width]`.
    pub ape: Vec<f32>,
    pub norm: Vec<f32>,
}

/// A CSA layer's lightning indexer.
pub struct IndexerWeights {
    /// `[index_heads * index_head_dim, q_lora_rank]`.
    pub wq_b: Linear,
    /// `[index_heads, hidden]`.
    pub weights_proj: Linear,
    pub compressor: CompressorWeights,
}

pub struct AttentionWeights {
    pub wq_a: Linear,
    pub q_norm: Vec<f32>,
    pub wq_b: Linear,
    pub wkv: Linear,
    pub kv_norm: Vec<f32>,
    /// `[o_groups * o_lora_rank, heads * head_dim / o_groups]`: group `g`'s block is rows
    /// `g * o_lora_rank..`.
    pub wo_a: Linear,
    pub wo_b: Linear,
    pub sinks: Vec<f32>,
    pub compressor: Option<CompressorWeights>,
    pub indexer: Option<IndexerWeights>,
}

/// A hyper-connection mixer: `fn [(2 + m) * m, m * hidden]`, `base`, `scale [3]`.
pub struct MixerWeights {
    pub fn_: Vec<f32>,
    pub base: Vec<f32>,
    pub scale: Vec<f32>,
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub attn_hc: MixerWeights,
    pub ffn_hc: MixerWeights,
    pub attention: AttentionWeights,
    /// `[experts, hidden]`.
    pub gate: Linear,
    /// Score layers: the routing bias (`gate.bias`).
    pub gate_bias: Option<Vec<f32>>,
    /// Hash layers: `[vocab, top_k]` experts per token (`gate.tid2eid`).
    pub tid2eid: Option<Vec<u32>>,
    pub shared: SwiGlu,
}

pub struct V4Weights {
    pub embed: Vec<f32>,
    pub head: Linear,
    pub norm: Vec<f32>,
    /// The final collapse of the streams: `hc_head_fn [m, m * hidden]`, base, scale.
    pub head_fn: Vec<f32>,
    pub head_base: Vec<f32>,
    pub head_scale: f32,
    pub layers: Vec<LayerWeights>,
}

/// `name` of `shape` in f32; FP8 (with a `.scale` beside it) refused by name.
fn tensor(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
    if let Some(weight) = name.strip_suffix(".weight")
        && ckpt.contains(&format!("{weight}.scale"))
    {
        return Err(ModelError::Corrupt {
            path: ckpt.dir().to_path_buf(),
            reason: format!(
                "tensor `{name}` is FP8 with ue8m0 scales, which the DeepSeek-V4 CPU forward does \
                 not read yet; use a bf16 copy"
            ),
        });
    }
    ckpt.read_f32(name, shape)
}

fn linear(ckpt: &Checkpoint, name: &str, out: usize, inp: usize) -> Result<Linear, ModelError> {
    let weight = tensor(ckpt, &format!("{name}.weight"), &[out, inp])?;
    Ok(Linear::without_bias(weight, out, inp))
}

/// `down(silu(min(gate, limit)) * clamp(up, -limit, limit))`: DeepSeek-V4's experts and
/// shared experts.
pub fn clamp_swiglu<W: crate::compute::cpu::WeightElement>(block: &mut SwiGlu<W>, limit: f32) {
    block.gate.clamp = Some([f32::NEG_INFINITY, limit]);
    block.up.clamp = Some([-limit, limit]);
}

fn compressor(
    ckpt: &Checkpoint,
    prefix: &str,
    [ratio, series, width, hidden]: [usize; 4],
) -> Result<CompressorWeights, ModelError> {
    Ok(CompressorWeights {
        wkv: linear(ckpt, &format!("{prefix}.wkv"), series * width, hidden)?,
        wgate: linear(ckpt, &format!("{prefix}.wgate"), series * width, hidden)?,
        ape: tensor(ckpt, &format!("{prefix}.ape"), &[ratio, series * width])?,
        norm: tensor(ckpt, &format!("{prefix}.norm.weight"), &[width])?,
    })
}

fn mixer(ckpt: &Checkpoint, prefix: &str, m: usize, h: usize) -> Result<MixerWeights, ModelError> {
    let outputs = (2 + m) * m;
    Ok(MixerWeights {
        fn_: tensor(ckpt, &format!("{prefix}_fn"), &[outputs, m * h])?,
        base: tensor(ckpt, &format!("{prefix}_base"), &[outputs])?,
        scale: tensor(ckpt, &format!("{prefix}_scale"), &[3])?,
    })
}

fn attention(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    v4: &DeepseekV4,
    layer: usize,
) -> Result<AttentionWeights, ModelError> {
    let p = format!("layers.{layer}.attn");
    let (h, heads, hd) = (cfg.hidden_size, cfg.num_heads, v4.head_dim);
    let q = v4.q_lora_rank;
    let groups = v4.o_groups;
    // transformers reads both `kv_norm` and `norm` (its conversion renames `.norm.`).
    let kv_norm = if ckpt.contains(&format!("{p}.kv_norm.weight")) {
        format!("{p}.kv_norm.weight")
    } else {
        format!("{p}.norm.weight")
    };
    let kind = v4.layers[layer];
    let pooling = match kind {
        V4LayerKind::Sliding => None,
        V4LayerKind::Csa => Some(compressor(
            ckpt,
            &format!("{p}.compressor"),
            [v4.csa_ratio, 2, hd, h],
        )?),
        V4LayerKind::Hca => Some(compressor(
            ckpt,
            &format!("{p}.compressor"),
            [v4.hca_ratio, 1, hd, h],
        )?),
    };
    let indexer = match kind {
        V4LayerKind::Csa => Some(IndexerWeights {
            wq_b: linear(
                ckpt,
                &format!("{p}.indexer.wq_b"),
                v4.index_n_heads * v4.index_head_dim,
                q,
            )?,
            weights_proj: linear(
                ckpt,
                &format!("{p}.indexer.weights_proj"),
                v4.index_n_heads,
                h,
            )?,
            compressor: compressor(
                ckpt,
                &format!("{p}.indexer.compressor"),
                [v4.csa_ratio, 2, v4.index_head_dim, h],
            )?,
        }),
        _ => None,
    };
    Ok(AttentionWeights {
        wq_a: linear(ckpt, &format!("{p}.wq_a"), q, h)?,
        q_norm: tensor(ckpt, &format!("{p}.q_norm.weight"), &[q])?,
        wq_b: linear(ckpt, &format!("{p}.wq_b"), heads * hd, q)?,
        wkv: linear(ckpt, &format!("{p}.wkv"), hd, h)?,
        kv_norm: tensor(ckpt, &kv_norm, &[hd])?,
        wo_a: linear(
            ckpt,
            &format!("{p}.wo_a"),
            groups * v4.o_lora_rank,
            heads * hd / groups.max(1),
        )?,
        wo_b: linear(ckpt, &format!("{p}.wo_b"), h, groups * v4.o_lora_rank)?,
        sinks: tensor(ckpt, &format!("{p}.attn_sink"), &[heads])?,
        compressor: pooling,
        indexer,
    })
}

/// Layer `layer`'s token-to-experts table, each entry checked to name an expert.
fn tid2eid(ckpt: &Checkpoint, cfg: &ModelConfig, layer: usize) -> Result<Vec<u32>, ModelError> {
    let name = format!("layers.{layer}.ffn.gate.tid2eid");
    let (vocab, k, experts) = (cfg.vocab_size, cfg.moe.top_k, cfg.moe.num_experts);
    let table = ckpt.read_int(&name, &[vocab, k])?;
    if let Some((i, &e)) = table
        .iter()
        .enumerate()
        .find(|(_, e)| !(0..experts as i64).contains(e))
    {
        return Err(ModelError::Corrupt {
            path: ckpt.dir().to_path_buf(),
            reason: format!(
                "`{name}` sends token {} to expert {e}, past the {experts} experts of the layer",
                i / k.max(1)
            ),
        });
    }
    Ok(table.into_iter().map(|e| e as u32).collect())
}

fn layer(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    v4: &DeepseekV4,
    l: usize,
) -> Result<LayerWeights, ModelError> {
    let (h, m) = (cfg.hidden_size, v4.hc_mult);
    let p = format!("layers.{l}");
    let gate_name = format!("{p}.ffn.gate");
    let hash = v4.is_hash_layer(l);
    let shared_i = cfg.moe.shared_intermediate_size;
    let sp = format!("{p}.ffn.shared_experts");
    let mut shared = SwiGlu {
        gate: linear(ckpt, &format!("{sp}.w1"), shared_i, h)?,
        up: linear(ckpt, &format!("{sp}.w3"), shared_i, h)?,
        down: linear(ckpt, &format!("{sp}.w2"), h, shared_i)?,
    };
    clamp_swiglu(&mut shared, v4.swiglu_limit);
    Ok(LayerWeights {
        attn_norm: tensor(ckpt, &format!("{p}.attn_norm.weight"), &[h])?,
        ffn_norm: tensor(ckpt, &format!("{p}.ffn_norm.weight"), &[h])?,
        attn_hc: mixer(ckpt, &format!("{p}.hc_attn"), m, h)?,
        ffn_hc: mixer(ckpt, &format!("{p}.hc_ffn"), m, h)?,
        attention: attention(ckpt, cfg, v4, l)?,
        gate: linear(ckpt, &gate_name, cfg.moe.num_experts, h)?,
        gate_bias: if hash || !ckpt.contains(&format!("{gate_name}.bias")) {
            None
        } else {
            Some(tensor(
                ckpt,
                &format!("{gate_name}.bias"),
                &[cfg.moe.num_experts],
            )?)
        },
        tid2eid: if hash {
            Some(tid2eid(ckpt, cfg, l)?)
        } else {
            None
        },
        shared,
    })
}

impl V4Weights {
    pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, v4: &DeepseekV4) -> Result<Self, ModelError> {
        let (h, m, vocab) = (cfg.hidden_size, v4.hc_mult, cfg.vocab_size);
        let head_scale = tensor(ckpt, "hc_head_scale", &[1])?;
        Ok(V4Weights {
            embed: tensor(ckpt, "embed.weight", &[vocab, h])?,
            head: linear(ckpt, "head", vocab, h)?,
            norm: tensor(ckpt, "norm.weight", &[h])?,
            head_fn: tensor(ckpt, "hc_head_fn", &[m, m * h])?,
            head_base: tensor(ckpt, "hc_head_base", &[m])?,
            head_scale: head_scale.first().copied().unwrap_or(1.0),
            layers: (0..cfg.num_layers)
                .map(|l| layer(ckpt, cfg, v4, l))
                .collect::<Result<_, _>>()?,
        })
    }
}

/// Every routed expert, clamped at `swiglu_limit`: `[layer][expert]`.
pub fn load_experts(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    v4: &DeepseekV4,
) -> Result<Vec<Vec<ExpertWeights>>, ModelError> {
    (0..cfg.num_layers)
        .map(|l| {
            (0..cfg.moe.num_experts)
                .map(|e| {
                    let mut expert = load_expert(ckpt, cfg, l, e)?;
                    match &mut expert {
                        ExpertWeights::F32(block) => clamp_swiglu(block, v4.swiglu_limit),
                        ExpertWeights::Bf16(block) => clamp_swiglu(block, v4.swiglu_limit),
                        ExpertWeights::Quantized(_) => {
                            return Err(ModelError::Corrupt {
                                path: ckpt.dir().to_path_buf(),
                                reason: format!(
                                    "layer {l} expert {e}: quantized DeepSeek-V4 experts are not \
                                     read yet (their clamped SwiGLU); use a bf16 copy"
                                ),
                            });
                        }
                    }
                    Ok(expert)
                })
                .collect()
        })
        .collect()
}
