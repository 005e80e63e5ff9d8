//! Mixtral (`mixtral`, MixtralForCausalLM): GQA with an optional sliding window, softmax
//! gating with renormalised top-k weights, every layer MoE, experts under
//! `block_sparse_moe` as `w1` (gate), `w3` (up) and `w2` (down).

use serde::Deserialize;
use serde_json::Value;

use super::{
    Common, Defaults, ExpertNames, FamilyParts, FamilySpec, Gqa, ToolCallFormat, gqa, keys,
};
use crate::model::config::parts::{
    ExpertActivation, GatingConfig, MAX_CONTEXT, MoeConfig, Problems, QkNorm,
};

pub(super) struct Mixtral;

/// Its own keys.
#[derive(Deserialize)]
struct Keys {
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
    sliding_window: Option<usize>,
}

impl FamilySpec for Mixtral {
    fn model_types(&self) -> &'static [&'static str] {
        &["mixtral"]
    }

    fn wrapper_types(&self) -> &'static [&'static str] {
        &[]
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            max_position_embeddings: 131072,
            rms_norm_eps: 1e-5,
            rope_theta: 1_000_000.0,
        }
    }

    fn size_limits(&self) -> &'static [(&'static str, usize)] {
        &[
            ("sliding_window", MAX_CONTEXT),
            ("num_experts", 1 << 16),
            ("num_local_experts", 1 << 16),
        ]
    }

    fn read(
        &self,
        config: &Value,
        common: &Common,
        p: &mut Problems,
    ) -> Result<FamilyParts, Vec<String>> {
        let own: Keys = keys(config)?;
        // Mixtral's attention has no biases and no q/k norm, whatever the config says.
        let (attention, rope_dim) = gqa(
            common,
            p,
            Gqa {
                qk_norm: QkNorm::None,
                bias: false,
                sliding_window: own.sliding_window,
            },
        );
        let intermediate = p.require(common.keys.intermediate_size, "intermediate_size");
        let moe = MoeConfig {
            num_experts: own.num_local_experts.or(own.num_experts).unwrap_or(8),
            top_k: common.keys.num_experts_per_tok.unwrap_or(2),
            expert_intermediate_size: intermediate,
            shared_intermediate_size: 0,
            gating: GatingConfig::Softmax { renormalize: true },
            weight_input: false,
            shared_expert_gate: false,
            activation: ExpertActivation::Silu,
        };
        Ok(FamilyParts {
            attention,
            rope_dim,
            moe,
            moe_layers: vec![true; common.num_layers],
            intermediate_size: intermediate,
            linear_attention: None,
            centered_norms: false,
        })
    }

    fn mlp_prefix(&self, layer: usize) -> String {
        format!("model.layers.{layer}.block_sparse_moe")
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
        None
    }

    fn tool_call_formats(&self) -> &'static [ToolCallFormat] {
        &[ToolCallFormat::Mistral]
    }
}
