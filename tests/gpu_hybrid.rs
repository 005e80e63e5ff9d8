//! A hybrid model (Qwen3.5-MoE: gated DeltaNet layers beside full attention) with its whole
//! dense part on a GPU, where its linear-attention states live in pages of the KV pool: a
//! forked cache goes on exactly as its source, and a step that fails half-way forgets the
//! states it left part-way (the sequence recomputes from its first position). On GPUs emulated on the CPU, or a real one under `tests/gpu/run.sh`.
//! (tests/reference.rs holds the model's logits to the CPU's; tests/hybrid_server.rs serves it.)

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use moe_node::compute::cuda::dense::KV_BLOCK;
use moe_node::engine::batch::KvBudget;
use moe_node::engine::gpu::model::KvPool;
use moe_node::engine::{Engine, KvCache, SequenceStep};
use moe_node::experts::{ExpertError, ExpertExecutor};
use moe_node::model::ModelSource;
use moe_node::moe::DispatchPlan;

fn on_gpu(what: &str) -> Option<Engine> {
    common::engine_on_gpu(what, "qwen3_5_moe")
}

fn step(engine: &Engine, cache: &mut KvCache, tokens: &[u32]) -> Vec<f32> {
    engine
        .forward(&mut [SequenceStep::new(cache, tokens)])
        .unwrap()
        .remove(0)
}

const PROMPT: [u32; 20] = [
    3, 17, 40, 99, 5, 61, 23, 88, 12, 7, 70, 31, 45, 2, 118, 64, 9, 50, 33, 101,
];

#[test]
fn a_forked_cache_goes_on_as_its_source_and_the_states_are_counted_as_the_budget_counts() {
    let Some(engine) = on_gpu("hybrid states on the GPU, forked") else {
        return;
    };
    let config = engine.config();
    // What the GPU's pool gives a sequence's states is what the batcher admits it by.
    let per_position = KvCache::gpu_bytes_per_position(config);
    let budget = KvBudget::of_bytes(1 << 20, per_position)
        .with_state(KvCache::state_bytes(config), per_position);
    assert!(KvPool::state_blocks(config) > 0);
    assert_eq!(budget.state_blocks, KvPool::state_blocks(config));
    assert_eq!(per_position * KV_BLOCK, KvPool::block_bytes(config));

    let mut source = engine.new_cache();
    step(&engine, &mut source, &PROMPT);
    assert!(
        source.has_state(),
        "a hybrid model's GPU cache keeps states"
    );
    let mut fork = engine.fork_cache(&source).unwrap();
    assert_eq!(fork.len(), PROMPT.len());
    let from_source = step(&engine, &mut source, &[77]);
    let from_fork = step(&engine, &mut fork, &[77]);
    assert_eq!(from_source, from_fork, "the fork's states are its source's");
    // Each goes on on its own: the fork another way, the source as a fresh prefill would.
    step(&engine, &mut fork, &[4]);
    let next = step(&engine, &mut source, &[8]);
    let mut all = PROMPT.to_vec();
    all.extend([77, 8]);
    let prefilled = step(&engine, &mut engine.new_cache(), &all);
    let diff = next
        .iter()
        .zip(&prefilled)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(
        diff < 1e-4,
        "the source after its fork went on elsewhere differs from one prefill by {diff}"
    );
}

/// Fails every call while `failing` is set.
struct Failing {
    experts: Arc<dyn ExpertExecutor>,
    failing: Arc<AtomicBool>,
}

impl ExpertExecutor for Failing {
    fn run(
        &self,
        layer: usize,
        plan: &DispatchPlan,
        grouped_input: &[f32],
    ) -> Result<Vec<f32>, ExpertError> {
        if self.failing.load(Ordering::SeqCst) {
            let experts = plan.experts.clone();
            return Err(ExpertError::NoLiveReplica { layer, experts });
        }
        self.experts.run(layer, plan, grouped_input)
    }
}

#[test]
fn a_step_that_fails_half_way_forgets_the_states_it_left_part_way() {
    let Some(mut engine) = on_gpu("hybrid states on the GPU, a failed step") else {
        return;
    };
    let failing = Arc::new(AtomicBool::new(false));
    let flag = failing.clone();
    engine.wrap_experts(|experts| {
        Arc::new(Failing {
            experts,
            failing: flag,
        })
    });
    let mut cache = engine.new_cache();
    step(&engine, &mut cache, &PROMPT[..12]);
    // The step's first MoE layer fails after the linear layer before it updated its states.
    failing.store(true, Ordering::SeqCst);
    let failed = engine.forward(&mut [SequenceStep::new(&mut cache, &PROMPT[12..])]);
    assert!(failed.is_err(), "the step was to fail");
    assert_eq!(cache.len(), 0, "states left part-way must be forgotten");
    failing.store(false, Ordering::SeqCst);
    // Recomputed from the first position, the cache holds what a fresh one would.
    let again = step(&engine, &mut cache, &PROMPT[..12]);
    let fresh = step(&engine, &mut engine.new_cache(), &PROMPT[..12]);
    assert_eq!(
        again, fresh,
        "the recomputed states differ from a fresh cache's"
    );
    let next = step(&engine, &mut cache, &PROMPT[12..]);
    let mut never_failed = engine.new_cache();
    step(&engine, &mut never_failed, &PROMPT[..12]);
    assert_eq!(next, step(&engine, &mut never_failed, &PROMPT[12..]));
}

/// A convolution wider than the GPU's kernel takes is refused when the model loads there,
/// naming the config key, not at its first step.
#[test]
fn a_convolution_the_gpu_cannot_hold_is_refused_at_load() {
    if common::gpus("a too-wide convolution refused on the GPU").is_none() {
        return;
    }
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_5_moe");
    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap())
            .unwrap();
    config["text_config"]["linear_conv_kernel_dim"] = 20.into();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let source = ModelSource {
        load_format: moe_node::model::LoadFormat::Dummy,
        ..ModelSource::files(dir.path())
    };
    match moe_node::engine::gpu::engine_on_gpu(&source, 0, true, None, None) {
        Ok(_) => panic!("a 20-wide convolution loaded on the GPU"),
        Err(e) => {
            let said = e.to_string();
            assert!(
                said.contains("dense part has no") && said.contains("linear_conv_kernel_dim"),
                "{said}"
            );
        }
    }
}
