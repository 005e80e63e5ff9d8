//! A reasoning model over HTTP: `chat_template_kwargs` reach the chat template (thinking
//! mode on or off), the reasoning comes back as `reasoning_content` beside `content`, whole
//! and streamed, or not at all with `include_reasoning: false`; an assistant's reasoning sent
//! back is rendered by the template; bad values are 400s naming the field.
//!
//! The demo model (random weights, a byte-level tokenizer) with a template that opens the
//! `<think>` block in thinking mode, as DeepSeek-V3.1 to V4 do: what it generates is what
//! `/v1/completions` generates from the same prompt, split at its first `</think>`.

mod common;
mod serve;

use std::path::PathBuf;

use serde_json::{Value, json};
use serve::{Server, read_sse};

fn demo_model_that_thinks() -> PathBuf {
    serve::demo_model_with_template("demo-model-thinking", serve::THINKING_TEMPLATE)
}

fn server() -> Server {
    let dir = demo_model_that_thinks();
    let server = Server::start_with(
        "[devices]\nbackend = \"cpu\"\n",
        &["--model", dir.to_str().unwrap()],
    );
    server.wait_ready();
    server
}

fn question() -> Value {
    json!([{"role": "user", "content": "What is 2 + 2?"}])
}

/// What `/v1/completions` generates, greedily, from the chat prompt `kwargs` render.
fn completion_text(server: &Server, kwargs: &Value, max_tokens: usize) -> String {
    let tokens = server.post_ok(
        "/tokenize",
        &json!({"messages": question(), "chat_template_kwargs": kwargs}),
    )["tokens"]
        .clone();
    let body = server.post_ok(
        "/v1/completions",
        &json!({"prompt": tokens, "max_tokens": max_tokens, "temperature": 0}),
    );
    body["choices"][0]["text"].as_str().unwrap().to_string()
}

/// `text` split as a reader of the protocol expects it, after a prompt that opened the
/// block: the reasoning before the first `</think>`, the answer after it, ends trimmed.
fn expected_split(text: &str) -> (String, Option<String>) {
    match text.split_once("</think>") {
        Some((reasoning, answer)) => (
            reasoning.trim().to_string(),
            Some(answer.trim_start().to_string()).filter(|a| !a.is_empty()),
        ),
        None => (text.trim().to_string(), None),
    }
}

#[test]
fn thinking_mode_returns_the_reasoning_apart_whole_and_streamed() {
    let server = server();
    let on = json!({"thinking": true});
    let text = completion_text(&server, &on, 24);
    let (reasoning, answer) = expected_split(&text);
    assert!(!reasoning.is_empty(), "{text:?}");
    let request = json!({"messages": question(), "chat_template_kwargs": on,
                         "max_tokens": 24, "temperature": 0});
    let body = server.post_ok("/v1/chat/completions", &request);
    let message = &body["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], json!(reasoning), "{body}");
    assert_eq!(message["content"], json!(answer), "{body}");

    // Streamed: reasoning deltas, then the answer's; together, the whole response's.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let (events, done) = read_sse(server.post("/v1/chat/completions", &streamed));
    assert!(done);
    let joined = |field: &str| -> String {
        events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"][field].as_str())
            .collect()
    };
    assert_eq!(joined("reasoning_content"), reasoning, "{events:?}");
    assert_eq!(joined("content"), answer.clone().unwrap_or_default());
    let finish = events
        .iter()
        .filter_map(|e| e["choices"][0]["finish_reason"].as_str())
        .collect::<Vec<_>>();
    assert_eq!(finish, ["length"], "{events:?}");

    // `include_reasoning: false`: the reasoning is split off and not returned.
    let mut without = request.clone();
    without["include_reasoning"] = json!(false);
    let body = server.post_ok("/v1/chat/completions", &without);
    let message = &body["choices"][0]["message"];
    assert!(message.get("reasoning_content").is_none(), "{body}");
    assert_eq!(
        message["content"].as_str().unwrap_or_default(),
        answer.unwrap_or_default()
    );
    let mut streamed = without;
    streamed["stream"] = json!(true);
    let (events, _) = read_sse(server.post("/v1/chat/completions", &streamed));
    assert!(
        events
            .iter()
            .all(|e| e["choices"][0]["delta"].get("reasoning_content").is_none()),
        "{events:?}"
    );
}

#[test]
fn chat_mode_answers_without_reasoning() {
    let server = server();
    for kwargs in [json!({"thinking": false}), json!({})] {
        let text = completion_text(&server, &kwargs, 16);
        let body = server.post_ok(
            "/v1/chat/completions",
            &json!({"messages": question(), "chat_template_kwargs": kwargs,
                    "max_tokens": 16, "temperature": 0}),
        );
        let message = &body["choices"][0]["message"];
        assert_eq!(message["content"], json!(text), "{body}");
        assert!(message["reasoning_content"].is_null(), "{body}");
    }
}

#[test]
fn reasoning_sent_back_is_rendered_and_bad_values_are_refused() {
    let server = server();
    let count = |messages: Value| -> u64 {
        server.post_ok("/tokenize", &json!({"messages": messages}))["count"]
            .as_u64()
            .unwrap()
    };
    let turn = |reasoning: Option<&str>| {
        let mut assistant = json!({"role": "assistant", "content": "4"});
        if let Some(r) = reasoning {
            assistant["reasoning_content"] = json!(r);
        }
        json!([{"role": "user", "content": "2 + 2?"}, assistant,
               {"role": "user", "content": "And 3 + 3?"}])
    };
    // The demo's tokens are bytes: the template adds `<think>`, the reasoning, `</think>`.
    let added = "<think>Add them.</think>".len() as u64;
    assert_eq!(count(turn(Some("Add them."))), count(turn(None)) + added);
    // vLLM's newer name for it is taken too.
    let mut renamed = turn(None);
    renamed[1]["reasoning"] = json!("Add them.");
    assert_eq!(count(renamed), count(turn(None)) + added);

    for (body, param, says) in [
        (
            json!({"messages": question(), "chat_template_kwargs": [true]}),
            "chat_template_kwargs",
            "must be an object",
        ),
        (
            json!({"messages": question(), "chat_template_kwargs": {"messages": []}}),
            "chat_template_kwargs",
            "cannot set `messages`",
        ),
        (
            json!({"messages": question(), "reasoning_effort": "extreme"}),
            "reasoning_effort",
            "must be one of",
        ),
        (
            json!({"messages": [{"role": "user", "content": "Hi", "reasoning_content": "x"}]}),
            "messages",
            "only assistant messages have reasoning_content",
        ),
        (
            json!({"messages": question(), "include_reasoning": "yes"}),
            "",
            "expected a boolean",
        ),
    ] {
        let response = server.post("/v1/chat/completions", &body);
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().unwrap();
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{message}");
        if !param.is_empty() {
            assert_eq!(error["error"]["param"], param, "{error}");
        }
    }
    // The node serves on.
    server.post_ok(
        "/v1/chat/completions",
        &json!({"messages": question(), "max_tokens": 2}),
    );
}

/// A model whose template shows no reasoning returns none: no `reasoning_content` field.
#[test]
fn a_model_without_reasoning_has_no_reasoning_field() {
    let server = Server::start_with("[devices]\nbackend = \"cpu\"\n", &[]);
    server.wait_ready();
    let body = server.post_ok(
        "/v1/chat/completions",
        &json!({"messages": question(), "max_tokens": 4, "temperature": 0,
                "chat_template_kwargs": {"thinking": true}}),
    );
    assert!(
        body["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{body}"
    );
}
