//! DeepSeek-V4's attention for one sequence's new positions, as transformers'
//! `DeepseekV4Attention`: queries through a low-rank projection (normed), each head RMS-normed
//! without weight; one key-value head, normed, read as both key and value; rope over the last
//! `rope_dim` values of each head, in interleaved pairs; keys of the last `sliding_window`
//! positions and, on compressed layers, the compressor's entries (all those whose window has
//! closed on HCA layers, the indexer's choice on CSA layers); a learned sink per head; the
//! output's rope undone at the query's position, then the grouped low-rank projection.

use super::compressor::{Pool, PoolState};
use super::weights::{AttentionWeights, CompressorWeights, IndexerWeights};
use crate::compute::cpu::{Linear, rms_norm_in_place};
use crate::engine::rope::{Rope, RopeAngles};
use crate::model::config::{DeepseekV4, V4LayerKind};
use crate::model::weights::StoredLinear;

/// What a sequence keeps of one layer.
#[derive(Debug, Clone, Default)]
pub struct LayerState {
    /// The key-value rows of the last `sliding_window - 1` positions, oldest first.
    window: Vec<f32>,
    compressor: PoolState,
    indexer: PoolState,
    /// While a step is in flight ([`LayerState::begin_step`]): how many values of entries
    /// the compressor and the indexer had, which the step's state holds.
    lent: Option<[usize; 2]>,
}

impl LayerState {
    /// The state a step of this layer starts from, to become this one when the step
    /// succeeds: the window and unfinished windows copied, the entries (which grow with the
    /// context) moved into it; [`LayerState::restore`] takes them back where it fails.
    pub(crate) fn begin_step(&mut self) -> LayerState {
        self.lent = Some([self.compressor.entries.len(), self.indexer.entries.len()]);
        LayerState {
            window: self.window.clone(),
            compressor: self.compressor.begin_step(),
            indexer: self.indexer.begin_step(),
            lent: None,
        }
    }

    /// Takes back the entries lent to `next`, the state of a step that failed, without what
    /// the step appended.
    pub(crate) fn restore(&mut self, next: LayerState) {
        if let Some([compressor, indexer]) = self.lent.take() {
            let (mut c, mut i) = (next.compressor.entries, next.indexer.entries);
            c.truncate(compressor);
            i.truncate(indexer);
            self.compressor.entries = c;
            self.indexer.entries = i;
        }
    }

    /// Floats held.
    pub fn floats(&self) -> usize {
        self.window.len()
            + self.compressor.entries.len()
            + self.compressor.pending_floats()
            + self.indexer.entries.len()
            + self.indexer.pending_floats()
    }
}

/// Rotates the last `2 * angles.cos.len()` values of `x` in interleaved pairs; `inverse` turns
/// them back (the reference's `-sin`).
pub fn rotate(x: &mut [f32], angles: &RopeAngles, inverse: bool) {
    let half = angles.cos.len();
    let start = x.len() - 2 * half;
    for (i, pair) in x[start..].chunks_exact_mut(2).enumerate() {
        let (c, s) = (
            angles.cos[i],
            if inverse {
                -angles.sin[i]
            } else {
                angles.sin[i]
            },
        );
        let (a, b) = (pair[0], pair[1]);
        pair[0] = a * c - b * s;
        pair[1] = b * c + a * s;
    }
}

/// What one layer's attention needs besides its weights and state.
pub struct Step<'a> {
    pub v4: &'a DeepseekV4,
    pub layer: usize,
    pub heads: usize,
    pub eps: f32,
    /// The layer's rope (main on sliding-only layers, compress on the others) and the
    /// compressors' and indexer's.
    pub rope: &'a Rope,
    pub compress_rope: &'a Rope,
    /// Position of the first new row.
    pub start: usize,
}

/// Feeds a compressor the new rows and returns its entries so far.
fn compress<'s>(
    weights: &CompressorWeights,
    state: &'s mut PoolState,
    (x, rows): (&[f32], usize),
    (ratio, width, overlapping): (usize, usize, bool),
    step: &Step,
) -> &'s [f32] {
    let kv = weights.wkv.forward(x, rows);
    let gate = weights.wgate.forward(x, rows);
    let pool = Pool {
        ratio,
        width,
        overlapping,
        ape: &weights.ape,
        norm: &weights.norm,
        eps: step.eps,
    };
    let rope = |entry: &mut [f32], position: usize| {
        rotate(entry, &step.compress_rope.angles(position), false);
    };
    state.push(&pool, &kv, &gate, &rope);
    &state.entries
}

/// The lightning indexer's choice for each new row: the compressed entries it keeps, those
/// past the row's causal limit dropped (the reference's `-1`).
fn select(
    weights: &IndexerWeights,
    state: &mut PoolState,
    (x, q_residual, rows): (&[f32], &[f32], usize),
    step: &Step,
) -> Vec<Vec<usize>> {
    let v4 = step.v4;
    let (ratio, heads, width) = (v4.csa_ratio, v4.index_n_heads, v4.index_head_dim);
    let keys = compress(
        &weights.compressor,
        state,
        (x, rows),
        (ratio, width, true),
        step,
    );
    let entries = keys.len() / width;
    let mut queries = weights.wq_b.forward(q_residual, rows);
    let head_weights = weights.weights_proj.forward(x, rows);
    let (softmax_scale, weights_scale) = ((width as f32).powf(-0.5), (heads as f32).powf(-0.5));
    let top_k = v4.index_topk.min(entries);
    (0..rows)
        .map(|r| {
            let position = step.start + r;
            let angles = step.compress_rope.angles(position);
            let q = &mut queries[r * heads * width..(r + 1) * heads * width];
            q.chunks_exact_mut(width)
                .for_each(|h| rotate(h, &angles, false));
            let limit = (position + 1) / ratio;
            let mut scores: Vec<(f32, usize)> = (0..entries)
                .map(|t| {
                    if t >= limit {
                        return (f32::NEG_INFINITY, t);
                    }
                    let key = &keys[t * width..(t + 1) * width];
                    let score = q
                        .chunks_exact(width)
                        .zip(&head_weights[r * heads..(r + 1) * heads])
                        .map(|(qh, w)| {
                            let dot: f32 = qh.iter().zip(key).map(|(a, b)| a * b).sum();
                            dot.max(0.0) * softmax_scale * (w * weights_scale)
                        })
                        .sum();
                    (score, t)
                })
                .collect();
            // Highest first. Equal scores (exactly 0 where every head's ReLU is 0) by position:
            // torch.topk leaves their order open, and transformers' cached and uncached passes
            // break them differently.
            scores.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            scores
                .into_iter()
                .take(top_k)
                .map(|(_, t)| t)
                .filter(|&t| t < limit)
                .collect()
        })
        .collect()
}

/// The grouped low-rank output projection: group `g` of each row's heads through its own
/// block of `wo_a`, then all through `wo_b`.
fn output(
    wo_a: &Linear,
    wo_b: &StoredLinear,
    attended: &[f32],
    rows: usize,
    groups: usize,
) -> Vec<f32> {
    let (rank, per_group) = (wo_a.out_features / groups, wo_a.in_features);
    let mut mid = vec![0.0; rows * groups * rank];
    for g in 0..groups {
        let block = &wo_a.weight[g * rank * per_group..(g + 1) * rank * per_group];
        for r in 0..rows {
            let input = &attended[(r * groups + g) * per_group..][..per_group];
            for (o, w) in block.chunks_exact(per_group).enumerate() {
                mid[(r * groups + g) * rank + o] = w.iter().zip(input).map(|(a, b)| a * b).sum();
            }
        }
    }
    wo_b.forward(&mid, rows)
}

/// One layer's attention over `rows` new normed rows `x`, appending to `state`.
pub fn attention(
    weights: &AttentionWeights,
    state: &mut LayerState,
    x: &[f32],
    rows: usize,
    step: &Step,
) -> Vec<f32> {
    let v4 = step.v4;
    let (heads, hd, eps) = (step.heads, v4.head_dim, step.eps);
    let mut q_residual = weights.wq_a.forward(x, rows);
    rms_norm_in_place(&mut q_residual, &weights.q_norm, eps);
    let mut q = weights.wq_b.forward(&q_residual, rows);
    let unit = vec![1.0; hd];
    rms_norm_in_place(&mut q, &unit, eps);
    let mut kv = weights.wkv.forward(x, rows);
    rms_norm_in_place(&mut kv, &weights.kv_norm, eps);
    let angles: Vec<RopeAngles> = (0..rows)
        .map(|r| step.rope.angles(step.start + r))
        .collect();
    for (r, a) in angles.iter().enumerate() {
        q[r * heads * hd..(r + 1) * heads * hd]
            .chunks_exact_mut(hd)
            .for_each(|h| rotate(h, a, false));
        rotate(&mut kv[r * hd..(r + 1) * hd], a, false);
    }
    // Keys: the kept window, then the new rows; key `j` is at position `first + j`.
    let first = step.start - state.window.len() / hd;
    let mut keys = std::mem::take(&mut state.window);
    keys.extend_from_slice(&kv);
    let kind = v4.layers[step.layer];
    let selected = match (kind, &weights.indexer) {
        (V4LayerKind::Csa, Some(indexer)) => Some(select(
            indexer,
            &mut state.indexer,
            (x, &q_residual, rows),
            step,
        )),
        _ => None,
    };
    let (ratio, overlapping) = match kind {
        V4LayerKind::Csa => (v4.csa_ratio, true),
        _ => (v4.hca_ratio, false),
    };
    let entries: &[f32] = match &weights.compressor {
        Some(c) => compress(
            c,
            &mut state.compressor,
            (x, rows),
            (ratio, hd, overlapping),
            step,
        ),
        None => &[],
    };
    let scale = (hd as f32).powf(-0.5);
    let mut attended = vec![0.0; rows * heads * hd];
    for r in 0..rows {
        let position = step.start + r;
        let window_start = (position + 1).saturating_sub(v4.sliding_window).max(first);
        let visible_keys = (window_start - first)..(position + 1 - first);
        let visible_entries: Vec<usize> = match &selected {
            Some(chosen) => chosen[r].clone(),
            None => (0..(position + 1) / ratio.max(1))
                .take(entries.len() / hd)
                .collect(),
        };
        for h in 0..heads {
            let query = &q[(r * heads + h) * hd..][..hd];
            let dot = |k: &[f32]| query.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
            let mut logits: Vec<f32> = visible_keys
                .clone()
                .map(|j| dot(&keys[j * hd..(j + 1) * hd]))
                .collect();
            logits.extend(
                visible_entries
                    .iter()
                    .map(|&t| dot(&entries[t * hd..(t + 1) * hd])),
            );
            let sink = weights.sinks[h];
            let max = logits.iter().copied().fold(sink, f32::max);
            let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f32 = exps.iter().sum::<f32>() + (sink - max).exp();
            let out = &mut attended[(r * heads + h) * hd..][..hd];
            let values = visible_keys
                .clone()
                .map(|j| &keys[j * hd..(j + 1) * hd])
                .chain(
                    visible_entries
                        .iter()
                        .map(|&t| &entries[t * hd..(t + 1) * hd]),
                );
            for (e, value) in exps.iter().zip(values) {
                let p = e / sum;
                out.iter_mut().zip(value).for_each(|(o, v)| *o += p * v);
            }
            rotate(out, &angles[r], true);
        }
    }
    let keep = v4.sliding_window.saturating_sub(1) * hd;
    state.window = keys[keys.len().saturating_sub(keep)..].to_vec();
    output(&weights.wo_a, &weights.wo_b, &attended, rows, v4.o_groups)
}
