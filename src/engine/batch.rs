//! Continuous batching as plain state: requests wait in a bounded queue, join the running
//! batch at step boundaries, prefill their prompts in chunks that share a per-step token
//! budget with the decoding sequences, and leave when they finish or their client goes away.
//! The router actor feeds this state and runs the steps it plans.

use std::collections::VecDeque;
use std::sync::Arc;

use super::generate::FinishReason;
use super::grammar::Constraint;
use super::kv_cache::KvCache;
use super::logprobs::{TokenLogprobs, token_logprobs};
use super::prefix::PrefixStore;
use super::sampling::{Sampler, SamplingParams};
use super::{EngineError, SequenceStep};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Sequences stepped together at most.
    pub max_sequences: usize,
    /// Tokens in one step at most.
    pub max_tokens_per_step: usize,
    /// Sequences waiting for a place at most.
    pub max_waiting: usize,
    /// Prompt tokens one sequence prefills in one step at most.
    pub prefill_chunk: usize,
    /// The KV cache memory the running sequences may hold; `None`: no bound.
    pub kv: Option<KvBudget>,
    /// Prompt prefixes kept for reuse at most ([`PrefixStore`]); 0: none.
    pub prefix_cache_entries: usize,
}

/// KV cache memory counted in blocks of `block_tokens` positions of one sequence (what a
/// paged cache allocates). A sequence is admitted when its prompt fits beside what the
/// running ones hold; when a step would need more blocks than are free, the most recently
/// arrived running sequences are preempted: their caches are released and they wait to
/// recompute them (prompt and tokens so far, in one prefill), then go on. A sequence alone
/// is never preempted: the node serves a context no longer than the whole budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBudget {
    pub block_tokens: usize,
    pub blocks: usize,
    /// Blocks every running sequence holds whatever its length: the states of a hybrid
    /// model's linear-attention layers ([`KvBudget::with_state`]); 0 for other models.
    pub state_blocks: usize,
}

impl KvBudget {
    /// Positions of one sequence per block as the node counts them.
    pub const BLOCK_TOKENS: usize = 16;

    /// What `bytes` hold of caches taking `bytes_per_position` each: whole blocks of
    /// [`Self::BLOCK_TOKENS`] positions, at least one.
    pub fn of_bytes(bytes: usize, bytes_per_position: usize) -> Self {
        let block_bytes = bytes_per_position * Self::BLOCK_TOKENS;
        KvBudget {
            block_tokens: Self::BLOCK_TOKENS,
            blocks: (bytes / block_bytes.max(1)).max(1),
            state_blocks: 0,
        }
    }

    /// This budget where each sequence also holds `state_bytes` however long it is (a hybrid
    /// model's linear-attention states), counted in whole blocks of positions of
    /// `bytes_per_position`: a sequence is admitted only where its state fits too.
    pub fn with_state(mut self, state_bytes: usize, bytes_per_position: usize) -> Self {
        let block_bytes = (bytes_per_position * self.block_tokens).max(1);
        self.state_blocks = state_bytes.div_ceil(block_bytes);
        self
    }

    /// The bytes taken for caches on a GPU with `free` bytes left after loading: 90% of
    /// them, allocated once as the GPU's pool of blocks (caches there are paged).
    pub fn gpu_share(free: u64) -> u64 {
        free / 10 * 9
    }

    /// Blocks holding `positions` positions of one sequence, and its state.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_tokens.max(1)) + self.state_blocks
    }

    /// Positions one sequence can hold with the whole budget (beside its state).
    pub fn max_positions(&self) -> usize {
        self.blocks.saturating_sub(self.state_blocks) * self.block_tokens
    }
}

/// What happened to a sequence in a step, as its client sees it. `choice` tells the
/// choices of a request with `n` > 1 apart (0 to n - 1).
#[derive(Debug, Clone, PartialEq)]
pub enum SequenceEvent {
    /// The log probabilities of the prompt's tokens after the first, once it is prefilled
    /// (when asked for with [`Sequence::with_prompt_logprobs`]).
    PromptLogprobs(Vec<TokenLogprobs>),
    /// A generated token, with its log probabilities when asked for.
    Token {
        choice: usize,
        token: u32,
        logprobs: Option<TokenLogprobs>,
    },
    /// No more tokens will come for this choice.
    Finished {
        choice: usize,
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// The step failed (e.g. no live replica held a needed expert); the sequence is dropped.
    /// The error is carried as it is to where the response's status is chosen.
    Failed(StepFailure),
    /// From here on this choice is degraded: a step routed some of its tokens around an
    /// expert with no live replica (`on_expert_unavailable = "reroute"`). Said once, before
    /// the first token it affects.
    Degraded { choice: usize },
}

/// Why a step failed, shared by every sequence it ended, carried as the engine's error to
/// where a response's status is chosen. Two are equal when they say the same.
#[derive(Debug, Clone)]
pub struct StepFailure(pub Arc<EngineError>);

impl std::ops::Deref for StepFailure {
    type Target = EngineError;

    fn deref(&self) -> &EngineError {
        &self.0
    }
}

impl std::fmt::Display for StepFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl PartialEq for StepFailure {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

/// The waiting queue is at its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the server is at capacity: {waiting} requests are already waiting")]
pub struct QueueFull {
    pub waiting: usize,
}

/// A request to generate, with `sink` receiving its events.
pub struct Sequence<S> {
    /// The tokens to prefill: the prompt, and after a preemption the tokens generated
    /// before it too.
    prompt: Vec<u32>,
    /// The client's prompt length (what usage reports).
    prompt_tokens: usize,
    /// Every token generated so far, and how many of them `prompt` already holds.
    generated_tokens: Vec<u32>,
    replayed: usize,
    /// Arrival order: preemption takes the latest first.
    arrival: u64,
    prefilled: usize,
    /// The last sampled token, fed in the next step.
    pending: u32,
    generated: usize,
    max_tokens: usize,
    stop_at_eos: bool,
    sampler: Sampler,
    cache: KvCache,
    /// Which choice of its request this sequence generates.
    choice: usize,
    /// Choices still to be forked off this one when its prompt is prefilled (1: none).
    choices: usize,
    /// Alternatives per generated token's log probabilities; `None`: no log probabilities.
    logprobs: Option<usize>,
    /// Alternatives per prompt token's log probabilities; `None`: none computed.
    prompt_logprobs: Option<usize>,
    /// The prompt's log probabilities computed so far (prefill may take several steps).
    prompt_logprobs_so_far: Vec<TokenLogprobs>,
    /// A step routed some of its rows around an expert with no live replica; and whether
    /// that was said ([`SequenceEvent::Degraded`]).
    degraded: bool,
    degraded_said: bool,
    pub sink: S,
}

impl<S> Sequence<S> {
    pub fn new(
        prompt: Vec<u32>,
        max_tokens: usize,
        sampling: SamplingParams,
        stop_at_eos: bool,
        cache: KvCache,
        sink: S,
    ) -> Self {
        Sequence {
            sampler: Sampler::new(sampling).with_prompt(&prompt),
            prompt_tokens: prompt.len(),
            prompt,
            generated_tokens: Vec::new(),
            replayed: 0,
            arrival: 0,
            prefilled: 0,
            pending: 0,
            generated: 0,
            max_tokens,
            stop_at_eos,
            cache,
            choice: 0,
            choices: 1,
            logprobs: None,
            prompt_logprobs: None,
            prompt_logprobs_so_far: Vec::new(),
            degraded: false,
            degraded_said: false,
            sink,
        }
    }

    /// `n` choices from one prompt: prefilled once, then its cache is copied into each.
    /// Choice `i` samples with seed `seed + i`. Needs `n` places in the batch.
    pub fn with_choices(mut self, n: usize) -> Self {
        self.choices = n.max(1);
        self
    }

    /// Draws only what `constraint` allows (see [`Sampler::constrain`]).
    pub fn with_constraint(mut self, constraint: Option<(Constraint, u32)>) -> Self {
        if let Some((constraint, end)) = constraint {
            self.sampler.constrain(constraint, end);
        }
        self
    }

    /// Goes on from `tokens`, generated before (on a node that failed, or one that handed
    /// the generation off while draining): they are prefilled after the prompt, count
    /// against `max_tokens` and in usage, and the sampler draws as if it had drawn them.
    /// Applied after [`Sequence::with_constraint`], so that the grammar moves past them.
    pub fn resuming(mut self, tokens: Vec<u32>) -> Self {
        self.sampler.resume(&tokens);
        self.prompt.extend_from_slice(&tokens);
        self.generated = tokens.len();
        self.replayed = tokens.len();
        self.generated_tokens = tokens;
        self
    }

    /// Log probabilities of each generated token, with `top` alternatives.
    pub fn with_logprobs(mut self, top: Option<usize>) -> Self {
        self.logprobs = top;
        self
    }

    /// Log probabilities of the prompt's tokens (all but the first), with `top`
    /// alternatives: the prompt's prefill computes the logits of every position.
    pub fn with_prompt_logprobs(mut self, top: Option<usize>) -> Self {
        self.prompt_logprobs = top;
        self
    }

    fn decoding(&self) -> bool {
        self.prefilled == self.prompt.len()
    }

    /// Places in the batch: a prompt still to fork into `n` choices holds `n`.
    fn places(&self) -> usize {
        self.choices
    }

    /// Choice `choice` of this prefilled sequence, in a copy of its cache.
    fn fork(&mut self, choice: usize, cache: KvCache) -> Self
    where
        S: Clone,
    {
        Sequence {
            prompt: self.prompt.clone(),
            prompt_tokens: self.prompt_tokens,
            generated_tokens: self.generated_tokens.clone(),
            replayed: self.replayed,
            arrival: self.arrival,
            prefilled: self.prefilled,
            pending: self.pending,
            generated: self.generated,
            max_tokens: self.max_tokens,
            stop_at_eos: self.stop_at_eos,
            sampler: self.sampler.fork(choice as u64),
            cache,
            choice,
            choices: 1,
            logprobs: self.logprobs,
            prompt_logprobs: None,
            prompt_logprobs_so_far: Vec::new(),
            degraded: self.degraded,
            degraded_said: false,
            sink: self.sink.clone(),
        }
    }

    /// Samples this sequence's next token from `logits` (the model's, for its last
    /// position) and reports it; returns whether the sequence stays in the batch.
    fn take_token(
        &mut self,
        mut logits: Vec<f32>,
        emit: &mut impl FnMut(&mut S, SequenceEvent) -> bool,
    ) -> bool {
        if self.max_tokens == 0 {
            // Only the prompt was wanted (its log probabilities).
            return self.finish(FinishReason::Length, emit);
        }
        // Log probabilities of the raw logits, before the sampler changes them.
        let logprobs = self.logprobs.map(|top| (top, logits.clone()));
        let token = self.sampler.sample(&mut logits);
        let logprobs = logprobs.map(|(top, raw)| token_logprobs(&raw, token, top));
        self.pending = token;
        self.generated += 1;
        self.generated_tokens.push(token);
        if self.degraded && !self.degraded_said {
            self.degraded_said = true;
            let degraded = SequenceEvent::Degraded {
                choice: self.choice,
            };
            if !emit(&mut self.sink, degraded) {
                return false;
            }
        }
        let event = SequenceEvent::Token {
            choice: self.choice,
            token,
            logprobs,
        };
        let open = emit(&mut self.sink, event);
        if self.sampler.ends_at(token) {
            self.finish(FinishReason::Stop, emit)
        } else if self.generated >= self.max_tokens {
            self.finish(FinishReason::Length, emit)
        } else {
            open
        }
    }

    /// Reports the end of this choice; it leaves the batch.
    fn finish(
        &mut self,
        reason: FinishReason,
        emit: &mut impl FnMut(&mut S, SequenceEvent) -> bool,
    ) -> bool {
        let finished = SequenceEvent::Finished {
            choice: self.choice,
            reason,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.generated,
        };
        emit(&mut self.sink, finished);
        false
    }

    /// Releases the cache; the sequence will prefill its prompt and the tokens generated so
    /// far (the last one included: its logits give the next token) before it goes on.
    fn preempt(&mut self) {
        if self.decoding() {
            // Its prompt's log probabilities were reported.
            self.prompt_logprobs = None;
        }
        self.prompt_logprobs_so_far.clear();
        self.prompt
            .extend_from_slice(&self.generated_tokens[self.replayed..]);
        self.replayed = self.generated_tokens.len();
        self.prefilled = 0;
        self.cache.release();
    }

    /// Log probabilities of the prompt tokens that `rows` (the logits of the `rows.len() /
    /// vocab` positions just prefilled from `self.prefilled`) predict.
    fn note_prompt_logprobs(&mut self, rows: &[f32], positions: usize, top: usize) {
        if positions == 0 || !rows.len().is_multiple_of(positions) {
            return;
        }
        let vocab = rows.len() / positions;
        for (j, row) in rows.chunks_exact(vocab).enumerate() {
            if let Some(&next) = self.prompt.get(self.prefilled + j + 1) {
                self.prompt_logprobs_so_far
                    .push(token_logprobs(row, next, top));
            }
        }
    }
}

pub struct Batcher<S> {
    limits: BatchLimits,
    eos_token_ids: Vec<u32>,
    waiting: VecDeque<Sequence<S>>,
    running: Vec<Sequence<S>>,
    /// `(index into running, tokens)` of the step planned by [`Batcher::plan_step`].
    planned: Vec<(usize, usize)>,
    planned_prompt_tokens: usize,
    arrivals: u64,
    preemptions: u64,
    prefixes: PrefixStore,
}

impl<S> Batcher<S> {
    pub fn new(limits: BatchLimits, eos_token_ids: Vec<u32>) -> Self {
        Batcher {
            limits,
            eos_token_ids,
            waiting: VecDeque::new(),
            running: Vec::new(),
            planned: Vec::new(),
            planned_prompt_tokens: 0,
            arrivals: 0,
            preemptions: 0,
            prefixes: PrefixStore::new(
                limits.kv.map_or(16, |kv| kv.block_tokens),
                limits.prefix_cache_entries,
            )
            .with_state_blocks(limits.kv.map_or(0, |kv| kv.state_blocks)),
        }
    }

    /// Prompts that started from a kept prefix, and the prompt tokens that saved.
    pub fn prefix_hits(&self) -> (u64, u64) {
        self.prefixes.hits()
    }

    /// Sequences preempted so far (their caches released, to be recomputed).
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// KV cache blocks the running sequences hold, and the budget's total (`None`: no
    /// budget).
    pub fn kv_blocks(&self) -> Option<(usize, usize)> {
        self.limits.kv.map(|kv| (self.blocks_held(&kv), kv.blocks))
    }

    /// KV cache blocks the kept prompt prefixes hold (within the budget).
    pub fn prefix_blocks(&self) -> usize {
        self.prefixes.blocks()
    }

    /// The keys of the kept prefixes' first blocks ([`super::prefix::leading_block_key`]).
    pub fn prefix_keys(&self) -> Vec<u64> {
        self.prefixes.leading_block_keys()
    }

    fn blocks_held(&self, kv: &KvBudget) -> usize {
        self.counted(|_, s| kv.blocks_for(s.cache.len()))
    }

    /// `blocks(s)` summed over the running sequences, less what their caches share with
    /// other caches (a shared block counts once over all its holders; rounded down, so
    /// never less than the pool holds).
    fn counted(&self, mut blocks: impl FnMut(usize, &Sequence<S>) -> usize) -> usize {
        let whole: usize = self
            .running
            .iter()
            .enumerate()
            .map(|(i, s)| blocks(i, s))
            .sum();
        let shared: f64 = self.running.iter().map(|s| s.cache.shared_blocks()).sum();
        whole - shared.floor() as usize
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Prompt tokens in the step last planned.
    pub fn planned_prompt_tokens(&self) -> usize {
        self.planned_prompt_tokens
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Queues a sequence, or refuses it when the queue is full.
    pub fn submit(&mut self, sequence: Sequence<S>) -> Result<(), QueueFull> {
        if self.waiting.len() >= self.limits.max_waiting {
            return Err(QueueFull {
                waiting: self.waiting.len(),
            });
        }
        let mut sequence = sequence;
        if sequence.stop_at_eos {
            sequence.sampler.end_also_at(&self.eos_token_ids);
        }
        self.arrivals += 1;
        sequence.arrival = self.arrivals;
        self.waiting.push_back(sequence);
        Ok(())
    }

    /// Drops every sequence, waiting or running, for which `keep` says no (a client that
    /// went away), and returns how many were dropped.
    pub fn retain(&mut self, mut keep: impl FnMut(&S) -> bool) -> usize {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|s| keep(&s.sink));
        self.running.retain(|s| keep(&s.sink));
        before - self.waiting.len() - self.running.len()
    }

    /// Moves waiting sequences into free places (and, with a KV budget, while the blocks
    /// their prompts need fit beside what the running ones hold or will hold once their
    /// prompts are in, one position more each).
    fn admit(&mut self, copy: &mut impl FnMut(&KvCache) -> Result<KvCache, EngineError>) {
        let mut occupied: usize = self.running.iter().map(Sequence::places).sum();
        let reserved = |kv: &KvBudget, s: &Sequence<S>| {
            kv.blocks_for(s.cache.len().max(s.prompt.len()) + 1) * s.places()
        };
        let mut held = self
            .limits
            .kv
            .map_or(0, |kv| self.counted(|_, s| reserved(&kv, s)));
        while let Some(next) = self.waiting.front() {
            // A request with more choices than places still gets in, alone.
            let fits = occupied + next.places() <= self.limits.max_sequences;
            // On a GPU a prompt from a kept prefix shares the prefix's whole blocks.
            let shares = match next.cache.on_gpu() && next.cache.is_empty() {
                true => self.prefixes.reusable_blocks(&next.prompt),
                false => 0,
            };
            let needs = self
                .limits
                .kv
                .map_or(0, |kv| reserved(&kv, next).saturating_sub(shares));
            let room = self
                .limits
                .kv
                .is_none_or(|kv| held + needs + self.prefixes.blocks() <= kv.blocks);
            if fits && !room && self.prefixes.evict_oldest() {
                continue;
            }
            if !(fits && room) && occupied > 0 {
                break;
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            // A prompt whose log probabilities are wanted computes every position.
            if s.cache.is_empty()
                && s.prompt_logprobs.is_none()
                && let Some((cache, positions)) = self.prefixes.reuse(&s.prompt, copy)
            {
                s.cache = cache;
                s.prefilled = positions;
            }
            occupied += s.places();
            held += needs;
            self.running.push(s);
        }
    }

    /// Plans which tokens each running sequence steps: one for every decoding sequence
    /// first, then prompt chunks in arrival order while the step's token budget lasts.
    fn plan_tokens(&mut self) {
        self.planned.clear();
        let mut budget = self.limits.max_tokens_per_step;
        for (i, s) in self.running.iter().enumerate() {
            if s.decoding() && budget > 0 {
                self.planned.push((i, 1));
                budget -= 1;
            }
        }
        let decoding = self.planned.len();
        let mut prefilling: Vec<usize> = (0..self.running.len())
            .filter(|&i| !self.running[i].decoding())
            .collect();
        prefilling.sort_by_key(|&i| self.running[i].arrival);
        for i in prefilling {
            if budget == 0 {
                break;
            }
            let s = &self.running[i];
            let chunk = (s.prompt.len() - s.prefilled)
                .min(budget)
                .min(self.limits.prefill_chunk);
            self.planned.push((i, chunk));
            budget -= chunk;
        }
        self.planned_prompt_tokens = self.limits.max_tokens_per_step - budget - decoding;
        self.planned.sort_unstable();
    }

    /// Blocks the running sequences would hold after the planned step.
    fn step_blocks(&self, kv: &KvBudget) -> usize {
        let mut planned = self.planned.iter().peekable();
        self.counted(|i, s| {
            let tokens = planned.next_if(|(p, _)| *p == i).map_or(0, |&(_, t)| t);
            kv.blocks_for(s.cache.len() + tokens)
        })
    }

    /// Admits waiting sequences into free places (from a copy of a kept prefix's cache when
    /// one matches, made by `copy`) and plans the next step: one token for
    /// every decoding sequence first (their latency is what users feel between tokens), then
    /// prompt chunks in arrival order while the step's token budget lasts. Returns the step's
    /// inputs, empty when there is nothing to do.
    pub fn plan_step(
        &mut self,
        copy: impl FnMut(&KvCache) -> Result<KvCache, EngineError>,
    ) -> Vec<SequenceStep<'_>> {
        self.prepare_step(copy);
        self.planned_steps()
    }

    /// The first half of [`Batcher::plan_step`]: admits, plans the step's tokens, and
    /// preempts what does not fit; [`Batcher::planned_sinks`] then tells whose sequences
    /// the step runs, and [`Batcher::planned_steps`] gives the step.
    pub fn prepare_step(&mut self, mut copy: impl FnMut(&KvCache) -> Result<KvCache, EngineError>) {
        self.admit(&mut copy);
        self.plan_tokens();
        if let Some(kv) = self.limits.kv {
            // Drop kept prefixes, then preempt the latest arrivals, until the step's new
            // blocks fit.
            while self.step_blocks(&kv) + self.prefixes.blocks() > kv.blocks {
                if self.prefixes.evict_oldest() {
                    continue;
                }
                if self.running.len() <= 1 {
                    break;
                }
                let latest = (0..self.running.len())
                    .max_by_key(|&i| self.running[i].arrival)
                    .unwrap_or(0);
                let mut s = self.running.swap_remove(latest);
                s.preempt();
                self.preemptions += 1;
                self.waiting.push_front(s);
                self.plan_tokens();
            }
        }
    }

    /// The sinks of the sequences the prepared step runs, in plan order.
    pub fn planned_sinks(&self) -> impl Iterator<Item = &S> {
        self.planned.iter().map(|&(i, _)| &self.running[i].sink)
    }

    /// The step [`Batcher::prepare_step`] planned.
    pub fn planned_steps(&mut self) -> Vec<SequenceStep<'_>> {
        let mut planned = self.planned.iter().peekable();
        let mut steps = Vec::with_capacity(self.planned.len());
        for (i, s) in self.running.iter_mut().enumerate() {
            let Some(&(_, tokens)) = planned.next_if(|(p, _)| *p == i) else {
                continue;
            };
            let Sequence {
                prompt,
                prefilled,
                pending,
                cache,
                prompt_logprobs,
                ..
            } = s;
            let (tokens, all_logits) = if *prefilled < prompt.len() {
                let chunk = &prompt[*prefilled..*prefilled + tokens];
                (chunk, prompt_logprobs.is_some())
            } else {
                (std::slice::from_ref(&*pending), false)
            };
            steps.push(SequenceStep {
                cache,
                tokens,
                all_logits,
                rerouted: false,
            });
        }
        steps
    }

    /// Takes the planned step's logits (in plan order; every position of a sequence that
    /// asked for all of them), samples, and reports each event through `emit`; sequences
    /// that finish, or whose `emit` returns false (client gone), leave the batch. A prompt
    /// with `n` choices that is now prefilled forks into `n` sequences, each in a copy of its
    /// cache made by `fork_cache`.
    /// Marks the planned sequences whose rows the step routed around an expert with no live
    /// replica (`rerouted[i]` for the step's `i`th sequence, as [`SequenceStep::rerouted`]
    /// says): their answers say they are degraded from then on.
    pub fn mark_rerouted(&mut self, rerouted: &[bool]) {
        for (&(i, _), &r) in self.planned.iter().zip(rerouted) {
            if r {
                self.running[i].degraded = true;
            }
        }
    }

    pub fn complete_step(
        &mut self,
        logits: Vec<Vec<f32>>,
        mut fork_cache: impl FnMut(&KvCache) -> Result<KvCache, EngineError>,
        mut emit: impl FnMut(&mut S, SequenceEvent) -> bool,
    ) where
        S: Clone,
    {
        let mut leaving = Vec::new();
        let mut forked = Vec::new();
        for (&(i, tokens), mut logits) in self.planned.iter().zip(logits) {
            let s = &mut self.running[i];
            if !s.decoding() {
                if let Some(top) = s.prompt_logprobs {
                    s.note_prompt_logprobs(&logits, tokens, top);
                    // The last position's logits choose the first token.
                    let vocab = logits.len() / tokens.max(1);
                    logits.drain(..logits.len() - vocab);
                }
                s.prefilled += tokens;
                if !s.decoding() {
                    continue;
                }
                self.prefixes.keep(&s.prompt, &s.cache, &mut fork_cache);
                if s.prompt_logprobs.is_some() {
                    let prompt = std::mem::take(&mut s.prompt_logprobs_so_far);
                    if !emit(&mut s.sink, SequenceEvent::PromptLogprobs(prompt)) {
                        leaving.push(i);
                        continue;
                    }
                }
                let mut copies = Vec::with_capacity(s.choices - 1);
                for choice in 1..s.choices {
                    match fork_cache(&s.cache) {
                        Ok(cache) => copies.push(s.fork(choice, cache)),
                        Err(e) => {
                            emit(&mut s.sink, SequenceEvent::Failed(StepFailure(Arc::new(e))));
                            break;
                        }
                    }
                }
                if copies.len() + 1 < s.choices {
                    leaving.push(i);
                    continue;
                }
                s.choices = 1;
                for mut copy in copies {
                    if copy.take_token(logits.clone(), &mut emit) {
                        forked.push(copy);
                    }
                }
            }
            if !s.take_token(logits, &mut emit) {
                leaving.push(i);
            }
        }
        self.planned.clear();
        leaving.sort_unstable();
        for i in leaving.into_iter().rev() {
            self.running.swap_remove(i);
        }
        self.running.extend(forked);
    }

    /// The planned step failed: every sequence in it is told why and leaves (their caches
    /// were left as before the step).
    pub fn fail_step(
        &mut self,
        error: Arc<EngineError>,
        mut emit: impl FnMut(&mut S, SequenceEvent),
    ) {
        let mut failed: Vec<usize> = self.planned.drain(..).map(|(i, _)| i).collect();
        failed.sort_unstable();
        for i in failed.into_iter().rev() {
            let mut s = self.running.swap_remove(i);
            emit(
                &mut s.sink,
                SequenceEvent::Failed(StepFailure(error.clone())),
            );
        }
    }
}

#[cfg(test)]
mod tests;
