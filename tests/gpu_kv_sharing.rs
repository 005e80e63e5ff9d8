//! Copies of a KV cache on the GPU share their source's whole blocks: a fork (a kept prompt
//! prefix, a prompt's `n` choices) takes one block of the pool for its last, partial block,
//! not a copy of every block; source and fork then go on apart, each as a fresh prefill of
//! its own tokens would, and the shared blocks go back to the pool only when the last
//! holder lets go. On GPUs emulated on the CPU, or a real one under `tests/gpu/run.sh`.

mod common;

use moe_node::compute::cuda::dense::KV_BLOCK;
use moe_node::engine::{Engine, KvCache, SequenceStep};

fn on_gpu(what: &str) -> Option<Engine> {
    common::engine_on_gpu(what, "qwen3_moe")
}

fn step(engine: &Engine, cache: &mut KvCache, tokens: &[u32]) -> Vec<f32> {
    engine
        .forward(&mut [SequenceStep::new(cache, tokens)])
        .unwrap()
        .remove(0)
}

fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn free(engine: &Engine) -> usize {
    engine.gpu_kv_blocks().expect("a pool after a step").0
}

#[test]
fn a_fork_shares_the_whole_blocks_and_each_goes_on_as_its_own_prefill() {
    let Some(engine) = on_gpu("KV blocks shared between copies of a cache") else {
        return;
    };
    // Two whole blocks and a part of a third.
    let prompt: Vec<u32> = (0..2 * KV_BLOCK as u32 + 8)
        .map(|k| 1 + (k * 13) % 120)
        .collect();
    let mut source = engine.new_cache();
    step(&engine, &mut source, &prompt);
    let before = free(&engine);
    let mut fork = engine.fork_cache(&source).unwrap();
    assert_eq!(fork.len(), prompt.len());
    assert_eq!(
        before - free(&engine),
        1,
        "the fork copied only its partial block"
    );
    let mut second = engine.fork_cache(&fork).unwrap();
    assert_eq!(before - free(&engine), 2);

    // Each goes on its own way, writing into its own partial block and then new ones.
    let ways: [&[u32]; 3] = [&[5, 6, 7, 8, 9, 10, 11, 12, 13], &[77], &[3, 3]];
    let mut outputs = Vec::new();
    for (cache, tokens) in [&mut source, &mut fork, &mut second].into_iter().zip(ways) {
        outputs.push(step(&engine, cache, tokens));
    }
    for (output, tokens) in outputs.iter().zip(ways) {
        let mut all = prompt.clone();
        all.extend_from_slice(tokens);
        let alone = step(&engine, &mut engine.new_cache(), &all);
        let diff = largest_difference(output, &alone);
        assert!(
            diff < 1e-4,
            "after {tokens:?}: {diff} from one prefill of the same tokens"
        );
    }
    // The shared blocks are the pool's again once every holder has let go.
    drop(second);
    drop(fork);
    assert!(free(&engine) < engine.gpu_kv_blocks().unwrap().1);
    drop(source);
    let (free, blocks) = engine.gpu_kv_blocks().unwrap();
    assert_eq!(free, blocks, "blocks left held after every cache let go");
}
