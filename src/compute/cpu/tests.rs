use half::bf16;

use super::decode::*;
use super::tiles::*;
use super::*;

/// `x [m, k] · w [n, k]ᵀ`, element by element: the reference the products are held to.
pub(crate) fn naive(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
        }
    }
    out
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.iter()
        .zip(b)
        .all(|(x, y)| (x - y).abs() <= 1e-4 * (1.0 + y.abs()))
}

#[test]
fn attention_scores_and_weighted_sums_equal_the_plain_loops() {
    // Keys and values `stride` apart (other heads between them); widths below, at and
    // above a 16-lane chunk and a 128-value block, with tails; row counts that leave
    // rows over after the groups of four.
    for (width, stride, count) in [(128, 512, 37), (64, 64, 4), (200, 300, 9), (20, 21, 3)] {
        let x: Vec<f32> = (0..width)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
            .collect();
        let rows: Vec<f32> = (0..count * stride)
            .map(|i| ((i * 11 % 17) as f32 - 8.0) / 9.0)
            .collect();
        let mut scores = vec![0.0; count];
        dot_strided(&x, &rows, stride, &mut scores);
        for (j, &got) in scores.iter().enumerate() {
            let want: f32 = (0..width).map(|i| x[i] * rows[j * stride + i]).sum();
            assert!(
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "score {j}: {got} vs {want}"
            );
        }
        // A row's score is the same whatever rows are scored beside it (the first is
        // scored in a group of four above, alone here).
        let mut alone = vec![0.0; 1];
        dot_strided(&x, &rows, stride, &mut alone);
        assert_eq!(alone[0].to_bits(), scores[0].to_bits());
        let weights: Vec<f32> = (0..count).map(|j| 1.0 / (1 + j) as f32).collect();
        let mut out = vec![f32::NAN; width];
        weighted_rows(&weights, &rows, stride, &mut out);
        for (i, &got) in out.iter().enumerate() {
            let want: f32 = (0..count).map(|j| weights[j] * rows[j * stride + i]).sum();
            assert!(
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "value {i}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn transposed_product_matches_naive_for_one_and_many_rows() {
    let (k, n) = (37, 130);
    let w: Vec<f32> = (0..n * k)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
        .collect();
    for m in [1, 3, 4, 7, 8, 9, 64] {
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
            .collect();
        for parallel in [false, true] {
            let mut out = vec![0.0; m * n];
            matmul_transposed(&x, m, k, &w, n, &mut out, parallel);
            assert!(close(&out, &naive(&x, m, k, &w, n)), "m={m}");
        }
    }
}

#[test]
fn bf16_weights_give_the_product_of_their_f32_values() {
    // (300, 530): above FEW_ROWS rows the weights are widened in panels of 218 rows
    // (fewer when parallel), the last one partial; 9 to 64 rows take the broadcast tiles
    // on AVX-512: one to four registers of 16 rows (the last partial at 33, 40 and 49
    // rows), tasks of 32 columns (48 from 49 rows, in tiles of six), the last task and
    // tile partial; 65 rows and more go to the packed GEMM.
    for (k, n) in [(40, 24), (300, 530)] {
        let w: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32(((i * 7 % 13) as f32 - 6.0) / 5.0))
            .collect();
        let widened: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        for m in [1, 4, 6, 9, 12, 20, 32, 33, 40, 48, 49, 64, 65, 100] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
                .collect();
            let expected = naive(&x, m, k, &widened, n);
            for parallel in [false, true] {
                let mut out = vec![f32::NAN; m * n];
                matmul_transposed(&x, m, k, &w, n, &mut out, parallel);
                assert!(close(&out, &expected), "k={k} n={n} m={m} {parallel}");
            }
        }
    }
}

#[test]
fn few_row_tiles_match_the_naive_product_at_every_edge() {
    // Rows left over by the tiles of four (5, 7, 33), weight rows left over by the tiles
    // of three or four (10), inputs that leave a partial chunk of lanes (37, 1000), and
    // inputs long enough to be cut into several slices at 33 rows (1000); below four rows,
    // the decode kernel (four weight rows a pass: 9 and 10 leave one and two over).
    for (m, k, n) in [
        (1, 37, 10),
        (2, 1000, 9),
        (3, 16, 4),
        (1, 8, 3),
        (4, 16, 4),
        (5, 37, 10),
        (7, 64, 9),
        (16, 1000, 12),
        (33, 1000, 10),
        // The broadcast tiles (9 to 32 rows, AVX-512): rows padded to one or two
        // registers (9, 24, 32), weight rows left over by tiles of 16 or 8 (17, 19),
        // slices of 256 whole (256) or with one value over (513).
        (9, 300, 17),
        (24, 256, 8),
        (32, 513, 19),
    ] {
        // The same product from bf16 weights and from the same weights in f32.
        let (x, w, wide, expected) = few_row_case(m, k, n);
        let mut from_bf16 = vec![f32::NAN; n * m];
        dot_tiles(&x, m, k, &w, &mut from_bf16);
        let mut from_f32 = vec![f32::NAN; n * m];
        dot_tiles(&x, m, k, &wide, &mut from_f32);
        for out_t in [from_bf16, from_f32] {
            assert_transposed_matches(&out_t, &expected, m, n, "dot_tiles");
        }
    }
}

#[test]
fn the_portable_row_kernel_matches_the_naive_product() {
    // dot_rows is what products below four rows run where the CPU has no AVX-512 (and
    // what `dot` always runs): one to six input rows (the passes of four and the rows
    // left over), inputs that leave no, a partial, or a whole odd chunk of 16 lanes.
    for m in 1..=6 {
        for k in [1, 15, 16, 17, 32, 33, 48, 100] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.0)
                .collect();
            let w: Vec<bf16> = (0..k)
                .map(|i| bf16::from_f32(((i * 5 % 19) as f32 - 9.0) / 16.0))
                .collect();
            let wide: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            let expected = naive(&x, m, k, &wide, 1);
            let mut out = vec![0.0f32; m];
            dot_rows(&x, k, &w, &mut out);
            for (got, want) in out.iter().zip(&expected) {
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "m={m}, k={k}: {got} against {want}"
                );
            }
        }
    }
}

#[test]
fn every_decode_kernel_the_cpu_has_matches_the_naive_product() {
    // One to eight input rows (as many as the kernel takes: AVX2 in groups of up to
    // four, the last group short); weight rows left over by passes of two, three and
    // four (5, 7); inputs with and without a partial chunk of 8 or 16 lanes.
    let cases = [
        (1, 16, 4),
        (1, 37, 5),
        (2, 1000, 7),
        (3, 8, 3),
        (3, 100, 9),
        (4, 37, 7),
        (5, 100, 5),
        (6, 16, 3),
        (7, 1000, 4),
        (8, 100, 9),
    ];
    for kernel in DecodeKernel::all() {
        for (m, k, n) in cases.into_iter().filter(|c| c.0 <= kernel.max_rows()) {
            let (x, w, wide, expected) = few_row_case(m, k, n);
            let mut from_bf16 = vec![f32::NAN; n * m];
            kernel.run(&x, m, k, &w, &mut from_bf16);
            let mut from_f32 = vec![f32::NAN; n * m];
            kernel.run(&x, m, k, &wide, &mut from_f32);
            for out_t in [from_bf16, from_f32] {
                assert_transposed_matches(&out_t, &expected, m, n, &format!("{kernel:?}"));
            }
        }
    }
}

/// Inputs `[m, k]`, bf16 weights `[n, k]`, the same weights in f32, and the naive product.
fn few_row_case(m: usize, k: usize, n: usize) -> (Vec<f32>, Vec<bf16>, Vec<f32>, Vec<f32>) {
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.0)
        .collect();
    let w: Vec<bf16> = (0..n * k)
        .map(|i| bf16::from_f32(((i * 5 % 19) as f32 - 9.0) / 16.0))
        .collect();
    let wide: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    let expected = naive(&x, m, k, &wide, n);
    (x, w, wide, expected)
}

/// `out_t[j * m + i]` (output-transposed) is `expected[i * n + j]` within f32 rounding.
fn assert_transposed_matches(out_t: &[f32], expected: &[f32], m: usize, n: usize, what: &str) {
    for i in 0..m {
        for j in 0..n {
            let (got, want) = (out_t[j * m + i], expected[i * n + j]);
            assert!(
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "{what} ({m}, {n}) at row {i}, column {j}: {got} against {want}"
            );
        }
    }
}

#[test]
fn every_tile_kernel_the_cpu_has_computes_its_tile() {
    #[cfg(target_arch = "x86_64")]
    {
        let mut kernels = Vec::new();
        if std::arch::is_x86_feature_detected!("avx512f") {
            kernels.push(TileKernel::Avx512);
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            kernels.push(TileKernel::Avx2);
        }
        if kernels.is_empty() {
            crate::compute::skipped("this CPU has neither AVX-512 nor AVX2 with FMA");
        }
        for kernel in kernels {
            let c = kernel.columns();
            for len in [8, 16, 37, 100] {
                let stride = len + 3;
                let x: Vec<f32> = (0..TILE_ROWS * stride)
                    .map(|i| (i % 13) as f32 - 6.0)
                    .collect();
                let w: Vec<f32> = (0..c * len).map(|i| (i % 7) as f32 * 0.5 - 1.5).collect();
                let sums = kernel.tile(&x, stride, &w, len);
                for col in 0..c {
                    for r in 0..TILE_ROWS {
                        let want: f32 =
                            (0..len).map(|q| x[r * stride + q] * w[col * len + q]).sum();
                        assert_eq!(
                            sums[col * TILE_ROWS + r],
                            want,
                            "column {col}, row {r}, {len} values"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn plain_product_matches_transposed_of_transpose() {
    let (m, k, n) = (4, 6, 5);
    let x: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.1).collect();
    let w_kn: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.3).sin()).collect();
    let mut w_nk = vec![0.0; n * k];
    for r in 0..k {
        for c in 0..n {
            w_nk[c * k + r] = w_kn[r * n + c];
        }
    }
    let mut out = vec![0.0; m * n];
    matmul(&x, m, k, &w_kn, n, &mut out, false);
    assert!(close(&out, &naive(&x, m, k, &w_nk, n)));
}

#[test]
fn rms_norm_and_softmax_hand_checked() {
    let mut x = vec![3.0, 4.0];
    rms_norm_in_place(&mut x, &[1.0, 2.0], 0.0);
    let rms = (12.5f32).sqrt();
    assert!(close(&x, &[3.0 / rms, 8.0 / rms]));
    let mut s = vec![0.0, (2.0f32).ln()];
    softmax_in_place(&mut s);
    assert!(close(&s, &[1.0 / 3.0, 2.0 / 3.0]));
}

#[test]
fn a_dot_product_of_empty_slices_is_zero_and_others_are_the_sum() {
    assert_eq!(dot(&[], &[]), 0.0);
    let (a, b): (Vec<f32>, Vec<f32>) = (0..37).map(|i| (i as f32, 0.5 - i as f32)).unzip();
    let expected: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
    assert!((dot(&a, &b) - expected).abs() <= 1e-3 * expected.abs());
}
