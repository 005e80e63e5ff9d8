//! A generation's response as its events arrive: one text per choice (`n`), log
//! probabilities in the endpoint's format, sent whole or as server-sent events.

use std::collections::VecDeque;
use std::time::Instant;

use actix_web::web::Bytes;
use actix_web::{HttpResponse, web};
use futures::Stream;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

use super::detokenize::ChoiceText;
use super::generation::{Admitted, Endpoint, cut_error, next_event};
use super::reasoning::{Part, ReasoningStream};
use super::stop::StopStrings;
use super::tool_calls::{Piece, ToolCall, ToolCallStream};
use super::{ApiError, AppState, ServedModel};
use crate::engine::FinishReason;
use crate::engine::batch::SequenceEvent;
use crate::engine::logprobs::TokenLogprobs;
use crate::model::Tokenizer;

/// The state of one response as tokens arrive.
pub(super) struct Response {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) request: Admitted,
    choices: Vec<Choice>,
    /// The prompt's log probabilities (after its first token), once prefilled.
    prompt_logprobs: Vec<TokenLogprobs>,
    /// Tokens received over all choices.
    tokens_seen: usize,
    /// Chunks a stream still has to send.
    out: VecDeque<Bytes>,
    pub(super) started: Instant,
    /// Turns true when the drain time is up.
    pub(super) cut: watch::Receiver<bool>,
    /// Some tokens were routed around experts with no live replica: every envelope from
    /// then on says `"degraded": true`.
    degraded: bool,
    /// It goes on from tokens made elsewhere ([`Response::take_resumed`]).
    resumed: bool,
    pub(super) _in_flight: super::InFlight,
}

/// One choice of a response.
struct Choice {
    text: ChoiceText,
    /// A reasoning model's reasoning split off the text as it streams, and whether it is
    /// sent (`include_reasoning`).
    reasoning: Option<(ReasoningStream, bool)>,
    /// Tool calls parsed out of the text as it streams (requests with `tools`).
    tool_stream: Option<ToolCallStream>,
    token_ids: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
    /// Characters of token text streamed so far (the legacy format's `text_offset`).
    streamed_chars: usize,
    /// Set when the choice has ended, by the router or by a stop string.
    finish_reason: Option<&'static str>,
    /// Tool calls streamed so far.
    calls_sent: usize,
    /// Whether a stream has sent the prompt of an `echo` request for this choice.
    echoed: bool,
}

impl Choice {
    /// What `text`, the next of the output, hands on (`last`: the output has ended): the
    /// reasoning split off first, then calls parsed out of the answer.
    fn pieces(&mut self, text: &str, last: bool) -> Vec<Piece> {
        let parts = match &mut self.reasoning {
            Some((split, include)) => {
                let mut parts = split.push(text);
                if last {
                    parts.extend(split.finish());
                }
                if !*include {
                    parts.retain(|p| matches!(p, Part::Content(_)));
                }
                parts
            }
            None => vec![Part::Content(text.to_string())],
        };
        let mut pieces = Vec::new();
        for part in parts {
            match (part, &mut self.tool_stream) {
                (Part::Reasoning(text), _) => pieces.push(Piece::Reasoning(text)),
                (Part::Content(text), Some(tools)) => pieces.extend(tools.push(&text)),
                (Part::Content(text), None) => pieces.push(Piece::Text(text)),
            }
        }
        if let (true, Some(tools)) = (last, &mut self.tool_stream) {
            pieces.extend(tools.finish());
        }
        pieces
    }
}

impl Response {
    pub(super) fn new(
        id: String,
        created: u64,
        request: Admitted,
        cut: watch::Receiver<bool>,
        in_flight: super::InFlight,
    ) -> Self {
        let choices = (0..request.choices)
            .map(|_| Choice {
                text: if request.tool_calls.is_some()
                    || request.reasoning.is_some_and(|r| r.special)
                {
                    ChoiceText::new(StopStrings::new(request.stop.clone()))
                        .keeping_special_tokens(request.end_tokens.clone())
                } else {
                    ChoiceText::new(StopStrings::new(request.stop.clone()))
                },
                reasoning: request.reasoning.map(|r| (r.stream(), r.include)),
                tool_stream: request.tool_calls.map(ToolCallStream::new),
                token_ids: Vec::new(),
                logprobs: Vec::new(),
                streamed_chars: 0,
                finish_reason: None,
                calls_sent: 0,
                echoed: false,
            })
            .collect();
        Response {
            id,
            created,
            request,
            choices,
            prompt_logprobs: Vec::new(),
            tokens_seen: 0,
            out: VecDeque::new(),
            started: Instant::now(),
            cut,
            degraded: false,
            resumed: false,
            _in_flight: in_flight,
        }
    }

    fn streaming(&self) -> bool {
        self.request.stream
    }

    /// A resumed generation's earlier tokens, taken as if they had just arrived: the text,
    /// stop strings, reasoning split and tool-call parser stand where they stood on the node
    /// that made them, and a stream sends none of it again (nor a chat stream's opening
    /// chunk). Their log probabilities are not known here: a whole response lists only
    /// those of the tokens made after them.
    pub(super) fn take_resumed(&mut self, served: &ServedModel) -> Result<(), ApiError> {
        for token in std::mem::take(&mut self.request.resumed) {
            let event = SequenceEvent::Token {
                choice: 0,
                token,
                logprobs: None,
            };
            if self.take(served, event)? {
                return Err(ApiError::bad_request(
                    "resume_token_ids already ends the generation (a stop string)",
                )
                .with_param("resume_token_ids"));
            }
            self.resumed = true;
        }
        self.out.clear();
        Ok(())
    }

    /// Takes one event of the generation; returns whether every choice has ended. A
    /// stream's chunks are queued in `out`.
    fn take(&mut self, served: &ServedModel, event: SequenceEvent) -> Result<bool, ApiError> {
        let tokenizer = served.tokenizer.as_ref();
        match event {
            SequenceEvent::PromptLogprobs(logprobs) => self.prompt_logprobs = logprobs,
            SequenceEvent::Token {
                choice: index,
                token,
                logprobs,
            } => {
                let streaming = self.streaming();
                let Some(choice) = self.choices.get_mut(index) else {
                    return Ok(false);
                };
                if choice.finish_reason.is_some() {
                    // Cut by a stop string; its sequence runs on only while others do.
                    return Ok(false);
                }
                self.tokens_seen += 1;
                choice.token_ids.push(token);
                if streaming {
                    self.stream_echo(tokenizer, index);
                }
                let Some(choice) = self.choices.get_mut(index) else {
                    return Ok(false);
                };
                let stopped = choice.text.push(tokenizer, token);
                if streaming {
                    let delta = choice.text.delta();
                    let pieces = choice.pieces(&delta, false);
                    let logprobs = logprobs.as_ref().map(|lp| match self.request.endpoint {
                        Endpoint::Completions => {
                            let mut legacy = LegacyLogprobs::starting_at(choice.streamed_chars);
                            legacy.push(tokenizer, token, Some(lp));
                            choice.streamed_chars = legacy.offset;
                            legacy.into_json()
                        }
                        Endpoint::Chat => json!({"content": [chat_logprob(tokenizer, lp)]}),
                    });
                    self.stream_pieces(index, pieces, &[token], logprobs);
                }
                if let (Some(lp), Some(choice)) = (logprobs, self.choices.get_mut(index)) {
                    choice.logprobs.push(lp);
                }
                if stopped {
                    self.end_choice(tokenizer, index, FinishReason::Stop);
                }
            }
            SequenceEvent::Finished {
                choice: index,
                reason,
                ..
            } => {
                if self
                    .choices
                    .get(index)
                    .is_some_and(|c| c.finish_reason.is_none())
                {
                    self.end_choice(tokenizer, index, reason);
                }
            }
            SequenceEvent::Failed(error) => {
                tracing::info!(request = %self.id, reason = %error, "request failed");
                return Err(ApiError::generation_failed(&error));
            }
            SequenceEvent::Degraded { choice } => {
                if !self.degraded {
                    tracing::warn!(request = %self.id, choice, "answer degraded: tokens routed around experts with no live replica");
                }
                self.degraded = true;
            }
        }
        let done = self.choices.iter().all(|c| c.finish_reason.is_some());
        if done {
            self.finish();
        }
        Ok(done)
    }

    /// Choice `index` has ended: a stream sends the rest of its text and its reason.
    fn end_choice(&mut self, tokenizer: Option<&Tokenizer>, index: usize, reason: FinishReason) {
        let reason = finish_reason(reason);
        let streaming = self.streaming();
        if streaming {
            // A choice can end before its first token (`max_tokens: 0` scores the prompt).
            self.stream_echo(tokenizer, index);
        }
        let Some(choice) = self.choices.get_mut(index) else {
            return;
        };
        if streaming {
            let rest = choice.text.rest(tokenizer);
            let pieces = choice.pieces(&rest, true);
            let called = choice.tool_stream.as_ref().is_some_and(|t| t.calls() > 0);
            let reason = tool_calls_reason(reason, called);
            if let Some(choice) = self.choices.get_mut(index) {
                choice.finish_reason = Some(reason);
            }
            let (text, rest): (Vec<_>, Vec<_>) = pieces
                .into_iter()
                .partition(|p| matches!(p, Piece::Text(_)));
            // Calls get chunks of their own; the last text goes with the reason.
            self.stream_pieces(index, rest, &[], None);
            let text: String = text
                .into_iter()
                .map(|p| match p {
                    Piece::Text(t) => t,
                    Piece::Call(_) | Piece::Reasoning(_) => String::new(),
                })
                .collect();
            let chunk = self.chunk(index, &text, &[], None, Some(reason));
            self.out.push_back(sse(&chunk));
        } else {
            choice.finish_reason = Some(reason);
        }
    }

    /// The prompt of an `echo` request, with its log probabilities when they were asked
    /// for (the first token has none).
    fn echo_logprobs(&self, tokenizer: Option<&Tokenizer>) -> Option<LegacyLogprobs> {
        let echo = self.request.echo.as_ref()?;
        let mut legacy = LegacyLogprobs::starting_at(0);
        for (i, &id) in echo.ids.iter().enumerate() {
            let lp = i.checked_sub(1).and_then(|i| self.prompt_logprobs.get(i));
            legacy.push(tokenizer, id, lp);
        }
        Some(legacy)
    }

    /// A stream of an `echo` request sends each choice's prompt in a chunk of its own
    /// before the choice's first token, as the whole response puts it before the text.
    fn stream_echo(&mut self, tokenizer: Option<&Tokenizer>, index: usize) {
        let Some(echo) = &self.request.echo else {
            return;
        };
        if self.choices.get(index).is_none_or(|c| c.echoed) {
            return;
        }
        let text = echo.text.clone();
        let with_logprobs = echo.logprobs.is_some();
        let legacy = self.echo_logprobs(tokenizer);
        let offset = legacy.as_ref().map_or(0, |l| l.offset);
        let logprobs = legacy
            .filter(|_| with_logprobs)
            .map(LegacyLogprobs::into_json);
        let chunk = self.chunk(index, &text, &[], logprobs, None);
        self.out.push_back(sse(&chunk));
        if let Some(choice) = self.choices.get_mut(index) {
            choice.echoed = true;
            choice.streamed_chars = offset;
        }
    }

    /// Queues the chunks of `pieces` of choice `index`: text as content, each call as a
    /// `tool_calls` delta. The token's ids and log probabilities go with the first; with
    /// no pieces, an empty chunk carries them.
    fn stream_pieces(
        &mut self,
        index: usize,
        pieces: Vec<Piece>,
        ids: &[u32],
        logprobs: Option<Value>,
    ) {
        let mut ids = Some((ids, logprobs));
        let pieces = match self.choices.get(index) {
            Some(choice) if self.request.single_tool_call => {
                first_call_only(pieces, choice.calls_sent)
            }
            _ => pieces,
        };
        let mut pieces = pieces.into_iter().peekable();
        if pieces.peek().is_none() {
            if let Some((ids, logprobs)) = ids.take()
                && (!ids.is_empty() || logprobs.is_some())
            {
                let chunk = self.chunk(index, "", ids, logprobs, None);
                self.out.push_back(sse(&chunk));
            }
            return;
        }
        for piece in pieces {
            let (token_ids, logprobs) = ids.take().unwrap_or((&[], None));
            let chunk = match piece {
                Piece::Text(text) => self.chunk(index, &text, token_ids, logprobs, None),
                Piece::Reasoning(text) => {
                    let mut chunk = self.chunk(index, "", token_ids, logprobs, None);
                    chunk["choices"][0]["delta"] = json!({"reasoning_content": text});
                    chunk
                }
                Piece::Call(call) => {
                    let Some(choice) = self.choices.get_mut(index) else {
                        return;
                    };
                    let number = choice.calls_sent;
                    choice.calls_sent += 1;
                    let mut chunk = self.chunk(index, "", token_ids, logprobs, None);
                    chunk["choices"][0]["delta"] =
                        json!({"tool_calls": [tool_call_json(number, &call)]});
                    chunk
                }
            };
            self.out.push_back(sse(&chunk));
        }
    }

    /// Every choice has ended: a stream sends usage if asked, then `[DONE]`.
    fn finish(&mut self) {
        let completion_tokens = self.completion_tokens();
        if self.streaming() {
            if self.request.include_usage {
                let mut usage = self.envelope(true, json!([]));
                usage["usage"] = self.usage();
                self.out.push_back(sse(&usage));
            }
            self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        }
        let reasons: Vec<&str> = self
            .choices
            .iter()
            .filter_map(|c| c.finish_reason)
            .collect();
        tracing::info!(
            request = %self.id,
            completion_tokens,
            finish_reason = reasons.join(","),
            seconds = self.started.elapsed().as_secs_f32(),
            "request finished"
        );
    }

    fn completion_tokens(&self) -> usize {
        self.choices.iter().map(|c| c.token_ids.len()).sum()
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.request.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        let mut envelope = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
        });
        if self.degraded {
            // Every chunk from the first degraded token on, and the whole response.
            envelope["degraded"] = json!(true);
        }
        envelope
    }

    fn usage(&self) -> Value {
        let prompt_tokens = self.request.prompt_tokens;
        let completion_tokens = self.completion_tokens();
        json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        })
    }

    /// One streamed chunk of choice `index` carrying `delta` (text) and `ids` (token ids).
    fn chunk(
        &self,
        index: usize,
        delta: &str,
        ids: &[u32],
        logprobs: Option<Value>,
        finish_reason: Option<&str>,
    ) -> Value {
        let mut choice = match self.request.endpoint {
            Endpoint::Completions => json!({"index": index, "text": delta}),
            Endpoint::Chat => {
                let delta = if finish_reason.is_some() && delta.is_empty() {
                    json!({})
                } else {
                    json!({"content": delta})
                };
                json!({"index": index, "delta": delta})
            }
        };
        choice["logprobs"] = logprobs.unwrap_or(Value::Null);
        choice["finish_reason"] = finish_reason.into();
        if self.request.return_token_ids {
            choice["token_ids"] = json!(ids);
        }
        self.envelope(true, json!([choice]))
    }

    /// The whole response, once every choice has ended.
    fn whole_body(&mut self, served: &ServedModel) -> Value {
        let tokenizer = served.tokenizer.as_ref();
        let echo_legacy = self.echo_logprobs(tokenizer);
        let mut choices = Vec::with_capacity(self.choices.len());
        for (index, choice) in self.choices.iter_mut().enumerate() {
            let generated = choice.text.final_text(tokenizer);
            let mut body = match self.request.endpoint {
                Endpoint::Completions => {
                    let mut text = String::new();
                    let mut logprobs = self.request.logprobs.map(|_| {
                        let echoed = self
                            .request
                            .echo
                            .as_ref()
                            .is_some_and(|echo| echo.logprobs.is_some());
                        echo_legacy
                            .clone()
                            .filter(|_| echoed)
                            .unwrap_or_else(|| LegacyLogprobs::starting_at(0))
                    });
                    if let Some(echo) = &self.request.echo {
                        text.push_str(&echo.text);
                    }
                    text.push_str(&generated);
                    if let Some(legacy) = &mut logprobs {
                        for lp in &choice.logprobs {
                            legacy.push(tokenizer, lp.token, Some(lp));
                        }
                    }
                    json!({
                        "index": index,
                        "text": text,
                        "logprobs": logprobs.map(LegacyLogprobs::into_json),
                    })
                }
                Endpoint::Chat => {
                    let (reasoning, generated) = match self.request.reasoning {
                        Some(split) => {
                            let (reasoning, answer) =
                                ReasoningStream::split(split.format, split.opened, &generated);
                            (Some(reasoning).filter(|_| split.include), answer)
                        }
                        None => (None, generated),
                    };
                    let (content, mut calls) = match self.request.tool_calls {
                        Some(format) => {
                            let parsed = format.parse(&generated);
                            (parsed.content, parsed.calls)
                        }
                        None => (generated, Vec::new()),
                    };
                    if self.request.single_tool_call {
                        calls.truncate(1);
                    }
                    if let Some(reason) = &mut choice.finish_reason {
                        *reason = tool_calls_reason(reason, !calls.is_empty());
                    }
                    let mut message = json!({"role": "assistant", "content": content});
                    if let Some(reasoning) = reasoning {
                        // All reasoning (the answer never began): no content, as vLLM says.
                        if reasoning.is_some() && content.is_empty() {
                            message["content"] = Value::Null;
                        }
                        message["reasoning_content"] = reasoning.into();
                    }
                    if !calls.is_empty() {
                        if content.trim().is_empty() {
                            message["content"] = Value::Null;
                        }
                        message["tool_calls"] = calls
                            .iter()
                            .enumerate()
                            .map(|(i, call)| tool_call_json(i, call))
                            .collect();
                    }
                    let logprobs = self.request.logprobs.map(|_| {
                        let content: Vec<Value> = choice
                            .logprobs
                            .iter()
                            .map(|lp| chat_logprob(tokenizer, lp))
                            .collect();
                        json!({"content": content})
                    });
                    json!({
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                    })
                }
            };
            body["finish_reason"] = choice.finish_reason.into();
            if self.request.return_token_ids {
                body["token_ids"] = json!(choice.token_ids);
            }
            choices.push(body);
        }
        let mut body = self.envelope(false, Value::Array(choices));
        body["usage"] = self.usage();
        body
    }
}

/// `parallel_tool_calls: false`: `pieces` without the calls after a choice's first, of
/// which `calls_sent` are already out.
fn first_call_only(pieces: Vec<Piece>, calls_sent: usize) -> Vec<Piece> {
    let mut calls = calls_sent;
    pieces
        .into_iter()
        .filter(|piece| match piece {
            Piece::Call(_) => {
                calls += 1;
                calls == 1
            }
            Piece::Text(_) | Piece::Reasoning(_) => true,
        })
        .collect()
}

/// A choice that ended at the model's end token after calling tools ends with
/// `tool_calls`, as OpenAI's API says.
fn tool_calls_reason(reason: &'static str, called: bool) -> &'static str {
    if called && reason == "stop" {
        "tool_calls"
    } else {
        reason
    }
}

/// A call as the API returns it; `index` counts the choice's calls. Kimi K2 names its
/// calls (`functions.NAME:0`), and its chat template expects those ids back; other
/// formats get `call_` and 24 random characters, as OpenAI's ids.
fn tool_call_json(index: usize, call: &ToolCall) -> Value {
    let id = call.id.clone().unwrap_or_else(|| {
        use rand::Rng;
        let mut rng = rand::rng();
        let suffix: String = (0..24)
            .map(|_| char::from(rng.sample(rand::distr::Alphanumeric)))
            .collect();
        format!("call_{suffix}")
    });
    json!({
        "index": index,
        "id": id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    })
}

fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::Stop => "stop",
    }
}

/// A token as clients read it, and its bytes: its text when its bytes are whole UTF-8,
/// else `bytes:\xNN...` (as OpenAI writes a token that holds part of a character).
/// Without a tokenizer: `token_id:N` and no bytes.
fn token_text(tokenizer: Option<&Tokenizer>, id: u32) -> (String, Option<Vec<u8>>) {
    let Some(tokenizer) = tokenizer else {
        return (format!("token_id:{id}"), None);
    };
    let bytes = tokenizer.token_bytes(id);
    let text = match std::str::from_utf8(&bytes) {
        Ok(text) => text.to_string(),
        Err(_) => {
            let escaped: String = bytes.iter().map(|b| format!("\\x{b:02x}")).collect();
            format!("bytes:{escaped}")
        }
    };
    (text, Some(bytes))
}

/// The completions endpoint's log probabilities: parallel lists of token texts, their
/// log probabilities, the alternatives (text → log probability, the chosen token among
/// them) and each token's offset in characters.
#[derive(Clone)]
struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
    /// Characters of token text so far.
    offset: usize,
}

impl LegacyLogprobs {
    fn starting_at(offset: usize) -> Self {
        LegacyLogprobs {
            tokens: Vec::new(),
            token_logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            text_offset: Vec::new(),
            offset,
        }
    }

    /// Token `id`, with its log probabilities (none for a prompt's first token).
    fn push(&mut self, tokenizer: Option<&Tokenizer>, id: u32, logprobs: Option<&TokenLogprobs>) {
        let (text, _) = token_text(tokenizer, id);
        self.text_offset.push(self.offset);
        self.offset += text.chars().count();
        match logprobs {
            Some(lp) => {
                let mut top = serde_json::Map::new();
                for &(alternative, logprob) in &lp.top {
                    top.insert(token_text(tokenizer, alternative).0, json!(logprob));
                }
                top.insert(text.clone(), json!(lp.logprob));
                self.token_logprobs.push(json!(lp.logprob));
                self.top_logprobs.push(Value::Object(top));
            }
            None => {
                self.token_logprobs.push(Value::Null);
                self.top_logprobs.push(Value::Null);
            }
        }
        self.tokens.push(text);
    }

    fn into_json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

/// One entry of the chat endpoint's `logprobs.content`.
fn chat_logprob(tokenizer: Option<&Tokenizer>, lp: &TokenLogprobs) -> Value {
    let entry = |id: u32, logprob: f32| {
        let (token, bytes) = token_text(tokenizer, id);
        json!({"token": token, "logprob": logprob, "bytes": bytes})
    };
    let mut value = entry(lp.token, lp.logprob);
    value["top_logprobs"] = lp.top.iter().map(|&(id, l)| entry(id, l)).collect();
    value
}

/// A non-streamed response, once its first event is in (so a request that fails at once has
/// got its error status). The body is sent as it forms: a space (JSON allows leading
/// whitespace) every [`KEEPALIVE_TOKENS`] tokens, then the object. The spaces are how a
/// client that went away is noticed: the write fails, the body is dropped, and so is the
/// generation. The status (200) is sent with the first space, so a generation that fails
/// later ends the body with the error envelope instead of the completion.
pub(super) async fn whole_response(
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
                            let body = cut_error().body().to_string();
                            return Some((Ok(Bytes::from(body)), (response, events, None, true)));
                        }
                    },
                };
                let Some(event) = event else {
                    let body = ApiError::unavailable("the router stopped")
                        .body()
                        .to_string();
                    return Some((Ok(Bytes::from(body)), (response, events, None, true)));
                };
                let seen = response.tokens_seen;
                let out = match response.take(served, event) {
                    // Dropping `events` afterwards ends what is still generating.
                    Ok(true) => response.whole_body(served).to_string(),
                    Err(error) => error.body().to_string(),
                    Ok(false) => {
                        let token = response.tokens_seen != seen;
                        if token && response.tokens_seen.is_multiple_of(KEEPALIVE_TOKENS) {
                            return Some((
                                Ok(Bytes::from_static(b" ")),
                                (response, events, None, false),
                            ));
                        }
                        continue;
                    }
                };
                return Some((Ok(Bytes::from(out)), (response, events, None, true)));
            }
        }
    });
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        .streaming::<_, actix_web::Error>(body))
}

/// Tokens between the keep-alive spaces of a non-streamed response.
const KEEPALIVE_TOKENS: usize = 16;

/// Server-sent events: one chunk per token and choice, each choice's finishing chunk,
/// optionally usage, then `data: [DONE]`. Dropping the stream (the client went away) drops
/// the receiver, which ends the generation at the router's next step.
pub(super) fn sse_stream(
    mut response: Response,
    events: mpsc::Receiver<SequenceEvent>,
    first: SequenceEvent,
    app: web::Data<AppState>,
) -> impl Stream<Item = Result<Bytes, actix_web::Error>> + 'static {
    if response.request.endpoint == Endpoint::Chat && !response.resumed {
        for index in 0..response.choices.len() {
            let mut chunk = response.chunk(index, "", &[], None, None);
            chunk["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
            response.out.push_back(sse(&chunk));
        }
    }
    let state = (response, events, Some(first), false);
    futures::stream::unfold(
        state,
        move |(mut response, mut events, mut next, mut done)| {
            let app = app.clone();
            async move {
                let served = app.served()?;
                loop {
                    if let Some(bytes) = response.out.pop_front() {
                        return Some((Ok(bytes), (response, events, next, done)));
                    }
                    if done {
                        return None;
                    }
                    let event = match next.take() {
                        Some(first) => Some(first),
                        None => match next_event(&mut events, &mut response.cut).await {
                            Some(event) => event,
                            None => {
                                tracing::info!(request = %response.id, "stream ended by the drain deadline");
                                response.out.push_back(sse(&cut_error().body()));
                                response
                                    .out
                                    .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                                done = true;
                                continue;
                            }
                        },
                    };
                    let Some(event) = event else {
                        done = true;
                        continue;
                    };
                    match response.take(served, event) {
                        // The stream ends here; dropping `events` ends what still generates.
                        Ok(finished) => done = finished,
                        Err(error) => {
                            response.out.push_back(sse(&error.body()));
                            response
                                .out
                                .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                            done = true;
                        }
                    }
                }
            }
        },
    )
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tool_calls::ToolCall;

    fn call(name: &str) -> Piece {
        Piece::Call(ToolCall {
            id: None,
            name: name.into(),
            arguments: "{}".into(),
        })
    }

    fn names(pieces: &[Piece]) -> Vec<String> {
        pieces
            .iter()
            .map(|p| match p {
                Piece::Text(t) => format!("text {t}"),
                Piece::Call(c) => format!("call {}", c.name),
                Piece::Reasoning(t) => format!("reasoning {t}"),
            })
            .collect()
    }

    #[test]
    fn without_parallel_tool_calls_a_choice_streams_its_first_call_only() {
        let pieces = vec![
            Piece::Text("a".into()),
            call("f"),
            Piece::Text("b".into()),
            call("g"),
        ];
        assert_eq!(
            names(&first_call_only(pieces, 0)),
            ["text a", "call f", "text b"]
        );
        // A call already streamed: the next ones are dropped, text is kept.
        assert_eq!(
            names(&first_call_only(
                vec![call("h"), Piece::Text("c".into())],
                1
            )),
            ["text c"]
        );
    }
}
