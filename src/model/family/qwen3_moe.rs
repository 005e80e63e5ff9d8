//! Qwen3-MoE (`qwen3_moe`, Qwen3MoeForCausalLM): GQA with an RMSNorm over each q and k head
//! before rope, softmax gating (top-k weights renormalised where `norm_topk_prob`), no shared
//! expert; MoE every `decoder_sparse_step` layers except `mlp_only_layers`.

use serde::Deserialize;
use serde_json::Value;

use super::{
    Common, Defaults, ExpertNames, FamilyParts, FamilySpec, Gqa, ToolCallFormat, gqa, keys,
};
use crate::model::config::parts::{
    ExpertActivation, GatingConfig, MAX_CONTEXT, MAX_LAYERS, MoeConfig, Problems, QkNorm,
};

pub(super) struct Qwen3Moe;

/// Its own keys.
#[derive(Deserialize)]
struct Keys {
    /// Published configs say `num_experts`; transformers 5 writes `num_local_experts`.
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
}

impl FamilySpec for Qwen3Moe {
    fn model_types(&self) -> &'static [&'static str] {
        &["qwen3_moe"]
    }

    fn wrapper_types(&self) -> &'static [&'static str] {
        &[]
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
            ("sliding_window", MAX_CONTEXT),
            ("num_experts", 1 << 16),
            ("num_local_experts", 1 << 16),
            ("decoder_sparse_step", MAX_LAYERS),
        ]
    }

    fn read(
        &self,
        config: &Value,
        common: &Common,
        p: &mut Problems,
    ) -> Result<FamilyParts, Vec<String>> {
        let own: Keys = keys(config)?;
        let sliding_window = match own.use_sliding_window {
            Some(true) => Some(own.sliding_window.unwrap_or(4096)),
            _ => None,
        };
        let (attention, rope_dim) = gqa(
            common,
            p,
            Gqa {
                qk_norm: QkNorm::PerHead,
                bias: common.keys.attention_bias == Some(true),
                sliding_window,
            },
        );
        let num_experts = p.require(own.num_experts.or(own.num_local_experts), "num_experts");
        let step = own.decoder_sparse_step.unwrap_or(1);
        p.check(step > 0, || {
            "`decoder_sparse_step` must be at least 1".into()
        });
        let mlp_only = own.mlp_only_layers.unwrap_or_default();
        let moe_layers = (0..common.num_layers)
            .map(|l| !mlp_only.contains(&l) && num_experts > 0 && (l + 1) % step.max(1) == 0)
            .collect();
        let moe = MoeConfig {
            num_experts,
            top_k: common.keys.num_experts_per_tok.unwrap_or(8),
            expert_intermediate_size: p
                .require(common.keys.moe_intermediate_size, "moe_intermediate_size"),
            shared_intermediate_size: 0,
            gating: GatingConfig::Softmax {
                renormalize: common.keys.norm_topk_prob.unwrap_or(false),
            },
            weight_input: false,
            shared_expert_gate: false,
            activation: ExpertActivation::Silu,
        };
        Ok(FamilyParts {
            attention,
            rope_dim,
            moe,
            moe_layers,
            intermediate_size: common.keys.intermediate_size.unwrap_or(0),
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
        None
    }

    fn tool_call_formats(&self) -> &'static [ToolCallFormat] {
        &[ToolCallFormat::Hermes]
    }
}
