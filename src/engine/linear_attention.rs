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
//! A decode step runs this recurrent form. A segment of [`CHUNKED_FROM`] tokens or more (a
//! prefill) runs the chunked form, as transformers and FLA do: the same sums regrouped into
//! blocks of [`CHUNK`] tokens, each a handful of matrix products (see [`head_chunked`]). One
//! head of one sequence is one task, so a prefill keeps every core busy on its heads and a
//! decode batch on its sequences' heads. The state a step computes is kept aside and becomes
//! the sequence's only when the whole step succeeds (`KvCache::advance`).

use rayon::prelude::*;

use super::kv_cache::{KvCache, LinearState};
use crate::compute::cpu::{matmul, matmul_transposed_strided};
use crate::compute::layout::Segment;
use crate::model::config::LinearAttention;
use crate::model::weights::LinearAttentionWeights;

/// The epsilon of the L2 norm over each q and k head (transformers' and FLA's `l2norm`).
const L2_EPS: f32 = 1e-6;

/// Tokens per block of the chunked form. transformers and FLA use 64 (on a GPU); on the CPU
/// a block's own terms grow as its square while the products with the state do not shrink,
/// and 16 was fastest on Qwen3.5's heads (keys and values of 128; the ignored test
/// `chunked_and_recurrent_forms_timed`, on the project's Zen 4 VM: 512 tokens in 0.83 ms a
/// head against 1.0 with 32, 1.6 with 64 and 2.5 token by token).
pub const CHUNK: usize = 16;

/// A segment this long or longer runs the chunked form. A single token (a decode step) runs
/// the recurrent form: 5.6 us against 10 a head in the same measurement; from 2 tokens on the
/// chunked form costs less.
pub const CHUNKED_FROM: usize = 2;

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
                let g = weights.decay_scale[head] * softplus(a[at] + weights.dt_bias[head]);
                (g, sigmoid(b[at]))
            };
            let gates: Vec<(f32, f32)> = seg.rows.clone().map(gates).collect();
            let head = HeadInputs::gather(la, head, &convolved[s].0, gates);
            let state = &states[s].recurrent;
            if head.len() >= CHUNKED_FROM {
                head_chunked(la, &head, state)
            } else {
                head_recurrence(la, &head, state)
            }
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

/// One value head's inputs over one segment: its queries (L2-normed, scaled by
/// `1/sqrt(key_head_dim)`) and keys (L2-normed), `[n, key_head_dim]`; its values
/// `[n, value_head_dim]`; and each token's log decay `g` and `beta`.
struct HeadInputs {
    index: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    gates: Vec<(f32, f32)>,
}

impl HeadInputs {
    /// Head `head`'s part of each convolved row `[n, conv_dim]` (queries, keys, values; a key
    /// head serves `value_heads / key_heads` value heads).
    fn gather(
        la: &LinearAttention,
        head: usize,
        convolved: &[f32],
        gates: Vec<(f32, f32)>,
    ) -> Self {
        let (hk, hv) = (la.key_head_dim, la.value_head_dim);
        let key_dim = la.key_dim();
        let key_head = head / (la.num_value_heads / la.num_key_heads.max(1)).max(1);
        let scale = (hk as f32).powf(-0.5);
        let n = gates.len();
        let (mut q, mut k, mut v) = (
            Vec::with_capacity(n * hk),
            Vec::with_capacity(n * hk),
            Vec::with_capacity(n * hv),
        );
        for (t, row) in convolved.chunks_exact(la.conv_dim()).take(n).enumerate() {
            q.extend_from_slice(&row[key_head * hk..(key_head + 1) * hk]);
            l2_normalize(&mut q[t * hk..], scale);
            k.extend_from_slice(&row[key_dim + key_head * hk..key_dim + (key_head + 1) * hk]);
            l2_normalize(&mut k[t * hk..], 1.0);
            v.extend_from_slice(&row[2 * key_dim + head * hv..2 * key_dim + (head + 1) * hv]);
        }
        Self {
            index: head,
            q,
            k,
            v,
            gates,
        }
    }

    fn len(&self) -> usize {
        self.gates.len()
    }

    /// The head's `[key, value]` state in `state` (`[heads, key, value]`; empty: zeros).
    fn initial_state(&self, la: &LinearAttention, state: &[f32]) -> Vec<f32> {
        let size = la.key_head_dim * la.value_head_dim;
        if state.is_empty() {
            vec![0.0; size]
        } else {
            state[self.index * size..(self.index + 1) * size].to_vec()
        }
    }
}

/// One value head over one segment, token by token, from `state` (`[heads, key, value]`,
/// empty: zeros). Returns the head's new `[key, value]` state and its `[n, value]` outputs.
fn head_recurrence(la: &LinearAttention, head: &HeadInputs, state: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (hk, hv) = (la.key_head_dim, la.value_head_dim);
    let mut s = head.initial_state(la, state);
    let mut outputs = vec![0.0; head.len() * hv];
    let mut delta = vec![0.0; hv];
    for (t, &(g, beta)) in head.gates.iter().enumerate() {
        let q = &head.q[t * hk..(t + 1) * hk];
        let k = &head.k[t * hk..(t + 1) * hk];
        let decay = g.exp();
        s.iter_mut().for_each(|x| *x *= decay);
        // delta = beta * (v - S^T k)
        delta.copy_from_slice(&head.v[t * hv..(t + 1) * hv]);
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

/// The same as [`head_recurrence`], block by block of [`CHUNK`] tokens. Within a block, with
/// `G_t` the sum of the block's log decays up to token `t` and `S` the state before it, the
/// recurrence unrolls to
///
/// ```text
/// u_j = beta_j (v_j - exp(G_j) S^T k_j) - sum_{i<j} beta_j exp(G_j - G_i) (k_j . k_i) u_i
/// o_t = exp(G_t) S^T q_t + sum_{j<=t} exp(G_t - G_j) (q_t . k_j) u_j
/// S'  = exp(G_n) S + sum_j exp(G_n - G_j) k_j u_j^T
/// ```
///
/// The first is a lower-triangular system, solved by forward substitution for `beta v` and
/// `beta exp(G) k` at once (transformers forms the inverse; the two agree to rounding); the
/// rest are products.
fn head_chunked(la: &LinearAttention, head: &HeadInputs, state: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (hk, hv) = (la.key_head_dim, la.value_head_dim);
    let width = hv + hk;
    let mut s = head.initial_state(la, state);
    let mut outputs = vec![0.0; head.len() * hv];
    let mut kk = vec![0.0; CHUNK * CHUNK];
    let mut solved = vec![0.0; CHUNK * width];
    let mut w_s = vec![0.0; CHUNK * hv];
    let (mut w, mut u) = (vec![0.0; CHUNK * hk], vec![0.0; CHUNK * hv]);
    let mut q_decayed = vec![0.0; CHUNK * hk];
    let mut k_to_end = vec![0.0; hk * CHUNK];
    let mut update = vec![0.0; hk * hv];
    for (block, gates) in head.gates.chunks(CHUNK).enumerate() {
        let (first, n) = (block * CHUNK, gates.len());
        let q = &head.q[first * hk..(first + n) * hk];
        let k = &head.k[first * hk..(first + n) * hk];
        let v = &head.v[first * hv..(first + n) * hv];
        let mut cumulative = Vec::with_capacity(n);
        gates.iter().fold(0.0, |sum, &(g, _)| {
            cumulative.push(sum + g);
            sum + g
        });
        let kk = &mut kk[..n * n];
        matmul_transposed_strided((k, hk), n, hk, (k, hk), n, kk, false);
        // Each row: [beta v | beta exp(G) k], less the rows before it as the system says.
        let solved = &mut solved[..n * width];
        for j in 0..n {
            let (before, row) = solved.split_at_mut(j * width);
            let row = &mut row[..width];
            let (g_j, beta) = (cumulative[j], gates[j].1);
            let decay = g_j.exp();
            for (r, &x) in row[..hv].iter_mut().zip(&v[j * hv..(j + 1) * hv]) {
                *r = beta * x;
            }
            for (r, &x) in row[hv..].iter_mut().zip(&k[j * hk..(j + 1) * hk]) {
                *r = beta * decay * x;
            }
            for (i, earlier) in before.chunks_exact(width).enumerate() {
                let a = beta * (g_j - cumulative[i]).exp() * kk[j * n + i];
                for (r, &u) in row.iter_mut().zip(earlier) {
                    *r -= a * u;
                }
            }
        }
        // u = (beta v)' - (beta exp(G) k)' S, in place of the values' part.
        let (w_s, w, u) = (&mut w_s[..n * hv], &mut w[..n * hk], &mut u[..n * hv]);
        for (wj, row) in w.chunks_exact_mut(hk).zip(solved.chunks_exact(width)) {
            wj.copy_from_slice(&row[hv..]);
        }
        matmul(w, n, hk, &s, hv, w_s, false);
        for ((uj, row), ws) in u
            .chunks_exact_mut(hv)
            .zip(solved.chunks_exact(width))
            .zip(w_s.chunks_exact(hv))
        {
            for ((x, &r), &y) in uj.iter_mut().zip(&row[..hv]).zip(ws) {
                *x = r - y;
            }
        }
        // Outputs: exp(G) q against the state, plus the block's own tokens (q k^T, decayed,
        // causal) against u.
        let q_decayed = &mut q_decayed[..n * hk];
        for (t, (qd, qt)) in q_decayed
            .chunks_exact_mut(hk)
            .zip(q.chunks_exact(hk))
            .enumerate()
        {
            let decay = cumulative[t].exp();
            qd.iter_mut().zip(qt).for_each(|(d, &x)| *d = x * decay);
        }
        let out = &mut outputs[first * hv..(first + n) * hv];
        matmul(q_decayed, n, hk, &s, hv, out, false);
        let qk = kk;
        matmul_transposed_strided((q, hk), n, hk, (k, hk), n, qk, false);
        for t in 0..n {
            for j in 0..n {
                qk[t * n + j] = if j <= t {
                    qk[t * n + j] * (cumulative[t] - cumulative[j]).exp()
                } else {
                    0.0
                };
            }
        }
        let intra = w_s;
        matmul(qk, n, n, u, hv, intra, false);
        out.iter_mut().zip(intra.iter()).for_each(|(o, &x)| *o += x);
        // The state after the block: decayed, plus each token's key decayed to the block's
        // end times its u.
        let end = cumulative[n - 1];
        let k_to_end = &mut k_to_end[..hk * n];
        for (j, kj) in k.chunks_exact(hk).enumerate() {
            let decay = (end - cumulative[j]).exp();
            for (i, &x) in kj.iter().enumerate() {
                k_to_end[i * n + j] = x * decay;
            }
        }
        matmul(k_to_end, hk, n, u, hv, &mut update, false);
        let decay = end.exp();
        s.iter_mut()
            .zip(&update)
            .for_each(|(x, &d)| *x = *x * decay + d);
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
