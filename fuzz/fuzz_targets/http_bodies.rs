//! HTTP request bodies of every endpoint that takes one, through the functions the handlers
//! call before anything is queued: `completion_request` (`/v1/completions`), `chat_request`
//! (`/v1/chat/completions`, chat template and tokenizer included) and `tokenize_request`
//! (`/tokenize`), against a small demo model (byte-level tokenizer, ChatML template) and the
//! default limits; `response_format` and `tools` compile their grammars. Input: one byte
//! choosing the endpoint, then the body. Each request is validated on a thread with an HTTP
//! worker's 2 MiB stack.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use moe_node::api::openai::{RequestContext, chat_request, completion_request, tokenize_request};
use moe_node::api::reasoning::ReasoningFormat;
use moe_node::api::tool_calls::ToolCallFormat;
use moe_node::config::NodeConfig;
use moe_node::engine::grammar::Grammars;
use moe_node::model::chat_template::ChatTemplate;
use moe_node::model::demo::{DemoSpec, write_demo_model};
use moe_node::model::{ModelConfig, Tokenizer};

struct Served {
    model: ModelConfig,
    grammars: Grammars,
    tokenizer: Tokenizer,
    chat_template: ChatTemplate,
    config: NodeConfig,
}

fn served() -> &'static Served {
    static SERVED: OnceLock<Served> = OnceLock::new();
    SERVED.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temporary directory");
        let spec = DemoSpec {
            hidden_size: 8,
            num_layers: 2,
            first_k_dense: 1,
            num_heads: 2,
            num_experts: 4,
            top_k: 2,
            expert_intermediate_size: 4,
            dense_intermediate_size: 8,
            kv_lora_rank: 4,
            q_lora_rank: 4,
            qk_nope_head_dim: 2,
            qk_rope_head_dim: 2,
            v_head_dim: 2,
            seed: 1,
            skew: 0.0,
        };
        write_demo_model(dir.path(), &spec, |_, _| {}).expect("demo model");
        let model = ModelConfig::load(dir.path()).expect("demo config");
        let tokenizer = Tokenizer::load_optional(dir.path())
            .expect("demo tokenizer")
            .expect("the demo has a tokenizer");
        Served {
            grammars: Grammars::for_model(&tokenizer, &model, Default::default())
                .expect("grammars for the demo"),
            model,
            tokenizer,
            chat_template: ChatTemplate::load_optional(dir.path())
                .expect("demo chat template")
                .expect("the demo has a chat template"),
            config: NodeConfig::default(),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&endpoint, body)) = data.split_first() else {
        return;
    };
    let served = served();
    let context = RequestContext {
        name: "demo-model",
        model: &served.model,
        tokenizer: Some(&served.tokenizer),
        chat_template: Some(&served.chat_template),
        limits: &served.config.batching,
        grammars: Some(&served.grammars),
        tool_format: ToolCallFormat::detect(served.chat_template.source()),
        // As a reasoning model's: the kwargs, efforts and reasoning sent back are read, and
        // the prompt's end is looked at for an opened `<think>`.
        reasoning: Some(ReasoningFormat::Think),
    };
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn_scoped(scope, || match endpoint % 3 {
                0 => drop(completion_request(&context, body)),
                1 => drop(chat_request(&context, body)),
                _ => {
                    if let Ok(tokens) = tokenize_request(&context, body) {
                        let vocab = served.model.vocab_size;
                        assert!(tokens.iter().all(|&t| (t as usize) < vocab), "{tokens:?}");
                    }
                }
            })
            .expect("request thread")
            .join()
            .expect("validation panicked");
    });
});
