//! Bytes of one routed expert and of the dense part, from config.json's shapes and dtype
//! alone (no weights needed).

use serde::Serialize;

use crate::compute::cuda::experts::ExpertShape;
use crate::compute::cuda::storage::ExpertStorage;
use crate::engine::kv_cache::KvCache;
use crate::model::ModelConfig;
use crate::model::config::{AttentionConfig, DeepseekV4, ExpertActivation, V4Shape};
use crate::model::quant::Quantization;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ModelSizes {
    /// Bytes per parameter of the stored dtype (bf16 and f16: 2, f32: 4).
    pub dtype_bytes: u64,
    /// One routed expert of one layer: gate, up and down projections, as a node holds them
    /// on CPU slots and GPUs alike: in the stored form for a quantized checkpoint (FP8: 1
    /// byte per weight, INT4: half a byte, plus their f32 scales; MXFP4: half a byte plus a
    /// byte per 32).
    pub expert_bytes: u64,
    /// Everything every node loads besides routed experts: embeddings, attention, norms,
    /// gates, shared experts, dense MLPs, the output head.
    pub dense_bytes: u64,
    /// KV cache of one position of one sequence over all layers, as the node keeps it in
    /// host memory (f32; MLA keeps the latent and the rotary key only):
    /// [`KvCache::bytes_per_position`].
    pub kv_bytes_per_position: u64,
    /// The part of `kv_bytes_per_position` that DeepSeek Sparse Attention's lightning
    /// indexers keep (their keys, f32): [`KvCache::indexer_bytes_per_position`]; 0 for other
    /// models.
    pub indexer_bytes_per_position: u64,
    /// The same on a GPU (bf16): [`KvCache::gpu_bytes_per_position`].
    pub gpu_kv_bytes_per_position: u64,
    /// What one sequence keeps however long it is: a hybrid model's linear-attention states
    /// (f32), [`KvCache::state_bytes`]; 0 for other models.
    pub state_bytes_per_sequence: u64,
}

/// Bytes per parameter for a config's `torch_dtype` (bf16 when it names none).
pub fn dtype_bytes(dtype: Option<&str>) -> u64 {
    match dtype {
        Some("float32" | "f32" | "fp32") => 4,
        _ => 2,
    }
}

impl ModelSizes {
    pub fn of(model: &ModelConfig) -> ModelSizes {
        if let Some(v4) = &model.deepseek_v4 {
            return deepseek_v4(model, v4);
        }
        let bytes = dtype_bytes(model.dtype.as_deref());
        let h = model.hidden_size as u64;
        let heads = model.num_heads as u64;
        let swiglu = |intermediate: usize| 3 * h * intermediate as u64;
        let attention = match model.attention {
            AttentionConfig::Gqa {
                num_kv_heads,
                head_dim,
                qk_norm,
                bias,
                sinks,
                o_bias,
                ..
            } => {
                let (kv, hd) = (num_kv_heads as u64, head_dim as u64);
                let mut params = h * heads * hd + 2 * h * kv * hd + heads * hd * h;
                if let Some((q, k)) = qk_norm.widths(model.num_heads, num_kv_heads, head_dim) {
                    params += (q + k) as u64;
                }
                if bias {
                    params += heads * hd + 2 * kv * hd;
                }
                if o_bias {
                    params += h;
                }
                if sinks {
                    params += heads;
                }
                if let AttentionConfig::Gqa {
                    output_gate: true, ..
                } = model.attention
                {
                    params += h * heads * hd;
                }
                params
            }
            AttentionConfig::Mla {
                q_lora_rank,
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
                ..
            } => {
                let q_head = (qk_nope_head_dim + qk_rope_head_dim) as u64;
                let (kv_rank, rope, nope, v) = (
                    kv_lora_rank as u64,
                    qk_rope_head_dim as u64,
                    qk_nope_head_dim as u64,
                    v_head_dim as u64,
                );
                let q = match q_lora_rank {
                    Some(r) => h * r as u64 + r as u64 + r as u64 * heads * q_head,
                    None => h * heads * q_head,
                };
                q + h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v) + heads * v * h
            }
        };
        let experts = model.moe.num_experts as u64;
        // The router, and its per-expert correction bias where the family's gate has one.
        // gpt-oss's router and experts carry biases; its bf16 experts are held in f32 (their
        // clamped activation is folded into scaled weights: `crate::model::weights`), its
        // MXFP4 experts as stored.
        let clamped = matches!(model.moe.activation, ExpertActivation::ClampedSwiglu { .. });
        let gate = experts * h
            + if model.family.gate_correction_bias() || clamped {
                experts
            } else {
                0
            };
        let mut dense = model.vocab_size as u64 * h + h;
        if !model.tie_word_embeddings {
            dense += model.vocab_size as u64 * h;
        }
        // A gated DeltaNet: its projections (q, k, v, the output gate, beta and the decay
        // input), the convolution, dt_bias, A_log, the gated norm and the output projection.
        let linear_attention = model.linear_attention.as_ref().map_or(0, |la| {
            let (conv, value) = (la.conv_dim() as u64, la.value_dim() as u64);
            let heads = la.num_value_heads as u64;
            h * (conv + value + 2 * heads)
                + conv * la.conv_kernel as u64
                + 2 * heads
                + la.value_head_dim as u64
                + value * h
        });
        // DeepSeek Sparse Attention's lightning indexer, on the layers that run their own: its
        // queries from the low-rank query, its key with a LayerNorm, the per-head weights.
        let indexer = match &model.attention {
            AttentionConfig::Mla {
                indexer: Some(indexer),
                q_lora_rank,
                ..
            } => {
                let (n, d) = (indexer.num_heads as u64, indexer.head_dim as u64);
                let params = q_lora_rank.unwrap_or(0) as u64 * n * d + h * d + 2 * d + h * n;
                Some((indexer, params))
            }
            _ => None,
        };
        for (l, &is_moe) in model.moe_layers.iter().enumerate() {
            dense += indexer
                .filter(|(indexer, _)| indexer.has_own(l))
                .map_or(0, |(_, params)| params);
            let linear = model
                .linear_attention
                .as_ref()
                .is_some_and(|la| la.is_linear(l));
            dense += 2 * h + if linear { linear_attention } else { attention };
            if is_moe && model.moe.shared_expert_gate {
                dense += h;
            }
            dense += if is_moe {
                gate + swiglu(model.moe.shared_intermediate_size)
            } else {
                swiglu(model.intermediate_size)
            };
        }
        let expert_params = swiglu(model.moe.expert_intermediate_size);
        let expert_bytes = match quantized_expert_bytes(model) {
            Some(quantized) => quantized,
            None if clamped => {
                let biases = 2 * model.moe.expert_intermediate_size as u64 + h;
                (expert_params + biases) * 4
            }
            None => expert_params * bytes,
        };
        ModelSizes {
            dtype_bytes: bytes,
            expert_bytes,
            dense_bytes: dense * bytes,
            kv_bytes_per_position: KvCache::bytes_per_position(model) as u64,
            indexer_bytes_per_position: KvCache::indexer_bytes_per_position(model) as u64,
            gpu_kv_bytes_per_position: KvCache::gpu_bytes_per_position(model) as u64,
            state_bytes_per_sequence: KvCache::state_bytes(model) as u64,
        }
    }
}

/// DeepSeek-V4 as published (FP8 dense part with ue8m0 scales, MXFP4 or FP8 experts) and its
/// caches of several kinds (compressed entries and indexer keys per position, windows per
/// sequence): [`DeepseekV4::dense_bytes`] and the rest.
fn deepseek_v4(model: &ModelConfig, v4: &DeepseekV4) -> ModelSizes {
    let shape = V4Shape {
        vocab: model.vocab_size as u64,
        hidden: model.hidden_size as u64,
        heads: model.num_heads as u64,
        experts: model.moe.num_experts as u64,
        top_k: model.moe.top_k as u64,
        expert_intermediate: model.moe.expert_intermediate_size as u64,
        shared_intermediate: model.moe.shared_intermediate_size as u64,
    };
    ModelSizes {
        dtype_bytes: 1,
        expert_bytes: v4.expert_bytes(&shape),
        dense_bytes: v4.dense_bytes(&shape),
        kv_bytes_per_position: v4.cache_bytes_per_position(),
        // Not served on a GPU (refused at load): its host figure.
        gpu_kv_bytes_per_position: v4.cache_bytes_per_position(),
        // V4's indexer keys are per compressed entry, counted in the figure above.
        indexer_bytes_per_position: 0,
        state_bytes_per_sequence: v4.cache_bytes_per_sequence(),
    }
}

/// Bytes of GPU memory a device holding experts takes besides their weights, as the start-up
/// fit check counts them ([`ExpertShape::bytes_needed`]): the bf16 copies quantized experts
/// are widened into for the grouped GEMM (up to 1 GiB), the rows of a step of `max_rows`
/// grouped rows, the per-group pointer arrays and cuBLAS's reserve.
pub fn gpu_work_bytes(model: &ModelConfig, max_rows: usize) -> u64 {
    let storage = match (&model.quantization, quantized_expert_bytes(model)) {
        (_, None) | (Quantization::None | Quantization::Mxfp4, _) => ExpertStorage::Bf16,
        (Quantization::Fp8 { block }, Some(_)) => ExpertStorage::Fp8 {
            block_rows: block[0],
            block_cols: block[1],
        },
        (Quantization::PackedInt4 { group_size, .. }, Some(_)) => ExpertStorage::Int4 {
            group: *group_size,
            scales_bf16: int4_scale_bytes(model) == 2,
        },
    };
    let shape = ExpertShape {
        hidden: model.hidden_size,
        intermediate: model.moe.expert_intermediate_size,
        num_experts: model.moe.num_experts,
        max_rows,
        host_io: true,
        storage,
        activation: Default::default(),
        // gpt-oss's experts carry biases after their matrices.
        biases: matches!(
            model.moe.activation,
            crate::model::config::ExpertActivation::ClampedSwiglu { .. }
        ),
    };
    shape.bytes_needed(0) as u64
}

/// How many of a node's first `devices` carry a replica of the dense part, as `plan` and
/// `serve` both count it: `dense_replicas` of them (0: all), none where the dense part stays
/// on the host (`devices.dense_on_gpu = false`, or DeepSeek-V4, whose dense part the GPU
/// backend does not run: serve refuses it on a GPU).
pub fn dense_carriers(
    model: &ModelConfig,
    dense_on_gpu: bool,
    dense_replicas: usize,
    devices: usize,
) -> usize {
    if !dense_on_gpu || model.deepseek_v4.is_some() {
        return 0;
    }
    match dense_replicas {
        0 => devices,
        n => n.min(devices),
    }
}

/// The share of a device's usable memory placement keeps for the KV cache of the dense
/// replica it carries, when experts would otherwise crowd it out and `batching.kv_cache_mib`
/// does not say how much: a quarter holds some 480k positions of Kimi K2 on an H200 (68.6
/// KiB each) and still leaves three quarters to weights.
pub const KV_SHARE_KEPT: f64 = 0.25;

/// Experts of one MoE layer a device with `usable` bytes (its memory times
/// `devices.gpu_memory_fraction`) has room for, as `plan` and `serve` both count it: what is
/// left after its work area for `max_rows` grouped rows and, where it carries a dense
/// replica, the dense weights and its KV cache (`kv_cache_bytes`, else [`KV_SHARE_KEPT`] of
/// `usable`). Placement stops filling a device there while others have room.
pub fn expert_slots(
    model: &ModelConfig,
    max_rows: usize,
    kv_cache_bytes: Option<u64>,
    usable: u64,
    dense: bool,
) -> usize {
    let sizes = ModelSizes::of(model);
    let moe_layers = model.moe_layers.iter().filter(|&&m| m).count() as u64;
    let per_slot = (sizes.expert_bytes * moe_layers).max(1);
    let mut taken = gpu_work_bytes(model, max_rows);
    if dense {
        let kv = kv_cache_bytes.unwrap_or((usable as f64 * KV_SHARE_KEPT) as u64);
        taken += sizes.dense_bytes + kv;
    }
    usize::try_from(usable.saturating_sub(taken) / per_slot).unwrap_or(usize::MAX)
}

/// Bytes of one INT4 scale as a node holds them: bf16 when the file's are (compressed-tensors
/// writes them in the model's dtype), else f32 (`GroupScales`).
fn int4_scale_bytes(model: &ModelConfig) -> u64 {
    match model.dtype.as_deref() {
        None | Some("bfloat16" | "bf16") => 2,
        Some(_) => 4,
    }
}

/// Bytes of one routed expert held in its quantized form (weights and f32 scales), or `None`
/// where the checkpoint stores experts unquantized.
fn quantized_expert_bytes(model: &ModelConfig) -> Option<u64> {
    let (h, i) = (
        model.hidden_size as u64,
        model.moe.expert_intermediate_size as u64,
    );
    // gate and up are [i, h], down is [h, i].
    let matrices = [(i, h), (i, h), (h, i)];
    match &model.quantization {
        Quantization::None => None,
        // Held as stored: half a byte per weight and one E8M0 byte per 32, plus gpt-oss's
        // f32 biases (gate, up and down).
        Quantization::Mxfp4 => {
            let biases = if matches!(model.moe.activation, ExpertActivation::ClampedSwiglu { .. }) {
                4 * (2 * i + h)
            } else {
                0
            };
            Some(
                matrices
                    .iter()
                    .map(|&(out, inp)| out * inp / 2 + out * inp.div_ceil(32))
                    .sum::<u64>()
                    + biases,
            )
        }
        Quantization::Fp8 { block } => {
            let [rows, cols] = block.map(|b| b as u64);
            Some(
                matrices
                    .iter()
                    .map(|&(out, inp)| out * inp + 4 * out.div_ceil(rows) * inp.div_ceil(cols))
                    .sum(),
            )
        }
        Quantization::PackedInt4 { group_size, ignore } => {
            let layer = model.moe_layers.iter().position(|&m| m)?;
            // The loader's rule: an expert named in `ignore` is stored unquantized.
            let (expert, names) = model.family.routed_expert(layer, 0);
            let module = format!("{expert}.{}", names.gate);
            let multimodal = format!("language_model.{module}");
            if ignore.contains(&module) || ignore.contains(&multimodal) {
                return None;
            }
            let group = *group_size as u64;
            let scale_bytes = int4_scale_bytes(model);
            Some(
                matrices
                    .iter()
                    .map(|&(out, inp)| {
                        4 * out * inp.div_ceil(8) + scale_bytes * out * inp.div_ceil(group)
                    })
                    .sum(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which of a node's devices carry a dense replica, as plan and serve both count it.
    #[test]
    fn dense_replicas_go_to_the_first_devices_and_never_for_deepseek_v4() {
        let fixture = |name: &str| {
            ModelConfig::load(
                &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/fixtures")
                    .join(name),
            )
            .unwrap()
        };
        let v3 = fixture("deepseek_v3");
        assert_eq!(dense_carriers(&v3, true, 0, 8), 8, "0: every device");
        assert_eq!(dense_carriers(&v3, true, 2, 8), 2);
        assert_eq!(dense_carriers(&v3, true, 16, 8), 8);
        assert_eq!(dense_carriers(&v3, false, 0, 8), 0, "dense_on_gpu off");
        assert_eq!(dense_carriers(&fixture("deepseek_v4"), true, 0, 8), 0);
    }

    /// The reference fixtures' tensors, counted from their config.json alone, add up to their
    /// safetensors files: every family's attention (GLM's biases and q/k norms), gates and
    /// shared experts included.
    #[test]
    fn every_familys_fixture_sizes_to_its_safetensors_file() {
        for name in [
            "qwen3_moe",
            "qwen3_moe_bf16",
            "mixtral_sliding",
            "deepseek_v3",
            "kimi_k2",
            "glm4_moe",
            "minimax_m2",
            "llama4",
            "gpt_oss",
        ] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures")
                .join(name);
            let model = ModelConfig::load(&dir).unwrap();
            let sizes = ModelSizes::of(&model);
            let moe_layers = model.moe_layers.iter().filter(|&&m| m).count() as u64;
            let tensors =
                sizes.dense_bytes + moe_layers * model.moe.num_experts as u64 * sizes.expert_bytes;
            let file = std::fs::read(dir.join("model.safetensors")).unwrap();
            // The file is an 8-byte header length, the JSON header, then the tensors.
            let header = u64::from_le_bytes(file[..8].try_into().unwrap());
            assert_eq!(file.len() as u64 - 8 - header, tensors, "{name}");
        }
    }

    /// gpt-oss's MXFP4 release: `plan` counts its experts as a node holds them (blocks,
    /// scales and f32 biases), what a loaded expert reports reading.
    #[test]
    fn mxfp4_experts_are_counted_as_held() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt_oss_mxfp4");
        let model = ModelConfig::load(&dir).unwrap();
        let ckpt = crate::model::Checkpoint::open(&dir).unwrap();
        let expert = crate::model::weights::load_expert(&ckpt, &model, 0, 0).unwrap();
        assert!(matches!(
            expert,
            crate::compute::expert::ExpertWeights::Quantized(_)
        ));
        let (h, i) = (64u64, 32u64);
        let expected = 3 * (h * i / 2 + h * i / 32) + 4 * (2 * i + h);
        assert_eq!(ModelSizes::of(&model).expert_bytes, expected);
        assert_eq!(expert.weight_bytes() as u64, expected);
    }

    #[test]
    fn the_demo_models_sizes_match_its_safetensors_file() {
        let dir = tempfile::tempdir().unwrap();
        let spec = crate::model::demo::DemoSpec {
            num_experts: 8,
            top_k: 2,
            ..Default::default()
        };
        crate::model::demo::write_demo_model(dir.path(), &spec, |_, _| {}).unwrap();
        let model = ModelConfig::load(dir.path()).unwrap();
        let sizes = ModelSizes::of(&model);
        assert_eq!(sizes.expert_bytes, 3 * 128 * 64 * 2);
        let moe_layers = model.moe_layers.iter().filter(|&&m| m).count() as u64;
        let file = std::fs::metadata(dir.path().join("model.safetensors"))
            .unwrap()
            .len();
        let tensors = sizes.dense_bytes + moe_layers * 8 * sizes.expert_bytes;
        // The file adds a JSON header; the tensors are everything else.
        assert!(
            file > tensors && file - tensors < 64 * 1024,
            "{file} vs {tensors}"
        );
    }
}
