//! Qwen3-Next and Qwen3.5-MoE (gated DeltaNet layers beside full attention) served over HTTP
//! as a user runs them: the greedy tokens of transformers; 16 streams at once under a KV
//! budget too small for all of them, so that the latest are preempted and recompute their
//! states; half of them starting with a prompt run before, whose kept cache (linear states
//! and all) they start from. Each stream gets the tokens it gets alone. And the whole model
//! served on an emulated GPU, its states paged there, starting from a kept prefix.

mod common;
mod serve;

use std::path::Path;

use serde_json::{Value, json};
use serve::{Server, ids, read_sse, streamed_ids};

fn check(name: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    // 1 MiB holds 128 blocks of 16 positions of these fixtures' two full layers (512 bytes a
    // position), and each sequence's linear states take a block: the 16 streams at their
    // longest (about 155 positions) need 176.
    let server = Server::start_with(
        "[devices]\nbackend = \"cpu\"\n[batching]\nkv_cache_mib = 1\nprefix_cache_entries = 4\n",
        &["--model", dir.to_str().unwrap()],
    );
    server.wait_ready();
    let stream = |body: &Value| {
        let (events, done) = read_sse(server.post("/v1/completions", body));
        assert!(done, "{name}: the stream did not finish");
        streamed_ids(&events)
    };
    let request = |prompt: &[u32], max_tokens: usize| {
        json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": true, "stream": true, "return_token_ids": true})
    };
    let prompt: Vec<u32> = serde_json::from_value(reference["prompt_ids"].clone()).unwrap();
    assert_eq!(
        stream(&request(&prompt, 12)),
        ids(&reference["token_ids"]),
        "{name}: against transformers"
    );

    // Kept whole once prefilled: what the even prompts, which start with it, reuse.
    let shared: Vec<u32> = (0..48).map(|k| 1 + (k * 13) % 120).collect();
    stream(&request(&shared, 1));
    let bodies: Vec<Value> = (0..16u32)
        .map(|i| {
            let mut prompt = if i % 2 == 0 {
                shared.clone()
            } else {
                (0..45).map(|k| (5 + i + k * 7) % 127).collect()
            };
            prompt.extend((0..3 + i % 5).map(|k| (7 + i * 11 + k * 3) % 127));
            request(&prompt, 100 + i as usize % 4)
        })
        .collect();
    // Alone, each even prompt starts from the kept one; together, the kept prompt may be
    // let go for room before an even prompt comes (arrival order decides), so the hits are
    // counted over both.
    let hits = server.metric("moe_node_prefix_cache_hits_total");
    let alone: Vec<Vec<u64>> = bodies.iter().map(stream).collect();
    let preemptions = server.metric("moe_node_preemptions_total");
    let together: Vec<Vec<u64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|body| scope.spawn(|| stream(body)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "{name}: stream {i} together and alone");
    }
    assert!(
        server.metric("moe_node_prefix_cache_hits_total") > hits,
        "{name}: no stream started from the kept 48-token prompt"
    );
    assert!(
        server.metric("moe_node_preemptions_total") > preemptions,
        "{name}: no stream was preempted"
    );
}

#[test]
fn qwen3_next_served_over_http() {
    check("qwen3_next");
}

#[test]
fn qwen3_5_moe_served_over_http() {
    check("qwen3_5_moe");
}

/// Qwen3.5-MoE whole on a GPU emulated on the CPU (`cuda-emulated`: experts, dense part,
/// linear-attention states paged in the GPU's KV pool): a prompt answered from a kept prefix
/// (its states copied on the GPU, the rest prefilled after them) gives the tokens the same
/// prompt gave prefilled whole.
#[test]
fn qwen3_5_moe_served_whole_on_an_emulated_gpu_from_a_kept_prefix() {
    if common::gpus("a hybrid model served on an emulated GPU").is_none() {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_5_moe");
    let server = Server::start_with(
        "[devices]\nbackend = \"cuda-emulated\"\nemulated_gpus = 1\n\
         [batching]\nprefix_cache_entries = 4\n",
        &["--model", dir.to_str().unwrap()],
    );
    server.wait_ready();
    let shared: Vec<u32> = (0..48).map(|k| 1 + (k * 13) % 120).collect();
    let mut prompt = shared.clone();
    prompt.extend([7, 19, 33, 2]);
    let complete = |prompt: &[u32], max_tokens: usize| {
        let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                          "ignore_eos": true, "return_token_ids": true});
        server.post_ok("/v1/completions", &body)["choices"][0]["token_ids"].clone()
    };
    let whole = complete(&prompt, 16);
    // Kept whole once prefilled; the longer prompt's own entry cannot serve it (a kept state
    // is reused only where it ends exactly, leaving a token to compute).
    complete(&shared, 1);
    let hits = server.metric("moe_node_prefix_cache_hits_total");
    let from_prefix = complete(&prompt, 16);
    assert_eq!(
        server.metric("moe_node_prefix_cache_hits_total"),
        hits + 1.0,
        "the prompt did not start from the kept 48 tokens"
    );
    assert_eq!(from_prefix, whole, "from a kept prefix and prefilled whole");
}
