//! GLM-5 (`glm_moe_dsa`, GlmMoeDsaForCausalLM): MLA with DeepSeek Sparse Attention's
//! lightning indexer (as DeepSeek-V3.2, `super::deepseek_v32`, but its rope turns
//! interleaved pairs), the grouped sigmoid gate with a routing bias, a shared expert and dense
//! first layers. Layers may share an indexer: `indexer_types` (or `index_topk_pattern`, or
//! `index_topk_freq` with `index_skip_topk_offset`) marks each `full` (its own indexer and
//! keys) or `shared` (the choice of the last full layer), as transformers'
//! `GlmMoeDsaConfig` derives it.

use serde::Deserialize;
use serde_json::Value;

use super::deepseek_v32::{INDEX_SIZE_LIMITS, IndexDefaults, mlp_layer_types, sparse_mla};
use super::{
    Common, Defaults, ExpertNames, FamilyParts, FamilySpec, GroupedDefaults, GroupedKeys,
    ToolCallFormat, grouped_sigmoid_experts, keys,
};
use crate::model::config::parts::{MAX_LAYERS, Problems};

pub(super) struct GlmMoeDsa;

/// Which layers run their own indexer.
#[derive(Deserialize)]
struct SharingKeys {
    indexer_types: Option<Vec<String>>,
    /// A string of `F` and `S`, or a list of `full` and `shared`.
    index_topk_pattern: Option<Value>,
    index_topk_freq: Option<usize>,
    index_skip_topk_offset: Option<usize>,
}

impl FamilySpec for GlmMoeDsa {
    fn model_types(&self) -> &'static [&'static str] {
        &["glm_moe_dsa"]
    }

    fn wrapper_types(&self) -> &'static [&'static str] {
        &[]
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            max_position_embeddings: 202_752,
            rms_norm_eps: 1e-5,
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
        let sharing: SharingKeys = keys(config)?;
        let own = own_indexers(&sharing, common.num_layers, p);
        let defaults = IndexDefaults {
            n_heads: 32,
            q_lora_rank: 2048,
            qk_nope_head_dim: 192,
            v_head_dim: 256,
        };
        let (attention, rope_dim) = sparse_mla(config, common, defaults, (own, true), p)?;
        let gate: GroupedKeys = keys(config)?;
        let (moe, moe_layers) = grouped_sigmoid_experts(
            "glm_moe_dsa",
            &gate,
            GroupedDefaults {
                first_k_dense_replace: 3,
                n_group: 1,
                topk_group: 1,
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
            intermediate_size: common.keys.intermediate_size.unwrap_or(12288),
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

/// DeepSeek-V3's size keys and the indexer's.
const SIZE_LIMITS: [(&str, usize); 14] = [
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
    ("index_topk_freq", MAX_LAYERS),
    INDEX_SIZE_LIMITS[0],
    INDEX_SIZE_LIMITS[1],
    INDEX_SIZE_LIMITS[2],
];

/// Per layer: whether it runs its own indexer (`full`) or reuses the last one's (`shared`).
fn own_indexers(keys: &SharingKeys, layers: usize, p: &mut Problems) -> Vec<bool> {
    let listed: Option<Vec<String>> = match (&keys.indexer_types, &keys.index_topk_pattern) {
        (Some(types), _) => Some(types.clone()),
        (None, Some(Value::String(pattern))) => Some(
            pattern
                .chars()
                .map(|c| match c {
                    'F' => "full".to_string(),
                    'S' => "shared".to_string(),
                    other => other.to_string(),
                })
                .collect(),
        ),
        (None, Some(Value::Array(items))) => Some(
            items
                .iter()
                .map(|v| v.as_str().unwrap_or("?").to_string())
                .collect(),
        ),
        (None, Some(Value::Null) | None) => None,
        (None, Some(other)) => {
            p.0.push(format!(
                "`index_topk_pattern` must be a string of F and S or a list, not {other}"
            ));
            None
        }
    };
    let Some(types) = listed else {
        let freq = keys.index_topk_freq.unwrap_or(1).max(1);
        let offset = keys.index_skip_topk_offset.unwrap_or(2);
        return (0..layers)
            .map(|l| (l + 1).saturating_sub(offset).is_multiple_of(freq))
            .collect();
    };
    p.check(types.len() == layers, || {
        format!(
            "indexer_types has {} entries for {layers} layers",
            types.len()
        )
    });
    for t in &types {
        p.check(matches!(t.as_str(), "full" | "shared"), || {
            format!("indexer_types: unknown `{t}` (full or shared; F or S in a pattern)")
        });
    }
    (0..layers)
        .map(|l| types.get(l).is_none_or(|t| t != "shared"))
        .collect()
}
