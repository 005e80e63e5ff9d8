//! The gate functions a router computes, as data: the CPU's (`crate::moe::gating`) and the
//! GPU's (`kernels/moe.cu`'s `gate_topk`) both take one. A model family's config names its
//! gate (`crate::model::config`).

/// How the router turns gate logits into top-k experts and weights.
#[derive(Debug, Clone, PartialEq)]
pub enum GatingConfig {
    /// Softmax over all experts, top-k, optionally renormalised to sum 1.
    Softmax { renormalize: bool },
    /// Sigmoid scores, choice biased by `e_score_correction_bias`, top-k within the best
    /// `topk_group` of `n_group` groups, weights optionally normalised, then scaled.
    SigmoidGrouped {
        n_group: usize,
        topk_group: usize,
        normalize: bool,
        routed_scaling_factor: f32,
    },
}
