//! Tool calls in generated text, in the formats the models publish: the model writes its
//! calls as text between markers (special tokens for Kimi K2 and DeepSeek-V3), and the API
//! returns them as `tool_calls`. Parsing is incremental, so that a stream sends text as
//! it comes and each call as soon as it is complete; a whole response is parsed the same
//! way in one piece. Text that does not parse as a call (a truncated or malformed one) is
//! returned as text, never dropped.

use serde_json::Value;

use crate::model::Family;
pub use crate::model::family::ToolCallFormat;

const HERMES_BEGIN: &str = "<tool_call>";
const HERMES_END: &str = "</tool_call>";
const DEEPSEEK_SECTION_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DEEPSEEK_SECTION_END: &str = "<｜tool▁calls▁end｜>";
const DEEPSEEK_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DEEPSEEK_CALL_END: &str = "<｜tool▁call▁end｜>";
const DEEPSEEK_SEP: &str = "<｜tool▁sep｜>";
const KIMI_SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
const KIMI_SECTION_END: &str = "<|tool_calls_section_end|>";
const KIMI_CALL_BEGIN: &str = "<|tool_call_begin|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";
const KIMI_ARGUMENT_BEGIN: &str = "<|tool_call_argument_begin|>";
const MISTRAL_BEGIN: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const GLM_ARG_KEY: &str = "<arg_key>";
const GLM_ARG_KEY_END: &str = "</arg_key>";
const GLM_ARG_VALUE: &str = "<arg_value>";
const GLM_ARG_VALUE_END: &str = "</arg_value>";
const HARMONY_BEGIN: &str = "to=functions.";
const HARMONY_MESSAGE: &str = "<|message|>";
const HARMONY_CALL: &str = "<|call|>";
const MINIMAX_SECTION_BEGIN: &str = "<minimax:tool_call>";
const MINIMAX_SECTION_END: &str = "</minimax:tool_call>";
const MINIMAX_INVOKE: &str = "<invoke name=\"";
const MINIMAX_INVOKE_END: &str = "</invoke>";
const MINIMAX_PARAMETER: &str = "<parameter name=\"";
const MINIMAX_PARAMETER_END: &str = "</parameter>";
const DSML_V32_BEGIN: &str = "<｜DSML｜function_calls>";
const DSML_V32_END: &str = "</｜DSML｜function_calls>";
const DSML_V4_BEGIN: &str = "<｜DSML｜tool_calls>";
const DSML_V4_END: &str = "</｜DSML｜tool_calls>";
const DSML_INVOKE: &str = "<｜DSML｜invoke name=\"";
const DSML_INVOKE_END: &str = "</｜DSML｜invoke>";
const DSML_PARAMETER: &str = "<｜DSML｜parameter name=\"";
const DSML_PARAMETER_END: &str = "</｜DSML｜parameter>";
const QWEN_FUNCTION: &str = "<function=";
const QWEN_FUNCTION_END: &str = "</function>";
const QWEN_PARAMETER: &str = "<parameter=";

impl ToolCallFormat {
    /// The format a model's chat template writes tool calls in, from the markers it
    /// renders; `None` when it renders none of them.
    pub fn detect(chat_template: &str) -> Option<Self> {
        [
            ToolCallFormat::KimiK2,
            ToolCallFormat::DeepseekV3,
            ToolCallFormat::Mistral,
            ToolCallFormat::MiniMax,
            ToolCallFormat::DeepseekV4,
            ToolCallFormat::DeepseekV32,
            ToolCallFormat::Harmony,
            // These open as Hermes' calls do; their own tags tell them apart.
            ToolCallFormat::Glm,
            ToolCallFormat::Qwen3Coder,
            ToolCallFormat::Hermes,
        ]
        .into_iter()
        .find(|format| format.rendered_by(chat_template))
    }

    /// The format a model of `family` writes tool calls in, from the markers its chat
    /// template renders: the family's own formats are looked for first, then every other
    /// (a fine-tuned checkpoint may have taken another family's template). Calls that open
    /// as Hermes' do but carry their own tags (GLM's, Qwen3.5's) are read as those whatever
    /// the family: such a template renders Hermes' marker too.
    pub fn for_model(chat_template: &str, family: Family) -> Option<Self> {
        let renders = |format: &ToolCallFormat| format.rendered_by(chat_template);
        let tagged = [ToolCallFormat::Glm, ToolCallFormat::Qwen3Coder]
            .iter()
            .any(renders);
        family
            .tool_call_formats()
            .iter()
            .copied()
            .filter(renders)
            .find(|&format| !(tagged && format == ToolCallFormat::Hermes))
            .or_else(|| Self::detect(chat_template))
    }

    /// Whether `chat_template` writes calls in this format: it renders the text that starts
    /// them and, where calls open alike, the tags inside them.
    fn rendered_by(self, chat_template: &str) -> bool {
        let inside = match self {
            ToolCallFormat::Glm => GLM_ARG_KEY,
            ToolCallFormat::Qwen3Coder => QWEN_FUNCTION,
            _ => "",
        };
        chat_template.contains(self.begin()) && chat_template.contains(inside)
    }

    /// The text that starts the model's tool calls.
    pub fn begin(self) -> &'static str {
        match self {
            ToolCallFormat::Hermes | ToolCallFormat::Glm | ToolCallFormat::Qwen3Coder => {
                HERMES_BEGIN
            }
            ToolCallFormat::DeepseekV3 => DEEPSEEK_SECTION_BEGIN,
            ToolCallFormat::KimiK2 => KIMI_SECTION_BEGIN,
            ToolCallFormat::Mistral => MISTRAL_BEGIN,
            ToolCallFormat::MiniMax => MINIMAX_SECTION_BEGIN,
            ToolCallFormat::DeepseekV32 => DSML_V32_BEGIN,
            ToolCallFormat::DeepseekV4 => DSML_V4_BEGIN,
            ToolCallFormat::Harmony => HARMONY_BEGIN,
        }
    }

    /// Parses a whole generated text: its text without the calls, and the calls.
    pub fn parse(self, text: &str) -> Parsed {
        let mut stream = ToolCallStream::new(self);
        let mut parsed = Parsed::default();
        for piece in stream.push(text).into_iter().chain(stream.finish()) {
            match piece {
                Piece::Text(t) => parsed.content.push_str(&t),
                Piece::Call(call) => parsed.calls.push(call),
                // Never from this parser.
                Piece::Reasoning(_) => {}
            }
        }
        parsed
    }
}

/// One tool call as the API returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// The model's own id where its format has one (Kimi K2's `functions.NAME:0`).
    pub id: Option<String>,
    pub name: String,
    /// The arguments as JSON text (an object, as the model wrote it).
    pub arguments: String,
}

/// A whole text, parsed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// What a choice's output hands on, in order: the parser's text and calls, and the
/// reasoning split off before the parser sees the text (`super::reasoning`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
    Reasoning(String),
}

/// The outcome of reading one call (or the end of a section) at the start of a buffer.
enum Next {
    /// Calls (one, or a list's), and the bytes they took.
    Calls(Vec<ToolCall>, usize),
    /// The section ended after this many bytes.
    End(usize),
    /// The buffer may become a call with more text.
    More,
    /// The buffer cannot become a call.
    Malformed,
}

/// Tool calls parsed out of text as it arrives.
pub struct ToolCallStream {
    format: ToolCallFormat,
    /// Text received and not yet handed on.
    buffer: String,
    /// Inside a section of calls (its begin marker consumed).
    in_section: bool,
    /// The section's marker, handed on as text if the section's first call proves
    /// malformed.
    section_text: String,
    /// Calls handed on so far.
    calls_seen: usize,
    /// Only whitespace has come since the last call: it is held back, and dropped if a call
    /// or the end follows.
    after_call: bool,
}

impl ToolCallStream {
    pub fn new(format: ToolCallFormat) -> Self {
        ToolCallStream {
            format,
            buffer: String::new(),
            in_section: false,
            section_text: String::new(),
            calls_seen: 0,
            after_call: false,
        }
    }

    /// Calls parsed so far.
    pub fn calls(&self) -> usize {
        self.calls_seen
    }

    /// Adds generated text; returns what can be handed on now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buffer.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_section {
                let start = self.buffer.len() - self.buffer.trim_start().len();
                match self.next(&self.buffer[start..]) {
                    Next::Calls(calls, used) => {
                        self.buffer.drain(..start + used);
                        // Handed on as calls: a malformed rest of the section is text
                        // from here.
                        self.section_text.clear();
                        self.calls_seen += calls.len();
                        self.after_call = true;
                        out.extend(calls.into_iter().map(Piece::Call));
                        if matches!(
                            self.format,
                            ToolCallFormat::Hermes
                                | ToolCallFormat::Mistral
                                | ToolCallFormat::Glm
                                | ToolCallFormat::Qwen3Coder
                                | ToolCallFormat::Harmony
                        ) {
                            // Their section is one call (or one list); the next starts
                            // with its own marker.
                            self.leave_section();
                        }
                    }
                    Next::End(used) if self.section_text.is_empty() => {
                        self.buffer.drain(..start + used);
                        self.leave_section();
                    }
                    Next::More => return out,
                    // A section with no call in it is text too.
                    Next::End(_) | Next::Malformed => {
                        // Hand the section on as text, and read on past its marker.
                        let text = std::mem::take(&mut self.section_text);
                        push_text(&mut out, text);
                        self.in_section = false;
                    }
                }
                continue;
            }
            let begin = self.format.begin();
            match self.buffer.find(begin) {
                Some(at) => {
                    let before: String = self.buffer.drain(..at).collect();
                    self.buffer.drain(..begin.len());
                    self.hand_on_text(&mut out, before, true);
                    self.in_section = true;
                    self.section_text = begin.to_string();
                }
                None => {
                    // Hold back a tail that may be the start of the marker.
                    let keep = partial_suffix(&self.buffer, begin);
                    let sendable: String = self.buffer.drain(..self.buffer.len() - keep).collect();
                    self.hand_on_text(&mut out, sendable, false);
                    return out;
                }
            }
        }
    }

    /// The text has ended: what is still held back is handed on (an unfinished call as
    /// text).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buffer);
        if self.in_section {
            let mut text = std::mem::take(&mut self.section_text);
            text.push_str(&rest);
            self.in_section = false;
            if !text.trim().is_empty() {
                push_text(&mut out, text);
            }
        } else if !(self.after_call && rest.trim().is_empty()) {
            push_text(&mut out, rest);
        }
        out
    }

    /// Text outside calls: after a call, whitespace alone (between calls) is dropped
    /// when a call follows, and held while more may come.
    fn hand_on_text(&mut self, out: &mut Vec<Piece>, text: String, call_follows: bool) {
        if self.after_call && text.trim().is_empty() {
            if !call_follows {
                // Put it back: it is handed on only if text follows it.
                self.buffer.insert_str(0, &text);
            }
            return;
        }
        if !text.is_empty() {
            self.after_call = false;
        }
        push_text(out, text);
    }

    fn leave_section(&mut self) {
        self.in_section = false;
        self.section_text.clear();
    }

    fn next(&self, s: &str) -> Next {
        match self.format {
            // A JSON object.
            ToolCallFormat::Hermes => closed_call(s, |body| named_object(body.trim())),
            ToolCallFormat::DeepseekV3 => marked_call(
                s,
                DEEPSEEK_CALL_BEGIN,
                DEEPSEEK_CALL_END,
                DEEPSEEK_SECTION_END,
                deepseek_call,
            ),
            ToolCallFormat::KimiK2 => marked_call(
                s,
                KIMI_CALL_BEGIN,
                KIMI_CALL_END,
                KIMI_SECTION_END,
                kimi_call,
            ),
            ToolCallFormat::Mistral => mistral_calls(s),
            ToolCallFormat::Glm => closed_call(s, glm_arguments),
            ToolCallFormat::Qwen3Coder => closed_call(s, qwen3_coder_arguments),
            ToolCallFormat::Harmony => harmony_call(s),
            ToolCallFormat::MiniMax => marked_call(
                s,
                MINIMAX_INVOKE,
                MINIMAX_INVOKE_END,
                MINIMAX_SECTION_END,
                minimax_call,
            ),
            ToolCallFormat::DeepseekV32 => {
                marked_call(s, DSML_INVOKE, DSML_INVOKE_END, DSML_V32_END, dsml_call)
            }
            ToolCallFormat::DeepseekV4 => {
                marked_call(s, DSML_INVOKE, DSML_INVOKE_END, DSML_V4_END, dsml_call)
            }
        }
    }
}

fn push_text(out: &mut Vec<Piece>, text: String) {
    if text.is_empty() {
        return;
    }
    if let Some(Piece::Text(last)) = out.last_mut() {
        last.push_str(&text);
    } else {
        out.push(Piece::Text(text));
    }
}

/// Bytes at the end of `text` that are the start of `marker` (never all of it).
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && marker.is_char_boundary(n)
                && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// Whether `s` (more may come) can still become `marker`.
fn may_become(s: &str, marker: &str) -> bool {
    marker.starts_with(s)
}

/// `<tool_call>` was read; the call's body, read by `call`, then `</tool_call>`.
fn closed_call(s: &str, call: fn(&str) -> Option<ToolCall>) -> Next {
    let Some(end) = s.find(HERMES_END) else {
        return if s.len() > MAX_CALL_BYTES {
            Next::Malformed
        } else {
            Next::More
        };
    };
    match call(&s[..end]) {
        Some(call) => Next::Calls(vec![call], end + HERMES_END.len()),
        None => Next::Malformed,
    }
}

/// A GLM call's name, then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` per argument
/// (whitespace between them). Its template writes a string value as it is and any other
/// with `tojson`; without the tool's schema at hand, a value that reads as JSON is taken as
/// JSON (a string argument "42" comes back as the number 42): [`template_value`].
fn glm_arguments(body: &str) -> Option<ToolCall> {
    let (name, mut rest) = body.split_at(body.find(GLM_ARG_KEY).unwrap_or(body.len()));
    let mut arguments = serde_json::Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let (key, after) = rest
            .strip_prefix(GLM_ARG_KEY)?
            .split_once(GLM_ARG_KEY_END)?;
        let (value, after) = after
            .trim_start()
            .strip_prefix(GLM_ARG_VALUE)?
            .split_once(GLM_ARG_VALUE_END)?;
        arguments.insert(key.trim().to_string(), template_value(value));
        rest = after;
    }
    call_of(None, name.trim(), &Value::Object(arguments).to_string())
}

/// A value as the XML-like formats' templates write it (GLM, MiniMax-M2, Qwen3.5): a string
/// as it is, any other as JSON. Without the tool's schema at hand, a value that reads as
/// JSON is taken as JSON.
fn template_value(value: &str) -> Value {
    serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.into()))
}

/// A Qwen3.5 call's body: `<function=NAME>`, then `<parameter=KEY>\nVALUE\n</parameter>` per
/// argument (whitespace between them), then `</function>`. The template puts a newline on
/// each side of a value; a value spanning lines keeps its own.
fn qwen3_coder_arguments(body: &str) -> Option<ToolCall> {
    let (name, mut rest) = body.trim().strip_prefix(QWEN_FUNCTION)?.split_once('>')?;
    let mut arguments = serde_json::Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix(QWEN_FUNCTION_END) {
            if !after.trim().is_empty() {
                return None;
            }
            break;
        }
        let (key, after) = rest.strip_prefix(QWEN_PARAMETER)?.split_once('>')?;
        let (value, after) = after.split_once(MINIMAX_PARAMETER_END)?;
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        arguments.insert(key.trim().to_string(), template_value(value));
        rest = after;
    }
    call_of(None, name.trim(), &Value::Object(arguments).to_string())
}

/// `to=functions.` was read; `NAME`, what harmony writes before the message
/// (` <|constrain|>json`), `<|message|>`, the JSON arguments, then `<|call|>`.
fn harmony_call(s: &str) -> Next {
    let Some(end) = s.find(HARMONY_CALL) else {
        return if s.len() > MAX_CALL_BYTES {
            Next::Malformed
        } else {
            Next::More
        };
    };
    let Some((head, arguments)) = s[..end].split_once(HARMONY_MESSAGE) else {
        return Next::Malformed;
    };
    let name = head.split(|c: char| c.is_whitespace() || c == '<').next();
    match name.and_then(|name| call_of(None, name, arguments.trim())) {
        Some(call) => Next::Calls(vec![call], end + HARMONY_CALL.len()),
        None => Next::Malformed,
    }
}

/// `NAME">` then one `PREFIX HEAD>VALUE END` per argument (whitespace between them): the body
/// of an invoke block, MiniMax-M2's or DeepSeek-V3.2's. `argument(HEAD, VALUE)` reads one.
fn invoke_call(
    body: &str,
    (prefix, end): (&str, &str),
    argument: fn(&str, &str) -> Option<(String, Value)>,
) -> Option<ToolCall> {
    let (name, mut rest) = body.split_once("\">")?;
    let mut arguments = serde_json::Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let (head, after) = rest.strip_prefix(prefix)?.split_once('>')?;
        let (value, after) = after.split_once(end)?;
        let (key, value) = argument(head, value)?;
        arguments.insert(key, value);
        rest = after;
    }
    call_of(None, name, &Value::Object(arguments).to_string())
}

/// The body of MiniMax-M2's `<invoke name="NAME">...</invoke>`: `NAME">`, then
/// `<parameter name="KEY">VALUE</parameter>` per argument. Values read as GLM's are
/// ([`template_value`]).
fn minimax_call(body: &str) -> Option<ToolCall> {
    invoke_call(
        body,
        (MINIMAX_PARAMETER, MINIMAX_PARAMETER_END),
        |head, value| Some((head.strip_suffix('"')?.to_string(), template_value(value))),
    )
}

/// The body of DeepSeek-V3.2's and V4's `<｜DSML｜invoke name="NAME">...</｜DSML｜invoke>`: `NAME">`, then
/// `<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>` per argument.
/// `string="true"`: the value as it is; `"false"`: JSON (a value that does not parse is not a
/// call); no `string`: read as GLM's.
fn dsml_call(body: &str) -> Option<ToolCall> {
    invoke_call(body, (DSML_PARAMETER, DSML_PARAMETER_END), |head, value| {
        let (key, attributes) = head.split_once('"')?;
        let value = match attributes.trim() {
            "string=\"true\"" => Value::String(value.into()),
            "string=\"false\"" => serde_json::from_str(value).ok()?,
            "" => template_value(value),
            _ => return None,
        };
        Some((key.to_string(), value))
    })
}

/// Largest call text waited for; past it the text is not a call.
const MAX_CALL_BYTES: usize = 1 << 20;

/// Sections of calls each between `begin` and `end`, the section closed by `section_end`.
fn marked_call(
    s: &str,
    begin: &str,
    end: &str,
    section_end: &str,
    call: fn(&str) -> Option<ToolCall>,
) -> Next {
    if let Some(rest) = s.strip_prefix(section_end) {
        return Next::End(s.len() - rest.len());
    }
    if let Some(body) = s.strip_prefix(begin) {
        let Some(at) = body.find(end) else {
            return if body.len() > MAX_CALL_BYTES {
                Next::Malformed
            } else {
                Next::More
            };
        };
        return match call(&body[..at]) {
            Some(call) => Next::Calls(vec![call], begin.len() + at + end.len()),
            None => Next::Malformed,
        };
    }
    if s.is_empty() || may_become(s, begin) || may_become(s, section_end) {
        Next::More
    } else {
        Next::Malformed
    }
}

/// `function<｜tool▁sep｜>NAME\n```json\nARGS\n```` (V3) or `NAME<｜tool▁sep｜>ARGS` (V3.1).
fn deepseek_call(body: &str) -> Option<ToolCall> {
    let (head, tail) = body.split_once(DEEPSEEK_SEP)?;
    let (name, arguments) = if head.trim() == "function" {
        let (name, fenced) = tail.split_once('\n')?;
        let fenced = fenced.trim();
        let inner = fenced
            .strip_prefix("```json")
            .or_else(|| fenced.strip_prefix("```"))?;
        (name.trim(), inner.strip_suffix("```")?.trim())
    } else {
        (head.trim(), tail.trim())
    };
    call_of(None, name, arguments)
}

/// `functions.NAME:INDEX<|tool_call_argument_begin|>ARGS`.
fn kimi_call(body: &str) -> Option<ToolCall> {
    let (id, arguments) = body.split_once(KIMI_ARGUMENT_BEGIN)?;
    let id = id.trim();
    let qualified = id.rsplit_once(':').map_or(id, |(name, _)| name);
    let name = qualified
        .rsplit_once('.')
        .map_or(qualified, |(_, name)| name);
    call_of(Some(id.to_string()), name, arguments.trim())
}

/// `[{"name": ..., "arguments": ...}, ...]` or `NAME[ARGS]{...}`, after `[TOOL_CALLS]`.
fn mistral_calls(s: &str) -> Next {
    if s.is_empty() {
        return Next::More;
    }
    if s.starts_with('[') {
        return match first_json_value(s) {
            JsonValue::More if s.len() <= MAX_CALL_BYTES => Next::More,
            JsonValue::Value(Value::Array(items), used) => {
                match items.iter().map(named_value).collect::<Option<Vec<_>>>() {
                    Some(calls) if !calls.is_empty() => Next::Calls(calls, used),
                    _ => Next::Malformed,
                }
            }
            _ => Next::Malformed,
        };
    }
    let Some((name, rest)) = s.split_once(MISTRAL_ARGS) else {
        // A name, then perhaps the start of `[ARGS]`.
        let (name, marker) = s.split_at(s.find('[').unwrap_or(s.len()));
        return if name.len() <= 256 && is_name(name) && may_become(marker, MISTRAL_ARGS) {
            Next::More
        } else {
            Next::Malformed
        };
    };
    // Decided on the name before waiting for the arguments, as when the text streams in.
    if !is_name(name) {
        return Next::Malformed;
    }
    let start = rest.len() - rest.trim_start().len();
    match first_json_value(&rest[start..]) {
        JsonValue::More if rest.len() <= MAX_CALL_BYTES => Next::More,
        JsonValue::Value(value @ Value::Object(_), used) => Next::Calls(
            vec![ToolCall {
                id: None,
                name: name.to_string(),
                arguments: value.to_string(),
            }],
            name.len() + MISTRAL_ARGS.len() + start + used,
        ),
        _ => Next::Malformed,
    }
}

enum JsonValue {
    Value(Value, usize),
    More,
    Invalid,
}

/// The JSON value at the start of `s`, and its length.
fn first_json_value(s: &str) -> JsonValue {
    let mut values = serde_json::Deserializer::from_str(s).into_iter::<Value>();
    match values.next() {
        Some(Ok(value)) => JsonValue::Value(value, values.byte_offset()),
        Some(Err(e)) if e.is_eof() => JsonValue::More,
        None => JsonValue::More,
        Some(Err(_)) => JsonValue::Invalid,
    }
}

fn is_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// `{"name": ..., "arguments": {...}}` (or `"parameters"`, as some models write).
fn named_object(text: &str) -> Option<ToolCall> {
    named_value(&serde_json::from_str(text).ok()?)
}

fn named_value(value: &Value) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?;
    let arguments = value.get("arguments").or_else(|| value.get("parameters"));
    let arguments = match arguments {
        None => "{}".to_string(),
        Some(Value::String(text)) => text.clone(),
        Some(object) => object.to_string(),
    };
    call_of(None, name, &arguments)
}

/// A call whose arguments are a JSON object.
fn call_of(id: Option<String>, name: &str, arguments: &str) -> Option<ToolCall> {
    if !is_name(name) {
        return None;
    }
    let parsed: Value = serde_json::from_str(arguments).ok()?;
    if !parsed.is_object() {
        return None;
    }
    Some(ToolCall {
        id,
        name: name.to_string(),
        arguments: arguments.to_string(),
    })
}

#[cfg(test)]
mod tests;
