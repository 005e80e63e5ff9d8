//! Sequences stepped together in one batch give what they give alone (the same greedy
//! tokens, logits within rounding): the property continuous batching rests on.

mod batch_run;

use std::path::Path;

use batch_run::run_batch;
use moe_node::engine::{Engine, SequenceStep};

/// The largest difference between two equally long vectors; NaN anywhere is NaN (which
/// fails every `diff < tolerance`), where `fold(0.0, f32::max)` would drop it.
fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m })
}

/// Largest logit difference accepted between a sequence stepped in a batch and alone on the
/// CPU. Not bit-exact: the kernel and row tiles a product takes depend on how many rows it
/// has (`FEW_ROWS`, `TILE_ROWS` in `compute/cpu/`), so sums round
/// differently with the company a row keeps. Measured (2026-12-06, Intel Xeon with
/// AVX-512 and AMX): at most 7.5e-6 (mixtral; qwen3_moe 4.1e-6, deepseek_v3 5.0e-6) on
/// logits of magnitude ~5, with every greedy token the same. The bound leaves room for the
/// other kernels of a CPU without AVX-512 or AMX (AVX2 only: not measured), still ten
/// thousand times under the GPU's.
const BATCHED_LOGIT_TOLERANCE: f32 = 5e-5;

/// The same for the hybrid models (`qwen3_next`, `qwen3_5_moe`): their gated delta rule
/// carries each step's rounding forward in its recurrent state, so the company a row keeps
/// shows more. Measured (2026-12-06, AMD EPYC with AVX-512 and AVX512_BF16, no AMX): at most
/// 5.6e-5 (qwen3_5_moe; qwen3_next 3.7e-5), where the attention-only models stay within
/// 7.4e-6 on the same machine; every greedy token the same.
const HYBRID_BATCHED_LOGIT_TOLERANCE: f32 = 2e-4;

#[test]
fn batched_steps_equal_single_steps() {
    for name in [
        "qwen3_moe",
        "mixtral",
        "deepseek_v3",
        "glm4_moe",
        "minimax_m2",
        "llama4",
        "gpt_oss",
        "qwen3_next",
        "qwen3_5_moe",
    ] {
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
                let mut step = [SequenceStep::new(&mut cache, p)];
                let mut logits = engine.forward(&mut step).unwrap().swap_remove(0);
                // Then one decode step with a fixed token.
                let mut step = [SequenceStep::new(&mut cache, &[7])];
                logits.extend(engine.forward(&mut step).unwrap().swap_remove(0));
                logits
            })
            .collect();

        let mut caches: Vec<_> = prompts.iter().map(|_| engine.new_cache()).collect();
        let mut batch: Vec<SequenceStep> = caches
            .iter_mut()
            .zip(prompts)
            .map(|(cache, tokens)| SequenceStep::new(cache, tokens))
            .collect();
        let mut together = engine.forward(&mut batch).unwrap();
        let mut batch: Vec<SequenceStep> = caches
            .iter_mut()
            .map(|cache| SequenceStep::new(cache, &[7]))
            .collect();
        for (all, decode) in together.iter_mut().zip(engine.forward(&mut batch).unwrap()) {
            all.extend(decode);
        }
        assert_eq!(alone.len(), together.len(), "{name}: sequences");
        let argmax = |l: &[f32]| (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b]));
        let vocab = engine.config().vocab_size;
        for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
            let diff = max_difference(a, b);
            eprintln!("{name}: sequence {i} batched vs alone: largest logit difference {diff:e}");
            let tolerance = match name {
                "qwen3_next" | "qwen3_5_moe" => HYBRID_BATCHED_LOGIT_TOLERANCE,
                _ => BATCHED_LOGIT_TOLERANCE,
            };
            assert!(
                diff <= tolerance,
                "{name}: sequence {i}'s logits batched differ from alone by {diff} (bound {tolerance})"
            );
            // The greedy token after the prompt and after the decode step.
            for (step, (x, y)) in a.chunks(vocab).zip(b.chunks(vocab)).enumerate() {
                assert_eq!(
                    argmax(x),
                    argmax(y),
                    "{name}: sequence {i}, step {step}: another greedy token batched"
                );
            }
        }
    }
}

/// Over MLA's cache and a hybrid model's (whose linear layers' states the failed step had
/// already moved on before its last layer failed).
#[test]
fn a_step_whose_experts_are_unreachable_fails_and_leaves_the_caches_as_they_were() {
    for name in ["deepseek_v3", "qwen3_next"] {
        unreachable_experts_leave_the_cache_as_it_was(name);
    }
}

fn unreachable_experts_leave_the_cache_as_it_was(name: &str) {
    use std::sync::Arc;

    use moe_node::engine::EngineError;
    use moe_node::experts::{ExpertError, LocalExperts};
    use moe_node::model::weights::load_all_experts;
    use moe_node::model::{Checkpoint, DenseWeights, ModelConfig};

    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let config = ModelConfig::load(&dir).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let dense = DenseWeights::load(&checkpoint, &config).unwrap();
    let mut experts = load_all_experts(&checkpoint, &config).unwrap();
    let complete = Engine::new(
        config.clone(),
        dense.clone(),
        Arc::new(LocalExperts::new(experts.clone(), config.hidden_size)),
    );
    // This executor holds no experts of the last layer, as if their worker had died.
    experts.last_mut().unwrap().clear();
    let partial = Engine::new(
        config.clone(),
        dense,
        Arc::new(LocalExperts::new(experts, config.hidden_size)),
    );

    let mut cache = complete.new_cache();
    let mut step = [SequenceStep::new(&mut cache, &[1, 2, 3])];
    complete.forward(&mut step).unwrap();
    let (len_before, bytes_before) = (cache.len(), cache.bytes());

    let mut step = [SequenceStep::new(&mut cache, &[4, 5])];
    let err = partial.forward(&mut step).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::Expert(ExpertError::NotHeld { layer, .. }) if layer == config.num_layers - 1
        ),
        "{name}: {err}"
    );
    assert_eq!(cache.len(), len_before);
    assert_eq!(cache.bytes(), bytes_before);

    // The sequence carries on as if the failed step had never been tried.
    let mut step = [SequenceStep::new(&mut cache, &[4, 5])];
    let resumed = complete.forward(&mut step).unwrap();
    let mut fresh = complete.new_cache();
    let mut step = [SequenceStep::new(&mut fresh, &[1, 2, 3, 4, 5])];
    let expected = complete.forward(&mut step).unwrap();
    let diff = max_difference(&resumed[0], &expected[0]);
    assert!(diff < 1e-4, "{name}: resumed logits differ by {diff}");
    assert!(complete.forward(&mut []).unwrap().is_empty());
}

/// A prompt attended in one step (its queries in blocks against the cache: the prefill path)
/// gives the logits it gives fed one token at a time (each query alone: the decode path), and
/// so does a chunk of it after a cached start; over GQA (with and without a sliding window,
/// rotating whole heads or part of each as GLM does) and MLA, and past one block's rows.
#[test]
fn a_prompt_attended_in_blocks_equals_it_fed_token_by_token() {
    for name in [
        "qwen3_moe",
        "mixtral_sliding",
        "deepseek_v3",
        "glm4_moe",
        "minimax_m2",
        "llama4",
        "gpt_oss",
        "qwen3_next",
        "qwen3_5_moe",
    ] {
        let engine = Engine::load(
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures")
                .join(name),
        )
        .unwrap();
        let prompt: Vec<u32> = (0..150u32).map(|i| (i * 37 + 11) % 128).collect();
        let last = |logits: Vec<Vec<f32>>| logits.into_iter().next().unwrap();

        let mut cache = engine.new_cache();
        let mut one_by_one = Vec::new();
        for token in &prompt {
            let mut step = [SequenceStep::new(&mut cache, std::slice::from_ref(token))];
            one_by_one = last(engine.forward(&mut step).unwrap());
        }

        let mut cache = engine.new_cache();
        let mut step = [SequenceStep::new(&mut cache, &prompt)];
        let whole = last(engine.forward(&mut step).unwrap());

        let mut cache = engine.new_cache();
        for chunk in prompt.chunks(70) {
            let mut step = [SequenceStep::new(&mut cache, chunk)];
            engine.forward(&mut step).unwrap();
        }
        let next = [prompt[0]];
        let mut step = [SequenceStep::new(&mut cache, &next)];
        let after_chunks = last(engine.forward(&mut step).unwrap());
        let mut cache = engine.new_cache();
        let mut with_next = prompt.clone();
        with_next.push(prompt[0]);
        let mut step = [SequenceStep::new(&mut cache, &with_next)];
        let whole_next = last(engine.forward(&mut step).unwrap());

        let diff = max_difference(&one_by_one, &whole);
        assert!(
            diff < 1e-4,
            "{name}: one step and token by token differ by {diff}"
        );
        let diff = max_difference(&after_chunks, &whole_next);
        assert!(diff < 1e-4, "{name}: chunks and one step differ by {diff}");
    }
}

/// A hybrid model (linear layers' states beside the KV cache) served as the router serves:
/// 16 sequences at once under a KV budget too small for all, so the latest are preempted and
/// recompute, prompts prefilled in chunks of 4, and half of them starting with a prompt run
/// before, whose kept cache (state and all) they start from. Each gets the greedy tokens it
/// gets alone.
#[test]
fn a_hybrid_model_batched_preempted_and_from_a_kept_prefix_gives_what_it_gives_alone() {
    use moe_node::engine::batch::{BatchLimits, Batcher, KvBudget, Sequence};
    use moe_node::engine::{GenerateRequest, KvCache, SamplingParams, generate};

    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_next");
    let engine = Engine::load(&dir).unwrap();
    let cfg = engine.config().clone();
    let per_position = KvCache::bytes_per_position(&cfg);
    let kv = KvBudget {
        block_tokens: 4,
        blocks: 60,
        state_blocks: 0,
    }
    .with_state(KvCache::state_bytes(&cfg), per_position);
    assert!(kv.state_blocks > 0);
    let limits = BatchLimits {
        max_sequences: 16,
        max_tokens_per_step: 32,
        max_waiting: 32,
        prefill_chunk: 4,
        kv: Some(kv),
        prefix_cache_entries: 8,
    };
    let mut batcher: Batcher<usize> = Batcher::new(limits, cfg.eos_token_ids.clone());
    // Odd prompts continue the shared prompt, which runs first and is kept whole.
    let shared = batch_run::shared_prefix();
    let prompt = |i: usize| batch_run::prompt_after(&shared, i);
    let max_tokens = 10;
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); 17];
    let run = |batcher: &mut Batcher<usize>, tokens: &mut Vec<Vec<u32>>| {
        run_batch(&engine, batcher, tokens);
    };
    let submit = |batcher: &mut Batcher<usize>, prompt: Vec<u32>, id: usize| {
        let seq = Sequence::new(
            prompt,
            max_tokens,
            SamplingParams::default(),
            false,
            KvCache::new(&cfg),
            id,
        );
        batcher.submit(seq).unwrap();
    };
    submit(&mut batcher, shared.clone(), 16);
    run(&mut batcher, &mut tokens);
    for i in 0..16 {
        submit(&mut batcher, prompt(i), i);
    }
    run(&mut batcher, &mut tokens);
    assert!(batcher.preemptions() > 0, "the budget preempted none");
    let (hits, _) = batcher.prefix_hits();
    assert!(hits > 0, "no prompt started from a kept prefix");
    for (i, got) in tokens.iter().enumerate() {
        let prompt = if i == 16 { shared.clone() } else { prompt(i) };
        let alone = generate(
            &engine,
            &GenerateRequest {
                prompt,
                max_tokens,
                sampling: SamplingParams::default(),
                stop_at_eos: false,
            },
        )
        .unwrap();
        assert_eq!(got, &alone.token_ids, "sequence {i}");
    }
}
