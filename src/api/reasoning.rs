//! A reasoning model's thinking split out of its chat answer: returned as the message's
//! `reasoning_content` beside `content` (and streamed as `reasoning_content` deltas), as
//! DeepSeek's API and vLLM return it, so that a client shows the answer without the
//! thinking and tool calls are read from the answer alone.
//!
//! Two ways of writing it, told apart by the chat template:
//! - [`ReasoningFormat::Think`]: `<think>` reasoning `</think>` answer (DeepSeek-R1 and
//!   V3.1 to V4, Qwen3 and Qwen3.5, GLM-4.5 to 5, MiniMax-M2, Kimi K2 Thinking). A template
//!   that ends the prompt with `<think>` (thinking mode) leaves the output inside the block;
//!   otherwise the output is an answer unless it opens the block itself. An answer with no
//!   `</think>` after an opened block is all reasoning, as vLLM reads it.
//! - [`ReasoningFormat::Harmony`]: gpt-oss's channels, `<|channel|>analysis<|message|>`
//!   reasoning `<|end|>`, then `<|start|>assistant<|channel|>final<|message|>` answer; a
//!   `commentary` message addressed `to=functions.NAME` is a tool call, handed on as the
//!   tool-call parser reads it, and one addressed to nobody is part of the answer.

use serde_json::{Map, Value};

use super::ApiError;
use super::generation::RequestContext;
use crate::model::Family;
use crate::model::chat_template::TEMPLATE_VARIABLES;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

const HARMONY_START: &str = "<|start|>";
const HARMONY_CHANNEL: &str = "<|channel|>";
const HARMONY_MESSAGE: &str = "<|message|>";
const HARMONY_RECIPIENT: &str = "to=functions.";
/// What ends a harmony message: the last three end the generation too.
const HARMONY_ENDS: [&str; 4] = ["<|end|>", HARMONY_START, "<|call|>", "<|return|>"];
/// A header longer than this without `<|message|>` is not one: it is answer text.
const MAX_HEADER_BYTES: usize = 256;

/// How a model writes its reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    Think,
    Harmony,
}

impl ReasoningFormat {
    /// The format the chat template shows the model reasoning in, if any.
    pub fn detect(template: &str, family: Family) -> Option<Self> {
        if family == Family::GptOss || template.contains("<|channel|>analysis") {
            Some(ReasoningFormat::Harmony)
        } else if template.contains(THINK_CLOSE) {
            Some(ReasoningFormat::Think)
        } else {
            None
        }
    }

    /// Whether a prompt whose last tokens read `tail` (special tokens' text included) left
    /// the output inside the reasoning block.
    pub fn opened_by(self, tail: &str) -> bool {
        match self {
            ReasoningFormat::Think => tail.trim_end().ends_with(THINK_OPEN),
            ReasoningFormat::Harmony => false,
        }
    }

    /// Whether the split needs the text of special tokens (harmony's markers always are;
    /// `</think>` is in some tokenizers), given whether `text` is special in this model's.
    pub fn needs_special_text(self, is_special: impl Fn(&str) -> bool) -> bool {
        match self {
            ReasoningFormat::Think => is_special(THINK_OPEN) || is_special(THINK_CLOSE),
            ReasoningFormat::Harmony => true,
        }
    }
}

/// How one request's answers are split.
#[derive(Debug, Clone, Copy)]
pub struct ReasoningSplit {
    pub format: ReasoningFormat,
    /// The prompt left the output inside the reasoning block.
    pub opened: bool,
    /// `include_reasoning`: whether the reasoning is returned (it is split off either way).
    pub include: bool,
    /// The split reads special tokens' text, which the answer's text must then keep.
    pub special: bool,
}

impl ReasoningSplit {
    pub fn stream(self) -> ReasoningStream {
        ReasoningStream::new(self.format, self.opened)
    }
}

/// How a chat request to this model is split: from the model's format and the end of the
/// request's prompt (`prompt`: its ids).
pub fn split_for(
    served: &RequestContext,
    prompt: &[u32],
    include: Option<bool>,
) -> Option<ReasoningSplit> {
    let format = served.reasoning?;
    // The last tokens hold `<think>` and what a template writes after it (a tokenizer
    // without a `<think>` token spells it in up to 7).
    let tail = served
        .tokenizer
        .and_then(|t| t.decode(&prompt[prompt.len().saturating_sub(16)..]).ok())
        .unwrap_or_default();
    Some(ReasoningSplit {
        format,
        opened: format.opened_by(&tail),
        include: include != Some(false),
        special: format.needs_special_text(|text| {
            served
                .tokenizer
                .is_some_and(|t| t.special_token_id(text).is_some())
        }),
    })
}

/// `reasoning_effort`'s values: OpenAI's, and DeepSeek-V4's `max`.
const REASONING_EFFORTS: [&str; 7] = ["none", "minimal", "low", "medium", "high", "xhigh", "max"];

/// A request's `chat_template_kwargs` (an object whose keys become the template's variables,
/// none of those it is always given) with its `reasoning_effort` (which wins over a
/// `reasoning_effort` among them unless null, as vLLM merges them).
pub fn template_kwargs(
    kwargs: Option<Value>,
    effort: Option<Value>,
) -> Result<Map<String, Value>, ApiError> {
    let mut kwargs = match kwargs {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(map)) => map,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "chat_template_kwargs must be an object of the template's variables, got {other}"
            ))
            .with_param("chat_template_kwargs"));
        }
    };
    if let Some(name) = kwargs
        .keys()
        .find(|k| TEMPLATE_VARIABLES.contains(&k.as_str()))
    {
        return Err(ApiError::bad_request(format!(
            "chat_template_kwargs cannot set `{name}`: the request's own fields give the \
             template {}",
            TEMPLATE_VARIABLES.join(", ")
        ))
        .with_param("chat_template_kwargs"));
    }
    match effort {
        None | Some(Value::Null) => {}
        Some(Value::String(e)) if REASONING_EFFORTS.contains(&e.as_str()) => {
            kwargs.insert("reasoning_effort".into(), Value::String(e));
        }
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "reasoning_effort must be one of {}, got {other}",
                REASONING_EFFORTS.join(", ")
            ))
            .with_param("reasoning_effort"));
        }
    }
    Ok(kwargs)
}

/// A stretch of the output, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Reasoning(String),
    /// The answer (tool calls included, which the tool-call parser reads out of it).
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the block may still open.
    Start,
    /// Inside the reasoning; leading whitespace not handed on yet.
    ReasoningStart,
    Reasoning,
    /// Just past the reasoning: the whitespace before the answer is dropped.
    ContentStart,
    Content,
    /// A harmony header (up to `<|message|>`).
    Header,
    /// A harmony message's body, on a channel.
    Body(Channel),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Channel {
    Reasoning,
    Content,
    /// A tool call, handed on with its header and end marker for the tool-call parser.
    Call,
}

/// Splits an output as it streams.
#[derive(Debug)]
pub struct ReasoningStream {
    state: State,
    /// Text received and not yet handed on.
    buffer: String,
}

impl ReasoningStream {
    /// `opened`: the prompt left the output inside the reasoning block.
    pub fn new(format: ReasoningFormat, opened: bool) -> Self {
        let state = match (format, opened) {
            (ReasoningFormat::Think, true) => State::ReasoningStart,
            (ReasoningFormat::Think, false) => State::Start,
            (ReasoningFormat::Harmony, _) => State::Header,
        };
        ReasoningStream {
            state,
            buffer: String::new(),
        }
    }

    /// A whole output's reasoning (`None` when it has none) and answer.
    pub fn split(format: ReasoningFormat, opened: bool, text: &str) -> (Option<String>, String) {
        let mut stream = ReasoningStream::new(format, opened);
        let (mut reasoning, mut content) = (None::<String>, String::new());
        for part in stream.push(text).into_iter().chain(stream.finish()) {
            match part {
                Part::Reasoning(t) => reasoning.get_or_insert_default().push_str(&t),
                Part::Content(t) => content.push_str(&t),
            }
        }
        (reasoning, content)
    }

    /// Adds generated text; returns what can be handed on now.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.buffer.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out.retain(|p| !matches!(p, Part::Reasoning(t) | Part::Content(t) if t.is_empty()));
        out
    }

    /// The output has ended: what is held back, as what it was part of.
    pub fn finish(&mut self) -> Vec<Part> {
        let rest = std::mem::take(&mut self.buffer);
        let part = match self.state {
            State::ReasoningStart | State::Reasoning | State::Body(Channel::Reasoning) => {
                Part::Reasoning(rest.trim_end().to_string())
            }
            State::ContentStart => Part::Content(rest.trim_start().to_string()),
            State::Start | State::Content | State::Header | State::Body(_) => Part::Content(rest),
        };
        self.state = State::Content;
        match part {
            Part::Reasoning(t) | Part::Content(t) if t.is_empty() => Vec::new(),
            part => vec![part],
        }
    }

    /// Takes one step through the buffer; returns whether another may follow.
    fn step(&mut self, out: &mut Vec<Part>) -> bool {
        match self.state {
            State::Start => {
                let text = self.buffer.trim_start();
                if let Some(rest) = text.strip_prefix(THINK_OPEN) {
                    self.buffer = rest.to_string();
                    self.state = State::ReasoningStart;
                    true
                } else if THINK_OPEN.starts_with(text) {
                    false
                } else {
                    self.state = State::Content;
                    true
                }
            }
            State::ReasoningStart | State::ContentStart => {
                let text = self.buffer.trim_start();
                if text.is_empty() {
                    self.buffer.clear();
                    return false;
                }
                self.buffer = text.to_string();
                self.state = match self.state {
                    State::ReasoningStart => State::Reasoning,
                    _ => State::Content,
                };
                true
            }
            State::Reasoning => {
                if let Some(at) = self.buffer.find(THINK_CLOSE) {
                    out.push(Part::Reasoning(self.buffer[..at].trim_end().to_string()));
                    self.buffer.drain(..at + THINK_CLOSE.len());
                    self.state = State::ContentStart;
                    return true;
                }
                // Held back: the start of a `</think>`, and whitespace that may end the
                // reasoning.
                let whole = partial_suffix(&self.buffer, &[THINK_CLOSE]);
                let ready = self.buffer[..whole].trim_end().len();
                out.push(Part::Reasoning(self.buffer[..ready].to_string()));
                self.buffer.drain(..ready);
                false
            }
            State::Content => {
                out.push(Part::Content(std::mem::take(&mut self.buffer)));
                false
            }
            State::Header => self.header(out),
            State::Body(channel) => self.body(channel, out),
        }
    }

    /// A harmony header: which channel the message is on, once `<|message|>` has come. Text
    /// that does not open as a header, or whose header runs past [`MAX_HEADER_BYTES`], is an
    /// answer as written (decided alike however the text is cut into pieces).
    fn header(&mut self, out: &mut Vec<Part>) -> bool {
        let text = self.buffer.trim_start();
        let markers = [HARMONY_START, HARMONY_CHANNEL];
        let opens = markers.iter().any(|m| text.starts_with(m));
        let may_open = opens || markers.iter().any(|m| m.starts_with(text));
        let found = self
            .buffer
            .find(HARMONY_MESSAGE)
            .filter(|at| opens && at + HARMONY_MESSAGE.len() <= MAX_HEADER_BYTES);
        let Some(at) = found else {
            if !may_open || self.buffer.len() >= MAX_HEADER_BYTES {
                self.state = State::Body(Channel::Content);
                return true;
            }
            return false;
        };
        let header = self.buffer[..at].to_string();
        self.buffer.drain(..at + HARMONY_MESSAGE.len());
        let channel = header
            .split_once(HARMONY_CHANNEL)
            .map_or("", |(_, c)| c)
            .split(|c: char| c.is_whitespace() || c == '<')
            .next()
            .unwrap_or_default();
        let channel = if let Some(to) = header.find(HARMONY_RECIPIENT) {
            out.push(Part::Content(format!("{}{HARMONY_MESSAGE}", &header[to..])));
            Channel::Call
        } else if channel == "analysis" {
            Channel::Reasoning
        } else {
            Channel::Content
        };
        self.state = State::Body(channel);
        true
    }

    /// A harmony message's body up to the marker that ends it.
    fn body(&mut self, channel: Channel, out: &mut Vec<Part>) -> bool {
        let end = HARMONY_ENDS
            .iter()
            .filter_map(|marker| self.buffer.find(marker).map(|at| (at, *marker)))
            .min();
        let Some((at, marker)) = end else {
            let ready = partial_suffix(&self.buffer, &HARMONY_ENDS);
            let text: String = self.buffer.drain(..ready).collect();
            out.push(match channel {
                Channel::Reasoning => Part::Reasoning(text),
                Channel::Content | Channel::Call => Part::Content(text),
            });
            return false;
        };
        let body: String = self.buffer.drain(..at).collect();
        // `<|start|>` opens the next header: it stays for `header` to read past.
        let taken = if marker == HARMONY_START {
            0
        } else {
            marker.len()
        };
        let ended: String = self.buffer.drain(..taken).collect();
        out.push(match channel {
            Channel::Reasoning => Part::Reasoning(body),
            Channel::Content => Part::Content(body),
            Channel::Call => Part::Content(body + &ended),
        });
        self.state = State::Header;
        true
    }
}

/// How much of `text` can be handed on: all but a suffix that may be the start of one of
/// `markers`.
fn partial_suffix(text: &str, markers: &[&str]) -> usize {
    let longest = markers.iter().map(|m| m.len()).max().unwrap_or(0);
    let from = text.len().saturating_sub(longest.saturating_sub(1));
    (from..text.len())
        .filter(|&at| text.is_char_boundary(at))
        .find(|&at| markers.iter().any(|m| m.starts_with(&text[at..])))
        .unwrap_or(text.len())
}

#[cfg(test)]
mod tests;
