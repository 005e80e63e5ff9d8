use super::*;
use crate::model::ModelConfig;

#[test]
fn every_model_type_finds_its_family_and_errors_name_them_all() {
    for family in Family::ALL {
        for model_type in family.model_types() {
            assert_eq!(Family::of_model_type(model_type), Some(family));
        }
    }
    assert_eq!(
        Family::supported_model_types(),
        "qwen3_moe, mixtral, deepseek_v3, kimi_k2, glm4_moe, minimax_m2, llama4_text, gpt_oss, \
         qwen3_next, qwen3_5_moe_text, deepseek_v32, glm_moe_dsa and deepseek_v4"
    );
    let err = ModelConfig::parse(r#"{"model_type": "llama"}"#).unwrap_err();
    for family in Family::ALL {
        for model_type in family.model_types() {
            assert!(err[0].contains(model_type), "{model_type} not in {err:?}");
        }
    }
}

#[test]
fn routed_experts_are_named_as_each_family_publishes_them() {
    let (prefix, names) = Family::Mixtral.routed_expert(2, 5);
    assert_eq!(prefix, "model.layers.2.block_sparse_moe.experts.5");
    assert_eq!((names.gate, names.up, names.down), ("w1", "w3", "w2"));
    for family in [Family::Qwen3Moe, Family::DeepseekV3] {
        let (prefix, names) = family.routed_expert(2, 5);
        assert_eq!(prefix, "model.layers.2.mlp.experts.5");
        assert_eq!(names, ExpertNames::PROJ);
    }
    assert!(Family::DeepseekV3.gate_correction_bias());
    assert!(!Family::Qwen3Moe.gate_correction_bias());
}

#[test]
fn a_wrapper_names_the_text_model_types_it_accepts() {
    let text = r#"{"model_type": "kimi_k25", "text_config": {"model_type": "qwen3_moe"}}"#;
    let err = ModelConfig::parse(text).unwrap_err();
    assert!(err[0].contains("deepseek_v3 or kimi_k2"), "{err:?}");
}

#[test]
fn every_family_names_a_tool_call_format() {
    for family in Family::ALL {
        assert!(!family.tool_call_formats().is_empty(), "{family:?}");
    }
}

/// GLM-4.5's config.json in its published form (zai-org/GLM-4.5; the sizes as NVIDIA's Megatron
/// Bridge page on GLM 4.5 lists them).
const GLM_4_5: &str = r#"{
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 1536, "norm_topk_prob": true,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "num_hidden_layers": 92, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0", "use_cache": true, "use_qk_norm": true,
    "vocab_size": 151552
}"#;

#[test]
fn reads_glm_4_5_as_published() {
    use crate::model::config::{AttentionConfig, GatingConfig};
    let c = ModelConfig::parse(GLM_4_5).unwrap();
    assert_eq!(c.family, Family::Glm4Moe);
    assert_eq!(
        c.attention,
        AttentionConfig::Gqa {
            num_kv_heads: 8,
            head_dim: 128,
            qk_norm: QkNorm::PerHead,
            bias: true,
            sliding_window: None,
            interleave: false,
            layers: Vec::new(),
            sinks: false,
            o_bias: false,
            output_gate: false,
        }
    );
    assert_eq!(c.rope.dim, 64);
    assert_eq!(c.rope.theta, 1e6);
    assert_eq!(c.moe_layers.iter().filter(|&&m| m).count(), 89);
    assert!(!c.moe_layers[2] && c.moe_layers[3]);
    assert_eq!(c.moe.shared_intermediate_size, 1536);
    assert_eq!(
        c.moe.gating,
        GatingConfig::SigmoidGrouped {
            n_group: 1,
            topk_group: 1,
            normalize: true,
            routed_scaling_factor: 2.5,
        }
    );
    assert_eq!(c.eos_token_ids, vec![151329, 151336, 151338]);
    // transformers 5 writes the factor under rope_parameters; the Air model has no q/k norm.
    let mut v: serde_json::Value = serde_json::from_str(GLM_4_5).unwrap();
    v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e6,
                                               "partial_rotary_factor": 0.25});
    v["use_qk_norm"] = false.into();
    let c = ModelConfig::parse(&v.to_string()).unwrap();
    assert_eq!(c.rope.dim, 32);
    assert!(matches!(
        c.attention,
        AttentionConfig::Gqa {
            qk_norm: QkNorm::None,
            ..
        }
    ));
    v["rope_parameters"]["partial_rotary_factor"] = 1.5.into();
    let err = ModelConfig::parse(&v.to_string()).unwrap_err();
    assert!(
        err.iter().any(|m| m.contains("partial_rotary_factor")),
        "{err:?}"
    );
}

/// MiniMax-M2's config.json as published (MiniMaxAI/MiniMax-M2), FP8 blocks with the format
/// written as torch names it.
const MINIMAX_M2: &str = r#"{
    "architectures": ["MiniMaxM2ForCausalLM"], "attention_dropout": 0.0, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 1536, "max_position_embeddings": 196608, "model_type": "minimax_m2",
    "mtp_transformer_layers": 1, "num_attention_heads": 48, "num_experts_per_tok": 8,
    "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
    "num_mtp_modules": 3, "output_router_logits": false, "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64,
    "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "scoring_func": "sigmoid",
    "shared_intermediate_size": 0, "tie_word_embeddings": false, "use_mtp": true,
    "use_qk_norm": true, "use_routing_bias": true, "vocab_size": 200064,
    "torch_dtype": "bfloat16", "transformers_version": "4.46.1",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn",
        "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
}"#;

#[test]
fn reads_minimax_m2_as_published() {
    use crate::model::config::{AttentionConfig, GatingConfig};
    use crate::model::quant::Quantization;
    let c = ModelConfig::parse(MINIMAX_M2).unwrap();
    assert_eq!(c.family, Family::MiniMaxM2);
    assert_eq!(
        c.attention,
        AttentionConfig::Gqa {
            num_kv_heads: 8,
            head_dim: 128,
            qk_norm: QkNorm::PerLayer,
            bias: false,
            sliding_window: None,
            interleave: false,
            layers: Vec::new(),
            sinks: false,
            o_bias: false,
            output_gate: false,
        }
    );
    assert_eq!(c.rope.dim, 64);
    assert_eq!(c.rope.theta, 5e6);
    assert!(c.moe_layers.iter().all(|&m| m));
    assert_eq!((c.moe.num_experts, c.moe.top_k), (256, 8));
    assert_eq!(c.moe.expert_intermediate_size, 1536);
    assert_eq!(c.moe.shared_intermediate_size, 0);
    assert_eq!(
        c.moe.gating,
        GatingConfig::SigmoidGrouped {
            n_group: 1,
            topk_group: 1,
            normalize: true,
            routed_scaling_factor: 1.0,
        }
    );
    assert_eq!(c.quantization, Quantization::Fp8 { block: [128, 128] });
    assert_eq!(
        Family::MiniMaxM2.correction_bias_name(3).as_deref(),
        Some("model.layers.3.block_sparse_moe.e_score_correction_bias")
    );
    let (prefix, names) = Family::MiniMaxM2.routed_expert(3, 7);
    assert_eq!(prefix, "model.layers.3.block_sparse_moe.experts.7");
    assert_eq!((names.gate, names.up, names.down), ("w1", "w3", "w2"));
}

#[test]
fn minimax_m2_names_a_bad_qk_norm_type_rotary_dim_or_shared_expert() {
    let with = |key: &str, value: serde_json::Value| {
        let mut v: serde_json::Value = serde_json::from_str(MINIMAX_M2).unwrap();
        v[key] = value;
        ModelConfig::parse(&v.to_string()).unwrap_err()
    };
    for (key, value) in [
        ("qk_norm_type", serde_json::json!("per_token")),
        ("rotary_dim", serde_json::json!(130)),
        ("rotary_dim", serde_json::json!(0)),
        ("shared_intermediate_size", serde_json::json!(512)),
        ("scoring_func", serde_json::json!("softmax")),
    ] {
        let err = with(key, value.clone());
        assert!(
            err.iter().any(|m| m.contains(key)),
            "{key} = {value}: {err:?}"
        );
    }
    let err = with("qk_norm_type", serde_json::json!("per_token"));
    assert!(err.iter().any(|m| m.contains("`per_token`")), "{err:?}");
}

/// Llama 4 Scout's config.json as published (meta-llama/Llama-4-Scout-17B-16E): the text
/// model under the `llama4` wrapper, beside a vision tower's config.
const LLAMA_4_SCOUT: &str = r#"{
    "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
    "boi_token_index": 200080, "eoi_token_index": 200081, "image_token_index": 200092,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "llama4_text", "attention_bias": false, "attention_chunk_size": 8192,
        "attention_dropout": 0.0, "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
        "for_llm_compressor": false, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
        "initializer_range": 0.02, "interleave_moe_layer_step": 1, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760,
        "no_rope_layers": [], "num_attention_heads": 40, "num_experts_per_tok": 1,
        "num_hidden_layers": 48, "num_key_value_heads": 8, "num_local_experts": 16,
        "output_router_logits": false, "pad_token_id": 200018, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
        "torch_dtype": "bfloat16", "use_cache": true, "use_qk_norm": true,
        "attn_temperature_tuning": 4, "floor_scale": 8192, "attn_scale": 0.1,
        "vocab_size": 202048
    },
    "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 1408}
}"#;

#[test]
fn reads_llama_4_scout_as_published() {
    use crate::model::config::{AttentionConfig, LayerAttention, Span};
    let c = ModelConfig::parse(LLAMA_4_SCOUT).unwrap();
    assert_eq!(
        (c.family, c.model_type.as_str()),
        (Family::Llama4, "llama4")
    );
    assert!(c.moe_layers.iter().all(|&m| m));
    assert_eq!((c.moe.num_experts, c.moe.top_k), (16, 1));
    assert!(c.moe.weight_input);
    assert_eq!(c.moe.shared_intermediate_size, 8192);
    assert_eq!(c.intermediate_size, 16384);
    let AttentionConfig::Gqa {
        layers, interleave, ..
    } = &c.attention
    else {
        panic!("{:?}", c.attention)
    };
    assert!(interleave);
    // Every fourth layer has no rope and sees everything.
    assert_eq!(
        layers[3],
        LayerAttention {
            rope: false,
            span: Span::Full,
            unit_qk_norm: false,
            temperature: layers[3].temperature,
        }
    );
    assert!(layers[3].temperature.is_some());
    assert_eq!(layers[0].span, Span::Chunk(8192));
    assert!(layers[0].unit_qk_norm && layers[0].temperature.is_none());
    assert_eq!(layers.iter().filter(|l| l.rope).count(), 36);
    // Scout publishes equal low and high frequency factors (no ramp); below is refused.
    let text = LLAMA_4_SCOUT.replace(r#""high_freq_factor": 1.0"#, r#""high_freq_factor": 0.5"#);
    let err = ModelConfig::parse(&text).unwrap_err();
    assert!(
        err.iter().any(|m| m.contains("high_freq_factor")),
        "{err:?}"
    );
}

#[test]
fn llama4_names_wrong_length_layer_lists_and_unknown_layer_types() {
    let mut v: serde_json::Value = serde_json::from_str(LLAMA_4_SCOUT).unwrap();
    v["text_config"]["layer_types"] = serde_json::json!(["full_attention", "sliding"]);
    v["text_config"]["no_rope_layers"] = serde_json::json!([1, 0, 1]);
    let err = ModelConfig::parse(&v.to_string()).unwrap_err();
    for needle in [
        "layer_types has 2 entries for 48 layers",
        "layer_types: unknown `sliding`",
        "no_rope_layers has 3 entries for 48 layers",
    ] {
        assert!(err.iter().any(|m| m.contains(needle)), "{needle}: {err:?}");
    }
}

/// gpt-oss-20b's config.json as published (openai/gpt-oss-20b), its MXFP4 experts' method
/// left out (the bf16 release's form).
const GPT_OSS_20B: &str = r#"{
    "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention",
    "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    "sliding_attention", "full_attention"], "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "output_router_logits": false, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": false},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0",
    "use_cache": true, "vocab_size": 201088
}"#;

#[test]
fn reads_gpt_oss_as_published() {
    use crate::model::config::{AttentionConfig, ExpertActivation, GatingConfig, Span};
    let c = ModelConfig::parse(GPT_OSS_20B).unwrap();
    assert_eq!(c.family, Family::GptOss);
    let AttentionConfig::Gqa {
        layers,
        sinks,
        o_bias,
        bias,
        ..
    } = &c.attention
    else {
        panic!("{:?}", c.attention)
    };
    assert!(*sinks && *o_bias && *bias);
    assert_eq!(layers[0].span, Span::Window(128));
    assert_eq!(layers[1].span, Span::Full);
    assert_eq!((c.moe.num_experts, c.moe.top_k), (32, 4));
    assert_eq!(c.moe.gating, GatingConfig::Softmax { renormalize: true });
    assert_eq!(
        c.moe.activation,
        ExpertActivation::ClampedSwiglu {
            alpha: 1.702,
            limit: 7.0
        }
    );
    let (prefix, fused) = Family::GptOss.fused_experts(3).unwrap();
    assert_eq!(prefix, "model.layers.3.mlp.experts");
    assert!(fused.interleaved && fused.bias);
    assert_eq!(Family::GptOss.router(3), "model.layers.3.mlp.router");

    // The MXFP4 release is read (its experts widened as they load); a wrong-length
    // layer_types, an unknown layer type, naming the key.
    let mut v: serde_json::Value = serde_json::from_str(GPT_OSS_20B).unwrap();
    v["quantization_config"] = serde_json::json!({"quant_method": "mxfp4"});
    let c = ModelConfig::parse(&v.to_string()).unwrap();
    assert_eq!(c.quantization, crate::model::quant::Quantization::Mxfp4);
    v["layer_types"] = serde_json::json!(["sliding_attention", "chunked"]);
    let err = ModelConfig::parse(&v.to_string()).unwrap_err();
    for needle in [
        "layer_types has 2 entries for 24 layers",
        "layer_types: unknown `chunked`",
    ] {
        assert!(err.iter().any(|m| m.contains(needle)), "{needle}: {err:?}");
    }
}

/// Qwen3-Next-80B-A3B-Instruct's config.json as published (Qwen/Qwen3-Next-80B-A3B-Instruct).
const QWEN3_NEXT_80B: &str = r#"{
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": true,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
    "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": false,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": null,
    "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936
}"#;

#[test]
fn reads_qwen3_next_as_published() {
    use crate::model::config::{AttentionConfig, GatingConfig};
    let c = ModelConfig::parse(QWEN3_NEXT_80B).unwrap();
    assert_eq!(c.family, Family::Qwen3Next);
    assert!(matches!(
        c.attention,
        AttentionConfig::Gqa {
            num_kv_heads: 2,
            head_dim: 256,
            qk_norm: QkNorm::PerHead,
            output_gate: true,
            ..
        }
    ));
    assert_eq!(c.rope.dim, 64, "a quarter of 256");
    assert_eq!(c.rope.theta, 1e7);
    let linear = c.linear_attention.as_ref().unwrap();
    assert_eq!(linear.count(), 36, "three of every four layers");
    assert!(linear.is_linear(0) && !linear.is_linear(3));
    assert!(linear.fused_projections);
    assert!(c.centered_norms);
    assert!(c.moe_layers.iter().all(|&m| m));
    assert_eq!(c.moe.shared_intermediate_size, 512);
    assert!(c.moe.shared_expert_gate);
    assert_eq!(c.moe.gating, GatingConfig::Softmax { renormalize: true });
    // 32 heads of 128 x 128, and a window of 3 of the 8192 convolved channels, per layer.
    assert_eq!(linear.state_floats(), 32 * 128 * 128 + 3 * 8192);
}

#[test]
fn reads_the_qwen3_5_moe_wrapper_and_its_text_config() {
    let mut text: serde_json::Value = serde_json::from_str(QWEN3_NEXT_80B).unwrap();
    text["model_type"] = "qwen3_5_moe_text".into();
    text["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e7,
        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": true});
    text["mlp_only_layers"] = serde_json::json!([0]);
    text["norm_topk_prob"] = false.into();
    let wrapper = serde_json::json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": text, "vision_config": {"model_type": "qwen3_5_moe", "depth": 27},
    });
    let c = ModelConfig::parse(&wrapper.to_string()).unwrap();
    assert_eq!(c.model_type, "qwen3_5_moe");
    assert_eq!(c.family, Family::Qwen3Next);
    assert!(!c.linear_attention.as_ref().unwrap().fused_projections);
    // Every Qwen3.5 layer is MoE and its router always renormalises.
    assert!(c.moe_layers.iter().all(|&m| m));
    assert_eq!(
        c.moe.gating,
        crate::model::config::GatingConfig::Softmax { renormalize: true }
    );
}

#[test]
fn qwen3_next_names_bad_layer_types_and_heads_that_do_not_divide() {
    let mut v: serde_json::Value = serde_json::from_str(QWEN3_NEXT_80B).unwrap();
    v["layer_types"] = serde_json::json!(["linear_attention", "full_attention"]);
    v["linear_num_value_heads"] = 24.into();
    v["linear_num_key_heads"] = 16.into();
    v["partial_rotary_factor"] = 0.0.into();
    let err = ModelConfig::parse(&v.to_string()).unwrap_err();
    for needle in [
        "layer_types has 2 entries for 48 layers",
        "linear_num_value_heads (24) must be a multiple of linear_num_key_heads (16)",
        "partial_rotary_factor",
    ] {
        assert!(err.iter().any(|m| m.contains(needle)), "{needle}: {err:?}");
    }
    v["layer_types"] = serde_json::json!(vec!["sliding_attention"; 48]);
    v["linear_num_key_heads"] = 0.into();
    let err = ModelConfig::parse(&v.to_string()).unwrap_err();
    assert!(
        err.iter()
            .any(|m| m.contains("unknown `sliding_attention`")),
        "{err:?}"
    );
    assert!(
        err.iter().any(|m| m.contains("linear_num_key_heads")),
        "{err:?}"
    );
}
