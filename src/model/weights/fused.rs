//! Routed experts stored fused, all of a layer's in two tensors (gpt-oss, Llama 4, Qwen3.5's
//! releases; [`FusedExperts`] says how each lays them out), cut into the per-expert SwiGLU
//! blocks the kernels take. Only an expert's own block of each tensor is decoded: a node
//! reads just the experts it holds, and a layer's load stays linear in its experts.

use safetensors::tensor::Dtype;

use crate::compute::cpu::{Linear, SwiGlu};
use crate::compute::expert::ExpertWeights;
use crate::compute::quant::{MXFP4_BLOCK, QuantLinear, QuantSwiGlu, SwiGluActivation};
use crate::model::config::ModelConfig;
use crate::model::family::FusedExperts;
use crate::model::{Checkpoint, ModelError};

/// Layer `layer`'s fused experts where this checkpoint stores them fused: always for a family
/// that stores them only so, else where `{gate_up}` is present (a dummy checkpoint makes them
/// apart, as it does every family's that may be).
pub(super) fn fused_layout(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    layer: usize,
) -> Option<(String, FusedExperts)> {
    let (prefix, fused) = cfg.family.fused_experts(layer)?;
    let stored = !ckpt.is_dummy() && ckpt.contains(&format!("{prefix}.{}", fused.gate_up));
    (!fused.or_apart || stored).then_some((prefix, fused))
}

/// Expert `expert` of a layer's fused experts under `prefix`, as the SwiGLU block the
/// kernels take (`[out, in]` matrices), bf16 kept bf16 and MXFP4 kept MXFP4. Only this expert's block of each
/// fused tensor is decoded: a node reads just the experts it holds.
pub(super) fn fused_expert(
    ckpt: &Checkpoint,
    prefix: &str,
    fused: FusedExperts,
    expert: usize,
    [experts, h, i]: [usize; 3],
) -> Result<ExpertWeights, ModelError> {
    let gate_up_name = format!("{prefix}.{}", fused.gate_up);
    let down_name = format!("{prefix}.{}", fused.down);
    if ckpt.contains(&format!("{gate_up_name}_blocks")) {
        return mxfp4_expert(
            ckpt,
            [&gate_up_name, &down_name],
            fused,
            expert,
            [experts, h, i],
        );
    }
    // Output row `r` of one expert's matrix of `outs` by `ins`, stored `[out, in]` or
    // `[in, out]`.
    fn row<T: Copy>(m: &[T], out_first: bool, [outs, ins]: [usize; 2], r: usize) -> Vec<T> {
        if out_first {
            m[r * ins..][..ins].to_vec()
        } else {
            (0..ins).map(|c| m[c * outs + r]).collect()
        }
    }
    let out_first = fused.outputs_first;
    let shapes = if fused.outputs_first {
        [[experts, 2 * i, h], [experts, h, i]]
    } else {
        [[experts, h, 2 * i], [experts, i, h]]
    };
    macro_rules! block {
        ($read:ident) => {{
            let gate_up = ckpt.$read(&gate_up_name, &shapes[0], expert)?;
            let down = ckpt.$read(&down_name, &shapes[1], expert)?;
            let (mut gate, mut up) = (Vec::with_capacity(i * h), Vec::with_capacity(i * h));
            for c in 0..i {
                let (g, u) = fused_split(fused, i, c);
                gate.extend(row(&gate_up, out_first, [2 * i, h], g));
                up.extend(row(&gate_up, out_first, [2 * i, h], u));
            }
            let down: Vec<_> = (0..h)
                .flat_map(|r| row(&down, out_first, [h, i], r))
                .collect();
            let mut block = SwiGlu {
                gate: Linear::without_bias(gate, i, h),
                up: Linear::without_bias(up, i, h),
                down: Linear::without_bias(down, h, i),
            };
            if let Some([gate, up, down]) = fused_biases(
                ckpt,
                [&gate_up_name, &down_name],
                fused,
                expert,
                [experts, h, i],
            )? {
                block.gate.bias = Some(gate);
                block.up.bias = Some(up);
                block.down.bias = Some(down);
            }
            block
        }};
    }
    Ok(if ckpt.dtype(&gate_up_name) == Some(Dtype::BF16) {
        ExpertWeights::Bf16(block!(read_bf16_at))
    } else {
        ExpertWeights::F32(block!(read_f32_at))
    })
}

/// Where gate and up row `c` sit among a fused `[2 * intermediate]` dimension.
fn fused_split(fused: FusedExperts, i: usize, c: usize) -> (usize, usize) {
    if fused.interleaved {
        (2 * c, 2 * c + 1)
    } else {
        (c, i + c)
    }
}

/// The biases beside fused experts (`{gate_up}_bias`, `{down}_bias`) of expert `expert`, as
/// gate, up and down biases, where the family has them.
fn fused_biases(
    ckpt: &Checkpoint,
    [gate_up_name, down_name]: [&str; 2],
    fused: FusedExperts,
    expert: usize,
    [experts, h, i]: [usize; 3],
) -> Result<Option<[Vec<f32>; 3]>, ModelError> {
    if !fused.bias {
        return Ok(None);
    }
    let gate_up = ckpt.read_f32_at(&format!("{gate_up_name}_bias"), &[experts, 2 * i], expert)?;
    let (gate, up): (Vec<f32>, Vec<f32>) = (0..i)
        .map(|c| fused_split(fused, i, c))
        .map(|(g, u)| (gate_up[g], gate_up[u]))
        .unzip();
    let down = ckpt.read_f32_at(&format!("{down_name}_bias"), &[experts, h], expert)?;
    Ok(Some([gate, up, down]))
}

/// Expert `expert` of fused experts stored in MXFP4 (gpt-oss's release: `{name}_blocks`
/// and `{name}_scales`, matrices `[out, in]`, gate and up along `out`), held as stored: each
/// output row's 16-byte blocks and E8M0 scales, gate's and up's rows taken apart.
fn mxfp4_expert(
    ckpt: &Checkpoint,
    [gate_up_name, down_name]: [&str; 2],
    fused: FusedExperts,
    expert: usize,
    [experts, h, i]: [usize; 3],
) -> Result<ExpertWeights, ModelError> {
    let corrupt = |name: &str, reason: String| ModelError::Corrupt {
        path: ckpt.dir().to_path_buf(),
        reason: format!("`{}` (MXFP4): {reason}", ckpt.stored_name(name)),
    };
    // The matrix's blocks and scales, `rows` rows of `cols` inputs.
    let matrix = |name: &str, rows: usize, cols: usize| -> Result<(Vec<u8>, Vec<u8>), ModelError> {
        if !cols.is_multiple_of(MXFP4_BLOCK) {
            return Err(corrupt(
                name,
                format!("{cols} inputs is not a whole number of {MXFP4_BLOCK}-element blocks"),
            ));
        }
        let groups = cols / MXFP4_BLOCK;
        let blocks = ckpt.read_u8_at(
            &format!("{name}_blocks"),
            &[experts, rows, groups, MXFP4_BLOCK / 2],
            expert,
        )?;
        let scales =
            ckpt.read_u8_at(&format!("{name}_scales"), &[experts, rows, groups], expert)?;
        Ok((blocks, scales))
    };
    let linear = |name: &str, (blocks, scales): (Vec<u8>, Vec<u8>), rows: usize, cols: usize| {
        QuantLinear::mxfp4(blocks, scales, rows, cols).map_err(|e| corrupt(name, e))
    };
    let (gate_up_blocks, gate_up_scales) = matrix(gate_up_name, 2 * i, h)?;
    let (row_bytes, row_scales) = (h / 2, h / MXFP4_BLOCK);
    let (mut gate, mut up) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
    for c in 0..i {
        let (g, u) = fused_split(fused, i, c);
        for (to, r) in [(&mut gate, g), (&mut up, u)] {
            to.0.extend_from_slice(&gate_up_blocks[r * row_bytes..][..row_bytes]);
            to.1.extend_from_slice(&gate_up_scales[r * row_scales..][..row_scales]);
        }
    }
    let mut block = QuantSwiGlu {
        gate: linear(gate_up_name, gate, i, h)?,
        up: linear(gate_up_name, up, i, h)?,
        down: linear(down_name, matrix(down_name, h, i)?, h, i)?,
        activation: SwiGluActivation::Silu,
    };
    if let Some([gate, up, down]) = fused_biases(
        ckpt,
        [gate_up_name, down_name],
        fused,
        expert,
        [experts, h, i],
    )? {
        block.gate.bias = Some(gate);
        block.up.bias = Some(up);
        block.down.bias = Some(down);
    }
    Ok(ExpertWeights::Quantized(block))
}
