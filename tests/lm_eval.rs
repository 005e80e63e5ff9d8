//! lm-evaluation-harness (`lm-eval` from PyPI) runs a small loglikelihood task against the
//! real server through its `local-completions` backend, to completion: each choice is
//! scored from the echoed prompt's log probabilities, as with vLLM. Skipped with a
//! `SKIPPED:` line when `lm_eval` with its `api` extra (or `transformers`, with which lm-eval
//! reads the demo model's tokenizer.json) is not importable, unless `MOE_TEST_REQUIRE_LM_EVAL`
//! is set (CI sets it after installing them): then that fails.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

mod serve;
use serve::{Server, demo_model};

mod common;

#[test]
fn lm_eval_scores_a_multiple_choice_task_through_the_completions_api() {
    let importable = Command::new("python3")
        .args(["-c", "import lm_eval, tenacity, transformers"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !importable {
        assert!(
            std::env::var_os("MOE_TEST_REQUIRE_LM_EVAL").is_none(),
            "MOE_TEST_REQUIRE_LM_EVAL is set but python3 cannot import lm_eval and transformers"
        );
        common::skipped(
            "python3 cannot import lm_eval (with its api extra) and transformers (pip install 'lm-eval[api]' transformers)",
        );
        return;
    }
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    server.wait_ready();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let scratch = tempfile::tempdir().unwrap();
    let model_args = format!(
        "model=demo-model,base_url={}/v1/completions,tokenizer_backend=huggingface,\
         tokenizer={},num_concurrent=1,max_retries=1",
        server.base,
        demo_model().display()
    );
    let out = Command::new("python3")
        .args(["-m", "lm_eval", "run", "--model", "local-completions"])
        .args(["--model_args", &model_args])
        .args([
            "--tasks",
            "moe_node_tiny_choice",
            "--include_path",
            "tests/lm_eval",
        ])
        .arg("--output_path")
        .arg(scratch.path())
        .current_dir(root)
        .env("HF_HOME", scratch.path().join("hf"))
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("TOKENIZERS_PARALLELISM", "false")
        .output()
        .unwrap();
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "lm-eval failed:\n{log}");
    // lm-eval writes results_<time>.json under a folder named after the model.
    let results = find_results(scratch.path()).unwrap_or_else(|| panic!("no results:\n{log}"));
    let value: Value = serde_json::from_str(&std::fs::read_to_string(&results).unwrap()).unwrap();
    let task = &value["results"]["moe_node_tiny_choice"];
    let accuracy = task["acc,none"]
        .as_f64()
        .unwrap_or_else(|| panic!("{value}"));
    assert!((0.0..=1.0).contains(&accuracy), "{task}");
    assert_eq!(
        value["n-samples"]["moe_node_tiny_choice"]["effective"], 4,
        "{value}"
    );
    // Every choice of every question was one completions request.
    let scored = server
        .process
        .log_lines()
        .iter()
        .filter(|l| l.contains("request finished"))
        .count();
    assert!(scored >= 10, "{scored} requests finished");
}

fn find_results(dir: &Path) -> Option<std::path::PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = find_results(&path) {
                return Some(found);
            }
        } else if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("results") && n.ends_with(".json"))
        {
            return Some(path);
        }
    }
    None
}
