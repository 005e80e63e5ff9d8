use crate::model::ModelConfig;
use crate::model::config::{AttentionConfig, Family, LightningIndexer};

/// A small DeepSeek-V3.2 config with every key the indexer reads.
fn v32(changes: serde_json::Value) -> Result<ModelConfig, Vec<String>> {
    let mut config = serde_json::json!({
        "model_type": "deepseek_v32", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
        "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "kv_lora_rank": 32,
        "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "index_n_heads": 8, "index_head_dim": 16, "index_topk": 5
    });
    for (key, value) in changes.as_object().unwrap() {
        config[key] = value.clone();
    }
    ModelConfig::parse(&config.to_string())
}

fn indexer(config: &ModelConfig) -> &LightningIndexer {
    match &config.attention {
        AttentionConfig::Mla {
            indexer: Some(indexer),
            ..
        } => indexer,
        other => panic!("no indexer: {other:?}"),
    }
}

#[test]
fn deepseek_v32_reads_its_indexer_on_every_layer() {
    let c = v32(serde_json::json!({})).unwrap();
    assert_eq!(c.family, Family::DeepseekV32);
    assert_eq!(c.moe_layers, vec![false, true, true]);
    assert_eq!(
        *indexer(&c),
        LightningIndexer {
            num_heads: 8,
            head_dim: 16,
            topk: 5,
            rope_interleave: false,
            own: vec![true; 3],
        }
    );
    // `mlp_layer_types`, as transformers writes it, wins over first_k_dense_replace.
    let c = v32(serde_json::json!({"mlp_layer_types": ["sparse", "dense", "sparse"]})).unwrap();
    assert_eq!(c.moe_layers, vec![true, false, true]);
}

#[test]
fn bad_indexer_settings_are_each_named() {
    let cases = [
        (
            serde_json::json!({"index_topk": 0}),
            "`index_topk` must be greater than 0",
        ),
        (
            serde_json::json!({"index_n_heads": 0}),
            "`index_n_heads` must be greater than 0",
        ),
        (
            serde_json::json!({"index_head_dim": 0}),
            "`index_head_dim` (0) must be at least",
        ),
        (
            serde_json::json!({"index_head_dim": 4}),
            "`index_head_dim` (4) must be at least",
        ),
        (
            serde_json::json!({"q_lora_rank": null}),
            "needs `q_lora_rank`",
        ),
        (serde_json::json!({"index_topk": -1}), "cannot read it"),
        (
            serde_json::json!({"index_n_heads": 1_000_000}),
            "`index_n_heads` (1000000) exceeds",
        ),
        (
            serde_json::json!({"mlp_layer_types": ["dense", "sparse"]}),
            "mlp_layer_types has 2 entries for 3 layers",
        ),
    ];
    for (change, message) in cases {
        let err = v32(change.clone()).unwrap_err();
        assert!(
            err.iter().any(|m| m.contains(message)),
            "{change}: {message} not in {err:?}"
        );
    }
    // All at once.
    let err = v32(serde_json::json!({"index_topk": 0, "index_n_heads": 0})).unwrap_err();
    assert_eq!(err.len(), 2, "{err:?}");
}

#[test]
fn glm_5_shares_indexers_as_its_config_says() {
    let glm = |changes: serde_json::Value| {
        let mut changes = changes;
        changes["model_type"] = "glm_moe_dsa".into();
        changes["num_hidden_layers"] = 6.into();
        v32(changes)
    };
    let c = glm(serde_json::json!({})).unwrap();
    assert_eq!(c.family, Family::GlmMoeDsa);
    assert!(indexer(&c).rope_interleave);
    assert_eq!(
        indexer(&c).own,
        vec![true; 6],
        "every layer full by default"
    );
    let listed = glm(serde_json::json!({
        "indexer_types": ["full", "shared", "shared", "full", "shared", "full"]
    }))
    .unwrap();
    assert_eq!(
        indexer(&listed).own,
        vec![true, false, false, true, false, true]
    );
    assert_eq!(indexer(&listed).count(), 3);
    let pattern = glm(serde_json::json!({"index_topk_pattern": "FSSFSF"})).unwrap();
    assert_eq!(indexer(&pattern).own, indexer(&listed).own);
    // transformers' schedule: full where max(i - offset + 1, 0) % freq == 0.
    let schedule =
        glm(serde_json::json!({"index_topk_freq": 2, "index_skip_topk_offset": 2})).unwrap();
    assert_eq!(
        indexer(&schedule).own,
        vec![true, true, false, true, false, true]
    );
    for (change, message) in [
        (
            serde_json::json!({"indexer_types": ["shared", "full", "full", "full", "full", "full"]}),
            "the first layer must run its own indexer",
        ),
        (
            serde_json::json!({"index_topk_pattern": "FSX"}),
            "indexer_types has 3 entries",
        ),
        (
            serde_json::json!({"index_topk_pattern": "FSXFFF"}),
            "unknown `X`",
        ),
        (
            serde_json::json!({"index_topk_pattern": 3}),
            "`index_topk_pattern` must be",
        ),
    ] {
        let err = glm(change.clone()).unwrap_err();
        assert!(
            err.iter().any(|m| m.contains(message)),
            "{change}: {message} not in {err:?}"
        );
    }
}

#[test]
fn serving_fewer_layers_keeps_their_indexers_only() {
    let c = v32(serde_json::json!({})).unwrap().with_layers(2).unwrap();
    assert_eq!(indexer(&c).own, vec![true; 2]);
}
