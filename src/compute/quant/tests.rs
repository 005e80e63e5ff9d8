use super::e4m3::*;
use super::int4_rows::*;
use super::linear::*;
use super::*;
use crate::compute::cpu::decode::{DecodeKernel, decode_kernel_available};
use crate::compute::cpu::ops::silu_mul;
use crate::compute::cpu::tests::naive;

/// The dequantized matrix computed value by value from the stored fields.
fn by_hand(m: &QuantLinear) -> Vec<f32> {
    let (n, k) = (m.out_features, m.in_features);
    let mut out = Vec::with_capacity(n * k);
    for r in 0..n {
        for c in 0..k {
            out.push(match &m.format {
                QuantFormat::Fp8 {
                    weights,
                    scales,
                    block_rows,
                    block_cols,
                } => {
                    let scale = scales[r / block_rows * k.div_ceil(*block_cols) + c / block_cols];
                    e4m3_to_f32(weights[r * k + c]) * scale
                }
                QuantFormat::Int4 {
                    packed,
                    scales,
                    group,
                } => {
                    let word = packed[r * k.div_ceil(8) + c / 8];
                    let value = ((word >> (4 * (c % 8))) & 0xf) as i32 - 8;
                    value as f32 * scales.get(r * k.div_ceil(*group) + c / group)
                }
                QuantFormat::Mxfp4 { blocks, scales } => {
                    // e2m1: sign, two exponent bits (bias 1), one mantissa bit; 0 subnormal.
                    let byte = blocks[(r * k + c) / 2];
                    let nibble = if c % 2 == 0 { byte & 0xf } else { byte >> 4 };
                    let (exponent, mantissa) = (i32::from((nibble >> 1) & 3), nibble & 1);
                    let magnitude = if exponent == 0 {
                        0.5 * f32::from(mantissa)
                    } else {
                        (1.0 + 0.5 * f32::from(mantissa)) * 2f32.powi(exponent - 1)
                    };
                    let sign = if nibble & 8 != 0 { -1.0 } else { 1.0 };
                    let scale = 2f64.powi(i32::from(scales[r * k / 32 + c / 32]) - 127) as f32;
                    sign * magnitude * scale
                }
            });
        }
    }
    out
}

#[test]
fn e4m3_bytes_decode_to_their_values() {
    // Values from the OCP FP8 spec's e4m3 table.
    for (byte, value) in [
        (0x00u8, 0.0f32),
        (0x80, -0.0),
        (0x38, 1.0),
        (0xb8, -1.0),
        (0x7e, 448.0),
        (0x01, 2f32.powi(-9)),
        (0x07, 7.0 * 2f32.powi(-9)),
        (0x08, 2f32.powi(-6)),
        (0x3c, 1.5),
        (0x40, 2.0),
    ] {
        assert_eq!(e4m3_to_f32(byte), value, "byte {byte:#04x}");
    }
}

/// An e4m3fn byte's value from the format's definition (OCP 8-bit floating point, E4M3FN),
/// field by field and apart from every decoder under test: a sign bit, four exponent bits
/// biased by 7, three mantissa bits; exponent 0 holds the subnormals (`m/8 * 2^-6`); there
/// are no infinities, and S.1111.111 is NaN (`None`).
pub(crate) fn e4m3_by_definition(byte: u8) -> Option<f32> {
    let sign = if byte & 0x80 == 0 { 1.0 } else { -1.0 };
    let exponent = i32::from((byte >> 3) & 0xf);
    let mantissa = f64::from(byte & 0x7);
    if exponent == 15 && mantissa == 7.0 {
        return None;
    }
    let magnitude = if exponent == 0 {
        mantissa / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + mantissa / 8.0) * 2f64.powi(exponent - 7)
    };
    // Every e4m3 value is exact in f32 (and the sign of zero survives the product).
    Some((sign * magnitude) as f32)
}

/// What the decoders give an e4m3fn byte: its value, or for the NaN bytes the ±480 that
/// [`e4m3_to_f32`] documents (their fields read as if they were a number; no quantizer
/// writes them).
pub(crate) fn e4m3_expected(byte: u8) -> f32 {
    e4m3_by_definition(byte).unwrap_or(if byte & 0x80 == 0 { 480.0 } else { -480.0 })
}

#[test]
fn every_e4m3_byte_widens_to_its_value_on_every_path() {
    // The definition's landmarks, so that the reference itself is held to the spec's table.
    assert_eq!(e4m3_by_definition(0x7e), Some(448.0), "largest normal");
    assert_eq!(
        e4m3_by_definition(0x01),
        Some(2f32.powi(-9)),
        "smallest subnormal"
    );
    assert!(e4m3_by_definition(0x7f).is_none() && e4m3_by_definition(0xff).is_none());
    assert_eq!(
        e4m3_by_definition(0x80).map(f32::to_bits),
        Some((-0.0f32).to_bits())
    );
    // Every byte (subnormals, both zeros, and the NaN patterns), three times over so that the
    // vector path also has a partial last chunk.
    let bytes: Vec<u8> = (0..=255u8).cycle().take(3 * 256 + 7).collect();
    let expected: Vec<u32> = bytes.iter().map(|b| e4m3_expected(*b).to_bits()).collect();
    let check = |path: &str, out: &[f32]| {
        for ((b, o), e) in bytes.iter().zip(out).zip(&expected) {
            assert_eq!(o.to_bits(), *e, "{path}: byte {b:#04x} gave {o}");
        }
    };
    // The scalar decoding (each weight the row kernels read, and the portable widening).
    let scalar: Vec<f32> = bytes.iter().map(|b| e4m3_to_f32(*b)).collect();
    check("e4m3_to_f32", &scalar);
    // The widening as the products call it (AVX-512 where the CPU has it).
    let mut out = vec![f32::NAN; bytes.len()];
    widen_e4m3(&bytes, &mut out);
    check("widen_e4m3", &out);
    // The AVX-512 kernel itself, where the CPU has it.
    #[cfg(target_arch = "x86_64")]
    if decode_kernel_available() {
        let mut out = vec![f32::NAN; bytes.len()];
        // SAFETY: the CPU has AVX-512 F, BW and VL; the slices are one length.
        unsafe { widen_e4m3_avx512(&bytes, &mut out) };
        check("widen_e4m3_avx512", &out);
        println!("e4m3 checked on the scalar and the AVX-512 (f16 conversion) paths");
        return;
    }
    crate::compute::skipped(
        "e4m3: no AVX-512 F/BW/VL here, so only the scalar path was checked against the \
         definition",
    );
}

#[test]
fn every_decode_kernel_reads_every_e4m3_byte() {
    // Each byte (no NaN) as a weight of its own: one input row of ones times a matrix
    // whose row j holds byte j at column j % 24 and zeros elsewhere.
    let k = 24;
    let values: Vec<u8> = (0..=255u8).filter(|b| b & 0x7f != 0x7f).collect();
    let n = values.len();
    let mut bytes = vec![0u8; n * k];
    for (j, b) in values.iter().enumerate() {
        bytes[j * k + j % k] = *b;
    }
    let x = vec![1.0f32; k];
    for kernel in DecodeKernel::all() {
        let mut out = vec![f32::NAN; n];
        kernel.run(&x, 1, k, E4m3::slice(&bytes), &mut out);
        for (b, o) in values.iter().zip(&out) {
            assert_eq!(
                Some(*o),
                e4m3_by_definition(*b),
                "{kernel:?}, byte {b:#04x}"
            );
        }
    }
}

#[test]
fn fp8_blocks_scale_their_own_weights_including_partial_edge_blocks() {
    // 3 x 5 in [2, 2] blocks: 2 x 3 scales, the last row and column blocks partial.
    let (n, k) = (3, 5);
    let weights = vec![0x38u8; n * k]; // 1.0 everywhere
    let scales: Vec<f32> = (1..=6).map(|s| s as f32).collect();
    let m = QuantLinear::fp8(weights, scales, n, k, [2, 2]).unwrap();
    let widened = m.widen();
    #[rustfmt::skip]
    let expected = [
        1.0, 1.0, 2.0, 2.0, 3.0,
        1.0, 1.0, 2.0, 2.0, 3.0,
        4.0, 4.0, 5.0, 5.0, 6.0,
    ];
    assert_eq!(widened, expected);
    assert!(QuantLinear::fp8(vec![0; 15], vec![1.0; 4], n, k, [2, 2]).is_err());
}

#[test]
fn int4_nibbles_are_offset_by_eight_lowest_first_and_scaled_per_group() {
    // One row of 10 values (two words, the second padded), groups of 4.
    let values: [i32; 10] = [-8, -1, 0, 1, 7, 3, -3, 2, 5, -5];
    let mut packed = [0u32; 2];
    for (i, v) in values.iter().enumerate() {
        packed[i / 8] |= ((v + 8) as u32) << (4 * (i % 8));
    }
    let scales = vec![0.5, 2.0, -1.0];
    let m = QuantLinear::int4(packed.to_vec(), scales.clone(), 1, 10, 4).unwrap();
    let expected: Vec<f32> = values
        .iter()
        .enumerate()
        .map(|(i, v)| *v as f32 * scales[i / 4])
        .collect();
    assert_eq!(m.widen(), expected);
    assert!(QuantLinear::int4(packed.to_vec(), vec![1.0; 2], 1, 10, 4).is_err());
}

#[test]
fn int4_scales_are_held_in_bf16_only_when_that_loses_nothing() {
    let exact = GroupScales::new(vec![0.125, -3.0, 0.0]);
    assert!(matches!(exact, GroupScales::Bf16(_)));
    assert_eq!(exact.bytes(), 6);
    assert_eq!(exact.get(1), -3.0);
    let inexact = GroupScales::new(vec![0.125, 0.05]);
    assert!(matches!(inexact, GroupScales::F32(_)));
    assert_eq!((inexact.bytes(), inexact.get(1)), (8, 0.05));
    // A packed matrix reports the bytes it holds.
    let m = QuantLinear::int4(vec![0; 4], vec![0.5; 2], 2, 16, 16).unwrap();
    assert_eq!(m.stored_bytes(), 4 * 4 + 2 * 2);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn every_int4_decode_kernel_equals_the_widened_product() {
    // 37 weight rows: passes of two, three and four with rows left over; one to nine, 13,
    // 16 and 32 input rows: one group of one to four, then groups of three or four (the
    // last repeating a row for 5, 7 and 13); k = 100 and 300: a partial last chunk (under
    // and over half a chunk), 160: one whole chunk and a partial one, an odd count of
    // groups of 32 (a row's scales start at any multiple of four bytes), 1024: whole
    // chunks; groups of 8 to 256 weights (1 to 32 words
    // to a scale: a half's scales loaded as eight, four, two or one), and of 384 (not a
    // power of two: AVX-512 only); scales held in bf16 (0.125 and its multiples) and in
    // f32 (0.05); every nibble value, the top nibble's too (AVX2 reads it shifted, not in
    // place).
    let kernels = Int4Decode::all();
    println!("INT4 decode kernels on this CPU: {kernels:?}");
    let n = 37;
    for k in [100usize, 160, 300, 1024] {
        let x: Vec<f32> = (0..(INT4_AVX2_MAX_ROWS + 1) * k)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0 + (i / k) as f32 * 0.25)
            .collect();
        for group in [8usize, 16, 32, 64, 128, 256, 384] {
            for unit in [0.125f32, 0.05] {
                let packed: Vec<u32> = (0..n * k.div_ceil(8))
                    .map(|i| (i as u32 ^ group as u32).wrapping_mul(2_654_435_761))
                    .collect();
                let scales = (0..n * k.div_ceil(group))
                    .map(|i| unit * (1 + i % 7) as f32)
                    .collect();
                let matrix = QuantLinear::int4(packed, scales, n, k, group).unwrap();
                let decodes = kernels.first().is_some_and(|k| k.takes(1, group));
                assert_eq!(matrix.int4_decodes(1), decodes);
                for &kernel in &kernels {
                    let some_rows = (1..=9).chain([13, 16, INT4_AVX2_MAX_ROWS]);
                    for m in some_rows.filter(|&m| kernel.takes(m, group)) {
                        let x = &x[..m * k];
                        let expected = naive(x, m, k, &by_hand(&matrix), n);
                        for parallel in [false, true] {
                            let mut got = vec![f32::NAN; m * n];
                            let inputs = Int4Inputs::for_decode(x, m, kernel);
                            matrix.int4_decode(&inputs, &mut got, parallel);
                            for (at, (g, e)) in got.iter().zip(&expected).enumerate() {
                                assert!(
                                    (g - e).abs() <= 1e-4 * (1.0 + e.abs()),
                                    "{kernel:?} {m} rows k={k} group={group} scale {unit} \
                                     output {at}: {g} vs {e}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn products_equal_the_product_of_the_widened_matrix_for_few_and_many_rows() {
    // k = 100: several 16-wide chunks, scale blocks and groups along a row, and a tail;
    // k = 300: INT4 rows of two whole 16-word chunks and a partial one; (96, 128) and
    // (96, 320): whole AMX tiles (FP8 from 5 rows where the CPU has them: block rows of
    // 16 and a partial one of 96 of 128; with k = 320, a partial block column of 64 of
    // 128); (80, 128): an odd count of 16-neuron blocks, so a lone last block.
    for (n, k) in [(70, 100usize), (70, 300), (96, 128), (96, 320), (80, 128)] {
        products_equal_the_widened_product(n, k);
    }
}

#[test]
fn an_expert_whose_gate_and_up_share_one_packing_equals_the_widened_expert() {
    // Hidden 64, intermediate 96: whole tiles; 9 and 24 rows take the AMX-BF16 tiles
    // where the CPU has them (gate and up from one packing), 3 rows the other kernels.
    let (h, i) = (64, 96);
    let int4 = |n: usize, k: usize, seed: u32| {
        let packed = (0..n * k / 8)
            .map(|j| (j as u32 ^ seed).wrapping_mul(2_654_435_761))
            .collect();
        let scales = (0..n * k / 32).map(|j| 0.125 * (1 + (j + seed as usize) % 5) as f32);
        QuantLinear::int4(packed, scales.collect(), n, k, 32).unwrap()
    };
    let fp8 = |n: usize, k: usize, seed: usize| {
        let bytes = (0..n * k)
            .map(|j| ((j * 37 + seed) % 251) as u8 & 0xfe)
            .collect();
        let scales = (0..n.div_ceil(16) * k.div_ceil(32))
            .map(|j| 0.01 * (1 + j % 3) as f32)
            .collect();
        QuantLinear::fp8(bytes, scales, n, k, [16, 32]).unwrap()
    };
    let experts = [
        QuantSwiGlu {
            gate: int4(i, h, 1),
            up: int4(i, h, 2),
            down: int4(h, i, 3),
            activation: Default::default(),
        },
        QuantSwiGlu {
            gate: fp8(i, h, 1),
            up: fp8(i, h, 2),
            down: fp8(h, i, 3),
            activation: Default::default(),
        },
    ];
    for expert in &experts {
        for rows in [3, 9, 24] {
            let x: Vec<f32> = (0..rows * h)
                .map(|j| ((j * 5 % 11) as f32 - 5.0) / 7.0)
                .collect();
            let mut gate = naive(&x, rows, h, &by_hand(&expert.gate), i);
            let up = naive(&x, rows, h, &by_hand(&expert.up), i);
            silu_mul(&mut gate, &up);
            let expected = naive(&gate, rows, i, &by_hand(&expert.down), h);
            let got = expert.forward_with(&x, rows, false);
            // The outputs are sums of large terms that cancel: bounded against the largest.
            let largest = expected.iter().fold(0f32, |m, e| m.max(e.abs()));
            for (g, e) in got.iter().zip(&expected) {
                assert!(
                    (g - e).abs() <= 1e-5 * largest,
                    "{rows} rows: {g} vs {e} ({largest})"
                );
            }
        }
    }
}

fn products_equal_the_widened_product(n: usize, k: usize) {
    // Both signs; no NaN (0x7f, 0xff).
    let bytes: Vec<u8> = (0..n * k).map(|i| ((i * 37) % 251) as u8 & 0xfe).collect();
    let fp8 = |[rows, cols]: [usize; 2]| {
        let scales: Vec<f32> = (0..n.div_ceil(rows) * k.div_ceil(cols))
            .map(|i| 0.01 * (1 + i % 5) as f32)
            .collect();
        QuantLinear::fp8(bytes.clone(), scales, n, k, [rows, cols]).unwrap()
    };
    let packed: Vec<u32> = (0..n * k.div_ceil(8))
        .map(|i| (i as u32).wrapping_mul(2_654_435_761))
        .collect();
    // Scales that are bf16 values are held in bf16 (as published files store them);
    // 0.05 and its multiples are not, and stay f32.
    let int4_scaled = |group: usize, unit: f32| {
        let scales = (0..n * k.div_ceil(group))
            .map(|i| unit * (1 + i % 7) as f32)
            .collect();
        QuantLinear::int4(packed.clone(), scales, n, k, group).unwrap()
    };
    let int4 = |group: usize| int4_scaled(group, 0.05);
    // FP8 blocks that are whole 16-value chunks and ones that are not; INT4 groups the
    // chunked kernel takes (1 to 16 words to a scale, or 32: two chunks to a scale) and
    // ones it leaves to the row-by-row path (12 and 48 weights).
    let matrices = [
        fp8([16, 8]),
        fp8([128, 32]),
        // On the tiles where k allows: tiles of one 16-row block row each, and two
        // 32-value steps to a scale; the published blocks.
        fp8([16, 64]),
        fp8([128, 128]),
        // Blocks that the broadcast tiles' slices of 256 (9 to 32 rows, AVX-512) start
        // within, rather than at their start.
        fp8([16, 24]),
        int4(32),
        int4(8),
        int4(64),
        int4(128),
        int4(256),
        int4(12),
        int4(48),
        int4_scaled(32, 0.125),
        int4_scaled(12, 0.125),
    ]
    .into_iter()
    .chain(k.is_multiple_of(32).then(|| mxfp4_matrix(n, k, 0)));
    for matrix in matrices {
        let w = by_hand(&matrix);
        assert_eq!(matrix.widen(), w);
        // 9 to 64 rows: the broadcast tiles on AVX-512 (one to four registers of 16);
        // with AVX2 tiles, FP8's few-row tiles to 16 rows and the AVX2 INT4 kernel to 32;
        // 65: dequantized panels and the packed GEMM.
        for m in [1, 2, 3, 8, 9, 16, 32, 40, 64, 65] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
                .collect();
            let expected = naive(&x, m, k, &w, n);
            for parallel in [false, true] {
                let got = matrix.forward_with(&x, m, parallel);
                for (g, e) in got.iter().zip(&expected) {
                    assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "m={m}: {g} vs {e}");
                }
            }
        }
    }
}

/// An MXFP4 matrix of every byte value, scales 2^-8 to 2^3 (and one 2^-127, subnormal).
fn mxfp4_matrix(n: usize, k: usize, seed: usize) -> QuantLinear {
    let blocks = (0..n * k / 2)
        .map(|j| ((j * 193 + seed * 7) % 256) as u8)
        .collect();
    let mut scales: Vec<u8> = (0..n * k / 32)
        .map(|j| 119 + ((j * 5 + seed) % 12) as u8)
        .collect();
    scales[0] = 0;
    QuantLinear::mxfp4(blocks, scales, n, k).unwrap()
}

#[test]
fn mxfp4_spans_from_within_a_block_and_of_odd_length_equal_the_widened_row() {
    let (n, k) = (3, 128);
    let m = mxfp4_matrix(n, k, 1);
    let w = m.widen();
    assert_eq!(w, by_hand(&m));
    for row in 0..n {
        for (from, len) in [
            (0, 128),
            (8, 5),
            (8, 57),
            (24, 40),
            (32, 33),
            (96, 31),
            (40, 88),
        ] {
            let mut out = vec![f32::NAN; len];
            m.dequantize_span(row, from, &mut out);
            assert_eq!(
                out,
                w[row * k + from..][..len],
                "row {row} from {from} len {len}"
            );
        }
    }
    assert!(QuantLinear::mxfp4(vec![0; 16], vec![255], 1, 32).is_err());
    assert!(QuantLinear::mxfp4(vec![0; 16], vec![127, 127], 1, 32).is_err());
    assert!(QuantLinear::mxfp4(vec![0; 24], vec![127], 1, 48).is_err());
}

/// `expert` (a quantized block) against `widened` for inputs of each of `row_counts` rows made
/// by `input` (per index), within f32 rounding of the largest output; and that `limit` clamps
/// some of its gate (from above) and up (either side) outputs for one such row.
fn assert_equals_widened(
    expert: &crate::compute::expert::ExpertWeights,
    widened: &crate::compute::expert::ExpertWeights,
    row_counts: &[usize],
    input: impl Fn(usize) -> f32,
    limit: f32,
) {
    use crate::compute::expert::ExpertWeights;
    let ExpertWeights::Quantized(q) = expert else {
        unreachable!()
    };
    let h = q.gate.in_features;
    for &rows in row_counts {
        let x: Vec<f32> = (0..rows * h).map(&input).collect();
        let got = expert.forward_with(&x, rows, false);
        let expected = widened.forward_with(&x, rows, false);
        let largest = expected.iter().fold(0f32, |m, e| m.max(e.abs()));
        for (g, e) in got.iter().zip(&expected) {
            assert!(
                (g - e).abs() <= 2e-5 * largest,
                "{rows} rows: {g} vs {e} ({largest})"
            );
        }
    }
    let x: Vec<f32> = (0..h).map(&input).collect();
    let (gate, up) = (
        q.gate.forward_with(&x, 1, false),
        q.up.forward_with(&x, 1, false),
    );
    assert!(gate.iter().any(|&g| g > limit) && up.iter().any(|&u| u.abs() > limit));
}

/// DeepSeek-V4's expert kept in MXFP4 (`silu(min(gate, l)) * clamp(up, -l, l)` applied after
/// the products) equals the block widened to f32 with the clamps on its projections, as bf16
/// and f32 V4 experts are held, within f32 rounding; inputs reach both clamps.
#[test]
fn a_v4_clamped_mxfp4_expert_equals_its_widened_clamped_block() {
    use crate::compute::expert::ExpertWeights;
    let (h, i, limit) = (64, 96, 3.0);
    let expert = ExpertWeights::Quantized(QuantSwiGlu {
        gate: mxfp4_matrix(i, h, 4),
        up: mxfp4_matrix(i, h, 5),
        down: mxfp4_matrix(h, i, 6),
        activation: SwiGluActivation::Clamped { limit },
    });
    let widened = expert.widened();
    assert_eq!(widened.gate.clamp, Some([f32::NEG_INFINITY, limit]));
    assert_eq!(widened.up.clamp, Some([-limit, limit]));
    let widened = ExpertWeights::F32(widened);
    let input = |j: usize| ((j * 7 % 13) as f32 - 6.0) / 3.0;
    assert_equals_widened(&expert, &widened, &[1, 5, 16, 33], input, limit);
    // By hand: gate 5 clamps to 3, up -4 to -3: silu(3) * -3.
    let mut g = [5.0f32, -1.0];
    SwiGluActivation::Clamped { limit }.apply(&mut g, &[-4.0, 2.0]);
    let silu = |v: f32| v / (1.0 + (-v).exp());
    assert_eq!(g, [silu(3.0) * -3.0, silu(-1.0) * 2.0]);
}

/// gpt-oss's expert kept in MXFP4 (biases, clamped SwiGLU applied after the products) equals
/// the block widened to f32 with the activation folded into its weights, as f32 experts are
/// held, within f32 rounding: the fold scales weights by alpha before the products where the
/// compressed path scales the gate's sum after, and the two sum in different orders.
#[test]
fn a_clamped_mxfp4_expert_equals_its_widened_folded_block() {
    use crate::compute::expert::ExpertWeights;
    let (h, i) = (64, 96);
    let biased = |mut m: QuantLinear, seed: usize| {
        m.bias = Some(
            (0..m.out_features)
                .map(|j| ((j * 7 + seed) % 13) as f32 / 4.0 - 1.5)
                .collect(),
        );
        m
    };
    let expert = ExpertWeights::Quantized(QuantSwiGlu {
        gate: biased(mxfp4_matrix(i, h, 1), 1),
        up: biased(mxfp4_matrix(i, h, 2), 2),
        down: biased(mxfp4_matrix(h, i, 3), 3),
        activation: SwiGluActivation::ClampedGptOss {
            alpha: 1.702,
            limit: 7.0,
        },
    });
    let folded = ExpertWeights::F32(expert.widened());
    // The inputs reach both clamps (gate above the limit, up outside ±limit).
    let input = |j: usize| ((j * 5 % 11) as f32 - 5.0) / 2.0;
    assert_equals_widened(&expert, &folded, &[1, 3, 9, 16, 40, 70], input, 7.0);
    assert_eq!(
        expert.weight_bytes(),
        3 * (h * i / 2 + h * i / 32) + 4 * (2 * i + h)
    );
}
