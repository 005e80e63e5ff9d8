use super::*;
use crate::compute::cpu::Linear;
use crate::engine::attention::Segment;
use crate::engine::rope::Rope;
use crate::model::config::{AttentionConfig, ModelConfig, RopeConfig, RopeScaling};
use crate::model::weights::StoredLinear;

#[test]
fn a_sequence_no_longer_than_topk_attends_to_every_position() {
    assert_eq!(top_positions(&[], 2), None);
    assert_eq!(top_positions(&[1.0], 2), None);
    assert_eq!(top_positions(&[-3.0, 5.0], 2), None);
    assert_eq!(top_positions(&[-3.0, 5.0, 0.5], 3), None);
}

#[test]
fn the_best_topk_positions_are_chosen_in_position_order() {
    assert_eq!(
        top_positions(&[0.5, 3.0, -1.0, 2.0, 0.0], 2),
        Some(vec![1, 3])
    );
    assert_eq!(
        top_positions(&[0.5, 3.0, -1.0, 2.0, 0.0], 4),
        Some(vec![0, 1, 3, 4])
    );
    assert_eq!(top_positions(&[-1.0, -2.0, -0.5], 1), Some(vec![2]));
}

#[test]
fn ties_at_the_boundary_go_to_the_earlier_position() {
    assert_eq!(
        top_positions(&[1.0, 0.0, 1.0, 0.0, 1.0], 2),
        Some(vec![0, 2])
    );
    // Scores the relu cut to 0 on every head tie: the earlier of them is taken, and -0
    // equals 0.
    assert_eq!(
        top_positions(&[1.0, -0.0, 2.0, 0.0, -1.0], 3),
        Some(vec![0, 1, 2])
    );
    assert_eq!(
        top_positions(&[1.0, 0.0, 2.0, -0.0, -1.0], 3),
        Some(vec![0, 1, 2])
    );
}

#[test]
fn the_mask_removes_the_positions_not_chosen_up_to_the_rows_own() {
    let selection = Selection {
        rows: vec![None, Some(vec![0, 2])],
        seen: vec![1, 4],
    };
    let mut all = vec![1.0; 3];
    selection.mask(0, &mut all);
    assert_eq!(
        all,
        vec![1.0; 3],
        "a row without a choice keeps every score"
    );
    let mut scores = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    selection.mask(1, &mut scores);
    let ninf = f32::NEG_INFINITY;
    // Positions 4 and 5 come after the row's own (3): the causal mask's, left as they are.
    assert_eq!(scores, vec![1.0, ninf, 3.0, ninf, 5.0, 6.0]);
}

/// One layer of a tiny DeepSeek-V3.2 (indexer of one head of 4 values, `index_topk` 2).
const TINY: &str = r#"{"model_type": "deepseek_v32", "vocab_size": 16, "hidden_size": 4,
    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 4,
    "q_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2,
    "index_n_heads": 1, "index_head_dim": 4, "index_topk": 2}"#;

fn identity(n: usize) -> Vec<f32> {
    (0..n * n)
        .map(|i| if i % (n + 1) == 0 { 1.0 } else { 0.0 })
        .collect()
}

/// Keys that are their inputs (identity `wk`, a LayerNorm that leaves mean-0, variance-1
/// rows as they are, no rotation), queries that are `q_low`, head weight `x[0]` (1 here).
fn select_tiny(xs: &[[f32; 4]], query: [f32; 4]) -> Selection {
    let config = ModelConfig::parse(TINY).unwrap();
    let AttentionConfig::Mla {
        indexer: Some(indexer),
        ..
    } = &config.attention
    else {
        panic!("no indexer in {:?}", config.attention)
    };
    let weights = IndexerWeights {
        wq_b: StoredLinear::F32(Linear::without_bias(identity(4), 4, 4)),
        wk: StoredLinear::F32(Linear::without_bias(identity(4), 4, 4)),
        k_norm_weight: vec![1.0; 4],
        k_norm_bias: vec![0.0; 4],
        weights_proj: Linear::without_bias(vec![1.0, 0.0, 0.0, 0.0], 1, 4),
    };
    // No rotary dimensions: rope leaves the keys and queries alone.
    let rope = Rope::new(
        &RopeConfig {
            theta: 10_000.0,
            dim: 0,
            scaling: RopeScaling::None,
        },
        false,
    );
    let rows = xs.len();
    let angles: Vec<_> = (0..rows).map(|p| rope.angles(p)).collect();
    let segments = [Segment {
        rows: 0..rows,
        start_position: 0,
    }];
    let input = AttentionInput {
        config: &config.attention,
        num_heads: 1,
        softmax_scale: 1.0,
        unit_norm_eps: 1e-6,
        rope: &rope,
        angles: &angles,
        segments: &segments,
    };
    let x: Vec<f32> = xs.iter().flatten().copied().collect();
    let q_low: Vec<f32> = xs.iter().flat_map(|_| query).collect();
    let mut cache = KvCache::new(&config);
    let selection = select(
        (&weights, indexer),
        &input,
        0,
        (&x, &q_low),
        rows,
        &mut [&mut cache],
    );
    assert_eq!(
        cache.layers[0].indexer_keys.len(),
        rows * 4,
        "one key a row"
    );
    selection
}

#[test]
fn a_query_chooses_among_its_own_and_earlier_positions_only() {
    // q . k / sqrt(4) = [1, 2, 0, 2] and the relu keeps them: position 3 scores highest but
    // comes after row 2, which chooses among 0..=2; rows 0 and 1 see no more than 2.
    let xs = [
        [1.0, -1.0, 1.0, -1.0],
        [1.0, 1.0, -1.0, -1.0],
        [1.0, -1.0, -1.0, 1.0],
        [1.0, 1.0, -1.0, -1.0],
    ];
    let selection = select_tiny(&xs, [3.0, 2.0, 1.0, 0.0]);
    assert_eq!(
        selection.rows,
        vec![None, None, Some(vec![0, 1]), Some(vec![1, 3])]
    );
    assert_eq!(selection.seen, vec![1, 2, 3, 4]);
}

#[test]
fn negative_scores_are_cut_to_zero_before_the_heads_are_summed() {
    // q . k / 2 = [-1, 0, 1]: the relu makes it [0, 0, 1], so positions 0 and 1 tie and
    // the earlier is taken (without the relu, 1 would win over 0).
    let xs = [
        [1.0, -1.0, 1.0, -1.0],
        [1.0, 1.0, -1.0, -1.0],
        [1.0, -1.0, -1.0, 1.0],
    ];
    let selection = select_tiny(&xs, [0.0, 0.0, -1.0, 1.0]);
    assert_eq!(selection.rows[2], Some(vec![0, 2]));
}

#[test]
fn a_decode_row_attends_to_the_chosen_positions_only() {
    // Latents [1, 0], [0, 1], [1, 1]; position 2 is not chosen. Scores ln 3 and 0: weights
    // 3/4 and 1/4.
    let latents = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
    let mut out = [9.0; 2];
    let query = [3f32.ln(), 0.0];
    attend_chosen(&[0, 1], (&query, &[]), (&latents, &[]), 1.0, &mut out);
    assert!(
        (out[0] - 0.75).abs() < 1e-6 && (out[1] - 0.25).abs() < 1e-6,
        "{out:?}"
    );
    // The rotary part adds to the scores: with it position 1 scores ln 3 too.
    let rope_keys = [0.0, 1.0, 0.0];
    attend_chosen(
        &[0, 1],
        (&query, &[3f32.ln()]),
        (&latents, &rope_keys),
        1.0,
        &mut out,
    );
    assert!(
        (out[0] - 0.5).abs() < 1e-6 && (out[1] - 0.5).abs() < 1e-6,
        "{out:?}"
    );
}
