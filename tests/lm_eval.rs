//! lm-evaluation-harness (`lm-eval` from PyPI) runs a small loglikelihood task against the
//! real server through its `local-completions` backend, to completion: each choice is
//! scored from the echoed prompt's log probabilities, as with vLLM; and a small generation
//! task through `local-chat-completions`. Skipped with a
//! `SKIPPED:` line when `lm_eval` with its `api` extra (or `transformers`, with which lm-eval
//! reads the demo model's tokenizer.json) is not importable, unless `MOE_TEST_REQUIRE_LM_EVAL`
//! is set (CI sets it after installing them): then that fails.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

mod serve;
use serve::{Server, demo_model};

mod common;

/// Whether lm-eval can run here; a skip (or, with `MOE_TEST_REQUIRE_LM_EVAL`, a failure)
/// when it cannot.
fn lm_eval_available() -> bool {
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
    }
    importable
}

/// Runs lm-eval's `backend` with `model_args` on task `task` (from tests/lm_eval/) to
/// completion, and returns its results file.
fn run_lm_eval(backend: &str, model_args: &str, task: &str, extra: &[&str]) -> Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let scratch = tempfile::tempdir().unwrap();
    let out = Command::new("python3")
        .args(["-m", "lm_eval", "run", "--model", backend])
        .args(["--model_args", model_args])
        .args(["--tasks", task, "--include_path", "tests/lm_eval"])
        .args(extra)
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
    let results = find_results(scratch.path()).unwrap_or_else(|| panic!("no results:\n{log}"));
    serde_json::from_str(&std::fs::read_to_string(&results).unwrap()).unwrap()
}

fn finished_requests(server: &Server) -> usize {
    server
        .process
        .log_lines()
        .iter()
        .filter(|l| l.contains("request finished"))
        .count()
}

#[test]
fn lm_eval_scores_a_multiple_choice_task_through_the_completions_api() {
    if !lm_eval_available() {
        return;
    }
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    server.wait_ready();
    let model_args = format!(
        "model=demo-model,base_url={}/v1/completions,tokenizer_backend=huggingface,\
         tokenizer={},num_concurrent=1,max_retries=1",
        server.base,
        demo_model().display()
    );
    let value = run_lm_eval(
        "local-completions",
        &model_args,
        "moe_node_tiny_choice",
        &[],
    );
    let task = &value["results"]["moe_node_tiny_choice"];
    let accuracy = task["acc,none"]
        .as_f64()
        .unwrap_or_else(|| panic!("{value}"));
    assert!((0.0..=1.0).contains(&accuracy), "{task}");
    assert_eq!(
        value["n-samples"]["moe_node_tiny_choice"]["effective"], 4,
        "{value}"
    );
    let scored = finished_requests(&server);
    assert!(scored >= 10, "{scored} requests finished");
}

/// A generation task through `local-chat-completions`: each prompt goes out as a chat
/// request (greedy, `stop` at a newline, 8 tokens at most) and the text is scored against
/// the target. The random-weight demo model gets none right; the run must complete.
#[test]
fn lm_eval_runs_a_generation_task_through_the_chat_completions_api() {
    if !lm_eval_available() {
        return;
    }
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    server.wait_ready();
    let model_args = format!(
        "model=demo-model,base_url={}/v1/chat/completions,num_concurrent=1,max_retries=1",
        server.base
    );
    let value = run_lm_eval(
        "local-chat-completions",
        &model_args,
        "moe_node_tiny_generate",
        &["--apply_chat_template"],
    );
    let task = &value["results"]["moe_node_tiny_generate"];
    let score = task["exact_match,none"]
        .as_f64()
        .unwrap_or_else(|| panic!("{value}"));
    assert!((0.0..=1.0).contains(&score), "{task}");
    assert_eq!(
        value["n-samples"]["moe_node_tiny_generate"]["effective"], 4,
        "{value}"
    );
    let generated = finished_requests(&server);
    assert_eq!(generated, 4, "one chat request per prompt");
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
