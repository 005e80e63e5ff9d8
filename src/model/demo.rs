//! The built-in demo model: a deterministic checkpoint shaped like Kimi K3 (the `kimi_k2` /
//! DeepSeek-V3 layout with 896 routed experts, 16 active per token and one shared expert),
//! with dimensions small enough to write and load in seconds on a CPU. Its weights are
//! pseudo-random, so its text is noise; it exists to exercise every part of the server.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use half::bf16;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use safetensors::tensor::{Dtype, View};
use serde_json::json;

use super::ModelError;

/// Shape of the demo model.
pub struct DemoSpec {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub first_k_dense: usize,
    pub num_heads: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate_size: usize,
    pub dense_intermediate_size: usize,
    pub kv_lora_rank: usize,
    pub q_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub seed: u64,
    /// Zipf exponent of the experts' activation frequencies (0: no skew); see
    /// [`skewed_bias`].
    pub skew: f64,
}

/// Byte-level vocabulary: ids 0..=255 are bytes, then the chat special tokens.
const SPECIAL_TOKENS: [&str; 3] = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"];
pub const VOCAB_SIZE: usize = 256 + SPECIAL_TOKENS.len();
const IM_END: u32 = 257;

impl Default for DemoSpec {
    /// Kimi K3's routing shape (896 experts, top-16, one shared expert) at toy width.
    fn default() -> Self {
        DemoSpec {
            hidden_size: 128,
            num_layers: 4,
            first_k_dense: 1,
            num_heads: 4,
            num_experts: 896,
            top_k: 16,
            expert_intermediate_size: 64,
            dense_intermediate_size: 256,
            kv_lora_rank: 64,
            q_lora_rank: 96,
            qk_nope_head_dim: 32,
            qk_rope_head_dim: 16,
            v_head_dim: 32,
            seed: 0x6b33,
            skew: 0.0,
        }
    }
}

/// A bf16 tensor ready to serialise.
struct Bf16Tensor {
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Bf16Tensor {
    fn dtype(&self) -> Dtype {
        Dtype::BF16
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

struct Writer {
    rng: ChaCha8Rng,
    tensors: Vec<(String, Bf16Tensor)>,
}

impl Writer {
    /// Uniform values in `[-scale, scale)`.
    fn random(&mut self, name: String, shape: &[usize], scale: f32) {
        let count: usize = shape.iter().product();
        let mut bytes = Vec::with_capacity(count * 2);
        for _ in 0..count {
            let unit = (self.rng.next_u32() >> 8) as f32 / (1u32 << 23) as f32 - 1.0;
            bytes.extend_from_slice(&bf16::from_f32(unit * scale).to_le_bytes());
        }
        self.tensors.push((
            name,
            Bf16Tensor {
                shape: shape.to_vec(),
                bytes,
            },
        ));
    }

    fn ones(&mut self, name: String, width: usize) {
        let bytes = bf16::ONE.to_le_bytes().repeat(width);
        self.tensors.push((
            name,
            Bf16Tensor {
                shape: vec![width],
                bytes,
            },
        ));
    }

    fn linear(&mut self, name: String, out: usize, inp: usize) {
        let scale = 1.0 / (inp as f32).sqrt();
        self.random(format!("{name}.weight"), &[out, inp], scale);
    }

    fn swiglu(&mut self, prefix: &str, hidden: usize, intermediate: usize) {
        self.linear(format!("{prefix}.gate_proj"), intermediate, hidden);
        self.linear(format!("{prefix}.up_proj"), intermediate, hidden);
        self.linear(format!("{prefix}.down_proj"), hidden, intermediate);
    }
}

/// Writes the demo checkpoint (config.json, model.safetensors, tokenizer.json,
/// tokenizer_config.json) into `out`, calling `progress(done, total)` per layer.
pub fn write_demo_model(
    out: &Path,
    spec: &DemoSpec,
    mut progress: impl FnMut(usize, usize),
) -> Result<(), ModelError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ModelError::Io { path, source }
    };
    std::fs::create_dir_all(out).map_err(io(out))?;
    let h = spec.hidden_size;
    let mut w = Writer {
        rng: ChaCha8Rng::seed_from_u64(spec.seed),
        tensors: Vec::new(),
    };
    w.random("model.embed_tokens.weight".into(), &[VOCAB_SIZE, h], 1.0);
    w.linear("lm_head".into(), VOCAB_SIZE, h);
    w.ones("model.norm.weight".into(), h);
    let q_width = spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim);
    for l in 0..spec.num_layers {
        let p = format!("model.layers.{l}");
        w.ones(format!("{p}.input_layernorm.weight"), h);
        w.ones(format!("{p}.post_attention_layernorm.weight"), h);
        let a = format!("{p}.self_attn");
        w.linear(format!("{a}.q_a_proj"), spec.q_lora_rank, h);
        w.ones(format!("{a}.q_a_layernorm.weight"), spec.q_lora_rank);
        w.linear(format!("{a}.q_b_proj"), q_width, spec.q_lora_rank);
        w.linear(
            format!("{a}.kv_a_proj_with_mqa"),
            spec.kv_lora_rank + spec.qk_rope_head_dim,
            h,
        );
        w.ones(format!("{a}.kv_a_layernorm.weight"), spec.kv_lora_rank);
        w.linear(
            format!("{a}.kv_b_proj"),
            spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim),
            spec.kv_lora_rank,
        );
        w.linear(format!("{a}.o_proj"), h, spec.num_heads * spec.v_head_dim);
        if l < spec.first_k_dense {
            w.swiglu(&format!("{p}.mlp"), h, spec.dense_intermediate_size);
        } else {
            w.linear(format!("{p}.mlp.gate"), spec.num_experts, h);
            w.random(
                format!("{p}.mlp.gate.e_score_correction_bias"),
                &[spec.num_experts],
                0.01,
            );
            if spec.skew > 0.0 {
                let bias = skewed_bias(
                    spec.num_experts,
                    spec.top_k,
                    spec.skew,
                    spec.seed ^ l as u64,
                );
                if let Some((_, tensor)) = w.tensors.last_mut() {
                    add_bf16(&mut tensor.bytes, &bias);
                }
            }
            w.swiglu(
                &format!("{p}.mlp.shared_experts"),
                h,
                spec.expert_intermediate_size,
            );
            for e in 0..spec.num_experts {
                w.swiglu(
                    &format!("{p}.mlp.experts.{e}"),
                    h,
                    spec.expert_intermediate_size,
                );
            }
        }
        progress(l + 1, spec.num_layers);
    }
    let weights_path = out.join("model.safetensors");
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(
        w.tensors.iter().map(|(n, t)| (n.as_str(), t)),
        Some(metadata),
        &weights_path,
    )
    .map_err(|e| ModelError::Corrupt {
        path: weights_path.clone(),
        reason: format!("could not write: {e}"),
    })?;

    let path = out.join("config.json");
    let text = serde_json::to_string_pretty(&config_json(spec)).expect("JSON values serialise");
    std::fs::write(&path, text).map_err(io(&path))?;
    refresh_demo_tokenizer(out)?;
    Ok(())
}

/// Writes the demo's tokenizer.json and tokenizer_config.json into `dir` where they differ
/// from this build's (a demo checkpoint written by an earlier version has an older chat
/// template; its weights are the same). Returns whether anything was written.
pub fn refresh_demo_tokenizer(dir: &Path) -> Result<bool, ModelError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |e: std::io::Error| ModelError::Corrupt {
            path,
            reason: format!("could not write: {e}"),
        }
    };
    let mut written = false;
    for (name, value) in [
        ("tokenizer.json", tokenizer_json()),
        ("tokenizer_config.json", tokenizer_config_json()),
    ] {
        let path = dir.join(name);
        let text = serde_json::to_string_pretty(&value).expect("JSON values serialise");
        if std::fs::read_to_string(&path).is_ok_and(|old| old == text) {
            continue;
        }
        // Whole or not at all: another process may be reading it.
        let partial = dir.join(format!("{name}.partial-{}", std::process::id()));
        std::fs::write(&partial, text).map_err(io(&partial))?;
        std::fs::rename(&partial, &path).map_err(io(&path))?;
        written = true;
    }
    Ok(written)
}

/// Spread of the demo gate's sigmoid scores: the gate's logits have variance 1/3 (uniform
/// weights of scale 1/sqrt(hidden) over RMS-normed inputs), and the sigmoid's slope at 0 is
/// 1/4.
const SCORE_SPREAD: f32 = 0.144;

/// A per-expert bias on the gate's choice (DeepSeek's `e_score_correction_bias`) under which
/// expert activations follow a Zipf-like law: the expert of rank r (a shuffle of the ids,
/// different per layer) is chosen by a token with probability p_r ∝ r^-skew (at most 0.95,
/// `top_k` in all). A score around 0.5 of spread [`SCORE_SPREAD`] plus bias b clears 0.5
/// with about that probability when b = spread × logit(p_r) / 1.702 (the logistic
/// approximation of the normal quantile); the probabilities adding up to `top_k`, the top-k
/// threshold then sits near 0.5.
pub fn skewed_bias(num_experts: usize, top_k: usize, skew: f64, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5a1f);
    let mut rank_of: Vec<usize> = (0..num_experts).collect();
    for i in (1..num_experts).rev() {
        rank_of.swap(i, rng.next_u64() as usize % (i + 1));
    }
    let probability = crate::placement::profile::zipf_probabilities(num_experts, top_k, skew);
    rank_of
        .iter()
        .map(|&rank| {
            let p = probability[rank].clamp(1e-6, 0.95);
            SCORE_SPREAD * ((p / (1.0 - p)).ln() / 1.702) as f32
        })
        .collect()
}

/// Adds `extra` to a bf16 tensor's values.
fn add_bf16(bytes: &mut [u8], extra: &[f32]) {
    for (value, add) in bytes.chunks_exact_mut(2).zip(extra) {
        let old = bf16::from_le_bytes([value[0], value[1]]).to_f32();
        value.copy_from_slice(&bf16::from_f32(old + add).to_le_bytes());
    }
}

fn config_json(spec: &DemoSpec) -> serde_json::Value {
    json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.dense_intermediate_size,
        "moe_intermediate_size": spec.expert_intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads,
        "n_routed_experts": spec.num_experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": spec.top_k,
        "first_k_dense_replace": spec.first_k_dense,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": true,
        "routed_scaling_factor": 2.827,
        "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 50000.0,
        "rope_scaling": null,
        "tie_word_embeddings": false,
        "bos_token_id": null,
        "eos_token_id": IM_END,
        "torch_dtype": "bfloat16"
    })
}

/// GPT-2's byte-to-character table: printable bytes map to themselves, the rest to code
/// points from 256 up, so every byte has a visible, unique character.
fn byte_level_char(byte: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(byte) {
        return char::from(byte);
    }
    let rank = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + rank).expect("code points 256..512 are valid")
}

pub(crate) fn tokenizer_json() -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| (byte_level_char(b).to_string(), json!(b)))
        .collect();
    let added: Vec<serde_json::Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": 256 + i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []
        }
    })
}

/// ChatML, as Qwen's: tools listed in a system turn and called in `<tool_call>` blocks
/// (the Hermes format, which [`crate::api::tool_calls`] reads); a conversation without
/// tools renders as plain ChatML.
const DEMO_CHAT_TEMPLATE: &str = concat!(
    "{% if tools %}<|im_start|>system\n",
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}",
    "# Tools\n\nYou may call one or more functions. Their signatures are in <tools></tools>:\n",
    "<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n",
    "For each call, return a JSON object with the function's name and arguments within ",
    "<tool_call></tool_call>:\n<tool_call>\n",
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n",
    "{% endif %}",
    "{% for message in messages %}",
    "{% if not (tools and loop.first and message.role == 'system') %}",
    "<|im_start|>{{ message.role }}\n",
    "{% if message.content is not none %}{{ message.content }}{% endif %}",
    "{% for call in message.tool_calls or [] %}",
    "{% if not loop.first or message.content %}\n{% endif %}",
    "<tool_call>\n{\"name\": {{ call.function.name | tojson }}, ",
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>",
    "{% endfor %}<|im_end|>\n",
    "{% endif %}{% endfor %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
);

pub(crate) fn tokenizer_config_json() -> serde_json::Value {
    json!({
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": DEMO_CHAT_TEMPLATE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_tokenizer_maps_text_to_its_utf8_bytes_and_back() {
        let dir = tempfile::tempdir().unwrap();
        let text = serde_json::to_string(&tokenizer_json()).unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), text).unwrap();
        let tokenizer = crate::model::Tokenizer::load_optional(dir.path())
            .unwrap()
            .expect("tokenizer.json was written");
        let sample = "Hi there, ü\n";
        let ids = tokenizer.encode(sample).unwrap();
        let bytes: Vec<u32> = sample.bytes().map(u32::from).collect();
        assert_eq!(ids, bytes);
        assert_eq!(tokenizer.decode(&ids).unwrap(), sample);
        assert_eq!(tokenizer.encode("<|im_end|>").unwrap(), vec![IM_END]);
    }

    #[test]
    fn byte_level_table_is_a_bijection() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_level_char).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(byte_level_char(b'a'), 'a');
        assert_eq!(byte_level_char(b' '), 'Ġ');
        assert_eq!(byte_level_char(b'\n'), 'Ċ');
    }
}
