use super::pack::*;
use super::to_bf16::*;
use super::*;
use crate::compute::cpu::tests::naive;

#[test]
fn int4_words_become_their_values_in_bf16() {
    // Every nibble in every position, in a run long enough for the four-word vector steps
    // and a tail of three.
    let words: Vec<u32> = (0..23u32)
        .map(|i| (0..8).fold(0, |w, j| w | (((i + 3 * j) % 16) << (4 * j))))
        .collect();
    let mut out = Vec::new();
    int4_to_bf16(&words, &mut out);
    assert_eq!(out.len(), 8 * words.len());
    for (i, v) in out.iter().enumerate() {
        let nibble = (words[i / 8] >> (4 * (i % 8))) & 0xf;
        assert_eq!(v.to_f32(), nibble as f32 - 8.0, "value {i}");
    }
}

#[test]
fn every_e4m3_byte_becomes_its_bf16_value() {
    // Every byte, in a run long enough for the 32-byte vector steps and a tail.
    let bytes: Vec<u8> = (0..=255u8).chain(0..=40).collect();
    let mut out = Vec::new();
    e4m3_to_bf16(&bytes, &mut out);
    assert_eq!(out.len(), bytes.len());
    for (&b, v) in bytes.iter().zip(&out) {
        let expected = crate::compute::quant::tests::e4m3_expected(b);
        assert_eq!(v.to_f32().to_bits(), expected.to_bits(), "byte {b:#04x}");
    }
}

#[test]
fn three_parts_carry_every_bit_of_an_f32() {
    for v in [
        1.0f32,
        -2.718_281_7,
        1e-20,
        6.5e4,
        0.1,
        -0.333_333_34,
        123_456.79,
    ] {
        let [hi, mid, lo] = split(v).map(|b| bf16::from_bits(b).to_f32() as f64);
        assert_eq!(hi + mid + lo, v as f64, "{v}");
    }
}

#[test]
fn vector_packing_equals_the_portable_packing() {
    #[cfg(target_arch = "x86_64")]
    {
        if !std::arch::is_x86_feature_detected!("avx512bw") {
            crate::compute::skipped("this CPU has no AVX-512 BW");
            return;
        }
        // Partial row blocks (5, 21 rows), values of every magnitude and sign, ties.
        for (rows, k) in [(5, 32), (21, 96), (16, 64)] {
            let x: Vec<f32> = (0..rows * k)
                .map(|i| {
                    let v = ((i * 7919 % 1013) as f32 - 506.0) * 1.37e-3;
                    v * 10f32.powi((i % 9) as i32 - 4)
                })
                .chain([1.0 + 2f32.powi(-8), -(1.0 + 3.0 * 2f32.powi(-8))])
                .take(rows * k)
                .collect();
            let size = rows.div_ceil(TILE) * (k / TILE_K) * PARTS * TILE_VALUES;
            let (mut vector, mut portable) = (vec![7u16; size], vec![0u16; size]);
            // SAFETY: the CPU has AVX-512 BW (checked above); the sizes match.
            unsafe { pack_avx512(&x, rows, k, &mut vector) };
            PackedInputs::pack_portable(&x, rows, k, &mut portable);
            assert_eq!(vector, portable, "{rows} x {k}");
        }
    }
}

#[test]
fn amx_products_match_the_naive_product_at_every_edge() {
    if !enabled() {
        crate::compute::skipped(&format!("AMX tiles are not used here ({:?})", status()));
        return;
    }
    // Row blocks whole, partial and odd in number (5, 17, 33, 40, 200 rows: 200 is more
    // than one pass); neuron blocks even and odd (16, 48, 64); k of one and many blocks.
    for (m, k, n) in [
        (5, 32, 16),
        (17, 64, 48),
        (33, 96, 64),
        (40, 1024, 48),
        (200, 128, 32),
    ] {
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.3 + (i as f32 * 1e-3).sin())
            .collect();
        let w: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32(((i * 5 % 19) as f32 - 9.0) / 16.0))
            .collect();
        let wide: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let expected = naive(&x, m, k, &wide, n);
        let inputs = PackedInputs::new(&x, m, k).expect("AMX applies");
        for parallel in [false, true] {
            let mut out = vec![f32::NAN; m * n];
            assert!(matmul_transposed(
                &inputs,
                TileWeights::Bf16(&w),
                n,
                &mut out,
                n,
                parallel
            ));
            for (i, (got, want)) in out.iter().zip(&expected).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "({m}, {k}, {n}) at {i}: {got} against {want}"
                );
            }
        }
    }
}

#[test]
fn shapes_the_tiles_do_not_cover_are_left_to_other_kernels() {
    if !enabled() {
        crate::compute::skipped(&format!("AMX tiles are not used here ({:?})", status()));
        return;
    }
    assert!(
        PackedInputs::new(&[0.0; 8 * 40], 8, 40).is_none(),
        "k not whole tiles"
    );
    assert!(
        PackedInputs::new(&[0.0; 4 * 32], 4, 32).is_none(),
        "too few rows"
    );
    let inputs = PackedInputs::new(&[1.0; 8 * 32], 8, 32).expect("AMX applies");
    let mut out = vec![0.0; 8 * 20];
    let weights = TileWeights::Bf16(&[bf16::ONE; 20 * 32]);
    assert!(!matmul_transposed(
        &inputs, weights, 20, &mut out, 20, false
    ));
}
