//! Qwen3-Next (`qwen3_next`) and Qwen3.5-MoE (`qwen3_5_moe_text`, and the `qwen3_5_moe`
//! wrapper whose `text_config` it is; the vision tower is not served): hybrid models whose
//! `layer_types` mix `linear_attention` layers (gated DeltaNet, [`LinearAttention`]: a
//! recurrent state per value head after a short causal convolution) with `full_attention`
//! ones (GQA with an RMSNorm over each q and k head, rope over the first
//! `partial_rotary_factor` of each head, and each head's output scaled by the sigmoid of a
//! gate projected with its query). Every RMSNorm but the linear layers' gated one stores its
//! weight as an offset from 1. Softmax top-k routing (renormalised where `norm_topk_prob`;
//! always in Qwen3.5) with one shared expert scaled by the sigmoid of its own gate
//! (`shared_expert_gate`). Qwen3-Next's MoE layers follow `decoder_sparse_step` and
//! `mlp_only_layers`; every Qwen3.5 layer is MoE. Qwen3-Next stores the linear layers'
//! projections fused and grouped per key head (`in_proj_qkvz`, `in_proj_ba`), Qwen3.5 apart.
//! Qwen3.5's releases store the routed experts fused (`experts.gate_up_proj`
//! `[experts, 2 * moe_intermediate, hidden]`, gate first, and `experts.down_proj`), while
//! transformers' `save_pretrained` writes them apart: both are read.
//! The multi-token-prediction layers both publish (`mtp.*`) are not read.

use serde::Deserialize;
use serde_json::Value;

use super::{
    Common, Defaults, ExpertNames, FamilyParts, FamilySpec, Gqa, ToolCallFormat, gqa, keys,
};
use crate::model::config::parts::{
    AttentionConfig, ExpertActivation, GatingConfig, LinearAttention, MAX_LAYERS, MoeConfig,
    Problems, QkNorm,
};

pub(super) struct Qwen3Next;

/// Its own keys.
#[derive(Deserialize)]
struct Keys {
    model_type: Option<String>,
    num_experts: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    layer_types: Option<Vec<String>>,
    full_attention_interval: Option<usize>,
    linear_num_key_heads: Option<usize>,
    linear_num_value_heads: Option<usize>,
    linear_key_head_dim: Option<usize>,
    linear_value_head_dim: Option<usize>,
    linear_conv_kernel_dim: Option<usize>,
    /// Published configs write it at the top level; transformers 5 under `rope_parameters`.
    partial_rotary_factor: Option<f64>,
    /// Qwen3.5 writes it (true); Qwen3-Next's attention always gates.
    attn_output_gate: Option<bool>,
}

/// The configs' default: a quarter of each head is rotated.
const DEFAULT_PARTIAL_ROTARY_FACTOR: f64 = 0.25;

impl FamilySpec for Qwen3Next {
    fn model_types(&self) -> &'static [&'static str] {
        &["qwen3_next", "qwen3_5_moe_text"]
    }

    fn wrapper_types(&self) -> &'static [&'static str] {
        &["qwen3_5_moe"]
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
        }
    }

    fn size_limits(&self) -> &'static [(&'static str, usize)] {
        &[
            ("num_experts", 1 << 16),
            ("shared_expert_intermediate_size", 1 << 18),
            ("decoder_sparse_step", MAX_LAYERS),
            ("full_attention_interval", MAX_LAYERS),
            ("linear_num_key_heads", 1 << 10),
            ("linear_num_value_heads", 1 << 10),
            ("linear_key_head_dim", 1 << 12),
            ("linear_value_head_dim", 1 << 12),
            ("linear_conv_kernel_dim", 1 << 6),
        ]
    }

    fn read(
        &self,
        config: &Value,
        common: &Common,
        p: &mut Problems,
    ) -> Result<FamilyParts, Vec<String>> {
        let own: Keys = keys(config)?;
        let qwen3_5 = own.model_type.as_deref() == Some("qwen3_5_moe_text");
        let (attention, head_dim) = gqa(
            common,
            p,
            Gqa {
                qk_norm: QkNorm::PerHead,
                bias: common.keys.attention_bias == Some(true),
                sliding_window: None,
            },
        );
        let output_gate = own.attn_output_gate.unwrap_or(true);
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
                layers: Vec::new(),
                sinks: false,
                o_bias: false,
                output_gate,
            },
            mla => mla,
        };
        let rope_dim = rotated_dim(&own, common, head_dim, p);
        let linear = linear_attention(&own, common.num_layers, qwen3_5, p);
        let num_experts = p.require(own.num_experts, "num_experts");
        let moe_layers = if qwen3_5 {
            vec![num_experts > 0; common.num_layers]
        } else {
            let step = own.decoder_sparse_step.unwrap_or(1);
            p.check(step > 0, || {
                "`decoder_sparse_step` must be at least 1".into()
            });
            let mlp_only = own.mlp_only_layers.clone().unwrap_or_default();
            (0..common.num_layers)
                .map(|l| !mlp_only.contains(&l) && num_experts > 0 && (l + 1) % step.max(1) == 0)
                .collect()
        };
        let shared = own.shared_expert_intermediate_size.unwrap_or(0);
        let moe = MoeConfig {
            num_experts,
            top_k: common.keys.num_experts_per_tok.unwrap_or(10),
            expert_intermediate_size: p
                .require(common.keys.moe_intermediate_size, "moe_intermediate_size"),
            shared_intermediate_size: shared,
            gating: GatingConfig::Softmax {
                // Qwen3.5's router always renormalises (its config has no such key).
                renormalize: qwen3_5 || common.keys.norm_topk_prob.unwrap_or(true),
            },
            weight_input: false,
            shared_expert_gate: shared > 0,
            activation: ExpertActivation::Silu,
        };
        Ok(FamilyParts {
            attention,
            rope_dim,
            moe,
            moe_layers,
            intermediate_size: common.keys.intermediate_size.unwrap_or(0),
            linear_attention: Some(linear),
            centered_norms: true,
        })
    }

    fn mlp_prefix(&self, layer: usize) -> String {
        format!("model.layers.{layer}.mlp")
    }

    fn expert_names(&self) -> ExpertNames {
        ExpertNames::PROJ
    }

    fn fused_experts(&self) -> Option<super::FusedExperts> {
        // Qwen3.5-MoE's releases (gate first); Qwen3-Next's, and what transformers saves, keep
        // each expert apart.
        Some(super::FusedExperts {
            gate_up: "gate_up_proj",
            down: "down_proj",
            interleaved: false,
            bias: false,
            outputs_first: true,
            or_apart: true,
        })
    }

    fn router(&self) -> &'static str {
        "gate"
    }

    fn shared_experts(&self) -> &'static str {
        "shared_expert"
    }

    fn correction_bias(&self) -> Option<&'static str> {
        None
    }

    fn tool_call_formats(&self) -> &'static [ToolCallFormat] {
        // Qwen3.5's template writes XML calls, Qwen3-Next's Hermes JSON.
        &[ToolCallFormat::Qwen3Coder, ToolCallFormat::Hermes]
    }
}

/// Rotated values per head, `int(head_dim * partial_rotary_factor)`; the factor is read from
/// `rope_parameters` first, as transformers 5 writes it.
fn rotated_dim(own: &Keys, common: &Common, head_dim: usize, p: &mut Problems) -> usize {
    let nested = [&common.keys.rope_parameters, &common.keys.rope_scaling]
        .into_iter()
        .find_map(|params| params.as_ref()?.get("partial_rotary_factor")?.as_f64());
    let factor = nested
        .or(own.partial_rotary_factor)
        .unwrap_or(DEFAULT_PARTIAL_ROTARY_FACTOR);
    let ok = factor > 0.0 && factor <= 1.0;
    p.check(ok, || {
        format!("partial_rotary_factor ({factor}) must be greater than 0 and at most 1")
    });
    let rope_dim = if ok {
        (head_dim as f64 * factor) as usize
    } else {
        head_dim
    };
    p.check(rope_dim >= 2 && rope_dim.is_multiple_of(2), || {
        format!("head_dim ({head_dim}) times partial_rotary_factor ({factor}) must be even and at least 2")
    });
    rope_dim
}

/// The linear layers: `layer_types` where given (its length checked), else every
/// `full_attention_interval`-th layer full and the others linear, as the config classes
/// derive it; the DeltaNet's head counts, which must divide.
fn linear_attention(
    own: &Keys,
    num_layers: usize,
    qwen3_5: bool,
    p: &mut Problems,
) -> LinearAttention {
    let layers: Vec<bool> = match &own.layer_types {
        Some(types) => {
            p.check(types.len() == num_layers, || {
                format!(
                    "layer_types has {} entries for {num_layers} layers",
                    types.len()
                )
            });
            for t in types {
                p.check(
                    matches!(t.as_str(), "linear_attention" | "full_attention"),
                    || format!("layer_types: unknown `{t}` (linear_attention or full_attention)"),
                );
            }
            (0..num_layers)
                .map(|l| types.get(l).is_some_and(|t| t == "linear_attention"))
                .collect()
        }
        None => {
            let interval = own.full_attention_interval.unwrap_or(4);
            p.check(interval > 0, || {
                "`full_attention_interval` must be greater than 0".into()
            });
            (0..num_layers)
                .map(|l| (l + 1) % interval.max(1) != 0)
                .collect()
        }
    };
    let key_heads = p.require(
        own.linear_num_key_heads.or(Some(16)),
        "linear_num_key_heads",
    );
    let value_heads = p.require(
        own.linear_num_value_heads.or(Some(32)),
        "linear_num_value_heads",
    );
    p.check(value_heads.is_multiple_of(key_heads.max(1)), || {
        format!(
            "linear_num_value_heads ({value_heads}) must be a multiple of linear_num_key_heads \
             ({key_heads})"
        )
    });
    LinearAttention {
        num_key_heads: key_heads,
        num_value_heads: value_heads,
        key_head_dim: p.require(own.linear_key_head_dim.or(Some(128)), "linear_key_head_dim"),
        value_head_dim: p.require(
            own.linear_value_head_dim.or(Some(128)),
            "linear_value_head_dim",
        ),
        conv_kernel: p.require(
            own.linear_conv_kernel_dim.or(Some(4)),
            "linear_conv_kernel_dim",
        ),
        layers,
        fused_projections: !qwen3_5,
    }
}
