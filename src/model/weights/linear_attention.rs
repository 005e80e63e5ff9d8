//! The weights of a gated DeltaNet layer (`linear_attn`), held in one layout whatever the
//! family stores: Qwen3.5's, with q, k and v projected together in the order the convolution
//! takes them (`in_proj_qkv`), the output gate (`in_proj_z`), and the per-value-head beta
//! and decay inputs (`in_proj_b`, `in_proj_a`) apart. Qwen3-Next fuses them and groups the
//! rows per key head (`in_proj_qkvz`: each key head's q, k, then its value heads' v and z;
//! `in_proj_ba`: its value heads' b then a); its rows are put in Qwen3.5's order at load, so
//! one forward pass serves both.

use super::{RmsNorm, StoredLinear, linear, norm};
use crate::compute::cpu::Linear;
use crate::model::config::{LinearAttention, ModelConfig};
use crate::model::{Checkpoint, ModelError};

#[derive(Debug, Clone)]
pub struct LinearAttentionWeights {
    /// `[2 * key_dim + value_dim, hidden]`: queries, keys and values, every head's in turn.
    pub qkv: StoredLinear,
    /// `[value_dim, hidden]`: the output gate.
    pub z: StoredLinear,
    /// `[value_heads, hidden]`: beta's logit per value head.
    pub b: StoredLinear,
    /// `[value_heads, hidden]`: the decay's input per value head.
    pub a: StoredLinear,
    /// `[conv_dim, kernel]`: the depthwise causal convolution (no bias).
    pub conv: Vec<f32>,
    /// `[value_heads]`: added to `a` before the softplus.
    pub dt_bias: Vec<f32>,
    /// `[value_heads]`: `-exp(A_log)`, the decay rate's scale.
    pub decay_scale: Vec<f32>,
    /// Over each value head's output before the gate; its weight is stored whole.
    pub norm: RmsNorm,
    /// `[hidden, value_dim]`.
    pub out: StoredLinear,
}

/// Layer `l`'s gated DeltaNet.
pub(super) fn load(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    la: &LinearAttention,
    l: usize,
) -> Result<LinearAttentionWeights, ModelError> {
    let h = cfg.hidden_size;
    let quant = &cfg.quantization;
    let p = format!("model.layers.{l}.linear_attn");
    let (key_dim, value_dim, heads) = (la.key_dim(), la.value_dim(), la.num_value_heads);
    let (qkv, z, b, a) = if la.fused_projections {
        let qkvz = linear(
            ckpt,
            quant,
            &format!("{p}.in_proj_qkvz"),
            2 * key_dim + 2 * value_dim,
            h,
        )?;
        let ba = linear(ckpt, quant, &format!("{p}.in_proj_ba"), 2 * heads, h)?;
        let rows = FusedRows::of(la);
        (
            select_rows(&qkvz, &rows.qkv),
            select_rows(&qkvz, &rows.z),
            select_rows(&ba, &rows.b),
            select_rows(&ba, &rows.a),
        )
    } else {
        (
            linear(ckpt, quant, &format!("{p}.in_proj_qkv"), la.conv_dim(), h)?,
            linear(ckpt, quant, &format!("{p}.in_proj_z"), value_dim, h)?,
            linear(ckpt, quant, &format!("{p}.in_proj_b"), heads, h)?,
            linear(ckpt, quant, &format!("{p}.in_proj_a"), heads, h)?,
        )
    };
    let a_log = ckpt.read_f32(&format!("{p}.A_log"), &[heads])?;
    Ok(LinearAttentionWeights {
        qkv,
        z,
        b,
        a,
        conv: ckpt.read_f32(
            &format!("{p}.conv1d.weight"),
            &[la.conv_dim(), 1, la.conv_kernel],
        )?,
        dt_bias: ckpt.read_f32(&format!("{p}.dt_bias"), &[heads])?,
        decay_scale: a_log.iter().map(|v| -v.exp()).collect(),
        norm: norm(
            ckpt,
            &format!("{p}.norm"),
            la.value_head_dim,
            cfg.rms_norm_eps,
        )?,
        out: linear(ckpt, quant, &format!("{p}.out_proj"), h, value_dim)?,
    })
}

/// Which rows of Qwen3-Next's fused projections make each of Qwen3.5's.
#[derive(Debug, PartialEq)]
struct FusedRows {
    qkv: Vec<usize>,
    z: Vec<usize>,
    b: Vec<usize>,
    a: Vec<usize>,
}

impl FusedRows {
    fn of(la: &LinearAttention) -> Self {
        let (hk, hv) = (la.key_head_dim, la.value_head_dim);
        let per_key = la.num_value_heads / la.num_key_heads.max(1);
        let block = 2 * hk + 2 * per_key * hv;
        let groups = 0..la.num_key_heads;
        let span = |from: usize, len: usize| {
            groups
                .clone()
                .flat_map(move |g| g * block + from..g * block + from + len)
        };
        let qkv = span(0, hk)
            .chain(span(hk, hk))
            .chain(span(2 * hk, per_key * hv))
            .collect();
        let z = span(2 * hk + per_key * hv, per_key * hv).collect();
        let ba = |from: usize| {
            groups
                .clone()
                .flat_map(move |g| g * 2 * per_key + from..g * 2 * per_key + from + per_key)
                .collect()
        };
        FusedRows {
            qkv,
            z,
            b: ba(0),
            a: ba(per_key),
        }
    }
}

/// The rows `rows` of `from`, in that order, kept in its storage (quantized ones widened to
/// f32: their blocks span rows that part here).
fn select_rows(from: &StoredLinear, rows: &[usize]) -> StoredLinear {
    fn pick<W: Copy + crate::compute::cpu::WeightElement>(
        l: &Linear<W>,
        rows: &[usize],
    ) -> Linear<W> {
        let k = l.in_features;
        Linear {
            weight: rows
                .iter()
                .flat_map(|&r| l.weight[r * k..][..k].iter().copied())
                .collect(),
            bias: l
                .bias
                .as_ref()
                .map(|b| rows.iter().map(|&r| b[r]).collect()),
            out_features: rows.len(),
            in_features: k,
            clamp: l.clamp,
        }
    }
    match from {
        StoredLinear::F32(l) => StoredLinear::F32(pick(l, rows)),
        StoredLinear::Bf16(l) => StoredLinear::Bf16(pick(l, rows)),
        StoredLinear::Quantized { .. } => {
            let widened = Linear {
                weight: from.widened().into_owned(),
                bias: from.bias().map(<[f32]>::to_vec),
                out_features: from.out_features(),
                in_features: from.in_features(),
                clamp: None,
            };
            StoredLinear::F32(pick(&widened, rows))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_rows_regroup_per_key_head_into_q_k_v_then_z_b_a() {
        // Two key heads of 1 value each, two value heads per key head of 1 value each: each
        // key head's block is q, k, v0, v1, z0, z1.
        let la = LinearAttention {
            num_key_heads: 2,
            num_value_heads: 4,
            key_head_dim: 1,
            value_head_dim: 1,
            conv_kernel: 4,
            layers: vec![true],
            fused_projections: true,
        };
        let rows = FusedRows::of(&la);
        assert_eq!(rows.qkv, [0, 6, 1, 7, 2, 3, 8, 9]);
        assert_eq!(rows.z, [4, 5, 10, 11]);
        assert_eq!(rows.b, [0, 1, 4, 5]);
        assert_eq!(rows.a, [2, 3, 6, 7]);
    }
}
