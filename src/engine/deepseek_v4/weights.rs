//! DeepSeek-V4's tensors by their published names (no `model.` prefix), shapes checked
//! against the config. Projections are held as stored: FP8 e4m3 with a `.scale` of ue8m0
//! exponents per 128 x 128 block kept FP8 (the scales widened to f32), bf16 kept bf16, the rest
//! f32; the grouped output projection's first half and the shared experts widened to f32 (the
//! shared experts clamped at `swiglu_limit`). The routed experts load with every family's
//! (`crate::model::weights::load_expert`, which reads V4's MXFP4 and FP8 and clamps them).

use safetensors::tensor::Dtype;

use crate::compute::cpu::{Linear, SwiGlu};
use crate::compute::quant::QuantLinear;
use crate::model::config::{DeepseekV4, V4LayerKind};
use crate::model::weights::StoredLinear;
use crate::model::weights::deepseek_v4::{FP8_BLOCK, clamp_swiglu, corrupt, scales};
use crate::model::{Checkpoint, ModelConfig, ModelError};

/// A pooling compressor's projections, position bias and norm.
pub struct CompressorWeights {
    /// `[series * width, hidden]` each.
    pub wkv: StoredLinear,
    pub wgate: StoredLinear,
    /// `[ratio, series * width]`.
    pub ape: Vec<f32>,
    pub norm: Vec<f32>,
}

/// A CSA layer's lightning indexer.
pub struct IndexerWeights {
    /// `[index_heads * index_head_dim, q_lora_rank]`.
    pub wq_b: StoredLinear,
    /// `[index_heads, hidden]`.
    pub weights_proj: StoredLinear,
    pub compressor: CompressorWeights,
}

pub struct AttentionWeights {
    pub wq_a: StoredLinear,
    pub q_norm: Vec<f32>,
    pub wq_b: StoredLinear,
    pub wkv: StoredLinear,
    pub kv_norm: Vec<f32>,
    /// `[o_groups * o_lora_rank, heads * head_dim / o_groups]`: group `g`'s block is rows
    /// `g * o_lora_rank..`.
    pub wo_a: Linear,
    pub wo_b: StoredLinear,
    pub sinks: Vec<f32>,
    pub compressor: Option<CompressorWeights>,
    pub indexer: Option<IndexerWeights>,
}

/// A hyper-connection mixer: `fn [(2 + m) * m, m * hidden]`, `base`, `scale [3]`.
pub struct MixerWeights {
    pub fn_: Vec<f32>,
    pub base: Vec<f32>,
    pub scale: Vec<f32>,
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub attn_hc: MixerWeights,
    pub ffn_hc: MixerWeights,
    pub attention: AttentionWeights,
    /// `[experts, hidden]`.
    pub gate: StoredLinear,
    /// Score layers: the routing bias (`gate.bias`).
    pub gate_bias: Option<Vec<f32>>,
    /// Hash layers: `[vocab, top_k]` experts per token (`gate.tid2eid`).
    pub tid2eid: Option<Vec<u32>>,
    pub shared: SwiGlu,
}

pub struct V4Weights {
    pub embed: Vec<f32>,
    pub head: StoredLinear,
    pub norm: Vec<f32>,
    /// The final collapse of the streams: `hc_head_fn [m, m * hidden]`, base, scale.
    pub head_fn: Vec<f32>,
    pub head_base: Vec<f32>,
    pub head_scale: f32,
    pub layers: Vec<LayerWeights>,
}

fn tensor(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
    ckpt.read_f32(name, shape)
}

/// `{name}.weight` `[out, inp]` as stored (see the module comment).
fn linear(
    ckpt: &Checkpoint,
    name: &str,
    out: usize,
    inp: usize,
) -> Result<StoredLinear, ModelError> {
    let weight = format!("{name}.weight");
    Ok(match ckpt.dtype(&weight) {
        Some(Dtype::F8_E4M3) => {
            let [rows, cols] = FP8_BLOCK;
            let bytes = ckpt.read_fp8(&weight, &[out, inp])?;
            let factors = scales(ckpt, name, &[out.div_ceil(rows), inp.div_ceil(cols)])?;
            let matrix = QuantLinear::fp8(bytes, factors, out, inp, FP8_BLOCK)
                .map_err(|e| corrupt(ckpt, &weight, e))?;
            StoredLinear::Quantized { matrix, bias: None }
        }
        Some(Dtype::BF16) => StoredLinear::Bf16(Linear::without_bias(
            ckpt.read_bf16(&weight, &[out, inp])?,
            out,
            inp,
        )),
        _ => StoredLinear::F32(Linear::without_bias(
            tensor(ckpt, &weight, &[out, inp])?,
            out,
            inp,
        )),
    })
}

/// As [`linear`], widened to f32.
fn linear_f32(ckpt: &Checkpoint, name: &str, out: usize, inp: usize) -> Result<Linear, ModelError> {
    let stored = linear(ckpt, name, out, inp)?;
    Ok(match stored {
        StoredLinear::F32(l) => l,
        other => Linear::without_bias(other.widened().into_owned(), out, inp),
    })
}

fn compressor(
    ckpt: &Checkpoint,
    prefix: &str,
    [ratio, series, width, hidden]: [usize; 4],
) -> Result<CompressorWeights, ModelError> {
    Ok(CompressorWeights {
        wkv: linear(ckpt, &format!("{prefix}.wkv"), series * width, hidden)?,
        wgate: linear(ckpt, &format!("{prefix}.wgate"), series * width, hidden)?,
        ape: tensor(ckpt, &format!("{prefix}.ape"), &[ratio, series * width])?,
        norm: tensor(ckpt, &format!("{prefix}.norm.weight"), &[width])?,
    })
}

fn mixer(ckpt: &Checkpoint, prefix: &str, m: usize, h: usize) -> Result<MixerWeights, ModelError> {
    let outputs = (2 + m) * m;
    Ok(MixerWeights {
        fn_: tensor(ckpt, &format!("{prefix}_fn"), &[outputs, m * h])?,
        base: tensor(ckpt, &format!("{prefix}_base"), &[outputs])?,
        scale: tensor(ckpt, &format!("{prefix}_scale"), &[3])?,
    })
}

fn attention(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    v4: &DeepseekV4,
    layer: usize,
) -> Result<AttentionWeights, ModelError> {
    let p = format!("layers.{layer}.attn");
    let (h, heads, hd) = (cfg.hidden_size, cfg.num_heads, v4.head_dim);
    let q = v4.q_lora_rank;
    let groups = v4.o_groups;
    // transformers reads both `kv_norm` and `norm` (its conversion renames `.norm.`).
    let kv_norm = if ckpt.contains(&format!("{p}.kv_norm.weight")) {
        format!("{p}.kv_norm.weight")
    } else {
        format!("{p}.norm.weight")
    };
    let kind = v4.layers[layer];
    let pooling = match kind {
        V4LayerKind::Sliding => None,
        V4LayerKind::Csa => Some(compressor(
            ckpt,
            &format!("{p}.compressor"),
            [v4.csa_ratio, 2, hd, h],
        )?),
        V4LayerKind::Hca => Some(compressor(
            ckpt,
            &format!("{p}.compressor"),
            [v4.hca_ratio, 1, hd, h],
        )?),
    };
    let indexer = match kind {
        V4LayerKind::Csa => Some(IndexerWeights {
            wq_b: linear(
                ckpt,
                &format!("{p}.indexer.wq_b"),
                v4.index_n_heads * v4.index_head_dim,
                q,
            )?,
            weights_proj: linear(
                ckpt,
                &format!("{p}.indexer.weights_proj"),
                v4.index_n_heads,
                h,
            )?,
            compressor: compressor(
                ckpt,
                &format!("{p}.indexer.compressor"),
                [v4.csa_ratio, 2, v4.index_head_dim, h],
            )?,
        }),
        _ => None,
    };
    Ok(AttentionWeights {
        wq_a: linear(ckpt, &format!("{p}.wq_a"), q, h)?,
        q_norm: tensor(ckpt, &format!("{p}.q_norm.weight"), &[q])?,
        wq_b: linear(ckpt, &format!("{p}.wq_b"), heads * hd, q)?,
        wkv: linear(ckpt, &format!("{p}.wkv"), hd, h)?,
        kv_norm: tensor(ckpt, &kv_norm, &[hd])?,
        wo_a: linear_f32(
            ckpt,
            &format!("{p}.wo_a"),
            groups * v4.o_lora_rank,
            heads * hd / groups.max(1),
        )?,
        wo_b: linear(ckpt, &format!("{p}.wo_b"), h, groups * v4.o_lora_rank)?,
        sinks: tensor(ckpt, &format!("{p}.attn_sink"), &[heads])?,
        compressor: pooling,
        indexer,
    })
}

/// Layer `layer`'s token-to-experts table, each entry checked to name an expert.
fn tid2eid(ckpt: &Checkpoint, cfg: &ModelConfig, layer: usize) -> Result<Vec<u32>, ModelError> {
    let name = format!("layers.{layer}.ffn.gate.tid2eid");
    let (vocab, k, experts) = (cfg.vocab_size, cfg.moe.top_k, cfg.moe.num_experts);
    let table = ckpt.read_int(&name, &[vocab, k])?;
    if let Some((i, &e)) = table
        .iter()
        .enumerate()
        .find(|(_, e)| !(0..experts as i64).contains(e))
    {
        return Err(ModelError::Corrupt {
            path: ckpt.dir().to_path_buf(),
            reason: format!(
                "`{name}` sends token {} to expert {e}, past the {experts} experts of the layer",
                i / k.max(1)
            ),
        });
    }
    Ok(table.into_iter().map(|e| e as u32).collect())
}

fn layer(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    v4: &DeepseekV4,
    l: usize,
) -> Result<LayerWeights, ModelError> {
    let (h, m) = (cfg.hidden_size, v4.hc_mult);
    let p = format!("layers.{l}");
    let gate_name = format!("{p}.ffn.gate");
    let hash = v4.is_hash_layer(l);
    let shared_i = cfg.moe.shared_intermediate_size;
    let sp = format!("{p}.ffn.shared_experts");
    let mut shared = SwiGlu {
        gate: linear_f32(ckpt, &format!("{sp}.w1"), shared_i, h)?,
        up: linear_f32(ckpt, &format!("{sp}.w3"), shared_i, h)?,
        down: linear_f32(ckpt, &format!("{sp}.w2"), h, shared_i)?,
    };
    clamp_swiglu(&mut shared, v4.swiglu_limit);
    Ok(LayerWeights {
        attn_norm: tensor(ckpt, &format!("{p}.attn_norm.weight"), &[h])?,
        ffn_norm: tensor(ckpt, &format!("{p}.ffn_norm.weight"), &[h])?,
        attn_hc: mixer(ckpt, &format!("{p}.hc_attn"), m, h)?,
        ffn_hc: mixer(ckpt, &format!("{p}.hc_ffn"), m, h)?,
        attention: attention(ckpt, cfg, v4, l)?,
        gate: linear(ckpt, &gate_name, cfg.moe.num_experts, h)?,
        gate_bias: if hash || !ckpt.contains(&format!("{gate_name}.bias")) {
            None
        } else {
            Some(tensor(
                ckpt,
                &format!("{gate_name}.bias"),
                &[cfg.moe.num_experts],
            )?)
        },
        tid2eid: if hash {
            Some(tid2eid(ckpt, cfg, l)?)
        } else {
            None
        },
        shared,
    })
}

impl V4Weights {
    pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, v4: &DeepseekV4) -> Result<Self, ModelError> {
        let (h, m, vocab) = (cfg.hidden_size, v4.hc_mult, cfg.vocab_size);
        let head_scale = tensor(ckpt, "hc_head_scale", &[1])?;
        Ok(V4Weights {
            embed: tensor(ckpt, "embed.weight", &[vocab, h])?,
            head: linear(ckpt, "head", vocab, h)?,
            norm: tensor(ckpt, "norm.weight", &[h])?,
            head_fn: tensor(ckpt, "hc_head_fn", &[m, m * h])?,
            head_base: tensor(ckpt, "hc_head_base", &[m])?,
            head_scale: head_scale.first().copied().unwrap_or(1.0),
            layers: (0..cfg.num_layers)
                .map(|l| layer(ckpt, cfg, v4, l))
                .collect::<Result<_, _>>()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::weights::deepseek_v4::{expert_matrix, ue8m0};

    /// ue8m0 against its definition, 2^(e - 127): 127 is 1, 128 is 2, 126 is 1/2, 0 is
    /// 2^-127 (subnormal in f32, still exact), 254 is 2^127, 255 is NaN.
    #[test]
    fn ue8m0_scales_are_their_powers_of_two() {
        assert_eq!(ue8m0(127), Some(1.0));
        assert_eq!(ue8m0(128), Some(2.0));
        assert_eq!(ue8m0(126), Some(0.5));
        assert_eq!(ue8m0(134), Some(128.0));
        assert_eq!(ue8m0(0), Some(f32::from_bits(1 << 22)));
        assert_eq!(ue8m0(254), Some(f32::from_bits(254 << 23)));
        assert_eq!(ue8m0(255), None);
        for e in 0..255u8 {
            assert_eq!(ue8m0(e), Some(2f32.powi(i32::from(e) - 127)), "{e}");
        }
    }

    /// An FP8 projection with ue8m0 block scales is held FP8 and reads as byte times scale;
    /// an MXFP4 expert matrix widens to its e2m1 values times 2^(e - 127).
    #[test]
    fn fp8_with_ue8m0_scales_and_mxfp4_experts_read_to_their_values() {
        use safetensors::tensor::TensorView;
        let dir = tempfile::tempdir().unwrap();
        // [2, 130] bytes of 1.0 (e4m3 0x38) in two 128-wide blocks scaled 2 and 1/2.
        let fp8 = vec![0x38u8; 2 * 130];
        let fp8_scale = vec![128u8, 126];
        // [2, 32] e2m1 pairs: row 0 bytes 0x21 (0.5 then 1.0) scaled 2; row 1 bytes 0x9F
        // (-6 then -0.5) scaled 1.
        let fp4: Vec<u8> = [vec![0x21u8; 16], vec![0x9Fu8; 16]].concat();
        let fp4_scale = vec![128u8, 127];
        let tensors = [
            ("a.weight", Dtype::F8_E4M3, vec![2, 130], &fp8),
            ("a.scale", Dtype::F8_E8M0, vec![1, 2], &fp8_scale),
            ("e.weight", Dtype::I8, vec![2, 16], &fp4),
            ("e.scale", Dtype::F8_E8M0, vec![2, 1], &fp4_scale),
        ];
        let views: Vec<(&str, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let a = linear(&ckpt, "a", 2, 130).unwrap();
        assert!(matches!(a, StoredLinear::Quantized { .. }), "kept FP8");
        let widened = a.widened();
        assert_eq!(widened[0], 2.0);
        assert_eq!(widened[127], 2.0);
        assert_eq!(widened[128], 0.5);
        assert_eq!(widened[130 + 129], 0.5);
        let e = expert_matrix(&ckpt, "e", 2, 32).unwrap();
        let e: Vec<f32> = e.iter().map(|v| v.to_f32()).collect();
        assert_eq!(&e[..4], &[1.0, 2.0, 1.0, 2.0]);
        assert_eq!(&e[32..36], &[-6.0, -0.5, -6.0, -0.5]);
        // A NaN scale (255) is an error naming the tensor, not a NaN weight.
        let views = vec![
            (
                "a.weight",
                TensorView::new(Dtype::F8_E4M3, vec![2, 130], &fp8).unwrap(),
            ),
            (
                "a.scale",
                TensorView::new(Dtype::F8_E8M0, vec![1, 2], &[255u8, 127]).unwrap(),
            ),
        ];
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let err = linear(&ckpt, "a", 2, 130).err().unwrap().to_string();
        assert!(err.contains("a.scale") && err.contains("NaN"), "{err}");
    }
}
