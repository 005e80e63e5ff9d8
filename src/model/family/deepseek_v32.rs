//! DeepSeek-V3.2 (`deepseek_v32`, DeepseekV32ForCausalLM): DeepSeek-V3's shape (MLA, sigmoid
//! gating biased by `e_score_correction_bias` over the best `topk_group` of `n_group` groups,
//! shared experts, dense MLPs in the first `first_k_dense_replace` layers) with DeepSeek
//! Sparse Attention: every layer's lightning indexer ([`LightningIndexer`]: `index_n_heads`,
//! `index_head_dim`, `index_topk`; tensors `self_attn.indexer.{wq_b, wk, k_norm,
//! weights_proj}`) picks the positions its MLA attends to. Its rope turns the two halves of
//! the indexer's rotary part, unlike the MLA's interleaved pairs (transformers'
//! `DeepseekV32Indexer`). GLM-5 (`super::glm_moe_dsa`) reads its keys through this file too.

use serde::Deserialize;
use serde_json::Value;

use super::deepseek_v3::{Keys as MlaKeys, mla};
use super::{
    Common, Defaults, ExpertNames, FamilyParts, FamilySpec, GroupedDefaults, GroupedKeys,
    ToolCallFormat, grouped_sigmoid_experts, keys,
};
use crate::model::config::parts::{
    AttentionConfig, LightningIndexer, MAX_CONTEXT, MAX_LAYERS, Problems,
};

pub(super) struct DeepseekV32;

/// The indexer's keys, and the per-layer MLP kinds transformers' configs may list.
#[derive(Deserialize)]
pub(super) struct IndexKeys {
    index_n_heads: Option<usize>,
    index_head_dim: Option<usize>,
    index_topk: Option<usize>,
    mlp_layer_types: Option<Vec<String>>,
}

/// What a family's configs leave out of the indexer's and the MLA's keys.
pub(super) struct IndexDefaults {
    pub n_heads: usize,
    pub q_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub v_head_dim: usize,
}

/// The size keys both families add to DeepSeek-V3's.
pub(super) const INDEX_SIZE_LIMITS: [(&str, usize); 3] = [
    ("index_n_heads", 1 << 10),
    ("index_head_dim", 1 << 12),
    ("index_topk", MAX_CONTEXT),
];

impl FamilySpec for DeepseekV32 {
    fn model_types(&self) -> &'static [&'static str] {
        &["deepseek_v32"]
    }

    fn wrapper_types(&self) -> &'static [&'static str] {
        &[]
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            max_position_embeddings: 163_840,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
        }
    }

    fn size_limits(&self) -> &'static [(&'static str, usize)] {
        &SIZE_LIMITS
    }

    fn read(
        &self,
        config: &Value,
        common: &Common,
        p: &mut Problems,
    ) -> Result<FamilyParts, Vec<String>> {
        let own = vec![true; common.num_layers];
        let defaults = IndexDefaults {
            n_heads: 64,
            q_lora_rank: 1536,
            qk_nope_head_dim: 128,
            v_head_dim: 128,
        };
        let (attention, rope_dim) = sparse_mla(config, common, defaults, (own, false), p)?;
        let gate: GroupedKeys = keys(config)?;
        let (moe, moe_layers) = grouped_sigmoid_experts(
            "deepseek_v32",
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
        let moe_layers = mlp_layer_types(config, moe_layers, p)?;
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
        // V3.2 writes DSML; a fine-tune on V3.1's template writes V3's markers.
        &[ToolCallFormat::DeepseekV32, ToolCallFormat::DeepseekV3]
    }

    fn builtin_chat_template(&self) -> Option<&'static str> {
        Some(include_str!("deepseek_v32/chat_template.jinja"))
    }
}

/// DeepSeek-V3's size keys and the indexer's.
const SIZE_LIMITS: [(&str, usize); 13] = [
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
    INDEX_SIZE_LIMITS[0],
    INDEX_SIZE_LIMITS[1],
    INDEX_SIZE_LIMITS[2],
];

/// MLA with a lightning indexer on the layers `own` marks (the others reuse the last one's
/// choice), its rope over pairs when `rope_interleave`. Every problem goes to `p`.
pub(super) fn sparse_mla(
    config: &Value,
    common: &Common,
    defaults: IndexDefaults,
    (own, rope_interleave): (Vec<bool>, bool),
    p: &mut Problems,
) -> Result<(AttentionConfig, usize), Vec<String>> {
    let mut mla_keys: MlaKeys = keys(config)?;
    let index: IndexKeys = keys(config)?;
    // transformers' defaults where the key is absent; an explicit `null` q_lora_rank stays
    // absent, and is refused below.
    if config.get("q_lora_rank").is_none() {
        mla_keys.q_lora_rank = Some(defaults.q_lora_rank);
    }
    mla_keys.qk_nope_head_dim = mla_keys
        .qk_nope_head_dim
        .or(Some(defaults.qk_nope_head_dim));
    mla_keys.v_head_dim = mla_keys.v_head_dim.or(Some(defaults.v_head_dim));
    let (attention, rope_dim) = mla(&mla_keys, common, p);
    p.check(mla_keys.q_lora_rank.is_some(), || {
        "DeepSeek Sparse Attention needs `q_lora_rank`: the indexer's queries are projected \
         from the low-rank query"
            .into()
    });
    let num_heads = index.index_n_heads.unwrap_or(defaults.n_heads);
    let head_dim = index.index_head_dim.unwrap_or(128);
    let topk = index.index_topk.unwrap_or(2048);
    p.check(topk > 0, || {
        "`index_topk` must be greater than 0: it is how many positions each query attends to".into()
    });
    p.check(num_heads > 0, || {
        "`index_n_heads` must be greater than 0".into()
    });
    p.check(head_dim >= rope_dim && head_dim > 0, || {
        format!(
            "`index_head_dim` ({head_dim}) must be at least qk_rope_head_dim ({rope_dim}): the \
             indexer rotates its first qk_rope_head_dim values"
        )
    });
    p.check(own.first().copied().unwrap_or(true), || {
        "the first layer must run its own indexer (`full`): a shared layer reuses the choice \
         of an earlier one"
            .into()
    });
    let attention = match attention {
        AttentionConfig::Mla {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            interleave,
            bias,
            ..
        } => AttentionConfig::Mla {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            interleave,
            bias,
            indexer: Some(LightningIndexer {
                num_heads,
                head_dim,
                topk,
                rope_interleave,
                own,
            }),
        },
        gqa => gqa,
    };
    Ok((attention, rope_dim))
}

/// `mlp_layer_types` (`dense` or `sparse` per layer) where the config lists them, else the
/// layers from `first_k_dense_replace`.
pub(super) fn mlp_layer_types(
    config: &Value,
    from_first_dense: Vec<bool>,
    p: &mut Problems,
) -> Result<Vec<bool>, Vec<String>> {
    let index: IndexKeys = keys(config)?;
    let Some(types) = index.mlp_layer_types else {
        return Ok(from_first_dense);
    };
    let layers = from_first_dense.len();
    p.check(types.len() == layers, || {
        format!(
            "mlp_layer_types has {} entries for {layers} layers",
            types.len()
        )
    });
    for t in &types {
        p.check(matches!(t.as_str(), "dense" | "sparse"), || {
            format!("mlp_layer_types: unknown `{t}` (dense or sparse)")
        });
    }
    Ok((0..layers)
        .map(|l| types.get(l).is_some_and(|t| t == "sparse"))
        .collect())
}

#[cfg(test)]
mod tests;
