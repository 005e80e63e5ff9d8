//! DeepSeek-V4 against transformers: the tiny checkpoint `tests/fixtures/make_fixtures.py`
//! made with transformers' own classes, in the published layout (compressed and windowed
//! attention shorter than the sequence, an indexer keeping fewer entries than there are,
//! hash-routed layers, 3 hyper-connection streams, random sinks), must give the same greedy
//! tokens and logits within 1e-3 relative. The serving engine and the GPU backend refuse it,
//! naming what they lack.

mod common;

use std::path::{Path, PathBuf};

use moe_node::engine::Engine;
use moe_node::engine::deepseek_v4::DeepseekV4Model;
use safetensors::SafeTensors;
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    prompt_ids: Vec<u32>,
    token_ids: Vec<u32>,
    last_logits: Vec<f32>,
    long_prompt_ids: Vec<u32>,
    /// Logits at a few positions of the uncached pass over `long_prompt_ids`.
    long_logits: std::collections::BTreeMap<usize, Vec<f32>>,
}

fn reference() -> Reference {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
        .unwrap()
}

/// The largest difference, relative to the largest reference logit.
fn relative_difference(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let largest = want.iter().fold(0.0f32, |m, l| m.max(l.abs()));
    let diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m });
    diff / largest
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4")
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn deepseek_v4_matches_transformers() {
    let reference: Reference =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
            .unwrap();
    let model = DeepseekV4Model::load(&fixture()).unwrap();
    let mut cache = model.new_cache();
    let logits = model.forward(&mut cache, &reference.prompt_ids).unwrap();
    let largest = reference
        .last_logits
        .iter()
        .fold(0.0f32, |m, l| m.max(l.abs()));
    let diff = logits
        .iter()
        .zip(&reference.last_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m });
    eprintln!(
        "deepseek_v4: max logit difference from transformers {diff:e} ({:e} of the largest logit)",
        diff / largest
    );
    assert!(
        diff <= 1e-3 * largest,
        "logits differ by {diff} (largest logit {largest})"
    );
    // Greedy decoding one token at a time through the cache: past the window, past several
    // compressed windows, the indexer choosing among more entries than it keeps.
    let mut tokens = vec![argmax(&logits)];
    while tokens.len() < reference.token_ids.len() {
        let last = *tokens.last().unwrap();
        let logits = model.forward(&mut cache, &[last]).unwrap();
        tokens.push(argmax(&logits));
    }
    assert_eq!(tokens, reference.token_ids);
}

/// 64 positions decoded one at a time through the cache (16 CSA entries, 8 HCA ones, the
/// window passed ten times over) give the logits of transformers' uncached pass, and so does
/// one prefill of them all.
#[test]
fn a_long_decode_through_the_cache_matches_the_uncached_pass() {
    let reference = reference();
    let model = DeepseekV4Model::load(&fixture()).unwrap();
    let mut cache = model.new_cache();
    let mut worst = 0.0f32;
    for (position, &token) in reference.long_prompt_ids.iter().enumerate() {
        let logits = model.forward(&mut cache, &[token]).unwrap();
        if let Some(want) = reference.long_logits.get(&position) {
            worst = worst.max(relative_difference(&logits, want));
        }
    }
    let mut whole = model.new_cache();
    let logits = model
        .forward(&mut whole, &reference.long_prompt_ids)
        .unwrap();
    let prefill = relative_difference(&logits, &reference.long_logits[&63]);
    eprintln!(
        "deepseek_v4, 64 positions: decode {worst:e}, prefill {prefill:e} of the largest logit"
    );
    assert!(worst <= 1e-3 && prefill <= 1e-3, "{worst} {prefill}");
}

#[test]
fn the_serving_engine_refuses_it_naming_what_it_lacks() {
    let err = Engine::load(&fixture())
        .err()
        .expect("Engine loaded DeepSeek-V4");
    let message = err.to_string();
    assert!(message.contains("compressed attention"), "{message}");
    assert!(message.contains("engine::deepseek_v4"), "{message}");
}

/// The GPU backend (a real GPU under `tests/gpu/run.sh`, else GPUs emulated on the CPU)
/// refuses it at load, its experts alone or the whole model, naming what it lacks: never
/// experts without the clamp or attention without the compressor.
#[test]
fn the_gpu_backend_refuses_it_naming_what_it_lacks() {
    if common::gpus("deepseek_v4: GPU backend").is_none() {
        return;
    }
    for dense in [false, true] {
        let source = moe_node::model::ModelSource::files(&fixture());
        match moe_node::engine::gpu::engine_on_gpu(&source, 0, dense, None, None) {
            Ok(_) => panic!("deepseek_v4 loaded on the GPU (dense: {dense})"),
            Err(e) => assert!(e.to_string().contains("compressed attention"), "{e}"),
        }
    }
}

/// A `tid2eid` table naming an expert past the layer's experts is a clear error at load.
#[test]
fn a_token_table_past_the_experts_is_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    for file in ["config.json", "reference.json"] {
        std::fs::copy(fixture().join(file), dir.path().join(file)).unwrap();
    }
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )
        })
        .collect();
    let table = owned
        .iter_mut()
        .find(|(name, ..)| name == "layers.1.ffn.gate.tid2eid")
        .unwrap();
    // Token 5's first expert: 8 (of 8).
    let at = 5 * 2 * 8;
    table.3[at..at + 8].copy_from_slice(&8i64.to_le_bytes());
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    let err = DeepseekV4Model::load(dir.path())
        .err()
        .expect("a table past the experts loaded");
    let message = err.to_string();
    assert!(
        message.contains("layers.1.ffn.gate.tid2eid")
            && message.contains("token 5 to expert 8, past the 8 experts"),
        "{message}"
    );
}

/// `moe-node plan` on DeepSeek-V4-Pro's config alone (experts MXFP4, the dense part FP8 with
/// ue8m0 scales): two copies of every expert fit on two 8 x H200 nodes, 48 experts per GPU and
/// layer (95.7 GiB), and either node failing leaves every expert its other copy.
#[test]
fn plan_fits_pro_with_two_copies_on_two_h200_nodes() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4_pro");
    let plan = |nodes: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_moe-node"))
            .args([
                "plan",
                "--json",
                "--model",
                model.to_str().unwrap(),
                "--nodes",
                nodes,
            ])
            .args(["--devices-per-node", "8", "--replication", "2"])
            .args(["--device-memory-gib", "141"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str::<serde_json::Value>(&stdout)
            .unwrap_or_else(|e| panic!("{e}: {stdout} {}", String::from_utf8_lossy(&out.stderr)))
    };
    let report = plan("2");
    let sizes = &report["model"]["sizes"];
    // 3 matrices of 7168 x 3072 e2m1 pairs and one e8m0 byte per 32.
    assert_eq!(
        sizes["expert_bytes"],
        3 * (7168 * 3072 / 2 + 7168 * 3072 / 32)
    );
    // 29 CSA layers of (512 + 128) / 4 floats and 32 HCA layers of 512 / 128.
    assert_eq!(sizes["kv_bytes_per_position"], 4 * (29 * 160 + 32 * 4));
    assert_eq!(report["verdict"]["ok"], true, "{}", report["verdict"]);
    for device in report["devices"].as_array().unwrap() {
        assert_eq!(device["experts"]["0"], 48, "{device}");
        assert_eq!(device["fits"], true, "{device}");
    }
    for failure in report["failures"].as_array().unwrap() {
        assert_eq!(failure["experts_losing_a_replica"], 61 * 384);
        assert_eq!(failure["unavailable_experts"], 0);
    }
}
