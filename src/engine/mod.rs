//! The forward pass: embeddings, attention with a KV cache, the MoE layer glue, sampling and
//! the generation loop. The routed experts are reached only through
//! [`crate::experts::ExpertExecutor`], so the same engine runs with experts in this process, on
//! device actors or on other nodes.

mod attention;
pub mod batch;
pub mod deepseek_v4;
pub mod generate;
pub mod gpu;
pub mod grammar;
pub mod kv_cache;
mod linear_attention;
pub mod logprobs;
pub mod moe_layer;
pub mod prefix;
pub mod rope;
mod sampling;
mod sparse_attention;
mod step_pool;

use std::path::Path;
use std::sync::{Arc, Mutex};

use attention::{AttentionInput, Segment, attention};
pub use generate::{FinishReason, GenerateRequest, Generation, generate};
pub use kv_cache::KvCache;
use rope::{Rope, yarn_mscale};
pub use sampling::{Sampler, SamplingParams, argmax};

use crate::compute::cpu::{add_in_place, rms_norm};
use crate::compute::cuda::{CudaError, GpuInfo};
use crate::engine::gpu::model::{DeviceCache, GpuModel};
use crate::experts::{ExpertError, ExpertExecutor, LocalExperts};
use crate::model::config::{AttentionConfig, RopeScaling};
use crate::model::weights::{FeedForward, load_all_experts};
use crate::model::{Checkpoint, DenseWeights, ModelConfig, ModelError, ModelSource};
use moe_layer::{moe_forward, moe_routed};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Expert(#[from] ExpertError),
    #[error("token id {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange { token: u32, vocab_size: usize },
    #[error("{needed} positions needed but the model supports {max}")]
    ContextTooLong { needed: usize, max: usize },
    #[error("the prompt is empty: at least one token is needed")]
    EmptyPrompt,
    #[error("invalid sampling parameters: {0}")]
    InvalidSampling(String),
    #[error("GPU: {0}")]
    Gpu(#[from] CudaError),
    #[error("a cache made by another engine (host and GPU caches do not mix)")]
    ForeignCache,
}

impl EngineError {
    /// Every [`EngineError::reason`], for a metric that exports each from the start.
    pub const REASONS: [&'static str; 5] =
        ["expert_unavailable", "expert", "gpu", "request", "internal"];

    /// What failed, as the failed-generation metric and the API's error code name it:
    /// `expert_unavailable` (no live replica of an expert a token chose), `expert` (another
    /// failure of the expert data plane), `gpu`, `request` (what the request asked for, found
    /// at a step) or `internal`.
    pub fn reason(&self) -> &'static str {
        match self {
            EngineError::Expert(ExpertError::NoLiveReplica { .. }) => "expert_unavailable",
            EngineError::Expert(_) => "expert",
            EngineError::Gpu(_) => "gpu",
            EngineError::TokenOutOfRange { .. }
            | EngineError::ContextTooLong { .. }
            | EngineError::EmptyPrompt
            | EngineError::InvalidSampling(_) => "request",
            EngineError::Model(_) | EngineError::ForeignCache => "internal",
        }
    }
}

/// One sequence's part of a forward step: its cache and the tokens that follow it.
pub struct SequenceStep<'a> {
    pub cache: &'a mut KvCache,
    pub tokens: &'a [u32],
    /// Logits for every one of `tokens`, not only the last (a prompt's log probabilities).
    pub all_logits: bool,
    /// Set by the step when a row of this sequence was routed around an expert with no
    /// live replica (`on_expert_unavailable = "reroute"`): what follows is degraded.
    pub rerouted: bool,
}

impl<'a> SequenceStep<'a> {
    /// `tokens` after `cache`, with the logits of the last one.
    pub fn new(cache: &'a mut KvCache, tokens: &'a [u32]) -> Self {
        SequenceStep {
            cache,
            tokens,
            all_logits: false,
            rerouted: false,
        }
    }
}

/// What the GPU backend lacks of DeepSeek-V4's dense part, which runs on the CPU only (in
/// [`deepseek_v4`]); its experts run on GPUs (their clamped SwiGLU in the kernel) or CPU slots.
pub const DEEPSEEK_V4_APART: &str = "DeepSeek-V4 (`deepseek_v4`) dense parts: its compressed \
    attention (compressor, lightning indexer, window and sinks over one shared key-value head), \
    hash-routed sqrtsoftplus gate and hyper-connections; its dense part runs on the CPU only \
    (devices.dense_on_gpu = false keeps it there while its experts run on GPUs)";

/// A loaded model ready to run steps.
pub struct Engine {
    config: ModelConfig,
    /// Shared by the node's dense replicas ([`Engine::replica`]): one copy in host memory.
    dense: Dense,
    experts: Arc<dyn ExpertExecutor>,
    /// The dense part on a GPU, when placed there; one step at a time on its stream.
    gpu: Option<Mutex<GpuModel>>,
}

/// The dense part of a model in host memory.
#[derive(Clone)]
enum Dense {
    /// Every family's layers but DeepSeek-V4's ([`Engine::run_layers`]).
    Layers(Layers),
    /// DeepSeek-V4's own ([`deepseek_v4`]).
    DeepseekV4(Arc<deepseek_v4::V4Dense>),
}

/// The layers every family but DeepSeek-V4 shares: attention of several kinds (GQA, MLA, with
/// an indexer, linear), a dense MLP or an MoE block.
#[derive(Clone)]
struct Layers {
    weights: Arc<DenseWeights>,
    rope: Rope,
    softmax_scale: f32,
}

impl Engine {
    /// Loads a model directory with every expert held in this process.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        Self::load_source(&ModelSource::files(dir))
    }

    /// Loads the model `source` names with every expert held in this process.
    pub fn load_source(source: &ModelSource) -> Result<Self, ModelError> {
        Self::load_with(source, |checkpoint, config| {
            let experts = load_all_experts(checkpoint, config)?;
            Ok(Arc::new(LocalExperts::new(experts, config.hidden_size)))
        })
    }

    /// Loads a model with its routed experts wherever `experts` puts them.
    pub fn load_with<E: From<ModelError>>(
        source: &ModelSource,
        experts: impl FnOnce(&Checkpoint, &ModelConfig) -> Result<Arc<dyn ExpertExecutor>, E>,
    ) -> Result<Self, E> {
        let config = source.config()?;
        let checkpoint = source.checkpoint(&config)?;
        let experts = experts(&checkpoint, &config)?;
        Ok(Self::from_checkpoint(config, &checkpoint, experts)?)
    }

    /// An engine with the dense part read from `checkpoint` (whichever family's) and the
    /// routed experts wherever `experts` runs them.
    pub fn from_checkpoint(
        config: ModelConfig,
        checkpoint: &Checkpoint,
        experts: Arc<dyn ExpertExecutor>,
    ) -> Result<Self, ModelError> {
        if config.deepseek_v4.is_some() {
            let dense = deepseek_v4::V4Dense::load(checkpoint, &config)?;
            return Ok(Engine {
                config,
                dense: Dense::DeepseekV4(Arc::new(dense)),
                experts,
                gpu: None,
            });
        }
        let weights = DenseWeights::load(checkpoint, &config)?;
        Ok(Self::new(config, weights, experts))
    }

    pub fn new(
        config: ModelConfig,
        weights: DenseWeights,
        experts: Arc<dyn ExpertExecutor>,
    ) -> Self {
        let (interleaved, softmax_scale) = match config.attention {
            AttentionConfig::Gqa {
                head_dim,
                interleave,
                ..
            } => (interleave, (head_dim as f64).powf(-0.5)),
            AttentionConfig::Mla {
                qk_nope_head_dim,
                qk_rope_head_dim,
                interleave,
                ..
            } => {
                let mut scale = ((qk_nope_head_dim + qk_rope_head_dim) as f64).powf(-0.5);
                // DeepSeek folds YaRN's magnitude correction into the softmax scale.
                if let RopeScaling::Yarn {
                    factor,
                    mscale_all_dim: Some(m),
                    ..
                } = config.rope.scaling
                    && m != 0.0
                {
                    let mscale = yarn_mscale(factor, m);
                    scale *= mscale * mscale;
                }
                (interleave, scale)
            }
        };
        Engine {
            dense: Dense::Layers(Layers {
                rope: Rope::new(&config.rope, interleaved),
                softmax_scale: softmax_scale as f32,
                weights: Arc::new(weights),
            }),
            config,
            experts,
            gpu: None,
        }
    }

    /// Another engine for the same model, sharing this one's host weights and routed
    /// experts, with its dense part on the host until placed on a GPU of its own
    /// ([`Engine::place_dense_on_gpu`]): a node's dense replicas, one per GPU, each with its
    /// own KV caches and sequences.
    pub fn replica(&self) -> Engine {
        Engine {
            config: self.config.clone(),
            dense: self.dense.clone(),
            experts: self.experts.clone(),
            gpu: None,
        }
    }

    /// The GPU holding this engine's dense part and KV caches; `None` on the host.
    pub fn dense_gpu(&self) -> Option<usize> {
        let gpu = self.gpu.as_ref()?;
        Some(gpu.lock().unwrap_or_else(|e| e.into_inner()).gpu())
    }

    /// Moves the dense part of the model (attention, norms, dense MLPs, shared experts, lm
    /// head) onto GPU `gpu`, its KV caches with it. Caches made before stay usable only by
    /// an engine on the host.
    pub fn place_dense_on_gpu(
        &mut self,
        gpu: &GpuInfo,
        memory_fraction: f64,
        kernel_cache: Option<&Path>,
    ) -> Result<(), CudaError> {
        let layers = match &self.dense {
            Dense::Layers(layers) => layers,
            Dense::DeepseekV4(_) => {
                let refused = crate::engine::gpu::deepseek_v4_refused(&self.config);
                return Err(refused.unwrap_or_else(|| CudaError::Unsupported("DeepSeek-V4".into())));
            }
        };
        let model = GpuModel::load(
            gpu,
            &self.config,
            &layers.weights,
            layers.softmax_scale,
            layers.rope.interleaved(),
            memory_fraction,
            kernel_cache,
        )?;
        self.gpu = Some(Mutex::new(model));
        Ok(())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Puts `wrap`'s executor in front of the routed experts, e.g. one that records where
    /// each token was routed (the reference tests tell routing flips from errors with it).
    pub fn wrap_experts(
        &mut self,
        wrap: impl FnOnce(Arc<dyn ExpertExecutor>) -> Arc<dyn ExpertExecutor>,
    ) {
        self.experts = wrap(self.experts.clone());
    }

    /// Free memory of the GPU the KV caches live on; `None` when they are in host memory.
    pub fn cache_gpu_free_memory(&self) -> Option<Result<usize, CudaError>> {
        let gpu = self.gpu.as_ref()?;
        let model = gpu.lock().unwrap_or_else(|e| e.into_inner());
        Some(model.free_memory())
    }

    /// The GPU's KV pool: its free blocks and all its blocks (`None` with the caches in host
    /// memory, or before the pool's first use).
    pub fn gpu_kv_blocks(&self) -> Option<(usize, usize)> {
        let gpu = self.gpu.as_ref()?;
        gpu.lock().unwrap_or_else(|e| e.into_inner()).kv_blocks()
    }

    /// Turns the CUDA graphs of decode steps on or off where the dense part is on a GPU
    /// (on by default).
    pub fn set_cuda_graphs(&self, on: bool) {
        if let Some(gpu) = &self.gpu {
            gpu.lock()
                .unwrap_or_else(|e| e.into_inner())
                .set_cuda_graphs(on);
        }
    }

    /// Step shapes the GPU holds CUDA graphs of (`None` with the dense part on the host).
    pub fn cuda_graphs(&self) -> Option<usize> {
        let gpu = self.gpu.as_ref()?;
        Some(
            gpu.lock()
                .unwrap_or_else(|e| e.into_inner())
                .cuda_graphs()
                .0,
        )
    }

    /// Decode steps replayed from CUDA graphs so far (0 with the dense part on the host).
    pub fn cuda_graph_steps(&self) -> u64 {
        self.gpu.as_ref().map_or(0, |gpu| {
            gpu.lock()
                .unwrap_or_else(|e| e.into_inner())
                .cuda_graphs()
                .1
        })
    }

    /// Allocates the GPU's pool of KV cache blocks at `blocks` blocks (the batcher's budget)
    /// where the dense part is on a GPU; nothing on the host, whose caches are not pooled.
    pub fn reserve_kv_cache(&self, blocks: usize) -> Result<(), CudaError> {
        match &self.gpu {
            Some(gpu) => gpu
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .reserve_kv_cache(blocks),
            None => Ok(()),
        }
    }

    pub fn new_cache(&self) -> KvCache {
        match &self.gpu {
            Some(_) => KvCache::on_device(DeviceCache::new(&self.config)),
            None => KvCache::new(&self.config),
        }
    }

    /// A copy of `cache` that grows on its own: the choices of a request with `n` > 1 start
    /// from one prefilled prompt.
    pub fn fork_cache(&self, cache: &KvCache) -> Result<KvCache, EngineError> {
        match (&self.gpu, &cache.device) {
            (None, None) => cache.host_copy().ok_or(EngineError::ForeignCache),
            (Some(gpu), Some(device)) => {
                let model = gpu.lock().unwrap_or_else(|e| e.into_inner());
                let copy = model.copy_cache(device, cache.len())?;
                Ok(KvCache::on_device(copy).with_len(cache.len()))
            }
            _ => Err(EngineError::ForeignCache),
        }
    }

    /// Runs one step for a batch of sequences and returns, for each, the logits after its
    /// last new token (`[vocab]`), or after every new token when it asks for all
    /// (`[tokens, vocab]`). Caches are extended only when the whole step succeeds.
    ///
    /// The step computes on the step pool ([`step_pool`]), whatever thread calls it.
    pub fn forward(&self, batch: &mut [SequenceStep]) -> Result<Vec<Vec<f32>>, EngineError> {
        step_pool::run(|| self.forward_here(batch))
    }

    fn forward_here(&self, batch: &mut [SequenceStep]) -> Result<Vec<Vec<f32>>, EngineError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let cfg = &self.config;
        let h = cfg.hidden_size;
        let mut segments = Vec::with_capacity(batch.len());
        let mut rows = 0;
        for step in batch.iter() {
            if step.tokens.is_empty() {
                return Err(EngineError::EmptyPrompt);
            }
            if step.cache.device.is_some() != self.gpu.is_some() {
                return Err(EngineError::ForeignCache);
            }
            if let Some(&token) = step.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(EngineError::TokenOutOfRange {
                    token,
                    vocab_size: cfg.vocab_size,
                });
            }
            let needed = step.cache.len() + step.tokens.len();
            if needed > cfg.max_position_embeddings {
                return Err(EngineError::ContextTooLong {
                    needed,
                    max: cfg.max_position_embeddings,
                });
            }
            segments.push(Segment {
                rows: rows..rows + step.tokens.len(),
                start_position: step.cache.len(),
            });
            rows += step.tokens.len();
        }
        let layers = match &self.dense {
            Dense::Layers(layers) => layers,
            Dense::DeepseekV4(v4) => return v4.forward(cfg, self.experts.as_ref(), batch),
        };

        let mut hidden = Vec::with_capacity(rows * h);
        let mut angles = Vec::with_capacity(rows);
        for (step, segment) in batch.iter().zip(&segments) {
            for (i, &token) in step.tokens.iter().enumerate() {
                let t = token as usize;
                layers.weights.embed_tokens.extend_with_row(t, &mut hidden);
                angles.push(layers.rope.angles(segment.start_position + i));
            }
        }
        // The rows whose logits are returned, and how many belong to each sequence.
        let mut logit_rows = Vec::with_capacity(segments.len());
        let mut rows_per_sequence = Vec::with_capacity(segments.len());
        for (step, segment) in batch.iter().zip(&segments) {
            let first = if step.all_logits {
                segment.rows.start
            } else {
                segment.rows.end - 1
            };
            logit_rows.extend(first..segment.rows.end);
            rows_per_sequence.push(segment.rows.end - first);
        }
        let mut rerouted = vec![false; rows];
        let mut caches: Vec<&mut KvCache> = batch.iter_mut().map(|s| &mut *s.cache).collect();
        let logits = match &self.gpu {
            Some(gpu) => self
                .forward_on_gpu(
                    (gpu, &layers.weights),
                    (&hidden, &angles),
                    (&segments, &logit_rows),
                    &mut caches,
                    &mut rerouted,
                )
                .map(|logits| split_logits(logits, &rows_per_sequence, cfg.vocab_size)),
            None => self.forward_on_host(
                layers,
                (hidden, &angles),
                (&segments, &logit_rows),
                &mut caches,
                (&rows_per_sequence, &mut rerouted),
            ),
        }?;
        drop(caches);
        for (step, segment) in batch.iter_mut().zip(&segments) {
            step.rerouted = rerouted[segment.rows.clone()].iter().any(|&r| r);
        }
        Ok(logits)
    }

    /// [`Engine::forward`]'s layers, final norm and lm head on the host.
    fn forward_on_host(
        &self,
        layers: &Layers,
        (mut hidden, angles): (Vec<f32>, &[rope::RopeAngles]),
        (segments, logit_rows): (&[Segment], &[usize]),
        caches: &mut [&mut KvCache],
        (rows_per_sequence, rerouted): (&[usize], &mut [bool]),
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let cfg = &self.config;
        let h = cfg.hidden_size;
        match self.run_layers(layers, (&mut hidden, angles), segments, caches, rerouted) {
            Ok(()) => {
                for (cache, segment) in caches.iter_mut().zip(segments) {
                    cache.advance(segment.rows.len());
                }
            }
            Err(e) => {
                // A failed step (an expert unreachable) leaves every sequence as it was.
                for cache in caches.iter_mut() {
                    cache.rollback();
                }
                return Err(e);
            }
        }

        let mut wanted = Vec::with_capacity(logit_rows.len() * h);
        for &row in logit_rows {
            wanted.extend_from_slice(&hidden[row * h..(row + 1) * h]);
        }
        let final_norm = &layers.weights.final_norm;
        let normed = rms_norm(&wanted, &final_norm.weight, final_norm.eps);
        let logits = layers.weights.lm_head().forward(&normed, logit_rows.len());
        Ok(split_logits(logits, rows_per_sequence, cfg.vocab_size))
    }

    /// [`Engine::forward`] with the dense part on the GPU: only the routed experts' rows
    /// pass through the host.
    fn forward_on_gpu(
        &self,
        (gpu, weights): (&Mutex<GpuModel>, &DenseWeights),
        (hidden, angles): (&[f32], &[rope::RopeAngles]),
        (segments, logit_rows): (&[Segment], &[usize]),
        caches: &mut [&mut KvCache],
        rerouted: &mut [bool],
    ) -> Result<Vec<f32>, EngineError> {
        // Every cache is on the GPU (checked by `forward`).
        let mut device_caches: Vec<_> = caches
            .iter_mut()
            .filter_map(|c| c.device.as_mut())
            .collect();
        let mut routed = |layer: usize, normed: &[f32], rows: usize| match &weights.layers[layer]
            .feed_forward
        {
            FeedForward::Moe(moe) => Ok(moe_routed(
                &self.config.moe,
                moe,
                self.experts.as_ref(),
                layer,
                normed,
                rows,
                rerouted,
            )?),
            FeedForward::Dense(_) => Err(EngineError::Expert(ExpertError::DenseLayer { layer })),
        };
        let model = gpu.lock().unwrap_or_else(|e| e.into_inner());
        let logits = model.forward(
            hidden,
            angles,
            segments,
            logit_rows,
            &mut device_caches,
            Some(self.experts.as_ref()),
            &mut routed,
        );
        drop(device_caches);
        let logits = match logits {
            Ok(logits) => logits,
            Err(e) => {
                // A GPU updates linear-attention states in place, layer by layer: after a
                // step that failed half-way they sum up no number of positions, so they are
                // forgotten (the batcher ends such a step's sequences anyway).
                for cache in caches.iter_mut().filter(|c| c.has_state()) {
                    cache.release();
                }
                return Err(e);
            }
        };
        for (cache, segment) in caches.iter_mut().zip(segments) {
            cache.advance(segment.rows.len());
        }
        Ok(logits)
    }

    /// Every decoder layer over the step's rows, appending to the caches.
    fn run_layers(
        &self,
        layers: &Layers,
        (hidden, angles): (&mut [f32], &[rope::RopeAngles]),
        segments: &[Segment],
        caches: &mut [&mut KvCache],
        rerouted: &mut [bool],
    ) -> Result<(), EngineError> {
        let cfg = &self.config;
        let h = cfg.hidden_size;
        let rows = hidden.len() / h;
        let input = AttentionInput {
            config: &cfg.attention,
            num_heads: cfg.num_heads,
            softmax_scale: layers.softmax_scale,
            unit_norm_eps: cfg.rms_norm_eps,
            rope: &layers.rope,
            angles,
            segments,
        };
        // DeepSeek Sparse Attention: the positions each row attends to, as the last layer
        // with an indexer chose them.
        let mut selection = None;
        for (l, layer) in layers.weights.layers.iter().enumerate() {
            let normed = rms_norm(hidden, &layer.input_norm.weight, layer.input_norm.eps);
            let sparse = sparse_attention::Sparse {
                indexer: layer.indexer.as_ref(),
                selection: &mut selection,
            };
            let attended = match (&layer.linear_attention, &cfg.linear_attention) {
                (Some(weights), Some(linear)) => linear_attention::linear_attention(
                    weights,
                    linear,
                    (l, cfg.rms_norm_eps),
                    &normed,
                    rows,
                    segments,
                    caches,
                ),
                _ => attention(
                    (&layer.attention, layer.sinks.as_deref()),
                    &input,
                    l,
                    &normed,
                    rows,
                    (caches, sparse),
                ),
            };
            add_in_place(hidden, &attended);
            let normed = rms_norm(
                hidden,
                &layer.post_attention_norm.weight,
                layer.post_attention_norm.eps,
            );
            let ff = match &layer.feed_forward {
                FeedForward::Dense(mlp) => mlp.forward_with(&normed, rows, true),
                FeedForward::Moe(moe) => moe_forward(
                    &cfg.moe,
                    moe,
                    self.experts.as_ref(),
                    l,
                    &normed,
                    rows,
                    rerouted,
                )?,
            };
            add_in_place(hidden, &ff);
        }
        Ok(())
    }
}

/// `[rows, vocab]` logits cut into each sequence's `rows_per_sequence` rows.
fn split_logits(logits: Vec<f32>, rows_per_sequence: &[usize], vocab: usize) -> Vec<Vec<f32>> {
    let mut rest = logits.as_slice();
    rows_per_sequence
        .iter()
        .map(|&rows| {
            let (mine, after) = rest.split_at((rows * vocab).min(rest.len()));
            rest = after;
            mine.to_vec()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixture's experts, noting the name of every thread that runs a layer's experts.
    struct NotingThreads {
        experts: LocalExperts,
        threads: Mutex<Vec<Option<String>>>,
    }

    impl ExpertExecutor for NotingThreads {
        fn run(
            &self,
            layer: usize,
            plan: &crate::moe::DispatchPlan,
            grouped_input: &[f32],
        ) -> Result<Vec<f32>, ExpertError> {
            let name = std::thread::current().name().map(String::from);
            self.threads.lock().unwrap().push(name);
            self.experts.run(layer, plan, grouped_input)
        }
    }

    #[test]
    fn a_step_computes_on_the_step_pool_whatever_thread_calls_it() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe");
        let mut noting = None;
        let engine = Engine::load_with(&ModelSource::files(&dir), |checkpoint, config| {
            let experts =
                LocalExperts::new(load_all_experts(checkpoint, config)?, config.hidden_size);
            let executor = Arc::new(NotingThreads {
                experts,
                threads: Mutex::new(Vec::new()),
            });
            noting = Some(executor.clone());
            Ok::<Arc<dyn ExpertExecutor>, ModelError>(executor)
        })
        .unwrap();
        let noting = noting.unwrap();
        let tokens = [5u32, 9, 17];
        let logits = std::thread::scope(|s| {
            s.spawn(|| {
                let mut cache = engine.new_cache();
                engine.forward(&mut [SequenceStep::new(&mut cache, &tokens)])
            })
            .join()
            .unwrap()
        })
        .unwrap();
        assert_eq!(logits[0].len(), engine.config().vocab_size);
        let threads = noting.threads.lock().unwrap();
        assert!(!threads.is_empty(), "no MoE layer ran");
        for name in threads.iter() {
            let name = name.as_deref().unwrap_or("(unnamed)");
            assert!(name.starts_with("step-"), "experts ran on {name}");
        }
    }
}
