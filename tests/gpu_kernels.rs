//! The kernels on a GPU against the CPU implementation they follow: the MoE layer (gating,
//! permutation, grouped expert FFN, combine) and the dense kernels (RMSNorm, rotary,
//! attention). On a GPU under `tests/gpu/run.sh`; everywhere else on GPUs emulated on the
//! CPU (`compute::cuda::emulated`), which run the same kernels through the same Rust
//! launchers and cudarc calls.

use half::bf16;
use moe_node::compute::cpu::{Linear, SwiGlu};
use moe_node::compute::cuda::GpuInfo;
use moe_node::compute::cuda::experts::{ExpertShape, random_bf16 as values};
use moe_node::compute::cuda::layer::{Gate, GpuMoeLayer};
use moe_node::compute::cuda::storage::ExpertStorage;
use moe_node::experts::gpu::{GpuOptions, load_experts};
use moe_node::model::config::GatingConfig;
use moe_node::model::weights::load_expert;
use moe_node::model::{ExpertWeights, LoadFormat, ModelSource};
use moe_node::moe::{DispatchPlan, route};

mod common;
use common::{AttentionCase, RopeCase, assert_close};
#[path = "../benches/common/quantize.rs"]
#[allow(dead_code)]
mod quantize;

/// GPU 0: a real one under `tests/gpu/run.sh`, else emulated on the CPU (see
/// `common::gpus`); `None` (with a line saying why) where neither can be had.
fn gpu_or_skip() -> Option<GpuInfo> {
    common::gpus("GPU kernels").map(|runtime| runtime.gpus[0].clone())
}

fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// How the layer's experts are stored.
#[derive(Clone, Copy)]
enum Form {
    Bf16,
    /// FP8 e4m3 in these blocks.
    Fp8([usize; 2]),
    /// INT4 in groups of this many.
    Int4(usize),
}

/// Expert `seed`'s weights in `form`: random values, quantized as the published tools do.
fn random_expert(form: Form, h: usize, i: usize, seed: u64) -> ExpertWeights {
    let linear = |rows: usize, cols: usize, seed: u64| {
        let v = values(rows * cols, seed, (cols as f32).powf(-0.5));
        Linear::without_bias(widen(&v), rows, cols)
    };
    let block = SwiGlu {
        gate: linear(i, h, seed),
        up: linear(i, h, seed + 1),
        down: linear(h, i, seed + 2),
    };
    match form {
        Form::Bf16 => ExpertWeights::Bf16(quantize::to_bf16(&block)),
        Form::Fp8(blocks) => ExpertWeights::Quantized(quantize::quantize(&block, |l| {
            quantize::to_fp8_blocks(l, blocks)
        })),
        Form::Int4(group) => ExpertWeights::Quantized(quantize::quantize(&block, |l| {
            quantize::to_int4_groups(l, group)
        })),
    }
}

fn check_layer(gating: GatingConfig, num_experts: usize, top_k: usize, bias: bool, form: Form) {
    let Some(gpu) = gpu_or_skip() else { return };
    let (h, i, max_tokens) = (256, 128, 128);
    let cpu_experts: Vec<ExpertWeights> = (0..num_experts as u64)
        .map(|e| random_expert(form, h, i, 100 + 3 * e))
        .collect();
    let storage = ExpertStorage::of(&cpu_experts[0], h, i).0;
    let shape = ExpertShape {
        hidden: h,
        intermediate: i,
        num_experts,
        max_rows: max_tokens * top_k,
        host_io: false,
        storage,
        activation: Default::default(),
        biases: false,
    };
    let gate = Gate {
        router: values(num_experts * h, 1, 0.2),
        correction_bias: bias.then(|| widen(&values(num_experts, 2, 0.05))),
        gating: gating.clone(),
        top_k,
    };
    let mut layer = GpuMoeLayer::new(&gpu, shape, gate.clone(), max_tokens, 0.5, None).unwrap();
    for (e, weights) in cpu_experts.iter().enumerate() {
        layer.experts.upload(0, e as u32, weights).unwrap();
    }
    // Held as stored: FP8 about half of bf16's bytes; INT4 four bits a weight and a bf16
    // scale a group (a quarter of bf16 with groups of 32, a third with groups of 12).
    let bf16_bytes = num_experts * 3 * h * i * 2;
    let held = layer.experts.weight_bytes();
    match form {
        Form::Bf16 => assert_eq!(held, bf16_bytes),
        Form::Fp8(_) => assert!(held * 2 < bf16_bytes * 11 / 10, "{held} bytes"),
        Form::Int4(group) => {
            let bits = 4.0 + 16.0 / group as f64;
            let expected = (bf16_bytes / 2) as f64 * bits / 8.0;
            assert!(
                (held as f64) < expected * 1.02,
                "{held} bytes, {expected} expected"
            )
        }
    }
    // cuBLAS's grouped GEMM (quantized experts widened first: in batches of 5 experts, then
    // all at once), then the grouped GEMV kernel where every expert has at most 8 rows (1
    // and 7 tokens; 128 tokens falls back to cuBLAS).
    for (tokens, gemv_rows, widen_batch) in [
        (1, 0, 5),
        (7, 0, 5),
        (128, 0, 5),
        (128, 0, num_experts),
        (1, 8, 5),
        (7, 8, 5),
        (128, 8, 5),
    ] {
        layer.experts.gemv_rows = gemv_rows;
        layer.experts.widen_batch = widen_batch;
        let x = values(tokens * h, 7 + tokens as u64, 1.0);
        layer.set_input(&x).unwrap();
        layer.forward(tokens).unwrap();
        let out = layer.output(tokens).unwrap();
        let routing = layer.routing(tokens).unwrap();
        let (ids, weights, logits) = (routing.ids, routing.weights, routing.logits);

        // The router GEMM: f32 accumulation of bf16 products.
        let xf = widen(&x);
        let router = widen(&gate.router);
        let mut worst_logit = 0f32;
        for t in 0..tokens {
            for e in 0..num_experts {
                let dot: f32 = (0..h).map(|c| xf[t * h + c] * router[e * h + c]).sum();
                worst_logit = worst_logit.max((dot - logits[t * num_experts + e]).abs());
            }
        }
        assert!(worst_logit < 1e-3, "router logits off by {worst_logit}");

        // Gating on the GPU's logits equals the CPU's on the same logits.
        let expected = route(
            &gating,
            &logits,
            num_experts,
            top_k,
            gate.correction_bias.as_deref(),
        );
        let got_ids: Vec<u32> = ids.iter().map(|&v| v as u32).collect();
        assert_eq!(got_ids, expected.experts, "{tokens} tokens: experts chosen");
        assert_eq!(weights.len(), expected.weights.len(), "gate weights");
        for (a, b) in weights.iter().zip(&expected.weights) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "gate weight {a} vs {b}"
            );
        }

        // The layer: group, expert FFN on the CPU from the same bf16 weights, combine.
        let plan = DispatchPlan::new(&expected, num_experts);
        let grouped = plan.gather(&xf, h);
        let mut expert_out = Vec::with_capacity(grouped.len());
        for (g, &e) in plan.experts.iter().enumerate() {
            let rows = plan.group(g);
            let input = &grouped[rows.start * h..rows.end * h];
            expert_out.extend(cpu_experts[e as usize].forward_with(input, rows.len(), false));
        }
        let mut reference = vec![0f32; tokens * h];
        plan.combine(&expert_out, h, &mut reference);
        let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(out.len(), reference.len(), "{tokens} tokens: outputs");
        let worst = out
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, |m, d| if d.is_nan() || d > m { d } else { m });
        eprintln!(
            "{} {tokens} tokens, gemv_rows {gemv_rows}, widen_batch {widen_batch}: largest \
             difference {worst:e} of outputs up to {scale:e}",
            storage.describe()
        );
        // bf16 rounding of the gate|up outputs and the activation, as the engine's GPU path.
        assert!(
            worst <= 0.03 * scale,
            "layer output off by {worst} (scale {scale})"
        );
        assert_eq!(layer.last_active_experts, plan.experts.len());
    }
}

#[test]
fn softmax_gated_layer_matches_the_cpu() {
    check_layer(
        GatingConfig::Softmax { renormalize: true },
        64,
        8,
        false,
        Form::Bf16,
    );
}

/// FP8 experts held as stored: blocks that leave partial ones at the edges, and columns that
/// are not a multiple of the kernels' eight (a chunk of eight spans two blocks).
#[test]
fn fp8_experts_held_as_stored_match_the_cpu() {
    check_layer(
        GatingConfig::Softmax { renormalize: true },
        64,
        8,
        false,
        Form::Fp8([48, 20]),
    );
}

/// INT4 experts held as stored, in the published groups of 32 and in groups of 12 (a chunk
/// of eight spans two groups).
#[test]
fn int4_experts_held_as_stored_match_the_cpu() {
    for group in [32, 12] {
        check_layer(
            GatingConfig::Softmax { renormalize: true },
            64,
            8,
            false,
            Form::Int4(group),
        );
    }
}

#[test]
fn sigmoid_grouped_layer_with_correction_bias_matches_the_cpu() {
    check_layer(
        GatingConfig::SigmoidGrouped {
            n_group: 8,
            topk_group: 4,
            normalize: true,
            routed_scaling_factor: 2.5,
        },
        64,
        6,
        true,
        Form::Bf16,
    );
}

#[test]
fn softmax_without_renormalising_at_many_experts_matches_the_cpu() {
    check_layer(
        GatingConfig::Softmax { renormalize: false },
        384,
        16,
        false,
        Form::Bf16,
    );
}

/// A CUDA context and stream on GPU 0 with the dense kernels loaded.
struct Dense {
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
    kernels: moe_node::compute::cuda::dense::DenseKernels,
}

/// `--load-format dummy` makes a GPU's experts on the device: the very bits the host would
/// make and upload.
#[test]
fn dummy_experts_made_on_the_gpu_equal_the_hosts() {
    let Some(gpu) = gpu_or_skip() else { return };
    let source = ModelSource {
        dir: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kimi_k2"),
        load_format: LoadFormat::Dummy,
        num_layers: None,
        remote: None,
    };
    let config = source.config().unwrap();
    let checkpoint = source.checkpoint(&config).unwrap();
    let experts: Vec<(usize, u32)> = (0..config.num_layers)
        .filter(|&l| config.moe_layers[l])
        .flat_map(|l| (0..config.moe.num_experts as u32).map(move |e| (l, e)))
        .collect();
    let options = GpuOptions {
        max_rows: 64,
        memory_fraction: 0.5,
        kernel_cache: None,
    };
    let held = load_experts(&gpu, &options, &checkpoint, &config, &experts).unwrap();
    for &(layer, expert) in &experts {
        let device = held.download(layer, expert).unwrap().unwrap();
        let host = load_expert(&checkpoint, &config, layer, expert as usize).unwrap();
        assert!(
            matches!(host, ExpertWeights::Bf16(_)),
            "dummy experts are bf16"
        );
        let (h, i) = (config.hidden_size, config.moe.expert_intermediate_size);
        let host = ExpertStorage::Bf16.pack(&host, h, i).unwrap();
        assert!(device == host, "layer {layer}, expert {expert}");
    }
}

fn dense_or_skip() -> Option<Dense> {
    let gpu = gpu_or_skip()?;
    let ctx = cudarc::driver::CudaContext::new(gpu.ordinal).unwrap();
    let kernels = moe_node::compute::cuda::dense::DenseKernels::load(&ctx, &gpu, None).unwrap();
    Some(Dense {
        stream: ctx.default_stream(),
        kernels,
    })
}

impl Dense {
    fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        v: &[T],
    ) -> (cudarc::driver::CudaSlice<T>, u64) {
        let slice = self.stream.clone_htod(v).unwrap();
        let (ptr, _) = cudarc::driver::DevicePtr::device_ptr(&slice, &self.stream);
        (slice, ptr)
    }

    fn download(&self, slice: &cudarc::driver::CudaSlice<f32>) -> Vec<f32> {
        self.stream.synchronize().unwrap();
        self.stream.clone_dtoh(slice).unwrap()
    }
}

#[test]
fn rms_norm_matches_the_cpu_on_the_gpu() {
    let Some(d) = dense_or_skip() else { return };
    let (rows, width, eps) = (5usize, 7168usize, 1e-6f32);
    let x: Vec<f32> = common::values(rows * width, 41)
        .iter()
        .map(|v| v * 3.0)
        .collect();
    let w: Vec<f32> = common::values(width, 42)
        .iter()
        .map(|v| 1.0 + v * 0.1)
        .collect();
    let (xs, xp) = d.upload(&x);
    let (_ws, wp) = d.upload(&w);
    // In place, as the engine will use it.
    // SAFETY: the buffers were uploaded above with the shapes the case states.
    unsafe {
        d.kernels
            .rms_norm(&d.stream, xp, rows, width, width, wp, eps, xp)
    }
    .unwrap();
    let expected = moe_node::compute::cpu::rms_norm(&x, &w, eps);
    assert_close(&d.download(&xs), &expected, 1e-5, "rms_norm");
}

#[test]
fn rope_matches_the_cpu_on_the_gpu() {
    for (interleaved, scaling) in [
        (false, moe_node::model::config::RopeScaling::None),
        (true, common::yarn()),
    ] {
        let Some(d) = dense_or_skip() else { return };
        let c = RopeCase::new(interleaved, scaling);
        let (xs, xp) = d.upload(&c.x);
        let (_c, cp) = d.upload(&c.cos);
        let (_s, sp) = d.upload(&c.sin);
        // SAFETY: the buffers were uploaded above with the shapes the case states.
        unsafe {
            d.kernels.rope(
                &d.stream,
                xp,
                c.rows,
                c.heads,
                c.head_width,
                c.offset,
                c.rope_dim,
                cp,
                sp,
                interleaved,
            )
        }
        .unwrap();
        assert_close(&d.download(&xs), &c.expected(), 1e-6, "rope");
    }
}

#[test]
fn attention_matches_the_cpu_on_the_gpu() {
    use moe_node::compute::cuda::dense::{BlockTable, PagedCache};
    for (mla, window) in [(false, 0), (false, 4), (true, 0)] {
        let Some(d) = dense_or_skip() else { return };
        let c = AttentionCase::new(mla, window);
        let shape = c.shape;
        let (keys, values) = (
            common::paged(&c.keys, shape.kv_stride),
            common::paged(&c.values, shape.kv_stride),
        );
        assert_eq!(keys.table, values.table);
        // The GPU's caches are bf16 (the case's values are bf16-exact).
        let narrow = |pool: &[f32]| pool.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
        let (_kp, key_pool) = d.upload(&narrow(&keys.pool));
        let (_vp, value_pool) = d.upload(&narrow(&values.pool));
        let (_t, blocks) = d.upload(&keys.table);
        let cache = PagedCache {
            keys: key_pool,
            values: value_pool,
            table: BlockTable {
                blocks,
                stride: keys.table_stride,
            },
        };
        let seqs: Vec<i32> = c.rows.iter().map(|r| r.0 as i32).collect();
        let positions: Vec<i32> = c.rows.iter().map(|r| r.1 as i32).collect();
        let (_rs, row_seq) = d.upload(&seqs);
        let (_rp, row_pos) = d.upload(&positions);
        let (_q, q) = d.upload(&c.q);
        let (out, out_ptr) = d.upload(&vec![0f32; c.rows.len() * shape.heads * shape.value_width]);
        // SAFETY: the buffers were uploaded above with the shapes the case states.
        unsafe {
            d.kernels.attend(
                &d.stream,
                &shape,
                q,
                (c.rows.len(), None),
                &cache,
                (row_seq, row_pos),
                0,
                out_ptr,
            )
        }
        .unwrap();
        assert_close(&d.download(&out), &c.expected(), 1e-5, "attention");
    }
}

/// A GPU takes experts while serving, as a new placement's copies: the taken ones run as
/// the CPU computes them, released slots take the next experts without new memory, and a
/// share with an expert of another shape, or more than the memory allowed, is refused whole.
#[test]
fn a_gpu_takes_and_releases_experts_while_serving() {
    use moe_node::compute::cuda::GpuExperts;
    use moe_node::compute::cuda::experts::RunOutcome;
    let Some(gpu) = gpu_or_skip() else { return };
    let (h, i) = (64, 32);
    let experts: Vec<ExpertWeights> = (0..6u64)
        .map(|e| random_expert(Form::Bf16, h, i, 500 + 3 * e))
        .collect();
    let shape = ExpertShape {
        hidden: h,
        intermediate: i,
        num_experts: 6,
        max_rows: 16,
        host_io: true,
        storage: ExpertStorage::Bf16,
        activation: Default::default(),
        biases: false,
    };
    let mut held = GpuExperts::new(&gpu, shape, &[(0, 0), (0, 1)], 0.5, None).unwrap();
    held.upload(0, 0, &experts[0]).unwrap();
    held.upload(0, 1, &experts[1]).unwrap();
    let rows = widen(&values(3 * h, 41, 1.0));
    let check = |held: &mut GpuExperts, expert: u32| match held.run(0, &[(expert, &rows)]).unwrap()
    {
        RunOutcome::Done(out) => {
            let expected = experts[expert as usize].forward_with(&rows, 3, false);
            assert_close(&out[0], &expected, 0.03, &format!("expert {expert} taken"));
        }
        RunOutcome::NotHeld(e) => panic!("expert {e} not held"),
    };
    let slots_at_load = held.slot_bytes_allocated();
    let share = |ids: &[u32]| -> Vec<((usize, u32), &ExpertWeights)> {
        ids.iter()
            .map(|&e| ((0, e), &experts[e as usize]))
            .collect()
    };
    assert_eq!(held.take(&share(&[2, 3]), 0.5).unwrap(), 4);
    check(&mut held, 2);
    check(&mut held, 3);
    check(&mut held, 0);
    assert_eq!(held.slot_bytes_allocated(), slots_at_load * 2);
    // Two let go of; two others take their slots.
    assert_eq!(held.release(|&(_, e)| e != 0 && e != 2), 2);
    assert!(matches!(
        held.run(0, &[(2, &rows)]).unwrap(),
        RunOutcome::NotHeld(2)
    ));
    assert_eq!(held.take(&share(&[4, 5]), 0.5).unwrap(), 4);
    assert_eq!(
        held.slot_bytes_allocated(),
        slots_at_load * 2,
        "released slots reused"
    );
    check(&mut held, 4);
    check(&mut held, 5);
    check(&mut held, 1);
    // A share with one expert of another shape: refused whole, before anything is written.
    // (An FP8 expert on this bf16 GPU is widened, as at load.)
    let wrong = random_expert(Form::Bf16, h, 2 * i, 900);
    let fp8 = random_expert(Form::Fp8([16, 16]), h, i, 901);
    let refused = held
        .take(&[((0, 2), &fp8), ((0, 0), &wrong)], 0.5)
        .unwrap_err()
        .to_string();
    assert!(refused.contains("expert 0 of layer 0"), "{refused}");
    assert_eq!(held.experts_held(), 4);
    assert!(matches!(
        held.run(0, &[(2, &rows)]).unwrap(),
        RunOutcome::NotHeld(2)
    ));
    // More than the memory allowed: refused, naming the GPU's budget.
    let many: Vec<ExpertWeights> = (0..4u64)
        .map(|e| random_expert(Form::Bf16, h, i, 700 + e))
        .collect();
    let share: Vec<((usize, u32), &ExpertWeights)> = many
        .iter()
        .enumerate()
        .map(|(e, w)| ((1, e as u32), w))
        .collect();
    let refused = held.take(&share, 1e-12).unwrap_err().to_string();
    assert!(refused.contains("MiB"), "{refused}");
    assert_eq!(held.experts_held(), 4);
}

/// Caches on a GPU take blocks of 16 positions from its pool: with a pool of two blocks, a
/// 20-token prompt takes both; a second sequence's step then fails with a clear error (the
/// batcher's budget keeps a serving node from getting there), and runs once the first
/// sequence's cache is dropped and its blocks are back.
#[test]
fn gpu_kv_caches_take_blocks_of_the_pool_and_a_full_pool_fails_clearly() {
    use moe_node::engine::SequenceStep;
    if gpu_or_skip().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let spec = moe_node::model::demo::DemoSpec::default();
    moe_node::model::demo::write_demo_model(dir.path(), &spec, |_, _| {}).unwrap();
    let source = ModelSource::files(dir.path());
    let engine = moe_node::engine::gpu::engine_on_gpu(&source, 0, true, None, None).unwrap();
    engine.reserve_kv_cache(2).unwrap();
    let long: Vec<u32> = (0..20).map(|t| 30 + t).collect();
    let mut first = engine.new_cache();
    engine
        .forward(&mut [SequenceStep::new(&mut first, &long)])
        .unwrap();
    let mut second = engine.new_cache();
    let error = engine
        .forward(&mut [SequenceStep::new(&mut second, &[256, 7, 8])])
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("the GPU's KV cache is full: 1 more blocks needed, 0 of 2 free"),
        "{error}"
    );
    assert_eq!(second.len(), 0, "a failed step extends no cache");
    drop(first);
    let logits = engine
        .forward(&mut [SequenceStep::new(&mut second, &[256, 7, 8])])
        .unwrap();
    assert_eq!(logits[0].len(), engine.config().vocab_size);
    assert_eq!(second.len(), 3);
}

/// The SwiGLU kernel's three activations against the CPU's: plain, gpt-oss's clamped one and
/// DeepSeek-V4's, on FP8 experts (the activation a quantized block carries) and on bf16 ones
/// (V4's clamp read off their projections), with inputs large enough that the clamps bite;
/// an expert with another activation than the GPU's is refused by name.
#[test]
fn the_swiglu_kernel_computes_each_activation_as_the_cpu() {
    use moe_node::compute::cuda::GpuExperts;
    use moe_node::compute::cuda::experts::RunOutcome;
    use moe_node::compute::quant::SwiGluActivation;
    let Some(gpu) = gpu_or_skip() else { return };
    let (h, i) = (64, 32);
    let rows = widen(&values(4 * h, 77, 3.0));
    let activations = [
        SwiGluActivation::Silu,
        SwiGluActivation::ClampedGptOss {
            alpha: 1.702,
            limit: 0.5,
        },
        SwiGluActivation::Clamped { limit: 0.4 },
    ];
    for activation in activations {
        for form in [Form::Fp8([16, 16]), Form::Bf16] {
            let expert = match (random_expert(form, h, i, 700), activation) {
                (ExpertWeights::Quantized(mut q), _) => {
                    q.activation = activation;
                    ExpertWeights::Quantized(q)
                }
                (bf16 @ ExpertWeights::Bf16(_), SwiGluActivation::Silu) => bf16,
                (ExpertWeights::Bf16(mut b), SwiGluActivation::Clamped { limit }) => {
                    b.gate.clamp = Some([f32::NEG_INFINITY, limit]);
                    b.up.clamp = Some([-limit, limit]);
                    ExpertWeights::Bf16(b)
                }
                // gpt-oss's activation is a quantized block's or folded into f32 weights.
                _ => continue,
            };
            let shape = ExpertShape {
                hidden: h,
                intermediate: i,
                num_experts: 2,
                max_rows: 16,
                host_io: true,
                storage: ExpertStorage::of(&expert, h, i).0,
                activation,
                biases: false,
            };
            let mut held = GpuExperts::new(&gpu, shape, &[(0, 0), (0, 1)], 0.5, None).unwrap();
            held.upload(0, 0, &expert).unwrap();
            let expected = expert.forward_with(&rows, 4, false);
            match held.run(0, &[(0, &rows)]).unwrap() {
                RunOutcome::Done(out) => {
                    assert_close(&out[0], &expected, 0.03, &format!("{activation:?}"))
                }
                RunOutcome::NotHeld(e) => panic!("expert {e} not held"),
            }
            // The clamps bite: the unclamped block computes something else.
            if activation != SwiGluActivation::Silu {
                let plain = match &expert {
                    ExpertWeights::Quantized(q) => {
                        let mut q = q.clone();
                        q.activation = SwiGluActivation::Silu;
                        ExpertWeights::Quantized(q)
                    }
                    ExpertWeights::Bf16(b) => {
                        let mut b = b.clone();
                        (b.gate.clamp, b.up.clamp) = (None, None);
                        ExpertWeights::Bf16(b)
                    }
                    ExpertWeights::F32(_) => unreachable!(),
                };
                let unclamped = plain.forward_with(&rows, 4, false);
                let largest = expected.iter().fold(0f32, |m, v| m.max(v.abs()));
                let apart = unclamped
                    .iter()
                    .zip(&expected)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    apart > 0.1 * largest,
                    "{activation:?}: the clamps change nothing"
                );
                let err = held.upload(0, 1, &plain).unwrap_err().to_string();
                assert!(err.contains("activation"), "{err}");
            }
        }
    }
}

/// Experts with biases (gpt-oss's) on a GPU: each group's rows get its own expert's biases
/// after both products, through the GEMV kernel (a few rows) and the widened grouped GEMM
/// (more), as the CPU computes them; an expert without biases is refused by a GPU whose
/// experts have them.
#[test]
fn biases_are_added_per_group_after_both_products() {
    use moe_node::compute::cuda::GpuExperts;
    use moe_node::compute::cuda::experts::RunOutcome;
    use moe_node::compute::quant::SwiGluActivation;
    let Some(gpu) = gpu_or_skip() else { return };
    let (h, i) = (64, 32);
    let activation = SwiGluActivation::ClampedGptOss {
        alpha: 1.702,
        limit: 7.0,
    };
    let biased = |seed: u64| {
        let ExpertWeights::Quantized(mut q) = random_expert(Form::Fp8([16, 16]), h, i, seed) else {
            unreachable!()
        };
        q.activation = activation;
        for (n, m) in [&mut q.gate, &mut q.up, &mut q.down]
            .into_iter()
            .enumerate()
        {
            let b = widen(&values(m.out_features, seed * 7 + n as u64, 0.5));
            m.bias = Some(b);
        }
        ExpertWeights::Quantized(q)
    };
    let experts = [biased(800), biased(810)];
    let shape = ExpertShape {
        hidden: h,
        intermediate: i,
        num_experts: 2,
        max_rows: 32,
        host_io: true,
        storage: ExpertStorage::of(&experts[0], h, i).0,
        activation,
        biases: true,
    };
    let mut held = GpuExperts::new(&gpu, shape, &[(0, 0), (0, 1)], 0.5, None).unwrap();
    held.upload(0, 0, &experts[0]).unwrap();
    held.upload(0, 1, &experts[1]).unwrap();
    for (a, b) in [(3, 5), (12, 9)] {
        let (x0, x1) = (
            widen(&values(a * h, 31, 1.0)),
            widen(&values(b * h, 32, 1.0)),
        );
        match held.run(0, &[(0, &x0), (1, &x1)]).unwrap() {
            RunOutcome::Done(out) => {
                for (n, (x, rows)) in [(&x0, a), (&x1, b)].into_iter().enumerate() {
                    let expected = experts[n].forward_with(x, rows, false);
                    assert_close(
                        &out[n],
                        &expected,
                        0.03,
                        &format!("{rows} rows, expert {n}"),
                    );
                }
            }
            RunOutcome::NotHeld(e) => panic!("expert {e} not held"),
        }
    }
    let ExpertWeights::Quantized(mut plain) = experts[0].clone() else {
        unreachable!()
    };
    (plain.gate.bias, plain.up.bias, plain.down.bias) = (None, None, None);
    let err = held
        .upload(0, 1, &ExpertWeights::Quantized(plain))
        .unwrap_err()
        .to_string();
    assert!(err.contains("biases"), "{err}");
}
