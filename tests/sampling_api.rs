//! The sampling controls and `n` over HTTP, against the real server on the demo model: each
//! one's effect is checked against greedy decoding, against the engine's own logits (from
//! `moe-node generate`), or against the same rule computed by hand.

use moe_node::engine::argmax;
use std::collections::HashMap;

use reqwest::StatusCode;
use serde_json::{Value, json};

mod serve;
use serve::{Server, engine_last_logits, ids, read_sse};

/// The engine's logits after `prompt`, from `moe-node generate` on the CPU.
fn engine_logits(prompt: &[u32]) -> Vec<f32> {
    engine_last_logits(prompt)
        .into_iter()
        .map(|l| l as f32)
        .collect()
}

fn completion_ids(server: &Server, body: Value) -> Vec<u64> {
    let mut body = body;
    body["return_token_ids"] = json!(true);
    let response = server.post_ok("/v1/completions", &body);
    ids(&response["choices"][0]["token_ids"])
}

/// The id of a demo-model token from its text: one byte as a character, `bytes:\xNN` for a
/// byte that is not UTF-8 alone, or a special token.
fn demo_token_id(text: &str) -> u64 {
    if let [byte] = text.as_bytes() {
        return u64::from(*byte);
    }
    if let Some(hex) = text.strip_prefix("bytes:\\x") {
        return u64::from_str_radix(hex, 16).unwrap();
    }
    match text {
        "<|im_start|>" => 256,
        "<|im_end|>" => 257,
        "<|endoftext|>" => 258,
        _ => panic!("not a demo token: {text:?}"),
    }
}

const PROMPT: [u32; 6] = [256, 72, 101, 108, 108, 111];

#[test]
fn top_k_min_p_logit_bias_and_stop_tokens_act_as_defined() {
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    server.wait_ready();
    let base = json!({"prompt": PROMPT, "max_tokens": 8, "ignore_eos": true});
    let with = |extra: Value| {
        let mut body = base.clone();
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let greedy = completion_ids(&server, with(json!({"temperature": 0})));
    assert_eq!(greedy.len(), 8);

    // top_k 1 at a high temperature leaves only the most likely token: greedy.
    for seed in [1, 2] {
        let got = completion_ids(
            &server,
            with(json!({"temperature": 2.0, "top_k": 1, "seed": seed})),
        );
        assert_eq!(got, greedy, "top_k 1, seed {seed}");
    }
    // min_p 1 keeps only tokens as likely as the best: greedy too.
    let got = completion_ids(
        &server,
        with(json!({"temperature": 2.0, "min_p": 1.0, "seed": 3})),
    );
    assert_eq!(got, greedy, "min_p 1");
    // Without them, that temperature wanders off greedy.
    let hot = completion_ids(&server, with(json!({"temperature": 2.0, "seed": 3})));
    assert_ne!(hot, greedy, "temperature 2 gave the greedy tokens");

    // A large bias forces its token, greedy or sampled; a large negative one bans it.
    for temperature in [0.0, 1.0] {
        let got = completion_ids(
            &server,
            with(json!({"temperature": temperature, "seed": 4, "logit_bias": {"65": 100}})),
        );
        assert_eq!(got, vec![65; 8], "temperature {temperature}");
    }
    let banned = greedy[0];
    let got = completion_ids(
        &server,
        with(json!({"temperature": 0, "logit_bias": {banned.to_string(): -100}})),
    );
    assert!(!got.contains(&banned), "{banned} banned but drawn: {got:?}");

    // A stop token ends the completion with "stop" right after it; min_tokens keeps it
    // (and EOS) from being drawn before.
    let mut body = with(json!({"temperature": 0, "stop_token_ids": [greedy[0]]}));
    body["return_token_ids"] = json!(true);
    let stopped = server.post_ok("/v1/completions", &body);
    assert_eq!(ids(&stopped["choices"][0]["token_ids"]), vec![greedy[0]]);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    let got = completion_ids(
        &server,
        with(json!({"temperature": 0, "stop_token_ids": [greedy[0]], "min_tokens": 3})),
    );
    assert!(got.len() >= 3, "{got:?}");
    assert!(!got[..3].contains(&greedy[0]), "{got:?}");
}

/// The repetition penalty on the first token, computed by hand from the engine's logits:
/// every prompt token's logit is divided by it when positive, multiplied when negative.
#[test]
fn repetition_penalty_matches_the_rule_applied_to_the_engine_logits() {
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    server.wait_ready();
    // Every byte token is in the prompt, the special tokens are not: the penalty reorders
    // the two kinds.
    let prompt: Vec<u32> = (0..256).collect();
    let logits = engine_logits(&prompt);
    let greedy = argmax(&logits);
    for penalty in [1.3f32, 5.0, 0.5] {
        let mut penalised = logits.clone();
        for &t in &prompt {
            let l = &mut penalised[t as usize];
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
        let expected = argmax(&penalised);
        let got = completion_ids(
            &server,
            json!({"prompt": prompt, "max_tokens": 1, "temperature": 0,
                   "repetition_penalty": penalty}),
        );
        assert_eq!(
            got,
            vec![u64::from(expected)],
            "repetition_penalty {penalty}"
        );
        if penalty == 5.0 {
            assert_ne!(
                expected, greedy,
                "the penalty changed nothing on this prompt"
            );
        }
    }
}

/// Presence and frequency penalties subtract from the logits of tokens already generated:
/// at each step of a penalised greedy completion, the token drawn must be the argmax of
/// the raw log probabilities (which the server returns) minus the penalties of that
/// completion's own earlier tokens. Negative penalties reward repeating.
#[test]
fn presence_and_frequency_penalties_match_the_rule_step_by_step() {
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    server.wait_ready();
    let plain = completion_ids(
        &server,
        json!({"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": true}),
    );
    let repeats = |t: &[u64]| t.len() - t.iter().collect::<std::collections::HashSet<_>>().len();
    for (presence, frequency) in [(0.7f32, 0.4f32), (-1.5, -0.5)] {
        let body = json!({"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                          "ignore_eos": true, "logprobs": 20, "return_token_ids": true,
                          "presence_penalty": presence, "frequency_penalty": frequency});
        let response = server.post_ok("/v1/completions", &body);
        let choice = &response["choices"][0];
        let tokens = ids(&choice["token_ids"]);
        let top = choice["logprobs"]["top_logprobs"].as_array().unwrap();
        let texts = choice["logprobs"]["tokens"].as_array().unwrap();
        let named: Vec<u64> = texts
            .iter()
            .map(|t| demo_token_id(t.as_str().unwrap()))
            .collect();
        assert_eq!(named, tokens, "logprobs.tokens name the generated tokens");
        let penalty =
            |count: u32| frequency * count as f32 + if count > 0 { presence } else { 0.0 };
        let mut counts: HashMap<u64, u32> = HashMap::new();
        let mut checked = 0;
        for (step, (&token, alternatives)) in tokens.iter().zip(top).enumerate() {
            let alternatives: HashMap<u64, f32> = alternatives
                .as_object()
                .unwrap()
                .iter()
                .map(|(text, lp)| (demo_token_id(text), lp.as_f64().unwrap() as f32))
                .collect();
            let lowest_raw = alternatives.values().copied().fold(f32::INFINITY, f32::min);
            let (best_id, best_value) = alternatives
                .iter()
                .map(|(&id, &raw)| (id, raw - penalty(counts.get(&id).copied().unwrap_or(0))))
                .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
                .unwrap();
            // A token not shown has a raw log probability of at most the lowest shown: the
            // argmax is among those shown when it beats that bound, penalties included.
            let bound = counts
                .iter()
                .filter(|(id, _)| !alternatives.contains_key(id))
                .map(|(_, &count)| lowest_raw - penalty(count))
                .fold(lowest_raw, f32::max);
            if best_value > bound + 1e-4 {
                assert_eq!(
                    token, best_id,
                    "presence {presence}, frequency {frequency}, step {step}"
                );
                checked += 1;
            }
            *counts.entry(token).or_default() += 1;
        }
        assert!(checked >= 8, "only {checked} of 16 steps could be checked");
        if presence < 0.0 {
            assert!(
                repeats(&tokens) > repeats(&plain),
                "rewarding repeats did not repeat more: {tokens:?} vs {plain:?}"
            );
        }
    }
}

#[test]
fn n_choices_are_distinct_reproducible_and_each_its_own_seed() {
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    server.wait_ready();
    let body = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 42,
                      "n": 3, "ignore_eos": true, "return_token_ids": true});
    let first = server.post_ok("/v1/completions", &body);
    let again = server.post_ok("/v1/completions", &body);
    let choices = first["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut all = Vec::new();
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["finish_reason"], "length");
        let tokens = ids(&choice["token_ids"]);
        assert_eq!(tokens, ids(&again["choices"][i]["token_ids"]), "choice {i}");
        // Choice i samples as a one-choice request with seed 42 + i.
        let alone = completion_ids(
            &server,
            json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0,
                   "seed": 42 + i, "ignore_eos": true}),
        );
        assert_eq!(tokens, alone, "choice {i}");
        all.push(tokens);
    }
    assert!(
        all[0] != all[1] && all[1] != all[2] && all[0] != all[2],
        "{all:?}"
    );
    assert_eq!(first["usage"]["prompt_tokens"], PROMPT.len());
    assert_eq!(first["usage"]["completion_tokens"], 24);

    // Streamed: chunks carry their choice's index; each choice's deltas add up to its text.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let (events, done) = read_sse(server.post("/v1/completions", &stream_body));
    assert!(done);
    let mut texts = vec![String::new(); 3];
    let mut streamed_ids = vec![Vec::new(); 3];
    let mut finished = 0;
    for event in &events {
        let Some(choice) = event["choices"].get(0) else {
            assert_eq!(event["usage"]["completion_tokens"], 24);
            continue;
        };
        let index = choice["index"].as_u64().unwrap() as usize;
        texts[index].push_str(choice["text"].as_str().unwrap());
        streamed_ids[index].extend(ids(&choice["token_ids"]));
        finished += usize::from(!choice["finish_reason"].is_null());
    }
    assert_eq!(finished, 3);
    for i in 0..3 {
        assert_eq!(streamed_ids[i], all[i], "choice {i}");
        assert_eq!(texts[i], choices[i]["text"].as_str().unwrap(), "choice {i}");
    }

    // Chat takes n too.
    let chat = server.post_ok(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "n": 2, "seed": 7,
                "temperature": 1.0, "max_tokens": 6}),
    );
    assert_eq!(chat["choices"].as_array().unwrap().len(), 2);
    assert_eq!(chat["choices"][1]["index"], 1);
}

#[test]
fn bad_sampling_values_and_unknown_fields_get_400_naming_the_parameter() {
    let server = Server::start("[devices]\nbackend = \"cpu\"\n[batching]\nmax_sequences = 4\n");
    server.wait_ready();
    let cases: Vec<(&str, Value, &str, &str)> = vec![
        (
            "/v1/completions",
            json!({"top_k": -2}),
            "top_k",
            "at least 1",
        ),
        ("/v1/completions", json!({"min_p": 1.5}), "min_p", "[0, 1]"),
        (
            "/v1/completions",
            json!({"presence_penalty": 3}),
            "presence_penalty",
            "[-2, 2]",
        ),
        (
            "/v1/completions",
            json!({"frequency_penalty": -2.5}),
            "frequency_penalty",
            "[-2, 2]",
        ),
        (
            "/v1/completions",
            json!({"repetition_penalty": 0}),
            "repetition_penalty",
            "more than 0",
        ),
        (
            "/v1/completions",
            json!({"logit_bias": {"abc": 1}}),
            "logit_bias",
            "not a token id",
        ),
        (
            "/v1/completions",
            json!({"logit_bias": {"5": 101}}),
            "logit_bias",
            "[-100, 100]",
        ),
        (
            "/v1/completions",
            json!({"logit_bias": {"99999": 1}}),
            "logit_bias",
            "vocabulary",
        ),
        (
            "/v1/completions",
            json!({"stop_token_ids": [99999]}),
            "stop_token_ids",
            "vocabulary",
        ),
        (
            "/v1/completions",
            json!({"min_tokens": 9, "max_tokens": 4}),
            "min_tokens",
            "max_tokens",
        ),
        ("/v1/completions", json!({"n": 0}), "n", "from 1 to 4"),
        ("/v1/completions", json!({"n": 5}), "n", "from 1 to 4"),
        (
            "/v1/completions",
            json!({"logprobs": 21}),
            "logprobs",
            "from 0 to 20",
        ),
        (
            "/v1/completions",
            json!({"logprobs": true}),
            "logprobs",
            "number of alternatives",
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 0}),
            "max_tokens",
            "echo",
        ),
        (
            "/v1/chat/completions",
            json!({"logprobs": 3}),
            "logprobs",
            "true or false",
        ),
        (
            "/v1/chat/completions",
            json!({"top_logprobs": 2}),
            "top_logprobs",
            "logprobs: true",
        ),
        (
            "/v1/chat/completions",
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
            "from 0 to 20",
        ),
    ];
    for (path, extra, param, part) in cases {
        let mut body = match path {
            "/v1/completions" => json!({"prompt": "hi"}),
            _ => json!({"messages": [{"role": "user", "content": "hi"}]}),
        };
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let response = server.post(path, &body);
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
        let error: Value = response.json().unwrap();
        assert_eq!(error["error"]["param"], param, "{body}: {error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(part),
            "{part:?} not in {message:?} ({body})"
        );
    }
    // Fields of the other endpoint, and features not supported, are unknown fields.
    let unknown: Vec<(&str, Value, &str)> = vec![
        (
            "/v1/completions",
            json!({"prompt": "hi", "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [], "echo": true}),
            "echo",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [], "functions": []}),
            "functions",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "guided_json": {"type": "object"}}),
            "guided_json",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_token": 3}),
            "max_token",
        ),
    ];
    for (path, body, field) in unknown {
        let response = server.post(path, &body);
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
        let error: Value = response.json().unwrap();
        assert_eq!(error["error"]["code"], "unknown_field", "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(&format!("`{field}`")), "{message}");
    }
}

/// Content and ids a chat stream sent, chunk by chunk: `(text of the chunk, its ids)`.
fn chat_chunks(events: &[Value]) -> Vec<(String, Vec<u64>)> {
    events
        .iter()
        .filter_map(|e| e["choices"].get(0))
        .map(|c| {
            let text = c["delta"]["content"].as_str().unwrap_or("").to_string();
            let ids = c["token_ids"]
                .as_array()
                .map_or(Vec::new(), |_| ids(&c["token_ids"]));
            (text, ids)
        })
        .collect()
}

/// What the gateway does when the node running a stream dies: it sends the request again
/// to another node with the tokens the client already has (`resume_token_ids`). The new
/// stream must carry exactly the rest (no role chunk again, no token twice, none missing),
/// greedy or seeded, and its usage must be the whole generation's.
#[test]
fn a_generation_resumed_from_its_first_tokens_goes_on_as_it_would_have() {
    let server = Server::start("[devices]\nbackend = \"cpu\"\n");
    server.wait_ready();
    for temperature in [0.0, 0.9] {
        let body = json!({"messages": [{"role": "user", "content": "Tell me a story"}],
                          "max_tokens": 24, "temperature": temperature, "seed": 5,
                          "ignore_eos": true, "stream": true, "return_token_ids": true,
                          "stream_options": {"include_usage": true}});
        let (whole, done) = read_sse(server.post("/v1/chat/completions", &body));
        assert!(done);
        let chunks = chat_chunks(&whole);
        let all_ids: Vec<u64> = chunks.iter().flat_map(|c| c.1.clone()).collect();
        let all_text: String = chunks.iter().map(|c| c.0.as_str()).collect();
        assert_eq!(all_ids.len(), 24);
        let usage = whole.last().unwrap()["usage"].clone();
        assert_eq!(usage["completion_tokens"], 24);
        for cut in [1, 7, 23] {
            // The client has the chunks up to the one holding token `cut`.
            let mut sent_ids = Vec::new();
            let mut sent_text = String::new();
            for (text, chunk_ids) in &chunks {
                if sent_ids.len() >= cut {
                    break;
                }
                sent_text.push_str(text);
                sent_ids.extend(chunk_ids);
            }
            let mut resumed = body.clone();
            resumed["resume_token_ids"] = json!(sent_ids);
            let (rest, done) = read_sse(server.post("/v1/chat/completions", &resumed));
            assert!(done);
            assert!(
                rest.iter()
                    .all(|e| e["choices"][0]["delta"].get("role").is_none()),
                "a resumed stream opens no message again"
            );
            let rest_chunks = chat_chunks(&rest);
            let mut got_ids = sent_ids.clone();
            got_ids.extend(rest_chunks.iter().flat_map(|c| c.1.clone()));
            let got_text =
                sent_text + &rest_chunks.iter().map(|c| c.0.as_str()).collect::<String>();
            assert_eq!(got_ids, all_ids, "temperature {temperature}, cut at {cut}");
            assert_eq!(
                got_text, all_text,
                "temperature {temperature}, cut at {cut}"
            );
            assert_eq!(
                rest.last().unwrap()["usage"],
                usage,
                "usage is the whole generation's"
            );
        }
    }
    // Not resumable: more tokens than max_tokens leaves, several choices, ids past the
    // vocabulary.
    for (extra, param) in [
        (
            json!({"resume_token_ids": [65, 66], "max_tokens": 2}),
            "resume_token_ids",
        ),
        (
            json!({"resume_token_ids": [65], "n": 2}),
            "resume_token_ids",
        ),
        (json!({"resume_token_ids": [1_000_000]}), "resume_token_ids"),
    ] {
        let mut body = json!({"prompt": "Hi", "max_tokens": 8});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let response = server.post("/v1/completions", &body);
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
        let error: Value = response.json().unwrap();
        assert_eq!(error["error"]["param"], param, "{error}");
    }
}
