//! Attention over the KV cache for a batch of sequence segments: GQA (Qwen3-MoE, Mixtral) and
//! MLA (DeepSeek-V3, Kimi K2) computed in its absorbed form, so the cache holds only latents.

use std::ops::Range;

use rayon::prelude::*;

use super::kv_cache::{KvCache, LayerCache};
use super::rope::{Rope, RopeAngles};
use super::sparse_attention::{self, Selection, Sparse};
use crate::compute::cpu::{
    Linear, dot_strided, matmul, matmul_strided, matmul_transposed, matmul_transposed_strided,
    rms_norm_in_place, softmax_in_place, weighted_rows,
};
use crate::model::config::{AttentionConfig, LayerAttention, LightningIndexer, Span};
use crate::model::weights::{AttentionWeights, QueryProjection, RmsNorm};

pub use crate::compute::layout::Segment;

/// What attention needs besides weights: shapes and per-row rotary angles.
pub struct AttentionInput<'a> {
    pub config: &'a AttentionConfig,
    pub num_heads: usize,
    pub softmax_scale: f32,
    /// The epsilon of a norm without weights (the model's RMSNorm epsilon).
    pub unit_norm_eps: f32,
    pub rope: &'a Rope,
    /// One entry per row of the batch.
    pub angles: &'a [RopeAngles],
    pub segments: &'a [Segment],
}

/// Runs attention of layer `layer` for all rows of `x` (already normalised) and returns the
/// output projection, `[rows, hidden]`. Appends the new keys to each segment's cache. Under
/// DeepSeek Sparse Attention (MLA only), `sparse` carries the layer's indexer and the
/// positions each row attends to.
pub fn attention(
    (weights, sinks): (&AttentionWeights, Option<&[f32]>),
    input: &AttentionInput,
    layer: usize,
    x: &[f32],
    rows: usize,
    (caches, sparse): (&mut [&mut KvCache], Sparse),
) -> Vec<f32> {
    match input.config {
        AttentionConfig::Gqa { .. } => gqa((weights, sinks), input, layer, x, rows, caches),
        AttentionConfig::Mla { .. } => mla(weights, input, layer, x, rows, (caches, sparse)),
    }
}

/// Grouped-query attention: `group` query heads share each key and value head; prefill
/// segments attend in blocks (products), the other rows head by head.
fn gqa(
    (weights, sinks): (&AttentionWeights, Option<&[f32]>),
    input: &AttentionInput,
    layer: usize,
    x: &[f32],
    rows: usize,
    caches: &mut [&mut KvCache],
) -> Vec<f32> {
    let (
        AttentionWeights::Gqa { o, .. },
        AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            sliding_window,
            layers,
            output_gate,
            ..
        },
    ) = (weights, input.config)
    else {
        unreachable!("attention weights are loaded from the same config")
    };
    let (num_kv_heads, head_dim) = (*num_kv_heads, *head_dim);
    let this = layers.get(layer).copied().unwrap_or(LayerAttention {
        rope: true,
        span: sliding_window.map_or(Span::Full, Span::Window),
        unit_qk_norm: false,
        temperature: None,
    });
    let (queries, gate, keys, values) =
        gqa_project(weights, input, (x, rows), (head_dim, *output_gate), &this);
    let kv_width = num_kv_heads * head_dim;
    append_to_caches(input.segments, caches, layer, &keys, &values);
    let group = input.num_heads / num_kv_heads;
    let mut out = vec![0.0; rows * input.num_heads * head_dim];
    let caches: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
    let window_start = |position: usize| this.span.start(position);
    // Segments of several rows (prefill) attend in blocks; the other rows below.
    let blocked = blocked_segments(input);
    let shape = GqaShape {
        head_dim,
        num_kv_heads,
        group,
    };
    gqa_blocks(
        input,
        (&caches, layer),
        &queries,
        shape,
        (this.span, sinks),
        &blocked,
        &mut out,
    );
    par_rows_heads(
        input,
        &blocked,
        &mut out,
        head_dim,
        |segment, row, head, out| {
            let LayerCache {
                first: keys,
                second: values,
                ..
            } = &caches[segment].layers[layer];
            let seg = &input.segments[segment];
            let position = seg.start_position + (row - seg.rows.start);
            let first = window_start(position);
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
                (input.softmax_scale, sinks.map(|s| s[head])),
                out,
            );
        },
    );
    if let Some(gate) = gate {
        for (o, g) in out.iter_mut().zip(&gate) {
            *o /= 1.0 + (-g).exp();
        }
    }
    o.forward(&out, rows)
}

/// GQA's projections of `x`: the queries (normed, rotated and scaled as the layer says), the
/// output gate where the model has one, the keys and the values.
fn gqa_project(
    weights: &AttentionWeights,
    input: &AttentionInput,
    (x, rows): (&[f32], usize),
    (head_dim, output_gate): (usize, bool),
    this: &LayerAttention,
) -> (Vec<f32>, Option<Vec<f32>>, Vec<f32>, Vec<f32>) {
    let AttentionWeights::Gqa {
        q,
        k,
        v,
        q_norm,
        k_norm,
        ..
    } = weights
    else {
        unreachable!("attention weights are loaded from the same config")
    };
    let mut queries = q.forward(x, rows);
    let gate = output_gate.then(|| split_query_gate(&mut queries, rows, input.num_heads, head_dim));
    let mut keys = k.forward(x, rows);
    let values = v.forward(x, rows);
    if let Some(norm) = q_norm {
        rms_norm_in_place(&mut queries, &norm.weight, norm.eps);
    }
    if let Some(norm) = k_norm {
        rms_norm_in_place(&mut keys, &norm.weight, norm.eps);
    }
    if this.rope {
        // The first `rope.dim()` values of each head (all of it but under partial rotary).
        let rope_dim = input.rope.dim();
        rotate_heads(input, &mut queries, head_dim, 0, rope_dim);
        rotate_heads(input, &mut keys, head_dim, 0, rope_dim);
    }
    if this.unit_qk_norm {
        // Over each head, which rope's rotation leaves as it is: before or after, alike.
        let ones = vec![1.0; head_dim];
        rms_norm_in_place(&mut queries, &ones, input.unit_norm_eps);
        rms_norm_in_place(&mut keys, &ones, input.unit_norm_eps);
    }
    if let Some(temperature) = this.temperature {
        let width = input.num_heads * head_dim;
        for seg in input.segments {
            for row in seg.rows.clone() {
                let scale = temperature.scale(seg.start_position + row - seg.rows.start);
                queries[row * width..][..width]
                    .iter_mut()
                    .for_each(|q| *q *= scale);
            }
        }
    }
    (queries, gate, keys, values)
}

/// The shape of a GQA layer's heads: `group` query heads share each key and value head.
#[derive(Clone, Copy)]
struct GqaShape {
    head_dim: usize,
    num_kv_heads: usize,
    group: usize,
}

/// GQA for the segments of several rows (prefill): blocks of queries against the cached keys
/// and values as products, the `group` heads that share a key head together, written into
/// `out` (`[rows, heads, head_dim]`).
fn gqa_blocks(
    input: &AttentionInput,
    (caches, layer): (&[&KvCache], usize),
    queries: &[f32],
    shape: GqaShape,
    (span, sinks): (Span, Option<&[f32]>),
    blocked: &[bool],
    out: &mut [f32],
) {
    let GqaShape {
        head_dim,
        num_kv_heads,
        group,
    } = shape;
    let kv_width = num_kv_heads * head_dim;
    let window_start = |position: usize| span.start(position);
    let tasks = block_tasks(input, blocked, group, num_kv_heads);
    let done: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|task| {
            let LayerCache {
                first: keys,
                second: values,
                ..
            } = &caches[task.segment].layers[layer];
            let seg = &input.segments[task.segment];
            let position = |row: usize| seg.start_position + (row - seg.rows.start);
            let first = window_start(position(task.rows.start));
            let count = position(task.rows.end - 1) + 1 - first;
            let width = group * head_dim;
            let kv_offset = task.kv_head * head_dim;
            let mut block = Vec::with_capacity(task.rows.len() * width);
            for row in task.rows.clone() {
                let at = (row * input.num_heads + task.kv_head * group) * head_dim;
                block.extend_from_slice(&queries[at..][..width]);
            }
            let n_queries = task.rows.len() * group;
            let mut scores = vec![0.0; n_queries * count];
            matmul_transposed_strided(
                (&block, head_dim),
                n_queries,
                head_dim,
                (&keys[first * kv_width + kv_offset..], kv_width),
                count,
                &mut scores,
                false,
            );
            let sink = |query: usize| sinks.map(|s| s[task.kv_head * group + query % group]);
            softmax_rows(&mut scores, count, input.softmax_scale, sink, |query| {
                let position = position(task.rows.start + query / group);
                window_start(position) - first..position + 1 - first
            });
            matmul_strided(
                &scores,
                n_queries,
                count,
                (&values[first * kv_width + kv_offset..], kv_width),
                head_dim,
                &mut block,
                false,
            );
            block
        })
        .collect();
    for (task, block) in tasks.iter().zip(&done) {
        let width = group * head_dim;
        for (row, block) in task.rows.clone().zip(block.chunks_exact(width)) {
            let at = (row * input.num_heads + task.kv_head * group) * head_dim;
            out[at..][..width].copy_from_slice(block);
        }
    }
}

/// Splits a gated projection's `[rows, heads, 2 * head_dim]` (each head's query, then its
/// gate) into the queries, left in `queries` as `[rows, heads, head_dim]`, and the gates,
/// returned in the same shape.
fn split_query_gate(
    queries: &mut Vec<f32>,
    rows: usize,
    heads: usize,
    head_dim: usize,
) -> Vec<f32> {
    let mut gate = Vec::with_capacity(rows * heads * head_dim);
    let mut kept = Vec::with_capacity(rows * heads * head_dim);
    for both in queries.chunks_exact(2 * head_dim) {
        kept.extend_from_slice(&both[..head_dim]);
        gate.extend_from_slice(&both[head_dim..]);
    }
    *queries = kept;
    gate
}

/// Multi-head latent attention: the queries absorb the keys' up-projection and attend to the
/// cached latents and rotary keys; the attended latents expand through the values' half.
/// Under DeepSeek Sparse Attention each query attends only to the positions selected.
fn mla(
    weights: &AttentionWeights,
    input: &AttentionInput,
    layer: usize,
    x: &[f32],
    rows: usize,
    (caches, sparse): (&mut [&mut KvCache], Sparse),
) -> Vec<f32> {
    let (
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
            ref indexer,
            ..
        },
    ) = (weights, input.config)
    else {
        unreachable!("attention weights are loaded from the same config")
    };
    let heads = input.num_heads;
    let q_width = nope + rope_dim;
    let (mut queries, selection) = mla_queries(
        (q, indexer.as_ref()),
        input,
        (layer, x, rows),
        (caches, sparse),
    );
    rotate_heads(input, &mut queries, q_width, nope, rope_dim);
    let (latents, rope_keys) = split_compressed(
        input,
        &kv_down.forward(x, rows),
        kv_lora_rank,
        rope_dim,
        kv_norm,
    );
    append_to_caches(input.segments, caches, layer, &latents, &rope_keys);
    // Absorb kv_b's key half into the queries: q_nope · (W_uk c) = (q_nope W_uk) · c.
    let up_rows_per_head = nope + v_head_dim;
    let absorbed = absorb_queries(&queries, rows, heads, q_width, nope, kv_up, kv_lora_rank);
    let caches: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
    let mut latent_out = vec![0.0; rows * heads * kv_lora_rank];
    // Segments of several rows (prefill) attend in blocks; the other rows below.
    let blocked = blocked_segments(input);
    let shape = MlaShape {
        heads,
        kv_lora_rank,
        nope,
        rope_dim,
    };
    mla_blocks(
        input,
        (&caches, layer),
        (&queries, &absorbed),
        shape,
        selection,
        &blocked,
        &mut latent_out,
    );
    par_rows_heads(
        input,
        &blocked,
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
            if let Some(chosen) = selection.and_then(|s| s.chosen(row)) {
                // Only the positions the indexer chose are read, scored and summed.
                let query = (q_latent, q_rope);
                let cached = (latents.as_slice(), rope_keys.as_slice());
                sparse_attention::attend_chosen(chosen, query, cached, input.softmax_scale, out);
                return;
            }
            let mut scores = vec![0.0; position + 1];
            let mut rope_scores = vec![0.0; position + 1];
            dot_strided(q_latent, latents, kv_lora_rank, &mut scores);
            dot_strided(q_rope, rope_keys, rope_dim, &mut rope_scores);
            for (s, r) in scores.iter_mut().zip(&rope_scores) {
                *s += r;
            }
            attend(
                scores,
                latents,
                kv_lora_rank,
                (input.softmax_scale, None),
                out,
            );
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

/// The shape of an MLA layer's heads: latents of `kv_lora_rank`, queries of `nope + rope_dim`.
#[derive(Clone, Copy)]
struct MlaShape {
    heads: usize,
    kv_lora_rank: usize,
    nope: usize,
    rope_dim: usize,
}

/// MLA for the segments of several rows (prefill): blocks of queries, every head at once
/// (they share the latents), against the cached latents and rotary keys as products, written
/// into `out` (`[rows, heads, kv_lora_rank]`, attended latents).
fn mla_blocks(
    input: &AttentionInput,
    (caches, layer): (&[&KvCache], usize),
    (queries, absorbed): (&[f32], &[f32]),
    shape: MlaShape,
    selection: Option<&Selection>,
    blocked: &[bool],
    out: &mut [f32],
) {
    let MlaShape {
        heads,
        kv_lora_rank,
        nope,
        rope_dim,
    } = shape;
    let q_width = nope + rope_dim;
    let tasks = block_tasks(input, blocked, heads, 1);
    let done: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|task| {
            let LayerCache {
                first: latents,
                second: rope_keys,
                ..
            } = &caches[task.segment].layers[layer];
            let seg = &input.segments[task.segment];
            let position = |row: usize| seg.start_position + (row - seg.rows.start);
            let count = position(task.rows.end - 1) + 1;
            let n_queries = task.rows.len() * heads;
            let first_query = task.rows.start * heads;
            let mut scores = vec![0.0; n_queries * count];
            matmul_transposed_strided(
                (&absorbed[first_query * kv_lora_rank..], kv_lora_rank),
                n_queries,
                kv_lora_rank,
                (latents, kv_lora_rank),
                count,
                &mut scores,
                false,
            );
            matmul_transposed_strided(
                (&queries[first_query * q_width + nope..], q_width),
                n_queries,
                rope_dim,
                (rope_keys, rope_dim),
                count,
                &mut scores,
                true,
            );
            if let Some(selection) = selection {
                selection.mask_block(&mut scores, count, task.rows.start, heads);
            }
            softmax_rows(
                &mut scores,
                count,
                input.softmax_scale,
                |_| None,
                |query| 0..position(task.rows.start + query / heads) + 1,
            );
            let mut block = vec![0.0; n_queries * kv_lora_rank];
            matmul_strided(
                &scores,
                n_queries,
                count,
                (latents, kv_lora_rank),
                kv_lora_rank,
                &mut block,
                false,
            );
            block
        })
        .collect();
    for (task, block) in tasks.iter().zip(&done) {
        let width = heads * kv_lora_rank;
        out[task.rows.start * width..task.rows.end * width].copy_from_slice(block);
    }
}

/// MLA's queries (`[rows, heads, nope + rope]`, not yet rotated) and, under DeepSeek Sparse
/// Attention, the positions each row attends to: chosen by this layer's indexer (run here on
/// the normed low-rank query, its keys appended to the caches) or by the last layer's.
fn mla_queries<'s>(
    (q, indexer): (&QueryProjection, Option<&LightningIndexer>),
    input: &AttentionInput,
    (layer, x, rows): (usize, &[f32], usize),
    (caches, sparse): (&mut [&mut KvCache], Sparse<'s>),
) -> (Vec<f32>, Option<&'s Selection>) {
    let (queries, low) = match q {
        QueryProjection::Direct(proj) => (proj.forward(x, rows), None),
        QueryProjection::LowRank { down, norm, up } => {
            let mut low = down.forward(x, rows);
            rms_norm_in_place(&mut low, &norm.weight, norm.eps);
            (up.forward(&low, rows), Some(low))
        }
    };
    let Sparse {
        indexer: weights,
        selection,
    } = sparse;
    if let (Some(config), Some(weights), Some(low)) = (indexer, weights, &low) {
        let chosen =
            sparse_attention::select((weights, config), input, layer, (x, low), rows, caches);
        *selection = Some(chosen);
    }
    // Only a model with DeepSeek Sparse Attention has a selection.
    let selection: &'s Option<Selection> = selection;
    (queries, selection.as_ref().filter(|_| indexer.is_some()))
}

/// The normed latents and the rotated shared keys of each row, from the rows' joint down
/// projection (`kv_a_proj_with_mqa`: the latent, then the rotary key).
fn split_compressed(
    input: &AttentionInput,
    compressed: &[f32],
    kv_lora_rank: usize,
    rope_dim: usize,
    kv_norm: &RmsNorm,
) -> (Vec<f32>, Vec<f32>) {
    let rows = compressed.len() / (kv_lora_rank + rope_dim);
    let mut latents = Vec::with_capacity(rows * kv_lora_rank);
    let mut rope_keys = Vec::with_capacity(rows * rope_dim);
    for (row, c) in compressed.chunks_exact(kv_lora_rank + rope_dim).enumerate() {
        let start = latents.len();
        latents.extend_from_slice(&c[..kv_lora_rank]);
        rms_norm_in_place(&mut latents[start..], &kv_norm.weight, kv_norm.eps);
        let start = rope_keys.len();
        rope_keys.extend_from_slice(&c[kv_lora_rank..]);
        input
            .rope
            .apply(&mut rope_keys[start..], &input.angles[row]);
    }
    (latents, rope_keys)
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
/// `out` that head's `width`-wide slice of the output, except rows of the segments marked in
/// `skip` (attended in blocks).
fn par_rows_heads<F>(input: &AttentionInput, skip: &[bool], out: &mut [f32], width: usize, f: F)
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
        let segment = segment_of_row[row];
        if !skip[segment] {
            f(segment, row, head, out)
        }
    });
}

/// Segments of at least this many rows attend in blocks of queries ([`block_tasks`]): each
/// cached key and value is then read once per block rather than once per query, and the
/// scores and weighted sums are products for the packed GEMM. A decode row (one per
/// sequence) reads them once either way and keeps the one-query kernels.
const BLOCK_MIN_ROWS: usize = 4;

/// Rows of a segment one block takes at most.
const BLOCK_MAX_ROWS: usize = 64;

/// Bytes of scores one block holds at most (its queries times the keys they may see), so a
/// long context takes fewer rows a block rather than a larger buffer.
const BLOCK_SCORE_BYTES: usize = 1 << 20;

/// Which segments attend in blocks.
fn blocked_segments(input: &AttentionInput) -> Vec<bool> {
    input
        .segments
        .iter()
        .map(|seg| seg.rows.len() >= BLOCK_MIN_ROWS)
        .collect()
}

/// One block of queries: rows of one segment, and the key head whose queries it takes (GQA:
/// `queries_per_row` heads share it; MLA: one for every head).
struct BlockTask {
    segment: usize,
    rows: Range<usize>,
    kv_head: usize,
}

/// The blocks of the `blocked` segments, for `kv_heads` key heads each serving
/// `queries_per_row` query heads. A block's rows are sized so that its scores (every query
/// against the keys its last row sees) stay within [`BLOCK_SCORE_BYTES`].
fn block_tasks(
    input: &AttentionInput,
    blocked: &[bool],
    queries_per_row: usize,
    kv_heads: usize,
) -> Vec<BlockTask> {
    let mut tasks = Vec::new();
    for (segment, seg) in input.segments.iter().enumerate() {
        if !blocked[segment] {
            continue;
        }
        let keys = seg.start_position + seg.rows.len();
        let per_row = queries_per_row * keys * std::mem::size_of::<f32>();
        let block_rows = (BLOCK_SCORE_BYTES / per_row).clamp(1, BLOCK_MAX_ROWS);
        for start in seg.rows.clone().step_by(block_rows) {
            let rows = start..(start + block_rows).min(seg.rows.end);
            tasks.extend((0..kv_heads).map(|kv_head| BlockTask {
                segment,
                rows: rows.clone(),
                kv_head,
            }));
        }
    }
    tasks
}

/// Turns a block's raw scores (`keys` per query) into attention weights, as [`attend`] does
/// for one query: scaled, and a softmax over the keys each query sees (`visible(query)`, an
/// index range into its row), zero for the others.
fn softmax_rows(
    scores: &mut [f32],
    keys: usize,
    scale: f32,
    sink: impl Fn(usize) -> Option<f32>,
    visible: impl Fn(usize) -> Range<usize>,
) {
    for (query, row) in scores.chunks_exact_mut(keys).enumerate() {
        let seen = visible(query);
        row[..seen.start].fill(0.0);
        row[seen.end..].fill(0.0);
        let row = &mut row[seen];
        for w in row.iter_mut() {
            *w *= scale;
        }
        softmax_with_sink(row, sink(query));
    }
}

/// A softmax over `row` and, where there is one, a sink logit that takes its share of the
/// weight and has no value (gpt-oss): the weights then sum to less than 1.
fn softmax_with_sink(row: &mut [f32], sink: Option<f32>) {
    let Some(sink) = sink else {
        softmax_in_place(row);
        return;
    };
    let max = row.iter().copied().fold(sink, f32::max);
    let mut sum = (sink - max).exp();
    for w in row.iter_mut() {
        *w = (*w - max).exp();
        sum += *w;
    }
    for w in row.iter_mut() {
        *w /= sum;
    }
}

/// Softmax-weighted sum of the values given their raw `scores` (one per value row, `stride`
/// apart in `values`), written into `out`.
fn attend(
    mut weights: Vec<f32>,
    values: &[f32],
    stride: usize,
    (scale, sink): (f32, Option<f32>),
    out: &mut [f32],
) {
    for w in weights.iter_mut() {
        *w *= scale;
    }
    softmax_with_sink(&mut weights, sink);
    weighted_rows(&weights, values, stride, out);
}
