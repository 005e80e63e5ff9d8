use serde_json::{Value, json};

use super::*;
use crate::model::ModelConfig;
use crate::model::config::Family;

fn fixture(name: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
        .join("config.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn parse(config: &Value) -> Result<ModelConfig, Vec<String>> {
    ModelConfig::parse(&config.to_string())
}

fn v4(config: &Value) -> DeepseekV4 {
    *parse(config).unwrap().deepseek_v4.unwrap()
}

#[test]
fn the_tiny_fixture_reads_every_part_as_transformers_does() {
    let config = parse(&fixture("deepseek_v4")).unwrap();
    assert_eq!(config.family, Family::DeepseekV4);
    assert_eq!(config.moe.num_experts, 8);
    assert_eq!(config.moe.top_k, 2);
    assert_eq!(config.moe_layers, vec![true; 4]);
    let v4 = config.deepseek_v4.unwrap();
    use V4LayerKind::*;
    assert_eq!(v4.layers, vec![Sliding, Csa, Hca, Csa]);
    // `compress_ratios` 128 names the HCA kind; its rate is `compress_rate_hca`.
    assert_eq!((v4.ratio(0), v4.ratio(1), v4.ratio(2)), (0, 4, 8));
    assert_eq!((v4.head_dim, v4.rope_dim, v4.q_lora_rank), (32, 8, 24));
    assert_eq!((v4.o_groups, v4.o_lora_rank, v4.sliding_window), (2, 16, 6));
    assert_eq!(
        (v4.index_n_heads, v4.index_head_dim, v4.index_topk),
        (16, 16, 2)
    );
    assert_eq!(v4.hash_layers, 2);
    assert!(v4.is_hash_layer(1) && !v4.is_hash_layer(2));
    assert!(v4.sqrt_softplus);
    assert_eq!((v4.swiglu_limit, v4.routed_scaling_factor), (0.6, 1.5));
    assert_eq!((v4.hc_mult, v4.hc_sinkhorn_iters), (3, 20));
    assert_eq!(v4.main_rope.theta, 10_000.0);
    assert_eq!(v4.main_rope.scaling, RopeScaling::None);
    assert_eq!(v4.compress_rope.theta, 160_000.0);
    assert!(matches!(
        v4.compress_rope.scaling,
        RopeScaling::Yarn { factor, attention_factor: Some(a), .. } if factor == 4.0 && a == 1.0
    ));
}

#[test]
fn the_published_pro_and_flash_configs_read() {
    let pro = parse(&fixture("deepseek_v4_pro")).unwrap();
    assert_eq!((pro.moe.num_experts, pro.moe.top_k), (384, 6));
    let v4 = pro.deepseek_v4.unwrap();
    assert_eq!(v4.layers.len(), 61);
    assert!(v4.ue8m0_scales);
    assert_eq!(v4.expert_dtype, Some(V4ExpertDtype::Fp4));
    // YaRN only on the compressed layers, with its magnitude factor fixed at 1.
    assert!(matches!(
        v4.compress_rope.scaling,
        RopeScaling::Yarn { factor, attention_factor: Some(a), .. } if factor == 16.0 && a == 1.0
    ));
    assert_eq!(v4.main_rope.scaling, RopeScaling::None);
    let flash = parse(&fixture("deepseek_v4_flash")).unwrap();
    assert_eq!((flash.moe.num_experts, flash.hidden_size), (256, 4096));
    assert_eq!(flash.deepseek_v4.unwrap().layers.len(), 43);
}

#[test]
fn transformers_style_keys_read_as_the_published_ones() {
    let mut config = fixture("deepseek_v4");
    let published = v4(&config);
    let object = config.as_object_mut().unwrap();
    object.remove("compress_ratios");
    object.remove("num_hash_layers");
    object.remove("compress_rate_csa");
    object.remove("compress_rate_hca");
    object.insert(
        "layer_types".into(),
        json!([
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention"
        ]),
    );
    object.insert(
        "mlp_layer_types".into(),
        json!(["hash_moe", "hash_moe", "moe", "moe"]),
    );
    object.insert(
        "compress_rates".into(),
        json!({"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}),
    );
    assert_eq!(v4(&config), published);
}

/// Every bad value is named, all at once, and nothing panics.
#[test]
fn bad_input_is_a_clear_error() {
    let with = |key: &str, value: Value| {
        let mut config = fixture("deepseek_v4");
        config[key] = value;
        parse(&config).unwrap_err()
    };
    let has = |errors: &[String], text: &str| {
        assert!(
            errors.iter().any(|e| e.contains(text)),
            "{text}: {errors:?}"
        );
    };
    has(
        &with("compress_ratios", json!([0, 4])),
        "compress_ratios has 2 entries",
    );
    has(
        &with("compress_ratios", json!([0, 4, 4, 4, 4, 4, 4])),
        "compress_ratios has 7",
    );
    has(
        &with("compress_ratios", json!([0, 4, 8, 4])),
        "8 is not a layer kind",
    );
    has(&with("index_topk", json!(0)), "index_topk");
    has(
        &with("scoring_func", json!("softmax")),
        "scoring_func `softmax`",
    );
    has(&with("n_group", json!(8)), "no expert groups");
    has(&with("num_key_value_heads", json!(8)), "one key-value head");
    has(&with("num_attention_heads", json!(5)), "o_groups");
    has(&with("num_hash_layers", json!(9)), "num_hash_layers (9)");
    has(&with("expert_dtype", json!("int3")), "expert_dtype `int3`");
    has(&with("scale_fmt", json!("e5m2")), "scale_fmt `e5m2`");
    has(&with("qk_rope_head_dim", json!(7)), "qk_rope_head_dim (7)");
    has(&with("hc_mult", json!(0)), "hc_mult");
    has(&with("compress_ratios", json!("four")), "cannot read it");
    // A longer list is accepted where the extra entries are the MTP layers'.
    let mut config = fixture("deepseek_v4");
    config["compress_ratios"] = json!([0, 4, 128, 4, 0]);
    config["num_nextn_predict_layers"] = json!(1);
    assert_eq!(v4(&config).layers.len(), 4);
}

/// DeepSeek-V4-Pro's parts as published, counted by hand: its experts in MXFP4, its caches
/// per position (29 CSA layers of (512 + 128) / 4 floats and 32 HCA layers of 512 / 128).
#[test]
fn pro_sizes_count_mxfp4_experts_and_compressed_caches() {
    let pro = parse(&fixture("deepseek_v4_pro")).unwrap();
    let v4 = pro.deepseek_v4.as_ref().unwrap();
    let shape = V4Shape {
        vocab: 129280,
        hidden: 7168,
        heads: 128,
        experts: 384,
        top_k: 6,
        expert_intermediate: 3072,
        shared_intermediate: 3072,
    };
    let per_matrix = 7168 * 3072 / 2 + 7168 * 3072 / 32;
    assert_eq!(v4.expert_bytes(&shape), 3 * per_matrix);
    let csa = v4.layers.iter().filter(|k| **k == V4LayerKind::Csa).count();
    let hca = v4.layers.iter().filter(|k| **k == V4LayerKind::Hca).count();
    assert_eq!((csa, hca), (29, 32));
    assert_eq!(
        v4.cache_bytes_per_position(),
        4 * (29 * (512 + 128) / 4 + 32 * 512 / 128)
    );
    // The dense part: 28.65 GB, 18.3 of them the attention's FP8 projections (about 300 MB a
    // layer), 4.0 the shared experts', 3.7 the bf16 embeddings and head.
    let dense = v4.dense_bytes(&shape);
    assert!((28.5e9..28.8e9).contains(&(dense as f64)), "{dense}");
}
