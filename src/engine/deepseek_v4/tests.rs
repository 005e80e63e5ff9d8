use super::*;

fn fixture() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4")
}

/// A prompt fed in pieces (windows left unfinished between them, the compressors' overlap
/// carried across) gives what it gives fed whole, and the cache holds what it says.
#[test]
fn a_prompt_in_pieces_equals_it_whole() {
    let model = DeepseekV4Model::load(&fixture()).unwrap();
    let prompt = [3u32, 17, 42, 7, 99, 1, 64, 23, 5, 88, 12, 9, 4];
    let mut whole = model.new_cache();
    let expected = model.forward(&mut whole, &prompt).unwrap();
    let mut pieces = model.new_cache();
    let mut got = Vec::new();
    for piece in [&prompt[..3], &prompt[3..9], &prompt[9..10], &prompt[10..]] {
        got = model.forward(&mut pieces, piece).unwrap();
    }
    let diff = got
        .iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(diff < 1e-4, "pieces differ from whole by {diff}");
    assert_eq!(pieces.len(), prompt.len());
    // 13 positions: windows of 5 rows of 32 on each of the 4 layers, 3 CSA entries and
    // 3 indexer keys on 2 layers, 1 HCA entry, and the unfinished windows.
    assert_eq!(whole.bytes(), pieces.bytes());
    assert!(whole.bytes() >= 4 * (4 * 5 * 32 + 2 * 3 * (32 + 16) + 32));
}

/// Bad input is an error, and the cache is left as it was.
#[test]
fn bad_tokens_are_refused_and_leave_the_cache() {
    let model = DeepseekV4Model::load(&fixture()).unwrap();
    let mut cache = model.new_cache();
    model.forward(&mut cache, &[1, 2]).unwrap();
    let err = model.forward(&mut cache, &[5, 128]).unwrap_err();
    assert!(err.to_string().contains("token id 128"), "{err}");
    assert!(matches!(
        model.forward(&mut cache, &[]),
        Err(EngineError::EmptyPrompt)
    ));
    assert_eq!(cache.len(), 2);
}

/// What `plan` and admission count for a sequence (a fixed part and a part per position) is
/// never less than what its cache holds.
#[test]
fn the_planned_bytes_bound_what_a_cache_holds() {
    let model = DeepseekV4Model::load(&fixture()).unwrap();
    let v4 = model.config().deepseek_v4.as_ref().unwrap();
    let mut cache = model.new_cache();
    for (n, token) in (0..70u32).enumerate() {
        model.forward(&mut cache, &[token % 128]).unwrap();
        let planned = v4.cache_bytes_per_sequence() as f64
            + (n + 1) as f64 * v4.cache_bytes_per_position() as f64;
        assert!(
            cache.bytes() as f64 <= planned,
            "{n}: {} > {planned}",
            cache.bytes()
        );
    }
    // Past the windows, the per-position part is what grows: 70 positions hold 17 CSA entries
    // and indexer keys on 2 layers and 8 HCA entries.
    assert!(cache.bytes() >= 4 * (2 * 17 * (32 + 16) + 8 * 32));
}

/// Sequences stepped together (their rows through one gate and one expert dispatch) give what
/// each gives alone, prefill and decode mixed.
#[test]
fn a_batch_equals_each_sequence_alone() {
    let model = DeepseekV4Model::load(&fixture()).unwrap();
    let (a, b) = ([3u32, 17, 42, 7, 99, 1, 64, 23, 5], [88u32, 12, 9]);
    let mut alone = Vec::new();
    for prompt in [&a[..], &b[..]] {
        let mut cache = model.new_cache();
        model
            .forward(&mut cache, &prompt[..prompt.len() - 1])
            .unwrap();
        alone.push(
            model
                .forward(&mut cache, &prompt[prompt.len() - 1..])
                .unwrap(),
        );
    }
    let (mut ca, mut cb) = (model.new_cache(), model.new_cache());
    model.forward(&mut ca, &a[..a.len() - 1]).unwrap();
    // b prefills while a decodes.
    let together = model
        .forward_batch(&mut [(&mut ca, &a[a.len() - 1..]), (&mut cb, &b[..])])
        .unwrap();
    for (got, want) in together.iter().zip(&alone) {
        let diff = got
            .iter()
            .zip(want)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(diff < 1e-5, "batched differs by {diff}");
    }
    assert_eq!((ca.len(), cb.len()), (a.len(), b.len()));
}
