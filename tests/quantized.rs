//! Quantized checkpoints (FP8 block-scaled, compressed-tensors INT4) as published: the
//! fixtures made by tests/fixtures/make_quant_fixtures.py, and copies of them broken the ways
//! a user's download can be broken. Each bad input must give an error that names the file,
//! the tensor and the shape expected, or the quantization method that is not read.
//! (Greedy tokens and logits against transformers are checked in tests/reference.rs.)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use moe_node::compute::quant::QuantFormat;
use moe_node::engine::Engine;
use moe_node::model::weights::load_all_experts;
use moe_node::model::{Checkpoint, ExpertWeights, ModelConfig};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A tensor as stored: dtype, shape, bytes.
type Stored = (Dtype, Vec<usize>, Vec<u8>);

/// A copy of single-file fixture `name` with its tensors passed through `edit` and its
/// config through `edit_config`.
fn broken_copy(
    name: &str,
    edit: impl FnOnce(&mut BTreeMap<String, Stored>),
    edit_config: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    let source = fixture(name);
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(source.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: BTreeMap<String, Stored> = file
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (dtype, shape, data))| {
            (
                n.clone(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap())
            .unwrap();
    edit_config(&mut config);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    dir
}

fn load_error(dir: &Path) -> String {
    match Engine::load(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_names(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "`{part}` not in: {message}");
    }
}

#[test]
fn fp8_scale_of_the_wrong_shape_is_refused_naming_file_tensor_and_shape() {
    // qwen3_moe_fp8's experts are [40, 64] in [16, 32] blocks: 3 x 2 scales.
    let name = "model.layers.0.mlp.experts.5.gate_proj.weight_scale_inv";
    let dir = broken_copy(
        "qwen3_moe_fp8",
        |t| {
            let (dtype, _, _) = t[name].clone();
            t.insert(name.into(), (dtype, vec![1, 1], vec![0; 2]));
        },
        |_| {},
    );
    let message = load_error(dir.path());
    assert_names(&message, &["model.safetensors", name, "[3, 2]", "[1, 1]"]);
}

#[test]
fn fp8_weight_without_its_scale_is_refused_naming_the_scale() {
    let name = "model.layers.2.self_attn.q_proj.weight_scale_inv";
    let dir = broken_copy(
        "kimi_k2_fp8",
        |t| {
            t.remove(name);
        },
        |_| {},
    );
    let message = load_error(dir.path());
    // q_proj is [4 heads * 24, 144]: 1 x 2 blocks of [128, 128].
    assert_names(&message, &[name, "missing", "[1, 2]"]);
}

#[test]
fn fp8_tensors_without_a_quantization_config_are_refused_saying_what_is_missing() {
    let dir = broken_copy(
        "kimi_k2_fp8",
        |_| {},
        |c| {
            c.as_object_mut().unwrap().remove("quantization_config");
        },
    );
    let message = load_error(dir.path());
    assert_names(&message, &["F8_E4M3", "quantization_config"]);
}

#[test]
fn int4_packed_weight_of_the_wrong_shape_is_refused_naming_file_tensor_and_shape() {
    // Experts are [64, 64]: 64 rows of 8 words.
    let name = "model.layers.1.mlp.experts.3.up_proj.weight_packed";
    let dir = broken_copy(
        "kimi_k2_int4",
        |t| {
            t.insert(name.into(), (Dtype::I32, vec![64, 4], vec![0; 64 * 4 * 4]));
        },
        |_| {},
    );
    let message = load_error(dir.path());
    assert_names(&message, &["model.safetensors", name, "[64, 8]", "[64, 4]"]);
}

#[test]
fn int4_weight_shape_that_disagrees_with_the_config_is_refused() {
    let name = "model.layers.2.mlp.experts.0.down_proj.weight_shape";
    let dir = broken_copy(
        "kimi_k2_int4",
        |t| {
            let (dtype, shape, _) = t[name].clone();
            let bytes: Vec<u8> = if dtype == Dtype::I64 {
                [64i64, 32].iter().flat_map(|v| v.to_le_bytes()).collect()
            } else {
                [64i32, 32].iter().flat_map(|v| v.to_le_bytes()).collect()
            };
            t.insert(name.into(), (dtype, shape, bytes));
        },
        |_| {},
    );
    let message = load_error(dir.path());
    assert_names(
        &message,
        &[
            "model.layers.2.mlp.experts.0.down_proj",
            "[64, 32]",
            "[64, 64]",
        ],
    );
}

#[test]
fn a_module_the_ignore_list_names_is_read_unquantized() {
    // Take the routed experts of layer 1 off the quantized list: the loader must then want
    // their plain `weight`, which this checkpoint does not have.
    let dir = broken_copy(
        "kimi_k2_int4",
        |_| {},
        |c| {
            let ignore = c["quantization_config"]["ignore"].as_array_mut().unwrap();
            ignore.push("re:model\\.layers\\.1\\.mlp\\.experts\\..*".into());
        },
    );
    let message = load_error(dir.path());
    assert_names(
        &message,
        &["model.layers.1.mlp.experts.0.gate_proj.weight", "missing"],
    );
}

#[test]
fn unsupported_quantization_methods_are_refused_by_name() {
    for (config, named) in [
        (
            serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 128}),
            "`awq`",
        ),
        (
            serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 128}),
            "`gptq`",
        ),
        (serde_json::json!({"quant_method": "mxfp4"}), "`mxfp4`"),
    ] {
        let dir = broken_copy(
            "kimi_k2_int4",
            |_| {},
            |c| c["quantization_config"] = config,
        );
        assert_names(&load_error(dir.path()), &[named, "config.json"]);
    }
    let dir = broken_copy(
        "kimi_k2_int4",
        |_| {},
        |c| c["quantization_config"]["format"] = "float-quantized".into(),
    );
    assert_names(&load_error(dir.path()), &["`float-quantized`"]);
}

/// Bytes the routed experts take in memory, against the same experts in bf16.
fn expert_bytes_against_bf16(name: &str) -> (usize, usize) {
    let dir = fixture(name);
    let config = ModelConfig::load(&dir).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let experts = load_all_experts(&checkpoint, &config).unwrap();
    let mut held = 0;
    let mut bf16 = 0;
    for expert in experts.iter().flatten() {
        let ExpertWeights::Quantized(block) = expert else {
            panic!("{name}: expert not held quantized: {expert:?}");
        };
        held += expert.weight_bytes();
        for m in [&block.gate, &block.up, &block.down] {
            bf16 += 2 * m.out_features * m.in_features;
        }
    }
    // What `moe-node plan` counts is what is held.
    let sizes = moe_node::plan::sizes::ModelSizes::of(&config);
    let moe_layers = config.moe_layers.iter().filter(|m| **m).count();
    assert_eq!(
        sizes.expert_bytes as usize * config.moe.num_experts * moe_layers,
        held,
        "{name}: plan's expert size"
    );
    (held, bf16)
}

#[test]
fn quantized_experts_stay_compressed_in_memory() {
    for (name, low, high) in [
        // FP8: 1 byte per weight plus an f32 scale per block.
        ("kimi_k2_fp8", 0.50, 0.55),
        ("qwen3_moe_fp8", 0.50, 0.55),
        ("qwen3_5_moe_fp8", 0.50, 0.55),
        // INT4: half a byte per weight plus a bf16 scale per 32 weights (the files' scales
        // are bf16, so they are held in bf16: 0.281; f32 would give 0.3125).
        ("kimi_k2_int4", 0.25, 0.29),
        ("kimi_k25_int4", 0.25, 0.29),
        // MXFP4: half a byte per weight plus an E8M0 byte per 32 (0.266 of bf16), and gpt-oss's
        // f32 biases, which weigh 0.042 more at this fixture's hidden size of 64.
        ("gpt_oss_mxfp4", 0.30, 0.31),
    ] {
        let (held, bf16) = expert_bytes_against_bf16(name);
        let ratio = held as f64 / bf16 as f64;
        eprintln!("{name}: experts hold {held} bytes, {bf16} in bf16: {ratio:.3}");
        assert!(
            (low..=high).contains(&ratio),
            "{name}: {held} bytes against {bf16} in bf16 ({ratio:.3})"
        );
    }
    // The FP8 experts hold the checkpoint's bytes, not a copy widened at load.
    let dir = fixture("kimi_k2_fp8");
    let config = ModelConfig::load(&dir).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let experts = load_all_experts(&checkpoint, &config).unwrap();
    let ExpertWeights::Quantized(block) = &experts[1][0] else {
        panic!("not quantized")
    };
    let QuantFormat::Fp8 {
        weights,
        block_rows,
        block_cols,
        ..
    } = &block.gate.format
    else {
        panic!("not fp8")
    };
    assert_eq!((*block_rows, *block_cols), (128, 128));
    assert_eq!(weights.len(), 48 * 144);
}

#[test]
fn kimi_k25_serves_the_text_model_and_leaves_the_vision_tower() {
    let dir = fixture("kimi_k25_int4");
    let config = ModelConfig::load(&dir).unwrap();
    assert_eq!(config.model_type, "kimi_k25");
    let checkpoint = Checkpoint::open(&dir).unwrap();
    assert_eq!(
        checkpoint.stored_name("model.embed_tokens.weight"),
        "language_model.model.embed_tokens.weight"
    );
    // The vision tower is in the files but not reachable as part of the text model.
    assert!(!checkpoint.contains("vision_tower.patch_embed.proj.weight"));
    assert!(checkpoint.contains("model.layers.1.mlp.experts.0.gate_proj.weight_packed"));
}

#[test]
fn shared_experts_are_held_as_stored_like_the_routed_ones() {
    use moe_node::model::weights::{DenseWeights, FeedForward};
    // FP8 checkpoints quantize the shared experts too; Kimi K2 Thinking's INT4 `ignore`
    // list leaves them bf16. Neither is widened to f32 at load.
    for (name, fp8) in [("kimi_k2_fp8", true), ("kimi_k2_int4", false)] {
        let dir = fixture(name);
        let config = ModelConfig::load(&dir).unwrap();
        let checkpoint = Checkpoint::open(&dir).unwrap();
        let dense = DenseWeights::load(&checkpoint, &config).unwrap();
        let shared: Vec<&ExpertWeights> = dense
            .layers
            .iter()
            .filter_map(|l| match &l.feed_forward {
                FeedForward::Moe(moe) => moe.shared_expert.as_ref(),
                FeedForward::Dense(_) => None,
            })
            .collect();
        assert!(!shared.is_empty(), "{name}: no shared experts");
        for expert in shared {
            match expert {
                ExpertWeights::Quantized(block) if fp8 => {
                    assert!(
                        matches!(block.down.format, QuantFormat::Fp8 { .. }),
                        "{name}"
                    )
                }
                ExpertWeights::Bf16(_) if !fp8 => {}
                other => panic!("{name}: shared expert held as {other:?}"),
            }
        }
    }
}

#[test]
fn dense_projections_are_held_as_stored() {
    use moe_node::model::weights::{AttentionWeights, DenseWeights, FeedForward, StoredLinear};
    // (fixture, how its attention projections are stored, how its embeddings, output head
    // and router gates are stored): FP8 checkpoints quantize attention and leave the rest
    // bf16; nothing stored bf16 or FP8 is widened to f32 at load.
    for (name, attention, rest) in [
        ("kimi_k2_fp8", "fp8", "bf16"),
        ("kimi_k2", "bf16", "bf16"),
        ("qwen3_moe_bf16", "bf16", "bf16"),
        ("qwen3_moe", "f32", "f32"),
    ] {
        let dir = fixture(name);
        let config = ModelConfig::load(&dir).unwrap();
        let checkpoint = Checkpoint::open(&dir).unwrap();
        let dense = DenseWeights::load(&checkpoint, &config).unwrap();
        let held = |l: &StoredLinear| match l {
            StoredLinear::F32(_) => "f32",
            StoredLinear::Bf16(_) => "bf16",
            StoredLinear::Quantized { matrix, .. } => match matrix.format {
                QuantFormat::Fp8 { .. } => "fp8",
                QuantFormat::Int4 { .. } => "int4",
                QuantFormat::Mxfp4 { .. } => "mxfp4",
            },
        };
        let per_weight = |l: &StoredLinear| {
            l.stored_bytes() as f64 / (l.out_features() * l.in_features()) as f64
        };
        assert_eq!(held(&dense.embed_tokens), rest, "{name}: embeddings");
        assert_eq!(held(dense.lm_head()), rest, "{name}: lm_head");
        for layer in &dense.layers {
            let o = match &layer.attention {
                AttentionWeights::Gqa { o, .. } | AttentionWeights::Mla { o, .. } => o,
            };
            assert_eq!(held(o), attention, "{name}: o_proj");
            let bytes = per_weight(o);
            let expected = match attention {
                "f32" => 4.0..=4.0,
                "bf16" => 2.0..=2.0,
                // One byte per weight and a few block scales.
                _ => 1.0..=1.25,
            };
            assert!(
                expected.contains(&bytes),
                "{name}: o_proj holds {bytes} bytes per weight"
            );
            if let FeedForward::Moe(moe) = &layer.feed_forward {
                assert_eq!(held(&moe.router), rest, "{name}: router gate");
            }
        }
    }
}
