//! Attention over the KV cache for a batch of sequence segments: GQA (Qwen3-MoE, Mixtral) and
//! MLA (DeepSeek-V3, Kimi K2) computed in its absorbed form, so the cache holds only latents.

use rayon::prelude::*;

use super::kv_cache::{KvCache, LayerCache};
use super::rope::{Rope, RopeAngles};
use crate::compute::cpu::{
    Linear, dot_strided, matmul, matmul_transposed, rms_norm_in_place, weighted_rows,
};
use crate::model::config::AttentionConfig;
use crate::model::weights::{AttentionWeights, QueryProjection};

pub use crate::compute::layout::Segment;

/// What attention needs besides weights: shapes and per-row rotary angles.
pub struct AttentionInput<'a> {
    pub config: &'a AttentionConfig,
    pub num_heads: usize,
    pub softmax_scale: f32,
    pub rope: &'a Rope,
    /// One entry per row of the batch.
    pub angles: &'a [RopeAngles],
    pub segments: &'a [Segment],
}

/// Runs attention of layer `layer` for all rows of `x` (already normalised) and returns the
/// output projection, `[rows, hidden]`. Appends the new keys to each segment's cache.
pub fn attention(
    weights: &AttentionWeights,
    input: &AttentionInput,
    layer: usize,
    x: &[f32],
    rows: usize,
    caches: &mut [&mut KvCache],
) -> Vec<f32> {
    match (weights, input.config) {
        (
            AttentionWeights::Gqa {
                q,
                k,
                v,
                o,
                q_norm,
                k_norm,
            },
            &AttentionConfig::Gqa {
                num_kv_heads,
                head_dim,
                sliding_window,
                ..
            },
        ) => {
            let mut queries = q.forward(x, rows);
            let mut keys = k.forward(x, rows);
            let values = v.forward(x, rows);
            if let Some(norm) = q_norm {
                rms_norm_in_place(&mut queries, &norm.weight, norm.eps);
            }
            if let Some(norm) = k_norm {
                rms_norm_in_place(&mut keys, &norm.weight, norm.eps);
            }
            rotate_heads(input, &mut queries, head_dim, 0, head_dim);
            rotate_heads(input, &mut keys, head_dim, 0, head_dim);
            let kv_width = num_kv_heads * head_dim;
            append_to_caches(input.segments, caches, layer, &keys, &values);
            let group = input.num_heads / num_kv_heads;
            let mut out = vec![0.0; rows * input.num_heads * head_dim];
            let caches: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
            par_rows_heads(input, &mut out, head_dim, |segment, row, head, out| {
                let LayerCache {
                    first: keys,
                    second: values,
                    ..
                } = &caches[segment].layers[layer];
                let seg = &input.segments[segment];
                let position = seg.start_position + (row - seg.rows.start);
                let first = sliding_window.map_or(0, |w| (position + 1).saturating_sub(w));
                let kv_offset = (head / group) * head_dim;
                let query = &queries[(row * input.num_heads + head) * head_dim..][..head_dim];
                let mut scores = vec![0.0; position + 1 - first];
                dot_strided(
                    query,
                    &keys[first * kv_width + kv_offset..],
                    kv_width,
                    &mut scores,
                );
                attend(
                    scores,
                    &values[first * kv_width + kv_offset..],
                    kv_width,
                    input.softmax_scale,
                    out,
                );
            });
            o.forward(&out, rows)
        }
        (
            AttentionWeights::Mla {
                q,
                kv_down,
                kv_norm,
                kv_up,
                o,
            },
            &AttentionConfig::Mla {
                kv_lora_rank,
                qk_nope_head_dim: nope,
                qk_rope_head_dim: rope_dim,
                v_head_dim,
                ..
            },
        ) => {
            let heads = input.num_heads;
            let q_width = nope + rope_dim;
            let mut queries = match q {
                QueryProjection::Direct(proj) => proj.forward(x, rows),
                QueryProjection::LowRank { down, norm, up } => {
                    let mut low = down.forward(x, rows);
                    rms_norm_in_place(&mut low, &norm.weight, norm.eps);
                    up.forward(&low, rows)
                }
            };
            rotate_heads(input, &mut queries, q_width, nope, rope_dim);
            let compressed = kv_down.forward(x, rows);
            let compressed_width = kv_lora_rank + rope_dim;
            let mut latents = Vec::with_capacity(rows * kv_lora_rank);
            let mut rope_keys = Vec::with_capacity(rows * rope_dim);
            for (row, c) in compressed.chunks_exact(compressed_width).enumerate() {
                let start = latents.len();
                latents.extend_from_slice(&c[..kv_lora_rank]);
                rms_norm_in_place(&mut latents[start..], &kv_norm.weight, kv_norm.eps);
                let start = rope_keys.len();
                rope_keys.extend_from_slice(&c[kv_lora_rank..]);
                input
                    .rope
                    .apply(&mut rope_keys[start..], &input.angles[row]);
            }
            append_to_caches(input.segments, caches, layer, &latents, &rope_keys);
            // Absorb kv_b's key half into the queries: q_nope · (W_uk c) = (q_nope W_uk) · c.
            let up_rows_per_head = nope + v_head_dim;
            let absorbed =
                absorb_queries(&queries, rows, heads, q_width, nope, kv_up, kv_lora_rank);
            let caches: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
            let mut latent_out = vec![0.0; rows * heads * kv_lora_rank];
            par_rows_heads(
                input,
                &mut latent_out,
                kv_lora_rank,
                |segment, row, head, out| {
                    let LayerCache {
                        first: latents,
                        second: rope_keys,
                        ..
                    } = &caches[segment].layers[layer];
                    let seg = &input.segments[segment];
                    let position = seg.start_position + (row - seg.rows.start);
                    let q_latent = &absorbed[(row * heads + head) * kv_lora_rank..][..kv_lora_rank];
                    let q_rope = &queries[(row * heads + head) * q_width + nope..][..rope_dim];
                    let mut scores = vec![0.0; position + 1];
                    let mut rope_scores = vec![0.0; position + 1];
                    dot_strided(q_latent, latents, kv_lora_rank, &mut scores);
                    dot_strided(q_rope, rope_keys, rope_dim, &mut rope_scores);
                    for (s, r) in scores.iter_mut().zip(&rope_scores) {
                        *s += r;
                    }
                    attend(scores, latents, kv_lora_rank, input.softmax_scale, out);
                },
            );
            // Expand the attended latents through kv_b's value half, head by head.
            let heads_in = HeadLayout {
                rows,
                heads,
                stride: kv_lora_rank,
                width: kv_lora_rank,
            };
            let out = per_head_product(&latent_out, heads_in, v_head_dim, |head, x, y| {
                let w_value = &kv_up.weight[(head * up_rows_per_head + nope) * kv_lora_rank..]
                    [..v_head_dim * kv_lora_rank];
                matmul_transposed(x, rows, kv_lora_rank, w_value, v_head_dim, y, true);
            });
            o.forward(&out, rows)
        }
        _ => unreachable!("attention weights are loaded from the same config"),
    }
}

/// Appends each segment's rows of the step's two cached arrays (keys and values, or latents
/// and rotary keys) to that segment's cache for `layer`.
fn append_to_caches(
    segments: &[Segment],
    caches: &mut [&mut KvCache],
    layer: usize,
    first: &[f32],
    second: &[f32],
) {
    let rows = segments.last().map_or(0, |s| s.rows.end).max(1);
    let (first_width, second_width) = (first.len() / rows, second.len() / rows);
    for (segment, cache) in segments.iter().zip(caches.iter_mut()) {
        let cached = &mut cache.layers[layer];
        let r = &segment.rows;
        cached
            .first
            .extend_from_slice(&first[r.start * first_width..r.end * first_width]);
        cached
            .second
            .extend_from_slice(&second[r.start * second_width..r.end * second_width]);
    }
}

/// `[rows, heads, kv_lora_rank]`: each head's non-rotary query times its key block of kv_b.
fn absorb_queries(
    queries: &[f32],
    rows: usize,
    heads: usize,
    q_width: usize,
    nope: usize,
    kv_up: &Linear,
    kv_lora_rank: usize,
) -> Vec<f32> {
    let up_rows_per_head = kv_up.out_features / heads;
    let heads_in = HeadLayout {
        rows,
        heads,
        stride: q_width,
        width: nope,
    };
    per_head_product(queries, heads_in, kv_lora_rank, |head, x, y| {
        let w_key = &kv_up.weight[head * up_rows_per_head * kv_lora_rank..][..nope * kv_lora_rank];
        matmul(x, rows, nope, w_key, kv_lora_rank, y, true);
    })
}

/// Where one head's input lies in a `[rows, heads, stride]` buffer: the first `width`
/// values of each head's block.
#[derive(Clone, Copy)]
struct HeadLayout {
    rows: usize,
    heads: usize,
    stride: usize,
    width: usize,
}

/// For each head, gathers its `[rows, width]` input, applies `product(head, input, output)`
/// and scatters the `[rows, out_width]` result into a `[rows, heads, out_width]` buffer.
fn per_head_product(
    input: &[f32],
    layout: HeadLayout,
    out_width: usize,
    product: impl Fn(usize, &[f32], &mut [f32]),
) -> Vec<f32> {
    let HeadLayout {
        rows,
        heads,
        stride,
        width,
    } = layout;
    let mut out = vec![0.0; rows * heads * out_width];
    let mut head_in = vec![0.0; rows * width];
    let mut head_out = vec![0.0; rows * out_width];
    for head in 0..heads {
        for row in 0..rows {
            head_in[row * width..][..width]
                .copy_from_slice(&input[(row * heads + head) * stride..][..width]);
        }
        product(head, &head_in, &mut head_out);
        for row in 0..rows {
            out[(row * heads + head) * out_width..][..out_width]
                .copy_from_slice(&head_out[row * out_width..][..out_width]);
        }
    }
    out
}

/// Applies rope to `rope_dim` elements at `offset` within every `head_width`-wide head.
fn rotate_heads(
    input: &AttentionInput,
    x: &mut [f32],
    head_width: usize,
    offset: usize,
    rope_dim: usize,
) {
    let row_width = x.len() / input.angles.len();
    for (row, angles) in x.chunks_exact_mut(row_width).zip(input.angles) {
        for head in row.chunks_exact_mut(head_width) {
            input
                .rope
                .apply(&mut head[offset..offset + rope_dim], angles);
        }
    }
}

/// Calls `f(segment, row, head, out)` for every (row, head) of the batch in parallel, with
/// `out` that head's `width`-wide slice of the output.
fn par_rows_heads<F>(input: &AttentionInput, out: &mut [f32], width: usize, f: F)
where
    F: Fn(usize, usize, usize, &mut [f32]) + Sync,
{
    let heads = input.num_heads;
    let segment_of_row: Vec<usize> = input
        .segments
        .iter()
        .enumerate()
        .flat_map(|(s, seg)| seg.rows.clone().map(move |_| s))
        .collect();
    out.par_chunks_mut(width).enumerate().for_each(|(i, out)| {
        let (row, head) = (i / heads, i % heads);
        f(segment_of_row[row], row, head, out)
    });
}

/// Softmax-weighted sum of the values given their raw `scores` (one per value row, `stride`
/// apart in `values`), written into `out`.
fn attend(mut weights: Vec<f32>, values: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    for w in weights.iter_mut() {
        *w *= scale;
    }
    crate::compute::cpu::softmax_in_place(&mut weights);
    weighted_rows(&weights, values, stride, out);
}
