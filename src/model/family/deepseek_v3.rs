//! DeepSeek-V3 (`deepseek_v3`) and Kimi K2 (`kimi_k2`, the same architecture), and Kimi K2.5
//! (`kimi_k25`, a multimodal wrapper whose `text_config` is one of them): multi-head latent
//! attention, sigmoid gating biased by `e_score_correction_bias` and limited to the best
//! `topk_group` of `n_group` groups, shared experts, dense MLPs in the first
//! `first_k_dense_replace` layers.

use serde::Deserialize;
use serde_json::Value;

use super::{Common, Defaults, ExpertNames, FamilyParts, FamilySpec, ToolCallFormat, keys};
use crate::model::config::{AttentionConfig, GatingConfig, MAX_LAYERS, MoeConfig, Problems};

pub(super) struct DeepseekV3;

/// Its own keys.
#[derive(Deserialize)]
struct Keys {
    n_routed_experts: Option<usize>,
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
        let (attention, rope_dim) = mla(&own, common, p);
        let (moe, moe_layers) = experts(&own, common, p);
        Ok(FamilyParts {
            attention,
            rope_dim,
            moe,
            moe_layers,
            intermediate_size: common.keys.intermediate_size.unwrap_or(18432),
        })
    }

    fn mlp_prefix(&self, layer: usize) -> String {
        format!("model.layers.{layer}.mlp")
    }

    fn expert_names(&self) -> ExpertNames {
        ExpertNames::PROJ
    }

    fn gate_correction_bias(&self) -> bool {
        true
    }

    fn tool_call_formats(&self) -> &'static [ToolCallFormat] {
        &[ToolCallFormat::KimiK2, ToolCallFormat::DeepseekV3]
    }
}

/// Multi-head latent attention; its rotary width is `qk_rope_head_dim`.
fn mla(own: &Keys, common: &Common, p: &mut Problems) -> (AttentionConfig, usize) {
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
    };
    (attention, qk_rope_head_dim)
}

/// Routed and shared experts, the group-limited sigmoid gate, and which layers are MoE.
fn experts(own: &Keys, common: &Common, p: &mut Problems) -> (MoeConfig, Vec<bool>) {
    let num_experts = p.require(own.n_routed_experts, "n_routed_experts");
    let expert_intermediate = p.require(common.keys.moe_intermediate_size, "moe_intermediate_size");
    let first_dense = own.first_k_dense_replace.unwrap_or(3);
    let n_group = own.n_group.unwrap_or(8);
    let topk_group = own.topk_group.unwrap_or(4);
    if let Some(f) = &own.scoring_func {
        p.check(f == "sigmoid", || {
            format!("unsupported scoring_func `{f}`: deepseek_v3 gating is sigmoid")
        });
    }
    if let Some(m) = &own.topk_method {
        p.check(m == "noaux_tc", || {
            format!("unsupported topk_method `{m}`: only noaux_tc is supported")
        });
    }
    p.check(
        n_group > 0 && num_experts.is_multiple_of(n_group.max(1)),
        || format!("n_routed_experts ({num_experts}) must be a multiple of n_group ({n_group})"),
    );
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
        top_k: common.keys.num_experts_per_tok.unwrap_or(8),
        expert_intermediate_size: expert_intermediate,
        shared_intermediate_size: expert_intermediate * own.n_shared_experts.unwrap_or(1),
        gating: GatingConfig::SigmoidGrouped {
            n_group,
            topk_group,
            normalize: common.keys.norm_topk_prob.unwrap_or(true),
            routed_scaling_factor: own.routed_scaling_factor.unwrap_or(2.5) as f32,
        },
    };
    let moe_layers = (0..common.num_layers).map(|l| l >= first_dense).collect();
    (moe, moe_layers)
}
