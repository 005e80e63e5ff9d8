//! DeepSeek-V4's gate, operation for operation as transformers' `DeepseekV4TopKRouter` and
//! `DeepseekV4HashRouter`: scores `sqrt(softplus(logit))` (or `sigmoid`), experts chosen by the
//! top-k of the scores plus the routing bias, or by the token's row of `tid2eid` on the first
//! layers; the chosen scores divided by their sum (plus 1e-20) and times
//! `routed_scaling_factor`.

use crate::moe::Routing;

/// torch's `softplus` (beta 1, threshold 20: linear above it).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// The gate's score of one logit.
pub fn score(logit: f32, sqrt_softplus: bool) -> f32 {
    if sqrt_softplus {
        softplus(logit).sqrt()
    } else {
        1.0 / (1.0 + (-logit).exp())
    }
}

/// Where each row's experts come from.
pub enum Choice<'a> {
    /// The top-k of score plus bias (`e_score_correction_bias`, published `gate.bias`).
    Scores { bias: Option<&'a [f32]> },
    /// Row `r`'s experts are `table[tokens[r] * top_k..][..top_k]` (`tid2eid`, checked at
    /// load to name experts that exist).
    Hash { table: &'a [u32], tokens: &'a [u32] },
}

/// Routes `[rows, num_experts]` gate logits. Experts `avoid` marks (none live: the node
/// reroutes) are not chosen where others can be: the top-k is taken among the rest, and a hash
/// layer's avoided expert gives its place to the best-scoring expert (score plus bias) the
/// row does not have yet. The weights are the chosen experts' scores over their sum, as ever.
pub fn route(
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    sqrt_softplus: bool,
    scaling: f32,
    choice: &Choice,
    avoid: Option<&[bool]>,
) -> Routing {
    let avoided = |e: u32| avoid.is_some_and(|a| a.get(e as usize).copied().unwrap_or(false));
    let rows = logits.len() / num_experts.max(1);
    let mut experts = Vec::with_capacity(rows * top_k);
    let mut weights = Vec::with_capacity(rows * top_k);
    for (r, row) in logits.chunks_exact(num_experts.max(1)).enumerate() {
        let scores: Vec<f32> = row.iter().map(|&l| score(l, sqrt_softplus)).collect();
        let bias = match choice {
            Choice::Scores { bias } => *bias,
            Choice::Hash { .. } => None,
        };
        let biased: Vec<f32> = match bias {
            Some(bias) => scores.iter().zip(bias).map(|(s, b)| s + b).collect(),
            None => scores.clone(),
        };
        // Every expert, highest first (equal values keep the lower index first, as
        // torch.topk does on the CPU), the avoided ones last.
        let ranked = || {
            let mut order: Vec<u32> = (0..num_experts as u32).collect();
            order.sort_by(|&a, &b| {
                avoided(a)
                    .cmp(&avoided(b))
                    .then_with(|| biased[b as usize].total_cmp(&biased[a as usize]))
            });
            order
        };
        let chosen: Vec<u32> = match choice {
            Choice::Hash { table, tokens } => {
                let token = tokens.get(r).copied().unwrap_or(0) as usize;
                let mut row = table
                    .get(token * top_k..(token + 1) * top_k)
                    .map(<[u32]>::to_vec)
                    .unwrap_or_else(|| vec![0; top_k]);
                if row.iter().any(|&e| avoided(e)) {
                    let held = row.clone();
                    let mut spare = ranked().into_iter().filter(|e| !held.contains(e));
                    for e in row.iter_mut().filter(|e| avoided(**e)) {
                        match spare.next() {
                            Some(other) if !avoided(other) => *e = other,
                            _ => break,
                        }
                    }
                }
                row
            }
            Choice::Scores { .. } => {
                let mut order = ranked();
                order.truncate(top_k);
                order
            }
        };
        let picked: Vec<f32> = chosen
            .iter()
            .map(|&e| scores.get(e as usize).copied().unwrap_or(0.0))
            .collect();
        let sum: f32 = picked.iter().sum::<f32>() + 1e-20;
        experts.extend_from_slice(&chosen);
        weights.extend(picked.iter().map(|w| w / sum * scaling));
    }
    Routing {
        top_k,
        experts,
        weights,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sqrt(softplus(x)) by hand: softplus(0) = ln 2, softplus(1) = ln(1 + e),
    /// softplus(-1) = ln(1 + 1/e), softplus(30) = 30 (torch's linear region).
    #[test]
    fn sqrtsoftplus_scores_by_hand() {
        let close = |a: f32, b: f64| assert!((a as f64 - b).abs() < 1e-6, "{a} vs {b}");
        close(score(0.0, true), 2f64.ln().sqrt());
        close(score(1.0, true), (1.0 + 1f64.exp()).ln().sqrt());
        close(score(-1.0, true), (1.0 + (-1f64).exp()).ln().sqrt());
        close(score(30.0, true), 30f64.sqrt());
        close(score(0.0, false), 0.5);
    }

    /// Logits 0, 1, -1, 2 over 4 experts, top 2: experts 3 and 1 (scores sqrt(ln(1 + e^2))
    /// = 1.4584, sqrt(ln(1 + e)) = 1.1460), weights each over their sum, times 1.5; a bias
    /// on expert 0 of 2 moves the choice to it, but the weights stay the unbiased scores.
    #[test]
    fn sqrtsoftplus_top_k_weights_by_hand() {
        let logits = [0.0, 1.0, -1.0, 2.0];
        let r = route(
            &logits,
            4,
            2,
            true,
            1.5,
            &Choice::Scores { bias: None },
            None,
        );
        assert_eq!(r.experts, vec![3, 1]);
        let (s3, s1) = (1.458_399_f32, 1.145_976_3f32);
        let sum = s3 + s1;
        assert!(
            (r.weights[0] - 1.5 * s3 / sum).abs() < 1e-5,
            "{:?}",
            r.weights
        );
        assert!(
            (r.weights[1] - 1.5 * s1 / sum).abs() < 1e-5,
            "{:?}",
            r.weights
        );
        let bias = [2.0, 0.0, 0.0, 0.0];
        let r = route(
            &logits,
            4,
            2,
            true,
            1.0,
            &Choice::Scores { bias: Some(&bias) },
            None,
        );
        assert_eq!(r.experts, vec![0, 3]);
        let s0 = 2f32.ln().sqrt();
        assert!(
            (r.weights[0] - s0 / (s0 + s3)).abs() < 1e-5,
            "{:?}",
            r.weights
        );
    }

    /// Hash layers take the token's row of the table whatever the scores say, weighted by
    /// those experts' scores.
    #[test]
    fn hash_routing_follows_the_token_table() {
        // 3 tokens, top 2: token 0 -> (2, 0), token 1 -> (1, 3), token 2 -> (3, 2).
        let table = [2, 0, 1, 3, 3, 2];
        let logits = [0.0, 1.0, -1.0, 2.0, 0.0, 1.0, -1.0, 2.0];
        let tokens = [2, 0];
        let r = route(
            &logits,
            4,
            2,
            true,
            1.0,
            &Choice::Hash {
                table: &table,
                tokens: &tokens,
            },
            None,
        );
        assert_eq!(r.experts, vec![3, 2, 2, 0]);
        let (s3, s2) = (1.458_399_f32, (1.0 + (-1f32).exp()).ln().sqrt());
        assert!(
            (r.weights[0] - s3 / (s3 + s2)).abs() < 1e-5,
            "{:?}",
            r.weights
        );
        assert!((r.weights[0] + r.weights[1] - 1.0).abs() < 1e-6);
    }

    /// Avoided experts are not chosen where others can be: the top-k is taken among the
    /// rest (weights over the chosen), and a hash row's avoided expert gives its place to the
    /// best-scoring expert the row does not have.
    #[test]
    fn avoided_experts_give_their_place_to_the_next_best() {
        let logits = [0.0, 1.0, -1.0, 2.0];
        // Expert 3 (the best) avoided: 1 and 0 instead.
        let avoid = [false, false, false, true];
        let r = route(
            &logits,
            4,
            2,
            true,
            1.0,
            &Choice::Scores { bias: None },
            Some(&avoid),
        );
        assert_eq!(r.experts, vec![1, 0]);
        let (s1, s0) = (1.145_976_3f32, 2f32.ln().sqrt());
        assert!(
            (r.weights[0] - s1 / (s1 + s0)).abs() < 1e-5,
            "{:?}",
            r.weights
        );
        // A hash row (3, 2) with 3 avoided: 3's place goes to 1, the best it lacks.
        let table = [3, 2];
        let hash = Choice::Hash {
            table: &table,
            tokens: &[0],
        };
        let r = route(&logits, 4, 2, true, 1.0, &hash, Some(&avoid));
        assert_eq!(r.experts, vec![1, 2]);
        // Nothing avoided, or a mask of another size: as without one.
        let none = [false; 4];
        for avoid in [Some(&none[..]), None] {
            assert_eq!(
                route(&logits, 4, 2, true, 1.0, &hash, avoid).experts,
                vec![3, 2]
            );
        }
        // Every expert avoided: the choice stands (the executor then says none is live).
        let all = [true; 4];
        let r = route(
            &logits,
            4,
            2,
            true,
            1.0,
            &Choice::Scores { bias: None },
            Some(&all),
        );
        assert_eq!(r.experts, vec![3, 1]);
        assert_eq!(
            route(&logits, 4, 2, true, 1.0, &hash, Some(&all)).experts,
            vec![3, 2]
        );
    }
}
