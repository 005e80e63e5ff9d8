//! Sequences stepped together in one batch give exactly what they give alone: the property
//! continuous batching rests on.

use std::path::Path;

use moe_node::engine::{Engine, SequenceStep};

#[test]
fn batched_steps_equal_single_steps() {
    for name in ["qwen3_moe", "mixtral", "deepseek_v3"] {
        let engine = Engine::load(
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures")
                .join(name),
        )
        .unwrap();
        let prompts: [&[u32]; 3] = [&[1, 2, 3, 4, 5], &[9, 8], &[100, 50, 25, 12, 6, 3, 1]];

        let alone: Vec<Vec<f32>> = prompts
            .iter()
            .map(|p| {
                let mut cache = engine.new_cache();
                let mut step = [SequenceStep {
                    cache: &mut cache,
                    tokens: p,
                }];
                let mut logits = engine.forward(&mut step).unwrap().swap_remove(0);
                // Then one decode step with a fixed token.
                let mut step = [SequenceStep {
                    cache: &mut cache,
                    tokens: &[7],
                }];
                logits.extend(engine.forward(&mut step).unwrap().swap_remove(0));
                logits
            })
            .collect();

        let mut caches: Vec<_> = prompts.iter().map(|_| engine.new_cache()).collect();
        let mut batch: Vec<SequenceStep> = caches
            .iter_mut()
            .zip(prompts)
            .map(|(cache, tokens)| SequenceStep { cache, tokens })
            .collect();
        let mut together = engine.forward(&mut batch).unwrap();
        let mut batch: Vec<SequenceStep> = caches
            .iter_mut()
            .map(|cache| SequenceStep {
                cache,
                tokens: &[7],
            })
            .collect();
        for (all, decode) in together.iter_mut().zip(engine.forward(&mut batch).unwrap()) {
            all.extend(decode);
        }
        for (a, b) in alone.iter().zip(&together) {
            let diff = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(diff < 1e-4, "{name}: batched logits differ by {diff}");
        }
    }
}
