//! The recurrent form against itself cut in other places: a prompt in one segment, in
//! chunks, and token by token give the same outputs and the same state, and sequences in
//! one batch do not see each other's state.

use super::*;
use crate::compute::cpu::Linear;
use crate::model::ModelConfig;
use crate::model::weights::{RmsNorm, StoredLinear};

fn config() -> LinearAttention {
    LinearAttention {
        num_key_heads: 2,
        num_value_heads: 4,
        key_head_dim: 8,
        value_head_dim: 4,
        conv_kernel: 4,
        layers: vec![true],
        fused_projections: false,
    }
}

/// Deterministic values in [-scale, scale).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn linear(out: usize, inp: usize, seed: u64) -> StoredLinear {
    StoredLinear::F32(Linear::without_bias(values(out * inp, seed, 0.5), out, inp))
}

const HIDDEN: usize = 12;

fn weights(la: &LinearAttention) -> LinearAttentionWeights {
    let heads = la.num_value_heads;
    LinearAttentionWeights {
        qkv: linear(la.conv_dim(), HIDDEN, 1),
        z: linear(la.value_dim(), HIDDEN, 2),
        b: linear(heads, HIDDEN, 3),
        a: linear(heads, HIDDEN, 4),
        conv: values(la.conv_dim() * la.conv_kernel, 5, 0.8),
        dt_bias: values(heads, 6, 1.0),
        decay_scale: values(heads, 7, 1.0).iter().map(|v| -v.exp()).collect(),
        norm: RmsNorm {
            weight: values(la.value_head_dim, 8, 1.0),
            eps: 1e-6,
        },
        out: linear(HIDDEN, la.value_dim(), 9),
    }
}

fn cache(la: &LinearAttention) -> KvCache {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_next");
    let mut cfg = ModelConfig::load(&dir).unwrap();
    cfg.linear_attention = Some(la.clone());
    cfg.num_layers = 1;
    KvCache::new(&cfg)
}

/// Runs `pieces` of `x` one step each on a fresh cache; returns every output row and the
/// final cache.
fn run_in_pieces(la: &LinearAttention, x: &[f32], pieces: &[usize]) -> (Vec<f32>, KvCache) {
    let w = weights(la);
    let mut cache = cache(la);
    let mut out = Vec::new();
    let mut at = 0;
    for &rows in pieces {
        let segments = [Segment {
            rows: 0..rows,
            start_position: cache.len(),
        }];
        let piece = &x[at * HIDDEN..(at + rows) * HIDDEN];
        out.extend(linear_attention(
            &w,
            la,
            (0, 1e-6),
            piece,
            rows,
            &segments,
            &mut [&mut cache],
        ));
        cache.advance(rows);
        at += rows;
    }
    (out, cache)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn a_prompt_at_once_in_chunks_and_token_by_token_agree() {
    let la = config();
    let x = values(11 * HIDDEN, 10, 1.0);
    let (whole, whole_cache) = run_in_pieces(&la, &x, &[11]);
    for pieces in [&[4, 4, 3][..], &[1; 11][..], &[2, 9][..]] {
        let (parts, parts_cache) = run_in_pieces(&la, &x, pieces);
        assert!(max_diff(&whole, &parts) < 1e-5, "{pieces:?}");
        let (a, b) = (
            whole_cache.layers[0].linear.as_ref().unwrap(),
            parts_cache.layers[0].linear.as_ref().unwrap(),
        );
        assert!(max_diff(&a.recurrent, &b.recurrent) < 1e-5, "{pieces:?}");
        assert!(max_diff(&a.conv, &b.conv) < 1e-5, "{pieces:?}");
    }
    let state_floats = la.state_floats();
    assert_eq!(whole_cache.bytes(), state_floats * 4);
}

#[test]
fn sequences_in_one_batch_keep_their_own_state_and_a_failed_step_leaves_none() {
    let la = config();
    let w = weights(&la);
    let (x, y) = (values(5 * HIDDEN, 11, 1.0), values(3 * HIDDEN, 12, 1.0));
    let (alone_x, _) = run_in_pieces(&la, &x, &[5]);
    let (alone_y, _) = run_in_pieces(&la, &y, &[3]);
    let (mut cx, mut cy) = (cache(&la), cache(&la));
    let both: Vec<f32> = x.iter().chain(&y).copied().collect();
    let segments = [
        Segment {
            rows: 0..5,
            start_position: 0,
        },
        Segment {
            rows: 5..8,
            start_position: 0,
        },
    ];
    let out = linear_attention(
        &w,
        &la,
        (0, 1e-6),
        &both,
        8,
        &segments,
        &mut [&mut cx, &mut cy],
    );
    assert!(max_diff(&out[..5 * HIDDEN], &alone_x) < 1e-5);
    assert!(max_diff(&out[5 * HIDDEN..], &alone_y) < 1e-5);
    // Not advanced: the step's state is dropped and the cache is as new.
    cx.rollback();
    let state = cx.layers[0].linear.as_ref().unwrap();
    assert!(state.next.is_none() && state.recurrent.is_empty());
}

#[test]
fn a_hybrid_model_counts_positions_only_in_its_full_layers_and_a_fixed_state_beside() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_next");
    let cfg = ModelConfig::load(&dir).unwrap();
    let la = cfg.linear_attention.clone().unwrap();
    // Two full layers of 2 kv heads of 16, keys and values; two linear layers' states.
    assert_eq!(KvCache::bytes_per_position(&cfg), 2 * 2 * 2 * 16 * 4);
    assert_eq!(KvCache::state_bytes(&cfg), 2 * la.state_floats() * 4);
    let cache = KvCache::new(&cfg);
    assert!(cache.has_state() && cache.can_truncate_to(0) && cache.bytes() == 0);
}

/// A head's random inputs over `n` tokens as the layer would gather them: unit keys, scaled
/// unit queries, decays from none to strong (`exp(g)` down to about 0.05), any beta.
fn head_inputs(la: &LinearAttention, n: usize, seed: u64) -> HeadInputs {
    let (hk, hv) = (la.key_head_dim, la.value_head_dim);
    let mut q = values(n * hk, seed, 1.0);
    let mut k = values(n * hk, seed + 1, 1.0);
    for t in 0..n {
        l2_normalize(&mut q[t * hk..(t + 1) * hk], (hk as f32).powf(-0.5));
        l2_normalize(&mut k[t * hk..(t + 1) * hk], 1.0);
    }
    let g = values(n, seed + 2, 1.5);
    let beta = values(n, seed + 3, 1.0);
    HeadInputs {
        index: 1,
        q,
        k,
        v: values(n * hv, seed + 4, 2.0),
        gates: g
            .iter()
            .zip(&beta)
            .map(|(&g, &b)| (-(g + 1.5), sigmoid(4.0 * b)))
            .collect(),
    }
}

fn relative(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    max_diff(a, b) / scale
}

/// The chunked form against the recurrent one on random inputs: within a block, exactly one,
/// across several and a partial last one, from a zero state and from a random one.
#[test]
fn the_chunked_form_gives_the_recurrent_forms_outputs_and_state() {
    let la = LinearAttention {
        key_head_dim: 32,
        value_head_dim: 16,
        ..config()
    };
    let size = la.num_value_heads * la.key_head_dim * la.value_head_dim;
    for (n, seed) in [
        (1, 20),
        (CHUNK - 3, 21),
        (CHUNK, 22),
        (CHUNK + 1, 23),
        (9 * CHUNK - 5, 24),
    ] {
        let head = head_inputs(&la, n, seed);
        for state in [Vec::new(), values(size, seed + 9, 0.5)] {
            let (s_rec, o_rec) = head_recurrence(&la, &head, &state);
            let (s_chunk, o_chunk) = head_chunked(&la, &head, &state);
            let (o, s) = (relative(&o_chunk, &o_rec), relative(&s_chunk, &s_rec));
            assert!(o < 1e-5 && s < 1e-5, "{n} tokens: outputs {o}, state {s}");
        }
    }
}

/// Both forms timed on Qwen3.5's head (keys and values of 128) per segment length, to choose
/// [`CHUNKED_FROM`]: `cargo test --release --lib chunked_and_recurrent -- --ignored --nocapture`.
#[test]
#[ignore = "timing, run by hand"]
fn chunked_and_recurrent_forms_timed() {
    let la = LinearAttention {
        key_head_dim: 128,
        value_head_dim: 128,
        ..config()
    };
    println!(
        "{:>6} {:>14} {:>14}",
        "tokens", "recurrent us", "chunked us"
    );
    for n in [1, 2, 4, 8, 16, 32, 64, 512] {
        let head = head_inputs(&la, n, 30);
        let time = |f: &dyn Fn() -> (Vec<f32>, Vec<f32>)| {
            let mut times: Vec<f64> = (0..21)
                .map(|_| {
                    let started = std::time::Instant::now();
                    std::hint::black_box(f());
                    started.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            times.sort_by(f64::total_cmp);
            times[10]
        };
        let recurrent = time(&|| head_recurrence(&la, &head, &[]));
        let chunked = time(&|| head_chunked(&la, &head, &[]));
        println!("{n:>6} {recurrent:>14.1} {chunked:>14.1}");
    }
}
