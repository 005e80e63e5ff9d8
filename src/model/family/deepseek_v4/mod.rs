//! DeepSeek-V4 (`deepseek_v4`, DeepseekV4ForCausalLM; Pro and Flash): every layer MoE, routed
//! by `sqrt(softplus(logit))` scores (`noaux_tc` without groups, `routed_scaling_factor`), the
//! first `num_hash_layers` by a fixed token-id table (`ffn.gate.tid2eid`) instead; experts
//! under a SwiGLU whose gate and up are clamped at `swiglu_limit`; attention with one shared
//! key-value head of `head_dim` (512) read as both key and value, a learned sink per head, a
//! sliding window, and on most layers compressed entries beside it: every `compress_ratios[l]`
//! positions (4: "CSA", with a lightning indexer that keeps the best `index_topk` entries per
//! query; 128: "HCA") are pooled into one by a learned compressor; the heads' outputs
//! projected through `o_groups` low-rank groups; `hc_mult` residual streams mixed per block
//! (hyper-connections, Sinkhorn-normalised). Tensors are published without the `model.`
//! prefix (`layers.N.attn.*`, `layers.N.ffn.experts.E.{w1,w2,w3}`, `embed`, `head`); the
//! multi-token-prediction layers (`mtp.*`) are not read.
//!
//! The keys follow transformers 5.25's `DeepseekV4Config`, which reads the published legacy
//! keys too (`compress_ratios`, `compress_rate_csa`/`_hca`, `num_hash_layers`,
//! `qk_rope_head_dim`): a `compress_ratios` entry names a layer kind (0 sliding only, 4 CSA,
//! 128 HCA) whose ratio is the kind's rate. The parts the generic engine does not have
//! ([`DeepseekV4`]) are read by [`deepseek_v4`]; the forward pass is
//! `crate::engine::deepseek_v4`.

mod sizes;
#[cfg(test)]
mod tests;

pub use sizes::V4Shape;

use serde::Deserialize;
use serde_json::Value;

use super::{Common, Defaults, ExpertNames, FamilyParts, FamilySpec, ToolCallFormat, keys};
use crate::model::config::parts::{
    AttentionConfig, ExpertActivation, GatingConfig, MAX_CONTEXT, MAX_LAYERS, MoeConfig, Problems,
    QkNorm, RopeConfig, RopeScaling,
};

/// The family's answers ([`FamilySpec`]).
pub(in crate::model) struct DeepseekV4Spec;

/// Its own keys (the published and transformers' names both).
#[derive(Deserialize)]
struct Keys {
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    scoring_func: Option<String>,
    topk_method: Option<String>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    routed_scaling_factor: Option<f64>,
    num_hash_layers: Option<usize>,
    mlp_layer_types: Option<Vec<String>>,
    swiglu_limit: Option<f64>,
    q_lora_rank: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    partial_rotary_factor: Option<f64>,
    compress_ratios: Option<Vec<usize>>,
    layer_types: Option<Vec<String>>,
    compress_rates: Option<serde_json::Map<String, Value>>,
    compress_rate_csa: Option<usize>,
    compress_rate_hca: Option<usize>,
    compress_rope_theta: Option<f64>,
    sliding_window: Option<usize>,
    o_groups: Option<usize>,
    o_lora_rank: Option<usize>,
    index_n_heads: Option<usize>,
    index_head_dim: Option<usize>,
    index_topk: Option<usize>,
    hc_mult: Option<usize>,
    hc_sinkhorn_iters: Option<usize>,
    hc_eps: Option<f64>,
    num_nextn_predict_layers: Option<usize>,
    expert_dtype: Option<String>,
    scale_fmt: Option<String>,
}

/// A layer's attention: the window alone, or the window and compressed entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4LayerKind {
    /// `sliding_attention` (`compress_ratios` 0): the last `sliding_window` positions.
    Sliding,
    /// `compressed_sparse_attention` (4): overlapping windows of `2 * ratio` pooled every
    /// `ratio` positions, of which a lightning indexer keeps `index_topk` per query.
    Csa,
    /// `heavily_compressed_attention` (128): windows of `ratio` pooled every `ratio`, all kept.
    Hca,
}

/// How the routed experts are stored in the published checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4ExpertDtype {
    /// MXFP4 (`expert_dtype: fp4`: Pro and Flash).
    Fp4,
    /// FP8 e4m3 with block scales (Flash-Base).
    Fp8,
}

/// What DeepSeek-V4 adds to the generic config: read from `config.json` by [`deepseek_v4`].
#[derive(Debug, Clone, PartialEq)]
pub struct DeepseekV4 {
    /// The one shared key-value head's width, also each query head's (512).
    pub head_dim: usize,
    /// Rotated values at the end of each head (`qk_rope_head_dim`, 64).
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub sliding_window: usize,
    /// Per layer.
    pub layers: Vec<V4LayerKind>,
    /// Positions pooled into one entry on CSA layers (4) and on HCA layers (128).
    pub csa_ratio: usize,
    pub hca_ratio: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    /// Layers `0..hash_layers` route by `tid2eid`.
    pub hash_layers: usize,
    pub swiglu_limit: f32,
    pub routed_scaling_factor: f32,
    /// Score function: `sqrt(softplus(x))` (true) or `sigmoid(x)`.
    pub sqrt_softplus: bool,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    /// Rope of the sliding-only layers (`rope_theta`, no scaling).
    pub main_rope: RopeConfig,
    /// Rope of the compressed layers and their compressors (`compress_rope_theta`, with
    /// `rope_scaling`; YaRN's magnitude factor fixed at 1 as the reference does).
    pub compress_rope: RopeConfig,
    /// FP8 scales stored as 8-bit powers of two (`scale_fmt: ue8m0`).
    pub ue8m0_scales: bool,
    pub expert_dtype: Option<V4ExpertDtype>,
    /// Multi-token-prediction layers in the checkpoint (`mtp.*`), not read.
    pub mtp_layers: usize,
}

impl DeepseekV4 {
    /// Layer `layer`'s compression ratio (0 on sliding-only layers).
    pub fn ratio(&self, layer: usize) -> usize {
        match self.layers.get(layer) {
            Some(V4LayerKind::Csa) => self.csa_ratio,
            Some(V4LayerKind::Hca) => self.hca_ratio,
            _ => 0,
        }
    }

    /// Whether layer `layer` routes by the token-id table.
    pub fn is_hash_layer(&self, layer: usize) -> bool {
        layer < self.hash_layers
    }

    /// Floats one sequence keeps per position, averaged over the layers' kinds for a long
    /// sequence: a compressed entry (`head_dim`) every `ratio` positions, and on CSA layers
    /// an indexer key (`index_head_dim`) with it. The window is a fixed size
    /// ([`DeepseekV4::fixed_floats`]).
    pub fn floats_per_position(&self) -> f64 {
        (0..self.layers.len())
            .map(|l| match self.layers[l] {
                V4LayerKind::Sliding => 0.0,
                V4LayerKind::Csa => {
                    (self.head_dim + self.index_head_dim) as f64 / self.csa_ratio as f64
                }
                V4LayerKind::Hca => self.head_dim as f64 / self.hca_ratio as f64,
            })
            .sum()
    }

    /// Floats one sequence keeps whatever its length: every layer's window of keys, and the
    /// compressors' unfinished windows (projected values and gates, two series on CSA).
    pub fn fixed_floats(&self) -> usize {
        (0..self.layers.len())
            .map(|l| {
                let window = self.sliding_window * self.head_dim;
                window
                    + match self.layers[l] {
                        V4LayerKind::Sliding => 0,
                        V4LayerKind::Csa => {
                            // Buffer of `ratio` rows and the previous window's first series.
                            (self.csa_ratio + 1) * 2 * 2 * (self.head_dim + self.index_head_dim)
                        }
                        V4LayerKind::Hca => self.hca_ratio * 2 * self.head_dim,
                    }
            })
            .sum()
    }
}

impl FamilySpec for DeepseekV4Spec {
    fn model_types(&self) -> &'static [&'static str] {
        &["deepseek_v4"]
    }

    fn wrapper_types(&self) -> &'static [&'static str] {
        &[]
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            max_position_embeddings: 1 << 20,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
        }
    }

    fn size_limits(&self) -> &'static [(&'static str, usize)] {
        &[
            ("n_routed_experts", 1 << 16),
            ("n_shared_experts", 1 << 6),
            ("num_hash_layers", MAX_LAYERS),
            ("q_lora_rank", 1 << 16),
            ("qk_rope_head_dim", 1 << 12),
            ("compress_rate_csa", 1 << 16),
            ("compress_rate_hca", 1 << 16),
            ("sliding_window", MAX_CONTEXT),
            ("o_groups", 1 << 10),
            ("o_lora_rank", 1 << 16),
            ("index_n_heads", 1 << 10),
            ("index_head_dim", 1 << 12),
            ("index_topk", MAX_CONTEXT),
            ("hc_mult", 1 << 6),
            ("hc_sinkhorn_iters", 1 << 10),
            ("num_nextn_predict_layers", 1 << 6),
        ]
    }

    fn read(
        &self,
        config: &Value,
        common: &Common,
        p: &mut Problems,
    ) -> Result<FamilyParts, Vec<String>> {
        let own: Keys = keys(config)?;
        let v4 = read_v4(&own, config, common, p);
        let attention = AttentionConfig::Gqa {
            num_kv_heads: 1,
            head_dim: v4.head_dim,
            qk_norm: QkNorm::None,
            bias: false,
            sliding_window: Some(v4.sliding_window),
            interleave: true,
            layers: Vec::new(),
            sinks: true,
            o_bias: false,
            output_gate: false,
        };
        let num_experts = p.require(own.n_routed_experts, "n_routed_experts");
        let expert_intermediate =
            p.require(common.keys.moe_intermediate_size, "moe_intermediate_size");
        let moe = MoeConfig {
            num_experts,
            top_k: common.keys.num_experts_per_tok.unwrap_or(6),
            expert_intermediate_size: expert_intermediate,
            shared_intermediate_size: expert_intermediate * own.n_shared_experts.unwrap_or(1),
            // Not DeepSeek-V4's gate (sqrtsoftplus, hash layers): `engine::deepseek_v4` routes
            // by [`DeepseekV4`], and the engines that would read this refuse the family.
            gating: GatingConfig::SigmoidGrouped {
                n_group: 1,
                topk_group: 1,
                normalize: true,
                routed_scaling_factor: v4.routed_scaling_factor,
            },
            weight_input: false,
            shared_expert_gate: false,
            activation: ExpertActivation::Silu,
        };
        Ok(FamilyParts {
            attention,
            rope_dim: v4.rope_dim,
            moe,
            moe_layers: vec![true; common.num_layers],
            intermediate_size: expert_intermediate,
            linear_attention: None,
            centered_norms: false,
        })
    }

    fn mlp_prefix(&self, layer: usize) -> String {
        format!("layers.{layer}.ffn")
    }

    fn expert_names(&self) -> ExpertNames {
        ExpertNames {
            gate: "w1",
            up: "w3",
            down: "w2",
        }
    }

    fn fused_experts(&self) -> Option<super::FusedExperts> {
        None
    }

    fn router(&self) -> &'static str {
        "gate"
    }

    fn shared_experts(&self) -> &'static str {
        "shared_experts"
    }

    fn correction_bias(&self) -> Option<&'static str> {
        Some("gate.bias")
    }

    fn tool_call_formats(&self) -> &'static [ToolCallFormat] {
        // V4 writes DSML in `tool_calls` blocks (its `encoding_dsv4.py`); a fine-tune on an
        // earlier template, V3.2's DSML or V3's markers.
        &[
            ToolCallFormat::DeepseekV4,
            ToolCallFormat::DeepseekV32,
            ToolCallFormat::DeepseekV3,
        ]
    }

    fn builtin_chat_template(&self) -> Option<&'static str> {
        Some(include_str!("chat_template.jinja"))
    }
}

/// DeepSeek-V4's own parts of a config the family has read (problems were reported then):
/// `None` for other families or a config that cannot be read.
pub(in crate::model) fn deepseek_v4(
    config: &Value,
    common: &Common,
    rope: &RopeConfig,
) -> Option<DeepseekV4> {
    let own: Keys = keys(config).ok()?;
    let mut scratch = Problems(Vec::new());
    let mut v4 = read_v4(&own, config, common, &mut scratch);
    // The compressed layers take `rope_scaling`; YaRN's magnitude factor stays 1 there
    // (transformers sets `attention_factor` 1.0 unless the config gives one).
    let scaling = match rope.scaling.clone() {
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            attention_factor,
            truncate,
        } => RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            attention_factor: attention_factor.or(Some(1.0)),
            truncate,
        },
        other => other,
    };
    v4.compress_rope.scaling = scaling;
    Some(v4)
}

/// Every key of [`DeepseekV4`], checked; problems go to `p`.
fn read_v4(own: &Keys, config: &Value, common: &Common, p: &mut Problems) -> DeepseekV4 {
    let n = common.num_layers;
    let num_heads = common.num_heads;
    let head_dim = common.keys.head_dim.unwrap_or(512);
    p.check(head_dim > 0, || "`head_dim` must be greater than 0".into());
    if let Some(kv) = common.keys.num_key_value_heads {
        p.check(kv == 1, || {
            format!("num_key_value_heads ({kv}) must be 1: DeepSeek-V4 shares one key-value head")
        });
    }
    let rope_dim = match (own.qk_rope_head_dim, own.partial_rotary_factor) {
        (Some(d), _) => d,
        (None, Some(f)) if f > 0.0 && f <= 1.0 => (head_dim as f64 * f) as usize,
        (None, Some(f)) => {
            p.0.push(format!(
                "partial_rotary_factor ({f}) must be greater than 0 and at most 1"
            ));
            0
        }
        (None, None) => head_dim / 8,
    };
    p.check(
        rope_dim >= 2 && rope_dim.is_multiple_of(2) && rope_dim <= head_dim,
        || format!("qk_rope_head_dim ({rope_dim}) must be even, at least 2 and at most head_dim ({head_dim})"),
    );
    let (layers, csa_ratio, hca_ratio) = layer_kinds(own, n, p);
    let index_topk = own.index_topk.unwrap_or(512);
    p.check(index_topk > 0, || {
        "`index_topk` must be greater than 0: the indexer keeps that many compressed entries per query".into()
    });
    let o_groups = own.o_groups.unwrap_or(8);
    p.check(
        o_groups > 0 && num_heads.is_multiple_of(o_groups.max(1)),
        || format!("num_attention_heads ({num_heads}) must be a multiple of o_groups ({o_groups})"),
    );
    for (value, key) in [
        (own.q_lora_rank.unwrap_or(1024), "q_lora_rank"),
        (own.o_lora_rank.unwrap_or(1024), "o_lora_rank"),
        (own.sliding_window.unwrap_or(128), "sliding_window"),
        (own.index_n_heads.unwrap_or(64), "index_n_heads"),
        (own.index_head_dim.unwrap_or(128), "index_head_dim"),
        (own.hc_mult.unwrap_or(4), "hc_mult"),
        (own.hc_sinkhorn_iters.unwrap_or(20), "hc_sinkhorn_iters"),
    ] {
        p.check(value > 0, || format!("`{key}` must be greater than 0"));
    }
    let index_head_dim = own.index_head_dim.unwrap_or(128);
    let rope_dim_fits_indexer = rope_dim <= index_head_dim;
    p.check(rope_dim_fits_indexer, || {
        format!("qk_rope_head_dim ({rope_dim}) must be at most index_head_dim ({index_head_dim})")
    });
    let hash_layers = hash_layers(own, n, p);
    let sqrt_softplus = gate(own, p);
    let swiglu_limit = own.swiglu_limit.unwrap_or(10.0);
    p.check(swiglu_limit > 0.0, || {
        format!("swiglu_limit ({swiglu_limit}) must be positive")
    });
    let (ue8m0_scales, expert_dtype) = precision(own, config, p);
    let rope_theta = common.keys.rope_theta.unwrap_or(10_000.0);
    let compress_theta = own.compress_rope_theta.unwrap_or(160_000.0);
    p.check(rope_theta > 0.0 && compress_theta > 0.0, || {
        "rope_theta and compress_rope_theta must be positive".into()
    });
    DeepseekV4 {
        head_dim,
        rope_dim,
        q_lora_rank: own.q_lora_rank.unwrap_or(1024),
        o_groups,
        o_lora_rank: own.o_lora_rank.unwrap_or(1024),
        sliding_window: own.sliding_window.unwrap_or(128),
        layers,
        csa_ratio,
        hca_ratio,
        index_n_heads: own.index_n_heads.unwrap_or(64),
        index_head_dim,
        index_topk,
        hash_layers,
        swiglu_limit: swiglu_limit as f32,
        routed_scaling_factor: own.routed_scaling_factor.unwrap_or(1.5) as f32,
        sqrt_softplus,
        hc_mult: own.hc_mult.unwrap_or(4),
        hc_sinkhorn_iters: own.hc_sinkhorn_iters.unwrap_or(20),
        hc_eps: own.hc_eps.unwrap_or(1e-6) as f32,
        main_rope: RopeConfig {
            theta: rope_theta,
            dim: rope_dim,
            scaling: RopeScaling::None,
        },
        compress_rope: RopeConfig {
            theta: compress_theta,
            dim: rope_dim,
            scaling: RopeScaling::None,
        },
        ue8m0_scales,
        expert_dtype,
        mtp_layers: own.num_nextn_predict_layers.unwrap_or(1),
    }
}

/// Each layer's kind and the two ratios: `layer_types` (transformers) or `compress_ratios`
/// (published), else transformers' default (two HCA layers, then CSA and HCA alternating).
fn layer_kinds(own: &Keys, n: usize, p: &mut Problems) -> (Vec<V4LayerKind>, usize, usize) {
    let rate = |name: &str| {
        own.compress_rates
            .as_ref()
            .and_then(|rates| rates.get(name))
            .and_then(Value::as_u64)
            .map(|r| r as usize)
    };
    let csa_ratio = own
        .compress_rate_csa
        .or(rate("compressed_sparse_attention"))
        .unwrap_or(4);
    let hca_ratio = own
        .compress_rate_hca
        .or(rate("heavily_compressed_attention"))
        .unwrap_or(128);
    p.check(csa_ratio > 0 && hca_ratio > 0, || {
        "compression rates (`compress_rate_csa`, `compress_rate_hca`) must be greater than 0".into()
    });
    let mtp = own.num_nextn_predict_layers.unwrap_or(1);
    let kinds: Vec<V4LayerKind> = if let Some(types) = &own.layer_types {
        p.check(types.len() == n, || {
            format!("layer_types has {} entries for {n} layers", types.len())
        });
        types
            .iter()
            .take(n)
            .map(|t| match t.as_str() {
                "sliding_attention" => V4LayerKind::Sliding,
                "compressed_sparse_attention" => V4LayerKind::Csa,
                "heavily_compressed_attention" => V4LayerKind::Hca,
                other => {
                    p.0.push(format!(
                        "layer_types: unknown `{other}` (sliding_attention, \
                         compressed_sparse_attention or heavily_compressed_attention)"
                    ));
                    V4LayerKind::Sliding
                }
            })
            .collect()
    } else if let Some(ratios) = &own.compress_ratios {
        // Published configs list the MTP layers' too; the rest of the model's are read.
        p.check(ratios.len() == n || ratios.len() == n + mtp, || {
            format!(
                "compress_ratios has {} entries: it needs one per layer ({n}), or one more per \
                 MTP layer ({})",
                ratios.len(),
                n + mtp
            )
        });
        ratios
            .iter()
            .take(n)
            .map(|&r| match r {
                0 => V4LayerKind::Sliding,
                4 => V4LayerKind::Csa,
                128 => V4LayerKind::Hca,
                other => {
                    p.0.push(format!(
                        "compress_ratios: {other} is not a layer kind (0: window only, 4: \
                         compressed sparse, 128: heavily compressed; their rates are \
                         compress_rate_csa and compress_rate_hca)"
                    ));
                    V4LayerKind::Sliding
                }
            })
            .collect()
    } else {
        (0..n)
            .map(|l| match l {
                0 | 1 => V4LayerKind::Hca,
                l if (l - 2) % 2 == 1 => V4LayerKind::Csa,
                _ => V4LayerKind::Hca,
            })
            .collect()
    };
    let mut kinds = kinds;
    kinds.resize(n, V4LayerKind::Sliding);
    (kinds, csa_ratio, hca_ratio)
}

/// Layers routed by the token-id table: `mlp_layer_types` (transformers) or
/// `num_hash_layers` (published, default 3), always the first ones.
fn hash_layers(own: &Keys, n: usize, p: &mut Problems) -> usize {
    match &own.mlp_layer_types {
        Some(types) => {
            p.check(types.len() == n, || {
                format!("mlp_layer_types has {} entries for {n} layers", types.len())
            });
            let hashed = types.iter().take_while(|t| *t == "hash_moe").count();
            for t in types.iter().skip(hashed) {
                p.check(t == "moe", || {
                    format!(
                        "mlp_layer_types: `{t}` after the first non-hash layer (hash_moe layers \
                         come first, then moe)"
                    )
                });
            }
            hashed
        }
        None => {
            let hashed = own.num_hash_layers.unwrap_or(3);
            p.check(hashed <= n, || {
                format!("num_hash_layers ({hashed}) exceeds num_hidden_layers ({n})")
            });
            hashed.min(n)
        }
    }
}

/// The gate: `sqrtsoftplus` (true) or `sigmoid` scores, `noaux_tc`, no groups.
fn gate(own: &Keys, p: &mut Problems) -> bool {
    let scoring = own.scoring_func.as_deref().unwrap_or("sqrtsoftplus");
    p.check(matches!(scoring, "sqrtsoftplus" | "sigmoid"), || {
        format!(
            "unsupported scoring_func `{scoring}`: DeepSeek-V4 gating is sqrtsoftplus (or sigmoid)"
        )
    });
    if let Some(m) = &own.topk_method {
        p.check(m == "noaux_tc", || {
            format!("unsupported topk_method `{m}`: only noaux_tc is supported")
        });
    }
    for (value, key) in [(own.n_group, "n_group"), (own.topk_group, "topk_group")] {
        if let Some(v) = value {
            p.check(v <= 1, || {
                format!("`{key}` ({v}): DeepSeek-V4's gate has no expert groups (0, 1 or null)")
            });
        }
    }
    scoring == "sqrtsoftplus"
}

/// `scale_fmt` and `expert_dtype`, at the top level or in `quantization_config`.
fn precision(own: &Keys, config: &Value, p: &mut Problems) -> (bool, Option<V4ExpertDtype>) {
    let quant = config.get("quantization_config");
    let text = |key: &str| quant.and_then(|q| q.get(key)).and_then(Value::as_str);
    let scale_fmt = own.scale_fmt.as_deref().or(text("scale_fmt"));
    if let Some(f) = scale_fmt {
        p.check(f == "ue8m0", || {
            format!("unsupported scale_fmt `{f}`: ue8m0 (power-of-two scales) is read")
        });
    }
    let expert_dtype = match own.expert_dtype.as_deref().or(text("expert_dtype")) {
        None => None,
        Some("fp4" | "mxfp4") => Some(V4ExpertDtype::Fp4),
        Some("fp8" | "float8_e4m3fn") => Some(V4ExpertDtype::Fp8),
        Some(other) => {
            p.0.push(format!(
                "unsupported expert_dtype `{other}`: fp4 (MXFP4) or fp8"
            ));
            None
        }
    };
    (scale_fmt == Some("ue8m0"), expert_dtype)
}
