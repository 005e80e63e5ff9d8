//! MiniMax-M2, M2.5 and M2.7 (`minimax_m2`, MiniMaxM2ForCausalLM): GQA with an RMSNorm over
//! each row's whole query and key projection (`qk_norm_type: per_layer`, one weight per value
//! rather than one per head dimension), rope over the first `rotary_dim` values of each head;
//! every layer MoE under `block_sparse_moe` with Mixtral's `w1`/`w3`/`w2` expert names and
//! DeepSeek's sigmoid gate without groups: the choice biased by
//! `block_sparse_moe.e_score_correction_bias`, the chosen scores renormalised, no scaling, no
//! shared expert (`use_routing_bias: false` is read as the bias's absence from the
//! checkpoint). The expert width is `intermediate_size` (there are no dense layers).
//! Published in FP8 128×128 blocks (`quantization_config.fmt` "float8_e4m3fn"); the
//! multi-token-prediction modules (`use_mtp`, `num_mtp_modules`) are not read.

use serde::Deserialize;
use serde_json::Value;

use super::{
    Common, Defaults, ExpertNames, FamilyParts, FamilySpec, Gqa, ToolCallFormat, gqa, keys,
};
use crate::model::config::parts::{ExpertActivation, GatingConfig, MoeConfig, Problems, QkNorm};

pub(super) struct MiniMaxM2;

/// Its own keys.
#[derive(Deserialize)]
struct Keys {
    num_local_experts: Option<usize>,
    /// Rotated values per head (published configs); transformers 5 writes
    /// `rope_parameters.partial_rotary_factor` instead.
    rotary_dim: Option<usize>,
    use_qk_norm: Option<bool>,
    qk_norm_type: Option<String>,
    scoring_func: Option<String>,
    shared_intermediate_size: Option<usize>,
    sliding_window: Option<usize>,
}

impl FamilySpec for MiniMaxM2 {
    fn model_types(&self) -> &'static [&'static str] {
        &["minimax_m2"]
    }

    fn wrapper_types(&self) -> &'static [&'static str] {
        &[]
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            max_position_embeddings: 196608,
            rms_norm_eps: 1e-6,
            rope_theta: 5_000_000.0,
        }
    }

    fn size_limits(&self) -> &'static [(&'static str, usize)] {
        &[
            ("num_local_experts", 1 << 16),
            ("rotary_dim", 1 << 12),
            ("shared_intermediate_size", 1 << 18),
        ]
    }

    fn read(
        &self,
        config: &Value,
        common: &Common,
        p: &mut Problems,
    ) -> Result<FamilyParts, Vec<String>> {
        let own: Keys = keys(config)?;
        let qk_norm = match (own.use_qk_norm, own.qk_norm_type.as_deref()) {
            (Some(false), _) => QkNorm::None,
            (_, None | Some("per_layer")) => QkNorm::PerLayer,
            (_, Some("per_head")) => QkNorm::PerHead,
            (_, Some(other)) => {
                p.0.push(format!(
                    "unknown qk_norm_type `{other}`: minimax_m2 norms q and k `per_layer` \
                     (over the whole projection) or `per_head`"
                ));
                QkNorm::None
            }
        };
        p.check(own.sliding_window.is_none(), || {
            "sliding_window: minimax_m2 is served with full attention only".into()
        });
        let (attention, head_dim) = gqa(
            common,
            p,
            Gqa {
                qk_norm,
                bias: false,
                sliding_window: None,
            },
        );
        let rope_dim = rotated_dim(&own, common, head_dim, p);
        if let Some(f) = &own.scoring_func {
            p.check(f == "sigmoid", || {
                format!("unsupported scoring_func `{f}`: minimax_m2 gating is sigmoid")
            });
        }
        p.check(own.shared_intermediate_size.unwrap_or(0) == 0, || {
            "shared_intermediate_size: minimax_m2 with a shared expert is not supported".into()
        });
        let intermediate = p.require(common.keys.intermediate_size, "intermediate_size");
        let moe = MoeConfig {
            num_experts: p.require(own.num_local_experts, "num_local_experts"),
            top_k: common.keys.num_experts_per_tok.unwrap_or(8),
            expert_intermediate_size: intermediate,
            shared_intermediate_size: 0,
            // MiniMaxM2TopKRouter: sigmoid, top-k of the biased scores, the unbiased scores of
            // the chosen renormalised; one group is no group.
            gating: GatingConfig::SigmoidGrouped {
                n_group: 1,
                topk_group: 1,
                normalize: true,
                routed_scaling_factor: 1.0,
            },
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
        Some("e_score_correction_bias")
    }

    fn tool_call_formats(&self) -> &'static [ToolCallFormat] {
        &[ToolCallFormat::MiniMax]
    }
}

/// Rotated values per head: `rotary_dim` as published, else `head_dim` times
/// `rope_parameters.partial_rotary_factor` as transformers 5 writes it, else all of it.
fn rotated_dim(own: &Keys, common: &Common, head_dim: usize, p: &mut Problems) -> usize {
    let factor = [&common.keys.rope_parameters, &common.keys.rope_scaling]
        .into_iter()
        .find_map(|params| params.as_ref()?.get("partial_rotary_factor")?.as_f64());
    let rope_dim = match (own.rotary_dim, factor) {
        (Some(dim), _) => dim,
        (None, Some(f)) if f > 0.0 && f <= 1.0 => (head_dim as f64 * f) as usize,
        (None, Some(f)) => {
            p.0.push(format!(
                "partial_rotary_factor ({f}) must be greater than 0 and at most 1"
            ));
            head_dim
        }
        (None, None) => head_dim,
    };
    p.check(
        rope_dim > 0 && rope_dim <= head_dim && rope_dim.is_multiple_of(2),
        || format!("rotary_dim ({rope_dim}) must be even, greater than 0 and at most head_dim ({head_dim})"),
    );
    rope_dim.min(head_dim)
}
