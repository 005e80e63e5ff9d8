//! Writes the `checkpoint` target's seed corpus: one tiny checkpoint per fixture family in
//! `tests/fixtures/`, with the fixture's config shrunk to sizes of 2 to 4 and the tensors the
//! loader itself asks for (each `MissingTensor` error names the next tensor and its shape),
//! stored in the dtype the fixture stores that tensor in.
//!
//! `cargo run --example checkpoint_seeds` from `fuzz/` (rewrites `corpus/checkpoint/`).

use std::collections::HashMap;
use std::path::Path;

use moe_node::model::weights::load_all_experts;
use moe_node::model::{Checkpoint, DenseWeights, ModelConfig, ModelError};
use serde_json::{Value, json};

/// The sizes every seed shrinks its fixture to (only keys the fixture has are changed).
const SMALL: &[(&str, u64)] = &[
    ("vocab_size", 4),
    ("hidden_size", 4),
    ("num_hidden_layers", 2),
    ("intermediate_size", 4),
    ("moe_intermediate_size", 2),
    ("num_attention_heads", 2),
    ("head_dim", 2),
    ("num_local_experts", 2),
    ("num_experts", 2),
    ("n_routed_experts", 2),
    ("num_experts_per_tok", 1),
    ("n_group", 1),
    ("topk_group", 1),
    ("kv_lora_rank", 2),
    ("qk_nope_head_dim", 2),
    ("qk_rope_head_dim", 2),
    ("v_head_dim", 2),
    ("first_k_dense_replace", 1),
];

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = root.join("fuzz/corpus/checkpoint");
    std::fs::create_dir_all(&out).expect("corpus directory");
    for (fixture, sharded) in [
        ("qwen3_moe", false),
        ("qwen3_moe_bf16", false),
        ("mixtral", true),
        ("kimi_k2", false),
        ("deepseek_v3", false),
    ] {
        let dir = root.join("tests/fixtures").join(fixture);
        let seed = seed(&dir, sharded);
        std::fs::write(out.join(format!("seed-{fixture}")), &seed).expect("write seed");
        println!("{fixture}: {} bytes", seed.len());
    }
}

fn seed(fixture: &Path, sharded: bool) -> Vec<u8> {
    let text = std::fs::read_to_string(fixture.join("config.json")).expect("fixture config");
    let mut config: Value = serde_json::from_str(&text).expect("fixture config is JSON");
    let object = config.as_object_mut().expect("config is an object");
    let mla = object.contains_key("kv_lora_rank");
    for (key, value) in SMALL {
        if object.get(*key).is_some_and(|v| !v.is_null()) {
            object.insert((*key).into(), json!(value));
        }
    }
    if let Some(kv_heads) = object.get_mut("num_key_value_heads") {
        *kv_heads = json!(if mla { 2 } else { 1 });
    }
    let config_text = serde_json::to_string(&config).expect("config");
    let model = ModelConfig::parse(&config_text).expect("the shrunk config validates");
    let dtypes = fixture_dtypes(fixture);

    let scratch = tempfile::tempdir().expect("temporary directory");
    std::fs::write(scratch.path().join("config.json"), &config_text).expect("config");
    let mut tensors: Vec<(String, Vec<usize>)> = Vec::new();
    loop {
        std::fs::write(
            scratch.path().join("model.safetensors"),
            safetensors(&tensors, &dtypes),
        )
        .expect("write");
        let checkpoint = Checkpoint::open(scratch.path()).expect("open");
        let missing = match DenseWeights::load(&checkpoint, &model)
            .and_then(|_| load_all_experts(&checkpoint, &model))
        {
            Ok(_) => break,
            Err(ModelError::MissingTensor {
                name,
                expected_shape,
            }) => (name, expected_shape),
            Err(other) => panic!("{}: {other}", fixture.display()),
        };
        tensors.push(missing);
    }
    let shard = safetensors(&tensors, &dtypes);
    let index = if sharded {
        let map: serde_json::Map<String, Value> = tensors
            .iter()
            .map(|(name, _)| (name.clone(), json!("model-00001-of-00001.safetensors")))
            .collect();
        serde_json::to_vec(&json!({"metadata": {}, "weight_map": map})).expect("index")
    } else {
        Vec::new()
    };
    let mut seed = config_text.into_bytes();
    seed.extend_from_slice(b"\n--8<--\n");
    seed.extend_from_slice(&index);
    seed.extend_from_slice(b"\n--8<--\n");
    seed.extend_from_slice(&shard);
    seed
}

/// The dtype each tensor has in the fixture's shards.
fn fixture_dtypes(fixture: &Path) -> HashMap<String, String> {
    let mut dtypes = HashMap::new();
    for entry in std::fs::read_dir(fixture).expect("fixture directory") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).expect("shard");
        let len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + len]).expect("header");
        for (name, info) in header.as_object().expect("header object") {
            if let Some(dtype) = info.get("dtype").and_then(Value::as_str) {
                dtypes.insert(name.clone(), dtype.to_string());
            }
        }
    }
    dtypes
}

/// A safetensors file of `tensors`, each filled with a small repeating pattern.
fn safetensors(tensors: &[(String, Vec<usize>)], dtypes: &HashMap<String, String>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape) in tensors {
        let dtype = dtypes.get(name).map_or("F32", String::as_str);
        let width = if dtype == "F32" { 4 } else { 2 };
        let len = shape.iter().product::<usize>() * width;
        let begin = data.len();
        data.extend((0..len).map(|i| (i % 7) as u8 * 16));
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}),
        );
    }
    let header = serde_json::to_vec(&header).expect("header");
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&data);
    file
}
