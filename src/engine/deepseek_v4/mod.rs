//! DeepSeek-V4's forward pass on the CPU (`deepseek_v4`; the config is
//! `crate::model::config::DeepseekV4`). It differs from every other family's at each step, so
//! it runs apart from [`crate::engine::Engine`]'s layers: `hc_mult` residual streams mixed
//! around each block ([`hc`]); attention over one shared key-value head with a window and
//! compressed entries ([`attention`], [`compressor`]); every layer MoE with its own gate
//! ([`gate`]), the routed experts reached through the same [`ExpertExecutor`] as every family's.
//!
//! What a sequence keeps ([`V4Cache`]) is its own, the way a linear-attention state is: per
//! layer the window of keys, the compressed entries and the indexer's keys, and the
//! compressors' unfinished windows; `crate::model::config::DeepseekV4` sizes it for admission
//! and `plan` ([`V4Cache::bytes`] is what one actually holds).

mod attention;
mod compressor;
mod gate;
mod hc;
mod weights;

use std::path::Path;
use std::sync::Arc;

use crate::compute::cpu::{add_in_place, rms_norm};
use crate::engine::EngineError;
use crate::engine::rope::Rope;
use crate::experts::{ExpertExecutor, LocalExperts};
use crate::model::config::{DeepseekV4, V4LayerKind};
use crate::model::{Checkpoint, ModelConfig, ModelError, ModelSource};
use crate::moe::DispatchPlan;
use attention::{LayerState, Step};
use weights::{LayerWeights, V4Weights};

pub use gate::{score as gate_score, softplus};

/// What one sequence keeps: its length and each layer's state.
#[derive(Debug, Clone)]
pub struct V4Cache {
    len: usize,
    layers: Vec<LayerState>,
}

impl V4Cache {
    /// Positions seen.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held (f32): windows, compressed entries, indexer keys, unfinished windows.
    pub fn bytes(&self) -> usize {
        4 * self.layers.iter().map(LayerState::floats).sum::<usize>()
    }
}

/// One sequence's rows in a step and the position of its first.
struct Segment {
    rows: std::ops::Range<usize>,
    start: usize,
}

/// A DeepSeek-V4 checkpoint loaded for the CPU.
pub struct DeepseekV4Model {
    config: ModelConfig,
    v4: DeepseekV4,
    weights: V4Weights,
    main_rope: Rope,
    compress_rope: Rope,
    experts: Arc<dyn ExpertExecutor>,
}

impl DeepseekV4Model {
    /// Loads a model directory with every expert in this process.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let source = ModelSource::files(dir);
        let config = source.config()?;
        let checkpoint = source.checkpoint(&config)?;
        let v4 = match &config.deepseek_v4 {
            Some(v4) => (**v4).clone(),
            None => {
                return Err(ModelError::Config {
                    path: dir.join("config.json"),
                    problems: vec![format!(
                        "model_type `{}` is not DeepSeek-V4",
                        config.model_type
                    )],
                });
            }
        };
        let experts = weights::load_experts(&checkpoint, &config, &v4)?;
        let experts = Arc::new(LocalExperts::new(experts, config.hidden_size));
        Self::with_experts(config, v4, &checkpoint, experts)
    }

    /// The dense part from `checkpoint`, the routed experts wherever `experts` runs them.
    pub fn with_experts(
        config: ModelConfig,
        v4: DeepseekV4,
        checkpoint: &Checkpoint,
        experts: Arc<dyn ExpertExecutor>,
    ) -> Result<Self, ModelError> {
        let weights = V4Weights::load(checkpoint, &config, &v4)?;
        if v4.mtp_layers > 0 || checkpoint.contains("mtp.0.norm.weight") {
            tracing::info!(
                "DeepSeek-V4: the multi-token-prediction layers (mtp.*) are not read; \
                 decoding predicts one token per step"
            );
        }
        Ok(DeepseekV4Model {
            main_rope: Rope::new(&v4.main_rope, true),
            compress_rope: Rope::new(&v4.compress_rope, true),
            config,
            v4,
            weights,
            experts,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn new_cache(&self) -> V4Cache {
        V4Cache {
            len: 0,
            layers: vec![LayerState::default(); self.config.num_layers],
        }
    }

    /// Runs `tokens` after `cache` and returns the logits after the last one (`[vocab]`). The
    /// cache is extended only when the whole step succeeds.
    pub fn forward(&self, cache: &mut V4Cache, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        let mut logits = self.forward_batch(&mut [(cache, tokens)])?;
        Ok(logits.pop().unwrap_or_default())
    }

    /// One step for several sequences: attention runs per sequence on its own cache, the
    /// gate and the routed experts over every row at once. Returns each sequence's logits
    /// after its last token; the caches are extended only when the whole step succeeds.
    pub fn forward_batch(
        &self,
        batch: &mut [(&mut V4Cache, &[u32])],
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let cfg = &self.config;
        for (cache, tokens) in batch.iter() {
            if tokens.is_empty() {
                return Err(EngineError::EmptyPrompt);
            }
            if let Some(&token) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(EngineError::TokenOutOfRange {
                    token,
                    vocab_size: cfg.vocab_size,
                });
            }
            let needed = cache.len + tokens.len();
            if needed > cfg.max_position_embeddings {
                return Err(EngineError::ContextTooLong {
                    needed,
                    max: cfg.max_position_embeddings,
                });
            }
        }
        let (h, m) = (cfg.hidden_size, self.v4.hc_mult);
        let tokens: Vec<u32> = batch.iter().flat_map(|(_, t)| t.iter().copied()).collect();
        let mut segments = Vec::with_capacity(batch.len());
        let mut next: Vec<V4Cache> = Vec::with_capacity(batch.len());
        for (cache, seq_tokens) in batch.iter() {
            let first = segments.last().map_or(0, |s: &Segment| s.rows.end);
            segments.push(Segment {
                rows: first..first + seq_tokens.len(),
                start: cache.len,
            });
            next.push((*cache).clone());
        }
        let mut streams = Vec::with_capacity(tokens.len() * m * h);
        for &token in &tokens {
            let row = &self.weights.embed[token as usize * h..][..h];
            (0..m).for_each(|_| streams.extend_from_slice(row));
        }
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let mut states: Vec<&mut LayerState> =
                next.iter_mut().map(|c| &mut c.layers[l]).collect();
            self.layer(l, layer, &mut streams, &tokens, &mut states, &segments)?;
        }
        let w = &self.weights;
        let eps = cfg.rms_norm_eps;
        let mut logits = Vec::with_capacity(batch.len());
        for ((cache, _), (segment, mut grown)) in batch.iter_mut().zip(segments.iter().zip(next)) {
            let last = &streams[(segment.rows.end - 1) * m * h..][..m * h];
            let head = (w.head_fn.as_slice(), w.head_base.as_slice(), w.head_scale);
            let collapsed = hc::head(head, last, h, (eps, self.v4.hc_eps));
            let normed = rms_norm(&collapsed, &w.norm, eps);
            logits.push(w.head.forward(&normed, 1));
            grown.len = segment.start + segment.rows.len();
            **cache = grown;
        }
        Ok(logits)
    }

    /// One decoder layer over every new row's streams.
    fn layer(
        &self,
        l: usize,
        layer: &LayerWeights,
        streams: &mut [f32],
        tokens: &[u32],
        states: &mut [&mut LayerState],
        segments: &[Segment],
    ) -> Result<(), EngineError> {
        let (h, m, rows) = (self.config.hidden_size, self.v4.hc_mult, tokens.len());
        let eps = self.config.rms_norm_eps;
        let hc = (eps, self.v4.hc_eps, self.v4.hc_sinkhorn_iters);
        // Attention, then the MoE block, each between a collapse and a spread of the streams.
        for block in 0..2 {
            let mixer = if block == 0 {
                &layer.attn_hc
            } else {
                &layer.ffn_hc
            };
            let mut mixes = Vec::with_capacity(rows);
            let mut input = Vec::with_capacity(rows * h);
            for r in 0..rows {
                let (mix, collapsed) = hc::mix(mixer, &streams[r * m * h..][..m * h], [m, h], hc);
                mixes.push(mix);
                input.extend(collapsed);
            }
            let output = if block == 0 {
                let normed = rms_norm(&input, &layer.attn_norm, eps);
                let mut output = Vec::with_capacity(rows * h);
                for (segment, state) in segments.iter().zip(states.iter_mut()) {
                    let step = Step {
                        v4: &self.v4,
                        layer: l,
                        heads: self.config.num_heads,
                        eps,
                        rope: match self.v4.layers[l] {
                            V4LayerKind::Sliding => &self.main_rope,
                            _ => &self.compress_rope,
                        },
                        compress_rope: &self.compress_rope,
                        start: segment.start,
                    };
                    let x = &normed[segment.rows.start * h..segment.rows.end * h];
                    output.extend(attention::attention(
                        &layer.attention,
                        state,
                        x,
                        segment.rows.len(),
                        &step,
                    ));
                }
                output
            } else {
                let normed = rms_norm(&input, &layer.ffn_norm, eps);
                self.moe(l, layer, &normed, tokens)?
            };
            for (r, mix) in mixes.iter().enumerate() {
                hc::spread(
                    &mut streams[r * m * h..][..m * h],
                    mix,
                    &output[r * h..][..h],
                    m,
                );
            }
        }
        Ok(())
    }

    /// The MoE block: the gate (scores or the token table), the routed experts through the
    /// executor, the shared expert.
    fn moe(
        &self,
        l: usize,
        layer: &LayerWeights,
        normed: &[f32],
        tokens: &[u32],
    ) -> Result<Vec<f32>, EngineError> {
        let (h, rows) = (self.config.hidden_size, tokens.len());
        let moe = &self.config.moe;
        let logits = layer.gate.forward(normed, rows);
        let choice = match &layer.tid2eid {
            Some(table) => gate::Choice::Hash { table, tokens },
            None => gate::Choice::Scores {
                bias: layer.gate_bias.as_deref(),
            },
        };
        let routing = gate::route(
            &logits,
            moe.num_experts,
            moe.top_k,
            self.v4.sqrt_softplus,
            self.v4.routed_scaling_factor,
            &choice,
        );
        let plan = DispatchPlan::new(&routing, moe.num_experts);
        let grouped = plan.gather(normed, h);
        let expert_out = self.experts.run(l, &plan, &grouped)?;
        let mut out = vec![0.0; rows * h];
        plan.combine(&expert_out, h, &mut out);
        add_in_place(&mut out, &layer.shared.forward_with(normed, rows, true));
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
