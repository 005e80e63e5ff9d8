//! Manifold-constrained hyper-connections, as transformers' `DeepseekV4HyperConnection` and
//! `DeepseekV4HyperHead`: the residual is `hc_mult` streams per position. Before a block, a
//! one-layer perceptron over the RMS-normed streams gives `pre` (how the streams collapse into
//! the block's input), `post` (how the block's output spreads back over them) and `comb` (how
//! the streams mix), the last made doubly stochastic by Sinkhorn-Knopp iterations; after the
//! block, stream `k` becomes `post[k] * output + sum_j comb[j][k] * stream[j]`.

use super::weights::MixerWeights;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The streams of one position `[m * hidden]`, RMS-normed as one vector (no weight), then
/// `weight [outputs, m * hidden]` times them.
fn project(streams: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mean_square = streams.iter().map(|v| v * v).sum::<f32>() / streams.len().max(1) as f32;
    let scale = 1.0 / (mean_square + eps).sqrt();
    let normed: Vec<f32> = streams.iter().map(|v| v * scale).collect();
    weight
        .chunks_exact(streams.len().max(1))
        .map(|row| row.iter().zip(&normed).map(|(w, x)| w * x).sum())
        .collect()
}

/// One position's mixing weights for the block after it.
pub struct Mix {
    /// `[m]`.
    pub post: Vec<f32>,
    /// `[m, m]`, doubly stochastic.
    pub comb: Vec<f32>,
}

/// Sinkhorn-Knopp as the reference runs it: columns first, then `iters - 1` rounds of rows
/// and columns, each sum offset by `eps`.
pub fn sinkhorn(comb: &mut [f32], m: usize, iters: usize, eps: f32) {
    let columns = |comb: &mut [f32]| {
        for k in 0..m {
            let sum: f32 = (0..m).map(|j| comb[j * m + k]).sum::<f32>() + eps;
            (0..m).for_each(|j| comb[j * m + k] /= sum);
        }
    };
    columns(comb);
    for _ in 1..iters {
        for row in comb.chunks_exact_mut(m) {
            let sum: f32 = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= sum);
        }
        columns(comb);
    }
}

/// The mixer of one position's `streams [m * hidden]`: its weights and the block's input.
pub fn mix(
    weights: &MixerWeights,
    streams: &[f32],
    [m, hidden]: [usize; 2],
    (norm_eps, hc_eps, iters): (f32, f32, usize),
) -> (Mix, Vec<f32>) {
    let mixes = project(streams, &weights.fn_, norm_eps);
    let (scale, base) = (&weights.scale, &weights.base);
    let pre: Vec<f32> = (0..m)
        .map(|i| sigmoid(mixes[i] * scale[0] + base[i]) + hc_eps)
        .collect();
    let post: Vec<f32> = (0..m)
        .map(|i| 2.0 * sigmoid(mixes[m + i] * scale[1] + base[m + i]))
        .collect();
    let mut comb = vec![0.0; m * m];
    for (j, row) in comb.chunks_exact_mut(m).enumerate() {
        for (k, v) in row.iter_mut().enumerate() {
            let i = 2 * m + j * m + k;
            *v = mixes[i] * scale[2] + base[i];
        }
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        row.iter_mut().for_each(|v| *v = (*v - max).exp());
        let sum: f32 = row.iter().sum();
        row.iter_mut().for_each(|v| *v = *v / sum + hc_eps);
    }
    sinkhorn(&mut comb, m, iters, hc_eps);
    (Mix { post, comb }, collapse(streams, &pre, hidden))
}

/// `sum_i pre[i] * stream[i]`.
fn collapse(streams: &[f32], pre: &[f32], hidden: usize) -> Vec<f32> {
    let mut out = vec![0.0; hidden];
    for (stream, p) in streams.chunks_exact(hidden).zip(pre) {
        out.iter_mut().zip(stream).for_each(|(o, x)| *o += p * x);
    }
    out
}

/// After the block: stream `k` becomes `post[k] * output + sum_j comb[j][k] * stream[j]`.
pub fn spread(streams: &mut [f32], mix: &Mix, output: &[f32], m: usize) {
    let hidden = output.len();
    let old = streams.to_vec();
    for (k, stream) in streams.chunks_exact_mut(hidden).enumerate() {
        for (d, v) in stream.iter_mut().enumerate() {
            let mixed: f32 = (0..m)
                .map(|j| mix.comb[j * m + k] * old[j * hidden + d])
                .sum();
            *v = mix.post[k] * output[d] + mixed;
        }
    }
}

/// The final collapse of one position's streams (`hc_head`): `pre` only.
pub fn head(
    (weight, base, scale): (&[f32], &[f32], f32),
    streams: &[f32],
    hidden: usize,
    (norm_eps, hc_eps): (f32, f32),
) -> Vec<f32> {
    let mixes = project(streams, weight, norm_eps);
    let pre: Vec<f32> = mixes
        .iter()
        .zip(base)
        .map(|(x, b)| sigmoid(x * scale + b) + hc_eps)
        .collect();
    collapse(streams, &pre, hidden)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Enough Sinkhorn rounds make any positive matrix doubly stochastic.
    #[test]
    fn sinkhorn_makes_rows_and_columns_sum_to_one() {
        let mut comb = vec![0.9, 0.05, 0.3, 0.1, 0.5, 0.2, 0.4, 0.1, 0.8];
        sinkhorn(&mut comb, 3, 50, 0.0);
        for i in 0..3 {
            let row: f32 = comb[i * 3..i * 3 + 3].iter().sum();
            let column: f32 = (0..3).map(|j| comb[j * 3 + i]).sum();
            assert!(
                (row - 1.0).abs() < 1e-4 && (column - 1.0).abs() < 1e-4,
                "{comb:?}"
            );
        }
    }

    /// Two streams, the identity mix and post 1: stream k gets the output added.
    #[test]
    fn spreading_adds_the_output_through_post_and_mixes_through_comb() {
        let mut streams = vec![1.0, 2.0, 10.0, 20.0];
        let mix = Mix {
            post: vec![1.0, 0.5],
            comb: vec![0.0, 1.0, 1.0, 0.0],
        };
        spread(&mut streams, &mix, &[100.0, 200.0], 2);
        // Stream 0 = 1 * out + stream 1 (comb[1][0] = 1); stream 1 = 0.5 * out + stream 0.
        assert_eq!(streams, vec![110.0, 220.0, 51.0, 102.0]);
    }
}
