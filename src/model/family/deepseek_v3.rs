//! DeepSeek-V3 (`deepseek_v3`) and Kimi K2 (`kimi_k2`, the same architecture), and Kimi K2.5
//! (`kimi_k25`, a multimodal wrapper whose `text_config` is one of them): multi-head latent
//! attention, sigmoid gating biased by `e_score_correction_bias` and limited to the best
//! `topk_group` of `n_group` groups, shared experts, dense MLPs in the first
//! `first_k_dense_replace` layers.

use serde::Deserialize;
use serde_json::Value;

use super::{
    Common, Defaults, ExpertNames, FamilyParts, FamilySpec, GroupedDefaults, GroupedKeys,
    ToolCallFormat, grouped_sigmoid_experts, keys,
};
use crate::model::config::parts::{AttentionConfig, MAX_LAYERS, Problems};

pub(super) struct DeepseekV3;

/// Its own keys (the gate's are [`GroupedKeys`]); DeepSeek-V3.2 and GLM-5 read them too.
#[derive(Deserialize)]
pub(super) struct Keys {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: Option<usize>,
    pub qk_nope_head_dim: Option<usize>,
    pub qk_rope_head_dim: Option<usize>,
    pub v_head_dim: Option<usize>,
    pub rope_interleave: Option<bool>,
}

impl FamilySpec for DeepseekV3 {
    fn model_types(&self) -> &'static [&'static str] {
        &["deepseek_v3", "kimi_k2"]
    }

    fn wrapper_types(&self) -> &'static [&'static str] {
        &["kimi_k25"]
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            max_position_embeddings: 4096,
            rms_norm_eps: 1e-6,
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
            ("q_lora_rank", 1 << 16),
            ("kv_lora_rank", 1 << 16),
            ("qk_nope_head_dim", 1 << 12),
            ("qk_rope_head_dim", 1 << 12),
            ("v_head_dim", 1 << 12),
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
        let (attention, rope_dim) = mla(&own, common, p);
        let (moe, moe_layers) = grouped_sigmoid_experts(
            "deepseek_v3",
            &gate,
            GroupedDefaults {
                first_k_dense_replace: 3,
                n_group: 8,
                topk_group: 4,
                routed_scaling_factor: 2.5,
            },
            common,
            p,
        );
        Ok(FamilyParts {
            attention,
            rope_dim,
            moe,
            moe_layers,
            intermediate_size: common.keys.intermediate_size.unwrap_or(18432),
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
        &[ToolCallFormat::KimiK2, ToolCallFormat::DeepseekV3]
    }
}

/// Multi-head latent attention, without an indexer; its rotary width is `qk_rope_head_dim`.
pub(super) fn mla(own: &Keys, common: &Common, p: &mut Problems) -> (AttentionConfig, usize) {
    let num_heads = common.num_heads;
    let kv_lora_rank = own.kv_lora_rank.unwrap_or(512);
    let qk_nope_head_dim = own.qk_nope_head_dim.unwrap_or(128);
    let qk_rope_head_dim = own.qk_rope_head_dim.unwrap_or(64);
    let v_head_dim = own.v_head_dim.unwrap_or(128);
    for (value, key) in [
        (kv_lora_rank, "kv_lora_rank"),
        (qk_nope_head_dim, "qk_nope_head_dim"),
        (v_head_dim, "v_head_dim"),
        (own.q_lora_rank.unwrap_or(1), "q_lora_rank"),
    ] {
        p.check(value > 0, || format!("`{key}` must be greater than 0"));
    }
    p.check(
        qk_rope_head_dim.is_multiple_of(2) && qk_rope_head_dim > 0,
        || format!("qk_rope_head_dim ({qk_rope_head_dim}) must be even and greater than 0"),
    );
    if let Some(kv_heads) = common.keys.num_key_value_heads {
        p.check(kv_heads == num_heads, || {
            format!(
                "MLA needs num_key_value_heads ({kv_heads}) equal to num_attention_heads ({num_heads})"
            )
        });
    }
    let attention = AttentionConfig::Mla {
        q_lora_rank: own.q_lora_rank,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        interleave: own.rope_interleave.unwrap_or(true),
        bias: common.keys.attention_bias == Some(true),
        indexer: None,
    };
    (attention, qk_rope_head_dim)
}
