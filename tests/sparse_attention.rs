//! DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) served as the router serves it: the
//! lightning indexer's keys are a second cache beside the MLA latents, so batching, prefill
//! in blocks or chunks, a failed step's rollback, preemption and a reused prefix must each
//! keep both caches together. Each case holds the tiny fixtures (an `index_topk` of 5, far
//! under the sequences here) to what one sequence alone gives.

use std::path::{Path, PathBuf};

use moe_node::engine::batch::{BatchLimits, Batcher, KvBudget, Sequence};
use moe_node::engine::{Engine, GenerateRequest, KvCache, SamplingParams, SequenceStep, generate};

mod batch_run;
mod serve;

use batch_run::run_batch;

const FIXTURES: [&str; 2] = ["deepseek_v32", "glm_moe_dsa"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The largest difference; NaN anywhere is NaN.
fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m })
}

fn last(logits: Vec<Vec<f32>>) -> Vec<f32> {
    logits.into_iter().next().unwrap()
}

/// The indexer's keys count in the cache's bytes and in its size per position.
#[test]
fn the_indexer_keys_are_cached_and_counted_per_position() {
    for name in FIXTURES {
        let engine = Engine::load(&fixture(name)).unwrap();
        let cfg = engine.config();
        // 3 layers of latents (32) and rotary keys (8); the indexers' keys (16) on the layers
        // with one of their own: all 3 (DeepSeek-V3.2), 2 of 3 (GLM-5's second is shared).
        let indexers = if name == "glm_moe_dsa" { 2 } else { 3 };
        assert_eq!(KvCache::indexer_bytes_per_position(cfg), indexers * 16 * 4);
        assert_eq!(
            KvCache::bytes_per_position(cfg),
            (3 * (32 + 8) + indexers * 16) * 4,
            "{name}"
        );
        let mut cache = engine.new_cache();
        let prompt: Vec<u32> = (0..9).collect();
        engine
            .forward(&mut [SequenceStep::new(&mut cache, &prompt)])
            .unwrap();
        assert_eq!(
            cache.bytes(),
            9 * KvCache::bytes_per_position(cfg),
            "{name}"
        );
    }
}

/// Prefill in blocks, in chunks after a cached start, and token by token give the same
/// logits over 150 positions (the indexer chooses 5 of up to 150), and sequences stepped
/// together give what they give alone.
#[test]
fn blocks_chunks_single_tokens_and_batches_agree() {
    for name in FIXTURES {
        let engine = Engine::load(&fixture(name)).unwrap();
        let prompt: Vec<u32> = (0..150u32).map(|i| (i * 37 + 11) % 128).collect();
        let mut cache = engine.new_cache();
        let mut one_by_one = Vec::new();
        for token in &prompt {
            let mut step = [SequenceStep::new(&mut cache, std::slice::from_ref(token))];
            one_by_one = last(engine.forward(&mut step).unwrap());
        }
        let mut cache = engine.new_cache();
        let whole = last(
            engine
                .forward(&mut [SequenceStep::new(&mut cache, &prompt)])
                .unwrap(),
        );
        let mut cache = engine.new_cache();
        let mut chunked = Vec::new();
        for chunk in prompt.chunks(70) {
            chunked = last(
                engine
                    .forward(&mut [SequenceStep::new(&mut cache, chunk)])
                    .unwrap(),
            );
        }
        let diff = max_difference(&one_by_one, &whole);
        eprintln!("{name}: token by token against one step: {diff:e}");
        assert!(
            diff < 1e-4,
            "{name}: token by token and one step differ by {diff}"
        );
        let diff = max_difference(&chunked, &whole);
        assert!(diff < 1e-4, "{name}: chunks and one step differ by {diff}");

        let prompts: [&[u32]; 3] = [&prompt[..9], &[9, 8], &prompt[20..47]];
        let alone: Vec<Vec<f32>> = prompts
            .iter()
            .map(|p| {
                let mut cache = engine.new_cache();
                last(
                    engine
                        .forward(&mut [SequenceStep::new(&mut cache, p)])
                        .unwrap(),
                )
            })
            .collect();
        let mut caches: Vec<_> = prompts.iter().map(|_| engine.new_cache()).collect();
        let mut batch: Vec<SequenceStep> = caches
            .iter_mut()
            .zip(prompts)
            .map(|(cache, tokens)| SequenceStep::new(cache, tokens))
            .collect();
        let together = engine.forward(&mut batch).unwrap();
        for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
            let diff = max_difference(a, b);
            assert!(
                diff < 5e-5,
                "{name}: sequence {i} batched differs by {diff}"
            );
        }
    }
}

/// A step that fails at its last layer (an expert unreachable) leaves both caches as they
/// were, and the sequence carries on as if it had never been tried.
#[test]
fn a_failed_step_leaves_the_indexer_keys_as_they_were() {
    use std::sync::Arc;

    use moe_node::experts::LocalExperts;
    use moe_node::model::weights::load_all_experts;
    use moe_node::model::{Checkpoint, DenseWeights, ModelConfig};

    for name in FIXTURES {
        let dir = fixture(name);
        let config = ModelConfig::load(&dir).unwrap();
        let checkpoint = Checkpoint::open(&dir).unwrap();
        let dense = DenseWeights::load(&checkpoint, &config).unwrap();
        let mut experts = load_all_experts(&checkpoint, &config).unwrap();
        let complete = Engine::new(
            config.clone(),
            dense.clone(),
            Arc::new(LocalExperts::new(experts.clone(), config.hidden_size)),
        );
        experts.last_mut().unwrap().clear();
        let partial = Engine::new(
            config.clone(),
            dense,
            Arc::new(LocalExperts::new(experts, config.hidden_size)),
        );
        let prompt: Vec<u32> = (0..12).map(|i| (i * 5 + 3) % 128).collect();
        let mut cache = complete.new_cache();
        complete
            .forward(&mut [SequenceStep::new(&mut cache, &prompt[..8])])
            .unwrap();
        let bytes = cache.bytes();
        assert!(
            partial
                .forward(&mut [SequenceStep::new(&mut cache, &prompt[8..])])
                .is_err()
        );
        assert_eq!((cache.len(), cache.bytes()), (8, bytes), "{name}");
        let resumed = last(
            complete
                .forward(&mut [SequenceStep::new(&mut cache, &prompt[8..])])
                .unwrap(),
        );
        let mut fresh = complete.new_cache();
        let expected = last(
            complete
                .forward(&mut [SequenceStep::new(&mut fresh, &prompt)])
                .unwrap(),
        );
        let diff = max_difference(&resumed, &expected);
        assert!(diff < 1e-4, "{name}: resumed logits differ by {diff}");
    }
}

/// 16 sequences at once under a KV budget too small for all (counted with the indexer's
/// keys), so the latest are preempted and recompute, prompts prefilled in chunks of 4, half
/// of them starting from a kept prefix (latents and indexer keys cut back to whole blocks).
/// Each gets the greedy tokens it gets alone.
#[test]
fn batched_preempted_and_from_a_kept_prefix_each_gives_what_it_gives_alone() {
    for name in FIXTURES {
        served_as_the_router_serves(name);
    }
}

fn served_as_the_router_serves(name: &str) {
    let engine = Engine::load(&fixture(name)).unwrap();
    let cfg = engine.config().clone();
    let limits = BatchLimits {
        max_sequences: 16,
        max_tokens_per_step: 32,
        max_waiting: 32,
        prefill_chunk: 4,
        kv: Some(KvBudget {
            block_tokens: 4,
            blocks: 40,
            state_blocks: 0,
        }),
        prefix_cache_entries: 8,
    };
    let mut batcher: Batcher<usize> = Batcher::new(limits, cfg.eos_token_ids.clone());
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
    assert!(
        batcher.preemptions() > 0,
        "{name}: the budget preempted none"
    );
    let (hits, _) = batcher.prefix_hits();
    assert!(hits > 0, "{name}: no prompt started from a kept prefix");
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
        assert_eq!(got, &alone.token_ids, "{name}: sequence {i}");
    }
}

/// `moe-node plan` on DeepSeek-V3.2's published config.json (tests/fixtures/configs): the
/// KV cache per position counts the 61 indexers' keys (128 f32 each) beside the MLA's latents
/// and rotary keys, and the report says how much of it they are.
#[test]
fn plan_counts_the_indexer_keys_of_the_published_deepseek_v32() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/configs/deepseek_v32");
    let plan = |json: bool| {
        let mut args = vec!["plan", "--model", model.to_str().unwrap()];
        args.extend([
            "--nodes",
            "2",
            "--devices-per-node",
            "8",
            "--replication",
            "2",
        ]);
        if json {
            args.push("--json");
        }
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_moe-node"))
            .args(&args)
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    let report: serde_json::Value = serde_json::from_str(&plan(true)).unwrap();
    let sizes = &report["model"]["sizes"];
    let indexer = 61 * 128 * 4;
    assert_eq!(sizes["indexer_bytes_per_position"], indexer, "{sizes}");
    assert_eq!(
        sizes["kv_bytes_per_position"],
        61 * (512 + 64) * 4 + indexer,
        "{sizes}"
    );
    let text = plan(false);
    assert!(
        text.contains("lightning indexer keys (DeepSeek Sparse Attention): 30.5 KiB"),
        "{text}"
    );
}

/// Through the HTTP API: the fixture's prompt streams transformers' greedy continuation; 16
/// streams at once (half of them sharing a 32-token start) each give what they give alone;
/// and a prompt starting with whole blocks of one run before starts from its kept cache
/// (latents and indexer keys) and gives what a fresh process gives.
#[test]
fn served_over_http_concurrent_streams_and_a_reused_prefix_give_what_they_give_alone() {
    use serde_json::{Value, json};
    use serve::{Server, ids, read_sse, streamed_ids};

    for name in FIXTURES {
        let dir = fixture(name);
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let server = Server::start_with(
            "[devices]\nbackend = \"cpu\"\n",
            &["--model", dir.to_str().unwrap()],
        );
        server.wait_ready();
        let stream = |body: &Value| {
            let (events, done) = read_sse(server.post("/v1/completions", body));
            assert!(done, "{name}: the stream did not finish");
            streamed_ids(&events)
        };
        let request = |prompt: &Value, max_tokens: usize| {
            json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                   "ignore_eos": true, "stream": true, "return_token_ids": true})
        };
        let streamed = stream(&request(&reference["prompt_ids"], 12));
        eprintln!("{name}: streamed {streamed:?}");
        assert_eq!(
            streamed,
            ids(&reference["token_ids"]),
            "{name}: against transformers"
        );

        let shared: Vec<u32> = (0..32).map(|k| 1 + (k * 13) % 120).collect();
        let bodies: Vec<Value> = (0..16u32)
            .map(|i| {
                let mut prompt = if i % 2 == 0 {
                    shared.clone()
                } else {
                    vec![5 + i]
                };
                prompt.extend((0..3 + i % 5).map(|k| (7 + i * 11 + k * 3) % 127));
                request(&json!(prompt), 10 + i as usize % 4)
            })
            .collect();
        let alone: Vec<Vec<u64>> = bodies.iter().map(&stream).collect();
        let hits_before = server.metric("moe_node_prefix_cache_hits_total");
        let together: Vec<Vec<u64>> = std::thread::scope(|scope| {
            let handles: Vec<_> = bodies
                .iter()
                .map(|body| scope.spawn(move || stream(body)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(a, t, "{name}: stream {i} together and alone");
        }
        assert!(
            server.metric("moe_node_prefix_cache_hits_total") > hits_before,
            "{name}: no stream started from the kept 32-token start"
        );
        drop(server);
        // A fresh process gives the prefix-reusing streams what the first gave them.
        let fresh = Server::start_with(
            "[devices]\nbackend = \"cpu\"\n",
            &["--model", dir.to_str().unwrap()],
        );
        fresh.wait_ready();
        let again = {
            let (events, done) = read_sse(fresh.post("/v1/completions", &bodies[2]));
            assert!(done);
            streamed_ids(&events)
        };
        assert_eq!(again, alone[2], "{name}: a fresh process");
    }
}

/// A fixture's files in a temporary directory, its config.json changed by `edit`.
fn edited_copy(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

/// Bad indexer settings: a clear error naming the key (exit 78 from the command line), a
/// checkpoint whose indexer does not match its config naming the tensor; never a panic.
#[test]
fn bad_indexer_settings_and_tensors_are_named() {
    use moe_node::model::ModelError;

    let dir = edited_copy("deepseek_v32", |c| c["index_topk"] = 0.into());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .args(["generate", "--model", dir.path().to_str().unwrap()])
        .args(["--prompt-ids", "1,2,3"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("`index_topk` must be greater than 0"),
        "{stderr}"
    );

    // The checkpoint's indexer keys are 16 wide.
    let dir = edited_copy("deepseek_v32", |c| c["index_head_dim"] = 32.into());
    let err = Engine::load(dir.path())
        .err()
        .expect("loaded a mis-shaped indexer");
    assert!(matches!(err, ModelError::TensorShape { .. }), "{err}");
    assert!(err.to_string().contains("self_attn.indexer.wq_b"), "{err}");

    // GLM-5's second layer shares the first's indexer and has none of its own.
    let dir = edited_copy("glm_moe_dsa", |c| {
        c["indexer_types"] = serde_json::json!(["full", "full", "full"])
    });
    let err = Engine::load(dir.path())
        .err()
        .expect("loaded a missing indexer");
    assert!(
        matches!(err, ModelError::MissingTensor { ref name, .. }
            if name.starts_with("model.layers.1.self_attn.indexer.")),
        "{err}"
    );
}
