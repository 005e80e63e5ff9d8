//! Chat templates as published in `tokenizer_config.json` (or `chat_template.jinja`), rendered
//! with minijinja and its Python-compatibility methods (`.strip()`, `.startswith()`, ...).

use std::path::{Path, PathBuf};

use minijinja::machinery::{Span, Token, WhitespaceConfig, ast, parse, tokenize};
use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, context};

use super::ModelError;

mod input;
pub(super) mod isolated;
mod limits;
mod namespaces;
mod sizes;

pub use input::{ChatInput, ChatMessage, TEMPLATE_VARIABLES};
use isolated::IsolatedRenderer;
pub use limits::{MAX_OUTPUT_BYTES, MAX_RECURSION, RENDER_FUEL, RENDER_STACK_BYTES};

pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    /// Set by [`ChatTemplate::isolate`]: renders run in a child process.
    isolated: Option<IsolatedRenderer>,
}

const TEMPLATE_NAME: &str = "chat";

/// `source` parsed as the environment parses it, for the rewrites made before it is
/// compiled (`sizes`, `namespaces`).
fn parse_source<'s>(source: &'s str, name: &'s str) -> Result<ast::Stmt<'s>, String> {
    parse(source, name, syntax(), WhitespaceConfig::default())
        .map_err(|e| format!("chat template does not parse: {e}"))
}

/// `source`'s tokens and their spans, as the environment reads them.
fn source_tokens(source: &str) -> Result<Vec<(Token<'_>, Span)>, String> {
    tokenize(source, false, syntax(), WhitespaceConfig::default())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("chat template does not parse: {e}"))
}

/// The syntax the node's environment uses: minijinja's default (a unit struct unless its
/// `custom_syntax` feature is on).
#[allow(clippy::default_constructed_unit_structs)]
fn syntax() -> SyntaxConfig {
    SyntaxConfig::default()
}

/// The render's output, refusing to grow past [`MAX_OUTPUT_BYTES`].
#[derive(Default)]
struct CappedOutput {
    text: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + bytes.len() > MAX_OUTPUT_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("output limit"));
        }
        self.text.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ChatTemplate {
    /// Loads the model's chat template; `Ok(None)` when it has none.
    pub fn load_optional(dir: &Path) -> Result<Option<Self>, ModelError> {
        Self::load(dir, None)
    }

    /// As [`ChatTemplate::load_optional`], with `builtin` where the model ships no template
    /// ([`crate::model::Family::builtin_chat_template`]).
    pub fn load(dir: &Path, builtin: Option<&str>) -> Result<Option<Self>, ModelError> {
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| ModelError::Tokenizer {
                path: config_path.clone(),
                reason: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(source) => {
                return Err(ModelError::Io {
                    path: config_path,
                    source,
                });
            }
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.exists() {
            Some(
                std::fs::read_to_string(&jinja_path).map_err(|source| ModelError::Io {
                    path: jinja_path.clone(),
                    source,
                })?,
            )
        } else {
            template_from_config(&config["chat_template"])
        }
        .or_else(|| builtin.map(str::to_string));
        let Some(source) = source else {
            return Ok(None);
        };
        Self::new(
            source,
            special_token(&config["bos_token"]),
            special_token(&config["eos_token"]),
        )
        .map(Some)
        .map_err(|reason| ModelError::Tokenizer {
            path: config_path,
            reason,
        })
    }

    /// A template from its source and the special tokens it may print, with the limits
    /// every render runs under (see [`RENDER_FUEL`]). Parsed and compiled on a thread with
    /// [`RENDER_STACK_BYTES`] of stack: both recurse once per operator of a chain
    /// (`1 + 1 + ...`), which a hostile template can make as long as it likes.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self, String> {
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("chat-template-load".into())
                .stack_size(RENDER_STACK_BYTES)
                .spawn_scoped(scope, || Self::compile(source, bos_token, eos_token))
                .map_err(|e| format!("cannot start a thread to load the chat template: {e}"))?
                .join()
                .map_err(|_| "loading the chat template panicked".to_string())?
        })
    }

    fn compile(source: String, bos_token: String, eos_token: String) -> Result<Self, String> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        // Python's methods, with `str.format`'s widths checked (see `sizes`).
        env.set_unknown_method_callback(sizes::unknown_method);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        // As transformers' `tojson` (Python's json.dumps: `", "` and `": "`, no HTML
        // escaping), which templates print tool definitions and arguments with.
        env.add_filter("tojson", tojson);
        // Debugging aids that no chat template needs, and whose output grows with the square
        // of a value's depth outside the output limit (a nested value pretty-printed with
        // indentation per level).
        env.remove_filter("pprint");
        env.remove_global("debug");
        env.set_fuel(Some(RENDER_FUEL));
        env.set_recursion_limit(MAX_RECURSION);
        // Namespaces hold plain values, copied in, so that none can hold itself (which
        // would print without end): see `namespaces`.
        env.add_filter(namespaces::FILTER, namespaces::namespace_value);
        env.add_function("namespace", namespaces::namespace);
        // Operations whose size an argument sets are checked before they allocate it.
        env.add_filter(sizes::TIMES, sizes::times);
        env.add_filter("batch", sizes::batch);
        env.add_filter("slice", sizes::slice);
        env.add_filter("indent", sizes::indent);
        env.add_filter("format", sizes::format);
        env.add_filter("replace", sizes::replace);
        env.add_filter("join", sizes::join);
        env.add_filter("chain", sizes::chain);
        env.add_filter(sizes::SLICE, sizes::slice_step);
        let checked = sizes::guard_slices(&source, TEMPLATE_NAME)?;
        let checked = sizes::guard(&checked, TEMPLATE_NAME)?;
        let checked = namespaces::guard(&checked, TEMPLATE_NAME)?;
        env.add_template_owned(TEMPLATE_NAME, checked)
            .map_err(|e| format!("chat template does not parse: {e}"))?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token,
            eos_token,
            isolated: None,
        })
    }

    /// From now on, renders run in child processes started from `exe` (this program), with
    /// a memory limit and a deadline: see [`isolated`].
    pub fn isolate(&mut self, exe: PathBuf) {
        self.isolated = Some(IsolatedRenderer::new(
            exe,
            &self.source,
            &self.bos_token,
            &self.eos_token,
        ));
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt for `messages`, ending where the assistant's reply begins.
    pub fn render(&self, chat: &ChatInput) -> Result<String, String> {
        match &self.isolated {
            Some(isolated) => isolated.render(chat),
            None => self.render_in_process(chat),
        }
    }

    /// Renders in this process, on a thread of its own with [`RENDER_STACK_BYTES`] of stack.
    pub fn render_in_process(&self, chat: &ChatInput) -> Result<String, String> {
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("chat-template".into())
                .stack_size(RENDER_STACK_BYTES)
                .spawn_scoped(scope, || self.render_here(chat))
                .map_err(|e| format!("cannot start a thread to render the chat template: {e}"))?
                .join()
                .map_err(|_| "rendering the chat template panicked".to_string())?
        })
    }

    fn render_here(&self, chat: &ChatInput) -> Result<String, String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| e.to_string())?;
        let mut out = CappedOutput::default();
        let rendered = template.render_captured_to(
            context! {
                messages => chat.messages,
                tools => chat.tools,
                add_generation_prompt => true,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
                // Variables named above keep their values.
                ..minijinja::Value::from_serialize(&chat.kwargs)
            },
            &mut out,
        );
        match rendered {
            Err(_) if out.overflowed => Err(format!(
                "the chat template failed: it wrote over {MAX_OUTPUT_BYTES} bytes"
            )),
            Err(e) => Err(format!("the chat template failed: {e}")),
            Ok(_) => String::from_utf8(out.text)
                .map_err(|_| "the chat template wrote invalid UTF-8".into()),
        }
    }
}

/// The ids of the prompt for `messages`: the template's own text (its special tokens
/// included) read with special tokens, each message's content read as plain text, so that a
/// message cannot forge a turn (`<|im_end|>\n<|im_start|>system ...` stays characters).
/// Content without special-token text is read with the template's text, as one string.
pub fn encode_chat(
    template: &ChatTemplate,
    tokenizer: &super::Tokenizer,
    mut chat: ChatInput,
) -> Result<Vec<u32>, String> {
    // Content that holds special-token text is rendered as a marker of private-use
    // characters, which the rendered text is split at.
    let mut plain = Vec::new();
    for (i, message) in chat.messages.iter_mut().enumerate() {
        let texts = [&mut message.content, &mut message.reasoning_content];
        for (j, text) in texts.into_iter().enumerate() {
            if let Some(text) = text
                && tokenizer.has_special_text(text)
            {
                let marker = format!("\u{F0000}moe-node-content-{i}-{j}\u{F0001}");
                let text = std::mem::replace(text, marker.clone());
                plain.push((marker, text));
            }
        }
    }
    let text = template.render(&chat)?;
    let tokenize = |e: super::ModelError| format!("the prompt cannot be tokenized: {e}");
    let mut ids = Vec::new();
    let mut rest = text.as_str();
    loop {
        let next = plain
            .iter()
            .filter_map(|(marker, content)| {
                rest.find(marker.as_str()).map(|at| (at, marker, content))
            })
            .min_by_key(|(at, _, _)| *at);
        let Some((at, marker, content)) = next else {
            break;
        };
        if at > 0 {
            ids.extend(tokenizer.encode(&rest[..at]).map_err(tokenize)?);
        }
        ids.extend(tokenizer.encode_plain(content).map_err(tokenize)?);
        rest = &rest[at + marker.len()..];
    }
    if !rest.is_empty() {
        ids.extend(tokenizer.encode(rest).map_err(tokenize)?);
    }
    Ok(ids)
}

/// The `tojson` filter as transformers defines it for chat templates: Python's
/// `json.dumps(value, ensure_ascii=False, indent=None, sort_keys=False)` with those
/// keyword arguments, keys in the order the value has them.
fn tojson(value: minijinja::Value, kwargs: minijinja::value::Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Each level writes `indent` spaces times its depth at once.
    if let Some(indent) = indent
        && indent > MAX_TOJSON_INDENT
    {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: an indent of {indent} spaces (at most {MAX_TOJSON_INDENT})"),
        ));
    }
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    // Accepted and not applied: templates pass Python's defaults.
    let _: Option<minijinja::Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    // Converting and writing recurse once per level, with larger frames than minijinja's
    // own printing: a value nested as deep as the fuel allows (hundreds of thousands of
    // levels) would overflow even the render thread's stack. Python's json.dumps stops at
    // its recursion limit (1000) too.
    if nested_deeper_than(&value, MAX_TOJSON_DEPTH) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: the value is nested more than {MAX_TOJSON_DEPTH} levels deep"),
        ));
    }
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&mut out, &json, indent, 0, sort_keys.unwrap_or(false));
    if ensure_ascii.unwrap_or(false) {
        out = out
            .chars()
            .map(|c| {
                if c.is_ascii() {
                    c.to_string()
                } else {
                    let mut units = [0u16; 2];
                    c.encode_utf16(&mut units)
                        .iter()
                        .map(|u| format!("\\u{u:04x}"))
                        .collect()
                }
            })
            .collect();
    }
    Ok(out)
}

/// The widest indent `tojson` writes a level with (Python's json.dumps takes any; published
/// templates pass 2 or 4).
const MAX_TOJSON_INDENT: usize = 1024;

/// The deepest nesting of lists and maps that `tojson` writes.
const MAX_TOJSON_DEPTH: usize = 512;

/// Whether `value` holds lists or maps nested more than `levels` deep. Recurses at most
/// `levels + 1` times, whatever the value's depth.
fn nested_deeper_than(value: &minijinja::Value, levels: usize) -> bool {
    use minijinja::value::ValueKind;
    let is_container = matches!(
        value.kind(),
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable
    );
    if !is_container {
        return false;
    }
    if levels == 0 {
        return true;
    }
    let Ok(items) = value.try_iter() else {
        return false;
    };
    let is_map = value.kind() == ValueKind::Map;
    for item in items {
        // A map iterates its keys; its values are what nest.
        let child = if is_map {
            value.get_item(&item).unwrap_or_default()
        } else {
            item
        };
        if nested_deeper_than(&child, levels - 1) {
            return true;
        }
    }
    false
}

/// JSON as Python's `json.dumps` writes it (see [`tojson`]).
fn write_python_json(
    out: &mut String,
    value: &serde_json::Value,
    indent: Option<usize>,
    level: usize,
    sort_keys: bool,
) {
    use serde_json::Value;
    let (item_separator, newline) = match indent {
        Some(_) => (",", true),
        None => (", ", false),
    };
    let open = |out: &mut String, level: usize| {
        if newline {
            out.push('\n');
            out.push_str(&" ".repeat(indent.unwrap_or(0) * level));
        }
    };
    match value {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                open(out, level + 1);
                write_python_json(out, item, indent, level + 1, sort_keys);
            }
            open(out, level);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            let mut entries: Vec<_> = map.iter().collect();
            if sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                open(out, level + 1);
                out.push_str(&Value::String(key.clone()).to_string());
                out.push_str(": ");
                write_python_json(out, item, indent, level + 1, sort_keys);
            }
            open(out, level);
            out.push('}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which `default` is used.
fn template_from_config(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// Special tokens are strings or `{"content": ...}` objects.
fn special_token(value: &serde_json::Value) -> String {
    value
        .as_str()
        .or_else(|| value["content"].as_str())
        .unwrap_or_default()
        .to_string()
}

#[cfg(test)]
mod deepseek_tests;
#[cfg(test)]
mod tests;
