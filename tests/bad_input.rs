//! A model directory that is wrong in any way gets an error naming the file and, where there
//! is one, the tensor; never a panic.

use std::fs;
use std::path::{Path, PathBuf};

use moe_node::engine::{Engine, EngineError, GenerateRequest, SamplingParams, generate};
use moe_node::model::ModelError;
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A writable copy of a fixture.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn load_error(dir: &Path) -> ModelError {
    match Engine::load(dir) {
        Ok(_) => panic!("{} loaded but should not have", dir.display()),
        Err(e) => e,
    }
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    fs::write(&path, config.to_string()).unwrap();
}

/// Rewrites model.safetensors keeping only the tensors `keep` accepts.
fn rewrite_weights(dir: &Path, keep: impl Fn(&str) -> bool) {
    let path = dir.join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, TensorView)> = tensors
        .tensors()
        .into_iter()
        .filter(|(name, _)| keep(name))
        .collect();
    let out = safetensors::serialize(kept, None).unwrap();
    fs::write(&path, out).unwrap();
}

#[test]
fn unsupported_model_type_is_named() {
    let dir = copy_fixture("qwen3_moe");
    edit_config(dir.path(), |c| c["model_type"] = "llama".into());
    let err = load_error(dir.path());
    assert!(matches!(err, ModelError::Config { .. }), "{err}");
    assert!(
        err.to_string().contains("unsupported model_type `llama`"),
        "{err}"
    );
}

#[test]
fn config_that_is_not_json_is_reported_with_its_path() {
    let dir = copy_fixture("qwen3_moe");
    fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let err = load_error(dir.path());
    let message = err.to_string();
    assert!(
        message.contains("config.json") && message.contains("cannot read it"),
        "{message}"
    );
}

#[test]
fn missing_config_names_the_file() {
    let dir = copy_fixture("qwen3_moe");
    fs::remove_file(dir.path().join("config.json")).unwrap();
    let err = load_error(dir.path());
    assert!(
        matches!(err, ModelError::Io { ref path, .. } if path.ends_with("config.json")),
        "{err}"
    );
}

#[test]
fn directory_without_weights() {
    let dir = copy_fixture("qwen3_moe");
    fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let err = load_error(dir.path());
    assert!(matches!(err, ModelError::NoWeights { .. }), "{err}");
}

#[test]
fn missing_tensor_is_named() {
    let dir = copy_fixture("deepseek_v3");
    let gone = "model.layers.2.mlp.experts.5.down_proj.weight";
    rewrite_weights(dir.path(), |name| name != gone);
    let err = load_error(dir.path());
    assert!(
        matches!(err, ModelError::MissingTensor { ref name, .. } if name == gone),
        "{err}"
    );
    assert!(err.to_string().contains(gone));
}

#[test]
fn mis_shaped_tensor_names_tensor_file_and_shapes() {
    let dir = copy_fixture("qwen3_moe");
    // The config now promises wider experts than the checkpoint holds.
    edit_config(dir.path(), |c| c["moe_intermediate_size"] = 40.into());
    let err = load_error(dir.path());
    let message = err.to_string();
    assert!(matches!(err, ModelError::TensorShape { .. }), "{message}");
    assert!(
        message.contains("mlp.experts.0.gate_proj.weight"),
        "{message}"
    );
    assert!(
        message.contains("[32, 64]") && message.contains("[40, 64]"),
        "{message}"
    );
}

/// Qwen3.5-MoE's fused experts stored the other way round (`[experts, hidden, 2 *
/// moe_intermediate]`, the input first): named with both shapes, not read transposed.
#[test]
fn fused_experts_of_the_wrong_shape_are_named() {
    let dir = copy_fixture("qwen3_5_moe_fused");
    let fused = "model.language_model.layers.1.mlp.experts.gate_up_proj";
    let path = dir.path().join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            if name != fused {
                return (name, view);
            }
            let [e, out, inp] = view.shape() else {
                panic!("{name}: {:?}", view.shape())
            };
            let turned = TensorView::new(view.dtype(), vec![*e, *inp, *out], view.data()).unwrap();
            (name, turned)
        })
        .collect();
    fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    let err = load_error(dir.path());
    let message = err.to_string();
    assert!(matches!(err, ModelError::TensorShape { .. }), "{message}");
    assert!(message.contains(fused), "{message}");
    assert!(
        message.contains("[8, 48, 64]") && message.contains("[8, 64, 48]"),
        "{message}"
    );
}

#[test]
fn truncated_safetensors_is_corrupt() {
    let dir = copy_fixture("qwen3_moe");
    let path = dir.path().join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    let err = load_error(dir.path());
    let message = err.to_string();
    assert!(matches!(err, ModelError::Corrupt { .. }), "{message}");
    assert!(
        message.contains("model.safetensors") && message.contains("truncated"),
        "{message}"
    );
}

#[test]
fn garbage_safetensors_is_corrupt() {
    let dir = copy_fixture("qwen3_moe");
    fs::write(dir.path().join("model.safetensors"), [0xffu8; 64]).unwrap();
    assert!(matches!(load_error(dir.path()), ModelError::Corrupt { .. }));
    fs::write(dir.path().join("model.safetensors"), [1u8; 3]).unwrap();
    assert!(matches!(load_error(dir.path()), ModelError::Corrupt { .. }));
}

#[test]
fn index_pointing_at_a_missing_shard() {
    let dir = copy_fixture("mixtral");
    fs::remove_file(dir.path().join("model-00002-of-00004.safetensors")).unwrap();
    let err = load_error(dir.path());
    let message = err.to_string();
    assert!(matches!(err, ModelError::MissingShard { .. }), "{message}");
    assert!(
        message.contains("model-00002-of-00004.safetensors"),
        "{message}"
    );
}

#[test]
fn index_that_is_not_json_is_corrupt() {
    let dir = copy_fixture("mixtral");
    fs::write(dir.path().join("model.safetensors.index.json"), "[]").unwrap();
    assert!(matches!(load_error(dir.path()), ModelError::Corrupt { .. }));
}

#[test]
fn token_outside_the_vocabulary_and_overlong_prompts_are_refused() {
    let engine = Engine::load(&fixture("qwen3_moe")).unwrap();
    let request = |prompt: Vec<u32>, max_tokens| GenerateRequest {
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop_at_eos: false,
    };
    let err = generate(&engine, &request(vec![1, 128], 1)).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::TokenOutOfRange {
                token: 128,
                vocab_size: 128
            }
        ),
        "{err}"
    );
    let err = generate(&engine, &request(vec![1; 250], 10)).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::ContextTooLong {
                needed: 259,
                max: 256
            }
        ),
        "{err}"
    );
    let err = generate(&engine, &request(vec![], 1)).unwrap_err();
    assert!(matches!(err, EngineError::EmptyPrompt), "{err}");
}
