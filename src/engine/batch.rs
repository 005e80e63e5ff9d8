//! Continuous batching as plain state: requests wait in a bounded queue, join the running
//! batch at step boundaries, prefill their prompts in chunks that share a per-step token
//! budget with the decoding sequences, and leave when they finish or their client goes away.
//! The router actor feeds this state and runs the steps it plans.

use std::collections::VecDeque;

use super::generate::FinishReason;
use super::kv_cache::KvCache;
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
}

/// What happened to a sequence in a step, as its client sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum SequenceEvent {
    /// A generated token.
    Token(u32),
    /// No more tokens will come.
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// The step failed (e.g. no live device held a needed expert); the sequence is dropped.
    Failed(String),
}

/// The waiting queue is at its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the server is at capacity: {waiting} requests are already waiting")]
pub struct QueueFull {
    pub waiting: usize,
}

/// A request to generate, with `sink` receiving its events.
pub struct Sequence<S> {
    prompt: Vec<u32>,
    prefilled: usize,
    /// The last sampled token, fed in the next step.
    pending: u32,
    generated: usize,
    max_tokens: usize,
    stop_at_eos: bool,
    sampler: Sampler,
    cache: KvCache,
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
            prompt,
            prefilled: 0,
            pending: 0,
            generated: 0,
            max_tokens,
            stop_at_eos,
            sampler: Sampler::new(sampling),
            cache,
            sink,
        }
    }

    fn decoding(&self) -> bool {
        self.prefilled == self.prompt.len()
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
        }
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

    /// Admits waiting sequences into free places and plans the next step: one token for
    /// every decoding sequence first (their latency is what users feel between tokens), then
    /// prompt chunks in arrival order while the step's token budget lasts. Returns the step's
    /// inputs, empty when there is nothing to do.
    pub fn plan_step(&mut self) -> Vec<SequenceStep<'_>> {
        while self.running.len() < self.limits.max_sequences {
            match self.waiting.pop_front() {
                Some(s) => self.running.push(s),
                None => break,
            }
        }
        self.planned.clear();
        let mut budget = self.limits.max_tokens_per_step;
        for (i, s) in self.running.iter().enumerate() {
            if s.decoding() && budget > 0 {
                self.planned.push((i, 1));
                budget -= 1;
            }
        }
        let decoding = self.planned.len();
        for (i, s) in self.running.iter().enumerate() {
            if !s.decoding() && budget > 0 {
                let chunk = (s.prompt.len() - s.prefilled)
                    .min(budget)
                    .min(self.limits.prefill_chunk);
                self.planned.push((i, chunk));
                budget -= chunk;
            }
        }
        self.planned_prompt_tokens = self.limits.max_tokens_per_step - budget - decoding;
        self.planned.sort_unstable();
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
                ..
            } = s;
            let tokens = if *prefilled < prompt.len() {
                &prompt[*prefilled..*prefilled + tokens]
            } else {
                std::slice::from_ref(&*pending)
            };
            steps.push(SequenceStep { cache, tokens });
        }
        steps
    }

    /// Takes the planned step's logits (in plan order), samples, and reports each event
    /// through `emit`; sequences that finish, or whose `emit` returns false (client gone),
    /// leave the batch.
    pub fn complete_step(
        &mut self,
        logits: Vec<Vec<f32>>,
        mut emit: impl FnMut(&mut S, SequenceEvent) -> bool,
    ) {
        let mut leaving = Vec::new();
        for (&(i, tokens), logits) in self.planned.iter().zip(logits) {
            let s = &mut self.running[i];
            if !s.decoding() {
                s.prefilled += tokens;
                if !s.decoding() {
                    continue;
                }
            }
            let token = s.sampler.sample(&logits);
            s.pending = token;
            s.generated += 1;
            let mut open = emit(&mut s.sink, SequenceEvent::Token(token));
            let reason = if s.stop_at_eos && self.eos_token_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if s.generated >= s.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                let finished = SequenceEvent::Finished {
                    reason,
                    prompt_tokens: s.prompt.len(),
                    completion_tokens: s.generated,
                };
                emit(&mut s.sink, finished);
                open = false;
            }
            if !open {
                leaving.push(i);
            }
        }
        self.planned.clear();
        for i in leaving.into_iter().rev() {
            self.running.swap_remove(i);
        }
    }

    /// The planned step failed: every sequence in it is told why and leaves (their caches
    /// were left as before the step).
    pub fn fail_step(&mut self, error: &EngineError, mut emit: impl FnMut(&mut S, SequenceEvent)) {
        let mut failed: Vec<usize> = self.planned.drain(..).map(|(i, _)| i).collect();
        failed.sort_unstable();
        for i in failed.into_iter().rev() {
            let mut s = self.running.swap_remove(i);
            emit(&mut s.sink, SequenceEvent::Failed(error.to_string()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;

    fn config() -> ModelConfig {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe");
        ModelConfig::load(&dir).unwrap()
    }

    fn limits() -> BatchLimits {
        BatchLimits {
            max_sequences: 2,
            max_tokens_per_step: 6,
            max_waiting: 2,
            prefill_chunk: 4,
        }
    }

    fn sequence(cfg: &ModelConfig, prompt_len: usize, max_tokens: usize, id: u32) -> Sequence<u32> {
        Sequence::new(
            (0..prompt_len as u32).collect(),
            max_tokens,
            SamplingParams::default(),
            true,
            KvCache::new(cfg),
            id,
        )
    }

    /// Logits whose argmax is `token`.
    fn logits_for(token: u32) -> Vec<f32> {
        let mut l = vec![0.0; 16];
        l[token as usize] = 1.0;
        l
    }

    fn plan(b: &mut Batcher<u32>) -> Vec<usize> {
        b.plan_step().iter().map(|s| s.tokens.len()).collect()
    }

    #[test]
    fn bounded_queue_refuses_beyond_max_waiting() {
        let cfg = config();
        let mut b = Batcher::new(limits(), vec![]);
        assert!(b.submit(sequence(&cfg, 3, 1, 0)).is_ok());
        assert!(b.submit(sequence(&cfg, 3, 1, 1)).is_ok());
        assert_eq!(
            b.submit(sequence(&cfg, 3, 1, 2)),
            Err(QueueFull { waiting: 2 })
        );
        assert_eq!(b.waiting(), 2);
    }

    #[test]
    fn decode_first_then_prompt_chunks_within_budget() {
        let cfg = config();
        let mut b = Batcher::new(limits(), vec![15]);
        b.submit(sequence(&cfg, 10, 3, 0)).unwrap();
        b.submit(sequence(&cfg, 3, 3, 1)).unwrap();
        // Both prefill: 4 (chunk limit) + 2 (what the budget leaves).
        assert_eq!(plan(&mut b), vec![4, 2]);
        b.complete_step(vec![logits_for(1), logits_for(1)], |_, _| true);
        // Sequence 0 has 6 prompt tokens left, sequence 1 has 1: still prefilling.
        assert_eq!(plan(&mut b), vec![4, 1]);
        let mut events = Vec::new();
        b.complete_step(vec![logits_for(1), logits_for(7)], |id, e| {
            events.push((*id, e));
            true
        });
        assert_eq!(events, vec![(1, SequenceEvent::Token(7))]);
        // Sequence 1 decodes (1 token, first in budget), sequence 0 finishes its prompt (2).
        assert_eq!(plan(&mut b), vec![2, 1]);
        assert_eq!(b.planned_prompt_tokens(), 2);
        events.clear();
        b.complete_step(vec![logits_for(5), logits_for(15)], |id, e| {
            events.push((*id, e));
            true
        });
        assert_eq!(
            events,
            vec![
                (0, SequenceEvent::Token(5)),
                (1, SequenceEvent::Token(15)),
                (
                    1,
                    SequenceEvent::Finished {
                        reason: FinishReason::Stop,
                        prompt_tokens: 3,
                        completion_tokens: 2
                    }
                ),
            ]
        );
        assert_eq!(b.running(), 1);
    }

    #[test]
    fn closed_sinks_and_max_tokens_end_sequences() {
        let cfg = config();
        let mut b = Batcher::new(limits(), vec![]);
        b.submit(sequence(&cfg, 1, 1, 0)).unwrap();
        b.submit(sequence(&cfg, 1, 5, 1)).unwrap();
        assert_eq!(plan(&mut b), vec![1, 1]);
        let mut finished = Vec::new();
        // Sequence 1's client is gone: emit returns false for it.
        b.complete_step(vec![logits_for(2), logits_for(2)], |id, e| {
            if matches!(e, SequenceEvent::Finished { .. }) {
                finished.push(*id);
            }
            *id == 0
        });
        assert_eq!(finished, vec![0]);
        assert!(!b.has_work());

        b.submit(sequence(&cfg, 2, 5, 3)).unwrap();
        assert_eq!(b.retain(|id| *id != 3), 1);
        assert!(!b.has_work());
    }
}
