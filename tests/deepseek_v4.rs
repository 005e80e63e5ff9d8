//! DeepSeek-V4 against transformers: the tiny checkpoint `tests/fixtures/make_fixtures.py`
//! made with transformers' own classes, in the published layout (compressed and windowed
//! attention shorter than the sequence, an indexer keeping fewer entries than there are,
//! hash-routed layers, 3 hyper-connection streams, random sinks), must give the same greedy
//! tokens and logits within 1e-3 relative, through the engine the router serves with: its
//! cache of several kinds (windows, compressed entries, indexer keys, unfinished windows per
//! layer) batched, rolled back, preempted and reused as the router does, and over HTTP. The
//! GPU backend refuses it, naming what it lacks.

mod batch_run;
mod common;
mod serve;

use moe_node::engine::argmax;
use std::path::{Path, PathBuf};

use batch_run::run_batch;
use moe_node::compute::quant::QuantFormat;
use moe_node::engine::batch::{BatchLimits, Batcher, KvBudget, Sequence};
use moe_node::engine::{Engine, GenerateRequest, KvCache, SamplingParams, SequenceStep, generate};
use moe_node::model::ExpertWeights;
use safetensors::SafeTensors;
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    prompt_ids: Vec<u32>,
    token_ids: Vec<u32>,
    last_logits: Vec<f32>,
    long_prompt_ids: Vec<u32>,
    /// Logits at a few positions of the uncached pass over `long_prompt_ids`.
    long_logits: std::collections::BTreeMap<usize, Vec<f32>>,
}

fn reference() -> Reference {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
        .unwrap()
}

/// The largest difference, relative to the largest reference logit.
fn relative_difference(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let largest = want.iter().fold(0.0f32, |m, l| m.max(l.abs()));
    let diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m });
    diff / largest
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4")
}

/// The logits after the last of `tokens`, fed after `cache`.
fn forward(engine: &Engine, cache: &mut KvCache, tokens: &[u32]) -> Vec<f32> {
    let mut logits = engine
        .forward(&mut [SequenceStep::new(cache, tokens)])
        .unwrap();
    logits.pop().unwrap()
}

#[test]
fn deepseek_v4_matches_transformers() {
    let reference: Reference =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
            .unwrap();
    let engine = Engine::load(&fixture()).unwrap();
    let mut cache = engine.new_cache();
    let logits = forward(&engine, &mut cache, &reference.prompt_ids);
    let largest = reference
        .last_logits
        .iter()
        .fold(0.0f32, |m, l| m.max(l.abs()));
    let diff = logits
        .iter()
        .zip(&reference.last_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m });
    eprintln!(
        "deepseek_v4: max logit difference from transformers {diff:e} ({:e} of the largest logit)",
        diff / largest
    );
    assert!(
        diff <= 1e-3 * largest,
        "logits differ by {diff} (largest logit {largest})"
    );
    // Greedy decoding one token at a time through the cache: past the window, past several
    // compressed windows, the indexer choosing among more entries than it keeps.
    let mut tokens = vec![argmax(&logits)];
    while tokens.len() < reference.token_ids.len() {
        let last = *tokens.last().unwrap();
        let logits = forward(&engine, &mut cache, &[last]);
        tokens.push(argmax(&logits));
    }
    assert_eq!(tokens, reference.token_ids);
}

/// 64 positions decoded one at a time through the cache (16 CSA entries, 8 HCA ones, the
/// window passed ten times over) give the logits of transformers' uncached pass, and so does
/// one prefill of them all.
#[test]
fn a_long_decode_through_the_cache_matches_the_uncached_pass() {
    let reference = reference();
    let engine = Engine::load(&fixture()).unwrap();
    let mut cache = engine.new_cache();
    let mut worst = 0.0f32;
    for (position, &token) in reference.long_prompt_ids.iter().enumerate() {
        let logits = forward(&engine, &mut cache, &[token]);
        if let Some(want) = reference.long_logits.get(&position) {
            worst = worst.max(relative_difference(&logits, want));
        }
    }
    let mut whole = engine.new_cache();
    let logits = forward(&engine, &mut whole, &reference.long_prompt_ids);
    let prefill = relative_difference(&logits, &reference.long_logits[&63]);
    eprintln!(
        "deepseek_v4, 64 positions: decode {worst:e}, prefill {prefill:e} of the largest logit"
    );
    assert!(worst <= 1e-3 && prefill <= 1e-3, "{worst} {prefill}");
}

/// The GPU backend (a real GPU under `tests/gpu/run.sh`, else GPUs emulated on the CPU):
/// the experts run on it, their clamped SwiGLU in the kernel, and give the CPU's logits
/// within bf16 rounding at every step of the CPU's greedy continuation (the tiny random
/// model's greedy path itself parts from the CPU's after a few tokens, where two logits are
/// within that rounding), also with the experts in MXFP4 (widened to bf16 on upload); the dense part is refused at load, naming what the GPU lacks, and a host
/// engine's dense part is not placed on one either.
#[test]
fn its_experts_run_on_the_gpu_and_its_dense_part_is_refused_naming_what_it_lacks() {
    let Some(runtime) = common::gpus("deepseek_v4: GPU backend") else {
        return;
    };
    let reference = reference();
    // The logits of every step of the CPU's greedy continuation, fed to `engine`.
    let steps = |engine: &Engine, tokens: &[u32]| -> Vec<Vec<f32>> {
        let mut cache = engine.new_cache();
        let mut logits = vec![forward(
            engine,
            &mut cache,
            &reference.long_prompt_ids[..40],
        )];
        for &token in tokens {
            logits.push(forward(engine, &mut cache, &[token]));
        }
        logits
    };
    let fp4 = tempfile::tempdir().unwrap();
    let f32_dir = tempfile::tempdir().unwrap();
    write_mxfp4_and_exact(fp4.path(), f32_dir.path());
    for dir in [fixture(), fp4.path().to_path_buf()] {
        let cpu = Engine::load(&dir).unwrap();
        let mut tokens = Vec::new();
        for _ in 0..12 {
            let logits = steps(&cpu, &tokens).pop().unwrap();
            tokens.push(argmax(&logits));
        }
        let on_cpu = steps(&cpu, &tokens);
        let source = moe_node::model::ModelSource::files(&dir);
        let on_gpu = moe_node::engine::gpu::engine_on_gpu(&source, 0, false, None, None)
            .unwrap_or_else(|e| panic!("deepseek_v4's experts on the GPU: {e}"));
        let gpu = steps(&on_gpu, &tokens);
        let worst = on_cpu
            .iter()
            .zip(&gpu)
            .map(|(c, g)| relative_difference(g, c))
            .fold(0f32, f32::max);
        eprintln!(
            "deepseek_v4 ({}), experts on the GPU, 13 steps: {worst:e} of the largest logit \
             from the CPU",
            dir.display()
        );
        assert!(worst <= 2e-2, "{}: {worst}", dir.display());
        assert_eq!(argmax(&gpu[0]), argmax(&on_cpu[0]), "{}", dir.display());
        match moe_node::engine::gpu::engine_on_gpu(&source, 0, true, None, None) {
            Ok(_) => panic!("deepseek_v4's dense part loaded on the GPU"),
            Err(e) => assert!(e.to_string().contains("compressed attention"), "{e}"),
        }
    }
    let mut engine = Engine::load(&fixture()).unwrap();
    let err = engine
        .place_dense_on_gpu(&runtime.gpus[0], 0.9, None)
        .expect_err("DeepSeek-V4's dense part placed on a GPU");
    assert!(err.to_string().contains("compressed attention"), "{err}");
    assert_eq!(engine.dense_gpu(), None);
}

/// A tensor of a checkpoint: name, dtype, shape, bytes.
type OwnedTensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// The fixture written to `dir` with its tensors passed through `edit` first.
fn rewritten_fixture(dir: &Path, edit: impl FnOnce(&mut Vec<OwnedTensor>)) {
    for file in ["config.json", "reference.json"] {
        std::fs::copy(fixture().join(file), dir.join(file)).unwrap();
    }
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<OwnedTensor> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )
        })
        .collect();
    // In name order: `tensors()` lists them in a hash map's order, which changes from one
    // process to the next, and an edit that draws values tensor by tensor must draw the same
    // ones in every run.
    owned.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut owned);
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// A `tid2eid` table naming an expert past the layer's experts is a clear error at load.
#[test]
fn a_token_table_past_the_experts_is_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    rewritten_fixture(dir.path(), |owned| {
        let table = owned
            .iter_mut()
            .find(|(name, ..)| name == "layers.1.ffn.gate.tid2eid")
            .unwrap();
        // Token 5's first expert: 8 (of 8).
        let at = 5 * 2 * 8;
        table.3[at..at + 8].copy_from_slice(&8i64.to_le_bytes());
    });
    let err = Engine::load(dir.path())
        .err()
        .expect("a table past the experts loaded");
    let message = err.to_string();
    assert!(
        message.contains("layers.1.ffn.gate.tid2eid")
            && message.contains("token 5 to expert 8, past the 8 experts"),
        "{message}"
    );
}

/// e2m1's eight magnitudes, by the definition (OCP MX spec): code `s eem`.
const E2M1_MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// The fixture with its routed experts written as Pro and Flash publish them (MXFP4, random
/// e2m1 values and exponents) to `fp4`, and with the same experts in f32 (their exact
/// values) to `exact`.
fn write_mxfp4_and_exact(fp4: &Path, exact: &Path) {
    let mut seed = 0x9e37_79b9_u32;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed
    };
    // Per expert matrix: its name, [out, in], packed e2m1 bytes and exponents.
    struct Mxfp4Matrix(String, [usize; 2], Vec<u8>, Vec<u8>);
    let mut quantized: Vec<Mxfp4Matrix> = Vec::new();
    rewritten_fixture(fp4, |owned| {
        for (name, dtype, shape, data) in owned.iter_mut() {
            let Some(stem) = name.strip_suffix(".weight") else {
                continue;
            };
            if !stem.contains(".ffn.experts.") {
                continue;
            }
            let [out, inp] = [shape[0], shape[1]];
            let packed: Vec<u8> = (0..out * inp / 2).map(|_| next() as u8).collect();
            // 2^-7 .. 2^-4: weights up to 0.375, as large as the fixture's.
            let exponents: Vec<u8> = (0..out * inp / 32)
                .map(|_| 120 + (next() % 4) as u8)
                .collect();
            *dtype = safetensors::Dtype::I8;
            *shape = vec![out, inp / 2];
            *data = packed.clone();
            quantized.push(Mxfp4Matrix(stem.to_string(), [out, inp], packed, exponents));
        }
        for Mxfp4Matrix(stem, [out, inp], _, exponents) in &quantized {
            owned.push((
                format!("{stem}.scale"),
                safetensors::Dtype::F8_E8M0,
                vec![*out, inp / 32],
                exponents.clone(),
            ));
        }
    });
    rewritten_fixture(exact, |owned| {
        for Mxfp4Matrix(stem, [out, inp], packed, exponents) in &quantized {
            let tensor = owned
                .iter_mut()
                .find(|(name, ..)| *name == format!("{stem}.weight"))
                .unwrap();
            let values: Vec<f32> = (0..out * inp)
                .map(|i| {
                    let nibble = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
                    let magnitude = E2M1_MAGNITUDES[usize::from(nibble & 7)];
                    let sign = if nibble & 8 != 0 { -1.0 } else { 1.0 };
                    let scale = 2f32.powi(i32::from(exponents[i / 32]) - 127);
                    sign * magnitude * scale
                })
                .collect();
            tensor.3 = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        }
    });
    assert_eq!(quantized.len(), 4 * 8 * 3, "every routed expert rewritten");
}

/// Routed experts as Pro and Flash publish them (`.weight` I8 `[out, in / 2]` of e2m1 pairs,
/// low nibble first; `.scale` F8_E8M0 `[out, in / 32]`) are held in MXFP4, 4.25 bits a weight,
/// and compute what the same experts written in f32 (their exact values, the path checked
/// against transformers above) compute: the same greedy tokens, logits equal to f32
/// rounding. The fixture's `swiglu_limit` (0.6) clamps many of their gate and up values.
#[test]
fn mxfp4_experts_are_held_compressed_and_compute_their_exact_values() {
    let (fp4, f32_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_mxfp4_and_exact(fp4.path(), f32_dir.path());

    // Held in MXFP4: packed nibbles and one exponent per 32 weights, three matrices.
    let config = moe_node::model::ModelConfig::load(fp4.path()).unwrap();
    let checkpoint = moe_node::model::Checkpoint::open(fp4.path()).unwrap();
    let (h, i) = (64, 32);
    for (layer, expert) in [(0, 0), (3, 7)] {
        match moe_node::model::weights::load_expert(&checkpoint, &config, layer, expert).unwrap() {
            ExpertWeights::Quantized(block) => {
                for m in [&block.gate, &block.up, &block.down] {
                    assert!(matches!(m.format, QuantFormat::Mxfp4 { .. }), "{m:?}");
                }
                assert_eq!(
                    ExpertWeights::Quantized(block).weight_bytes(),
                    3 * (h * i / 2 + h * i / 32)
                );
            }
            other => panic!("expert ({layer}, {expert}) held as {other:?}"),
        }
    }

    let reference = reference();
    let greedy = |dir: &Path| -> (Vec<f32>, Vec<u32>) {
        let engine = Engine::load(dir).unwrap();
        let mut cache = engine.new_cache();
        let first = forward(&engine, &mut cache, &reference.long_prompt_ids[..40]);
        let mut tokens = vec![argmax(&first)];
        while tokens.len() < 12 {
            let logits = forward(&engine, &mut cache, &[*tokens.last().unwrap()]);
            tokens.push(argmax(&logits));
        }
        (first, tokens)
    };
    let (logits, tokens) = greedy(fp4.path());
    let (exact_logits, exact_tokens) = greedy(f32_dir.path());
    let diff = relative_difference(&logits, &exact_logits);
    eprintln!("deepseek_v4 MXFP4 experts: {diff:e} of the largest logit from the f32 ones");
    assert!(diff <= 1e-5, "{diff}");
    assert_eq!(tokens, exact_tokens);
}

/// `moe-node plan` on DeepSeek-V4-Pro's config alone (experts MXFP4, the dense part FP8 with
/// ue8m0 scales): two copies of every expert fit on two 8 x H200 nodes, 48 experts per GPU and
/// layer (95.7 GiB), the dense part on the host, and either node failing leaves every expert
/// its other copy.
#[test]
fn plan_fits_pro_with_two_copies_on_two_h200_nodes() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4_pro");
    let plan = |nodes: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_moe-node"))
            .args([
                "plan",
                "--json",
                "--model",
                model.to_str().unwrap(),
                "--nodes",
                nodes,
            ])
            .args(["--devices-per-node", "8", "--replication", "2"])
            .args(["--device-memory-gib", "141"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str::<serde_json::Value>(&stdout)
            .unwrap_or_else(|e| panic!("{e}: {stdout} {}", String::from_utf8_lossy(&out.stderr)))
    };
    let report = plan("2");
    let sizes = &report["model"]["sizes"];
    // 3 matrices of 7168 x 3072 e2m1 pairs and one e8m0 byte per 32.
    assert_eq!(
        sizes["expert_bytes"],
        3 * (7168 * 3072 / 2 + 7168 * 3072 / 32)
    );
    // 29 CSA layers of (512 + 128) / 4 floats and 32 HCA layers of 512 / 128.
    assert_eq!(sizes["kv_bytes_per_position"], 4 * (29 * 160 + 32 * 4));
    assert_eq!(report["verdict"]["ok"], true, "{}", report["verdict"]);
    for device in report["devices"].as_array().unwrap() {
        assert_eq!(device["experts"]["0"], 48, "{device}");
        assert_eq!(device["fits"], true, "{device}");
        // The dense part and its caches are on the host, as serve runs it.
        assert_eq!(device["dense_bytes"], 0, "{device}");
    }
    for failure in report["failures"].as_array().unwrap() {
        assert_eq!(failure["experts_losing_a_replica"], 61 * 384);
        assert_eq!(failure["unavailable_experts"], 0);
    }
}

fn limits(kv: Option<KvBudget>) -> BatchLimits {
    BatchLimits {
        max_sequences: 16,
        max_tokens_per_step: 32,
        max_waiting: 32,
        prefill_chunk: 4,
        kv,
        prefix_cache_entries: 8,
    }
}

fn greedy(engine: &Engine, prompt: Vec<u32>, max_tokens: usize, id: usize) -> Sequence<usize> {
    let sampling = SamplingParams::default();
    Sequence::new(prompt, max_tokens, sampling, false, engine.new_cache(), id)
}

/// The fixture's prompt through the batcher (prefilled in chunks of 4, then decoded a token a
/// step) gives transformers' greedy tokens.
#[test]
fn the_batcher_decodes_transformers_greedy_tokens() {
    let reference = reference();
    let engine = Engine::load(&fixture()).unwrap();
    let mut batcher = Batcher::new(limits(None), Vec::new());
    let max_tokens = reference.token_ids.len();
    batcher
        .submit(greedy(&engine, reference.prompt_ids.clone(), max_tokens, 0))
        .unwrap();
    let mut tokens = vec![Vec::new()];
    run_batch(&engine, &mut batcher, &mut tokens);
    assert_eq!(tokens[0], reference.token_ids);
}

/// A step that fails at its last layer (an expert unreachable) leaves every layer's state as
/// it was, and the sequence carries on as if it had never been tried.
#[test]
fn a_failed_step_leaves_the_states_as_they_were() {
    use std::sync::Arc;

    use moe_node::experts::LocalExperts;
    use moe_node::model::weights::load_all_experts;
    use moe_node::model::{Checkpoint, ModelConfig};

    let dir = fixture();
    let config = ModelConfig::load(&dir).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let mut experts = load_all_experts(&checkpoint, &config).unwrap();
    let local = LocalExperts::new(experts.clone(), config.hidden_size);
    let complete = Engine::from_checkpoint(config.clone(), &checkpoint, Arc::new(local)).unwrap();
    experts.last_mut().unwrap().clear();
    let local = LocalExperts::new(experts, config.hidden_size);
    let partial = Engine::from_checkpoint(config, &checkpoint, Arc::new(local)).unwrap();
    // 14 positions: the window (6) passed, CSA and HCA windows part-filled at the failure.
    let prompt: Vec<u32> = (0..14).map(|i| (i * 5 + 3) % 128).collect();
    let mut cache = complete.new_cache();
    forward(&complete, &mut cache, &prompt[..9]);
    let bytes = cache.bytes();
    let mut step = [SequenceStep::new(&mut cache, &prompt[9..])];
    assert!(partial.forward(&mut step).is_err());
    assert_eq!((cache.len(), cache.bytes()), (9, bytes));
    let resumed = forward(&complete, &mut cache, &prompt[9..]);
    let mut fresh = complete.new_cache();
    let expected = forward(&complete, &mut fresh, &prompt);
    let diff = relative_difference(&resumed, &expected);
    assert!(
        diff < 1e-5,
        "resumed logits differ by {diff} of the largest"
    );
}

/// 16 sequences stepped at once with no KV budget; then the same under a budget too small for
/// all (counted with every sequence's windows and unfinished windows, and its compressed
/// entries per position), so the latest are preempted and recompute. Prompts are prefilled in
/// chunks of 4, half of them starting from a kept prefix (the whole of it: the windows cannot
/// be cut back). Each gets the greedy tokens it gets alone, past the window and several
/// compressed windows.
#[test]
fn batched_preempted_and_from_a_kept_prefix_each_gives_what_it_gives_alone() {
    let engine = Engine::load(&fixture()).unwrap();
    let cfg = engine.config().clone();
    let per_position = KvCache::bytes_per_position(&cfg);
    let state = KvCache::state_bytes(&cfg);
    let budget = |blocks| {
        KvBudget {
            block_tokens: 4,
            blocks,
            state_blocks: 0,
        }
        .with_state(state, per_position)
    };
    // The windows (6 keys of 32 on 4 layers) and the compressors' buffers dwarf the 28 floats
    // a position adds: a sequence holds 29 blocks of 4 positions before its first.
    assert_eq!(budget(0).state_blocks, 29);
    let shared = batch_run::shared_prefix();
    let prompt = |i: usize| batch_run::prompt_after(&shared, i);
    let max_tokens = 24;
    let alone: Vec<Vec<u32>> = (0..17)
        .map(|i| {
            let prompt = if i == 16 { shared.clone() } else { prompt(i) };
            let request = GenerateRequest {
                prompt,
                max_tokens,
                sampling: SamplingParams::default(),
                stop_at_eos: false,
            };
            generate(&engine, &request).unwrap().token_ids
        })
        .collect();
    // Four sequences' prompts fit in 140 blocks (29 and 3 or 4 more each), not what they then
    // grow to (6 blocks more each over 24 tokens).
    for kv in [None, Some(budget(140))] {
        let mut batcher: Batcher<usize> = Batcher::new(limits(kv), Vec::new());
        let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); 17];
        batcher
            .submit(greedy(&engine, shared.clone(), max_tokens, 16))
            .unwrap();
        run_batch(&engine, &mut batcher, &mut tokens);
        for i in 0..16 {
            batcher
                .submit(greedy(&engine, prompt(i), max_tokens, i))
                .unwrap();
        }
        let widest = run_batch(&engine, &mut batcher, &mut tokens);
        let (hits, hit_tokens) = batcher.prefix_hits();
        eprintln!(
            "deepseek_v4, budget {kv:?}: {widest} sequences in a step at most, {} preemptions, \
             {hits} prefix hits ({hit_tokens} tokens)",
            batcher.preemptions()
        );
        match kv {
            None => assert_eq!(widest, 16, "not every sequence stepped together"),
            Some(_) => assert!(batcher.preemptions() > 0, "the budget preempted none"),
        }
        assert!(hits > 0, "no prompt started from a kept prefix");
        for (i, (got, want)) in tokens.iter().zip(&alone).enumerate() {
            assert_eq!(got, want, "sequence {i}, budget {kv:?}");
        }
    }
}

/// Through the HTTP API: the fixture's prompt streams transformers' greedy continuation; 16
/// streams at once (half of them starting with a kept 37-token prompt) each give what they
/// give alone; and a fresh process, which has kept nothing, gives a prefix-reusing stream what
/// the first gave it. 37 is no whole number of the node's 16-token blocks: the kept cache is
/// the whole prompt's, as the windows cannot be cut back to 32.
#[test]
fn served_over_http_concurrent_streams_and_a_reused_prefix_give_what_they_give_alone() {
    use serde_json::{Value, json};
    use serve::{Server, ids, read_sse, streamed_ids};

    let dir = fixture();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let start = || {
        let server = Server::start_with(
            "[devices]\nbackend = \"cpu\"\n",
            &["--model", dir.to_str().unwrap()],
        );
        server.wait_ready();
        server
    };
    let server = start();
    let stream = |server: &Server, body: &Value| {
        let (events, done) = read_sse(server.post("/v1/completions", body));
        assert!(done, "the stream did not finish");
        streamed_ids(&events)
    };
    let request = |prompt: &Value, max_tokens: usize| {
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": true, "stream": true, "return_token_ids": true})
    };
    let streamed = stream(&server, &request(&reference["prompt_ids"], 12));
    assert_eq!(
        streamed,
        ids(&reference["token_ids"]),
        "against transformers"
    );

    // Kept whole once prefilled: what the prompts that start with it reuse.
    let shared: Vec<u32> = (0..37).map(|k| 1 + (k * 13) % 120).collect();
    stream(&server, &request(&json!(shared), 1));
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
    let alone: Vec<Vec<u64>> = bodies.iter().map(|b| stream(&server, b)).collect();
    let hits_before = server.metric("moe_node_prefix_cache_hits_total");
    let together: Vec<Vec<u64>> = std::thread::scope(|scope| {
        let server = &server;
        let handles: Vec<_> = bodies
            .iter()
            .map(|body| scope.spawn(move || stream(server, body)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "stream {i} together and alone");
    }
    assert!(
        server.metric("moe_node_prefix_cache_hits_total") > hits_before,
        "no stream started from the kept 37-token prompt"
    );
    drop(server);
    let fresh = start();
    assert_eq!(stream(&fresh, &bodies[2]), alone[2], "a fresh process");
}

/// `moe-node plan` on each DeepSeek-V4 fixture (the tiny checkpoint, Flash's and Pro's
/// published configs) reports the caches as the engine counts them.
#[test]
fn plan_reports_the_caches_of_every_v4_fixture() {
    for name in ["deepseek_v4", "deepseek_v4_flash", "deepseek_v4_pro"] {
        let model = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_moe-node"))
            .args(["plan", "--json", "--model", model.to_str().unwrap()])
            .args(["--nodes", "2", "--devices-per-node", "8"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let report: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!(
                "{name}: {e}: {stdout} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        let config = moe_node::model::ModelConfig::load(&model).unwrap();
        let sizes = &report["model"]["sizes"];
        assert_eq!(
            sizes["kv_bytes_per_position"],
            KvCache::bytes_per_position(&config) as u64,
            "{name}: {sizes}"
        );
        assert_eq!(
            sizes["state_bytes_per_sequence"],
            KvCache::state_bytes(&config) as u64,
            "{name}: {sizes}"
        );
    }
}

/// Where the executor says to route around experts (no live replica, `on_expert_unavailable
/// = "reroute"`), a V4 step chooses others, on score layers and hash layers alike: the step
/// succeeds without running an avoided expert, its rows are marked rerouted, and the executor
/// is told how many choices moved. Without avoided experts nothing is marked.
#[test]
fn a_step_routes_around_experts_without_a_live_replica() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use moe_node::experts::{ExpertError, ExpertExecutor, LocalExperts};
    use moe_node::model::weights::load_all_experts;
    use moe_node::model::{Checkpoint, ModelConfig};
    use moe_node::moe::DispatchPlan;

    /// Every layer's even experts have no live replica; running one is an error.
    struct EvenExpertsDown {
        inner: LocalExperts,
        experts: usize,
        moved: AtomicUsize,
        layers_moved: Mutex<Vec<usize>>,
    }

    impl ExpertExecutor for EvenExpertsDown {
        fn run(
            &self,
            layer: usize,
            plan: &DispatchPlan,
            grouped: &[f32],
        ) -> Result<Vec<f32>, ExpertError> {
            if let Some(&expert) = plan.experts.iter().find(|&&e| e % 2 == 0) {
                return Err(ExpertError::NoLiveReplica {
                    layer,
                    experts: vec![expert],
                });
            }
            self.inner.run(layer, plan, grouped)
        }

        fn avoid(&self, _layer: usize) -> Option<Vec<bool>> {
            Some((0..self.experts).map(|e| e % 2 == 0).collect())
        }

        fn rerouted(&self, layer: usize, choices: usize) {
            self.moved.fetch_add(choices, Ordering::Relaxed);
            self.layers_moved.lock().unwrap().push(layer);
        }
    }

    let dir = fixture();
    let config = ModelConfig::load(&dir).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let experts = load_all_experts(&checkpoint, &config).unwrap();
    let down = Arc::new(EvenExpertsDown {
        inner: LocalExperts::new(experts, config.hidden_size),
        experts: config.moe.num_experts,
        moved: AtomicUsize::new(0),
        layers_moved: Mutex::new(Vec::new()),
    });
    let hash_layers = config.deepseek_v4.as_ref().unwrap().hash_layers;
    assert!(hash_layers > 0, "the fixture has hash layers to reroute");
    let engine = Engine::from_checkpoint(config, &checkpoint, down.clone()).unwrap();
    let prompt: Vec<u32> = (0..14).map(|i| (i * 5 + 3) % 128).collect();
    let mut cache = engine.new_cache();
    let mut step = [SequenceStep::new(&mut cache, &prompt)];
    let logits = engine
        .forward(&mut step)
        .expect("the step routes around the even experts");
    assert!(
        step[0].rerouted,
        "the rows that chose an even expert are marked"
    );
    assert!(logits[0].iter().all(|l| l.is_finite()));
    assert!(down.moved.load(Ordering::Relaxed) > 0);
    let layers = down.layers_moved.lock().unwrap().clone();
    assert!(layers.contains(&0), "a hash layer rerouted: {layers:?}");
    assert!(
        layers.iter().any(|&l| l >= hash_layers),
        "a score layer rerouted: {layers:?}"
    );
    assert_eq!(cache.len(), prompt.len(), "the step went through");

    // The same engine's experts all live: nothing is marked.
    let complete = Engine::load(&dir).unwrap();
    let mut cache = complete.new_cache();
    let mut step = [SequenceStep::new(&mut cache, &prompt)];
    complete.forward(&mut step).unwrap();
    assert!(!step[0].rerouted);
}

/// A node with emulated GPUs serves DeepSeek-V4 with its experts on them and its dense part
/// on the CPU (`devices.dense_on_gpu = false`): both devices are GPUs, and the first token's
/// log probabilities are the CPU node's within bf16 rounding.
#[test]
fn a_node_serves_it_with_its_experts_on_gpus() {
    use serde_json::{Value, json};
    use serve::Server;
    if common::gpus("deepseek_v4: a node on emulated GPUs").is_none() {
        return;
    }
    let dir = fixture();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let top = |devices: &str| -> (Vec<String>, Vec<(String, f64)>) {
        let server = Server::start_with(
            &format!("[devices]\n{devices}\n"),
            &["--model", dir.to_str().unwrap()],
        );
        server.wait_ready();
        let listed: Value = server.get("/admin/devices").json().unwrap();
        let kinds = listed["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["kind"].as_str().unwrap().to_string())
            .collect();
        let body = server.post_ok(
            "/v1/completions",
            &json!({"prompt": reference["prompt_ids"], "max_tokens": 1, "temperature": 0,
                    "logprobs": 3}),
        );
        let top = body["choices"][0]["logprobs"]["top_logprobs"][0]
            .as_object()
            .unwrap()
            .iter()
            .map(|(token, lp)| (token.clone(), lp.as_f64().unwrap()))
            .collect();
        (kinds, top)
    };
    let (cpu_kinds, on_cpu) = top("backend = \"cpu\"\ncpu_slots = 2");
    let (gpu_kinds, on_gpu) =
        top("backend = \"cuda-emulated\"\nemulated_gpus = 2\ndense_on_gpu = false");
    eprintln!("deepseek_v4 first token, CPU node {on_cpu:?}, GPU node {on_gpu:?}");
    assert_eq!(cpu_kinds, ["cpu", "cpu"]);
    assert_eq!(gpu_kinds, ["gpu", "gpu"]);
    assert_eq!(on_cpu.len(), 3);
    for ((token, cpu), (gpu_token, gpu)) in on_cpu.iter().zip(&on_gpu) {
        assert_eq!(token, gpu_token, "{on_cpu:?} {on_gpu:?}");
        assert!((cpu - gpu).abs() < 0.05, "{on_cpu:?} {on_gpu:?}");
    }
}
