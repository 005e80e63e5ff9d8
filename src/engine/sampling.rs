//! Choosing the next token from logits. In vLLM's order: logit bias, the `min_tokens` mask,
//! penalties (repetition over prompt and output, presence and frequency over the output),
//! then greedy at temperature 0, else temperature, min-p, top-k and nucleus (top-p) sampling
//! from a seeded generator, so a seed reproduces a run.

use std::collections::{HashMap, HashSet};

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};

use super::grammar::Constraint;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 picks the most likely token.
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probabilities sum to at least this.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 keeps all.
    pub min_p: f32,
    /// Subtracted from the logit of every token the output already holds.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the output already holds it.
    pub frequency_penalty: f32,
    /// Divides positive (multiplies negative) logits of tokens in the prompt or the output;
    /// 1 changes nothing.
    pub repetition_penalty: f32,
    /// Added to the logits of these tokens before anything else.
    pub logit_bias: Vec<(u32, f32)>,
    /// The tokens that end generation cannot be drawn before this many tokens.
    pub min_tokens: usize,
    /// Tokens that end generation, besides the model's end-of-sequence tokens.
    pub stop_token_ids: Vec<u32>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            seed: 0,
        }
    }
}

/// Largest `|bias|` in `logit_bias`, as OpenAI's API.
pub const MAX_LOGIT_BIAS: f32 = 100.0;
/// Largest `|presence_penalty|` and `|frequency_penalty|`, as OpenAI's API.
pub const MAX_PENALTY: f32 = 2.0;
/// Most `stop_token_ids`: each generated token is checked against all of them.
pub const MAX_STOP_TOKEN_IDS: usize = 256;

/// A sampling parameter out of its range: `param` names it as the request does.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidSampling {
    pub param: &'static str,
    pub message: String,
}

impl SamplingParams {
    /// Rejects values no sampler can honour, naming the parameter and its range.
    /// `vocab_size` bounds the token ids given.
    pub fn validate(&self, vocab_size: usize) -> Result<(), InvalidSampling> {
        let bad = |param: &'static str, message: String| Err(InvalidSampling { param, message });
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(
                "temperature",
                format!("temperature must be 0 or more, not {}", self.temperature),
            );
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(
                "top_p",
                format!("top_p must be in (0, 1], not {}", self.top_p),
            );
        }
        if !(self.min_p.is_finite() && (0.0..=1.0).contains(&self.min_p)) {
            return bad(
                "min_p",
                format!("min_p must be in [0, 1], not {}", self.min_p),
            );
        }
        for (param, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(value.is_finite() && value.abs() <= MAX_PENALTY) {
                return bad(
                    param,
                    format!("{param} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], not {value}"),
                );
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(
                "repetition_penalty",
                format!(
                    "repetition_penalty must be more than 0 (1 changes nothing), not {}",
                    self.repetition_penalty
                ),
            );
        }
        for &(token, bias) in &self.logit_bias {
            if token as usize >= vocab_size {
                return bad(
                    "logit_bias",
                    format!(
                        "logit_bias: token id {token} is outside the vocabulary (size {vocab_size})"
                    ),
                );
            }
            if !(bias.is_finite() && bias.abs() <= MAX_LOGIT_BIAS) {
                return bad(
                    "logit_bias",
                    format!(
                        "logit_bias: the bias of token {token} must be in \
                         [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], not {bias}"
                    ),
                );
            }
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return bad(
                "stop_token_ids",
                format!(
                    "stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, not {}",
                    self.stop_token_ids.len()
                ),
            );
        }
        if let Some(&token) = self
            .stop_token_ids
            .iter()
            .find(|&&t| t as usize >= vocab_size)
        {
            return bad(
                "stop_token_ids",
                format!(
                    "stop_token_ids: token id {token} is outside the vocabulary (size {vocab_size})"
                ),
            );
        }
        Ok(())
    }

    fn penalises(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }
}

/// A test's failpoint: with this variable set to a seed, sampling for a request of that
/// seed panics, which is how `tests/server.rs` ends a router's step with a panic to see the
/// node exit with status 70. Read once; unset (as in service), it changes nothing.
const PANIC_SEED_VAR: &str = "MOE_TEST_PANIC_SEED";

fn panics_on_purpose(seed: u64) -> bool {
    static SEED: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| std::env::var(PANIC_SEED_VAR).ok()?.parse().ok()) == Some(seed)
}

/// One sequence's sampler: its parameters, its random stream, and what the penalties need
/// of its history (kept up to date one token at a time, never rescanned).
///
/// The draw for the token at output position `i` is word `i` of the seed's ChaCha8 stream,
/// whatever came before: a generation resumed from its first `i` tokens on another node
/// ([`Sampler::resume`]) draws what it would have drawn.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// How often each token was generated (kept only when a penalty is set).
    generated_counts: HashMap<u32, u32>,
    /// The prompt's distinct tokens (kept only for the repetition penalty).
    prompt_tokens: HashSet<u32>,
    generated: usize,
    /// Tokens that end generation: masked until `min_tokens` have been drawn.
    end_tokens: Vec<u32>,
    /// The grammar the output must match (structured output, forced tool calls), applied
    /// after everything else.
    constraint: Option<Constraint>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let end_tokens = params.stop_token_ids.clone();
        Sampler {
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            params,
            generated_counts: HashMap::new(),
            prompt_tokens: HashSet::new(),
            generated: 0,
            end_tokens,
            constraint: None,
        }
    }

    /// Draws only what `constraint` allows; `end`, the token the grammar ends with, ends
    /// the generation (even with `ignore_eos`: nothing may follow a complete grammar).
    pub fn constrain(&mut self, constraint: Constraint, end: u32) {
        if !self.end_tokens.contains(&end) {
            self.end_tokens.push(end);
        }
        self.constraint = Some(constraint);
    }

    /// The prompt, for the repetition penalty.
    pub fn with_prompt(mut self, prompt: &[u32]) -> Self {
        if self.params.repetition_penalty != 1.0 {
            self.prompt_tokens = prompt.iter().copied().collect();
        }
        self
    }

    /// The model's end-of-sequence tokens, which end generation too (unless `ignore_eos`).
    pub fn end_also_at(&mut self, eos: &[u32]) {
        self.end_tokens.extend_from_slice(eos);
    }

    /// The same parameters with its own random stream (`seed + offset`) and the same
    /// history: choice `offset` of a request with `n` choices.
    pub fn fork(&mut self, offset: u64) -> Self {
        let mut params = self.params.clone();
        params.seed = params.seed.wrapping_add(offset);
        Sampler {
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            params,
            generated_counts: self.generated_counts.clone(),
            prompt_tokens: self.prompt_tokens.clone(),
            generated: self.generated,
            end_tokens: self.end_tokens.clone(),
            constraint: self.constraint.as_mut().map(Constraint::fork),
        }
    }

    /// Takes `tokens` as already generated (a generation resumed after the node running it
    /// failed): the penalties count them, the grammar moves past them, and the next draw is
    /// the one for the position after them.
    pub fn resume(&mut self, tokens: &[u32]) {
        for &token in tokens {
            if let Some(constraint) = &mut self.constraint {
                constraint.advance(token);
            }
            self.generated += 1;
            if self.params.penalises() {
                *self.generated_counts.entry(token).or_default() += 1;
            }
        }
    }

    /// Whether `token` ends the generation.
    pub fn ends_at(&self, token: u32) -> bool {
        self.end_tokens.contains(&token)
    }

    /// Picks the next token and counts it in the history. `logits` are the model's; they
    /// are changed in place by the bias, mask and penalties.
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        if panics_on_purpose(self.params.seed) {
            panic!(
                "{PANIC_SEED_VAR}: sampling with seed {} panics on purpose",
                self.params.seed
            );
        }
        self.process(logits);
        if let Some(constraint) = &mut self.constraint {
            constraint.apply(logits, &self.end_tokens);
        }
        let token = self.choose(logits);
        if let Some(constraint) = &mut self.constraint {
            constraint.advance(token);
        }
        self.generated += 1;
        if self.params.penalises() {
            *self.generated_counts.entry(token).or_default() += 1;
        }
        token
    }

    /// Logit bias, the `min_tokens` mask and the penalties, in vLLM's order.
    fn process(&self, logits: &mut [f32]) {
        for &(token, bias) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(token as usize) {
                *l += bias;
            }
        }
        if self.generated < self.params.min_tokens {
            for &token in &self.end_tokens {
                if let Some(l) = logits.get_mut(token as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let seen = self.prompt_tokens.iter().chain(
                self.generated_counts
                    .keys()
                    .filter(|t| !self.prompt_tokens.contains(t)),
            );
            for &token in seen {
                if let Some(l) = logits.get_mut(token as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&token, &count) in &self.generated_counts {
                if let Some(l) = logits.get_mut(token as usize) {
                    *l -= p.frequency_penalty * count as f32 + p.presence_penalty;
                }
            }
        }
    }

    fn choose(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if p.temperature <= 0.0 || !max.is_finite() {
            return argmax(logits);
        }
        let mut candidates: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l - max) / p.temperature).exp()))
            .filter(|c| c.1 > 0.0)
            .collect();
        let total: f32 = candidates.iter().map(|c| c.1).sum();
        if p.min_p > 0.0 {
            // The most likely token has weight exp(0) = 1.
            candidates.retain(|c| c.1 >= p.min_p);
        }
        let by_weight = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < candidates.len() {
            candidates.select_nth_unstable_by(p.top_k - 1, by_weight);
            candidates.truncate(p.top_k);
        }
        candidates.sort_by(by_weight);
        // Top-p over what min-p and top-k kept, renormalised (as vLLM).
        let kept_total: f32 = if p.min_p > 0.0 || p.top_k > 0 {
            candidates.iter().map(|c| c.1).sum()
        } else {
            total
        };
        let mut kept = 0.0;
        let mut keep = candidates.len();
        for (i, (_, w)) in candidates.iter().enumerate() {
            kept += w / kept_total;
            if kept >= p.top_p {
                keep = i + 1;
                break;
            }
        }
        candidates.truncate(keep);
        let mass: f32 = candidates.iter().map(|c| c.1).sum();
        // 24 random bits give a uniform float in [0, 1); one 32-bit word per position.
        self.rng.set_word_pos(self.generated as u128);
        let mut draw = (self.rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32 * mass;
        for &(token, w) in &candidates {
            if draw < w {
                return token;
            }
            draw -= w;
        }
        candidates.last().map_or(0, |c| c.0)
    }
}

/// Index of the largest logit; the first on ties, as `torch.argmax`.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(params: SamplingParams) -> Sampler {
        Sampler::new(params)
    }

    fn draws(params: &SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
        let mut s = sampler(params.clone());
        (0..n).map(|_| s.sample(&mut logits.to_vec())).collect()
    }

    #[test]
    fn temperature_zero_is_greedy() {
        let mut s = sampler(SamplingParams::default());
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_p_limits_choice() {
        let logits = [2.0, 1.9, 0.0, -5.0];
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.6,
            seed: 7,
            ..Default::default()
        };
        let a = draws(&params, &logits, 200);
        assert_eq!(a, draws(&params, &logits, 200));
        // p(0) ≈ 0.47 and p(1) ≈ 0.43: top-p 0.6 keeps exactly those two.
        assert!(a.iter().all(|&t| t <= 1), "{a:?}");
        assert!(a.contains(&0) && a.contains(&1));
    }

    /// Reproducible is not enough: the seed must change the draws, and the temperature
    /// must give each token its softmax(logits / T) share.
    #[test]
    fn seed_and_temperature_change_what_is_drawn() {
        let logits = [1.0f32, 0.0, -1.0];
        let params = |temperature: f32, seed: u64| SamplingParams {
            temperature,
            seed,
            ..Default::default()
        };
        assert_ne!(
            draws(&params(1.0, 7), &logits, 64),
            draws(&params(1.0, 8), &logits, 64),
            "the seed changes nothing"
        );
        for temperature in [0.25f32, 1.0, 4.0] {
            let n = 20_000;
            let got = draws(&params(temperature, 3), &logits, n);
            let weights: Vec<f32> = logits.iter().map(|l| (l / temperature).exp()).collect();
            let total: f32 = weights.iter().sum();
            for (token, weight) in weights.iter().enumerate() {
                let share = got.iter().filter(|&&t| t as usize == token).count() as f32 / n as f32;
                let expected = weight / total;
                assert!(
                    (share - expected).abs() < 0.015,
                    "T = {temperature}: token {token} drawn {share}, softmax gives {expected}"
                );
            }
        }
    }

    #[test]
    fn top_k_and_min_p_keep_only_the_likely_tokens() {
        let logits = [3.0f32, 2.5, 2.0, 0.0, -1.0];
        let hot = |top_k, min_p| SamplingParams {
            temperature: 5.0,
            top_k,
            min_p,
            seed: 1,
            ..Default::default()
        };
        let got = draws(&hot(2, 0.0), &logits, 2000);
        assert!(got.iter().all(|&t| t <= 1), "top_k 2 drew {got:?}");
        assert!(got.contains(&0) && got.contains(&1));
        assert_eq!(
            draws(&hot(1, 0.0), &logits, 50),
            vec![0; 50],
            "top_k 1 is greedy"
        );
        // At T = 5 the weights relative to the best are 1, 0.90, 0.82, 0.55, 0.45.
        let got = draws(&hot(0, 0.8), &logits, 2000);
        assert!(got.iter().all(|&t| t <= 2), "min_p 0.8 drew {got:?}");
        assert!(got.contains(&2));
    }

    #[test]
    fn logit_bias_and_min_tokens_decide_the_token() {
        let logits = [5.0f32, 1.0, 0.0, 4.0];
        let params = SamplingParams {
            logit_bias: vec![(2, 100.0)],
            ..Default::default()
        };
        assert_eq!(draws(&params, &logits, 1), vec![2]);
        let params = SamplingParams {
            logit_bias: vec![(0, -100.0)],
            ..Default::default()
        };
        assert_eq!(draws(&params, &logits, 1), vec![3]);

        // Token 0 ends generation: masked for the first two tokens only.
        let params = SamplingParams {
            min_tokens: 2,
            stop_token_ids: vec![0],
            ..Default::default()
        };
        assert_eq!(draws(&params, &logits, 3), vec![3, 3, 0]);
        let mut eos = Sampler::new(SamplingParams {
            min_tokens: 1,
            ..Default::default()
        });
        eos.end_also_at(&[0]);
        assert!(eos.ends_at(0) && !eos.ends_at(3));
        assert_eq!(eos.sample(&mut logits.to_vec()), 3);
        assert_eq!(eos.sample(&mut logits.to_vec()), 0);
    }

    /// The penalties as vLLM defines them, computed by hand on known logits.
    #[test]
    fn penalties_change_logits_as_defined() {
        let params = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::new(params).with_prompt(&[1, 1, 4]);
        // Generate token 0 twice and token 3 once (biased logits force them).
        for forced in [0u32, 0, 3] {
            let mut l = vec![0.0; 6];
            l[forced as usize] = 1000.0;
            assert_eq!(s.sample(&mut l), forced);
        }
        let mut logits = vec![2.0f32, 2.0, -2.0, 2.0, 2.0, 2.0];
        s.process(&mut logits);
        // Token 0: output twice → 2/2 - 0.25·2 - 0.5. Token 1: prompt only → 2/2.
        // Token 2: never seen. Token 3: output once → 2/2 - 0.25 - 0.5. Token 4: prompt →
        // 2/2. Token 5: never seen.
        assert_eq!(logits, vec![0.0, 1.0, -2.0, 0.25, 1.0, 2.0]);
        let mut negative = vec![-2.0f32; 6];
        s.process(&mut negative);
        // A negative logit is multiplied by the repetition penalty.
        assert_eq!(negative[1], -4.0);
        assert_eq!(negative[0], -4.0 - 0.5 - 0.5);
        assert_eq!(negative[2], -2.0);
    }

    #[test]
    fn forks_draw_their_own_reproducible_streams() {
        let logits = [1.0f32, 0.9, 0.8, 0.7];
        let mut base = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 11,
            ..Default::default()
        });
        let run = |mut s: Sampler| {
            (0..32)
                .map(|_| s.sample(&mut logits.to_vec()))
                .collect::<Vec<_>>()
        };
        let first = run(base.fork(1));
        assert_eq!(first, run(base.fork(1)));
        assert_ne!(first, run(base.fork(2)));
        assert_eq!(run(base.fork(0)), run(base.fork(0)));
    }

    #[test]
    fn out_of_range_values_name_their_parameter() {
        let check = |params: SamplingParams| params.validate(10).unwrap_err().param;
        let base = SamplingParams::default;
        assert_eq!(
            check(SamplingParams {
                min_p: 1.5,
                ..base()
            }),
            "min_p"
        );
        assert_eq!(
            check(SamplingParams {
                presence_penalty: -2.5,
                ..base()
            }),
            "presence_penalty"
        );
        assert_eq!(
            check(SamplingParams {
                frequency_penalty: f32::NAN,
                ..base()
            }),
            "frequency_penalty"
        );
        assert_eq!(
            check(SamplingParams {
                repetition_penalty: 0.0,
                ..base()
            }),
            "repetition_penalty"
        );
        assert_eq!(
            check(SamplingParams {
                logit_bias: vec![(3, 101.0)],
                ..base()
            }),
            "logit_bias"
        );
        assert_eq!(
            check(SamplingParams {
                logit_bias: vec![(10, 1.0)],
                ..base()
            }),
            "logit_bias"
        );
        assert_eq!(
            check(SamplingParams {
                stop_token_ids: vec![10],
                ..base()
            }),
            "stop_token_ids"
        );
        assert!(base().validate(10).is_ok());
    }
}
