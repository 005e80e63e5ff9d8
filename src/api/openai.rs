//! OpenAI-compatible endpoints: `/v1/completions`, `/v1/chat/completions` (with server-sent
//! events when `stream` is set), `/v1/models`, and `/tokenize`.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use actix_web::web::Bytes;
use actix_web::{HttpResponse, web};
use futures::Stream;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

use super::stop::StopStrings;
use super::{ApiError, AppState, ServedModel, parse_json, read_body};
use crate::actors::router::{Submit, SubmitError};
use crate::config::{BatchingConfig, NodeConfig};
use crate::engine::batch::SequenceEvent;
use crate::engine::{FinishReason, SamplingParams};
use crate::model::chat_template::{ChatMessage, ChatTemplate, encode_chat};
use crate::model::{ModelConfig, Tokenizer};

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
    #[serde(flatten)]
    fields: GenerationFields,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IncomingMessage {
    role: String,
    /// A string, or a list of `{"type": "text", "text": ...}` parts; checked in
    /// [`message_text`].
    content: Option<Value>,
}

/// Roles a chat template is given.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Top-level fields both generation endpoints take (`user` is accepted and unused: it only
/// names the caller).
const GENERATION_FIELDS: [&str; 13] = [
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
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Endpoint {
    Completions,
    Chat,
}

/// What validating a request needs: the served model and the node's batching limits.
/// Built per request from the app state; the `http_bodies` fuzz target builds one around the
/// demo model.
pub struct RequestContext<'a> {
    /// The name clients use in the `model` field.
    pub name: &'a str,
    pub model: &'a ModelConfig,
    pub tokenizer: Option<&'a Tokenizer>,
    pub chat_template: Option<&'a ChatTemplate>,
    pub limits: &'a BatchingConfig,
}

impl ServedModel {
    /// The context requests to this model are validated in.
    pub fn request_context<'a>(&'a self, config: &'a NodeConfig) -> RequestContext<'a> {
        RequestContext {
            name: &self.name,
            model: &self.node.model,
            tokenizer: self.tokenizer.as_ref(),
            chat_template: self.chat_template.as_ref(),
            limits: &config.batching,
        }
    }
}

/// A validated request, ready for the router.
#[derive(Debug)]
pub struct Admitted {
    endpoint: Endpoint,
    model: String,
    /// Handed to the router on submission.
    prompt: Vec<u32>,
    prompt_tokens: usize,
    max_tokens: usize,
    sampling: SamplingParams,
    stop_at_eos: bool,
    stream: bool,
    include_usage: bool,
    return_token_ids: bool,
    stop: Vec<String>,
}

pub async fn completions(
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    let body = read_body(payload, &state.config.server).await?;
    let admitted = completion_request(&served.request_context(&state.config), &body)?;
    generate(state.clone(), served, admitted).await
}

pub async fn chat_completions(
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    let body = read_body(payload, &state.config.server).await?;
    let admitted = validate_off_the_event_loop(&state, body, chat_request).await?;
    generate(state.clone(), served, admitted).await
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
    let request: CompletionRequest = parse_request(body, &["prompt"])?;
    let prompt = match request.prompt {
        PromptInput::Ids(ids) => ids,
        PromptInput::Text(text) => encode(served, &text)?,
        PromptInput::IdsBatch(mut batch) if batch.len() == 1 => batch.swap_remove(0),
        PromptInput::TextBatch(batch) if batch.len() == 1 => encode(served, &batch[0])?,
        _ => {
            return Err(ApiError::bad_request(
                "send one prompt per request; batches of prompts are not supported",
            )
            .with_param("prompt"));
        }
    };
    admit(served, Endpoint::Completions, prompt, request.fields)
}

/// Parses and validates a `/v1/chat/completions` body: everything short of generating.
pub fn chat_request(served: &RequestContext, body: &[u8]) -> Result<Admitted, ApiError> {
    let request: ChatRequest = parse_request(body, &["messages"])?;
    let prompt = chat_prompt(served, request.messages)?;
    admit(served, Endpoint::Chat, prompt, request.fields)
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
    let request: TokenizeRequest = parse_request(body, &["prompt", "messages"])?;
    match (request.prompt, request.messages) {
        (Some(text), None) => encode(served, &text),
        (None, Some(messages)) => chat_prompt(served, messages),
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
            Ok(ChatMessage {
                role: m.role,
                content: message_text(i, m.content)?,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tokenizer = served.tokenizer.ok_or_else(|| {
        ApiError::bad_request(
            "this model has no tokenizer.json: use /v1/completions with token ids",
        )
    })?;
    encode_chat(template, tokenizer, messages)
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
    if fields.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("only n = 1 is supported").with_param("n"));
    }
    let limits = served.limits;
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
        Some(0) => {
            return Err(
                ApiError::bad_request("max_tokens must be at least 1").with_param("max_tokens")
            );
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
    let sampling = SamplingParams {
        temperature: fields.temperature.unwrap_or(1.0),
        top_p: fields.top_p.unwrap_or(1.0),
        seed: fields.seed.unwrap_or_else(rand_seed),
    };
    sampling.validate().map_err(ApiError::bad_request)?;
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
    })
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

async fn generate(
    state: web::Data<AppState>,
    served: &ServedModel,
    mut request: Admitted,
) -> Result<HttpResponse, ApiError> {
    let started = Instant::now();
    let in_flight = state.track();
    let prompt_tokens = request.prompt_tokens;
    let mut events = served
        .node
        .router
        .submit(Submit {
            prompt: std::mem::take(&mut request.prompt),
            max_tokens: request.max_tokens,
            sampling: request.sampling,
            stop_at_eos: request.stop_at_eos,
        })
        .await
        .map_err(|e| match e {
            SubmitError::QueueFull(full) => ApiError::overloaded(full.to_string()),
            SubmitError::Stopped => ApiError::unavailable(e.to_string()),
        })?;
    let id = format!(
        "{}-{:016x}",
        match request.endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        },
        rand_seed()
    );
    tracing::info!(
        request = %id,
        prompt_tokens,
        max_tokens = request.max_tokens,
        stream = request.stream,
        "request admitted"
    );
    let stop = request.stop.clone();
    let mut response = Response {
        id,
        created: unix_now(),
        request,
        decoder: TextDecoder::new(stop),
        token_ids: Vec::new(),
        started,
        cut: state.cut_watch(),
        _in_flight: in_flight,
    };
    // The status waits for the first event, streamed or not, so that a request that fails
    // before its first token (no live replica, the router gone) gets its error status.
    let first = match next_event(&mut events, &mut response.cut).await {
        Some(Some(SequenceEvent::Failed(reason))) => {
            tracing::info!(request = %response.id, reason = %reason, "request failed");
            return Err(ApiError::unavailable(format!(
                "generation failed: {reason}"
            )));
        }
        Some(None) => return Err(ApiError::unavailable("the router stopped")),
        None => return Err(cut_error()),
        Some(Some(event)) => event,
    };
    if response.request.stream {
        let stream = sse_stream(response, events, first, state);
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(stream));
    }
    whole_response(response, events, first, state).await
}

/// The state of one response as tokens arrive.
struct Response {
    id: String,
    created: u64,
    request: Admitted,
    decoder: TextDecoder,
    token_ids: Vec<u32>,
    started: Instant,
    /// Turns true when the drain time is up.
    cut: watch::Receiver<bool>,
    _in_flight: super::InFlight,
}

/// Resolves when the drain time is up (never, if the node's state is gone).
async fn drain_cut(cut: &mut watch::Receiver<bool>) {
    if cut.wait_for(|&cut| cut).await.is_err() {
        futures::future::pending::<()>().await;
    }
}

/// The error a response still running at the end of the drain time ends with.
fn cut_error() -> ApiError {
    ApiError::unavailable(
        "the node is shutting down and its drain time (server.drain_seconds) is up; \
         the generation was ended: retry on another node",
    )
    .with_code("shutting_down")
}

/// The next event of a generation, or `None` once the drain time is up.
async fn next_event(
    events: &mut mpsc::Receiver<SequenceEvent>,
    cut: &mut watch::Receiver<bool>,
) -> Option<Option<SequenceEvent>> {
    tokio::select! {
        event = events.recv() => Some(event),
        _ = drain_cut(cut) => None,
    }
}

impl Response {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.request.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
        })
    }

    fn usage(&self, prompt_tokens: usize, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        })
    }

    fn log_finished(&self, reason: &str, completion_tokens: usize) {
        tracing::info!(
            request = %self.id,
            completion_tokens,
            finish_reason = reason,
            seconds = self.started.elapsed().as_secs_f32(),
            "request finished"
        );
    }

    /// One streamed chunk carrying `delta` (text) and `ids` (token ids).
    fn chunk(&self, delta: &str, ids: &[u32], finish_reason: Option<&str>) -> Value {
        let mut choice = match self.request.endpoint {
            Endpoint::Completions => json!({"index": 0, "text": delta, "logprobs": null}),
            Endpoint::Chat => {
                let delta = if finish_reason.is_some() && delta.is_empty() {
                    json!({})
                } else {
                    json!({"content": delta})
                };
                json!({"index": 0, "delta": delta, "logprobs": null})
            }
        };
        choice["finish_reason"] = finish_reason.into();
        if self.request.return_token_ids {
            choice["token_ids"] = json!(ids);
        }
        self.envelope(true, json!([choice]))
    }
}

fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::Stop => "stop",
    }
}

/// A non-streamed response, once its first event is in (so a request that fails at once has
/// got its error status). The body is sent as it forms: a space (JSON allows leading
/// whitespace) every [`KEEPALIVE_TOKENS`] tokens, then the object. The spaces are how a
/// client that went away is noticed: the write fails, the body is dropped, and so is the
/// generation. The status (200) is sent with the first space, so a generation that fails
/// later ends the body with the error envelope instead of the completion.
async fn whole_response(
    response: Response,
    events: mpsc::Receiver<SequenceEvent>,
    first: SequenceEvent,
    app: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let state = (response, events, Some(first), false);
    let body = futures::stream::unfold(state, move |(mut response, mut events, mut next, done)| {
        let app = app.clone();
        async move {
            if done {
                return None;
            }
            let served = app.served()?;
            loop {
                let event = match next.take() {
                    Some(event) => Some(event),
                    None => match next_event(&mut events, &mut response.cut).await {
                        Some(event) => event,
                        None => {
                            tracing::info!(request = %response.id, "request ended by the drain deadline");
                            return Some((
                                Ok(Bytes::from(cut_error().body().to_string())),
                                (response, events, None, true),
                            ));
                        }
                    },
                };
                let out = match event {
                    Some(SequenceEvent::Token(token)) => {
                        response.token_ids.push(token);
                        if response.decoder.has_stops()
                            && response.decoder.stop_reached(served, &response.token_ids)
                        {
                            // Dropping `events` afterwards ends the generation.
                            let generated = response.token_ids.len();
                            let prompt_tokens = response.request.prompt_tokens;
                            let body = whole_body(
                                &mut response,
                                served,
                                FinishReason::Stop,
                                prompt_tokens,
                                generated,
                            );
                            return Some((
                                Ok(Bytes::from(body.to_string())),
                                (response, events, None, true),
                            ));
                        }
                        if response.token_ids.len() % KEEPALIVE_TOKENS != 0 {
                            continue;
                        }
                        return Some((
                            Ok(Bytes::from_static(b" ")),
                            (response, events, None, false),
                        ));
                    }
                    Some(SequenceEvent::Finished {
                        reason,
                        prompt_tokens,
                        completion_tokens,
                    }) => whole_body(
                        &mut response,
                        served,
                        reason,
                        prompt_tokens,
                        completion_tokens,
                    ),
                    Some(SequenceEvent::Failed(reason)) => {
                        ApiError::unavailable(format!("generation failed: {reason}")).body()
                    }
                    None => ApiError::unavailable("the router stopped").body(),
                };
                return Some((
                    Ok(Bytes::from(out.to_string())),
                    (response, events, None, true),
                ));
            }
        }
    });
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        .streaming::<_, actix_web::Error>(body))
}

/// Tokens between the keep-alive spaces of a non-streamed response.
const KEEPALIVE_TOKENS: usize = 16;

fn whole_body(
    response: &mut Response,
    served: &ServedModel,
    reason: FinishReason,
    prompt_tokens: usize,
    completion_tokens: usize,
) -> Value {
    let text = response.decoder.final_text(served, &response.token_ids);
    let reason = finish_reason(reason);
    let mut choice = match response.request.endpoint {
        Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": null}),
        Endpoint::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
        }),
    };
    choice["finish_reason"] = reason.into();
    if response.request.return_token_ids {
        choice["token_ids"] = json!(response.token_ids);
    }
    let mut body = response.envelope(false, json!([choice]));
    body["usage"] = response.usage(prompt_tokens, completion_tokens);
    response.log_finished(reason, completion_tokens);
    body
}

/// Server-sent events: one chunk per token, the finishing chunk, optionally usage, then
/// `data: [DONE]`. Dropping the stream (the client went away) drops the receiver, which ends
/// the generation at the router's next step.
fn sse_stream(
    response: Response,
    events: mpsc::Receiver<SequenceEvent>,
    first: SequenceEvent,
    app: web::Data<AppState>,
) -> impl Stream<Item = Result<Bytes, actix_web::Error>> + 'static {
    struct State {
        response: Response,
        events: mpsc::Receiver<SequenceEvent>,
        /// The first event, received before the status was sent.
        first: Option<SequenceEvent>,
        pending: std::collections::VecDeque<Bytes>,
        started: bool,
        done: bool,
    }
    impl State {
        /// Queues the finishing chunk (with `rest` of the text), usage if asked, `[DONE]`.
        fn finish(
            &mut self,
            rest: &str,
            reason: FinishReason,
            prompt_tokens: usize,
            completion_tokens: usize,
        ) {
            let reason = finish_reason(reason);
            let last = self.response.chunk(rest, &[], Some(reason));
            self.pending.push_back(sse(&last));
            if self.response.request.include_usage {
                let mut usage = self.response.envelope(true, json!([]));
                usage["usage"] = self.response.usage(prompt_tokens, completion_tokens);
                self.pending.push_back(sse(&usage));
            }
            self.pending
                .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            self.response.log_finished(reason, completion_tokens);
            self.done = true;
        }
    }
    let state = State {
        response,
        events,
        first: Some(first),
        pending: Default::default(),
        started: false,
        done: false,
    };
    futures::stream::unfold(state, move |mut s| {
        let app = app.clone();
        async move {
            let served = app.served()?;
            loop {
                if let Some(bytes) = s.pending.pop_front() {
                    return Some((Ok(bytes), s));
                }
                if s.done {
                    return None;
                }
                if !s.started && s.response.request.endpoint == Endpoint::Chat {
                    s.started = true;
                    let mut first = s.response.chunk("", &[], None);
                    first["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
                    s.pending.push_back(sse(&first));
                    continue;
                }
                let event = match s.first.take() {
                    Some(first) => Some(first),
                    None => match next_event(&mut s.events, &mut s.response.cut).await {
                        Some(event) => event,
                        None => {
                            tracing::info!(request = %s.response.id, "stream ended by the drain deadline");
                            s.pending.push_back(sse(&cut_error().body()));
                            s.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                            s.done = true;
                            continue;
                        }
                    },
                };
                match event {
                    Some(SequenceEvent::Token(token)) => {
                        s.response.token_ids.push(token);
                        let (delta, stopped) =
                            s.response.decoder.next_delta(served, &s.response.token_ids);
                        let chunk = s.response.chunk(&delta, &[token], None);
                        s.pending.push_back(sse(&chunk));
                        if stopped {
                            // The stream ends here; dropping `events` ends the generation.
                            let generated = s.response.token_ids.len();
                            let prompt_tokens = s.response.request.prompt_tokens;
                            s.finish("", FinishReason::Stop, prompt_tokens, generated);
                        }
                    }
                    Some(SequenceEvent::Finished {
                        reason,
                        prompt_tokens,
                        completion_tokens,
                    }) => {
                        let rest = s.response.decoder.rest(served, &s.response.token_ids);
                        s.finish(&rest, reason, prompt_tokens, completion_tokens);
                    }
                    Some(SequenceEvent::Failed(reason)) => {
                        let error = ApiError::unavailable(format!("generation failed: {reason}"));
                        s.pending.push_back(sse(&error.body()));
                        s.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                        s.done = true;
                    }
                    None => s.done = true,
                }
            }
        }
    })
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// Turns generated ids into text: for streaming, each delta is what the decoded text grew
/// by, held back while it ends in an incomplete character or in what may be the start of a
/// stop string; text from a stop string on is never sent. Without a tokenizer the text is
/// empty and clients read `token_ids`.
struct TextDecoder {
    stops: StopStrings,
    /// Bytes of the decoded text already sent.
    sent: usize,
}

impl TextDecoder {
    fn new(stops: Vec<String>) -> Self {
        TextDecoder {
            stops: StopStrings::new(stops),
            sent: 0,
        }
    }

    fn has_stops(&self) -> bool {
        !self.stops.is_empty()
    }

    fn full_text(&self, served: &ServedModel, ids: &[u32]) -> String {
        served
            .tokenizer
            .as_ref()
            .and_then(|t| t.decode_text(ids).ok())
            .unwrap_or_default()
    }

    /// The text of `ids`, cut before the first stop string.
    fn final_text(&self, served: &ServedModel, ids: &[u32]) -> String {
        let mut text = self.full_text(served, ids);
        if let Some(at) = self.stops.find(&text) {
            text.truncate(at);
        }
        text
    }

    fn stop_reached(&self, served: &ServedModel, ids: &[u32]) -> bool {
        self.stops.find(&self.full_text(served, ids)).is_some()
    }

    /// The next piece of text to stream, and whether a stop string was reached.
    fn next_delta(&mut self, served: &ServedModel, ids: &[u32]) -> (String, bool) {
        let text = self.full_text(served, ids);
        if let Some(at) = self.stops.find(&text) {
            return (self.take(&text, at), true);
        }
        if text.ends_with('\u{FFFD}') {
            return (String::new(), false);
        }
        let safe = self.stops.safe_len(&text);
        (self.take(&text, safe), false)
    }

    /// Whatever is left at the end, complete or not.
    fn rest(&mut self, served: &ServedModel, ids: &[u32]) -> String {
        let text = self.final_text(served, ids);
        self.take(&text, text.len())
    }

    /// `text[sent..end]`, after which `end` counts as sent.
    fn take(&mut self, text: &str, end: usize) -> String {
        match text.get(self.sent..end) {
            Some(delta) => {
                self.sent = end;
                delta.to_string()
            }
            None => String::new(),
        }
    }
}
