//! Drives a batcher over an engine as the router does, for the tests that compare sequences
//! batched, preempted and started from kept prefixes with each alone.

use moe_node::engine::Engine;
use moe_node::engine::batch::{Batcher, SequenceEvent};

/// Runs every step `batcher` plans over `engine` and collects each sequence's tokens by its
/// id; returns the most sequences one step held. Panics when the batch has not finished
/// within 1000 steps.
pub fn run_batch(engine: &Engine, batcher: &mut Batcher<usize>, tokens: &mut [Vec<u32>]) -> usize {
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
    }
    panic!("the batch did not finish within 1000 steps");
}
