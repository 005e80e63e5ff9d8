//! `config.json` of the supported checkpoint families, read into one validated [`ModelConfig`].
//!
//! Published configs carry many keys we do not need (training knobs, quantisation notes), so
//! unknown keys are ignored here; missing or inconsistent keys that the forward pass depends
//! on are reported, all at once.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::ModelError;
use super::quant::Quantization;

/// Which forward-pass code a checkpoint runs through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `qwen3_moe`: GQA with per-head q/k norm, softmax gating.
    Qwen3Moe,
    /// `mixtral`: GQA, softmax gating with renormalised top-k weights.
    Mixtral,
    /// `deepseek_v3` and `kimi_k2`: MLA, sigmoid group-limited gating, shared experts.
    DeepseekV3,
}

/// Rotary embedding parameters, from `rope_theta`/`rope_scaling` or `rope_parameters`.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    /// Number of rotated dimensions per head.
    pub dim: usize,
    pub scaling: RopeScaling,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Position interpolation by a constant factor.
    Linear {
        factor: f64,
    },
    /// YaRN as transformers' `_compute_yarn_parameters` defines it.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        attention_factor: Option<f64>,
        truncate: bool,
    },
}

/// How the attention block is built.
#[derive(Debug, Clone, PartialEq)]
pub enum AttentionConfig {
    /// Grouped-query attention (Qwen3-MoE, Mixtral).
    Gqa {
        num_kv_heads: usize,
        head_dim: usize,
        /// Qwen3's RMSNorm over each q and k head before rope.
        qk_norm: bool,
        bias: bool,
        sliding_window: Option<usize>,
    },
    /// Multi-head latent attention (DeepSeek-V3, Kimi K2).
    Mla {
        q_lora_rank: Option<usize>,
        kv_lora_rank: usize,
        qk_nope_head_dim: usize,
        qk_rope_head_dim: usize,
        v_head_dim: usize,
        /// Rope applied to interleaved pairs (DeepSeek's weight layout).
        interleave: bool,
        bias: bool,
    },
}

pub use crate::compute::gate::GatingConfig;

#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate_size: usize,
    /// Intermediate size of the always-on shared expert MLP, 0 when there is none.
    pub shared_intermediate_size: usize,
    pub gating: GatingConfig,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `model_type` as written (e.g. `kimi_k2`), for display.
    pub model_type: String,
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Intermediate size of the dense MLP layers.
    pub intermediate_size: usize,
    pub attention: AttentionConfig,
    pub rope: RopeConfig,
    pub moe: MoeConfig,
    /// Per layer: true where the MLP is a mixture of experts, false for a dense MLP.
    pub moe_layers: Vec<bool>,
    pub eos_token_ids: Vec<u32>,
    /// Storage dtype named by the config (`torch_dtype` or `dtype`), if any.
    pub dtype: Option<String>,
    /// How linear weights are stored (`quantization_config`).
    pub quantization: Quantization,
}

/// The keys we read. Everything is optional here so that every missing key is reported at
/// once by [`ModelConfig::from_raw`] rather than one by one by serde.
#[derive(Debug, Default, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    hidden_act: Option<String>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    eos_token_id: Option<Value>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    quantization_config: Option<Value>,
    // MoE, under the names each family uses.
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    n_routed_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    // DeepSeek-V3 / Kimi K2.
    n_shared_experts: Option<usize>,
    first_k_dense_replace: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    routed_scaling_factor: Option<f64>,
    scoring_func: Option<String>,
    topk_method: Option<String>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    rope_interleave: Option<bool>,
}

/// Upper bound on `num_hidden_layers` accepted from a config.
const MAX_LAYERS: usize = 1024;
/// Upper bound on `max_position_embeddings`: 32 M tokens, above any published context.
pub const MAX_CONTEXT: usize = 1 << 25;

/// Collects every problem with a config before failing.
struct Problems(Vec<String>);

impl Problems {
    /// A size the model cannot do without: present and greater than zero.
    fn require(&mut self, value: Option<usize>, key: &str) -> usize {
        match value {
            Some(0) => {
                self.0.push(format!("`{key}` must be greater than 0"));
                0
            }
            Some(v) => v,
            None => {
                self.0.push(format!("missing key `{key}`"));
                0
            }
        }
    }

    fn check(&mut self, ok: bool, message: impl FnOnce() -> String) {
        if !ok {
            self.0.push(message());
        }
    }
}

impl ModelConfig {
    /// Reads and validates `config.json` in `dir`.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Self::parse(&text).map_err(|problems| ModelError::Config { path, problems })
    }

    /// Parses the text of a `config.json`; on failure returns every problem found.
    pub fn parse(text: &str) -> Result<Self, Vec<String>> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| vec![format!("cannot read it: {e}")])?;
        let (value, outer_type) = text_model_config(value)?;
        let raw: RawConfig =
            serde_json::from_value(value).map_err(|e| vec![format!("cannot read it: {e}")])?;
        let mut config = Self::from_raw(raw)?;
        if let Some(outer) = outer_type {
            config.model_type = outer;
        }
        Ok(config)
    }

    fn from_raw(raw: RawConfig) -> Result<Self, Vec<String>> {
        // Sizes are multiplied together (tables, tensors, caches) before any tensor is read:
        // values no published model comes near are refused before any arithmetic on them.
        let too_large: Vec<String> = [
            ("vocab_size", raw.vocab_size, 1 << 22),
            ("hidden_size", raw.hidden_size, 1 << 16),
            ("intermediate_size", raw.intermediate_size, 1 << 18),
            ("num_hidden_layers", raw.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", raw.num_attention_heads, 1 << 10),
            ("num_key_value_heads", raw.num_key_value_heads, 1 << 10),
            ("head_dim", raw.head_dim, 1 << 12),
            (
                "max_position_embeddings",
                raw.max_position_embeddings,
                MAX_CONTEXT,
            ),
            ("sliding_window", raw.sliding_window, MAX_CONTEXT),
            ("num_experts", raw.num_experts, 1 << 16),
            ("num_local_experts", raw.num_local_experts, 1 << 16),
            ("n_routed_experts", raw.n_routed_experts, 1 << 16),
            ("num_experts_per_tok", raw.num_experts_per_tok, 1 << 10),
            ("moe_intermediate_size", raw.moe_intermediate_size, 1 << 18),
            ("decoder_sparse_step", raw.decoder_sparse_step, MAX_LAYERS),
            ("n_shared_experts", raw.n_shared_experts, 1 << 6),
            (
                "first_k_dense_replace",
                raw.first_k_dense_replace,
                MAX_LAYERS,
            ),
            ("n_group", raw.n_group, 1 << 16),
            ("topk_group", raw.topk_group, 1 << 16),
            ("q_lora_rank", raw.q_lora_rank, 1 << 16),
            ("kv_lora_rank", raw.kv_lora_rank, 1 << 16),
            ("qk_nope_head_dim", raw.qk_nope_head_dim, 1 << 12),
            ("qk_rope_head_dim", raw.qk_rope_head_dim, 1 << 12),
            ("v_head_dim", raw.v_head_dim, 1 << 12),
        ]
        .into_iter()
        .filter_map(|(key, value, max)| match value {
            Some(v) if v > max => Some(format!("`{key}` ({v}) exceeds {max}")),
            _ => None,
        })
        .collect();
        if !too_large.is_empty() {
            return Err(too_large);
        }
        let mut p = Problems(Vec::new());
        let model_type = raw.model_type.clone().unwrap_or_default();
        let family = match model_type.as_str() {
            "qwen3_moe" => Family::Qwen3Moe,
            "mixtral" => Family::Mixtral,
            "deepseek_v3" | "kimi_k2" => Family::DeepseekV3,
            "" => return Err(vec!["missing key `model_type`".into()]),
            other => {
                return Err(vec![format!(
                    "unsupported model_type `{other}`: moe-node runs qwen3_moe, mixtral, deepseek_v3 and kimi_k2"
                )]);
            }
        };

        let quantization = match raw.quantization_config.as_ref() {
            None => Quantization::None,
            Some(q) => Quantization::parse(q).unwrap_or_else(|problems| {
                p.0.extend(problems);
                Quantization::None
            }),
        };
        let vocab_size = p.require(raw.vocab_size, "vocab_size");
        let hidden_size = p.require(raw.hidden_size, "hidden_size");
        let num_layers = p.require(raw.num_hidden_layers, "num_hidden_layers");
        // Published models have at most ~100 layers; a config claiming millions is corrupt,
        // and per-layer tables are sized from it before any tensor is read.
        p.check(num_layers <= MAX_LAYERS, || {
            format!("num_hidden_layers ({num_layers}) exceeds {MAX_LAYERS}")
        });
        let num_layers = num_layers.min(MAX_LAYERS);
        let num_heads = p.require(raw.num_attention_heads, "num_attention_heads");
        let max_position_embeddings = raw.max_position_embeddings.unwrap_or(match family {
            Family::Qwen3Moe => 32768,
            Family::Mixtral => 131072,
            Family::DeepseekV3 => 4096,
        });
        p.check(max_position_embeddings >= 2, || {
            format!(
                "`max_position_embeddings` ({max_position_embeddings}) must be at least 2: a \
                 prompt token and one generated"
            )
        });
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(match family {
            Family::Mixtral => 1e-5,
            _ => 1e-6,
        }) as f32;
        if let Some(act) = &raw.hidden_act {
            p.check(act == "silu", || {
                format!("unsupported hidden_act `{act}`: only silu (SwiGLU) is supported")
            });
        }

        let (attention, rope_head_dim) = match family {
            Family::Qwen3Moe | Family::Mixtral => {
                let num_kv_heads = raw.num_key_value_heads.unwrap_or(num_heads);
                let head_dim = raw
                    .head_dim
                    .unwrap_or(hidden_size.checked_div(num_heads).unwrap_or(0));
                p.check(num_kv_heads > 0 && num_heads.is_multiple_of(num_kv_heads.max(1)), || {
                    format!(
                        "num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
                    )
                });
                p.check(head_dim > 0 && head_dim.is_multiple_of(2), || {
                    format!("head_dim ({head_dim}) must be even and greater than 0")
                });
                let sliding_window = match family {
                    Family::Qwen3Moe if raw.use_sliding_window == Some(true) => {
                        Some(raw.sliding_window.unwrap_or(4096))
                    }
                    Family::Mixtral => raw.sliding_window,
                    _ => None,
                };
                let attention = AttentionConfig::Gqa {
                    num_kv_heads,
                    head_dim,
                    qk_norm: family == Family::Qwen3Moe,
                    bias: family == Family::Qwen3Moe && raw.attention_bias == Some(true),
                    sliding_window,
                };
                (attention, head_dim)
            }
            Family::DeepseekV3 => {
                let kv_lora_rank = raw.kv_lora_rank.unwrap_or(512);
                let qk_nope_head_dim = raw.qk_nope_head_dim.unwrap_or(128);
                let qk_rope_head_dim = raw.qk_rope_head_dim.unwrap_or(64);
                let v_head_dim = raw.v_head_dim.unwrap_or(128);
                for (value, key) in [
                    (kv_lora_rank, "kv_lora_rank"),
                    (qk_nope_head_dim, "qk_nope_head_dim"),
                    (v_head_dim, "v_head_dim"),
                    (raw.q_lora_rank.unwrap_or(1), "q_lora_rank"),
                ] {
                    p.check(value > 0, || format!("`{key}` must be greater than 0"));
                }
                p.check(
                    qk_rope_head_dim.is_multiple_of(2) && qk_rope_head_dim > 0,
                    || {
                        format!(
                            "qk_rope_head_dim ({qk_rope_head_dim}) must be even and greater than 0"
                        )
                    },
                );
                if let Some(kv_heads) = raw.num_key_value_heads {
                    p.check(kv_heads == num_heads, || {
                        format!("MLA needs num_key_value_heads ({kv_heads}) equal to num_attention_heads ({num_heads})")
                    });
                }
                let attention = AttentionConfig::Mla {
                    q_lora_rank: raw.q_lora_rank,
                    kv_lora_rank,
                    qk_nope_head_dim,
                    qk_rope_head_dim,
                    v_head_dim,
                    interleave: raw.rope_interleave.unwrap_or(true),
                    bias: raw.attention_bias == Some(true),
                };
                (attention, qk_rope_head_dim)
            }
        };

        let rope = match parse_rope(&raw, family, rope_head_dim, max_position_embeddings) {
            Ok(rope) => rope,
            Err(message) => {
                p.0.push(message);
                RopeConfig {
                    theta: 10000.0,
                    dim: rope_head_dim,
                    scaling: RopeScaling::None,
                }
            }
        };

        let (moe, moe_layers, intermediate_size) = match family {
            Family::Qwen3Moe => {
                // Published Qwen3 configs say num_experts; transformers 5 writes num_local_experts.
                let num_experts =
                    p.require(raw.num_experts.or(raw.num_local_experts), "num_experts");
                let step = raw.decoder_sparse_step.unwrap_or(1);
                p.check(step > 0, || {
                    "`decoder_sparse_step` must be at least 1".into()
                });
                let mlp_only = raw.mlp_only_layers.clone().unwrap_or_default();
                let layers = (0..num_layers)
                    .map(|l| {
                        !mlp_only.contains(&l) && num_experts > 0 && (l + 1) % step.max(1) == 0
                    })
                    .collect();
                let moe = MoeConfig {
                    num_experts,
                    top_k: raw.num_experts_per_tok.unwrap_or(8),
                    expert_intermediate_size: p
                        .require(raw.moe_intermediate_size, "moe_intermediate_size"),
                    shared_intermediate_size: 0,
                    gating: GatingConfig::Softmax {
                        renormalize: raw.norm_topk_prob.unwrap_or(false),
                    },
                };
                (moe, layers, raw.intermediate_size.unwrap_or(0))
            }
            Family::Mixtral => {
                let intermediate = p.require(raw.intermediate_size, "intermediate_size");
                let moe = MoeConfig {
                    num_experts: raw.num_local_experts.or(raw.num_experts).unwrap_or(8),
                    top_k: raw.num_experts_per_tok.unwrap_or(2),
                    expert_intermediate_size: intermediate,
                    shared_intermediate_size: 0,
                    gating: GatingConfig::Softmax { renormalize: true },
                };
                (moe, vec![true; num_layers], intermediate)
            }
            Family::DeepseekV3 => {
                let num_experts = p.require(raw.n_routed_experts, "n_routed_experts");
                let expert_intermediate =
                    p.require(raw.moe_intermediate_size, "moe_intermediate_size");
                let first_dense = raw.first_k_dense_replace.unwrap_or(3);
                let n_group = raw.n_group.unwrap_or(8);
                let topk_group = raw.topk_group.unwrap_or(4);
                if let Some(f) = &raw.scoring_func {
                    p.check(f == "sigmoid", || {
                        format!("unsupported scoring_func `{f}`: deepseek_v3 gating is sigmoid")
                    });
                }
                if let Some(m) = &raw.topk_method {
                    p.check(m == "noaux_tc", || {
                        format!("unsupported topk_method `{m}`: only noaux_tc is supported")
                    });
                }
                p.check(n_group > 0 && num_experts.is_multiple_of(n_group.max(1)), || {
                    format!(
                        "n_routed_experts ({num_experts}) must be a multiple of n_group ({n_group})"
                    )
                });
                p.check(topk_group >= 1 && topk_group <= n_group, || {
                    format!("topk_group ({topk_group}) must be between 1 and n_group ({n_group})")
                });
                if n_group > 0 && num_experts.is_multiple_of(n_group.max(1)) {
                    p.check(num_experts / n_group >= 2, || {
                        "each expert group needs at least 2 experts (group score is the sum of the top 2)"
                            .into()
                    });
                }
                let moe = MoeConfig {
                    num_experts,
                    top_k: raw.num_experts_per_tok.unwrap_or(8),
                    expert_intermediate_size: expert_intermediate,
                    shared_intermediate_size: expert_intermediate
                        * raw.n_shared_experts.unwrap_or(1),
                    gating: GatingConfig::SigmoidGrouped {
                        n_group,
                        topk_group,
                        normalize: raw.norm_topk_prob.unwrap_or(true),
                        routed_scaling_factor: raw.routed_scaling_factor.unwrap_or(2.5) as f32,
                    },
                };
                let layers = (0..num_layers).map(|l| l >= first_dense).collect();
                let intermediate = raw.intermediate_size.unwrap_or(18432);
                (moe, layers, intermediate)
            }
        };
        p.check(
            moe.num_experts > 0 || !moe_layers.iter().any(|&is_moe| is_moe),
            || "the number of experts (`num_experts`, `num_local_experts` or `n_routed_experts`) must be greater than 0".into(),
        );
        p.check(
            moe.num_experts == 0 || (1..=moe.num_experts).contains(&moe.top_k),
            || {
                format!(
                    "num_experts_per_tok ({}) must be between 1 and the number of experts ({})",
                    moe.top_k, moe.num_experts
                )
            },
        );
        if let GatingConfig::SigmoidGrouped {
            n_group,
            topk_group,
            ..
        } = moe.gating
            && n_group > 0
        {
            p.check(moe.top_k <= topk_group * (moe.num_experts / n_group), || {
                format!(
                    "num_experts_per_tok ({}) exceeds the experts in the {topk_group} chosen groups",
                    moe.top_k
                )
            });
        }
        let has_dense = moe_layers.iter().any(|is_moe| !is_moe);
        p.check(!has_dense || intermediate_size > 0, || {
            "`intermediate_size` is needed: the model has dense MLP layers".into()
        });

        let eos_token_ids = match &raw.eos_token_id {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            Some(other) => {
                p.0.push(format!(
                    "`eos_token_id` must be a number or a list, not {other}"
                ));
                Vec::new()
            }
        };

        if !p.0.is_empty() {
            return Err(p.0);
        }
        Ok(ModelConfig {
            model_type,
            family,
            vocab_size,
            hidden_size,
            num_layers,
            num_heads,
            rms_norm_eps,
            max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            intermediate_size,
            attention,
            rope,
            moe,
            moe_layers,
            eos_token_ids,
            dtype: raw.dtype.or(raw.torch_dtype),
            quantization,
        })
    }
}

impl ModelConfig {
    /// The first `layers` decoder layers only (`--num-layers`).
    pub fn with_layers(mut self, layers: usize) -> Result<Self, String> {
        if layers == 0 || layers > self.num_layers {
            return Err(format!(
                "--num-layers {layers}: the model has {} layers (1 to {} can be served)",
                self.num_layers, self.num_layers
            ));
        }
        self.num_layers = layers;
        self.moe_layers.truncate(layers);
        Ok(self)
    }
}

/// Keys a multimodal wrapper keeps at its top level that belong to the text model too.
const WRAPPER_KEYS_FOR_TEXT: [&str; 5] = [
    "quantization_config",
    "eos_token_id",
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
];

/// The text model's config. Kimi K2.5 and later (`model_type = "kimi_k25"`,
/// `KimiK25ForConditionalGeneration`) nest it under `text_config` beside a vision tower's, with
/// `quantization_config` at the top level; moe-node serves the text model. Returns the config
/// to read and, for a wrapper, its `model_type` (for display).
fn text_model_config(value: Value) -> Result<(Value, Option<String>), Vec<String>> {
    let Value::Object(mut outer) = value else {
        return Err(vec!["cannot read it: not a JSON object".into()]);
    };
    if outer.get("model_type").and_then(Value::as_str) != Some("kimi_k25") {
        return Ok((Value::Object(outer), None));
    }
    let Some(Value::Object(mut text)) = outer.remove("text_config") else {
        return Err(vec![
            "model_type `kimi_k25` needs `text_config`, the text model's config".into(),
        ]);
    };
    match text.get("model_type").and_then(Value::as_str) {
        Some("kimi_k2" | "deepseek_v3") => {}
        other => {
            return Err(vec![format!(
                "kimi_k25: text_config.model_type is {other:?}; moe-node serves kimi_k2 or \
                 deepseek_v3 text models"
            )]);
        }
    }
    for key in WRAPPER_KEYS_FOR_TEXT {
        if !text.contains_key(key)
            && let Some(v) = outer.remove(key)
        {
            text.insert(key.to_string(), v);
        }
    }
    Ok((Value::Object(text), Some("kimi_k25".into())))
}

/// Reads rope settings from either style: `rope_theta` + `rope_scaling` at the top level
/// (published checkpoints) or one `rope_parameters` object (newer transformers).
fn parse_rope(
    raw: &RawConfig,
    family: Family,
    dim: usize,
    max_position_embeddings: usize,
) -> Result<RopeConfig, String> {
    let params = match (&raw.rope_parameters, &raw.rope_scaling) {
        (Some(Value::Object(p)), _) => Some(p),
        (_, Some(Value::Object(p))) => Some(p),
        (None | Some(Value::Null), None | Some(Value::Null)) => None,
        _ => return Err("`rope_parameters`/`rope_scaling` must be an object".into()),
    };
    let number = |key: &str| params.and_then(|p| p.get(key)).and_then(Value::as_f64);
    let default_theta = if family == Family::Mixtral {
        1_000_000.0
    } else {
        10_000.0
    };
    let theta = number("rope_theta")
        .or(raw.rope_theta)
        .unwrap_or(default_theta);
    let rope_type = params
        .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let scaling = match rope_type {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: number("factor").ok_or("linear rope scaling needs `factor`")?,
        },
        "yarn" => {
            let original = number("original_max_position_embeddings")
                .map(|v| v as usize)
                .unwrap_or(max_position_embeddings);
            let factor =
                number("factor").unwrap_or(max_position_embeddings as f64 / original.max(1) as f64);
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: number("beta_fast").filter(|v| *v != 0.0).unwrap_or(32.0),
                beta_slow: number("beta_slow").filter(|v| *v != 0.0).unwrap_or(1.0),
                mscale: number("mscale"),
                mscale_all_dim: number("mscale_all_dim"),
                attention_factor: number("attention_factor"),
                truncate: params
                    .and_then(|p| p.get("truncate"))
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
            }
        }
        other => {
            return Err(format!(
                "unsupported rope type `{other}`: default, linear and yarn are supported"
            ));
        }
    };
    if theta <= 0.0 {
        return Err(format!("rope_theta ({theta}) must be positive"));
    }
    Ok(RopeConfig {
        theta,
        dim,
        scaling,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIMI_LIKE: &str = r#"{
        "model_type": "kimi_k2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
        "kv_lora_rank": 32, "q_lora_rank": null, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "torch_dtype": "bfloat16", "eos_token_id": 7
    }"#;

    #[test]
    fn reads_kimi_config_with_top_level_rope_theta() {
        let c = ModelConfig::parse(KIMI_LIKE).unwrap();
        assert_eq!(c.family, Family::DeepseekV3);
        assert_eq!(c.model_type, "kimi_k2");
        assert_eq!(c.moe_layers, vec![false, true, true]);
        assert_eq!(c.moe.shared_intermediate_size, 32);
        assert_eq!(c.rope.theta, 50000.0);
        assert_eq!(c.rope.dim, 8);
        assert!(matches!(c.rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 32.0));
        assert_eq!(c.eos_token_ids, vec![7]);
        assert_eq!(c.dtype.as_deref(), Some("bfloat16"));
    }

    #[test]
    fn reads_rope_parameters_style() {
        let text = r#"{"model_type": "mixtral", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
            "dtype": "float32"}"#;
        let c = ModelConfig::parse(text).unwrap();
        assert_eq!(c.rope.theta, 500.0);
        assert_eq!(c.rope.scaling, RopeScaling::None);
        assert_eq!(c.dtype.as_deref(), Some("float32"));
    }

    #[test]
    fn qwen_sparse_step_and_mlp_only_layers() {
        let text = r#"{"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}"#;
        let c = ModelConfig::parse(text).unwrap();
        assert_eq!(c.moe_layers, vec![false, true, false, false]);
    }

    #[test]
    fn unsupported_model_type_is_named() {
        let err = ModelConfig::parse(r#"{"model_type": "llama"}"#).unwrap_err();
        assert!(err[0].contains("unsupported model_type `llama`"), "{err:?}");
    }

    #[test]
    fn every_missing_key_is_reported_at_once() {
        let err = ModelConfig::parse(r#"{"model_type": "qwen3_moe"}"#).unwrap_err();
        for key in [
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_experts",
        ] {
            assert!(err.iter().any(|m| m.contains(key)), "{key} not in {err:?}");
        }
    }

    #[test]
    fn zero_sized_latent_dimensions_are_rejected() {
        let text = KIMI_LIKE
            .replace(r#""q_lora_rank": null"#, r#""q_lora_rank": 0"#)
            .replace(r#""v_head_dim": 16"#, r#""v_head_dim": 0"#);
        let err = ModelConfig::parse(&text).unwrap_err();
        assert!(err.iter().any(|m| m.contains("q_lora_rank")), "{err:?}");
        assert!(err.iter().any(|m| m.contains("v_head_dim")), "{err:?}");
    }

    #[test]
    fn quantized_checkpoints_are_read_or_refused_naming_the_method() {
        let with = |q: &str| {
            KIMI_LIKE.replace(
                r#""eos_token_id": 7"#,
                &format!(r#""eos_token_id": 7, "quantization_config": {q}"#),
            )
        };
        let fp8 = with(
            r#"{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}"#,
        );
        let c = ModelConfig::parse(&fp8).unwrap();
        assert_eq!(c.quantization, Quantization::Fp8 { block: [128, 128] });
        let err = ModelConfig::parse(&with(r#"{"quant_method": "awq", "bits": 4}"#)).unwrap_err();
        assert!(
            err.iter().any(|m| m.contains("quant_method `awq`")),
            "{err:?}"
        );
    }

    #[test]
    fn kimi_k25_serves_the_nested_text_config_with_the_top_level_quantization() {
        let text: Value = serde_json::from_str(KIMI_LIKE).unwrap();
        let wrapper = serde_json::json!({
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": text,
            "vision_config": {"model_type": "moonvit", "hidden_size": 32},
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                    "weight_block_size": [128, 128]},
        });
        let c = ModelConfig::parse(&wrapper.to_string()).unwrap();
        assert_eq!(c.model_type, "kimi_k25");
        assert_eq!(c.family, Family::DeepseekV3);
        assert_eq!(c.hidden_size, 64);
        assert_eq!(c.quantization, Quantization::Fp8 { block: [128, 128] });
        let err = ModelConfig::parse(r#"{"model_type": "kimi_k25"}"#).unwrap_err();
        assert!(err[0].contains("text_config"), "{err:?}");
    }

    #[test]
    fn absurd_layer_count_is_rejected_not_allocated() {
        let text = KIMI_LIKE.replace(
            r#""num_hidden_layers": 3"#,
            r#""num_hidden_layers": 1000000000000"#,
        );
        let err = ModelConfig::parse(&text).unwrap_err();
        assert!(
            err.iter().any(|m| m.contains("num_hidden_layers")),
            "{err:?}"
        );
    }

    #[test]
    fn crafted_sizes_are_refused_naming_the_key() {
        let mixtral = r#"{"model_type": "mixtral", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "num_local_experts": 0}"#;
        let err = ModelConfig::parse(mixtral).unwrap_err();
        assert!(
            err.iter().any(|m| m.contains("num_local_experts")),
            "{err:?}"
        );
        for (key, value) in [
            ("max_position_embeddings", "4611686018427387904"),
            ("hidden_size", "18446744073709551615"),
            ("vocab_size", "4294967296"),
            ("n_routed_experts", "1099511627776"),
            ("moe_intermediate_size", "1099511627776"),
        ] {
            let mut v: serde_json::Value = serde_json::from_str(KIMI_LIKE).unwrap();
            v[key] = serde_json::Value::Number(value.parse::<u64>().unwrap().into());
            let text = v.to_string();
            let err = ModelConfig::parse(&text).unwrap_err();
            assert!(
                err.iter()
                    .any(|m| m.contains(&format!("`{key}` ({value}) exceeds"))),
                "{key}: {err:?}"
            );
        }
        let mut v: serde_json::Value = serde_json::from_str(KIMI_LIKE).unwrap();
        v["max_position_embeddings"] = 1.into();
        let err = ModelConfig::parse(&v.to_string()).unwrap_err();
        assert!(
            err.iter().any(|m| m.contains("max_position_embeddings")),
            "{err:?}"
        );
    }

    #[test]
    fn bad_group_settings_are_rejected() {
        let text = KIMI_LIKE.replace(r#""topk_group": 2"#, r#""topk_group": 9"#);
        let err = ModelConfig::parse(&text).unwrap_err();
        assert!(err.iter().any(|m| m.contains("topk_group")), "{err:?}");
    }
}
