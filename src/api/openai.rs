//! OpenAI-compatible endpoints: `/v1/completions`, `/v1/chat/completions` (with server-sent
//! events when `stream` is set), `/v1/models`, and `/tokenize`. Here a body is parsed and
//! validated into an admitted generation ([`super::generation`], with `structured.rs` for
//! grammars and tools), handed to the router, and its events given to `response.rs`.

use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::{HttpResponse, web};
use serde::Deserialize;
use serde_json::{Value, json};

use super::generation::{self, Echo, Endpoint};
pub use super::generation::{Admitted, RequestContext};
use super::response::{Response, sse_stream, whole_response};
use super::{ApiError, AppState, ServedModel, parse_json, read_body};
use super::{reasoning, structured};
use crate::engine::SamplingParams;
use crate::engine::grammar::Grammars;
use crate::engine::logprobs::MAX_TOP_LOGPROBS;
use crate::model::chat_template::{ChatInput, ChatMessage, encode_chat};

/// A prompt as `/v1/completions` accepts it: text, or token ids; a one-element batch of
/// either is accepted too.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
    TextBatch(Vec<String>),
    IdsBatch(Vec<Vec<u32>>),
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields both endpoints share.
#[derive(Debug, Deserialize)]
struct GenerationFields {
    model: Option<String>,
    max_tokens: Option<usize>,
    /// The chat endpoint's newer name for `max_tokens`.
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    n: Option<usize>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    /// Return the generated token ids in `choices[i].token_ids`.
    #[serde(default)]
    return_token_ids: bool,
    /// Keep generating past the end-of-sequence token.
    #[serde(default)]
    ignore_eos: bool,
    /// Text at which generation stops (not included in the output).
    stop: Option<StopInput>,
    /// Keep only the k most likely tokens; -1 or 0 keep all.
    top_k: Option<i64>,
    min_p: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    /// Token id (as a string) → bias added to its logit.
    logit_bias: Option<serde_json::Map<String, Value>>,
    /// Tokens generated before an end token may be.
    min_tokens: Option<usize>,
    /// Tokens that end generation, besides the model's end-of-sequence tokens.
    stop_token_ids: Option<Vec<u32>>,
    /// Completions: alternatives per token (an integer); chat: whether to return log
    /// probabilities (true or false).
    logprobs: Option<Value>,
    /// Chat: alternatives per token.
    top_logprobs: Option<usize>,
    /// Completions: the prompt's text (and log probabilities) before the completion.
    echo: Option<bool>,
    /// `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"schema"}}`:
    /// output constrained to match.
    response_format: Option<Value>,
    /// Tokens this generation produced before, on a node that failed or drained (the
    /// gateway sends them): it goes on after them, and they are not sent again.
    resume_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: PromptInput,
    #[serde(flatten)]
    fields: GenerationFields,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<IncomingMessage>,
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`, checked
    /// in [`structured::tool_use`].
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    /// `false`: each choice returns the first call the model writes, no more (a forced
    /// call, `tool_choice` required or named, is one call either way).
    parallel_tool_calls: Option<bool>,
    /// Further variables for the chat template, checked in [`reasoning::template_kwargs`].
    chat_template_kwargs: Option<Value>,
    reasoning_effort: Option<Value>,
    /// `false`: a reasoning model's reasoning is left out of the answer.
    include_reasoning: Option<bool>,
    #[serde(flatten)]
    fields: GenerationFields,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IncomingMessage {
    role: String,
    /// A string, or a list of `{"type": "text", "text": ...}` parts; checked in
    /// [`message_text`]. An assistant message that calls tools may have none.
    content: Option<Value>,
    /// An assistant message's calls.
    tool_calls: Option<Value>,
    /// A tool message: the call it answers.
    tool_call_id: Option<String>,
    name: Option<String>,
    /// An assistant message's reasoning, as this server returned it (`reasoning`, vLLM's
    /// newer name, is taken too).
    #[serde(alias = "reasoning")]
    reasoning_content: Option<String>,
}

/// Roles a chat template is given.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Top-level fields both generation endpoints take (`user` is accepted and unused: it only
/// names the caller).
const GENERATION_FIELDS: [&str; 24] = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "n",
    "stream",
    "stream_options",
    "return_token_ids",
    "ignore_eos",
    "stop",
    "user",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    "logprobs",
    "response_format",
    "resume_token_ids",
];

/// Fields only `/v1/completions` takes.
const COMPLETION_FIELDS: [&str; 2] = ["prompt", "echo"];
/// Fields only `/v1/chat/completions` takes.
const CHAT_FIELDS: [&str; 8] = [
    "messages",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "reasoning_effort",
    "include_reasoning",
];

/// A field the endpoint does not know is an error, not ignored: a misspelled `max_token`
/// must not silently generate to the end of the context.
fn reject_unknown_fields(body: &Value, endpoint: &[&str]) -> Result<(), ApiError> {
    let Some(fields) = body.as_object() else {
        return Err(ApiError::bad_request(
            "the request body is not valid: expected a JSON object",
        ));
    };
    let known = |key: &str| endpoint.contains(&key) || GENERATION_FIELDS.contains(&key);
    if let Some(unknown) = fields.keys().find(|k| !known(k)) {
        let mut accepted: Vec<&str> = endpoint.to_vec();
        accepted.extend(GENERATION_FIELDS);
        return Err(ApiError::bad_request(format!(
            "unknown field `{unknown}`; this endpoint accepts {}",
            accepted.join(", ")
        ))
        .with_code("unknown_field"));
    }
    if let Some(options) = fields.get("stream_options").and_then(Value::as_object)
        && let Some(unknown) = options.keys().find(|k| k.as_str() != "include_usage")
    {
        return Err(ApiError::bad_request(format!(
            "unknown field `stream_options.{unknown}`; stream_options accepts include_usage"
        ))
        .with_param("stream_options")
        .with_code("unknown_field"));
    }
    Ok(())
}

/// The text of message `index`: its content string, or its text parts joined. A part of
/// another kind (an image) is an error, not dropped.
fn message_text(index: usize, content: Option<Value>) -> Result<String, ApiError> {
    let bad = |message: String| ApiError::bad_request(message).with_param("messages");
    match content {
        None | Some(Value::Null) => Err(bad(format!(
            "messages[{index}].content is missing: every message needs its text"
        ))),
        Some(Value::String(text)) => Ok(text),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (p, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
                let part_text = part.get("text").and_then(Value::as_str);
                let extra = part
                    .as_object()
                    .and_then(|o| o.keys().find(|k| *k != "type" && *k != "text"));
                match (kind, part_text, extra) {
                    ("text", Some(t), None) => text.push_str(t),
                    ("text", _, Some(key)) => {
                        return Err(bad(format!(
                            "messages[{index}].content[{p}]: unknown field `{key}`"
                        )));
                    }
                    ("text", None, None) => {
                        return Err(bad(format!(
                            "messages[{index}].content[{p}]: a text part needs `text`"
                        )));
                    }
                    _ => {
                        return Err(bad(format!(
                            "messages[{index}].content[{p}]: only text parts are supported, \
                             not `{kind}`"
                        )));
                    }
                }
            }
            Ok(text)
        }
        Some(other) => Err(bad(format!(
            "messages[{index}].content: expected a string or a list of text parts, got {other}"
        ))),
    }
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    prompt: Option<String>,
    messages: Option<Vec<IncomingMessage>>,
    chat_template_kwargs: Option<Value>,
}

pub async fn completions(
    state: web::Data<AppState>,
    http: actix_web::HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    let body = read_body(payload, &state.config.server).await?;
    // Compiling a JSON schema into a grammar may take a while: off the event loop.
    let admitted = if contains(&body, b"response_format") {
        validate_off_the_event_loop(&state, body, completion_request).await?
    } else {
        completion_request(&served.request_context(&state.config), &body)?
    };
    generate(state.clone(), served, admitted, &http).await
}

pub async fn chat_completions(
    state: web::Data<AppState>,
    http: actix_web::HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    let body = read_body(payload, &state.config.server).await?;
    let admitted = validate_off_the_event_loop(&state, body, chat_request).await?;
    generate(state.clone(), served, admitted, &http).await
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Validates a request that renders the chat template on actix's blocking pool: a render is
/// a round trip to a worker process that may take up to
/// [`crate::model::template_worker::RENDER_DEADLINE`], and must not hold up the other
/// connections of the HTTP worker thread.
async fn validate_off_the_event_loop<T: Send + 'static>(
    state: &web::Data<AppState>,
    body: Vec<u8>,
    validate: fn(&RequestContext, &[u8]) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    let state = state.clone();
    web::block(move || {
        let served = state.admitting()?;
        validate(&served.request_context(&state.config), &body)
    })
    .await
    .map_err(|_| ApiError::internal("validating the request failed"))?
}

/// Parses and validates a `/v1/completions` body: everything short of generating.
pub fn completion_request(served: &RequestContext, body: &[u8]) -> Result<Admitted, ApiError> {
    let request: CompletionRequest = parse_request(body, &COMPLETION_FIELDS)?;
    let mut prompt_text = None;
    let prompt = match request.prompt {
        PromptInput::Ids(ids) => ids,
        PromptInput::Text(text) => {
            let ids = encode(served, &text)?;
            prompt_text = Some(text);
            ids
        }
        PromptInput::IdsBatch(mut batch) if batch.len() == 1 => batch.swap_remove(0),
        PromptInput::TextBatch(mut batch) if batch.len() == 1 => {
            let text = batch.swap_remove(0);
            let ids = encode(served, &text)?;
            prompt_text = Some(text);
            ids
        }
        _ => {
            return Err(ApiError::bad_request(
                "send one prompt per request; batches of prompts are not supported",
            )
            .with_param("prompt"));
        }
    };
    let mut admitted = admit(served, Endpoint::Completions, prompt, request.fields)?;
    if let Some(echo) = &mut admitted.echo {
        echo.text = match (prompt_text, served.tokenizer) {
            (Some(text), _) => text,
            (None, Some(tokenizer)) => tokenizer.decode_text(&echo.ids).unwrap_or_default(),
            (None, None) => String::new(),
        };
    }
    Ok(admitted)
}

/// Parses and validates a `/v1/chat/completions` body: everything short of generating.
pub fn chat_request(served: &RequestContext, body: &[u8]) -> Result<Admitted, ApiError> {
    let request: ChatRequest = parse_request(body, &CHAT_FIELDS)?;
    let tools = structured::tool_use(served, request.tools, request.tool_choice)?;
    let kwargs =
        reasoning::template_kwargs(request.chat_template_kwargs, request.reasoning_effort)?;
    let prompt = chat_prompt(served, request.messages, tools.tools, kwargs)?;
    let reasoning = reasoning::split_for(served, &prompt, request.include_reasoning);
    let mut admitted = admit(served, Endpoint::Chat, prompt, request.fields)?;
    admitted.reasoning = reasoning;
    if let Some(constraint) = tools.constraint {
        if admitted.constraint.is_some() {
            return Err(ApiError::bad_request(
                "response_format cannot be combined with a tool_choice that forces a call",
            )
            .with_param("response_format"));
        }
        admitted.constraint = Some((constraint, structured_end(served)));
    }
    if let (Some(split), Some(_)) = (&mut admitted.reasoning, &admitted.constraint) {
        // The grammar writes the output from its first token: an answer, not reasoning.
        split.opened = false;
    }
    admitted.tool_calls = tools.parse;
    admitted.single_tool_call = request.parallel_tool_calls == Some(false);
    Ok(admitted)
}

/// The token a grammar ends with.
fn structured_end(served: &RequestContext) -> u32 {
    served.grammars.map_or(0, Grammars::end)
}

pub async fn models(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    Ok(HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [{
            "id": served.name,
            "object": "model",
            "created": served.created,
            "owned_by": "moe-node",
            "max_model_len": served.node.model.max_position_embeddings,
        }],
    })))
}

pub async fn tokenize(
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    let body = read_body(payload, &state.config.server).await?;
    let tokens = validate_off_the_event_loop(&state, body, tokenize_request).await?;
    Ok(HttpResponse::Ok().json(json!({
        "count": tokens.len(),
        "max_model_len": served.node.model.max_position_embeddings,
        "tokens": tokens,
    })))
}

/// Parses a `/tokenize` body and returns the prompt's token ids.
pub fn tokenize_request(served: &RequestContext, body: &[u8]) -> Result<Vec<u32>, ApiError> {
    let request: TokenizeRequest =
        parse_request(body, &["prompt", "messages", "chat_template_kwargs"])?;
    let kwargs = reasoning::template_kwargs(request.chat_template_kwargs, None)?;
    match (request.prompt, request.messages) {
        (Some(text), None) => encode(served, &text),
        (None, Some(messages)) => chat_prompt(served, messages, None, kwargs),
        _ => Err(ApiError::bad_request(
            "give exactly one of `prompt` (text) or `messages` (chat)",
        )),
    }
}

/// The request body as `T`; top-level fields other than `fields` and the generation
/// options are refused.
fn parse_request<T: serde::de::DeserializeOwned>(
    body: &[u8],
    fields: &[&str],
) -> Result<T, ApiError> {
    let value: Value = parse_json(body)?;
    reject_unknown_fields(&value, fields)?;
    serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid: {e}")))
}

fn encode(served: &RequestContext, text: &str) -> Result<Vec<u32>, ApiError> {
    let tokenizer = served.tokenizer.ok_or_else(|| {
        ApiError::bad_request("this model has no tokenizer.json: send the prompt as token ids")
            .with_param("prompt")
    })?;
    tokenizer
        .encode(text)
        .map_err(|e| ApiError::bad_request(format!("the prompt cannot be tokenized: {e}")))
}

fn chat_prompt(
    served: &RequestContext,
    messages: Vec<IncomingMessage>,
    tools: Option<Vec<Value>>,
    kwargs: serde_json::Map<String, Value>,
) -> Result<Vec<u32>, ApiError> {
    let template = served.chat_template.ok_or_else(|| {
        ApiError::bad_request("this model has no chat template: use /v1/completions")
    })?;
    if messages.is_empty() {
        return Err(ApiError::bad_request("`messages` is empty").with_param("messages"));
    }
    let messages = messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].role: `{}` is not one of {}",
                    m.role,
                    ROLES.join(", ")
                ))
                .with_param("messages"));
            }
            let tool_calls = match m.tool_calls {
                None | Some(Value::Null) => None,
                Some(_) if m.role != "assistant" => {
                    return Err(ApiError::bad_request(format!(
                        "messages[{i}]: only assistant messages have tool_calls"
                    ))
                    .with_param("messages"));
                }
                Some(calls) => Some(structured::message_tool_calls(i, calls)?),
            };
            // An assistant turn that calls tools may have no text.
            let content = match m.content {
                None | Some(Value::Null) if tool_calls.is_some() => None,
                content => Some(message_text(i, content)?),
            };
            if m.reasoning_content.is_some() && m.role != "assistant" {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}]: only assistant messages have reasoning_content"
                ))
                .with_param("messages"));
            }
            Ok(ChatMessage {
                role: m.role,
                content,
                tool_calls,
                tool_call_id: m.tool_call_id,
                name: m.name,
                reasoning_content: m.reasoning_content,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tokenizer = served.tokenizer.ok_or_else(|| {
        ApiError::bad_request(
            "this model has no tokenizer.json: use /v1/completions with token ids",
        )
    })?;
    let chat = ChatInput {
        messages,
        tools,
        kwargs,
    };
    let called = chat.messages.iter().filter_map(|m| m.tool_calls.as_ref());
    if called
        .map(|calls| Value::Array(calls.clone()).to_string())
        .any(|calls| tokenizer.has_special_text(&calls))
    {
        return Err(ApiError::bad_request(
            "a message's tool_calls hold the text of one of the model's special tokens",
        )
        .with_param("messages"));
    }
    encode_chat(template, tokenizer, chat)
        .map_err(|e| ApiError::bad_request(e).with_param("messages"))
}

/// Checks everything the router would otherwise fail on, so that errors reach the client as
/// 400/404/413 before anything is queued.
fn admit(
    served: &RequestContext,
    endpoint: Endpoint,
    prompt: Vec<u32>,
    fields: GenerationFields,
) -> Result<Admitted, ApiError> {
    if let Some(model) = &fields.model
        && model != served.name
    {
        return Err(ApiError::unknown_model(model, served.name));
    }
    let limits = served.limits;
    let choices = fields.n.unwrap_or(1);
    if choices == 0 || choices > limits.max_sequences {
        return Err(ApiError::bad_request(format!(
            "n must be from 1 to {} (batching.max_sequences: every choice needs a place in \
             the batch), not {choices}",
            limits.max_sequences
        ))
        .with_param("n"));
    }
    let (logprobs, echo) = logprobs_asked(endpoint, &fields)?;
    let model = served.model;
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty").with_param("prompt"));
    }
    if let Some(&token) = prompt.iter().find(|&&t| t as usize >= model.vocab_size) {
        return Err(ApiError::bad_request(format!(
            "token id {token} is outside the vocabulary (size {})",
            model.vocab_size
        ))
        .with_param("prompt"));
    }
    let context = model.max_position_embeddings;
    if prompt.len() >= context {
        return Err(ApiError::bad_request(format!(
            "the prompt has {} tokens but the model's context is {context}",
            prompt.len()
        ))
        .with_param("prompt")
        .with_code("context_length_exceeded"));
    }
    // After the context check, so that a prompt too long for the model is always 400,
    // whichever limit is smaller.
    if prompt.len() > limits.max_prompt_tokens {
        return Err(ApiError::too_large(format!(
            "the prompt has {} tokens; this node accepts at most {}",
            prompt.len(),
            limits.max_prompt_tokens
        ))
        .with_param("prompt"));
    }
    let room = context - prompt.len();
    let max_tokens = match fields.max_completion_tokens.or(fields.max_tokens) {
        Some(0) if echo.is_none() => {
            return Err(ApiError::bad_request(
                "max_tokens must be at least 1 (0 is accepted with echo: true, to score the \
                 prompt)",
            )
            .with_param("max_tokens"));
        }
        Some(n) if n > room => {
            return Err(ApiError::bad_request(format!(
                "max_tokens is {n}, but the prompt ({} tokens) leaves room for {room} in the \
                 model's context of {context}",
                prompt.len()
            ))
            .with_param("max_tokens")
            .with_code("context_length_exceeded"));
        }
        Some(n) => n,
        None => limits.default_max_tokens.min(room),
    };
    let resumed = resumed_tokens(&fields, choices, echo.is_some(), max_tokens, model)?;
    let sampling = sampling_params(&fields, max_tokens)?;
    sampling
        .validate(model.vocab_size)
        .map_err(|e| ApiError::bad_request(e.message).with_param(e.param))?;
    let stop = match fields.stop {
        None => Vec::new(),
        Some(StopInput::One(s)) => vec![s],
        Some(StopInput::Many(v)) => v,
    };
    if stop.len() > MAX_STOP_STRINGS
        || stop
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::bad_request(format!(
            "`stop` takes at most {MAX_STOP_STRINGS} non-empty strings of at most \
             {MAX_STOP_BYTES} bytes each"
        ))
        .with_param("stop"));
    }
    if !stop.is_empty() && served.tokenizer.is_none() {
        return Err(
            ApiError::bad_request("`stop` needs text, and this model has no tokenizer")
                .with_param("stop"),
        );
    }
    let constraint = structured::response_format(served, fields.response_format.as_ref())?
        .map(|constraint| (constraint, structured_end(served)));
    if constraint.is_some() && sampling.min_tokens > 0 {
        return Err(ApiError::bad_request(
            "min_tokens cannot be combined with response_format: the grammar decides where \
             the output ends",
        )
        .with_param("min_tokens"));
    }
    let prompt_ids_for_echo = if echo.is_some() {
        prompt.clone()
    } else {
        Vec::new()
    };
    let end_tokens = model
        .eos_token_ids
        .iter()
        .chain(&sampling.stop_token_ids)
        .copied()
        .chain(constraint.as_ref().map(|(_, end)| *end))
        .collect();
    Ok(Admitted {
        endpoint,
        model: served.name.to_string(),
        prompt_tokens: prompt.len(),
        prompt,
        max_tokens,
        sampling,
        stop_at_eos: !fields.ignore_eos,
        stream: fields.stream,
        include_usage: fields.stream_options.unwrap_or_default().include_usage,
        return_token_ids: fields.return_token_ids,
        stop,
        choices,
        logprobs,
        echo: echo.map(|logprobs| Echo {
            ids: prompt_ids_for_echo,
            text: String::new(),
            logprobs,
        }),
        end_tokens,
        constraint,
        tool_calls: None,
        single_tool_call: false,
        reasoning: None,
        resumed,
    })
}

/// The tokens a resumed generation produced before (`resume_token_ids`): one choice, no
/// echo, fewer than `max_tokens` (the generation must have more to do), in the vocabulary.
fn resumed_tokens(
    fields: &GenerationFields,
    choices: usize,
    echo: bool,
    max_tokens: usize,
    model: &crate::model::ModelConfig,
) -> Result<Vec<u32>, ApiError> {
    let Some(tokens) = &fields.resume_token_ids else {
        return Ok(Vec::new());
    };
    let bad = |what: String| Err(ApiError::bad_request(what).with_param("resume_token_ids"));
    if choices != 1 || echo {
        return bad("resume_token_ids resumes one choice (n: 1) without echo".into());
    }
    if tokens.len() >= max_tokens {
        return bad(format!(
            "resume_token_ids holds {} tokens: the generation (max_tokens {max_tokens}) has \
             nothing left to do",
            tokens.len()
        ));
    }
    if let Some(&token) = tokens.iter().find(|&&t| t as usize >= model.vocab_size) {
        return bad(format!(
            "token id {token} is outside the vocabulary (size {})",
            model.vocab_size
        ));
    }
    Ok(tokens.clone())
}

/// The sampling controls of a request, checked for what needs the request to check.
fn sampling_params(
    fields: &GenerationFields,
    max_tokens: usize,
) -> Result<SamplingParams, ApiError> {
    let top_k = match fields.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::bad_request(format!(
                "top_k must be -1 or 0 (every token) or at least 1, not {k}"
            ))
            .with_param("top_k"));
        }
    };
    let mut logit_bias = Vec::new();
    for (key, bias) in fields.logit_bias.iter().flatten() {
        let bad = |what: String| ApiError::bad_request(what).with_param("logit_bias");
        let token = key.parse::<u32>().map_err(|_| {
            bad(format!(
                "logit_bias: `{key}` is not a token id (keys are token ids as strings)"
            ))
        })?;
        let bias = bias.as_f64().ok_or_else(|| {
            bad(format!(
                "logit_bias: the bias of token {token} must be a number from -100 to 100"
            ))
        })?;
        logit_bias.push((token, bias as f32));
    }
    let min_tokens = fields.min_tokens.unwrap_or(0);
    if min_tokens > max_tokens {
        return Err(ApiError::bad_request(format!(
            "min_tokens ({min_tokens}) must not be more than max_tokens ({max_tokens})"
        ))
        .with_param("min_tokens"));
    }
    Ok(SamplingParams {
        temperature: fields.temperature.unwrap_or(1.0),
        top_p: fields.top_p.unwrap_or(1.0),
        top_k,
        min_p: fields.min_p.unwrap_or(0.0),
        presence_penalty: fields.presence_penalty.unwrap_or(0.0),
        frequency_penalty: fields.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: fields.repetition_penalty.unwrap_or(1.0),
        logit_bias,
        min_tokens,
        stop_token_ids: fields.stop_token_ids.clone().unwrap_or_default(),
        seed: fields.seed.unwrap_or_else(rand_seed),
    })
}

/// Alternatives per generated token's log probabilities, and whether the prompt is echoed
/// (with alternatives per prompt token's log probabilities, if those are asked for too).
/// Completions take `logprobs: N` and `echo`; chat takes `logprobs: true` and
/// `top_logprobs: N`.
#[allow(clippy::type_complexity)]
fn logprobs_asked(
    endpoint: Endpoint,
    fields: &GenerationFields,
) -> Result<(Option<usize>, Option<Option<usize>>), ApiError> {
    let too_many = |param: &'static str, n: u64| {
        ApiError::bad_request(format!(
            "{param} must be from 0 to {MAX_TOP_LOGPROBS}, not {n}"
        ))
        .with_param(param)
    };
    match endpoint {
        Endpoint::Completions => {
            let top = match &fields.logprobs {
                None | Some(Value::Null) => None,
                Some(value) => match value.as_u64() {
                    Some(n) if n <= MAX_TOP_LOGPROBS as u64 => Some(n as usize),
                    Some(n) => return Err(too_many("logprobs", n)),
                    None => {
                        return Err(ApiError::bad_request(format!(
                            "logprobs on /v1/completions is the number of alternatives per \
                             token, from 0 to {MAX_TOP_LOGPROBS}, not {value}"
                        ))
                        .with_param("logprobs"));
                    }
                },
            };
            let echo = fields.echo.unwrap_or(false).then_some(top);
            Ok((top, echo))
        }
        Endpoint::Chat => {
            let on = match &fields.logprobs {
                None | Some(Value::Null) => false,
                Some(Value::Bool(on)) => *on,
                Some(other) => {
                    return Err(ApiError::bad_request(format!(
                        "logprobs on /v1/chat/completions is true or false (the number of \
                         alternatives is top_logprobs), not {other}"
                    ))
                    .with_param("logprobs"));
                }
            };
            match fields.top_logprobs {
                Some(n) if n > MAX_TOP_LOGPROBS => Err(too_many("top_logprobs", n as u64)),
                Some(_) if !on => Err(ApiError::bad_request("top_logprobs needs logprobs: true")
                    .with_param("top_logprobs")),
                top => Ok((on.then(|| top.unwrap_or(0)), None)),
            }
        }
    }
}

/// As OpenAI's API.
const MAX_STOP_STRINGS: usize = 4;
/// Longest stop string: each generated token is checked against every prefix of each.
const MAX_STOP_BYTES: usize = 256;

/// A seed for requests that give none: different per request.
fn rand_seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default();
    nanos ^ (std::process::id() as u64).rotate_left(32)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// Submits an admitted request to the router and answers with its events, whole or as
/// server-sent events.
async fn generate(
    state: web::Data<AppState>,
    served: &ServedModel,
    mut request: Admitted,
    http: &actix_web::HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let handed_off = super::handed_off(http);
    let in_flight = state.track();
    let prompt_tokens = request.prompt_tokens;
    let id = format!(
        "{}-{:016x}",
        match request.endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        },
        rand_seed()
    );
    let mut events =
        generation::submit(served, &mut request, &id, super::trace_parent(http)).await?;
    tracing::info!(
        request = %id,
        prompt_tokens,
        max_tokens = request.max_tokens,
        n = request.choices,
        stream = request.stream,
        "request admitted"
    );
    let stream = request.stream;
    let ends = state.end_watch(handed_off && stream);
    let mut response = Response::new(id, unix_now(), request, ends, in_flight);
    response.take_resumed(served)?;
    let first = generation::first_event(&response.id, &mut events, &mut response.cut).await?;
    // Degraded from its prefill on: said in a header too (a generation degraded later says
    // so in its body, the headers being sent by then).
    let degraded = matches!(first, crate::engine::batch::SequenceEvent::Degraded { .. });
    let mut answer = if stream {
        let stream = sse_stream(response, events, first, state);
        HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(stream)
    } else {
        whole_response(response, events, first, state).await?
    };
    if degraded {
        answer.headers_mut().insert(
            actix_web::http::header::HeaderName::from_static(DEGRADED_HEADER),
            actix_web::http::header::HeaderValue::from_static("rerouted-experts"),
        );
    }
    Ok(answer)
}

/// Said on a response some of whose tokens were routed around experts with no live replica
/// (`cluster.on_expert_unavailable = "reroute"`), as its body's `"degraded": true` says.
pub const DEGRADED_HEADER: &str = "x-moe-node-degraded";
