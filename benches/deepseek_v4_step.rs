//! A DeepSeek-V4 decode step's time as the context grows (issue 48): the V4 fixture's model
//! (tests/fixtures/deepseek_v4: hidden 64, 4 layers, compress ratios 0/4/128/4) with its
//! context raised, one sequence prefilled to each length in turn and then stepped. What grows
//! with the context in a step is attention over the compressed entries the indexer keeps and,
//! until 08a6b77, a copy of every layer's entries per step (the state a step starts from).
//!
//! `cargo bench --bench deepseek_v4_step`; `MOE_V4_STEPS` (decode steps per length, default
//! 50), `MOE_V4_CONTEXTS` (default 256,2048,8192,32768). Prints the median step per length.

use std::path::Path;
use std::time::Instant;

use moe_node::engine::{Engine, SequenceStep};

fn env_list(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect()
}

fn main() {
    let steps = env_list("MOE_V4_STEPS", "50")[0];
    let contexts = env_list("MOE_V4_CONTEXTS", "256,2048,8192,32768");
    let longest = contexts.iter().max().copied().unwrap_or(256) + steps + 1;
    // The fixture with room for the longest context.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4");
    let dir = std::env::temp_dir().join(format!("moe-v4-step-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for entry in std::fs::read_dir(&fixture).expect("fixture") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
    }
    let config_path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).expect("config")).unwrap();
    config["max_position_embeddings"] = longest.into();
    std::fs::write(&config_path, config.to_string()).expect("config");
    let engine = Engine::load(&dir).expect("the V4 fixture loads");
    let vocab = engine.config().vocab_size as u32;
    let token = |i: usize| (i as u32 * 7 + 3) % vocab;

    println!("DeepSeek-V4 fixture, one sequence: median decode step over {steps} steps");
    let mut cache = engine.new_cache();
    let mut at = 0;
    for &context in &contexts {
        // Prefill up to `context` in chunks.
        while at < context {
            let chunk: Vec<u32> = (at..context.min(at + 512)).map(token).collect();
            engine
                .forward(&mut [SequenceStep::new(&mut cache, &chunk)])
                .expect("prefill");
            at += chunk.len();
        }
        let mut times: Vec<f64> = (0..steps)
            .map(|_| {
                let next = [token(at)];
                let started = Instant::now();
                engine
                    .forward(&mut [SequenceStep::new(&mut cache, &next)])
                    .expect("decode step");
                at += 1;
                started.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        times.sort_by(f64::total_cmp);
        println!(
            "  context {context:>6}: {:8.3} ms a step (cache {} KiB)",
            times[times.len() / 2],
            cache.bytes() >> 10
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
