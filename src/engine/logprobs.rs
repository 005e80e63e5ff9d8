//! Log probabilities for clients: log-softmax of the model's raw logits (before logit bias,
//! penalties and temperature: vLLM's default `logprobs_mode = "raw_logprobs"`), for a chosen
//! token and the most likely ones.

/// Most alternatives a client may ask for per token (`logprobs`, `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The log probability of one token, and of the `top` most likely tokens at its position
/// (most likely first; ties by lower id).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log probability under `logits`, with the `top` most likely tokens.
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let log_total = max + sum.ln() as f32;
    let logprob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&l| l - log_total);
    TokenLogprobs {
        token,
        logprob,
        top: most_likely(logits, top)
            .into_iter()
            .map(|t| (t, logits[t as usize] - log_total))
            .collect(),
    }
}

/// Ids of the `k` largest logits, largest first (lower id first on ties).
fn most_likely(logits: &[f32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    // A running best-k list: O(vocab · k) with k ≤ 20, no vocabulary-sized allocation.
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    for id in 0..logits.len() as u32 {
        if best.len() == k && by_logit(&id, best.last().unwrap_or(&id)) != std::cmp::Ordering::Less
        {
            continue;
        }
        let at = best.partition_point(|b| by_logit(b, &id) == std::cmp::Ordering::Less);
        best.insert(at, id);
        best.truncate(k);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_of_the_token_and_the_most_likely_ones() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let total: f32 = logits.iter().map(|l| l.exp()).sum();
        let got = token_logprobs(&logits, 2, 3);
        assert_eq!(got.token, 2);
        assert!((got.logprob - (2.0 - total.ln())).abs() < 1e-6);
        let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2], "ties go to the lower id");
        assert!((got.top[0].1 - (3.0 - total.ln())).abs() < 1e-6);
        let probability: f32 = logits
            .iter()
            .map(|&l| token_logprobs(&logits, 0, 0).logprob + l - 1.0)
            .map(f32::exp)
            .sum();
        assert!((probability - 1.0).abs() < 1e-5);
        assert!(token_logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(token_logprobs(&logits, 0, 9).top.len(), 5);
    }
}
