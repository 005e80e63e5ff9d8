//! The engine against Hugging Face transformers, on every backend this machine has: each
//! fixture under tests/fixtures/ was made by make_fixtures.py, which recorded transformers'
//! greedy continuation and the logits after the last prompt token (computed in f32 from the
//! saved weights). The CPU backend is held to transformers; the GPU backend (experts in
//! bf16 on GPU 0, then the whole model there; on a GPU under `tests/gpu/run.sh`, else on GPUs
//! emulated on the CPU) to the CPU backend.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use moe_node::engine::{
    Engine, GenerateRequest, Generation, SamplingParams, SequenceStep, generate,
};
use moe_node::experts::{ExpertError, ExpertExecutor};
use moe_node::model::ModelSource;
use moe_node::moe::DispatchPlan;

mod common;

/// Largest absolute logit difference accepted on the CPU. Both sides compute in f32 from the
/// same weights; only summation order differs (absorbed MLA, blocked GEMM). Measured: at most
/// 1e-5 on logits of magnitude ~5.
const LOGIT_TOLERANCE: f32 = 1e-4;

/// Largest absolute logit difference accepted between the GPU backend and the CPU backend.
/// The GPU holds experts in bf16 and rounds their inputs, gate|up outputs and activations to
/// bf16 (accumulating in f32). The same rounding emulated on the CPU moved these fixtures'
/// logits (magnitude ~6) by at most 0.039 and changed no greedy token.
const BF16_LOGIT_TOLERANCE: f32 = 0.1;

/// The same with the dense part on the GPU too, where every product (attention projections,
/// MLA's per-head products, dense MLPs, shared experts, lm head) takes bf16 inputs and
/// weights. Emulated with transformers (tests/fixtures/bf16_effect.py), that moved the
/// logits after the prompt by at most 0.351 (kimi_k2_int4; the others 0.03 to 0.163); the
/// H200 measured 0.290 there (2026-12-04). The GPU's KV cache holds bf16 too: emulated with
/// the dense part (keys and values, or MLA's latent and rotary key, rounded as cached), the
/// logits after the prompt move by 0.031 to 0.177 (kimi_k2_int4). Where the prompt's last row
/// sits at a tie between experts it can take the other one (kimi_k2 with the paged bf16
/// cache, layer 2: 1.19); that row's logits are then not compared, and the routing flip that
/// explains them must be found ([`routing_flips`]). Over the continuations it also moves
/// routing (tokens near a tie between experts change experts) and flips near-tied greedy
/// choices (deepseek_v3 step 9, kimi_k2 step 5: top-2 margins of 0.012 and 0.008), so there
/// the whole-model GPU path is held to itself instead: decoding through its KV cache must
/// give what one prefill of the same tokens gives.
const BF16_DENSE_LOGIT_TOLERANCE: f32 = 0.4;

/// Largest logit difference accepted on the CPU between the demo model's sequences stepped
/// together and each alone, where no token may be routed differently and no greedy token
/// may differ. Not bit-exact (the kernel and row tiles a product takes depend on its rows, so sums
/// round differently with the batch): 32 sequences over 17 steps measured at most 1.2e-6
/// (2026-12-06, Intel Xeon with AVX-512 and AMX), every one of the 544 (sequence, step)
/// pairs off by some bits, none routed or decoded differently. The bound leaves room for
/// the other kernels of a CPU without AVX-512 or AMX (AVX2 only: not measured).
const CPU_BATCHED_LOGIT_TOLERANCE: f32 = 1e-5;

/// Decode and prefill on one backend differ only in how rows are batched into products.
const CACHE_LOGIT_TOLERANCE: f32 = 0.05;

/// [`CACHE_LOGIT_TOLERANCE`] for a hybrid model (linear-attention states) batched against
/// alone on the GPU. The routed experts take a GEMV for a few rows and a GEMM for more, which
/// round differently in bf16, so a decode step of 32 sequences rounds each expert's output
/// otherwise than the same step alone (the prefill steps, with many rows either way, were bit
/// equal); a KV cache keeps such a difference in one position, a state carries it into every
/// later one. Measured on the emulated GPU (qwen3_5_moe, 32 sequences, 4 decode steps): at
/// most 0.055, with no routing or greedy token changed.
const HYBRID_BATCHED_LOGIT_TOLERANCE: f32 = 0.1;

/// Batched against alone on the GPU, a token whose experts were chosen differently in the
/// two runs is exempt from [`CACHE_LOGIT_TOLERANCE`]: cuBLAS picks its kernels by the rows of
/// each product, so bf16 sums round differently with the batch, and where two experts' scores
/// are within that rounding of the top-k boundary the choice flips (the H200 measured one
/// such flip in 544 demo-model steps, moving that step's logits by 0.087 while every other
/// step stayed within 1e-3). Such flips must stay rare: a routing error would not.
const MAX_ROUTING_FLIPS_PER_STEP: f64 = 0.05;

/// Records, for each MoE layer an engine runs, the experts each token row was routed to.
struct RoutingLog {
    experts: Arc<dyn ExpertExecutor>,
    /// `[call][row]`: the experts of each row, ascending.
    layers: Mutex<Vec<Vec<Vec<u32>>>>,
}

impl RoutingLog {
    fn install(engine: &mut Engine) -> Arc<RoutingLog> {
        let mut log = None;
        engine.wrap_experts(|experts| {
            let l = Arc::new(RoutingLog {
                experts,
                layers: Mutex::default(),
            });
            log = Some(l.clone());
            l
        });
        log.unwrap()
    }

    /// The routing recorded since the last call: `[layer][row]`.
    fn take(&self) -> Vec<Vec<Vec<u32>>> {
        std::mem::take(&mut self.layers.lock().unwrap())
    }
}

impl ExpertExecutor for RoutingLog {
    fn run(
        &self,
        layer: usize,
        plan: &DispatchPlan,
        grouped_input: &[f32],
    ) -> Result<Vec<f32>, ExpertError> {
        let rows = plan.source_rows.iter().max().map_or(0, |&r| r as usize + 1);
        let mut routed = vec![Vec::new(); rows];
        for (i, &expert) in plan.experts.iter().enumerate() {
            for &row in &plan.source_rows[plan.group(i)] {
                routed[row as usize].push(expert);
            }
        }
        self.layers.lock().unwrap().push(routed);
        self.experts.run(layer, plan, grouped_input)
    }

    fn avoid(&self, layer: usize) -> Option<Vec<bool>> {
        self.experts.avoid(layer)
    }

    fn rerouted(&self, layer: usize, choices: usize) {
        self.experts.rerouted(layer, choices)
    }
}

#[derive(serde::Deserialize)]
struct Reference {
    prompt_ids: Vec<u32>,
    token_ids: Vec<u32>,
    last_logits: Vec<f32>,
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        // NaN sticks: f32::max would drop it.
        .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m })
}

/// The larger difference; NaN sticks (`f32::max` would drop it).
fn worse(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

fn run(engine: &Engine, reference: &Reference) -> Generation {
    generate(
        engine,
        &GenerateRequest {
            prompt: reference.prompt_ids.clone(),
            max_tokens: reference.token_ids.len(),
            sampling: SamplingParams::default(),
            stop_at_eos: false,
        },
    )
    .unwrap()
}

fn check(name: &str) {
    check_with(name, OnGpu::Everything);
}

/// What of a family the GPU backend runs.
enum OnGpu<'a> {
    /// Its experts, then the whole model.
    Everything,
    /// Its experts; placing the whole model there is refused naming what it lacks.
    ExpertsOnly { lacks: &'a str },
    /// Nothing: loading its experts there is refused naming what the GPU lacks.
    Refused { lacks: &'a str },
}

/// As [`check`], for a family whose parts the GPU's dense part lacks: where CUDA is present,
/// the experts on the GPU are held to the CPU as for every family, and placing the whole model
/// there must be refused with a message naming `lacks`.
fn check_dense_gpu_refused(name: &str, lacks: &str) {
    check_with(name, OnGpu::ExpertsOnly { lacks });
}

/// As [`check`] on the CPU, for a family whose experts the GPU backend cannot run: loading
/// them there must be refused with a message naming `lacks`.
fn check_gpu_refused(name: &str, lacks: &str) {
    check_with(name, OnGpu::Refused { lacks });
}

fn check_with(name: &str, gpu_support: OnGpu) {
    let dir = fixture(name);
    let reference: Reference =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let engine = Engine::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let generation = run(&engine, &reference);
    let max_diff = max_difference(&generation.last_logits, &reference.last_logits);
    eprintln!("{name}: max logit difference from transformers {max_diff:e}");
    assert_eq!(generation.last_logits.len(), reference.last_logits.len());
    assert!(
        max_diff <= LOGIT_TOLERANCE,
        "{name}: logits differ from transformers by up to {max_diff}"
    );
    assert_eq!(
        generation.token_ids, reference.token_ids,
        "{name}: greedy tokens differ from transformers (logit diff {max_diff})"
    );

    // The GPU backend: on a GPU under `tests/gpu/run.sh`, else on GPUs emulated on the CPU.
    if common::gpus(&format!("{name}: GPU backend")).is_none() {
        return;
    }
    if let OnGpu::Refused { lacks } = gpu_support {
        match moe_node::engine::gpu::engine_on_gpu(&ModelSource::files(&dir), 0, false, None, None)
        {
            Ok(_) => panic!("{name}: its experts loaded on the GPU, which lacks {lacks}"),
            Err(e) => assert!(e.to_string().contains(lacks), "{name}: {e}"),
        }
        return;
    }
    {
        {
            let experts_on_gpu = moe_node::engine::gpu::engine_on_gpu(
                &ModelSource::files(&dir),
                0,
                false,
                None,
                None,
            )
            .unwrap_or_else(|e| panic!("{name}, experts on GPU 0: {e}"));
            let on_gpu = run(&experts_on_gpu, &reference);
            let gpu_diff = max_difference(&on_gpu.last_logits, &generation.last_logits);
            eprintln!("{name}, experts on GPU: max logit difference from the CPU {gpu_diff:e}");
            assert!(
                gpu_diff <= BF16_LOGIT_TOLERANCE,
                "{name}, experts on GPU: logits differ from the CPU's by up to {gpu_diff}"
            );
            assert_eq!(
                on_gpu.token_ids, generation.token_ids,
                "{name}, experts on GPU: greedy tokens differ from the CPU's (logit diff \
                 {gpu_diff})"
            );
            drop(experts_on_gpu);
            if let OnGpu::ExpertsOnly { lacks } = gpu_support {
                let refused = moe_node::engine::gpu::engine_on_gpu(
                    &ModelSource::files(&dir),
                    0,
                    true,
                    None,
                    None,
                );
                match refused {
                    Ok(_) => {
                        panic!("{name}: the whole model loaded on the GPU, which lacks {lacks}")
                    }
                    Err(e) => assert!(e.to_string().contains(lacks), "{name}: {e}"),
                }
                return;
            }
            let mut whole = moe_node::engine::gpu::engine_on_gpu(
                &ModelSource::files(&dir),
                0,
                true,
                None,
                None,
            )
            .unwrap_or_else(|e| panic!("{name}, whole model on GPU 0: {e}"));
            check_whole_model_on_gpu(name, &mut whole, &reference, &generation);
        }
    }
}

/// The MoE layers (by call) whose experts for the last row of `prompt` differ between the
/// CPU and the whole model on the GPU, each routed through the host's gate (a [`RoutingLog`]
/// routes on the host): `(call, cpu experts, gpu experts)`.
///
/// A hybrid model's (linear-attention states) flips are looked for at every row of the
/// prompt: its states carry each row into all later ones undamped, so an earlier row that
/// took other experts moves the last row's logits as much as the last row's own flip.
fn routing_flips(name: &str, prompt: &[u32]) -> Vec<(usize, Vec<u32>, Vec<u32>)> {
    let dir = fixture(name);
    let mut cpu = Engine::load(&dir).unwrap();
    let mut gpu =
        moe_node::engine::gpu::engine_on_gpu(&ModelSource::files(&dir), 0, true, None, None)
            .unwrap_or_else(|e| panic!("{name}, whole model on GPU 0: {e}"));
    let (on_cpu, on_gpu) = (RoutingLog::install(&mut cpu), RoutingLog::install(&mut gpu));
    for engine in [&cpu, &gpu] {
        let mut cache = engine.new_cache();
        engine
            .forward(&mut [SequenceStep::new(&mut cache, prompt)])
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let rows = match cpu.config().linear_attention {
        Some(_) => 0..prompt.len(),
        None => prompt.len() - 1..prompt.len(),
    };
    let sorted = |mut experts: Vec<u32>| {
        experts.sort_unstable();
        experts
    };
    on_cpu
        .take()
        .into_iter()
        .zip(on_gpu.take())
        .enumerate()
        .flat_map(|(call, (c, g))| {
            rows.clone().filter_map(move |row| {
                let (c, g) = (sorted(c[row].clone()), sorted(g[row].clone()));
                (c != g).then_some((call, c, g))
            })
        })
        .collect()
}

/// The whole model on the GPU: the logits after the prompt against the CPU's, then the
/// CPU's continuation fed back one token at a time through the GPU's KV cache against one
/// GPU prefill of the same tokens.
fn check_whole_model_on_gpu(
    name: &str,
    engine: &mut Engine,
    reference: &Reference,
    on_cpu: &Generation,
) {
    let mut cache = engine.new_cache();
    let step = |cache: &mut moe_node::engine::KvCache, tokens: &[u32]| {
        engine
            .forward(&mut [SequenceStep::new(cache, tokens)])
            .unwrap_or_else(|e| panic!("{name}, whole model on GPU: {e}"))
            .remove(0)
    };
    let after_prompt = step(&mut cache, &reference.prompt_ids);
    let diff = max_difference(&after_prompt, &on_cpu.last_logits);
    eprintln!("{name}, whole model on GPU: max logit difference from the CPU {diff:e}");
    if diff > BF16_DENSE_LOGIT_TOLERANCE {
        // Past the bf16 bound only where the prompt's last row changed experts: a token
        // within rounding of a tie between two experts (the GPU's cache and products are
        // bf16) takes the other one, and the logits after it move by what that expert
        // contributes. Anything else is an error.
        let flips = routing_flips(name, &reference.prompt_ids);
        assert!(
            !flips.is_empty(),
            "{name}, whole model on GPU: logits after the prompt differ from the CPU's by \
             {diff}, and the routing is the CPU's in every layer"
        );
        eprintln!(
            "{name}, whole model on GPU: the prompt's rows changed experts ({flips:?}): \
             its logits are not compared"
        );
    }
    let continuation = &on_cpu.token_ids[..on_cpu.token_ids.len() - 1];
    let mut decoded = after_prompt;
    for &token in continuation {
        decoded = step(&mut cache, &[token]);
    }
    let mut all = reference.prompt_ids.clone();
    all.extend_from_slice(continuation);
    let prefilled = step(&mut engine.new_cache(), &all);
    let diff = max_difference(&decoded, &prefilled);
    eprintln!("{name}, whole model on GPU: decode through the cache vs one prefill {diff:e}");
    assert!(
        diff <= CACHE_LOGIT_TOLERANCE,
        "{name}, whole model on GPU: decoding through the KV cache differs from a prefill of \
         the same {} tokens by {diff}",
        all.len()
    );

    // Two sequences in one step, one decoding and one prefilling, against each alone.
    let mut first = engine.new_cache();
    step(&mut first, &reference.prompt_ids);
    let alone = step(&mut first, &continuation[..1]);
    let mut decoding = engine.new_cache();
    step(&mut decoding, &reference.prompt_ids);
    let mut prefilling = engine.new_cache();
    let together = engine
        .forward(&mut [
            SequenceStep::new(&mut decoding, &continuation[..1]),
            SequenceStep::new(&mut prefilling, &all),
        ])
        .unwrap_or_else(|e| panic!("{name}, whole model on GPU, two sequences: {e}"));
    let diff = worse(
        max_difference(&together[0], &alone),
        max_difference(&together[1], &prefilled),
    );
    eprintln!("{name}, whole model on GPU: two sequences in one step vs each alone {diff:e}");
    assert!(
        diff <= CACHE_LOGIT_TOLERANCE,
        "{name}, whole model on GPU: a decode and a prefill in one step differ from each alone \
         by {diff}"
    );

    // Many sequences at once, as a server batches them.
    let prompts: Vec<Vec<u32>> = (0..32u32)
        .map(|i| {
            let mut p = reference.prompt_ids.clone();
            p[0] = (p[0] + i) % on_cpu.last_logits.len() as u32;
            p
        })
        .collect();
    check_batching(&format!("{name}, whole model on GPU"), engine, &prompts, 4);
}

/// What [`batched_against_alone`] found.
struct Batching {
    /// The largest logit difference of a (sequence, step) whose tokens were routed alike.
    worst: f32,
    /// (sequence, step) pairs where some token so far was routed differently.
    flipped: usize,
    pairs: usize,
    /// (sequence, step) pairs whose logits are not bit for bit those of the sequence alone.
    not_bit_equal: usize,
    /// (sequence, step) pairs whose greedy token differs from the sequence alone's.
    tokens_differ: usize,
    /// Each step's largest difference, for the log.
    per_step: Vec<f32>,
}

/// Runs each prompt alone (prefill, then `steps` greedy decode steps), then all of them
/// together in the same steps fed the same tokens, and compares the logits, noting where
/// routing differed.
fn batched_against_alone(
    engine: &Engine,
    log: &RoutingLog,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Batching {
    let argmax = |l: &[f32]| (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32;
    log.take();
    let mut alone = Vec::new();
    let mut alone_routing = Vec::new();
    for prompt in prompts {
        let mut cache = engine.new_cache();
        let mut tokens = prompt.clone();
        let (mut logits, mut routing) = (Vec::new(), Vec::new());
        for _ in 0..=steps {
            let out = engine
                .forward(&mut [SequenceStep::new(&mut cache, &tokens)])
                .unwrap()
                .remove(0);
            tokens = vec![argmax(&out)];
            logits.push(out);
            routing.push(log.take());
        }
        alone.push(logits);
        alone_routing.push(routing);
    }
    let mut caches: Vec<_> = prompts.iter().map(|_| engine.new_cache()).collect();
    let mut found = Batching {
        worst: 0.0,
        flipped: 0,
        pairs: 0,
        not_bit_equal: 0,
        tokens_differ: 0,
        per_step: Vec::new(),
    };
    let mut diverged = vec![false; prompts.len()];
    for step in 0..=steps {
        let inputs: Vec<Vec<u32>> = (0..prompts.len())
            .map(|i| match step {
                0 => prompts[i].clone(),
                _ => vec![argmax(&alone[i][step - 1])],
            })
            .collect();
        let mut batch: Vec<SequenceStep> = caches
            .iter_mut()
            .zip(&inputs)
            .map(|(cache, tokens)| SequenceStep::new(cache, tokens))
            .collect();
        let together = engine.forward(&mut batch).unwrap();
        let routing = log.take();
        assert!(!routing.is_empty(), "no MoE layer's routing was recorded");
        let mut step_worst = 0f32;
        let mut first_row = 0;
        for (i, logits) in together.iter().enumerate() {
            let rows = first_row..first_row + inputs[i].len();
            first_row = rows.end;
            let mine = &alone_routing[i][step];
            diverged[i] |= routing.len() != mine.len()
                || routing
                    .iter()
                    .zip(mine)
                    .any(|(all, one)| all[rows.clone()] != one[..]);
            let diff = max_difference(logits, &alone[i][step]);
            step_worst = worse(step_worst, diff);
            found.pairs += 1;
            if logits.len() != alone[i][step].len()
                || logits
                    .iter()
                    .zip(&alone[i][step])
                    .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                found.not_bit_equal += 1;
            }
            if argmax(logits) != argmax(&alone[i][step]) {
                found.tokens_differ += 1;
            }
            if diverged[i] {
                found.flipped += 1;
            } else {
                found.worst = worse(found.worst, diff);
            }
        }
        found.per_step.push(step_worst);
    }
    found
}

/// `prompts` stepped together against each alone, said on stderr.
fn measure_batching(
    what: &str,
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Batching {
    let log = RoutingLog::install(engine);
    let found = batched_against_alone(engine, &log, prompts, steps);
    let per_step: Vec<String> = found.per_step.iter().map(|d| format!("{d:.1e}")).collect();
    eprintln!(
        "{what}: {} sequences stepped together vs each alone {:e} where routed alike; {} of {} \
         (sequence, step) pairs routed differently, {} not bit-equal, {} with another greedy \
         token; each step's largest difference: {}",
        prompts.len(),
        found.worst,
        found.flipped,
        found.pairs,
        found.not_bit_equal,
        found.tokens_differ,
        per_step.join(" ")
    );
    found
}

/// The GPU's batching: logits within [`CACHE_LOGIT_TOLERANCE`] wherever routing agreed, and
/// routing flips rare.
fn check_batching(what: &str, engine: &mut Engine, prompts: &[Vec<u32>], steps: usize) {
    let bound = match engine.config().linear_attention {
        Some(_) => HYBRID_BATCHED_LOGIT_TOLERANCE,
        None => CACHE_LOGIT_TOLERANCE,
    };
    let found = measure_batching(what, engine, prompts, steps);
    assert!(
        found.worst <= bound,
        "{what}: {} sequences stepped together differ from each alone by {} where they were \
         routed alike",
        prompts.len(),
        found.worst
    );
    assert!(
        found.flipped as f64 <= MAX_ROUTING_FLIPS_PER_STEP * found.pairs as f64,
        "{what}: {} of {} (sequence, step) pairs were routed differently batched and alone",
        found.flipped,
        found.pairs
    );
}

/// The demo model the server serves, stepped as the server's 32-stream test does: on the
/// CPU, and where this machine has a GPU with the experts there, then the whole model.
#[test]
fn demo_model_batched_equals_each_sequence_alone() {
    let dir = tempfile::tempdir().unwrap();
    moe_node::model::demo::write_demo_model(
        dir.path(),
        &moe_node::model::demo::DemoSpec::default(),
        |_, _| {},
    )
    .unwrap();
    let prompts: Vec<Vec<u32>> = (0..32u32)
        .map(|i| vec![256, 10 + i, 20 + i % 7, 30 + (i * 3) % 11])
        .collect();
    let mut on_cpu = Engine::load(dir.path()).unwrap();
    let found = measure_batching("demo model on the CPU", &mut on_cpu, &prompts, 16);
    let largest = found.per_step.iter().copied().fold(0.0, worse);
    assert_eq!(
        (found.flipped, found.tokens_differ),
        (0, 0),
        "demo model on the CPU: of {} (sequence, step) pairs stepped together, (routed \
         differently, another greedy token) than alone; largest logit difference {largest}",
        found.pairs
    );
    assert!(
        largest <= CPU_BATCHED_LOGIT_TOLERANCE,
        "demo model on the CPU: {} sequences stepped together differ from each alone by {largest}",
        prompts.len()
    );
    if common::gpus("demo model batched on the GPU").is_none() {
        return;
    }
    for dense in [false, true] {
        let mut engine = moe_node::engine::gpu::engine_on_gpu(
            &ModelSource::files(dir.path()),
            0,
            dense,
            None,
            None,
        )
        .unwrap();
        check_batching(
            &format!("demo model on the GPU (dense part there too: {dense})"),
            &mut engine,
            &prompts,
            16,
        );
    }
}

#[test]
fn qwen3_moe_matches_transformers() {
    check("qwen3_moe");
}

#[test]
fn qwen3_moe_bf16_matches_transformers() {
    check("qwen3_moe_bf16");
}

#[test]
fn mixtral_matches_transformers() {
    check("mixtral");
}

#[test]
fn deepseek_v3_matches_transformers() {
    check("deepseek_v3");
}

#[test]
fn kimi_k2_matches_transformers() {
    check("kimi_k2");
}

#[test]
fn mixtral_sliding_window_matches_transformers() {
    check("mixtral_sliding");
}

#[test]
fn glm4_moe_matches_transformers() {
    check("glm4_moe");
}

/// MiniMax-M2: q/k norm over the whole projection, 8 of 16 values rotated, a routing bias
/// that changes 17 of the prompt's 22 (token, layer) choices; bf16.
#[test]
fn minimax_m2_matches_transformers() {
    check("minimax_m2");
}

/// Llama 4: chunks of 4 positions and a NoPE layer with temperature tuning (both reached by
/// the 11-token prompt), q/k norm without weights, top-1 routing on the expert's input, a
/// shared expert, fused experts, llama3 rope scaling.
#[test]
fn llama4_matches_transformers() {
    check("llama4");
}

/// gpt-oss: a sliding window of 4 on alternate layers, random sinks and biases, YaRN rope,
/// softmax over the top-k router logits, fused interleaved experts whose clamp changes 1514 of
/// the prompt's 4224 gate and up values. The bf16 release's experts are held with the clamp
/// folded into f32 weights, which the GPU's SwiGLU kernel does not compute: loading them
/// there is refused, naming that.
#[test]
fn gpt_oss_matches_transformers() {
    check_gpu_refused("gpt_oss", "clamped");
}

/// gpt-oss as released: the experts in MXFP4 (`_blocks` of FP4 e2m1 pairs, `_scales` of E8M0
/// exponents per 32 inputs), the rest in bf16; transformers dequantizes them to bf16 as
/// moe-node does (tests/fixtures/make_fixtures.py `to_mxfp4` writes them). On the GPU its
/// experts run with their biases and clamped SwiGLU (widened to bf16 on upload), and its
/// dense part too: windowed and full layers in turn, a sink logit per head, biased
/// projections and router.
#[test]
fn gpt_oss_mxfp4_matches_transformers() {
    check("gpt_oss_mxfp4");
}

/// Qwen3-Next: gated DeltaNet layers (two value heads per key head, a 4-wide convolution)
/// between full-attention layers with a gated output, q/k norm and a quarter of each head
/// rotated; a gated shared expert, a dense layer, zero-centred norms. On the GPU too, the
/// whole model: the delta rule's states paged in the KV pool.
#[test]
fn qwen3_next_matches_transformers() {
    check("qwen3_next");
}

/// Qwen3.5-MoE as published: the multimodal wrapper (text model under
/// `model.language_model.`, a vision tower left unloaded), the linear layers' projections
/// stored apart, every layer MoE; bf16.
#[test]
fn qwen3_5_moe_matches_transformers() {
    check("qwen3_5_moe");
}

/// Qwen3.5-MoE in the layout of Qwen's releases: each layer's routed experts fused
/// (`experts.gate_up_proj` `[experts, 2 * moe_intermediate, hidden]`, gate first, and
/// `experts.down_proj`), each expert read from its block alone.
#[test]
fn qwen3_5_moe_fused_matches_transformers() {
    check("qwen3_5_moe_fused");
}

/// The hybrid models over a 150-token prompt, past two of transformers' 64-token chunks of the
/// delta rule (and nine of moe-node's 16): the logits at positions on each side of a chunk's
/// end, from the prompt prefilled in one step and in the router's pieces, within 1e-3 of the
/// largest (the bound; measured 6e-7 to 8.5e-6), with transformers' greedy token.
#[test]
fn hybrid_models_match_transformers_past_a_prefill_chunk() {
    #[derive(serde::Deserialize)]
    struct Long {
        long_prompt_ids: Vec<u32>,
        long_logits: std::collections::BTreeMap<usize, Vec<f32>>,
    }
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0
    };
    for name in ["qwen3_next", "qwen3_5_moe"] {
        let dir = fixture(name);
        let long: Long =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let engine = Engine::load(&dir).unwrap();
        for (&position, want) in &long.long_logits {
            let prompt = &long.long_prompt_ids[..=position];
            let largest = want.iter().fold(0.0f32, |m, l| m.max(l.abs()));
            for piece in [prompt.len(), 37] {
                let mut cache = engine.new_cache();
                let mut got = Vec::new();
                for chunk in prompt.chunks(piece) {
                    let mut step = [SequenceStep::new(&mut cache, chunk)];
                    got = engine.forward(&mut step).unwrap().remove(0);
                }
                let relative = max_difference(&got, want) / largest;
                eprintln!("{name}, position {position}, pieces of {piece}: {relative:e} relative");
                assert!(
                    relative <= 1e-3,
                    "{name}, position {position}, pieces of {piece}: {relative} relative"
                );
                assert_eq!(argmax(&got), argmax(want), "{name}, position {position}");
            }
        }
    }
}

// Quantized checkpoints (tests/fixtures/make_quant_fixtures.py): transformers ran on the
// dequantized weights, so the tolerance is the f32 one.

/// FP8 e4m3 in the published [128, 128] blocks, with partial blocks on every edge.
#[test]
fn kimi_k2_fp8_matches_transformers() {
    check("kimi_k2_fp8");
}

/// FP8 e4m3 in [16, 32] blocks with bf16 scales.
#[test]
fn qwen3_moe_fp8_matches_transformers() {
    check("qwen3_moe_fp8");
}

/// Qwen3.5-MoE as Qwen's FP8 releases store it: the wrapper, every projection of the text
/// layers (the linear layers' qkv, z and output projections among them) in e4m3 with a bf16
/// scale per [128, 128] block, the routed experts apart, what `modules_to_not_convert` names
/// in bf16.
#[test]
fn qwen3_5_moe_fp8_matches_transformers() {
    check("qwen3_5_moe_fp8");
}

/// compressed-tensors pack-quantized INT4 experts, groups of 32.
#[test]
fn kimi_k2_int4_matches_transformers() {
    check("kimi_k2_int4");
}

/// The Kimi K2.5 layout: text model under `language_model.`, vision tower beside it, sharded.
#[test]
fn kimi_k25_int4_matches_transformers() {
    check("kimi_k25_int4");
}

/// DeepSeek-V3.2: DeepSeek-V3's shape with DeepSeek Sparse Attention, an `index_topk` (5)
/// under the prompt so that the lightning indexer's choice decides what 18 of the 23
/// positions attend to in each layer (the smallest gap between the last position chosen and
/// the first left out, as make_fixtures.py reports: 5.2e-3). The GPU's dense part has no
/// indexer: placing the whole model there is refused naming it.
#[test]
fn deepseek_v32_matches_transformers() {
    check_dense_gpu_refused("deepseek_v32", "lightning indexer");
}

/// GLM-5: the same indexer with rope over interleaved pairs, its second layer reusing the
/// first's choice (`indexer_types: shared`), one expert group (smallest gap 7.7e-3).
#[test]
fn glm_moe_dsa_matches_transformers() {
    check_dense_gpu_refused("glm_moe_dsa", "lightning indexer");
}
