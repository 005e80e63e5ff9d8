//! The `openai` Python client, run against the real server: what users of that client see
//! (logprobs, n, echo, the sampling controls, strict fields). Skipped with a `SKIPPED:` line
//! when Python or the client is missing, unless `MOE_TEST_REQUIRE_OPENAI` is set (CI sets
//! it after installing the client): then a missing client fails.

use std::path::Path;
use std::process::Command;

mod serve;
use serve::Server;

mod common;

/// Whether python3 can import the client; if not, says SKIPPED (or fails where CI requires
/// the client).
fn openai_importable() -> bool {
    let importable = Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !importable {
        assert!(
            std::env::var_os("MOE_TEST_REQUIRE_OPENAI").is_none(),
            "MOE_TEST_REQUIRE_OPENAI is set but `import openai` fails in python3"
        );
        common::skipped("python3 cannot import openai (pip install openai)");
    }
    importable
}

/// Runs `tests/clients/<script>` against a fresh CPU server on the demo model; returns its
/// stdout after checking it exited 0.
fn run_client(script: &str) -> String {
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    run_client_on(&server, script, &[])
}

/// Runs `tests/clients/<script> BASE ARGS...` against `server`; returns its stdout after
/// checking it exited 0.
fn run_client_on(server: &Server, script: &str, args: &[&str]) -> String {
    server.wait_ready();
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/clients")
        .join(script);
    let out = Command::new("python3")
        .arg(&script)
        .arg(&server.base)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn the_openai_python_client_gets_logprobs_n_echo_structured_output_and_tool_calls() {
    if !openai_importable() {
        return;
    }
    assert!(run_client("openai_client.py").contains("openai client: ok"));
}

/// A named `tool_choice` on the random-weight demo model, at temperature 0.8 for ten
/// seeds, whole and streamed: a valid `get_weather` call every time, within the length
/// its schema allows (with free whitespace between JSON tokens it ran past max_tokens).
#[test]
fn a_named_tool_call_through_the_openai_client_always_finishes() {
    if !openai_importable() {
        return;
    }
    let stdout = run_client("tool_calls_finish.py");
    eprintln!("{}", stdout.trim());
    assert!(stdout.contains("tool calls: ok"), "{stdout}");
}

/// A model that thinks (the demo model with a template that opens `<think>` in thinking
/// mode): the client reads `reasoning_content` whole and streamed, sends `reasoning_effort`
/// and `chat_template_kwargs`, and sends the reasoning back.
#[test]
fn the_openai_python_client_reads_and_sends_back_reasoning() {
    if !openai_importable() {
        return;
    }
    let dir = serve::demo_model_with_template("demo-model-thinking", serve::THINKING_TEMPLATE);
    let server = Server::start_with(
        "[devices]\nbackend = \"cpu\"\n",
        &["--model", dir.to_str().unwrap()],
    );
    let stdout = run_client_on(&server, "reasoning.py", &["demo-model-thinking"]);
    assert!(stdout.contains("reasoning: ok"), "{stdout}");
}
