//! The cost of constrained decoding per generated token: how long llguidance takes to
//! compute a token mask, and how long a step waits for it when the mask is computed
//! beside a step of the engine's length (as the router runs it: the mask for the next token
//! starts when a token is drawn, and the step's logits need it).
//!
//! Vocabularies: the demo model's (259 byte-level tokens), and a synthetic one of 151,646
//! tokens (Qwen3's size): the 256 bytes, then JSON punctuation, then words and word pieces
//! of a fixed text ([`CORPUS`]), then random lowercase strings. Grammars: the `response_format`
//! schema of tests/structured_output.rs, and `{"type": "object"}` (free JSON). Each walk
//! draws uniformly among the allowed tokens until the grammar ends (at most 300 tokens).
//!
//! `cargo bench --bench grammar` (results/grammar.txt holds a run). `STEP_MS` sets the
//! simulated engine step (default 0.73 ms: the demo engine's step at concurrency 1).

use std::time::{Duration, Instant};

use moe_node::engine::grammar::{GrammarMetrics, Grammars};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use serde_json::json;

/// The words the synthetic vocabulary is built from: each distinct word (cut to 12 bytes)
/// of README.md, src/api/openai.rs and src/engine/batch.rs as they were at commit ea4110f,
/// in the order they first appeared, which builds the same vocabulary as those texts did.
/// Fixed, so that the repository's text changing does not change the vocabulary, and a run
/// stays comparable with results/grammar.txt.
const CORPUS: &str = include_str!("grammar_corpus.txt");

const WALKS: usize = 20;
const MAX_TOKENS: usize = 300;

fn demo_vocabulary() -> Vec<(Vec<u8>, bool)> {
    let mut tokens: Vec<(Vec<u8>, bool)> = (0..=255u8).map(|b| (vec![b], false)).collect();
    for special in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"] {
        tokens.push((special.as_bytes().to_vec(), true));
    }
    tokens
}

fn synthetic_vocabulary(size: usize) -> Vec<(Vec<u8>, bool)> {
    let mut seen = std::collections::HashSet::new();
    let mut tokens: Vec<(Vec<u8>, bool)> = Vec::with_capacity(size);
    let mut add = |bytes: Vec<u8>, tokens: &mut Vec<(Vec<u8>, bool)>| {
        if tokens.len() < size - 2 && seen.insert(bytes.clone()) {
            tokens.push((bytes, false));
        }
    };
    for b in 0..=255u8 {
        add(vec![b], &mut tokens);
    }
    for piece in [
        "{\"", "\":", "\": ", "\",", "\", \"", "},", "}\n", "[\"", "\"]", "\n  ", "\n    ", "  ",
    ] {
        add(piece.as_bytes().to_vec(), &mut tokens);
    }
    for word in CORPUS.split(|c: char| !c.is_alphanumeric() && c != '_') {
        if word.is_empty() {
            continue;
        }
        for end in 2..=word.len().min(12) {
            if word.is_char_boundary(end) {
                add(word.as_bytes()[..end].to_vec(), &mut tokens);
                add(format!(" {}", &word[..end]).into_bytes(), &mut tokens);
            }
        }
    }
    for n in 0..1000 {
        add(n.to_string().into_bytes(), &mut tokens);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    while tokens.len() < size - 2 {
        let len = 3 + (rng.next_u32() % 6) as usize;
        let word: Vec<u8> = (0..len)
            .map(|_| b'a' + (rng.next_u32() % 26) as u8)
            .collect();
        add(word, &mut tokens);
    }
    tokens.push((b"<|im_end|>".to_vec(), true));
    tokens.push((b"<|endoftext|>".to_vec(), true));
    tokens
}

struct Measured {
    tokens: usize,
    compute_per_token: Duration,
    wait_per_token: Duration,
    compile: Duration,
}

fn walk(
    grammars: &Grammars,
    metrics: &GrammarMetrics,
    schema: &serde_json::Value,
    vocab: usize,
    step: Duration,
) -> Measured {
    let end = grammars.end();
    let masks_before = metrics.masks.get();
    let compute_before = metrics.compute_seconds.get();
    let mut waited = Duration::ZERO;
    let mut compile = Duration::ZERO;
    let mut tokens = 0;
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut logits = vec![0.0f32; vocab];
    for _ in 0..WALKS {
        let started = Instant::now();
        let mut constraint = grammars
            .json_schema(schema.clone())
            .expect("schema compiles");
        compile += started.elapsed();
        for _ in 0..MAX_TOKENS {
            // The engine's step, while the mask is computed.
            std::thread::sleep(step);
            logits.iter_mut().for_each(|l| *l = 0.0);
            let started = Instant::now();
            constraint.apply(&mut logits, &[end]);
            waited += started.elapsed();
            let allowed: Vec<u32> = (0..vocab as u32)
                .filter(|&t| logits[t as usize].is_finite())
                .collect();
            let token = allowed[rng.next_u32() as usize % allowed.len()];
            tokens += 1;
            if token == end {
                break;
            }
            constraint.advance(token);
        }
    }
    let masks = (metrics.masks.get() - masks_before).max(1) as u32;
    Measured {
        tokens,
        compute_per_token: Duration::from_secs_f64(metrics.compute_seconds.get() - compute_before)
            / masks,
        wait_per_token: waited / tokens.max(1) as u32,
        compile: compile / WALKS as u32,
    }
}

fn main() {
    let step_ms: f64 = std::env::var("STEP_MS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.73);
    let step = Duration::from_secs_f64(step_ms / 1000.0);
    let answer = json!({
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 9},
            "sure": {"type": "boolean"}
        },
        "required": ["answer", "count", "sure"],
        "additionalProperties": false
    });
    let free = json!({"type": "object"});
    println!(
        "constrained decoding per token; simulated engine step {step_ms} ms; {WALKS} walks of at most {MAX_TOKENS} tokens"
    );
    println!(
        "{:<22} {:<12} {:>8} {:>14} {:>14} {:>12} {:>12}",
        "vocabulary",
        "schema",
        "tokens",
        "compute µs/tok",
        "wait µs/tok",
        "wait/step",
        "compile µs"
    );
    for (name, vocabulary) in [
        ("demo (259)", demo_vocabulary()),
        ("synthetic (151,646)", synthetic_vocabulary(151_646)),
    ] {
        let vocab = vocabulary.len();
        let end = (vocab - 2) as u32;
        let metrics = GrammarMetrics::default();
        let started = Instant::now();
        let grammars = Grammars::new(vocabulary, end, metrics.clone()).expect("vocabulary");
        let setup = started.elapsed();
        for (schema_name, schema) in [("answer", &answer), ("json_object", &free)] {
            let m = walk(&grammars, &metrics, schema, vocab, step);
            println!(
                "{:<22} {:<12} {:>8} {:>14.1} {:>14.1} {:>11.1}% {:>12.0}",
                name,
                schema_name,
                m.tokens,
                m.compute_per_token.as_secs_f64() * 1e6,
                m.wait_per_token.as_secs_f64() * 1e6,
                m.wait_per_token.as_secs_f64() / step.as_secs_f64() * 100.0,
                m.compile.as_secs_f64() * 1e6,
            );
        }
        println!(
            "{:<22} vocabulary set-up (token trie, once per model): {:.0} ms",
            name,
            setup.as_secs_f64() * 1e3
        );
    }
}
