//! One generation, from a validated request to its events: what both endpoints share. A
//! request is parsed into an [`Admitted`] generation (in `openai.rs`, with `structured.rs`
//! for grammars), submitted to the router here, and its events read here until the drain
//! time cuts them; `response.rs` shapes them into the reply. Arrows run one way: handlers ->
//! response and structured output -> this module.

use tokio::sync::{mpsc, watch};

use super::reasoning::ReasoningFormat;
use super::tool_calls::ToolCallFormat;
use super::{ApiError, ServedModel};
use crate::config::{BatchingConfig, NodeConfig};
use crate::engine::SamplingParams;
use crate::engine::batch::SequenceEvent;
use crate::engine::grammar::{Constraint, Grammars};
use crate::model::chat_template::ChatTemplate;
use crate::model::{ModelConfig, Tokenizer};
use crate::node::router::{Submit, SubmitError};

/// Which endpoint a generation answers: it decides the shape of the response.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Endpoint {
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
    /// Structured output; `None` without a tokenizer.
    pub grammars: Option<&'a Grammars>,
    /// How the model writes tool calls; `None` if its chat template writes none.
    pub tool_format: Option<ToolCallFormat>,
    /// How the model writes its reasoning; `None` if its chat template shows none.
    pub reasoning: Option<ReasoningFormat>,
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
            grammars: self.grammars.as_ref(),
            tool_format: self.tool_format,
            reasoning: self.reasoning,
        }
    }
}

/// A validated request, ready for the router.
#[derive(Debug)]
pub struct Admitted {
    pub(super) endpoint: Endpoint,
    pub(super) model: String,
    /// Handed to the router on submission.
    pub(super) prompt: Vec<u32>,
    pub(super) prompt_tokens: usize,
    pub(super) max_tokens: usize,
    pub(super) sampling: SamplingParams,
    pub(super) stop_at_eos: bool,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) return_token_ids: bool,
    pub(super) stop: Vec<String>,
    /// Choices (`n`).
    pub(super) choices: usize,
    /// Alternatives per generated token's log probabilities, when asked for.
    pub(super) logprobs: Option<usize>,
    /// The prompt returned before the completion (`echo`).
    pub(super) echo: Option<Echo>,
    /// The grammar the output must match, and the token that ends it.
    pub(super) constraint: Option<(Constraint, u32)>,
    /// The format tool calls are parsed out of the output in.
    pub(super) tool_calls: Option<ToolCallFormat>,
    /// `parallel_tool_calls: false`: a choice returns its first call only.
    pub(super) single_tool_call: bool,
    /// The tokens that end the generation (their text is never part of the output).
    pub(super) end_tokens: Vec<u32>,
    /// How a reasoning model's reasoning is split out of its chat answer.
    pub(super) reasoning: Option<super::reasoning::ReasoningSplit>,
    /// Tokens generated before, elsewhere (`resume_token_ids`): the generation goes on
    /// after them.
    pub(super) resumed: Vec<u32>,
}

/// What `echo` returns of the prompt.
#[derive(Debug, Default)]
pub(super) struct Echo {
    pub(super) ids: Vec<u32>,
    pub(super) text: String,
    /// Alternatives per prompt token's log probabilities, when asked for.
    pub(super) logprobs: Option<usize>,
}

/// Hands an admitted request to the router; its events arrive on the receiver. A full queue
/// is 429, a stopped router 503.
pub(super) async fn submit(
    served: &ServedModel,
    request: &mut Admitted,
    id: &str,
    parent: Option<crate::transport::wire::TraceContext>,
) -> Result<mpsc::Receiver<SequenceEvent>, ApiError> {
    let span = request_span(request, id, parent);
    served
        .node
        .router
        .submit(Submit {
            prompt: std::mem::take(&mut request.prompt),
            max_tokens: request.max_tokens,
            sampling: request.sampling.clone(),
            stop_at_eos: request.stop_at_eos,
            choices: request.choices,
            logprobs: request.logprobs,
            prompt_logprobs: request.echo.as_ref().and_then(|echo| echo.logprobs),
            constraint: request.constraint.take(),
            resumed: request.resumed.clone(),
            span,
        })
        .await
        .map_err(|e| match e {
            SubmitError::QueueFull(full) => ApiError::overloaded(full.to_string()),
            SubmitError::Stopped => ApiError::unavailable(e.to_string()),
        })
}

/// The span of generation request `id`, when traces are exported ([`crate::telemetry`]):
/// a child of the caller's span when its `traceparent` named one.
fn request_span(
    request: &Admitted,
    id: &str,
    parent: Option<crate::transport::wire::TraceContext>,
) -> tracing::Span {
    if !crate::telemetry::enabled() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "request",
        request = id,
        prompt_tokens = request.prompt.len(),
        max_tokens = request.max_tokens,
        choices = request.choices,
    );
    if let Some(parent) = parent {
        crate::telemetry::set_remote_parent(&span, parent);
    }
    span
}

/// The first event of generation `id`. The response's status waits for it, streamed or
/// not, so that a request that fails before its first token (no live replica, the router
/// gone) gets its error status.
pub(super) async fn first_event(
    id: &str,
    events: &mut mpsc::Receiver<SequenceEvent>,
    cut: &mut watch::Receiver<bool>,
) -> Result<SequenceEvent, ApiError> {
    match next_event(events, cut).await {
        Some(Some(SequenceEvent::Failed(error))) => {
            tracing::info!(request = %id, reason = %error, "request failed");
            Err(ApiError::generation_failed(&error))
        }
        Some(None) => Err(ApiError::unavailable("the router stopped")),
        None => Err(cut_error()),
        Some(Some(event)) => Ok(event),
    }
}

/// Resolves when the drain time is up (never, if the node's state is gone).
async fn drain_cut(cut: &mut watch::Receiver<bool>) {
    if cut.wait_for(|&cut| cut).await.is_err() {
        futures::future::pending::<()>().await;
    }
}

/// The error a response still running at the end of the drain time ends with.
pub(super) fn cut_error() -> ApiError {
    ApiError::unavailable(
        "the node is shutting down: its drain time (server.drain_seconds) is up, or the \
         gateway that sent this stream goes on with it on another node; the generation was \
         ended here",
    )
    .with_code("shutting_down")
}

/// The next event of a generation, or `None` once the drain time is up.
pub(super) async fn next_event(
    events: &mut mpsc::Receiver<SequenceEvent>,
    cut: &mut watch::Receiver<bool>,
) -> Option<Option<SequenceEvent>> {
    tokio::select! {
        event = events.recv() => Some(event),
        _ = drain_cut(cut) => None,
    }
}
