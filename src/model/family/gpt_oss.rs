//! gpt-oss 20b and 120b (`gpt_oss`, GptOssForCausalLM): GQA with biases on q, k, v and o, a
//! learned attention sink per head (`self_attn.sinks`), layers alternating a
//! `sliding_window` and full attention (`layer_types`), YaRN rope over half-split heads; every
//! layer MoE, a router with a bias (`mlp.router`) whose top-k logits are softmaxed (the
//! renormalised top-k of a softmax over all), experts stored fused (`mlp.experts.gate_up_proj`
//! `[experts, hidden, 2 * intermediate]` with gate and up interleaved, `down_proj`, each with
//! a `_bias`) under a clamped SwiGLU (`swiglu_alpha` 1.702, `swiglu_limit` 7.0, `up + 1`).
//! Both releases are read: bf16, and MXFP4 (`quant_method: mxfp4`), whose experts are held
//! as stored (`crate::compute::quant::QuantFormat::Mxfp4`).

use serde::Deserialize;
use serde_json::Value;

use super::{
    Common, Defaults, ExpertNames, FamilyParts, FamilySpec, FusedExperts, Gqa, ToolCallFormat, gqa,
    keys,
};
use crate::model::config::parts::{
    AttentionConfig, ExpertActivation, GatingConfig, LayerAttention, MAX_CONTEXT, MoeConfig,
    Problems, QkNorm, Span,
};

pub(super) struct GptOss;

/// Its own keys.
#[derive(Deserialize)]
struct Keys {
    num_local_experts: Option<usize>,
    sliding_window: Option<usize>,
    layer_types: Option<Vec<String>>,
    swiglu_alpha: Option<f64>,
    swiglu_limit: Option<f64>,
}

impl FamilySpec for GptOss {
    fn model_types(&self) -> &'static [&'static str] {
        &["gpt_oss"]
    }

    fn wrapper_types(&self) -> &'static [&'static str] {
        &[]
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            max_position_embeddings: 131072,
            rms_norm_eps: 1e-5,
            rope_theta: 150_000.0,
        }
    }

    fn size_limits(&self) -> &'static [(&'static str, usize)] {
        &[
            ("num_local_experts", 1 << 16),
            ("sliding_window", MAX_CONTEXT),
        ]
    }

    fn read(
        &self,
        config: &Value,
        common: &Common,
        p: &mut Problems,
    ) -> Result<FamilyParts, Vec<String>> {
        let own: Keys = keys(config)?;
        let bias = common.keys.attention_bias != Some(false);
        let (attention, head_dim) = gqa(
            common,
            p,
            Gqa {
                qk_norm: QkNorm::None,
                bias,
                sliding_window: None,
            },
        );
        let layers = layer_attention(&own, common.num_layers, p);
        let attention = match attention {
            AttentionConfig::Gqa {
                num_kv_heads,
                head_dim,
                qk_norm,
                bias,
                ..
            } => AttentionConfig::Gqa {
                num_kv_heads,
                head_dim,
                qk_norm,
                bias,
                sliding_window: None,
                interleave: false,
                layers,
                sinks: true,
                o_bias: bias,
                output_gate: false,
            },
            mla => mla,
        };
        let alpha = own.swiglu_alpha.unwrap_or(1.702);
        let limit = own.swiglu_limit.unwrap_or(7.0);
        p.check(alpha > 0.0 && alpha.is_finite(), || {
            format!("swiglu_alpha ({alpha}) must be positive")
        });
        p.check(limit > 0.0, || {
            format!("swiglu_limit ({limit}) must be positive")
        });
        let intermediate = p.require(common.keys.intermediate_size, "intermediate_size");
        let moe = MoeConfig {
            num_experts: p.require(own.num_local_experts, "num_local_experts"),
            top_k: common.keys.num_experts_per_tok.unwrap_or(4),
            expert_intermediate_size: intermediate,
            shared_intermediate_size: 0,
            gating: GatingConfig::Softmax { renormalize: true },
            weight_input: false,
            shared_expert_gate: false,
            activation: ExpertActivation::ClampedSwiglu {
                alpha: alpha as f32,
                limit: limit as f32,
            },
        };
        Ok(FamilyParts {
            attention,
            rope_dim: head_dim,
            moe,
            moe_layers: vec![true; common.num_layers],
            intermediate_size: intermediate,
            linear_attention: None,
            centered_norms: false,
        })
    }

    fn mlp_prefix(&self, layer: usize) -> String {
        format!("model.layers.{layer}.mlp")
    }

    fn expert_names(&self) -> ExpertNames {
        ExpertNames::PROJ
    }

    fn fused_experts(&self) -> Option<FusedExperts> {
        Some(FusedExperts {
            gate_up: "gate_up_proj",
            down: "down_proj",
            interleaved: true,
            bias: true,
            outputs_first: false,
            or_apart: false,
        })
    }

    fn router(&self) -> &'static str {
        "router"
    }

    fn shared_experts(&self) -> &'static str {
        "shared_experts"
    }

    fn correction_bias(&self) -> Option<&'static str> {
        None
    }

    fn tool_call_formats(&self) -> &'static [ToolCallFormat] {
        &[ToolCallFormat::Harmony]
    }
}

/// Each layer's span from `layer_types` (by default sliding on even layers, full on odd ones,
/// as `GptOssConfig` derives it). Every layer turns rope and has no q/k norm.
fn layer_attention(own: &Keys, num_layers: usize, p: &mut Problems) -> Vec<LayerAttention> {
    let window = own.sliding_window;
    p.check(window != Some(0), || {
        "`sliding_window` must be greater than 0".into()
    });
    let sliding: Vec<bool> = match &own.layer_types {
        Some(types) => {
            p.check(types.len() == num_layers, || {
                format!(
                    "layer_types has {} entries for {num_layers} layers",
                    types.len()
                )
            });
            for t in types {
                p.check(
                    matches!(t.as_str(), "sliding_attention" | "full_attention"),
                    || format!("layer_types: unknown `{t}` (sliding_attention or full_attention)"),
                );
            }
            (0..num_layers)
                .map(|l| types.get(l).is_some_and(|t| t == "sliding_attention"))
                .collect()
        }
        None => (0..num_layers).map(|l| l % 2 == 0).collect(),
    };
    (0..num_layers)
        .map(|l| LayerAttention {
            rope: true,
            span: match (sliding[l], window) {
                (true, Some(n)) if n > 0 => Span::Window(n),
                _ => Span::Full,
            },
            unit_qk_norm: false,
            temperature: None,
        })
        .collect()
}
