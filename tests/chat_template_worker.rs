//! Chat templates rendered in worker processes (`moe-node chat-template-worker`): a
//! template that exhausts memory or runs past the deadline fails its render with an error
//! that says so, and the next render works.

mod serve;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use moe_node::model::chat_template::{ChatInput, ChatMessage};
use moe_node::model::template_worker::IsolatedRenderer;
use reqwest::StatusCode;
use serde_json::json;
use serve::{Server, assert_envelope, demo_model};

/// Renders the user's message, unless it asks for a hostile path: `bomb` keeps 90 MB
/// strings until memory runs out (a few instructions, far within the fuel); `slow` builds
/// and counts a 90 MB string a thousand times, one at a time (work the fuel does not count,
/// in little memory, so that the deadline and not the memory limit stops it). The strings
/// are joined from 10 MB ones: a render refuses to repeat one past its output limit (16 MiB)
/// in one step, but memory grown a step at a time is the worker's to stop.
const TEMPLATE: &str = "{% set ns = namespace(l=[]) %}{% set content = messages[0].content %}\
    {% if content in ['bomb', 'slow'] %}{% set x = 'x' * 10000000 %}\
    {% set big = x ~ x ~ x ~ x ~ x ~ x ~ x ~ x ~ x %}{% endif %}\
    {% if content == 'bomb' %}{% for i in range(100) %}\
    {% set ns.l = ns.l + [big ~ i] %}{% endfor %}{{ ns.l|length }}{% elif content == 'slow' %}\
    {% for i in range(1000) %}{{ (big ~ i)|length }}{% endfor %}{% else %}{{ content }}{% endif %}";

fn renderer(deadline: Duration) -> IsolatedRenderer {
    IsolatedRenderer::new(PathBuf::from(serve::BIN), TEMPLATE, "<s>", "</s>")
        .with_deadline(deadline)
}

fn user(content: &str) -> ChatInput {
    vec![ChatMessage::new("user", content)].into()
}

#[test]
fn a_template_that_exhausts_memory_fails_its_render_and_the_next_render_works() {
    // A deadline the memory limit comes well before (a few seconds in a debug build).
    let renderer = renderer(Duration::from_secs(60));
    assert_eq!(renderer.render(&user("hi")).unwrap(), "hi");
    let error = renderer.render(&user("bomb")).unwrap_err();
    assert!(error.contains("exhausted its worker process"), "{error}");
    assert_eq!(renderer.render(&user("again")).unwrap(), "again");
}

#[test]
fn a_template_that_runs_past_the_deadline_is_stopped_and_the_next_render_works() {
    let renderer = renderer(Duration::from_secs(2));
    let started = Instant::now();
    let error = renderer.render(&user("slow")).unwrap_err();
    assert!(error.contains("ran over 2.0 s"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(renderer.render(&user("again")).unwrap(), "again");
}

#[test]
fn template_errors_come_back_from_the_worker_as_they_are() {
    let renderer = IsolatedRenderer::new(
        PathBuf::from(serve::BIN),
        "{{ raise_exception('no ' + messages[0].role) }}",
        "",
        "",
    );
    let error = renderer.render(&user("hi")).unwrap_err();
    assert!(error.contains("no user"), "{error}");
}

/// Over HTTP: the server renders in workers, so the hostile request gets a 400 naming the
/// problem, and the server goes on serving.
#[test]
fn a_server_with_a_hostile_template_answers_the_next_request() {
    let model = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(demo_model()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), model.path().join(entry.file_name())).unwrap();
    }
    let config_path = model.path().join("tokenizer_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["chat_template"] = json!(TEMPLATE);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let server = Server::start_with(
        "[devices]\nbackend = \"cpu\"\n",
        &["--model", model.path().to_str().unwrap()],
    );
    server.wait_ready();
    let chat = |content: &str| {
        json!({"messages": [{"role": "user", "content": content}], "max_tokens": 2,
                "ignore_eos": true})
    };
    assert_envelope(
        server.post("/v1/chat/completions", &chat("bomb")),
        StatusCode::BAD_REQUEST,
        "exhausted its worker process",
    );
    assert_eq!(server.get("/health").status(), StatusCode::OK);
    let body = server.post_ok("/v1/chat/completions", &chat("hello"));
    assert_eq!(body["usage"]["completion_tokens"], 2, "{body}");
}
