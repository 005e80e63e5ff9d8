//! The `openai` Python client, run against the real server: what users of that client see
//! (logprobs, n, echo, the sampling controls, strict fields). Skipped with a `SKIPPED:` line
//! when Python or the client is missing, unless `MOE_TEST_REQUIRE_OPENAI` is set (CI sets
//! it after installing the client): then a missing client fails.

use std::path::Path;
use std::process::Command;

mod serve;
use serve::Server;

mod common;

#[test]
fn the_openai_python_client_gets_logprobs_n_echo_structured_output_and_tool_calls() {
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
        return;
    }
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    server.wait_ready();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&server.base)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("openai client: ok"));
}
