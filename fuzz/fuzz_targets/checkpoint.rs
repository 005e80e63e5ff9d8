//! A model directory as a node loads it: `config.json`, then the safetensors header (one
//! file, or an index naming a shard), then every dense tensor and every expert, through
//! `ModelConfig::load`, `Checkpoint::open`, `DenseWeights::load` and `load_all_experts`.
//!
//! Input: `config.json`, the line `--8<--`, the index (empty: no index, the shard is
//! `model.safetensors`), the line `--8<--`, then the shard's bytes. The seeds are tiny
//! checkpoints built by `examples/checkpoint_seeds.rs` from the fixtures' configs.
#![no_main]

mod scratch;

use libfuzzer_sys::fuzz_target;
use moe_node::model::weights::load_all_experts;
use moe_node::model::{Checkpoint, DenseWeights, ModelConfig};

const SEPARATOR: &[u8] = b"\n--8<--\n";
/// The shard an index may name; anything else it names is missing.
const SHARD: &str = "model-00001-of-00001.safetensors";

fn split(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let at = data
        .windows(SEPARATOR.len())
        .position(|window| window == SEPARATOR)?;
    Some((&data[..at], &data[at + SEPARATOR.len()..]))
}

fuzz_target!(|data: &[u8]| {
    let Some((config, rest)) = split(data) else {
        return;
    };
    let Some((index, shard)) = split(rest) else {
        return;
    };
    let dir = scratch::dir();
    let write = |name: &str, bytes: &[u8]| std::fs::write(dir.join(name), bytes).expect("write");
    let remove = |name: &str| {
        let _ = std::fs::remove_file(dir.join(name));
    };
    write("config.json", config);
    if index.is_empty() {
        remove("model.safetensors.index.json");
        remove(SHARD);
        write("model.safetensors", shard);
    } else {
        remove("model.safetensors");
        write("model.safetensors.index.json", index);
        write(SHARD, shard);
    }

    let checkpoint = Checkpoint::open(dir);
    let config = ModelConfig::load(dir);
    let (Ok(checkpoint), Ok(config)) = (checkpoint, config) else {
        return;
    };
    let _ = checkpoint.fingerprint();
    if DenseWeights::load(&checkpoint, &config).is_ok() {
        let _ = load_all_experts(&checkpoint, &config);
    }
});
