//! DeepSeek-V4's tensors by their published names (no `model.` prefix), shapes checked
//! against the config. Projections are held as stored: FP8 e4m3 with a `.scale` of ue8m0
//! exponents per 128 x 128 block kept FP8 (the scales widened to f32), bf16 kept bf16, the rest
//! f32; the grouped output projection's first half and the shared experts widened to f32. The
//! routed experts (`layers.N.ffn.experts.E.{w1,w3,w2}`) load as bf16 blocks with
//! `swiglu_limit` set on their gate and up ([`clamp_swiglu`]): MXFP4 (`.weight` two e2m1 values
//! a byte, low nibble first, `.scale` one e8m0 exponent per 32) and FP8 widen to bf16 exactly.

use half::bf16;
use safetensors::tensor::Dtype;

use crate::compute::cpu::{Linear, SwiGlu};
use crate::compute::expert::ExpertWeights;
use crate::compute::quant::{QuantLinear, e4m3_to_f32};
use crate::model::config::{DeepseekV4, V4LayerKind};
use crate::model::weights::{StoredLinear, load_expert};
use crate::model::{Checkpoint, ModelConfig, ModelError, mxfp4};

/// A ue8m0 scale as its definition gives it: the byte is the biased exponent of a power of
/// two, `2^(e - 127)`; 255 is NaN.
pub fn ue8m0(byte: u8) -> Option<f32> {
    (byte != 255).then(|| (f32::from(byte) - 127.0).exp2())
}

/// FP8 block size of the published checkpoints.
const FP8_BLOCK: [usize; 2] = [128, 128];

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

fn corrupt(ckpt: &Checkpoint, name: &str, reason: impl std::fmt::Display) -> ModelError {
    ModelError::Corrupt {
        path: ckpt.dir().to_path_buf(),
        reason: format!("`{name}`: {reason}"),
    }
}

/// `{name}.scale` of `shape` as f32 factors: ue8m0 bytes decoded, or stored as floats.
fn scales(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
    let scale = format!("{name}.scale");
    if !matches!(ckpt.dtype(&scale), Some(Dtype::F8_E8M0 | Dtype::U8)) {
        return tensor(ckpt, &scale, shape);
    }
    ckpt.read_bytes(&scale, shape, &[Dtype::F8_E8M0, Dtype::U8])?
        .into_iter()
        .map(|b| ue8m0(b).ok_or_else(|| corrupt(ckpt, &scale, "a scale is 255, e8m0's NaN")))
        .collect()
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

/// `down(silu(min(gate, limit)) * clamp(up, -limit, limit))`: DeepSeek-V4's experts and
/// shared experts.
pub fn clamp_swiglu<W: crate::compute::cpu::WeightElement>(block: &mut SwiGlu<W>, limit: f32) {
    block.gate.clamp = Some([f32::NEG_INFINITY, limit]);
    block.up.clamp = Some([-limit, limit]);
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

/// A routed expert's projection `[out, inp]` in bf16: MXFP4 and FP8 widened (exactly), bf16
/// as stored, f32 rounded.
fn expert_matrix(
    ckpt: &Checkpoint,
    name: &str,
    out: usize,
    inp: usize,
) -> Result<Vec<bf16>, ModelError> {
    let weight = format!("{name}.weight");
    let e8m0 = [Dtype::F8_E8M0, Dtype::U8];
    match ckpt.dtype(&weight) {
        Some(dtype @ (Dtype::F4 | Dtype::I8 | Dtype::U8)) => {
            let packed_shape = if dtype == Dtype::F4 {
                [out, inp]
            } else {
                [out, inp / 2]
            };
            let packed = ckpt.read_bytes(&weight, &packed_shape, &[dtype])?;
            let exponents = ckpt.read_bytes(
                &format!("{name}.scale"),
                &[out, inp.div_ceil(mxfp4::BLOCK)],
                &e8m0,
            )?;
            mxfp4::dequantize(&packed, &exponents, out, inp).map_err(|e| corrupt(ckpt, &weight, e))
        }
        Some(Dtype::F8_E4M3) => {
            let [rows, cols] = FP8_BLOCK;
            let bytes = ckpt.read_fp8(&weight, &[out, inp])?;
            let factors = scales(ckpt, name, &[out.div_ceil(rows), inp.div_ceil(cols)])?;
            let blocks_per_row = inp.div_ceil(cols);
            Ok(bytes
                .iter()
                .enumerate()
                .map(|(i, &b)| {
                    let (r, c) = (i / inp, i % inp);
                    let factor = factors[(r / rows) * blocks_per_row + c / cols];
                    bf16::from_f32(e4m3_to_f32(b) * factor)
                })
                .collect())
        }
        Some(Dtype::BF16) => ckpt.read_bf16(&weight, &[out, inp]),
        _ => Ok(tensor(ckpt, &weight, &[out, inp])?
            .into_iter()
            .map(bf16::from_f32)
            .collect()),
    }
}

/// Every routed expert, clamped at `swiglu_limit`: `[layer][expert]`. bf16 and f32 go through
/// the families' loader (f32 kept f32); MXFP4 and FP8 widen to bf16.
pub fn load_experts(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    v4: &DeepseekV4,
) -> Result<Vec<Vec<ExpertWeights>>, ModelError> {
    let (h, i) = (cfg.hidden_size, cfg.moe.expert_intermediate_size);
    (0..cfg.num_layers)
        .map(|l| {
            (0..cfg.moe.num_experts)
                .map(|e| {
                    let (prefix, names) = cfg.family.routed_expert(l, e);
                    let gate = format!("{prefix}.{}", names.gate);
                    let compressed = matches!(
                        ckpt.dtype(&format!("{gate}.weight")),
                        Some(Dtype::F4 | Dtype::I8 | Dtype::U8 | Dtype::F8_E4M3)
                    );
                    let mut expert = if compressed {
                        let up = format!("{prefix}.{}", names.up);
                        let down = format!("{prefix}.{}", names.down);
                        ExpertWeights::Bf16(SwiGlu {
                            gate: Linear::without_bias(expert_matrix(ckpt, &gate, i, h)?, i, h),
                            up: Linear::without_bias(expert_matrix(ckpt, &up, i, h)?, i, h),
                            down: Linear::without_bias(expert_matrix(ckpt, &down, h, i)?, h, i),
                        })
                    } else {
                        load_expert(ckpt, cfg, l, e)?
                    };
                    match &mut expert {
                        ExpertWeights::F32(block) => clamp_swiglu(block, v4.swiglu_limit),
                        ExpertWeights::Bf16(block) => clamp_swiglu(block, v4.swiglu_limit),
                        ExpertWeights::Quantized(_) => {
                            return Err(corrupt(
                                ckpt,
                                &prefix,
                                "quantized experts under the config's quantization_config are \
                                 not read for DeepSeek-V4 (their clamped SwiGLU)",
                            ));
                        }
                    }
                    Ok(expert)
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
