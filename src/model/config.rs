//! `config.json` of the supported checkpoint families, read into one validated [`ModelConfig`].
//!
//! Published configs carry many keys we do not need (training knobs, quantisation notes), so
//! unknown keys are ignored here; missing or inconsistent keys that the forward pass depends
//! on are reported, all at once. The keys every family reads alike are read here; each
//! family reads its own in `super::family`.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::ModelError;
use super::family::{self, Common, FamilyParts};
use super::quant::Quantization;

pub use super::family::Family;
pub use super::family::{DeepseekV4, V4ExpertDtype, V4LayerKind, V4Shape};
pub use parts::{
    AttentionConfig, ExpertActivation, GatingConfig, LayerAttention, LightningIndexer,
    LinearAttention, MAX_CONTEXT, MAX_LAYERS, MoeConfig, QkNorm, RopeConfig, RopeScaling, Span,
    Temperature,
};
use parts::{CommonKeys, Problems};

/// The plain parts of a config, which the families build; this file reads what every family
/// shares and asks the family for the rest.
pub(super) mod parts;

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
    /// The linear-attention layers of a hybrid model (Qwen3-Next, Qwen3.5); `None` where
    /// every layer runs `attention`.
    pub linear_attention: Option<LinearAttention>,
    /// RMSNorm weights stored as offsets from 1 (`x * (1 + w)`: Qwen3-Next's zero-centred
    /// norms), made whole at load. The gated norm of its linear attention is not one of them.
    pub centered_norms: bool,
    pub rope: RopeConfig,
    pub moe: MoeConfig,
    /// Per layer: true where the MLP is a mixture of experts, false for a dense MLP.
    pub moe_layers: Vec<bool>,
    pub eos_token_ids: Vec<u32>,
    /// Storage dtype named by the config (`torch_dtype` or `dtype`), if any.
    pub dtype: Option<String>,
    /// How linear weights are stored (`quantization_config`).
    pub quantization: Quantization,
    /// DeepSeek-V4's own parts (compressed attention, hash routing, hyper-connections).
    pub deepseek_v4: Option<Box<DeepseekV4>>,
}

/// The common size keys with the largest value accepted (each family adds its own).
const COMMON_SIZE_LIMITS: [(&str, usize); 10] = [
    ("vocab_size", 1 << 22),
    ("hidden_size", 1 << 16),
    ("intermediate_size", 1 << 18),
    ("num_hidden_layers", MAX_LAYERS),
    ("num_attention_heads", 1 << 10),
    ("num_key_value_heads", 1 << 10),
    ("head_dim", 1 << 12),
    ("max_position_embeddings", MAX_CONTEXT),
    ("num_experts_per_tok", 1 << 10),
    ("moe_intermediate_size", 1 << 18),
];

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
        let (value, outer_type) = family::text_model_config(value)?;
        let raw =
            CommonKeys::deserialize(&value).map_err(|e| vec![format!("cannot read it: {e}")])?;
        let mut config = Self::from_raw(&value, raw)?;
        if let Some(outer) = outer_type {
            config.model_type = outer;
        }
        Ok(config)
    }

    /// Validates the config: the common keys here, the family's own in its file.
    fn from_raw(config: &Value, raw: CommonKeys) -> Result<Self, Vec<String>> {
        let model_type = raw.model_type.clone().unwrap_or_default();
        let family = Family::of_model_type(&model_type);
        // Sizes are multiplied together (tables, tensors, caches) before any tensor is read:
        // values no published model comes near are refused before any arithmetic on them.
        let family_limits = family.map_or(&[][..], Family::size_limits);
        let too_large = too_large(config, COMMON_SIZE_LIMITS.iter().chain(family_limits));
        if !too_large.is_empty() {
            return Err(too_large);
        }
        let Some(family) = family else {
            return Err(vec![if model_type.is_empty() {
                "missing key `model_type`".into()
            } else {
                format!(
                    "unsupported model_type `{model_type}`: moe-node runs {}",
                    Family::supported_model_types()
                )
            }]);
        };
        let defaults = family.defaults();
        let mut p = Problems(Vec::new());

        let quantization = match raw.quantization_config.as_ref() {
            None => Quantization::None,
            Some(q) => Quantization::parse(q).unwrap_or_else(|problems| {
                p.0.extend(problems);
                Quantization::None
            }),
        };
        // MXFP4 is how gpt-oss stores its fused experts; other families have no such tensors.
        if quantization == Quantization::Mxfp4 && family != Family::GptOss {
            p.0.push(format!(
                "quantization_config: quant_method `mxfp4` is read for gpt-oss's fused experts \
                 only, not for `{model_type}`"
            ));
        }
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
        let max_position_embeddings = raw
            .max_position_embeddings
            .unwrap_or(defaults.max_position_embeddings);
        p.check(max_position_embeddings >= 2, || {
            format!(
                "`max_position_embeddings` ({max_position_embeddings}) must be at least 2: a \
                 prompt token and one generated"
            )
        });
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(defaults.rms_norm_eps) as f32;
        if let Some(act) = &raw.hidden_act {
            p.check(act == "silu", || {
                format!("unsupported hidden_act `{act}`: only silu (SwiGLU) is supported")
            });
        }

        let common = Common {
            keys: &raw,
            hidden_size,
            num_heads,
            num_layers,
        };
        let FamilyParts {
            attention,
            rope_dim,
            moe,
            moe_layers,
            intermediate_size,
            linear_attention,
            centered_norms,
        } = family.read(config, &common, &mut p)?;
        let rope = match parse_rope(&raw, defaults.rope_theta, rope_dim, max_position_embeddings) {
            Ok(rope) => rope,
            Err(message) => {
                p.0.push(message);
                RopeConfig {
                    theta: 10000.0,
                    dim: rope_dim,
                    scaling: RopeScaling::None,
                }
            }
        };
        check_experts(&moe, &moe_layers, intermediate_size, &mut p);
        let deepseek_v4 = (family == Family::DeepseekV4)
            .then(|| family::deepseek_v4(config, &common, &rope).map(Box::new))
            .flatten();
        let eos_token_ids = eos_token_ids(raw.eos_token_id.as_ref(), &mut p);

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
            linear_attention,
            centered_norms,
            rope,
            moe,
            moe_layers,
            eos_token_ids,
            dtype: raw.dtype.or(raw.torch_dtype),
            quantization,
            deepseek_v4,
        })
    }
}

/// A message for each size key above its limit.
fn too_large<'a>(
    config: &Value,
    limits: impl Iterator<Item = &'a (&'a str, usize)>,
) -> Vec<String> {
    limits
        .filter_map(
            |&(key, max)| match config.get(key).and_then(Value::as_u64) {
                Some(v) if v > max as u64 => Some(format!("`{key}` ({v}) exceeds {max}")),
                _ => None,
            },
        )
        .collect()
}

/// What every family's experts must satisfy, whatever keys they came from.
fn check_experts(moe: &MoeConfig, moe_layers: &[bool], intermediate_size: usize, p: &mut Problems) {
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
}

/// `eos_token_id`: one id or a list of them.
fn eos_token_ids(value: Option<&Value>, p: &mut Problems) -> Vec<u32> {
    match value {
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
        if let Some(linear) = &mut self.linear_attention {
            linear.layers.truncate(layers);
        }
        if let AttentionConfig::Mla {
            indexer: Some(indexer),
            ..
        } = &mut self.attention
        {
            indexer.own.truncate(layers);
        }
        if let Some(v4) = &mut self.deepseek_v4 {
            v4.layers.truncate(layers);
            v4.hash_layers = v4.hash_layers.min(layers);
        }
        Ok(self)
    }
}

/// Reads rope settings from either style: `rope_theta` + `rope_scaling` at the top level
/// (published checkpoints) or one `rope_parameters` object (newer transformers).
fn parse_rope(
    raw: &CommonKeys,
    default_theta: f64,
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
        "llama3" => {
            let factor = number("factor").ok_or("llama3 rope scaling needs `factor`")?;
            let low = number("low_freq_factor").unwrap_or(1.0);
            let high = number("high_freq_factor").unwrap_or(4.0);
            // Scout publishes equal factors: no ramp between the two wavelengths.
            if !(factor > 0.0 && low > 0.0 && high >= low) {
                return Err(format!(
                    "llama3 rope scaling: factor ({factor}) and low_freq_factor ({low}) must be \
                     positive and high_freq_factor ({high}) at least low_freq_factor"
                ));
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: number("original_max_position_embeddings")
                    .map_or(8192, |v| v as usize),
            }
        }
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
                "unsupported rope type `{other}`: default, linear, llama3 and yarn are supported"
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
