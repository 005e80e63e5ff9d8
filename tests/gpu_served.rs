//! The served GPU path keeps an MoE layer's rows on the GPU: the gate, the grouping by
//! expert, the experts and the combine run where the dense part is, and the host sees only
//! the step's embeddings, positions and logits and each layer's group sizes. Checked on
//! GPUs emulated on the CPU (where the emulated driver counts every copy) and, under
//! `tests/gpu/run.sh`, on a real GPU (where only the outputs are checked).
//!
//! One test function: the emulated driver's copy counters are the process's, so nothing
//! else may run on the GPUs while a step is counted.

mod common;

use std::sync::Arc;

use moe_node::compute::cuda::emulated;
use moe_node::engine::{Engine, SequenceStep};
use moe_node::experts::{ExpertError, ExpertExecutor};
use moe_node::model::ModelSource;
use moe_node::model::demo::{DemoSpec, write_demo_model};
use moe_node::moe::DispatchPlan;

/// An executor that takes rows from the host only: the engine routes on the host, as it
/// did before rows stayed on the GPU.
struct HostRows(Arc<dyn ExpertExecutor>);

impl ExpertExecutor for HostRows {
    fn run(
        &self,
        layer: usize,
        plan: &DispatchPlan,
        grouped_input: &[f32],
    ) -> Result<Vec<f32>, ExpertError> {
        self.0.run(layer, plan, grouped_input)
    }
}

/// Host↔device bytes of `step`, where the GPUs are emulated.
fn host_bytes<T>(step: impl FnOnce() -> T) -> (T, Option<u64>) {
    let before = emulated::counters();
    let out = step();
    let moved = match (before, emulated::counters()) {
        (Some(a), Some(b)) => {
            Some((b.host_to_device - a.host_to_device) + (b.device_to_host - a.device_to_host))
        }
        _ => None,
    };
    (out, moved)
}

fn greedy(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold(
            (0, f32::MIN),
            |best, (i, &v)| if v > best.1 { (i, v) } else { best },
        )
        .0 as u32
}

#[test]
fn an_moe_layer_keeps_its_rows_on_the_gpu() {
    if common::gpus("rows kept on the GPU").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let spec = DemoSpec::default();
    write_demo_model(dir.path(), &spec, |_, _| {}).unwrap();
    let source = ModelSource::files(dir.path());
    let load = || moe_node::engine::gpu::engine_on_gpu(&source, 0, true, None, None).unwrap();
    let on_device: Engine = load();
    let mut on_host = load();
    on_host.wrap_experts(|experts| Arc::new(HostRows(experts)));
    let config = on_device.config().clone();
    let (h, vocab) = (config.hidden_size, config.vocab_size);
    let moe_layers = config.moe_layers.iter().filter(|&&m| m).count();
    let experts = config.moe.num_experts;
    assert!(moe_layers >= 2, "the demo model has MoE layers to count");

    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| vec![256, 10 + i, 20 + i % 3, 40 + 5 * i, 7])
        .collect();
    let mut device_caches: Vec<_> = prompts.iter().map(|_| on_device.new_cache()).collect();
    let mut host_caches: Vec<_> = prompts.iter().map(|_| on_host.new_cache()).collect();
    let step = |engine: &Engine, caches: &mut [moe_node::engine::KvCache], tokens: &[Vec<u32>]| {
        let mut batch: Vec<SequenceStep> = caches
            .iter_mut()
            .zip(tokens)
            .map(|(cache, tokens)| SequenceStep::new(cache, tokens))
            .collect();
        engine.forward(&mut batch).unwrap()
    };
    let mut device_logits = step(&on_device, &mut device_caches, &prompts);
    let mut host_logits = step(&on_host, &mut host_caches, &prompts);
    let mut worst = 0f32;
    let mut agree = 0;
    let mut compared = 0;
    let steps = 6;
    let rows = prompts.len();
    for s in 0..=steps {
        for (d, hst) in device_logits.iter().zip(&host_logits) {
            let diff = d
                .iter()
                .zip(hst)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            worst = worst.max(diff);
            agree += usize::from(greedy(d) == greedy(hst));
            compared += 1;
        }
        if s == steps {
            break;
        }
        // Both engines take the same tokens: the device path's greedy choices.
        let next: Vec<Vec<u32>> = device_logits.iter().map(|l| vec![greedy(l)]).collect();
        let (logits, device_bytes) = host_bytes(|| step(&on_device, &mut device_caches, &next));
        device_logits = logits;
        let (logits, host_path_bytes) = host_bytes(|| step(&on_host, &mut host_caches, &next));
        host_logits = logits;
        let (Some(device_bytes), Some(host_path_bytes)) = (device_bytes, host_path_bytes) else {
            if s == 0 {
                common::skipped("copies not counted: a real GPU's driver does not count them");
            }
            continue;
        };
        // What a decode step must move: each row's embedding in and logits out, its rotary
        // values and position, the cache pointers (the 4 KiB), and for each MoE layer its
        // group sizes back and the expert products' pointer arrays and row counts (8
        // pointers and a count per group) in. One layer's grouped rows in bf16, either way,
        // would be more than the 4 KiB.
        let groups = rows * config.moe.top_k;
        assert!(groups * h * 2 > 4 << 10);
        let per_step =
            rows * (h + vocab) * 4 + moe_layers * ((experts + 1) * 4 + groups * 68) + (4 << 10);
        assert!(
            device_bytes as usize <= per_step,
            "decode step {s}: {device_bytes} bytes between host and GPU, more than the \
             {per_step} a step needs without rows of its MoE layers"
        );
        // Routing on the host moves each MoE layer's rows down (f32) and their output up.
        let rows_moved = moe_layers * rows * h * 4 * 2;
        assert!(
            host_path_bytes
                >= device_bytes + rows_moved as u64 - (moe_layers * (experts + 1) * 4) as u64,
            "decode step {s}: routing on the host moved {host_path_bytes} bytes, rows on the \
             GPU {device_bytes}: the difference should be the {rows_moved} bytes of the rows"
        );
        eprintln!(
            "decode step {s}, {rows} rows (hidden {h}, vocabulary {vocab}, {moe_layers} MoE \
             layers): {device_bytes} bytes host<->GPU with rows on the GPU, \
             {host_path_bytes} routing on the host"
        );
    }
    eprintln!(
        "rows on the GPU against routing on the host: largest logit difference {worst:e}, \
         greedy tokens agree in {agree} of {compared}"
    );
    // The GPU's gate takes bf16 rows and weights; the host's multiplies in f32. Tokens
    // near a tie between experts may route differently, which moves their logits.
    assert!(worst <= 0.4, "logits differ by {worst}");
    assert!(
        agree * 10 >= compared * 9,
        "greedy tokens agree in {agree} of {compared}"
    );
}
