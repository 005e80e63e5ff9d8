use std::path::Path;

use super::*;
use crate::engine::Engine;

fn engine() -> Engine {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4");
    Engine::load(&dir).unwrap()
}

/// The logits after the last of `tokens`, fed after `cache`.
fn forward(engine: &Engine, cache: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
    let mut logits = engine.forward(&mut [SequenceStep::new(cache, tokens)])?;
    Ok(logits.pop().unwrap_or_default())
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m })
}

/// A prompt fed in pieces (windows left unfinished between them, the compressors' overlap
/// carried across) gives what it gives fed whole, and the cache holds what it says.
#[test]
fn a_prompt_in_pieces_equals_it_whole() {
    let engine = engine();
    let prompt = [3u32, 17, 42, 7, 99, 1, 64, 23, 5, 88, 12, 9, 4];
    let mut whole = engine.new_cache();
    let expected = forward(&engine, &mut whole, &prompt).unwrap();
    let mut pieces = engine.new_cache();
    let mut got = Vec::new();
    for piece in [&prompt[..3], &prompt[3..9], &prompt[9..10], &prompt[10..]] {
        got = forward(&engine, &mut pieces, piece).unwrap();
    }
    let diff = max_difference(&got, &expected);
    assert!(diff < 1e-4, "pieces differ from whole by {diff}");
    assert_eq!(pieces.len(), prompt.len());
    // 13 positions: windows of 5 rows of 32 on each of the 4 layers, 3 CSA entries and
    // 3 indexer keys on 2 layers, 1 HCA entry, and the unfinished windows.
    assert_eq!(whole.bytes(), pieces.bytes());
    assert!(whole.bytes() >= 4 * (4 * 5 * 32 + 2 * 3 * (32 + 16) + 32));
}

/// Every position's logits (a prompt's log probabilities) are each those of the prompt cut
/// there; the last is the one a step returns by default.
#[test]
fn all_logits_are_each_prefix_s_last() {
    let engine = engine();
    let prompt = [3u32, 17, 42, 7, 99, 1, 64, 23, 5];
    let vocab = engine.config().vocab_size;
    let mut cache = engine.new_cache();
    let mut step = [SequenceStep::new(&mut cache, &prompt)];
    step[0].all_logits = true;
    let all = engine.forward(&mut step).unwrap().pop().unwrap();
    assert_eq!(all.len(), prompt.len() * vocab);
    for n in [1, 5, prompt.len()] {
        let mut cache = engine.new_cache();
        let last = forward(&engine, &mut cache, &prompt[..n]).unwrap();
        let diff = max_difference(&all[(n - 1) * vocab..n * vocab], &last);
        assert!(diff < 1e-4, "position {n}: {diff}");
    }
}

/// Bad input is an error, and the cache is left as it was; a cache made for another model
/// is refused.
#[test]
fn bad_tokens_and_foreign_caches_are_refused_and_leave_the_cache() {
    let engine = engine();
    let mut cache = engine.new_cache();
    forward(&engine, &mut cache, &[1, 2]).unwrap();
    let bytes = cache.bytes();
    let err = forward(&engine, &mut cache, &[5, 128]).unwrap_err();
    assert!(err.to_string().contains("token id 128"), "{err}");
    assert!(matches!(
        forward(&engine, &mut cache, &[]),
        Err(EngineError::EmptyPrompt)
    ));
    assert_eq!((cache.len(), cache.bytes()), (2, bytes));
    let mut other = engine.config().clone();
    other.deepseek_v4 = None;
    let mut foreign = KvCache::new(&other);
    assert!(matches!(
        forward(&engine, &mut foreign, &[1]),
        Err(EngineError::ForeignCache)
    ));
}

/// What `plan` and admission count for a sequence (a fixed part and a part per position) is
/// never less than what its cache holds.
#[test]
fn the_planned_bytes_bound_what_a_cache_holds() {
    let engine = engine();
    let cfg = engine.config();
    let v4 = cfg.deepseek_v4.as_ref().unwrap();
    assert_eq!(
        KvCache::bytes_per_position(cfg) as u64,
        v4.cache_bytes_per_position()
    );
    assert_eq!(
        KvCache::state_bytes(cfg) as u64,
        v4.cache_bytes_per_sequence()
    );
    let mut cache = engine.new_cache();
    for (n, token) in (0..70u32).enumerate() {
        forward(&engine, &mut cache, &[token % 128]).unwrap();
        let planned = KvCache::state_bytes(cfg) + (n + 1) * KvCache::bytes_per_position(cfg);
        assert!(
            cache.bytes() <= planned,
            "{n}: {} > {planned}",
            cache.bytes()
        );
    }
    // Past the windows, the per-position part is what grows: 70 positions hold 17 CSA entries
    // and indexer keys on 2 layers and 8 HCA entries.
    assert!(cache.bytes() >= 4 * (2 * 17 * (32 + 16) + 8 * 32));
    cache.release();
    assert_eq!((cache.len(), cache.bytes()), (0, 0));
}

/// Sequences stepped together (their rows through one gate and one expert dispatch) give what
/// each gives alone, prefill and decode mixed.
#[test]
fn a_batch_equals_each_sequence_alone() {
    let engine = engine();
    let (a, b) = ([3u32, 17, 42, 7, 99, 1, 64, 23, 5], [88u32, 12, 9]);
    let mut alone = Vec::new();
    for prompt in [&a[..], &b[..]] {
        let mut cache = engine.new_cache();
        forward(&engine, &mut cache, &prompt[..prompt.len() - 1]).unwrap();
        alone.push(forward(&engine, &mut cache, &prompt[prompt.len() - 1..]).unwrap());
    }
    let (mut ca, mut cb) = (engine.new_cache(), engine.new_cache());
    forward(&engine, &mut ca, &a[..a.len() - 1]).unwrap();
    // b prefills while a decodes.
    let together = engine
        .forward(&mut [
            SequenceStep::new(&mut ca, &a[a.len() - 1..]),
            SequenceStep::new(&mut cb, &b[..]),
        ])
        .unwrap();
    for (got, want) in together.iter().zip(&alone) {
        let diff = max_difference(got, want);
        assert!(diff < 1e-5, "batched differs by {diff}");
    }
    assert_eq!((ca.len(), cb.len()), (a.len(), b.len()));
}
