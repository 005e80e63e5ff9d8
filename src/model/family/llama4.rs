//! Llama 4 Scout and Maverick (`llama4_text`, and the `llama4` wrapper whose `text_config` it
//! is; the vision tower is not served): GQA whose layers differ. Most layers turn rope over
//! interleaved pairs, norm each q and k head without a weight (`use_qk_norm`) and attend
//! within chunks of `attention_chunk_size` positions; every `no_rope_layer_interval`-th layer
//! (`no_rope_layers` 0) has no rope, attends to everything and scales its queries by the
//! attention temperature (`attn_temperature_tuning`, `floor_scale`, `attn_scale`). MoE every
//! `interleave_moe_layer_step` layers (`moe_layers`), a router (`feed_forward.router`) whose
//! top-1 sigmoid weight scales the expert's input, one shared expert
//! (`feed_forward.shared_expert`), routed experts stored fused (`feed_forward.experts.
//! gate_up_proj` `[experts, hidden, 2 * intermediate]`, gate then up, and `down_proj`); dense
//! layers' MLP is `intermediate_size_mlp` wide.

use serde::Deserialize;
use serde_json::Value;

use super::{
    Common, Defaults, ExpertNames, FamilyParts, FamilySpec, FusedExperts, Gqa, ToolCallFormat, gqa,
    keys,
};
use crate::model::config::parts::{
    AttentionConfig, ExpertActivation, GatingConfig, LayerAttention, MAX_CONTEXT, MAX_LAYERS,
    MoeConfig, Problems, QkNorm, Span, Temperature,
};

pub(super) struct Llama4;

/// Its own keys.
#[derive(Deserialize)]
struct Keys {
    num_local_experts: Option<usize>,
    intermediate_size_mlp: Option<usize>,
    interleave_moe_layer_step: Option<usize>,
    moe_layers: Option<Vec<usize>>,
    no_rope_layers: Option<Vec<u8>>,
    no_rope_layer_interval: Option<usize>,
    attention_chunk_size: Option<usize>,
    layer_types: Option<Vec<String>>,
    use_qk_norm: Option<bool>,
    /// A boolean in transformers' configs, a number (4) in Scout's published one: on unless
    /// false or 0.
    attn_temperature_tuning: Option<Value>,
    floor_scale: Option<f64>,
    attn_scale: Option<f64>,
}

impl FamilySpec for Llama4 {
    fn model_types(&self) -> &'static [&'static str] {
        &["llama4_text"]
    }

    fn wrapper_types(&self) -> &'static [&'static str] {
        &["llama4"]
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            max_position_embeddings: 131072,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
        }
    }

    fn size_limits(&self) -> &'static [(&'static str, usize)] {
        &[
            ("num_local_experts", 1 << 16),
            ("intermediate_size_mlp", 1 << 18),
            ("interleave_moe_layer_step", MAX_LAYERS),
            ("no_rope_layer_interval", MAX_LAYERS),
            ("attention_chunk_size", MAX_CONTEXT),
        ]
    }

    fn read(
        &self,
        config: &Value,
        common: &Common,
        p: &mut Problems,
    ) -> Result<FamilyParts, Vec<String>> {
        let own: Keys = keys(config)?;
        let (attention, head_dim) = gqa(
            common,
            p,
            Gqa {
                qk_norm: QkNorm::None,
                bias: common.keys.attention_bias == Some(true),
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
                sliding_window,
                ..
            } => AttentionConfig::Gqa {
                num_kv_heads,
                head_dim,
                qk_norm,
                bias,
                sliding_window,
                interleave: true,
                layers,
                sinks: false,
                o_bias: false,
                output_gate: false,
            },
            mla => mla,
        };
        let intermediate = p.require(common.keys.intermediate_size, "intermediate_size");
        let moe = MoeConfig {
            num_experts: p.require(own.num_local_experts, "num_local_experts"),
            top_k: common.keys.num_experts_per_tok.unwrap_or(1),
            expert_intermediate_size: intermediate,
            shared_intermediate_size: intermediate,
            // Llama4Router: top-k of the logits, each chosen one's sigmoid its weight (the top
            // k of the sigmoids are those of the logits); one group is no group.
            gating: GatingConfig::SigmoidGrouped {
                n_group: 1,
                topk_group: 1,
                normalize: false,
                routed_scaling_factor: 1.0,
            },
            weight_input: true,
            shared_expert_gate: false,
            activation: ExpertActivation::Silu,
        };
        let moe_layers = moe_layers(&own, common.num_layers, p);
        Ok(FamilyParts {
            attention,
            rope_dim: head_dim,
            moe,
            moe_layers,
            intermediate_size: own.intermediate_size_mlp.unwrap_or(16384),
            linear_attention: None,
            centered_norms: false,
        })
    }

    fn mlp_prefix(&self, layer: usize) -> String {
        format!("model.layers.{layer}.feed_forward")
    }

    fn expert_names(&self) -> ExpertNames {
        ExpertNames::PROJ
    }

    fn fused_experts(&self) -> Option<FusedExperts> {
        Some(FusedExperts {
            gate_up: "gate_up_proj",
            down: "down_proj",
            interleaved: false,
            bias: false,
            outputs_first: false,
            or_apart: false,
        })
    }

    fn router(&self) -> &'static str {
        "router"
    }

    fn shared_experts(&self) -> &'static str {
        "shared_expert"
    }

    fn correction_bias(&self) -> Option<&'static str> {
        None
    }

    fn tool_call_formats(&self) -> &'static [ToolCallFormat] {
        // Llama 4's template writes a call as a JSON object on its own, as Hermes' body is.
        &[ToolCallFormat::Hermes]
    }
}

/// Each layer's rope, span, q/k norm and temperature, from `no_rope_layers` (1: rope; by
/// default every `no_rope_layer_interval`-th layer has none) and `layer_types` (by default
/// chunked where there is rope and a chunk size), as `Llama4TextConfig` derives them.
fn layer_attention(own: &Keys, num_layers: usize, p: &mut Problems) -> Vec<LayerAttention> {
    let interval = own.no_rope_layer_interval.unwrap_or(4).max(1);
    let rope: Vec<bool> = match &own.no_rope_layers {
        Some(list) if !list.is_empty() => {
            p.check(list.len() == num_layers, || {
                format!(
                    "no_rope_layers has {} entries for {num_layers} layers",
                    list.len()
                )
            });
            (0..num_layers)
                .map(|l| list.get(l).is_none_or(|&r| r != 0))
                .collect()
        }
        _ => (0..num_layers).map(|l| (l + 1) % interval != 0).collect(),
    };
    let chunk = own.attention_chunk_size;
    p.check(chunk != Some(0), || {
        "`attention_chunk_size` must be greater than 0".into()
    });
    let chunked: Vec<bool> = match &own.layer_types {
        Some(types) => {
            p.check(types.len() == num_layers, || {
                format!(
                    "layer_types has {} entries for {num_layers} layers",
                    types.len()
                )
            });
            for t in types {
                p.check(
                    matches!(t.as_str(), "chunked_attention" | "full_attention"),
                    || format!("layer_types: unknown `{t}` (chunked_attention or full_attention)"),
                );
            }
            (0..num_layers)
                .map(|l| types.get(l).is_some_and(|t| t == "chunked_attention"))
                .collect()
        }
        None => rope.iter().map(|&r| r && chunk.is_some()).collect(),
    };
    p.check(!chunked.iter().any(|&c| c) || chunk.is_some(), || {
        "layer_types has chunked_attention layers but no `attention_chunk_size`".into()
    });
    let tuning = match &own.attn_temperature_tuning {
        Some(Value::Bool(on)) => *on,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        _ => true,
    };
    let temperature = tuning.then(|| Temperature {
        floor_scale: own.floor_scale.unwrap_or(8192.0) as f32,
        attn_scale: own.attn_scale.unwrap_or(0.1) as f32,
    });
    p.check(temperature.is_none_or(|t| t.floor_scale > 0.0), || {
        "`floor_scale` must be greater than 0".into()
    });
    let use_qk_norm = own.use_qk_norm.unwrap_or(true);
    (0..num_layers)
        .map(|l| LayerAttention {
            rope: rope[l],
            span: match (chunked[l], chunk) {
                (true, Some(n)) if n > 0 => Span::Chunk(n),
                _ => Span::Full,
            },
            unit_qk_norm: use_qk_norm && rope[l],
            temperature: temperature.filter(|_| !rope[l]),
        })
        .collect()
}

/// Which layers are MoE: `moe_layers` where given, else every `interleave_moe_layer_step`-th.
fn moe_layers(own: &Keys, num_layers: usize, p: &mut Problems) -> Vec<bool> {
    match &own.moe_layers {
        Some(list) => {
            for &l in list {
                p.check(l < num_layers, || {
                    format!("moe_layers names layer {l}; the model has {num_layers}")
                });
            }
            (0..num_layers).map(|l| list.contains(&l)).collect()
        }
        None => {
            let step = own.interleave_moe_layer_step.unwrap_or(1);
            p.check(step > 0, || {
                "`interleave_moe_layer_step` must be greater than 0".into()
            });
            (0..num_layers)
                .map(|l| (l + 1) % step.max(1) == 0)
                .collect()
        }
    }
}
