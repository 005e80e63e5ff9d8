//! How a GPU holds its experts: in the checkpoint's stored form, so that a model published in
//! FP8 or INT4 takes its stored bytes on the device (Kimi K2 in FP8 fits eight H200s only as
//! FP8), one fixed-size slot per expert. This module says which form a device holds, where
//! each part of a slot lies, and writes a slot's bytes; the kernels that read slots are
//! `Bf16Rows`, `Fp8Rows` and `Int4Rows` in kernels/moe.cu.
//!
//! A slot holds two matrices, the `a` operands of the expert's two grouped products: gate and
//! up stacked as one `[2·I, H]` matrix, then down `[H, I]`. Quantized forms put each
//! matrix's scales after both matrices: FP8's f32 block scales (gate's block rows, then up's,
//! then down's), INT4's group scales (one row of groups per weight row) in bf16 when the
//! checkpoint's are bf16 values, else f32.

use half::bf16;

use crate::compute::cpu::WeightElement;
use crate::compute::expert::ExpertWeights;
use crate::compute::quant::{GroupScales, QuantFormat, QuantLinear, SwiGluActivation};

/// Every part of a slot starts at a multiple of this many bytes (cuBLAS's fast paths want 16;
/// 256 keeps every matrix on its own cache lines).
const ALIGN: usize = 256;

/// The form a device holds its experts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertStorage {
    /// bf16: as a bf16 checkpoint stores them; f32 checkpoints are rounded to it.
    Bf16,
    /// e4m3 bytes with one f32 scale per `block_rows × block_cols` block.
    Fp8 {
        block_rows: usize,
        block_cols: usize,
    },
    /// Packed 4-bit integers with one scale per `group` weights of a row.
    Int4 { group: usize, scales_bf16: bool },
}

/// Byte offsets of a slot's parts from the slot's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotLayout {
    /// Down `[H, I]`; gate|up `[2·I, H]` is at 0.
    pub down: usize,
    /// Scales of gate|up and of down (0 for bf16, which has none).
    pub gate_up_scales: usize,
    pub down_scales: usize,
    /// The slot's size: slots lie this far apart.
    pub bytes: usize,
}

/// How a kernel reads one of a slot's matrices: its form, and where its scales are relative
/// to its first weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatrixForm {
    Bf16,
    /// `split`: rows below it and from it on are two matrices with their own block rows
    /// (gate and up); the matrix's rows for a single matrix.
    Fp8 {
        scale_offset: i64,
        block_rows: i32,
        block_cols: i32,
        split: i32,
    },
    Int4 {
        scale_offset: i64,
        group: i32,
        scales_bf16: i32,
    },
}

impl ExpertStorage {
    /// The form a device holds experts like `weights` in, with hidden size `h` and expert
    /// intermediate size `i`: the checkpoint's own when its three matrices share one
    /// quantized form and the kernels take the shape (both sizes multiples of 8: they read
    /// eight weights at a time), else bf16 (with the reason).
    pub fn of(weights: &ExpertWeights, h: usize, i: usize) -> (ExpertStorage, Option<String>) {
        let ExpertWeights::Quantized(block) = weights else {
            return (ExpertStorage::Bf16, None);
        };
        if !h.is_multiple_of(8) || !i.is_multiple_of(8) {
            return (
                ExpertStorage::Bf16,
                Some(format!(
                    "hidden size {h} and expert intermediate size {i} are not both multiples \
                     of 8, which the GPU's quantized kernels need"
                )),
            );
        }
        let matrices = [&block.gate, &block.up, &block.down];
        if matrices
            .iter()
            .any(|m| matches!(m.format, QuantFormat::Mxfp4 { .. }))
        {
            return (
                ExpertStorage::Bf16,
                Some(
                    "MXFP4 experts are widened to bf16 on upload: the GPU's expert kernels \
                     read FP8 and INT4"
                        .into(),
                ),
            );
        }
        let forms: Vec<ExpertStorage> = matrices.iter().map(|m| Self::of_matrix(m)).collect();
        let same_kind = |a: &ExpertStorage, b: &ExpertStorage| match (a, b) {
            (ExpertStorage::Int4 { group: g1, .. }, ExpertStorage::Int4 { group: g2, .. }) => {
                g1 == g2
            }
            _ => a == b,
        };
        if forms.iter().any(|f| !same_kind(f, &forms[0])) {
            return (
                ExpertStorage::Bf16,
                Some(format!(
                    "an expert's matrices are stored in different forms ({forms:?})"
                )),
            );
        }
        match forms[0] {
            ExpertStorage::Int4 { group, .. } => {
                // bf16 scales only when every matrix's are bf16 values.
                let scales_bf16 = forms.iter().all(|f| {
                    matches!(
                        f,
                        ExpertStorage::Int4 {
                            scales_bf16: true,
                            ..
                        }
                    )
                });
                (ExpertStorage::Int4 { group, scales_bf16 }, None)
            }
            form => (form, None),
        }
    }

    fn of_matrix(m: &QuantLinear) -> ExpertStorage {
        match &m.format {
            QuantFormat::Fp8 {
                block_rows,
                block_cols,
                ..
            } => ExpertStorage::Fp8 {
                block_rows: *block_rows,
                block_cols: *block_cols,
            },
            QuantFormat::Int4 { group, scales, .. } => ExpertStorage::Int4 {
                group: *group,
                scales_bf16: matches!(scales, GroupScales::Bf16(_)),
            },
            QuantFormat::Mxfp4 { .. } => ExpertStorage::Bf16,
        }
    }

    /// The narrowest form that holds experts of both forms: the same form, INT4 with f32
    /// scales for INT4 whose scales differ in width, else bf16.
    pub fn with(self, other: ExpertStorage) -> ExpertStorage {
        match (self, other) {
            (a, b) if a == b => a,
            (ExpertStorage::Int4 { group: a, .. }, ExpertStorage::Int4 { group: b, .. })
                if a == b =>
            {
                ExpertStorage::Int4 {
                    group: a,
                    scales_bf16: false,
                }
            }
            _ => ExpertStorage::Bf16,
        }
    }

    pub fn is_quantized(&self) -> bool {
        !matches!(self, ExpertStorage::Bf16)
    }

    /// What the log and errors call it.
    pub fn describe(&self) -> String {
        match *self {
            ExpertStorage::Bf16 => "bf16".into(),
            ExpertStorage::Fp8 {
                block_rows,
                block_cols,
            } => format!("FP8 e4m3 in [{block_rows}, {block_cols}] blocks"),
            ExpertStorage::Int4 { group, scales_bf16 } => format!(
                "INT4 in groups of {group} ({} scales)",
                if scales_bf16 { "bf16" } else { "f32" }
            ),
        }
    }

    /// How `weights`' gate and up products join, as the GPU's SwiGLU kernel computes it:
    /// a quantized block's activation, or the clamps on a bf16 or f32 block's projections
    /// (DeepSeek-V4's `min(gate, l)` and `clamp(up, -l, l)` are [`SwiGluActivation::Clamped`]);
    /// an error for other clamps (gpt-oss's folded into f32 weights).
    pub fn activation_of(weights: &ExpertWeights) -> Result<SwiGluActivation, String> {
        match weights {
            ExpertWeights::Quantized(b) => Ok(b.activation),
            ExpertWeights::F32(b) => clamps_activation([b.gate.clamp, b.up.clamp, b.down.clamp]),
            ExpertWeights::Bf16(b) => clamps_activation([b.gate.clamp, b.up.clamp, b.down.clamp]),
        }
    }

    /// `weights`' biases as a GPU slot holds them after the matrices (f32: gate's, up's, then
    /// down's; zeros for a projection without one), or `None` where it has none.
    pub fn biases_of(weights: &ExpertWeights) -> Option<Vec<f32>> {
        let biases: [(Option<&Vec<f32>>, usize); 3] = match weights {
            ExpertWeights::Quantized(b) => {
                [&b.gate, &b.up, &b.down].map(|m| (m.bias.as_ref(), m.out_features))
            }
            ExpertWeights::F32(b) => {
                [&b.gate, &b.up, &b.down].map(|l| (l.bias.as_ref(), l.out_features))
            }
            ExpertWeights::Bf16(b) => {
                [&b.gate, &b.up, &b.down].map(|l| (l.bias.as_ref(), l.out_features))
            }
        };
        biases.iter().any(|(b, _)| b.is_some()).then(|| {
            biases
                .iter()
                .flat_map(|&(b, n)| match b {
                    Some(b) => b.clone(),
                    None => vec![0.0; n],
                })
                .collect()
        })
    }

    /// Where the parts of a slot for experts of hidden size `h` and intermediate size `i`
    /// lie.
    pub fn layout(&self, h: usize, i: usize) -> SlotLayout {
        let (gate_up, down) = (self.matrix_bytes(2 * i, h), self.matrix_bytes(h, i));
        let down_at = gate_up.next_multiple_of(ALIGN);
        let weights_end = (down_at + down).next_multiple_of(ALIGN);
        let (gate_up_scales, down_scales) = match *self {
            ExpertStorage::Bf16 => (0, 0),
            _ => (
                weights_end,
                (weights_end + self.scale_bytes(i, h, 2)).next_multiple_of(ALIGN),
            ),
        };
        let end = match *self {
            ExpertStorage::Bf16 => weights_end,
            _ => down_scales + self.scale_bytes(h, i, 1),
        };
        SlotLayout {
            down: down_at,
            gate_up_scales,
            down_scales,
            bytes: end.next_multiple_of(ALIGN),
        }
    }

    /// Bytes of a `[rows, cols]` matrix's weights.
    fn matrix_bytes(&self, rows: usize, cols: usize) -> usize {
        match self {
            ExpertStorage::Bf16 => rows * cols * 2,
            ExpertStorage::Fp8 { .. } => rows * cols,
            ExpertStorage::Int4 { .. } => rows * cols.div_ceil(8) * 4,
        }
    }

    /// Bytes of the scales of `count` stacked `[rows, cols]` matrices.
    fn scale_bytes(&self, rows: usize, cols: usize, count: usize) -> usize {
        count
            * match *self {
                ExpertStorage::Bf16 => 0,
                ExpertStorage::Fp8 {
                    block_rows,
                    block_cols,
                } => rows.div_ceil(block_rows) * cols.div_ceil(block_cols) * 4,
                ExpertStorage::Int4 { group, scales_bf16 } => {
                    rows * cols.div_ceil(group) * if scales_bf16 { 2 } else { 4 }
                }
            }
    }

    /// How the kernels read gate|up (`[2·I, H]`) and down (`[H, I]`).
    pub fn forms(&self, h: usize, i: usize) -> [MatrixForm; 2] {
        let layout = self.layout(h, i);
        let scales = [
            layout.gate_up_scales as i64,
            layout.down_scales as i64 - layout.down as i64,
        ];
        match *self {
            ExpertStorage::Bf16 => [MatrixForm::Bf16; 2],
            ExpertStorage::Fp8 {
                block_rows,
                block_cols,
            } => [(scales[0], i), (scales[1], h)].map(|(scale_offset, split)| MatrixForm::Fp8 {
                scale_offset,
                block_rows: block_rows as i32,
                block_cols: block_cols as i32,
                split: split as i32,
            }),
            ExpertStorage::Int4 { group, scales_bf16 } => {
                scales.map(|scale_offset| MatrixForm::Int4 {
                    scale_offset,
                    group: group as i32,
                    scales_bf16: scales_bf16 as i32,
                })
            }
        }
    }

    /// The bytes of one expert's slot, or why `weights` cannot be held in this form (another
    /// quantization, other blocks or groups, scales wider than the device holds, another
    /// shape).
    pub fn pack(&self, weights: &ExpertWeights, h: usize, i: usize) -> Result<Vec<u8>, String> {
        let layout = self.layout(h, i);
        let mut slot = vec![0u8; layout.bytes];
        let expected = [(i, h), (i, h), (h, i)];
        let shapes = match weights {
            ExpertWeights::F32(b) => {
                [&b.gate, &b.up, &b.down].map(|l| (l.out_features, l.in_features))
            }
            ExpertWeights::Bf16(b) => {
                [&b.gate, &b.up, &b.down].map(|l| (l.out_features, l.in_features))
            }
            ExpertWeights::Quantized(b) => {
                [&b.gate, &b.up, &b.down].map(|l| (l.out_features, l.in_features))
            }
        };
        if shapes != expected {
            return Err(format!(
                "the expert's matrices are {shapes:?}, not gate and up [{i}, {h}] and down [{h}, {i}]"
            ));
        }
        // The activation is the kernel's to apply, the biases the device's to place
        // (`GpuExperts`): neither is part of these bytes, but a clamp the kernel cannot
        // compute is refused here too.
        Self::activation_of(weights)?;
        match (self, weights) {
            (ExpertStorage::Bf16, ExpertWeights::F32(b)) => {
                put_bf16(&mut slot, 0, &[&b.gate.weight, &b.up.weight]);
                put_bf16(&mut slot, layout.down, &[&b.down.weight]);
            }
            (ExpertStorage::Bf16, ExpertWeights::Bf16(b)) => {
                put_bf16(&mut slot, 0, &[&b.gate.weight, &b.up.weight]);
                put_bf16(&mut slot, layout.down, &[&b.down.weight]);
            }
            (ExpertStorage::Bf16, ExpertWeights::Quantized(b)) => {
                put_bf16(&mut slot, 0, &[&b.gate.widen(), &b.up.widen()]);
                put_bf16(&mut slot, layout.down, &[&b.down.widen()]);
            }
            (_, ExpertWeights::Quantized(b)) => {
                let parts = [
                    (&b.gate, 0, layout.gate_up_scales),
                    (
                        &b.up,
                        self.matrix_bytes(i, h),
                        layout.gate_up_scales + self.scale_bytes(i, h, 1),
                    ),
                    (&b.down, layout.down, layout.down_scales),
                ];
                for (matrix, weights_at, scales_at) in parts {
                    self.put_quantized(&mut slot, matrix, weights_at, scales_at)?;
                }
            }
            (_, _) => {
                return Err(format!(
                    "an unquantized expert cannot be held as {}",
                    self.describe()
                ));
            }
        }
        Ok(slot)
    }

    fn put_quantized(
        &self,
        slot: &mut [u8],
        matrix: &QuantLinear,
        weights_at: usize,
        scales_at: usize,
    ) -> Result<(), String> {
        let mismatch = || {
            format!(
                "a matrix stored as {} cannot be held as {}",
                Self::of_matrix(matrix).describe(),
                self.describe()
            )
        };
        match (*self, &matrix.format) {
            (
                ExpertStorage::Fp8 {
                    block_rows,
                    block_cols,
                },
                QuantFormat::Fp8 {
                    weights,
                    scales,
                    block_rows: r,
                    block_cols: c,
                },
            ) if (block_rows, block_cols) == (*r, *c) => {
                slot[weights_at..][..weights.len()].copy_from_slice(weights);
                put(slot, scales_at, scales.iter().map(|s| s.to_le_bytes()));
            }
            (
                ExpertStorage::Int4 { group, scales_bf16 },
                QuantFormat::Int4 {
                    packed,
                    scales,
                    group: g,
                },
            ) if group == *g => {
                put(slot, weights_at, packed.iter().map(|w| w.to_le_bytes()));
                match (scales_bf16, scales) {
                    (true, GroupScales::Bf16(s)) => {
                        put(slot, scales_at, s.iter().map(|v| v.to_bits().to_le_bytes()))
                    }
                    (false, GroupScales::Bf16(s)) => {
                        put(slot, scales_at, s.iter().map(|v| v.to_f32().to_le_bytes()))
                    }
                    (false, GroupScales::F32(s)) => {
                        put(slot, scales_at, s.iter().map(|v| v.to_le_bytes()))
                    }
                    (true, GroupScales::F32(_)) => {
                        return Err(format!(
                            "{}: this matrix's scales are not all bf16 values",
                            mismatch()
                        ));
                    }
                }
            }
            _ => return Err(mismatch()),
        }
        Ok(())
    }
}

/// The activation the clamps on a SwiGLU block's gate, up and down outputs make.
fn clamps_activation(clamps: [Option<[f32; 2]>; 3]) -> Result<SwiGluActivation, String> {
    match clamps {
        [None, None, None] => Ok(SwiGluActivation::Silu),
        [Some([f32::NEG_INFINITY, gate]), Some([low, high]), None]
            if gate == high && low == -high =>
        {
            Ok(SwiGluActivation::Clamped { limit: high })
        }
        other => Err(format!(
            "the expert's outputs are clamped ({other:?}) other than as DeepSeek-V4's \
             clamped SwiGLU, which the GPU's SwiGLU kernel does not compute"
        )),
    }
}

/// Writes `matrices`' values one after another as bf16 at `at`.
fn put_bf16<W: WeightElement>(slot: &mut [u8], at: usize, matrices: &[&[W]]) {
    let values = matrices.iter().copied().flatten();
    put(
        slot,
        at,
        values.map(|v| bf16::from_f32(v.to_f32()).to_bits().to_le_bytes()),
    );
}

/// Writes `items` one after another at `at`.
fn put<const N: usize>(slot: &mut [u8], at: usize, items: impl Iterator<Item = [u8; N]>) {
    for (chunk, item) in slot[at..].chunks_exact_mut(N).zip(items) {
        chunk.copy_from_slice(&item);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::cpu::{Linear, SwiGlu};
    use crate::compute::quant::QuantSwiGlu;

    const H: usize = 16;
    const I: usize = 8;

    fn bf16_expert() -> ExpertWeights {
        let m = |rows: usize, cols: usize, base: f32| {
            let v = (0..rows * cols)
                .map(|n| bf16::from_f32(base + n as f32 / 64.0))
                .collect();
            Linear::without_bias(v, rows, cols)
        };
        ExpertWeights::Bf16(SwiGlu {
            gate: m(I, H, 1.0),
            up: m(I, H, 2.0),
            down: m(H, I, 3.0),
        })
    }

    /// An FP8 matrix whose bytes and scales start from `base`: gate, up and down apart.
    fn fp8_from(base: usize, rows: usize, cols: usize, block: [usize; 2]) -> QuantLinear {
        let scales = rows.div_ceil(block[0]) * cols.div_ceil(block[1]);
        let weights = (0..rows * cols)
            .map(|n| ((base + n) % 0x7e) as u8)
            .collect();
        let scales = (0..scales).map(|n| (base + n) as f32 + 0.5).collect();
        QuantLinear::fp8(weights, scales, rows, cols, block).unwrap()
    }

    fn fp8(rows: usize, cols: usize, block: [usize; 2]) -> QuantLinear {
        fp8_from(0, rows, cols, block)
    }

    /// An INT4 matrix whose words and scales start from `base` (times `scale` for scales).
    fn int4_from(base: usize, rows: usize, cols: usize, group: usize, scale: f32) -> QuantLinear {
        let packed = (0..rows * cols / 8)
            .map(|n| (base + n) as u32 * 0x0101_0101)
            .collect();
        let scales = (0..rows * cols.div_ceil(group))
            .map(|n| scale * (base + n + 1) as f32)
            .collect();
        QuantLinear::int4(packed, scales, rows, cols, group).unwrap()
    }

    fn int4(rows: usize, cols: usize, group: usize, scale: f32) -> QuantLinear {
        int4_from(0, rows, cols, group, scale)
    }

    fn quantized(gate: QuantLinear, up: QuantLinear, down: QuantLinear) -> ExpertWeights {
        ExpertWeights::Quantized(QuantSwiGlu {
            gate,
            up,
            down,
            activation: Default::default(),
        })
    }

    #[test]
    fn the_form_held_is_the_checkpoints_when_the_kernels_take_it() {
        assert_eq!(
            ExpertStorage::of(&bf16_expert(), H, I),
            (ExpertStorage::Bf16, None)
        );
        let e = quantized(fp8(I, H, [4, 4]), fp8(I, H, [4, 4]), fp8(H, I, [4, 4]));
        let fp8_form = ExpertStorage::Fp8 {
            block_rows: 4,
            block_cols: 4,
        };
        assert_eq!(ExpertStorage::of(&e, H, I), (fp8_form, None));
        // INT4 scales held in bf16 only when every matrix's are bf16 values (0.1 is not).
        for (down_scale, scales_bf16) in [(0.5, true), (0.1, false)] {
            let e = quantized(
                int4(I, H, 8, 0.5),
                int4(I, H, 8, 0.5),
                int4(H, I, 8, down_scale),
            );
            let form = ExpertStorage::Int4 {
                group: 8,
                scales_bf16,
            };
            assert_eq!(ExpertStorage::of(&e, H, I).0, form);
        }
        // Mixed forms, and sizes the kernels cannot read eight at a time, are widened.
        let mixed = quantized(fp8(I, H, [4, 4]), fp8(I, H, [4, 4]), int4(H, I, 8, 0.5));
        let (form, reason) = ExpertStorage::of(&mixed, H, I);
        assert_eq!(form, ExpertStorage::Bf16);
        assert!(reason.unwrap().contains("different forms"));
        let (form, reason) = ExpertStorage::of(&e, 12, I);
        assert_eq!(form, ExpertStorage::Bf16);
        assert!(reason.unwrap().contains("multiples of 8"));
    }

    #[test]
    fn a_form_that_holds_two_is_the_same_int4_with_f32_scales_or_bf16() {
        let int4 = |scales_bf16| ExpertStorage::Int4 {
            group: 32,
            scales_bf16,
        };
        let fp8 = ExpertStorage::Fp8 {
            block_rows: 128,
            block_cols: 128,
        };
        assert_eq!(int4(true).with(int4(true)), int4(true));
        assert_eq!(int4(true).with(int4(false)), int4(false));
        assert_eq!(int4(false).with(int4(true)), int4(false));
        assert_eq!(fp8.with(fp8), fp8);
        let other_group = ExpertStorage::Int4 {
            group: 64,
            scales_bf16: true,
        };
        for (a, b) in [
            (int4(true), other_group),
            (fp8, int4(true)),
            (ExpertStorage::Bf16, fp8),
        ] {
            assert_eq!(a.with(b), ExpertStorage::Bf16);
            assert_eq!(b.with(a), ExpertStorage::Bf16);
        }
    }

    #[test]
    fn a_bf16_slot_is_gate_up_then_down_as_stored() {
        let expert = bf16_expert();
        let slot = ExpertStorage::Bf16.pack(&expert, H, I).unwrap();
        let layout = ExpertStorage::Bf16.layout(H, I);
        assert_eq!(slot.len(), layout.bytes);
        assert_eq!(layout.down, 2 * I * H * 2);
        let ExpertWeights::Bf16(b) = &expert else {
            unreachable!()
        };
        let read = |at: usize, n: usize| -> Vec<bf16> {
            slot[at..at + 2 * n]
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect()
        };
        assert_eq!(read(0, I * H), b.gate.weight);
        assert_eq!(read(I * H * 2, I * H), b.up.weight);
        assert_eq!(read(layout.down, H * I), b.down.weight);
    }

    #[test]
    fn an_fp8_slot_holds_the_bytes_and_each_matrixs_block_scales() {
        // Blocks of [3, 5]: gate and up [8, 16] have 3 x 4 blocks each, down [16, 8] 6 x 2.
        let expert = quantized(
            fp8_from(0, I, H, [3, 5]),
            fp8_from(100, I, H, [3, 5]),
            fp8_from(200, H, I, [3, 5]),
        );
        let storage = ExpertStorage::of(&expert, H, I).0;
        let slot = storage.pack(&expert, H, I).unwrap();
        let layout = storage.layout(H, I);
        assert_eq!(slot.len(), layout.bytes);
        let ExpertWeights::Quantized(b) = &expert else {
            unreachable!()
        };
        let f32_at = |at: usize| f32::from_le_bytes(slot[at..at + 4].try_into().unwrap());
        let (
            QuantFormat::Fp8 {
                weights: gate,
                scales: gate_scales,
                ..
            },
            QuantFormat::Fp8 {
                weights: up,
                scales: up_scales,
                ..
            },
            QuantFormat::Fp8 {
                weights: down,
                scales: down_scales,
                ..
            },
        ) = (&b.gate.format, &b.up.format, &b.down.format)
        else {
            unreachable!()
        };
        assert_eq!(&slot[..I * H], &gate[..]);
        assert_eq!(&slot[I * H..2 * I * H], &up[..]);
        assert_eq!(&slot[layout.down..layout.down + H * I], &down[..]);
        assert_eq!(gate_scales.len(), 12);
        for (n, s) in gate_scales.iter().chain(up_scales).enumerate() {
            assert_eq!(f32_at(layout.gate_up_scales + 4 * n), *s);
        }
        for (n, s) in down_scales.iter().enumerate() {
            assert_eq!(f32_at(layout.down_scales + 4 * n), *s);
        }
        // Where: gate|up's 256 bytes, down's 128 from 256, gate|up's 96 bytes of scales from
        // 512, down's 48 from 768 (every part on 256 bytes).
        assert_eq!(
            (
                layout.down,
                layout.gate_up_scales,
                layout.down_scales,
                layout.bytes
            ),
            (256, 512, 768, 1024)
        );
        // How the kernels read them: up's block rows follow gate's.
        let [gate_up, down_form] = storage.forms(H, I);
        assert_eq!(
            gate_up,
            MatrixForm::Fp8 {
                scale_offset: 512,
                block_rows: 3,
                block_cols: 5,
                split: I as i32
            }
        );
        assert_eq!(
            down_form,
            MatrixForm::Fp8 {
                scale_offset: 512,
                block_rows: 3,
                block_cols: 5,
                split: H as i32
            }
        );
    }

    #[test]
    fn an_int4_slot_holds_the_words_and_scales_in_the_form_held() {
        let expert = quantized(
            int4_from(0, I, H, 8, 0.5),
            int4_from(100, I, H, 8, 0.5),
            int4_from(200, H, I, 8, 0.5),
        );
        for scales_bf16 in [true, false] {
            let storage = ExpertStorage::Int4 {
                group: 8,
                scales_bf16,
            };
            let slot = storage.pack(&expert, H, I).unwrap();
            let layout = storage.layout(H, I);
            let word = |at: usize| u32::from_le_bytes(slot[at..at + 4].try_into().unwrap());
            // Gate's I rows of H / 8 words, then up's, then down's.
            let n = |base: usize| base as u32 * 0x0101_0101;
            assert_eq!(word(I * H / 2 - 4), n(I * H / 8 - 1));
            assert_eq!(word(I * H / 2), n(100));
            assert_eq!(word(2 * (I * H / 2) - 4), n(100 + I * H / 8 - 1));
            assert_eq!(word(layout.down + 4), n(201));
            // Up's first scale follows gate's I rows of 2 groups; down's first is its own.
            let scale = |at: usize| {
                if scales_bf16 {
                    bf16::from_bits(u16::from_le_bytes([slot[at], slot[at + 1]])).to_f32()
                } else {
                    f32::from_le_bytes(slot[at..at + 4].try_into().unwrap())
                }
            };
            let width = if scales_bf16 { 2 } else { 4 };
            assert_eq!(scale(layout.gate_up_scales + (2 * I - 1) * width), 8.0);
            assert_eq!(scale(layout.gate_up_scales + 2 * I * width), 50.5);
            assert_eq!(scale(layout.down_scales + width), 101.0);
        }
        // f32 scales that bf16 cannot hold are refused by a device holding bf16 ones.
        let f32_scales = quantized(int4(I, H, 8, 0.1), int4(I, H, 8, 0.1), int4(H, I, 8, 0.1));
        let bf16_device = ExpertStorage::Int4 {
            group: 8,
            scales_bf16: true,
        };
        let err = bf16_device.pack(&f32_scales, H, I).unwrap_err();
        assert!(err.contains("not all bf16 values"), "{err}");
    }

    /// MXFP4 experts are widened to bf16 on upload (the log says why); a clamped activation
    /// is the block's to say (the SwiGLU kernel computes it), and biases are read out for the
    /// device to place after the slot's matrices.
    #[test]
    fn mxfp4_experts_are_widened_at_upload_and_their_biases_read_out() {
        let (h, i) = (64, 32);
        let m = |rows: usize, cols: usize| {
            let blocks = (0..rows * cols / 2).map(|n| (n * 37 % 256) as u8).collect();
            QuantLinear::mxfp4(blocks, vec![126; rows * cols / 32], rows, cols).unwrap()
        };
        let expert = quantized(m(i, h), m(i, h), m(h, i));
        let (storage, reason) = ExpertStorage::of(&expert, h, i);
        assert_eq!(storage, ExpertStorage::Bf16);
        assert!(reason.unwrap().contains("MXFP4"));
        let slot = storage.pack(&expert, h, i).unwrap();
        let ExpertWeights::Quantized(b) = &expert else {
            unreachable!()
        };
        let first = bf16::from_le_bytes([slot[0], slot[1]]).to_f32();
        assert_eq!(first, b.gate.widen()[0]);
        let mut clamped = b.clone();
        clamped.activation = SwiGluActivation::ClampedGptOss {
            alpha: 1.702,
            limit: 7.0,
        };
        let clamped = ExpertWeights::Quantized(clamped);
        assert_eq!(storage.pack(&clamped, h, i).unwrap(), slot);
        assert_eq!(
            ExpertStorage::activation_of(&clamped),
            Ok(SwiGluActivation::ClampedGptOss {
                alpha: 1.702,
                limit: 7.0
            })
        );
        let mut biased = b.clone();
        biased.down.bias = Some(vec![0.5; h]);
        let biased = ExpertWeights::Quantized(biased);
        assert_eq!(storage.pack(&biased, h, i).unwrap(), slot);
        let biases = ExpertStorage::biases_of(&biased).unwrap();
        assert_eq!(biases.len(), 2 * i + h);
        assert_eq!(biases[2 * i - 1], 0.0);
        assert_eq!(biases[2 * i], 0.5);
        assert_eq!(ExpertStorage::biases_of(&expert), None);
    }

    /// A bf16 or f32 block's clamps read as DeepSeek-V4's clamped SwiGLU where they are its
    /// (`min(gate, l)`, `clamp(up, -l, l)`), and are refused otherwise.
    #[test]
    fn clamps_on_the_projections_are_v4s_activation_or_refused() {
        let expert = bf16_expert();
        assert_eq!(
            ExpertStorage::activation_of(&expert),
            Ok(SwiGluActivation::Silu)
        );
        let ExpertWeights::Bf16(mut block) = expert else {
            unreachable!()
        };
        block.gate.clamp = Some([f32::NEG_INFINITY, 10.0]);
        block.up.clamp = Some([-10.0, 10.0]);
        let v4 = ExpertWeights::Bf16(block.clone());
        assert_eq!(
            ExpertStorage::activation_of(&v4),
            Ok(SwiGluActivation::Clamped { limit: 10.0 })
        );
        assert!(ExpertStorage::Bf16.pack(&v4, H, I).is_ok());
        block.up.clamp = Some([-9.0, 11.0]);
        let err = ExpertStorage::activation_of(&ExpertWeights::Bf16(block)).unwrap_err();
        assert!(err.contains("clamped"), "{err}");
    }

    #[test]
    fn experts_in_another_form_or_shape_are_refused_by_name() {
        let fp8_expert = quantized(fp8(I, H, [4, 4]), fp8(I, H, [4, 4]), fp8(H, I, [4, 4]));
        let int4_device = ExpertStorage::Int4 {
            group: 8,
            scales_bf16: true,
        };
        let err = int4_device.pack(&fp8_expert, H, I).unwrap_err();
        assert!(
            err.contains("FP8 e4m3 in [4, 4] blocks cannot be held as INT4 in groups of 8"),
            "{err}"
        );
        let other_blocks = ExpertStorage::Fp8 {
            block_rows: 8,
            block_cols: 8,
        };
        assert!(other_blocks.pack(&fp8_expert, H, I).is_err());
        assert!(
            int4_device
                .pack(&bf16_expert(), H, I)
                .unwrap_err()
                .contains("unquantized")
        );
        let err = ExpertStorage::Bf16
            .pack(&bf16_expert(), 2 * H, I)
            .unwrap_err();
        assert!(err.contains("not gate and up [8, 32]"), "{err}");
        // Any expert can be held as bf16: quantized ones widened.
        let slot = ExpertStorage::Bf16.pack(&fp8_expert, H, I).unwrap();
        let ExpertWeights::Quantized(b) = &fp8_expert else {
            unreachable!()
        };
        let first = bf16::from_bits(u16::from_le_bytes([slot[2], slot[3]]));
        assert_eq!(first, bf16::from_f32(b.gate.widen()[1]));
    }
}
