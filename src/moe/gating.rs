//! Gate logits to top-k experts and their weights, for each gating variant.
//!
//! Pure functions over `[rows, num_experts]` logits; they follow transformers' routers
//! (`Qwen3MoeTopKRouter`, `MixtralTopKRouter`, `DeepseekV3TopkRouter`) operation for operation.

use crate::compute::cpu::softmax_in_place;
use crate::model::config::GatingConfig;

/// The experts each token goes to and the weight of each, `top_k` entries per token.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Routing {
    pub fn rows(&self) -> usize {
        self.experts.len() / self.top_k.max(1)
    }
}

/// Routes every row of `logits`. `correction_bias` is DeepSeek's `e_score_correction_bias`
/// (it biases the choice, not the weights); ignored by softmax gating.
pub fn route(
    gating: &GatingConfig,
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    correction_bias: Option<&[f32]>,
) -> Routing {
    route_avoiding(gating, logits, num_experts, top_k, correction_bias, None)
}

/// [`route`], never choosing an expert `avoid` marks (it has no live replica) while
/// `top_k` others remain: each token goes to the next-best experts by gate score instead,
/// weighted as the gate weighs them. The output is degraded, not what the model computes.
pub fn route_avoiding(
    gating: &GatingConfig,
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    correction_bias: Option<&[f32]>,
    avoid: Option<&[bool]>,
) -> Routing {
    let avoid = avoid.filter(|a| a.len() == num_experts && a.iter().any(|&x| x));
    // Model validation refuses MoE layers without experts; routing to none is no routing.
    if num_experts == 0 || top_k == 0 {
        return Routing {
            top_k,
            experts: Vec::new(),
            weights: Vec::new(),
        };
    }
    let rows = logits.len() / num_experts;
    let mut experts = Vec::with_capacity(rows * top_k);
    let mut weights = Vec::with_capacity(rows * top_k);
    let mut scratch = vec![0.0f32; num_experts];
    for row in logits.chunks_exact(num_experts) {
        scratch.copy_from_slice(row);
        match *gating {
            GatingConfig::Softmax { renormalize } => softmax_top_k(
                &mut scratch,
                top_k,
                renormalize,
                avoid,
                &mut experts,
                &mut weights,
            ),
            GatingConfig::SigmoidGrouped {
                n_group,
                topk_group,
                normalize,
                routed_scaling_factor,
            } => sigmoid_grouped_top_k(
                &mut scratch,
                correction_bias,
                avoid,
                SigmoidGrouping {
                    n_group,
                    topk_group,
                    top_k,
                    normalize,
                    routed_scaling_factor,
                },
                &mut experts,
                &mut weights,
            ),
        }
    }
    Routing {
        top_k,
        experts,
        weights,
    }
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    let by_value_desc = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    if k < order.len() {
        order.select_nth_unstable_by(k, by_value_desc);
        order.truncate(k);
    }
    order.sort_by(by_value_desc);
    order
}

fn softmax_top_k(
    probs: &mut [f32],
    top_k: usize,
    renormalize: bool,
    avoid: Option<&[bool]>,
    experts: &mut Vec<u32>,
    weights: &mut Vec<f32>,
) {
    softmax_in_place(probs);
    let chosen = match avoid {
        // Probabilities are never negative: an avoided expert ranks below every other.
        Some(avoid) => {
            let choice: Vec<f32> = probs
                .iter()
                .zip(avoid)
                .map(|(&p, &a)| if a { -1.0 } else { p })
                .collect();
            top_k_indices(&choice, top_k)
        }
        None => top_k_indices(probs, top_k),
    };
    let sum: f32 = chosen.iter().map(|&e| probs[e]).sum();
    for e in chosen {
        experts.push(e as u32);
        weights.push(if renormalize {
            probs[e] / sum
        } else {
            probs[e]
        });
    }
}

struct SigmoidGrouping {
    n_group: usize,
    topk_group: usize,
    top_k: usize,
    normalize: bool,
    routed_scaling_factor: f32,
}

fn sigmoid_grouped_top_k(
    scores: &mut [f32],
    correction_bias: Option<&[f32]>,
    avoid: Option<&[bool]>,
    g: SigmoidGrouping,
    experts: &mut Vec<u32>,
    weights: &mut Vec<f32>,
) {
    for s in scores.iter_mut() {
        *s = 1.0 / (1.0 + (-*s).exp());
    }
    let mut choice: Vec<f32> = match correction_bias {
        Some(bias) => scores.iter().zip(bias).map(|(s, b)| s + b).collect(),
        None => scores.to_vec(),
    };
    if let Some(avoid) = avoid {
        for (c, _) in choice.iter_mut().zip(avoid).filter(|(_, a)| **a) {
            *c = f32::NEG_INFINITY;
        }
    }
    let group_size = scores.len() / g.n_group;
    if g.topk_group < g.n_group {
        // A group scores the sum of its two best biased scores.
        let group_scores: Vec<f32> = choice
            .chunks_exact(group_size)
            .map(|group| top_k_indices(group, 2).iter().map(|&i| group[i]).sum())
            .collect();
        let kept = top_k_indices(&group_scores, g.topk_group);
        for (group, values) in choice.chunks_exact_mut(group_size).enumerate() {
            if !kept.contains(&group) {
                values.fill(f32::NEG_INFINITY);
            }
        }
    }
    let chosen = top_k_indices(&choice, g.top_k);
    let sum: f32 = chosen.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20;
    for e in chosen {
        let w = if g.normalize {
            scores[e] / sum
        } else {
            scores[e]
        };
        experts.push(e as u32);
        weights.push(w * g.routed_scaling_factor);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6)
    }

    #[test]
    fn avoided_experts_give_way_to_the_next_best_by_gate_score() {
        let logits: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|v| v.ln()).collect();
        let softmax = GatingConfig::Softmax { renormalize: false };
        let avoid = [false, false, false, true];
        let r = route_avoiding(&softmax, &logits, 4, 2, None, Some(&avoid));
        assert_eq!(r.experts, vec![2, 1]);
        assert!(close(&r.weights, &[0.3, 0.2]), "{:?}", r.weights);
        // Nothing to avoid: the same routing as `route`.
        let none = [false; 4];
        assert_eq!(
            route_avoiding(&softmax, &logits, 4, 2, None, Some(&none)),
            route(&softmax, &logits, 4, 2, None)
        );
        let grouped = GatingConfig::SigmoidGrouped {
            n_group: 2,
            topk_group: 1,
            normalize: true,
            routed_scaling_factor: 1.0,
        };
        // A group scores the sum of its two best: with 3 avoided, group {2, 3} has one
        // expert left and cannot be chosen; group {0, 1} takes the token.
        let logits = [0.0f32, 0.1, 3.0, 4.0];
        let plain = route(&grouped, &logits, 4, 2, None);
        assert_eq!(plain.experts, vec![3, 2]);
        let r = route_avoiding(&grouped, &logits, 4, 2, None, Some(&avoid));
        assert!(!r.experts.contains(&3), "{:?}", r.experts);
        assert_eq!(r.experts, vec![1, 0]);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-5);
    }

    #[test]
    fn softmax_top_k_without_renormalising_keeps_probabilities() {
        // softmax([ln1, ln2, ln3, ln4]) = [0.1, 0.2, 0.3, 0.4]
        let logits: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|v| v.ln()).collect();
        let gating = GatingConfig::Softmax { renormalize: false };
        let r = route(&gating, &logits, 4, 2, None);
        assert_eq!(r.experts, vec![3, 2]);
        assert!(close(&r.weights, &[0.4, 0.3]), "{:?}", r.weights);
    }

    #[test]
    fn softmax_top_k_renormalised_sums_to_one() {
        let logits: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|v| v.ln()).collect();
        let gating = GatingConfig::Softmax { renormalize: true };
        let r = route(&gating, &logits, 4, 2, None);
        assert_eq!(r.experts, vec![3, 2]);
        assert!(
            close(&r.weights, &[4.0 / 7.0, 3.0 / 7.0]),
            "{:?}",
            r.weights
        );
    }

    #[test]
    fn softmax_routes_each_row_independently() {
        let logits = [0.0, 5.0, 0.0, 5.0, 0.0, 0.0];
        let gating = GatingConfig::Softmax { renormalize: true };
        let r = route(&gating, &logits, 3, 1, None);
        assert_eq!(r.rows(), 2);
        assert_eq!(r.experts, vec![1, 0]);
        assert!(close(&r.weights, &[1.0, 1.0]));
    }

    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn sigmoid_bias_changes_choice_but_not_weights() {
        // Scores 0.9, 0.8, 0.2, 0.1; the bias lifts expert 3 above expert 1.
        let logits: Vec<f32> = [0.9, 0.8, 0.2, 0.1].map(logit).to_vec();
        let bias = [0.0, 0.0, 0.0, 0.75];
        let gating = GatingConfig::SigmoidGrouped {
            n_group: 1,
            topk_group: 1,
            normalize: false,
            routed_scaling_factor: 2.0,
        };
        let r = route(&gating, &logits, 4, 2, Some(&bias));
        assert_eq!(r.experts, vec![0, 3]);
        // Weights are the unbiased scores times the scaling factor.
        assert!(close(&r.weights, &[1.8, 0.2]), "{:?}", r.weights);
    }

    #[test]
    fn sigmoid_group_limited_top_k_skips_losing_groups() {
        // Groups of two: {0,1} scores 0.6+0.6, {2,3} 0.95+0.05, {4,5} 0.7+0.7.
        // The best two groups are {4,5} (1.4) and {0,1} (1.2); expert 2 (0.95, the best single
        // score) is in a dropped group and must not be chosen.
        let logits: Vec<f32> = [0.6, 0.6, 0.95, 0.05, 0.7, 0.7].map(logit).to_vec();
        let gating = GatingConfig::SigmoidGrouped {
            n_group: 3,
            topk_group: 2,
            normalize: true,
            routed_scaling_factor: 1.0,
        };
        let r = route(&gating, &logits, 6, 3, None);
        assert_eq!(r.experts, vec![4, 5, 0]);
        let sum = 0.7 + 0.7 + 0.6;
        assert!(
            close(&r.weights, &[0.7 / sum, 0.7 / sum, 0.6 / sum]),
            "{:?}",
            r.weights
        );
    }

    #[test]
    fn sigmoid_normalised_weights_are_scaled() {
        let logits: Vec<f32> = [0.5, 0.5].map(logit).to_vec();
        let gating = GatingConfig::SigmoidGrouped {
            n_group: 1,
            topk_group: 1,
            normalize: true,
            routed_scaling_factor: 2.5,
        };
        let r = route(&gating, &logits, 2, 2, None);
        assert!(close(&r.weights, &[1.25, 1.25]), "{:?}", r.weights);
    }
}
