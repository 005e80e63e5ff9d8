//! Log probabilities over HTTP against the real server on the demo model: they are the
//! log-softmax of the engine's own logits (from `moe-node generate`), in the completions
//! endpoint's legacy format (with `echo` scoring the prompt) and the chat endpoint's.

use serde_json::{Value, json};

mod serve;
use serve::{Server, engine_last_logits, ids, read_sse};

/// log-softmax of the engine's logits after `prompt`, from `moe-node generate` on the CPU.
fn engine_logprobs(prompt: &[u64]) -> Vec<f64> {
    let logits = engine_last_logits(prompt);
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let total: f64 = logits.iter().map(|l| (l - max).exp()).sum();
    logits.iter().map(|l| l - max - total.ln()).collect()
}

/// Ids of the `k` largest values, largest first.
fn top_ids(values: &[f64], k: usize) -> Vec<u64> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.into_iter().take(k).map(|i| i as u64).collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-4
}

const PROMPT: [u64; 6] = [256, 72, 101, 108, 108, 111];

#[test]
fn completion_logprobs_are_the_engine_log_softmax_in_the_legacy_format() {
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    server.wait_ready();
    let body = json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 5,
                      "ignore_eos": true, "return_token_ids": true});
    let response = server.post_ok("/v1/completions", &body);
    let choice = &response["choices"][0];
    let generated = ids(&choice["token_ids"]);
    let logprobs = &choice["logprobs"];
    let tokens = logprobs["tokens"].as_array().unwrap();
    let token_logprobs = logprobs["token_logprobs"].as_array().unwrap();
    let top = logprobs["top_logprobs"].as_array().unwrap();
    let offsets = logprobs["text_offset"].as_array().unwrap();
    assert_eq!(tokens.len(), 6);
    assert_eq!(token_logprobs.len(), 6);
    assert_eq!(top.len(), 6);
    let mut offset = 0;
    for j in 0..6 {
        let chosen = token_logprobs[j].as_f64().unwrap();
        let alternatives = top[j].as_object().unwrap();
        assert!((5..=6).contains(&alternatives.len()), "{alternatives:?}");
        // Greedy: the chosen token is the most likely one.
        let best = alternatives
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        assert!(close(chosen, best), "step {j}: {chosen} vs best {best}");
        let text = tokens[j].as_str().unwrap();
        assert!(close(alternatives[text].as_f64().unwrap(), chosen));
        assert_eq!(offsets[j], offset);
        offset += text.chars().count();
    }
    // The first token's values are the engine's logits after the prompt, log-softmaxed.
    let expected = engine_logprobs(&PROMPT);
    let first = token_logprobs[0].as_f64().unwrap();
    assert!(
        close(first, expected[generated[0] as usize]),
        "{first} vs the engine's {}",
        expected[generated[0] as usize]
    );
    let mut shown: Vec<f64> = top[0]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .collect();
    shown.sort_by(|a, b| b.total_cmp(a));
    let engine_top: Vec<f64> = top_ids(&expected, 5)
        .iter()
        .map(|&i| expected[i as usize])
        .collect();
    for (a, b) in shown.iter().zip(&engine_top) {
        assert!(
            close(*a, *b),
            "top 5 {shown:?} vs the engine's {engine_top:?}"
        );
    }

    // Sampling at a temperature does not change the values: they are the raw model's.
    let hot = server.post_ok(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 1, "temperature": 1.7, "seed": 5,
                "logprobs": 0, "return_token_ids": true, "presence_penalty": 1.0}),
    );
    let drawn = ids(&hot["choices"][0]["token_ids"])[0];
    let value = hot["choices"][0]["logprobs"]["token_logprobs"][0]
        .as_f64()
        .unwrap();
    assert!(close(value, expected[drawn as usize]));

    // Streamed, each token's chunk carries its own entry; together they are the same.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let (events, done) = read_sse(server.post("/v1/completions", &stream_body));
    assert!(done);
    let mut streamed_tokens = Vec::new();
    let mut streamed_offsets = Vec::new();
    for event in &events {
        let lp = &event["choices"][0]["logprobs"];
        if lp.is_null() {
            continue;
        }
        streamed_tokens.extend(lp["tokens"].as_array().unwrap().clone());
        streamed_offsets.extend(lp["text_offset"].as_array().unwrap().clone());
    }
    assert_eq!(&streamed_tokens, tokens);
    assert_eq!(&streamed_offsets, offsets);
}

#[test]
fn chat_logprobs_carry_token_bytes_and_the_top_alternatives() {
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    server.wait_ready();
    let messages = json!([{"role": "user", "content": "Hello"}]);
    let response = server.post_ok(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 5, "temperature": 0,
                "logprobs": true, "top_logprobs": 3, "return_token_ids": true}),
    );
    let choice = &response["choices"][0];
    let content = choice["logprobs"]["content"].as_array().unwrap();
    let generated = ids(&choice["token_ids"]);
    assert_eq!(content.len(), generated.len());
    for (entry, &id) in content.iter().zip(&generated) {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert!(close(
            entry["logprob"].as_f64().unwrap(),
            top[0]["logprob"].as_f64().unwrap()
        ));
        assert_eq!(entry["token"], top[0]["token"]);
        // The demo model's tokens are bytes (or special tokens, given by their text).
        let bytes: Vec<u64> = ids(&entry["bytes"]);
        if id < 256 {
            assert_eq!(bytes, vec![id]);
        } else {
            assert_eq!(
                bytes,
                entry["token"]
                    .as_str()
                    .unwrap()
                    .bytes()
                    .map(u64::from)
                    .collect::<Vec<_>>()
            );
        }
    }
    // Without top_logprobs: the chosen token only.
    let response = server.post_ok(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2, "temperature": 0, "logprobs": true}),
    );
    let entry = &response["choices"][0]["logprobs"]["content"][0];
    assert_eq!(entry["top_logprobs"], json!([]));
    assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
}

/// `echo` with `logprobs` scores the prompt (as evaluation harnesses do): each prompt token
/// after the first gets the engine's log probability of it given the tokens before; the
/// first gets null. With `max_tokens: 0` nothing is generated.
#[test]
fn echo_scores_the_prompt_as_the_engine_does_across_prefill_chunks() {
    // Three tokens per step: the prompt is prefilled in several chunks.
    let server = Server::start(
        "[devices]\nbackend = \"cpu\"\n[batching]\nmax_sequences = 2\nmax_tokens_per_step = 3\n",
    );
    server.wait_ready();
    let prompt = "aé, b";
    let tokenized: Value = server.post_ok("/tokenize", &json!({"prompt": prompt}));
    let prompt_ids = ids(&tokenized["tokens"]);
    assert_eq!(prompt_ids.len(), 6);
    let response = server.post_ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 2}),
    );
    let choice = &response["choices"][0];
    assert_eq!(choice["text"], prompt);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(response["usage"]["completion_tokens"], 0);
    let logprobs = &choice["logprobs"];
    let token_logprobs = logprobs["token_logprobs"].as_array().unwrap();
    let top = logprobs["top_logprobs"].as_array().unwrap();
    assert_eq!(token_logprobs.len(), prompt_ids.len());
    assert!(token_logprobs[0].is_null() && top[0].is_null());
    for i in 1..prompt_ids.len() {
        let expected = engine_logprobs(&prompt_ids[..i])[prompt_ids[i] as usize];
        let got = token_logprobs[i].as_f64().unwrap();
        assert!(
            close(got, expected),
            "prompt token {i}: {got} vs {expected}"
        );
        assert!(top[i].as_object().unwrap().len() >= 2);
    }
    // The é is two byte tokens: each its own entry, the text whole.
    let tokens: Vec<&str> = logprobs["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens, ["a", "bytes:\\xc3", "bytes:\\xa9", ",", " ", "b"]);

    // lm-eval's form: echo, logprobs 1, one token generated after the prompt's entries.
    let response = server.post_ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1, "echo": true, "logprobs": 1,
                "temperature": 0}),
    );
    let choice = &response["choices"][0];
    assert!(choice["text"].as_str().unwrap().starts_with(prompt));
    let again = choice["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(again.len(), prompt_ids.len() + 1);
    for i in 1..prompt_ids.len() {
        assert!(close(
            again[i].as_f64().unwrap(),
            token_logprobs[i].as_f64().unwrap()
        ));
    }
    // echo without logprobs: the prompt's text, then the completion's.
    let plain = server.post_ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 3, "echo": true, "temperature": 0}),
    );
    assert!(
        plain["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with(prompt)
    );
    assert!(plain["choices"][0]["logprobs"].is_null());

    // Streamed, the prompt comes first in a chunk of its own: the chunks put together are
    // the whole response, text and legacy log probabilities (offsets included).
    let body = json!({"prompt": prompt, "max_tokens": 3, "echo": true, "logprobs": 1,
                      "temperature": 0});
    let whole = server.post_ok("/v1/completions", &body);
    let mut streamed_body = body.clone();
    streamed_body["stream"] = json!(true);
    let (events, done) = read_sse(server.post("/v1/completions", &streamed_body));
    assert!(done, "the stream ends with [DONE]");
    let mut text = String::new();
    let mut joined = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []});
    for event in &events {
        let choice = &event["choices"][0];
        text.push_str(choice["text"].as_str().unwrap());
        if let Some(lp) = choice["logprobs"].as_object() {
            for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                let part = lp[key].as_array().unwrap().clone();
                joined[key].as_array_mut().unwrap().extend(part);
            }
        }
    }
    assert_eq!(events[0]["choices"][0]["text"], prompt, "the prompt first");
    let whole_choice = &whole["choices"][0];
    assert_eq!(text, whole_choice["text"].as_str().unwrap());
    for key in ["tokens", "text_offset"] {
        assert_eq!(joined[key], whole_choice["logprobs"][key], "{key}");
    }
    let (streamed_lp, whole_lp) = (
        joined["token_logprobs"].as_array().unwrap(),
        whole_choice["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap(),
    );
    assert_eq!(streamed_lp.len(), prompt_ids.len() + 3);
    assert!(streamed_lp[0].is_null());
    for (a, b) in streamed_lp.iter().zip(whole_lp).skip(1) {
        assert!(close(a.as_f64().unwrap(), b.as_f64().unwrap()));
    }
    // Scoring only (`max_tokens: 0`), streamed: the prompt and its log probabilities.
    let (events, done) = read_sse(server.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 2,
                "stream": true}),
    ));
    assert!(done);
    let first = &events[0]["choices"][0];
    assert_eq!(first["text"], prompt);
    assert_eq!(
        first["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        prompt_ids.len()
    );
    let last = &events.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], "length");
}
