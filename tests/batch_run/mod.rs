//! Drives a batcher over an engine as the router does, for the tests that compare sequences
//! batched, preempted and started from kept prefixes with each alone.
#![allow(dead_code)]

use moe_node::engine::Engine;
use moe_node::engine::batch::{Batcher, SequenceEvent};

/// Runs every step `batcher` plans over `engine` and collects each sequence's tokens by its
/// id; returns the most sequences one step held. Panics when the batch has not finished
/// within 1000 steps.
pub fn run_batch(engine: &Engine, batcher: &mut Batcher<usize>, tokens: &mut [Vec<u32>]) -> usize {
    run_batch_checking(engine, batcher, tokens, |_| {})
}

/// [`run_batch`], calling `check` with the batcher after every step.
pub fn run_batch_checking(
    engine: &Engine,
    batcher: &mut Batcher<usize>,
    tokens: &mut [Vec<u32>],
    mut check: impl FnMut(&Batcher<usize>),
) -> usize {
    let mut widest = 0;
    for _ in 0..1000 {
        let mut steps = batcher.plan_step(|c| engine.fork_cache(c));
        if steps.is_empty() {
            return widest;
        }
        widest = widest.max(steps.len());
        let logits = engine.forward(&mut steps).unwrap();
        drop(steps);
        batcher.complete_step(
            logits,
            |c| engine.fork_cache(c),
            |id, event| {
                if let SequenceEvent::Token { token, .. } = event {
                    tokens[*id].push(token);
                }
                true
            },
        );
        check(batcher);
    }
    panic!("the batch did not finish within 1000 steps");
}

/// The prompt the preemption tests share: nine tokens every other prompt starts from.
pub fn shared_prefix() -> Vec<u32> {
    (0..9).map(|k| 3 + k * 7 % 120).collect()
}

/// Prompt `i` of those tests: odd ones extend `shared` (a kept prefix can stand for it),
/// even ones change its first token and extend it by 0 to 4 tokens.
pub fn prompt_after(shared: &[u32], i: usize) -> Vec<u32> {
    let mut p = shared.to_vec();
    if i % 2 == 1 {
        p.extend((0..3 + i % 4).map(|k| (11 + i * 5 + k * 13) as u32 % 127));
    } else {
        p[0] = 40 + i as u32;
        p.extend((0..i % 5).map(|k| (7 + i * 3 + k) as u32 % 127));
    }
    p
}
