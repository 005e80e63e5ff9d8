//! DeepSeek-V4's dense part on the CPU (`deepseek_v4`; the config is
//! `crate::model::config::DeepseekV4`), run by [`crate::engine::Engine`] in place of the
//! layers every other family shares: it differs from them at each step. `hc_mult` residual
//! streams mixed around each block ([`hc`]); attention over one shared key-value head with a
//! window and compressed entries ([`attention`], [`compressor`]); every layer MoE with its own
//! gate ([`gate`]), the routed experts reached through the engine's [`ExpertExecutor`] as
//! every family's are.
//!
//! What a sequence keeps is a [`KvCache`] whose layers each hold a
//! [`CompressedState`](crate::engine::kv_cache::CompressedState) (the window of keys, the
//! compressed entries and the indexer's keys, the compressors' unfinished windows) and no
//! per-position arrays. A step computes each layer's next state beside the current one; the
//! cache moves on to them only when the whole step succeeds (`KvCache::advance`), and a failed
//! step drops them (`KvCache::rollback`), as a linear-attention state does. `DeepseekV4` sizes
//! it for admission and `plan` (`KvCache::bytes` is what one actually holds).

mod attention;
mod compressor;
mod gate;
mod hc;
mod weights;

use crate::compute::cpu::{add_in_place, rms_norm};
use crate::engine::kv_cache::{CompressedState, KvCache};
use crate::engine::rope::Rope;
use crate::engine::{EngineError, SequenceStep};
use crate::experts::ExpertExecutor;
use crate::model::config::{DeepseekV4, V4LayerKind};
use crate::model::{Checkpoint, ModelConfig, ModelError};
use crate::moe::DispatchPlan;
use attention::Step;
use weights::{LayerWeights, V4Weights};

pub(crate) use attention::LayerState as V4LayerState;
pub use gate::{score as gate_score, softplus};

/// One sequence's rows in a step and the position of its first.
struct Segment {
    rows: std::ops::Range<usize>,
    start: usize,
}

/// DeepSeek-V4's dense part (everything but the routed experts) loaded for the CPU.
pub struct V4Dense {
    v4: DeepseekV4,
    weights: V4Weights,
    main_rope: Rope,
    compress_rope: Rope,
}

impl V4Dense {
    /// The dense part from `checkpoint`; an error for a config of another family.
    pub fn load(checkpoint: &Checkpoint, config: &ModelConfig) -> Result<Self, ModelError> {
        let Some(v4) = config.deepseek_v4.as_deref() else {
            return Err(ModelError::Config {
                path: checkpoint.dir().join("config.json"),
                problems: vec![format!(
                    "model_type `{}` is not DeepSeek-V4",
                    config.model_type
                )],
            });
        };
        let weights = V4Weights::load(checkpoint, config, v4)?;
        if v4.mtp_layers > 0 || checkpoint.contains("mtp.0.norm.weight") {
            tracing::info!(
                "DeepSeek-V4: the multi-token-prediction layers (mtp.*) are not read; \
                 decoding predicts one token per step"
            );
        }
        Ok(V4Dense {
            main_rope: Rope::new(&v4.main_rope, true),
            compress_rope: Rope::new(&v4.compress_rope, true),
            v4: v4.clone(),
            weights,
        })
    }

    /// One step for several sequences (checked by the engine: tokens in the vocabulary,
    /// within the context, caches on the host): attention runs per sequence on its own cache,
    /// the gate and the routed experts over every row at once. Returns each sequence's logits
    /// after its last token, or after every one where it asks for all; the caches move on
    /// only when the whole step succeeds.
    pub(crate) fn forward(
        &self,
        cfg: &ModelConfig,
        experts: &dyn ExpertExecutor,
        batch: &mut [SequenceStep],
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let layers = self.weights.layers.len();
        if batch.iter().any(|s| !holds_v4_states(&*s.cache, layers)) {
            return Err(EngineError::ForeignCache);
        }
        let result = self.run(cfg, experts, batch);
        for step in batch.iter_mut() {
            match &result {
                Ok(_) => step.cache.advance(step.tokens.len()),
                // A failed step (an expert unreachable) leaves every sequence as it was.
                Err(_) => step.cache.rollback(),
            }
        }
        result
    }

    /// [`V4Dense::forward`] less the caches' commit: each layer's next states are left beside
    /// the current ones.
    fn run(
        &self,
        cfg: &ModelConfig,
        experts: &dyn ExpertExecutor,
        batch: &mut [SequenceStep],
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let (h, m) = (cfg.hidden_size, self.v4.hc_mult);
        let tokens: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let mut segments = Vec::with_capacity(batch.len());
        for step in batch.iter() {
            let first = segments.last().map_or(0, |s: &Segment| s.rows.end);
            segments.push(Segment {
                rows: first..first + step.tokens.len(),
                start: step.cache.len(),
            });
        }
        let mut streams = Vec::with_capacity(tokens.len() * m * h);
        for &token in &tokens {
            let row = &self.weights.embed[token as usize * h..][..h];
            (0..m).for_each(|_| streams.extend_from_slice(row));
        }
        let rerouted = std::cell::RefCell::new(vec![false; tokens.len()]);
        for (l, layer) in self.weights.layers.iter().enumerate() {
            // Each sequence's next state, its entries lent by the current one (no copy).
            let mut states: Vec<V4LayerState> = batch
                .iter_mut()
                .map(|s| {
                    compressed_mut(s.cache, l)
                        .map_or_else(Default::default, |c| c.state.begin_step())
                })
                .collect();
            let parts = LayerParts {
                cfg,
                experts,
                tokens: &tokens,
                segments: &segments,
                rerouted: &rerouted,
            };
            let done = self.layer(l, layer, &mut streams, &mut states, &parts);
            // Kept beside the current states even where the layer failed: the rollback
            // takes the lent entries back from them.
            for (step, state) in batch.iter_mut().zip(states) {
                if let Some(c) = compressed_mut(step.cache, l) {
                    c.next = Some(state);
                }
            }
            done?;
        }
        let rerouted = rerouted.into_inner();
        for (step, segment) in batch.iter_mut().zip(&segments) {
            step.rerouted = rerouted[segment.rows.clone()].iter().any(|&r| r);
        }
        let w = &self.weights;
        let eps = cfg.rms_norm_eps;
        let head = (w.head_fn.as_slice(), w.head_base.as_slice(), w.head_scale);
        let logits = batch
            .iter()
            .zip(&segments)
            .map(|(step, segment)| {
                let first = match step.all_logits {
                    true => segment.rows.start,
                    false => segment.rows.end - 1,
                };
                let mut normed = Vec::with_capacity((segment.rows.end - first) * h);
                for r in first..segment.rows.end {
                    let row = &streams[r * m * h..][..m * h];
                    let collapsed = hc::head(head, row, h, (eps, self.v4.hc_eps));
                    normed.extend(rms_norm(&collapsed, &w.norm, eps));
                }
                w.head.forward(&normed, segment.rows.end - first)
            })
            .collect();
        Ok(logits)
    }

    /// One decoder layer over every new row's streams, each sequence's attention on its
    /// `states` (the layer's next states, cloned from the current ones).
    fn layer(
        &self,
        l: usize,
        layer: &LayerWeights,
        streams: &mut [f32],
        states: &mut [V4LayerState],
        parts: &LayerParts,
    ) -> Result<(), EngineError> {
        let cfg = parts.cfg;
        let (h, m, rows) = (cfg.hidden_size, self.v4.hc_mult, parts.tokens.len());
        let eps = cfg.rms_norm_eps;
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
                for (segment, state) in parts.segments.iter().zip(states.iter_mut()) {
                    let step = Step {
                        v4: &self.v4,
                        layer: l,
                        heads: cfg.num_heads,
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
                self.moe(l, layer, &normed, parts)?
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
    /// executor, the shared expert. Experts the executor says to avoid (no live replica,
    /// `on_expert_unavailable = "reroute"`) give their place to the next best, and the rows
    /// that chose them are marked rerouted, as in every other family's MoE block.
    fn moe(
        &self,
        l: usize,
        layer: &LayerWeights,
        normed: &[f32],
        parts: &LayerParts,
    ) -> Result<Vec<f32>, EngineError> {
        let (h, rows) = (parts.cfg.hidden_size, parts.tokens.len());
        let moe = &parts.cfg.moe;
        let logits = layer.gate.forward(normed, rows);
        let choice = match &layer.tid2eid {
            Some(table) => gate::Choice::Hash {
                table,
                tokens: parts.tokens,
            },
            None => gate::Choice::Scores {
                bias: layer.gate_bias.as_deref(),
            },
        };
        let route = |avoid| {
            gate::route(
                &logits,
                moe.num_experts,
                moe.top_k,
                self.v4.sqrt_softplus,
                self.v4.routed_scaling_factor,
                &choice,
                avoid,
            )
        };
        let mut routing = route(None);
        if let Some(avoid) = parts.experts.avoid(l)
            && avoid.len() == moe.num_experts
        {
            let hit = |e: &u32| avoid[*e as usize];
            let choices = routing.experts.iter().filter(|e| hit(e)).count();
            if choices > 0 {
                parts.experts.rerouted(l, choices);
                let mut rerouted = parts.rerouted.borrow_mut();
                for (row, chosen) in routing.experts.chunks(moe.top_k.max(1)).enumerate() {
                    if chosen.iter().any(hit) {
                        rerouted[row] = true;
                    }
                }
                routing = route(Some(&avoid));
            }
        }
        let plan = DispatchPlan::new(&routing, moe.num_experts);
        let grouped = plan.gather(normed, h);
        let expert_out = parts.experts.run(l, &plan, &grouped)?;
        let mut out = vec![0.0; rows * h];
        plan.combine(&expert_out, h, &mut out);
        add_in_place(&mut out, &layer.shared.forward_with(normed, rows, true));
        Ok(out)
    }
}

/// What every layer of a step reads besides its weights and states.
struct LayerParts<'a> {
    cfg: &'a ModelConfig,
    experts: &'a dyn ExpertExecutor,
    /// Every new row's token, sequence after sequence.
    tokens: &'a [u32],
    segments: &'a [Segment],
    /// Per row: routed around an expert with no live replica in some layer.
    rerouted: &'a std::cell::RefCell<Vec<bool>>,
}

/// Layer `l`'s DeepSeek-V4 state in `cache`, if it keeps one.
fn compressed_mut(cache: &mut KvCache, l: usize) -> Option<&mut CompressedState> {
    cache.layers.get_mut(l)?.compressed.as_mut()
}

/// Whether `cache` was made for a DeepSeek-V4 model of `layers` layers (on the host).
fn holds_v4_states(cache: &KvCache, layers: usize) -> bool {
    cache.layers.len() == layers && cache.layers.iter().all(|l| l.compressed.is_some())
}

#[cfg(test)]
mod tests;
