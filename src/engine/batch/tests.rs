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
        kv: None,
        prefix_cache_entries: 0,
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

fn host_fork(cache: &KvCache) -> Result<KvCache, EngineError> {
    cache.host_copy().ok_or(EngineError::ForeignCache)
}

fn token(choice: usize, token: u32) -> SequenceEvent {
    SequenceEvent::Token {
        choice,
        token,
        logprobs: None,
    }
}

fn plan(b: &mut Batcher<u32>) -> Vec<usize> {
    b.plan_step(host_fork)
        .iter()
        .map(|s| s.tokens.len())
        .collect()
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
    b.complete_step(vec![logits_for(1), logits_for(1)], host_fork, |_, _| true);
    // Sequence 0 has 6 prompt tokens left, sequence 1 has 1: still prefilling.
    assert_eq!(plan(&mut b), vec![4, 1]);
    let mut events = Vec::new();
    b.complete_step(vec![logits_for(1), logits_for(7)], host_fork, |id, e| {
        events.push((*id, e));
        true
    });
    assert_eq!(events, vec![(1, token(0, 7))]);
    // Sequence 1 decodes (1 token, first in budget), sequence 0 finishes its prompt (2).
    assert_eq!(plan(&mut b), vec![2, 1]);
    assert_eq!(b.planned_prompt_tokens(), 2);
    events.clear();
    b.complete_step(vec![logits_for(5), logits_for(15)], host_fork, |id, e| {
        events.push((*id, e));
        true
    });
    assert_eq!(
        events,
        vec![
            (0, token(0, 5)),
            (1, token(0, 15)),
            (
                1,
                SequenceEvent::Finished {
                    choice: 0,
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
    b.complete_step(vec![logits_for(2), logits_for(2)], host_fork, |id, e| {
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

/// A prompt with three choices is prefilled once (with every position's logits for its
/// log probabilities), then forks: three sequences, each with its own choice index.
#[test]
fn n_choices_fork_after_one_prefill_and_prompt_logprobs_come_first() {
    let cfg = config();
    let mut b = Batcher::new(limits_for_three(), vec![]);
    let sequence = sequence(&cfg, 3, 2, 0)
        .with_choices(3)
        .with_prompt_logprobs(Some(1));
    b.submit(sequence).unwrap();
    let steps = b.plan_step(host_fork);
    assert_eq!(steps.len(), 1);
    assert!(steps[0].all_logits);
    drop(steps);
    // Three positions' logits: position j predicts prompt token j + 1 (ids 1 and 2).
    let rows: Vec<f32> = [logits_for(1), logits_for(2), logits_for(9)].concat();
    let mut events = Vec::new();
    b.complete_step(vec![rows], host_fork, |_, e| {
        events.push(e);
        true
    });
    let SequenceEvent::PromptLogprobs(prompt) = &events[0] else {
        panic!("{events:?}");
    };
    assert_eq!(
        prompt.iter().map(|p| p.token).collect::<Vec<_>>(),
        vec![1, 2]
    );
    assert_eq!(
        prompt[0].top[0].0, 1,
        "the prompt token was the most likely"
    );
    let tokens: Vec<(usize, u32)> = events[1..]
        .iter()
        .map(|e| match e {
            SequenceEvent::Token { choice, token, .. } => (*choice, *token),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        tokens,
        vec![(1, 9), (2, 9), (0, 9)],
        "greedy: every choice draws 9"
    );
    assert_eq!(b.running(), 3);
    assert_eq!(
        plan(&mut b),
        vec![1, 1, 1],
        "each choice decodes on its own"
    );
    events.clear();
    b.complete_step(vec![logits_for(4); 3], host_fork, |_, e| {
        events.push(e);
        true
    });
    let finished = events
        .iter()
        .filter(|e| {
            matches!(
                e,
                SequenceEvent::Finished {
                    completion_tokens: 2,
                    ..
                }
            )
        })
        .count();
    assert_eq!(finished, 3);
    assert!(!b.has_work());
}

/// With `max_tokens` 0 only the prompt is scored: no token, every choice finishes.
#[test]
fn zero_max_tokens_scores_the_prompt_and_generates_nothing() {
    let cfg = config();
    let mut b = Batcher::new(limits(), vec![]);
    b.submit(sequence(&cfg, 2, 0, 0).with_prompt_logprobs(Some(0)))
        .unwrap();
    assert_eq!(plan(&mut b), vec![2]);
    let mut events = Vec::new();
    b.complete_step(
        vec![[logits_for(1), logits_for(3)].concat()],
        host_fork,
        |_, e| {
            events.push(e);
            true
        },
    );
    assert!(matches!(&events[0], SequenceEvent::PromptLogprobs(p) if p.len() == 1));
    assert!(matches!(
        events[1],
        SequenceEvent::Finished {
            completion_tokens: 0,
            reason: FinishReason::Length,
            ..
        }
    ));
    assert!(!b.has_work());
}

/// Plans and runs steps until nothing is left (each step's caches advanced as the
/// engine would, every sequence given token 1), checking after each plan that the
/// running sequences stay within `kv` unless one runs alone; returns every event.
/// A batcher whose KV cache holds `blocks` blocks of 4 positions, and that budget.
fn kv_batcher(blocks: usize) -> (Batcher<u32>, KvBudget) {
    let kv = KvBudget {
        block_tokens: 4,
        blocks,
        state_blocks: 0,
    };
    let limits = BatchLimits {
        kv: Some(kv),
        ..limits()
    };
    (Batcher::new(limits, vec![]), kv)
}

fn run_to_the_end(b: &mut Batcher<u32>, kv: KvBudget) -> Vec<(u32, SequenceEvent)> {
    let mut events = Vec::new();
    for _ in 0..200 {
        let mut steps = b.plan_step(host_fork);
        if steps.is_empty() {
            return events;
        }
        for step in &mut steps {
            step.cache.advance(step.tokens.len());
        }
        let n = steps.len();
        drop(steps);
        let (held, total) = b.kv_blocks().unwrap();
        assert_eq!(total, kv.blocks);
        assert!(held <= kv.blocks || b.running() == 1, "{held} blocks held");
        b.complete_step(vec![logits_for(1); n], host_fork, |id, e| {
            events.push((*id, e));
            true
        });
    }
    panic!("the batch never emptied");
}

#[test]
fn a_full_kv_budget_preempts_the_latest_arrival_which_resumes_and_finishes() {
    let cfg = config();
    let (mut b, kv) = kv_batcher(5);
    // Each needs 2 blocks for its prompt and grows to 12 positions (3 blocks): both fit
    // at first, not both at the end.
    b.submit(sequence(&cfg, 6, 6, 0)).unwrap();
    b.submit(sequence(&cfg, 6, 6, 1)).unwrap();
    let events = run_to_the_end(&mut b, kv);
    assert!(b.preemptions() >= 1, "nothing was preempted");
    for id in [0, 1] {
        let mine: Vec<&SequenceEvent> = events
            .iter()
            .filter(|(i, _)| *i == id)
            .map(|(_, e)| e)
            .collect();
        // Six tokens each, none repeated or lost by the preemption, then the end, with
        // the client's prompt length.
        assert_eq!(mine.len(), 7, "sequence {id}: {mine:?}");
        assert!(mine[..6].iter().all(|e| **e == token(0, 1)));
        assert_eq!(
            *mine[6],
            SequenceEvent::Finished {
                choice: 0,
                reason: FinishReason::Length,
                prompt_tokens: 6,
                completion_tokens: 6
            }
        );
    }
    // The first arrival ran through: the second was the one preempted.
    let first_end = events
        .iter()
        .position(|(i, e)| *i == 0 && matches!(e, SequenceEvent::Finished { .. }));
    let second_end = events
        .iter()
        .position(|(i, e)| *i == 1 && matches!(e, SequenceEvent::Finished { .. }));
    assert!(first_end < second_end);
}

#[test]
fn a_prompt_waits_until_its_blocks_are_free() {
    let cfg = config();
    let (mut b, kv) = kv_batcher(3);
    // 7 prompt positions and one more: 2 blocks; the second prompt needs 2 as well.
    b.submit(sequence(&cfg, 7, 1, 0)).unwrap();
    b.submit(sequence(&cfg, 7, 1, 1)).unwrap();
    assert_eq!(plan(&mut b), vec![4], "only the first is admitted");
    assert_eq!(b.running(), 1);
    assert_eq!(b.waiting(), 1);
    let events = run_to_the_end(&mut b, kv);
    assert_eq!(b.preemptions(), 0);
    assert_eq!(
        events
            .iter()
            .filter(|(_, e)| matches!(e, SequenceEvent::Finished { .. }))
            .count(),
        2
    );
}

fn limits_for_three() -> BatchLimits {
    BatchLimits {
        max_sequences: 3,
        ..limits()
    }
}

#[test]
fn a_fixed_state_per_sequence_counts_against_the_budget_as_whole_blocks() {
    // 10 blocks of 16 positions of 100 bytes; a state of 3000 bytes is 2 blocks.
    let kv = KvBudget::of_bytes(16_000, 100).with_state(3000, 100);
    assert_eq!((kv.blocks, kv.state_blocks), (10, 2));
    assert_eq!(kv.blocks_for(0), 2);
    assert_eq!(kv.blocks_for(17), 4);
    assert_eq!(kv.max_positions(), 8 * 16);
    // Two sequences of 4 blocks each fill 8 of 10: a third (3 blocks at least) waits.
    let kv = KvBudget {
        block_tokens: 4,
        blocks: 10,
        state_blocks: 2,
    };
    let limits = BatchLimits {
        kv: Some(kv),
        max_sequences: 3,
        max_waiting: 3,
        ..limits()
    };
    let cfg = config();
    let mut b = Batcher::new(limits, vec![]);
    for id in 0..3 {
        b.submit(sequence(&cfg, 7, 4, id)).unwrap();
    }
    let _ = b.plan_step(host_fork);
    assert_eq!(
        b.running(),
        2,
        "each holds 2 blocks of positions and 2 of state"
    );
    assert_eq!(b.waiting(), 1);
}

#[test]
fn a_rerouted_sequence_says_it_is_degraded_once_before_its_next_token() {
    let cfg = config();
    let mut b = Batcher::new(limits(), vec![15]);
    b.submit(sequence(&cfg, 2, 3, 0)).unwrap();
    b.submit(sequence(&cfg, 2, 3, 1)).unwrap();
    let mut events = Vec::new();
    for (step, rerouted) in [[false, true], [false, false], [true, true]]
        .iter()
        .enumerate()
    {
        assert_eq!(plan(&mut b).len(), 2, "step {step}");
        b.mark_rerouted(rerouted);
        b.complete_step(vec![logits_for(3), logits_for(4)], host_fork, |id, e| {
            events.push((*id, e));
            true
        });
    }
    let degraded = |id: u32| {
        events
            .iter()
            .position(|(i, e)| *i == id && matches!(e, SequenceEvent::Degraded { choice: 0 }))
    };
    // Sequence 1 from its prefill, said once, before its first token; sequence 0 from the
    // third step, before that step's token.
    assert_eq!(degraded(1), Some(1), "{events:?}");
    assert_eq!(
        events
            .iter()
            .filter(|(_, e)| matches!(e, SequenceEvent::Degraded { .. }))
            .count(),
        2,
        "{events:?}"
    );
    let at = degraded(0).expect("sequence 0 degraded");
    assert_eq!(events[at + 1], (0, token(0, 3)));
    let tokens_before = events[..at]
        .iter()
        .filter(|(i, e)| *i == 0 && matches!(e, SequenceEvent::Token { .. }))
        .count();
    assert_eq!(tokens_before, 2, "{events:?}");
}
