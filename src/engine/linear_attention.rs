//! Gated DeltaNet, the linear attention of Qwen3-Next's and Qwen3.5's `linear_attention`
//! layers, over a batch of sequence segments. Each value head keeps a `key x value` state
//! `S`; per token, after a causal depthwise convolution (and SiLU) of the projected q, k and
//! v, with q and k L2-normed per head and q scaled by `1/sqrt(key_head_dim)`:
//!
//! ```text
//! S = exp(g) * S;   S += k (beta * (v - S^T k))^T;   o = S^T q
//! g = -exp(A_log) * softplus(a + dt_bias),   beta = sigmoid(b)
//! ```
//!
//! then an RMSNorm of each head's `o` times `silu(z)`, and the output projection.
//!
//! Prefill runs this recurrent form token by token too (transformers prefills with the
//! chunked form, which computes the same in blocks of 64 with products): one head of one
//! sequence is one task, so a prefill keeps every core busy on its heads and a decode batch
//! on its sequences' heads. The state a step computes is kept aside and becomes the
//! sequence's only when the whole step succeeds (`KvCache::advance`).

use rayon::prelude::*;

use super::kv_cache::{KvCache, LinearState};
use crate::compute::layout::Segment;
use crate::model::config::LinearAttention;
use crate::model::weights::LinearAttentionWeights;

/// The epsilon of the L2 norm over each q and k head (transformers' and FLA's `l2norm`).
const L2_EPS: f32 = 1e-6;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `log(1 + exp(x))`, as torch computes it: `x` itself above 20.
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// Runs layer `layer`'s gated DeltaNet for all rows of `x` (already normalised) and returns
/// its output projection, `[rows, hidden]`. Each segment's new state is put beside its
/// current one in its cache.
pub fn linear_attention(
    weights: &LinearAttentionWeights,
    la: &LinearAttention,
    (layer, eps): (usize, f32),
    x: &[f32],
    rows: usize,
    segments: &[Segment],
    caches: &mut [&mut KvCache],
) -> Vec<f32> {
    let (conv_dim, value_dim) = (la.conv_dim(), la.value_dim());
    let mixed = weights.qkv.forward(x, rows);
    let z = weights.z.forward(x, rows);
    let b = weights.b.forward(x, rows);
    let a = weights.a.forward(x, rows);
    let states: Vec<&LinearState> = caches
        .iter()
        .map(|c| {
            c.layers[layer]
                .linear
                .as_ref()
                .expect("a linear layer's cache holds a linear state")
        })
        .collect();
    // The convolution, segment by segment: its output rows and each segment's new window.
    let convolved: Vec<(Vec<f32>, Vec<f32>)> = segments
        .par_iter()
        .zip(&states)
        .map(|(seg, state)| {
            let input = &mixed[seg.rows.start * conv_dim..seg.rows.end * conv_dim];
            convolve(&weights.conv, la, &state.conv, input)
        })
        .collect();
    // Every head of every segment is one task, from the committed state.
    let heads = la.num_value_heads;
    let tasks: Vec<(usize, usize)> = (0..segments.len())
        .flat_map(|s| (0..heads).map(move |h| (s, h)))
        .collect();
    let done: Vec<(Vec<f32>, Vec<f32>)> = tasks
        .par_iter()
        .map(|&(s, head)| {
            let seg = &segments[s];
            let gates = |row: usize| {
                let at = row * heads + head;
                let decay = weights.decay_scale[head] * softplus(a[at] + weights.dt_bias[head]);
                (decay.exp(), sigmoid(b[at]))
            };
            let gates: Vec<(f32, f32)> = seg.rows.clone().map(gates).collect();
            head_recurrence(la, head, &states[s].recurrent, &convolved[s].0, &gates)
        })
        .collect();
    // Each head's outputs normed and gated, in `[rows, value_heads, value_head_dim]`.
    let hv = la.value_head_dim;
    let mut core = vec![0.0; rows * value_dim];
    for (&(s, head), (_, out)) in tasks.iter().zip(&done) {
        for (i, row) in segments[s].rows.clone().enumerate() {
            let at = row * value_dim + head * hv;
            let o = &mut core[at..at + hv];
            o.copy_from_slice(&out[i * hv..(i + 1) * hv]);
            gated_norm(o, &z[at..at + hv], &weights.norm.weight, eps);
        }
    }
    let state_len = heads * la.key_head_dim * hv;
    for (s, cache) in caches.iter_mut().enumerate() {
        let mut recurrent = Vec::with_capacity(state_len);
        for (_, (state, _)) in tasks.iter().zip(&done).filter(|((t, _), _)| *t == s) {
            recurrent.extend_from_slice(state);
        }
        let window = convolved[s].1.clone();
        if let Some(state) = cache.layers[layer].linear.as_mut() {
            state.next = Some((recurrent, window));
        }
    }
    weights.out.forward(&core, rows)
}

/// The causal depthwise convolution and SiLU over one segment's `[n, conv_dim]` input after
/// the window of the previous `kernel - 1` inputs (zeros where empty). Returns the output
/// rows and the window after the segment.
fn convolve(
    conv: &[f32],
    la: &LinearAttention,
    window: &[f32],
    input: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let (channels, kernel) = (la.conv_dim(), la.conv_kernel);
    let past = kernel - 1;
    let mut padded = Vec::with_capacity((past + input.len() / channels) * channels);
    if window.is_empty() {
        padded.resize(past * channels, 0.0);
    } else {
        padded.extend_from_slice(window);
    }
    padded.extend_from_slice(input);
    let n = input.len() / channels;
    let mut out = vec![0.0; n * channels];
    for t in 0..n {
        let row = &mut out[t * channels..(t + 1) * channels];
        for (c, o) in row.iter_mut().enumerate() {
            let taps = &conv[c * kernel..(c + 1) * kernel];
            let sum: f32 = taps
                .iter()
                .enumerate()
                .map(|(j, w)| w * padded[(t + j) * channels + c])
                .sum();
            *o = sum * sigmoid(sum);
        }
    }
    let window = padded[padded.len() - past * channels..].to_vec();
    (out, window)
}

/// One value head over one segment's convolved rows, from `state` (`[heads, key, value]`,
/// empty: zeros), with each row's `(exp(g), beta)`. Returns the head's new `[key, value]`
/// state and its `[n, value]` outputs.
fn head_recurrence(
    la: &LinearAttention,
    head: usize,
    state: &[f32],
    convolved: &[f32],
    gates: &[(f32, f32)],
) -> (Vec<f32>, Vec<f32>) {
    let (hk, hv) = (la.key_head_dim, la.value_head_dim);
    let key_dim = la.key_dim();
    let channels = la.conv_dim();
    let key_head = head / (la.num_value_heads / la.num_key_heads.max(1)).max(1);
    let mut s = if state.is_empty() {
        vec![0.0; hk * hv]
    } else {
        state[head * hk * hv..(head + 1) * hk * hv].to_vec()
    };
    let scale = (hk as f32).powf(-0.5);
    let mut outputs = vec![0.0; gates.len() * hv];
    let mut q = vec![0.0; hk];
    let mut k = vec![0.0; hk];
    let mut delta = vec![0.0; hv];
    for (t, &(decay, beta)) in gates.iter().enumerate() {
        let row = &convolved[t * channels..(t + 1) * channels];
        q.copy_from_slice(&row[key_head * hk..(key_head + 1) * hk]);
        k.copy_from_slice(&row[key_dim + key_head * hk..key_dim + (key_head + 1) * hk]);
        let v = &row[2 * key_dim + head * hv..2 * key_dim + (head + 1) * hv];
        l2_normalize(&mut q, scale);
        l2_normalize(&mut k, 1.0);
        s.iter_mut().for_each(|x| *x *= decay);
        // delta = beta * (v - S^T k)
        delta.copy_from_slice(v);
        for (i, &ki) in k.iter().enumerate() {
            for (d, &sij) in delta.iter_mut().zip(&s[i * hv..(i + 1) * hv]) {
                *d -= sij * ki;
            }
        }
        delta.iter_mut().for_each(|d| *d *= beta);
        // S += k delta^T; o = S^T q
        let out = &mut outputs[t * hv..(t + 1) * hv];
        for i in 0..hk {
            let s_row = &mut s[i * hv..(i + 1) * hv];
            for ((sij, &d), o) in s_row.iter_mut().zip(&delta).zip(out.iter_mut()) {
                *sij += k[i] * d;
                *o += *sij * q[i];
            }
        }
    }
    (s, outputs)
}

/// `x / sqrt(sum(x^2) + eps) * scale`.
fn l2_normalize(x: &mut [f32], scale: f32) {
    let sum: f32 = x.iter().map(|v| v * v).sum();
    let factor = (sum + L2_EPS).sqrt().recip() * scale;
    x.iter_mut().for_each(|v| *v *= factor);
}

/// An RMSNorm of one head's output with `weight`, times `silu(gate)`.
fn gated_norm(o: &mut [f32], gate: &[f32], weight: &[f32], eps: f32) {
    let mean = o.iter().map(|v| v * v).sum::<f32>() / o.len().max(1) as f32;
    let inv = (mean + eps).sqrt().recip();
    for ((v, &w), &g) in o.iter_mut().zip(weight).zip(gate) {
        *v = *v * inv * w * (g * sigmoid(g));
    }
}

#[cfg(test)]
mod tests;
