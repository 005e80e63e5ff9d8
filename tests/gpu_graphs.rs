//! Decode steps replayed from CUDA graphs compute what the same steps compute kernel by
//! kernel, bit for bit, at each batch size, for a GQA model (Qwen3-MoE), an MLA one
//! (DeepSeek-V3) and a hybrid one (Qwen3.5-MoE, its linear layers' states paged); and the emulated driver's capture records what a stream would have run
//! and replays it on the memory as it is at each launch. On GPUs emulated on the CPU, or a
//! real one under `tests/gpu/run.sh`.

mod common;

use cudarc::driver::{CudaContext, sys};
use moe_node::compute::cuda::emulated;
use moe_node::engine::argmax;
use moe_node::engine::{Engine, KvCache, SequenceStep};

fn prompts() -> Vec<Vec<u32>> {
    (0..4u32)
        .map(|s| (0..5 + 3 * s).map(|k| 1 + (k * 7 + s * 29) % 120).collect())
        .collect()
}

/// Prefills each prompt, then decodes `steps` greedy tokens for the first 2 sequences
/// together, then for all 4, then for the first 3 (three batch sizes, the second larger than
/// the first). Every step's logits, in order.
fn decode(engine: &Engine, steps: usize) -> Vec<Vec<f32>> {
    let prompts = prompts();
    let mut caches: Vec<KvCache> = prompts.iter().map(|_| engine.new_cache()).collect();
    let mut next = Vec::new();
    let mut all = Vec::new();
    for (cache, prompt) in caches.iter_mut().zip(&prompts) {
        let logits = engine
            .forward(&mut [SequenceStep::new(cache, prompt)])
            .unwrap()
            .remove(0);
        next.push(argmax(&logits));
        all.push(logits);
    }
    for batch in [2, caches.len(), 3] {
        for _ in 0..steps {
            let tokens: Vec<[u32; 1]> = next[..batch].iter().map(|&t| [t]).collect();
            let mut step: Vec<SequenceStep> = caches[..batch]
                .iter_mut()
                .zip(&tokens)
                .map(|(cache, token)| SequenceStep::new(cache, token))
                .collect();
            let logits = engine.forward(&mut step).unwrap();
            for (i, row) in logits.into_iter().enumerate() {
                next[i] = argmax(&row);
                all.push(row);
            }
        }
    }
    all
}

#[test]
fn decode_steps_replayed_from_graphs_equal_the_kernel_by_kernel_steps() {
    for fixture in ["qwen3_moe", "deepseek_v3", "qwen3_5_moe"] {
        let Some(graphed) = common::engine_on_gpu("decode steps from CUDA graphs", fixture) else {
            return;
        };
        let plain = common::engine_on_gpu("decode steps from CUDA graphs", fixture).unwrap();
        plain.set_cuda_graphs(false);

        let expected = decode(&plain, 3);
        assert_eq!(plain.cuda_graphs(), Some(0));
        let launches_before = emulated::counters().map(|c| c.graph_launches);
        let got = decode(&graphed, 3);
        // Each shape is run plainly once, then captured. The 4-row step needs a larger
        // arena than the 2-row one: growing it dropped the 2-row graphs.
        assert_eq!(graphed.cuda_graphs(), Some(2), "{fixture}: shapes captured");
        if let (Some(before), Some(after)) = (launches_before, emulated::counters()) {
            // Two of each batch's three steps replayed: a graph per layer and the head's.
            let layers = graphed.config().num_layers as u64;
            assert!(
                after.graph_launches - before >= 6 * (layers + 1),
                "{fixture}: {} graph launches",
                after.graph_launches - before
            );
        }
        let same = |got: &[Vec<f32>], when: &str| {
            assert_eq!(got.len(), expected.len());
            for (i, (got, expected)) in got.iter().zip(&expected).enumerate() {
                assert!(
                    got == expected,
                    "{fixture}, {when}: logits {i} differ from the kernel-by-kernel step's"
                );
            }
        };
        same(&got, "first pool");
        // A new KV pool drops the graphs (they read the old one's addresses); new ones are
        // captured over it.
        graphed.reserve_kv_cache(256).unwrap();
        assert_eq!(
            graphed.cuda_graphs(),
            Some(0),
            "{fixture}: graphs of the old pool"
        );
        same(&decode(&graphed, 3), "second pool");
        // The arena kept its size: all three shapes are held this time.
        assert_eq!(
            graphed.cuda_graphs(),
            Some(3),
            "{fixture}: shapes captured again"
        );
    }
}

#[test]
fn a_captured_stream_replays_on_the_memory_as_it_is_at_each_launch() {
    let Some(runtime) = common::gpus("capture and replay of the emulated driver") else {
        return;
    };
    if runtime.emulated.is_none() {
        return common::skipped("the emulated driver's capture rules: a real GPU is in use");
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let source = stream.clone_htod(&[1u32, 2, 3, 4]).unwrap();
    let mut target = stream.alloc_zeros::<u32>(4).unwrap();
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;

    stream.begin_capture(mode).unwrap();
    stream.memcpy_dtod(&source, &mut target).unwrap();
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    assert_eq!(
        stream.clone_dtoh(&target).unwrap(),
        [0, 0, 0, 0],
        "a captured copy ran at the capture"
    );
    graph.launch().unwrap();
    assert_eq!(stream.clone_dtoh(&target).unwrap(), [1, 2, 3, 4]);
    let mut source = source;
    stream.memcpy_htod(&[9u32, 8, 7, 6], &mut source).unwrap();
    graph.launch().unwrap();
    assert_eq!(
        stream.clone_dtoh(&target).unwrap(),
        [9, 8, 7, 6],
        "the replay read the source as it was at the capture"
    );

    // A capture takes no allocation and no copy from host memory: either invalidates it.
    stream.begin_capture(mode).unwrap();
    assert!(stream.alloc_zeros::<u32>(4).is_err());
    assert!(
        stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .is_err()
    );
    stream.begin_capture(mode).unwrap();
    assert!(stream.memcpy_htod(&[1u32], &mut target).is_err());
    assert!(
        stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .is_err()
    );
    // The stream works as before.
    stream.memcpy_htod(&[5u32, 5, 5, 5], &mut target).unwrap();
    assert_eq!(stream.clone_dtoh(&target).unwrap(), [5, 5, 5, 5]);
}
