//! GLM-4.5, 4.6 and 4.7 (`glm4_moe`, Glm4MoeForCausalLM): GQA with biases on q, k and v, an
//! RMSNorm over each q and k head where `use_qk_norm`, rope over the first
//! `partial_rotary_factor` of each head (rotate-half pairs); DeepSeek-V3's gate (sigmoid,
//! `e_score_correction_bias`, `n_group`/`topk_group`, `routed_scaling_factor`) with shared
//! experts, dense MLPs in the first `first_k_dense_replace` layers. Published checkpoints also
//! carry `num_nextn_predict_layers` multi-token-prediction layers after the last decoder
//! layer; they are not read.

use serde::Deserialize;
use serde_json::Value;

use super::{
    Common, Defaults, ExpertNames, FamilyParts, FamilySpec, Gqa, GroupedDefaults, GroupedKeys,
    ToolCallFormat, gqa, grouped_sigmoid_experts, keys,
};
use crate::model::config::parts::{MAX_LAYERS, Problems, QkNorm};

pub(super) struct Glm4Moe;

/// Its own keys (the gate's are [`GroupedKeys`]).
#[derive(Deserialize)]
struct Keys {
    use_qk_norm: Option<bool>,
    /// Published configs write it at the top level; transformers 5 under `rope_parameters`.
    partial_rotary_factor: Option<f64>,
}

/// Glm4MoeConfig's default: half of each head is rotated.
const DEFAULT_PARTIAL_ROTARY_FACTOR: f64 = 0.5;

impl FamilySpec for Glm4Moe {
    fn model_types(&self) -> &'static [&'static str] {
        &["glm4_moe"]
    }

    fn wrapper_types(&self) -> &'static [&'static str] {
        &[]
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            max_position_embeddings: 131072,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
        }
    }

    fn size_limits(&self) -> &'static [(&'static str, usize)] {
        &[
            ("n_routed_experts", 1 << 16),
            ("n_shared_experts", 1 << 6),
            ("first_k_dense_replace", MAX_LAYERS),
            ("n_group", 1 << 16),
            ("topk_group", 1 << 16),
        ]
    }

    fn read(
        &self,
        config: &Value,
        common: &Common,
        p: &mut Problems,
    ) -> Result<FamilyParts, Vec<String>> {
        let own: Keys = keys(config)?;
        let gate: GroupedKeys = keys(config)?;
        let (attention, head_dim) = gqa(
            common,
            p,
            Gqa {
                qk_norm: if own.use_qk_norm == Some(true) {
                    QkNorm::PerHead
                } else {
                    QkNorm::None
                },
                bias: common.keys.attention_bias == Some(true),
                sliding_window: None,
            },
        );
        let rope_dim = rotated_dim(&own, common, head_dim, p);
        let (moe, moe_layers) = grouped_sigmoid_experts(
            "glm4_moe",
            &gate,
            GroupedDefaults {
                first_k_dense_replace: 1,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 1.0,
            },
            common,
            p,
        );
        Ok(FamilyParts {
            attention,
            rope_dim,
            moe,
            moe_layers,
            intermediate_size: common.keys.intermediate_size.unwrap_or(10944),
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
        Some("gate.e_score_correction_bias")
    }

    fn tool_call_formats(&self) -> &'static [ToolCallFormat] {
        &[ToolCallFormat::Glm]
    }
}

/// Rotated values per head, `int(head_dim * partial_rotary_factor)` as transformers computes
/// it; the factor is read from `rope_parameters` first, as transformers 5 writes it.
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
    p.check(rope_dim > 0 && rope_dim.is_multiple_of(2), || {
        format!(
            "head_dim ({head_dim}) times partial_rotary_factor ({factor}) gives {rope_dim} \
             rotated values: it must be even and greater than 0"
        )
    });
    rope_dim
}
