//! DeepSeek Sparse Attention on the host (DeepSeek-V3.2, GLM-5): a layer's lightning indexer
//! scores every position a query sees and the layer's MLA attends only to the `index_topk`
//! best. The semantics are transformers' (`DeepseekV32Indexer`, the mask it folds into
//! `DeepseekV32Attention`):
//!
//! - A query at position `p` sees positions `0..=p` (its own included). While there are no
//!   more than `index_topk` of them it attends to all: transformers' `topk` then also takes
//!   masked (later) positions, which the causal mask removes again.
//! - Beyond that, the `index_topk` positions with the highest score
//!   `sum_h w_h relu(q_h . k_t / sqrt(head_dim))`, `w = weights_proj(x) / sqrt(heads)`. Ties
//!   at the boundary go to the earlier position (torch's `topk` leaves their order
//!   unspecified; a tie needs every head's score of two positions to be equal, as when all are
//!   cut to 0 by the relu).
//! - The selection masks the attention's scores (`-inf` elsewhere) before its softmax; the
//!   latents are still cached for every position.
//! - A GLM-5 `shared` layer reuses the selection of the last layer that ran an indexer.
//!
//! The indexer's keys are a cache of their own beside the MLA's latents
//! (`LayerCache::indexer_keys`, `head_dim` floats per position), appended, rolled back and
//! released with them.

use rayon::prelude::*;

use super::attention::AttentionInput;
use super::kv_cache::KvCache;
use crate::compute::cpu::{dot, dot_strided, softmax_in_place};
use crate::model::config::LightningIndexer;
use crate::model::weights::{INDEXER_KEY_NORM_EPS as KEY_NORM_EPS, IndexerWeights};

/// The positions each row of a step attends to.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// Per row: its positions, ascending; `None` where it attends to every position it sees.
    rows: Vec<Option<Vec<u32>>>,
    /// Per row: how many positions it sees (its own and those before).
    seen: Vec<usize>,
}

/// DeepSeek Sparse Attention's part of one layer: the indexer where the layer runs one, and
/// the selection it makes (or the last layer made, which a `shared` layer reuses).
pub struct Sparse<'a> {
    pub indexer: Option<&'a IndexerWeights>,
    pub selection: &'a mut Option<Selection>,
}

impl Selection {
    /// Sets the scores of the positions row `row` does not attend to to `-inf`;
    /// `scores[i]` is position `i`'s. Positions after the row's own are left as they are
    /// (the causal mask removes them).
    pub fn mask(&self, row: usize, scores: &mut [f32]) {
        let Some(Some(chosen)) = self.rows.get(row) else {
            return;
        };
        let seen = self.seen.get(row).map_or(0, |&seen| seen.min(scores.len()));
        let mut next = chosen.iter().map(|&p| p as usize).peekable();
        for (position, score) in scores[..seen].iter_mut().enumerate() {
            if next.peek() == Some(&position) {
                next.next();
            } else {
                *score = f32::NEG_INFINITY;
            }
        }
    }
}

impl Selection {
    /// [`Selection::mask`] over a block of queries: `heads` rows of `keys` scores for each
    /// row from `first_row` on.
    pub fn mask_block(&self, scores: &mut [f32], keys: usize, first_row: usize, heads: usize) {
        for (query, row_scores) in scores.chunks_exact_mut(keys).enumerate() {
            self.mask(first_row + query / heads, row_scores);
        }
    }

    /// The positions row `row` attends to, where it does not attend to all it sees.
    pub fn chosen(&self, row: usize) -> Option<&[u32]> {
        self.rows.get(row)?.as_deref()
    }
}

/// MLA's attention of one query head over the `chosen` positions only (a decode row): its
/// absorbed latent query and rotary query against those positions' cached latents and
/// rotary keys, softmax with `scale`, the chosen latents summed into `out`. The same as the
/// masked full attention, reading `index_topk` positions instead of every one.
pub fn attend_chosen(
    chosen: &[u32],
    (q_latent, q_rope): (&[f32], &[f32]),
    (latents, rope_keys): (&[f32], &[f32]),
    scale: f32,
    out: &mut [f32],
) {
    let (rank, rope_dim) = (q_latent.len(), q_rope.len());
    let mut weights: Vec<f32> = chosen
        .iter()
        .map(|&p| {
            let p = p as usize;
            let latent = dot(q_latent, &latents[p * rank..][..rank]);
            let rotary = match rope_dim {
                0 => 0.0,
                _ => dot(q_rope, &rope_keys[p * rope_dim..][..rope_dim]),
            };
            (latent + rotary) * scale
        })
        .collect();
    softmax_in_place(&mut weights);
    out.fill(0.0);
    for (&p, w) in chosen.iter().zip(&weights) {
        let latent = &latents[p as usize * rank..][..rank];
        for (o, v) in out.iter_mut().zip(latent) {
            *o += w * v;
        }
    }
}

/// The `topk` positions with the highest `scores` (one per position `0..scores.len()`),
/// ascending; ties go to the earlier position. `None` where there are no more than `topk`:
/// every position is attended to.
pub fn top_positions(scores: &[f32], topk: usize) -> Option<Vec<u32>> {
    if scores.len() <= topk {
        return None;
    }
    let mut order: Vec<u32> = (0..scores.len() as u32).collect();
    // `+ 0.0` makes -0 equal to 0, as torch compares them.
    let score = |p: &u32| scores[*p as usize] + 0.0;
    let better = |a: &u32, b: &u32| score(b).total_cmp(&score(a)).then(a.cmp(b));
    if topk > 0 {
        order.select_nth_unstable_by(topk - 1, better);
    }
    order.truncate(topk);
    order.sort_unstable();
    Some(order)
}

/// Runs layer `layer`'s indexer over the step's rows: appends each row's key to its
/// sequence's indexer cache and returns the positions each row attends to. `x` is the
/// layer's normed input (`[rows, hidden]`), `q_low` the MLA's normed low-rank query
/// (`[rows, q_lora_rank]`).
pub fn select(
    (weights, indexer): (&IndexerWeights, &LightningIndexer),
    input: &AttentionInput,
    layer: usize,
    (x, q_low): (&[f32], &[f32]),
    rows: usize,
    caches: &mut [&mut KvCache],
) -> Selection {
    let (heads, dim) = (indexer.num_heads, indexer.head_dim);
    let rope = input.rope.paired(indexer.rope_interleave);
    let rope_dim = rope.dim().min(dim);
    let mut queries = weights.wq_b.forward(q_low, rows);
    for (row, angles) in queries.chunks_exact_mut(heads * dim).zip(input.angles) {
        for head in row.chunks_exact_mut(dim) {
            rope.apply(&mut head[..rope_dim], angles);
        }
    }
    let mut keys = weights.wk.forward(x, rows);
    for (key, angles) in keys.chunks_exact_mut(dim).zip(input.angles) {
        layer_norm(key, &weights.k_norm_weight, &weights.k_norm_bias);
        rope.apply(&mut key[..rope_dim], angles);
    }
    let mut head_weights = weights.weights_proj.forward(x, rows);
    let head_scale = (heads as f32).powf(-0.5);
    head_weights.iter_mut().for_each(|w| *w *= head_scale);
    let mut row_of = Vec::with_capacity(rows);
    for (s, (segment, cache)) in input.segments.iter().zip(caches.iter_mut()).enumerate() {
        let r = &segment.rows;
        cache.layers[layer]
            .indexer_keys
            .extend_from_slice(&keys[r.start * dim..r.end * dim]);
        row_of.extend(
            r.clone()
                .map(|row| (s, segment.start_position + row - r.start)),
        );
    }
    let caches: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
    let scale = (dim as f32).powf(-0.5);
    let chosen: Vec<Option<Vec<u32>>> = (0..rows)
        .into_par_iter()
        .map(|row| {
            let (segment, position) = row_of[row];
            if position < indexer.topk {
                return None;
            }
            let cached = &caches[segment].layers[layer].indexer_keys;
            let mut scores = vec![0.0; position + 1];
            let mut head_scores = vec![0.0; position + 1];
            for head in 0..heads {
                let query = &queries[(row * heads + head) * dim..][..dim];
                dot_strided(query, cached, dim, &mut head_scores);
                let w = head_weights[row * heads + head];
                for (s, h) in scores.iter_mut().zip(&head_scores) {
                    *s += w * (h * scale).max(0.0);
                }
            }
            top_positions(&scores, indexer.topk)
        })
        .collect();
    let seen = row_of.iter().map(|&(_, position)| position + 1).collect();
    Selection { rows: chosen, seen }
}

/// transformers' `nn.LayerNorm` over one key: centred, scaled to unit variance (biased), then
/// the weight and bias.
fn layer_norm(x: &mut [f32], weight: &[f32], bias: &[f32]) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + KEY_NORM_EPS).sqrt();
    for ((v, w), b) in x.iter_mut().zip(weight).zip(bias) {
        *v = (*v - mean) * inv * w + b;
    }
}

#[cfg(test)]
mod tests;
