//! Structured output and tools in requests: `response_format` (a JSON object, or one
//! matching a JSON schema), `tools` rendered through the chat template, and `tool_choice`.
//! `required` and a named function are enforced by a grammar in the model's own tool-call
//! format, so the output is a call the parser reads back; `auto` leaves the model free
//! and parses whatever calls it writes.

use serde_json::{Value, json};

use super::ApiError;
use super::generation::RequestContext;
use super::tool_calls::ToolCallFormat;
use crate::engine::grammar::{Constraint, Grammars};

/// What a request's tools ask of the generation.
#[derive(Debug, Default)]
pub(super) struct ToolUse {
    /// The tools, as the chat template renders them.
    pub(super) tools: Option<Vec<Value>>,
    /// The format generated text is parsed for calls in (`None`: not parsed).
    pub(super) parse: Option<ToolCallFormat>,
    /// The grammar that forces a call (`required`, or a named function).
    pub(super) constraint: Option<Constraint>,
}

/// Longest a tool's name may be, as OpenAI's API.
const MAX_NAME: usize = 64;

/// Checks `tools` and `tool_choice`.
pub(super) fn tool_use(
    served: &RequestContext,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
) -> Result<ToolUse, ApiError> {
    let bad = |message: String| ApiError::bad_request(message).with_param("tools");
    let Some(tools) = tools.filter(|t| !t.is_empty()) else {
        return match tool_choice {
            None | Some(Value::Null) => Ok(ToolUse::default()),
            Some(Value::String(s)) if s == "none" || s == "auto" => Ok(ToolUse::default()),
            Some(_) => {
                Err(ApiError::bad_request("tool_choice needs `tools`").with_param("tool_choice"))
            }
        };
    };
    let mut functions = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        functions.push(function_of(i, tool).map_err(bad)?);
    }
    if let Some(tokenizer) = served.tokenizer
        && tokenizer.has_special_text(&Value::Array(tools.clone()).to_string())
    {
        return Err(bad(
            "a tool definition holds the text of one of the model's special tokens".into(),
        ));
    }
    let format = served.tool_format.ok_or_else(|| {
        ApiError::bad_request(
            "this model's chat template writes no tool calls in a format moe-node reads \
             (Kimi K2, DeepSeek-V3, Qwen3 / Hermes, Mistral, GLM)",
        )
        .with_param("tools")
    })?;
    let choice_error = |what: String| ApiError::bad_request(what).with_param("tool_choice");
    let forced: Option<Vec<&Function>> = match &tool_choice {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => None,
            "none" => {
                return Ok(ToolUse {
                    tools: Some(tools),
                    parse: None,
                    constraint: None,
                });
            }
            "required" => Some(functions.iter().collect()),
            other => {
                return Err(choice_error(format!(
                    "tool_choice is \"none\", \"auto\", \"required\" or {{\"type\": \
                     \"function\", \"function\": {{\"name\": ...}}}}, not \"{other}\""
                )));
            }
        },
        Some(named) => {
            let name = named_choice(named).ok_or_else(|| {
                choice_error(format!(
                    "tool_choice must be {{\"type\": \"function\", \"function\": {{\"name\": \
                     ...}}}}, not {named}"
                ))
            })?;
            let function = functions.iter().find(|f| f.name == name).ok_or_else(|| {
                choice_error(format!(
                    "tool_choice names `{name}`, which is not in `tools`"
                ))
            })?;
            Some(vec![function])
        }
    };
    let constraint = match forced {
        None => None,
        Some(forced) => {
            let grammars = grammars(served)?;
            let grammar = call_grammar(format, &forced, served);
            Some(grammars.lark(grammar).map_err(|e| {
                ApiError::bad_request(format!("a tool's parameters cannot be enforced: {e}"))
                    .with_param("tools")
            })?)
        }
    };
    Ok(ToolUse {
        tools: Some(tools),
        parse: Some(format),
        constraint,
    })
}

/// The grammar of `response_format`, if it asks for JSON.
pub(super) fn response_format(
    served: &RequestContext,
    format: Option<&Value>,
) -> Result<Option<Constraint>, ApiError> {
    let bad = |message: String| ApiError::bad_request(message).with_param("response_format");
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let kind = format
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let known = |keys: &[&str]| {
        format
            .as_object()
            .and_then(|o| o.keys().find(|k| !keys.contains(&k.as_str())).cloned())
            .map_or(Ok(()), |k| {
                Err(bad(format!("unknown field `response_format.{k}`")))
            })
    };
    let schema = match kind {
        "text" => {
            known(&["type"])?;
            return Ok(None);
        }
        "json_object" => {
            known(&["type"])?;
            json!({"type": "object"})
        }
        "json_schema" => {
            known(&["type", "json_schema"])?;
            let spec = format
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    bad("response_format.json_schema must be an object with `schema`".into())
                })?;
            if let Some(key) = spec
                .keys()
                .find(|k| !["name", "description", "schema", "strict"].contains(&k.as_str()))
            {
                return Err(bad(format!(
                    "unknown field `response_format.json_schema.{key}`"
                )));
            }
            let strict = match spec.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(strict)) => *strict,
                Some(other) => {
                    return Err(bad(format!(
                        "response_format.json_schema.strict must be true or false, not {other}"
                    )));
                }
            };
            let mut schema = match spec.get("schema") {
                Some(schema @ Value::Object(_)) => schema.clone(),
                None => json!({"type": "object"}),
                Some(other) => {
                    return Err(bad(format!(
                        "response_format.json_schema.schema must be a JSON schema object, not \
                         {other}"
                    )));
                }
            };
            if strict {
                compact_json(&mut schema);
            }
            schema
        }
        other => {
            return Err(bad(format!(
                "response_format.type is \"text\", \"json_object\" or \"json_schema\", not \
                 \"{other}\""
            )));
        }
    };
    let grammars = grammars(served)?;
    grammars
        .json_schema(schema)
        .map(Some)
        .map_err(|e| bad(format!("the JSON schema cannot be enforced: {e}")))
}

/// Makes the JSON a schema allows compact, `{"key":"value","n":1}`, unless the schema
/// sets its own whitespace (`x-guidance`). A forced tool call and a strict schema are
/// output for a program to read, and every place that allows whitespace is a place where a
/// weak model can keep drawing it: with the bounded whitespace of free JSON (12 bytes at
/// each of a call's dozen places) the demo model ran a one-argument `get_weather` call
/// past 64 tokens without closing it. Compact, a call is as long as its values.
fn compact_json(schema: &mut Value) {
    if let Some(object) = schema.as_object_mut() {
        let options = object
            .entry("x-guidance")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Some(options) = options.as_object_mut()
            && !options.contains_key("whitespace_flexible")
            && !options.contains_key("whitespace_pattern")
        {
            options.insert("whitespace_flexible".into(), false.into());
            options.insert("item_separator".into(), ",".into());
            options.insert("key_separator".into(), ":".into());
        }
    }
}

fn grammars<'a>(served: &RequestContext<'a>) -> Result<&'a Grammars, ApiError> {
    served.grammars.ok_or_else(|| {
        ApiError::bad_request(
            "structured output needs the model's tokenizer.json, and this model has none",
        )
    })
}

/// One tool of `tools`, checked.
struct Function {
    name: String,
    parameters: Value,
}

fn function_of(i: usize, tool: &Value) -> Result<Function, String> {
    let object = tool
        .as_object()
        .ok_or_else(|| format!("tools[{i}] must be an object"))?;
    if let Some(key) = object.keys().find(|k| *k != "type" && *k != "function") {
        return Err(format!("unknown field `tools[{i}].{key}`"));
    }
    if object.get("type").and_then(Value::as_str) != Some("function") {
        return Err(format!("tools[{i}].type must be \"function\""));
    }
    let function = object
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| format!("tools[{i}].function must be an object"))?;
    if let Some(key) = function
        .keys()
        .find(|k| !["name", "description", "parameters", "strict"].contains(&k.as_str()))
    {
        return Err(format!("unknown field `tools[{i}].function.{key}`"));
    }
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !valid {
        return Err(format!(
            "tools[{i}].function.name must be 1 to {MAX_NAME} letters, digits, `_` or `-`, \
             not {:?}",
            name
        ));
    }
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object"}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(other) => {
            return Err(format!(
                "tools[{i}].function.parameters must be a JSON schema object, not {other}"
            ));
        }
    };
    Ok(Function {
        name: name.to_string(),
        parameters,
    })
}

/// `{"type": "function", "function": {"name": NAME}}` → NAME.
fn named_choice(choice: &Value) -> Option<&str> {
    if choice.get("type")?.as_str()? != "function" {
        return None;
    }
    choice.get("function")?.get("name")?.as_str()
}

/// A Lark grammar for one call of one of `functions`, written as the model writes calls
/// (its markers as special tokens where its tokenizer has them).
fn call_grammar(
    format: ToolCallFormat,
    functions: &[&Function],
    served: &RequestContext,
) -> String {
    // A marker: the special token where the tokenizer has one, else its text.
    let marker = |text: &str| match served.tokenizer.and_then(|t| t.special_token_id(text)) {
        Some(id) => format!("<[{id}]>"),
        None => literal(text),
    };
    lark_call(format, functions, marker)
}

/// [`call_grammar`] with each marker as `marker` writes it.
fn lark_call(
    format: ToolCallFormat,
    functions: &[&Function],
    marker: impl Fn(&str) -> String,
) -> String {
    let alternatives: Vec<String> = functions
        .iter()
        .map(|f| call_of(format, f, &marker))
        .collect();
    let call = alternatives.join(" | ");
    let start = call_frame(format, &marker);
    format!("start: {start}\ncall: {call}\n")
}

/// One call of `f` as `format` writes it, between [`call_frame`]'s markers.
fn call_of(format: ToolCallFormat, f: &Function, marker: &impl Fn(&str) -> String) -> String {
    let schema = |value: Value| {
        let mut value = value;
        compact_json(&mut value);
        format!("%json {value}")
    };
    match format {
        ToolCallFormat::Hermes | ToolCallFormat::Mistral => schema(json!({
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": f.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        })),
        ToolCallFormat::DeepseekV3 => format!(
            "{} {} {} {} {}",
            literal("function"),
            marker("<｜tool▁sep｜>"),
            literal(&format!("{}\n```json\n", f.name)),
            schema(f.parameters.clone()),
            literal("\n```"),
        ),
        ToolCallFormat::KimiK2 => format!(
            "{} {} {}",
            literal(&format!("functions.{}:0", f.name)),
            marker("<|tool_call_argument_begin|>"),
            schema(f.parameters.clone()),
        ),
        // GLM's tags are special tokens in its tokenizer.
        ToolCallFormat::Glm => tagged_arguments(
            f,
            schema,
            literal(&f.name),
            |key, _| {
                format!(
                    "{} {} {} {} {} {}",
                    literal("\n"),
                    marker("<arg_key>"),
                    literal(key),
                    marker("</arg_key>"),
                    literal("\n"),
                    marker("<arg_value>"),
                )
            },
            |_| marker("</arg_value>"),
        ),
        ToolCallFormat::MiniMax => tagged_arguments(
            f,
            schema,
            literal(&format!("{}\">", f.name)),
            |key, _| literal(&format!("\n<parameter name=\"{key}\">")),
            |_| literal("</parameter>"),
        ),
        // A free text value ends with the newline the template writes before the closing
        // tag (the parser takes it off); any other value is followed by it.
        ToolCallFormat::Qwen3Coder => tagged_arguments(
            f,
            schema,
            literal(&format!("<function={}>", f.name)),
            |key, _| literal(&format!("\n<parameter={key}>\n")),
            |written| {
                literal(if written == Written::FreeText {
                    "</parameter>"
                } else {
                    "\n</parameter>"
                })
            },
        ),
        ToolCallFormat::DeepseekV32 | ToolCallFormat::DeepseekV4 => tagged_arguments(
            f,
            schema,
            literal(&format!("{}\">", f.name)),
            |key, written| {
                let text = written != Written::Json;
                literal(&format!(
                    "\n<｜DSML｜parameter name=\"{key}\" string=\"{text}\">"
                ))
            },
            |_| literal("</｜DSML｜parameter>"),
        ),
        ToolCallFormat::Harmony => {
            format!(
                "{} {} {} {}",
                literal(&format!("{} ", f.name)),
                marker("<|constrain|>"),
                literal("json"),
                marker("<|message|>"),
            ) + " "
                + &schema(f.parameters.clone())
        }
    }
}

/// What stands around a call in `format`: its markers, `call` where the call goes.
fn call_frame(format: ToolCallFormat, marker: &impl Fn(&str) -> String) -> String {
    match format {
        ToolCallFormat::Hermes => format!(
            "{} {} call {} {}",
            marker("<tool_call>"),
            literal("\n"),
            literal("\n"),
            marker("</tool_call>")
        ),
        ToolCallFormat::Mistral => format!(
            "{} {} call {}",
            marker("[TOOL_CALLS]"),
            literal(" ["),
            literal("]")
        ),
        ToolCallFormat::DeepseekV3 => format!(
            "{} {} call {} {}",
            marker("<｜tool▁calls▁begin｜>"),
            marker("<｜tool▁call▁begin｜>"),
            marker("<｜tool▁call▁end｜>"),
            marker("<｜tool▁calls▁end｜>"),
        ),
        ToolCallFormat::KimiK2 => format!(
            "{} {} call {} {}",
            marker("<|tool_calls_section_begin|>"),
            marker("<|tool_call_begin|>"),
            marker("<|tool_call_end|>"),
            marker("<|tool_calls_section_end|>"),
        ),
        ToolCallFormat::Glm => format!(
            "{} call {} {}",
            marker("<tool_call>"),
            literal("\n"),
            marker("</tool_call>")
        ),
        ToolCallFormat::Harmony => {
            format!("{} call {}", literal("to=functions."), marker("<|call|>"))
        }
        ToolCallFormat::Qwen3Coder => format!(
            "{} {} call {} {}",
            marker("<tool_call>"),
            literal("\n"),
            literal("\n</function>\n"),
            marker("</tool_call>")
        ),
        ToolCallFormat::DeepseekV32 | ToolCallFormat::DeepseekV4 => {
            let (begin, end) = if format == ToolCallFormat::DeepseekV32 {
                ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>")
            } else {
                ("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>")
            };
            format!(
                "{} {} call {} {} {}",
                marker(begin),
                literal("\n<｜DSML｜invoke name=\""),
                literal("\n</｜DSML｜invoke>"),
                literal("\n"),
                marker(end)
            )
        }
        ToolCallFormat::MiniMax => format!(
            "{} {} call {} {} {}",
            marker("<minimax:tool_call>"),
            literal("\n<invoke name=\""),
            literal("\n</invoke>"),
            literal("\n"),
            marker("</minimax:tool_call>")
        ),
    }
}

/// The names `f`'s schema lists as `required`.
fn required_parameters(f: &Function) -> Vec<&str> {
    f.parameters
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// How a value is written between its tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Written {
    /// A string as it is, up to the next tag.
    FreeText,
    /// One of a string `enum`'s values, as it is.
    Text,
    /// JSON of its schema.
    Json,
}

/// A value as GLM's, MiniMax's, Qwen3.5's and DeepSeek-V3.2's templates write it: a string as
/// text without `<` (or one of its `enum`), any other as JSON of its schema.
fn tagged_value(property: &Value, schema: impl Fn(Value) -> String) -> (String, Written) {
    let strings: Option<Vec<&str>> = property
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|values| values.iter().map(Value::as_str).collect());
    match (property.get("type").and_then(Value::as_str), strings) {
        // Strings are written without quotes.
        (_, Some(strings)) if !strings.is_empty() => {
            let options: Vec<String> = strings.into_iter().map(literal).collect();
            (format!("({})", options.join(" | ")), Written::Text)
        }
        (Some("string"), _) => ("/[^<]+/".to_string(), Written::FreeText),
        _ => (format!("({})", schema(property.clone())), Written::Json),
    }
}

/// A call of `f` in a format that gives each argument its own tags (GLM after `<tool_call>`,
/// MiniMax-M2 after `<invoke name="`, Qwen3.5 after `<tool_call>\n`, DeepSeek-V3.2 after
/// `<｜DSML｜invoke name="`): `head`, then each parameter of its schema in order as
/// `open(KEY, written) VALUE close(written)`, the required ones always and the others
/// optionally. Values as [`tagged_value`] writes them. Every piece is its own: no piece may
/// be a prefix of another where both can come next (the grammar's lexer reads the longest).
fn tagged_arguments(
    f: &Function,
    schema: impl Fn(Value) -> String,
    head: String,
    open: impl Fn(&str, Written) -> String,
    close: impl Fn(Written) -> String,
) -> String {
    let required = required_parameters(f);
    let mut parts = vec![head];
    if let Some(properties) = f.parameters.get("properties").and_then(Value::as_object) {
        for (key, property) in properties {
            let (value, written) = tagged_value(property, &schema);
            let argument = format!("{} {value} {}", open(key, written), close(written));
            parts.push(if required.contains(&key.as_str()) {
                argument
            } else {
                format!("({argument})?")
            });
        }
    }
    parts.join(" ")
}

/// `text` as a Lark string literal.
fn literal(text: &str) -> String {
    // JSON's escapes are a subset of what Lark's strings take.
    Value::String(text.into()).to_string()
}

/// An assistant message's `tool_calls`, checked and with each call's arguments (a JSON
/// string in the API) turned into the object chat templates expect.
pub(super) fn message_tool_calls(index: usize, calls: Value) -> Result<Vec<Value>, ApiError> {
    let bad = |what: String| {
        ApiError::bad_request(format!("messages[{index}].tool_calls{what}")).with_param("messages")
    };
    let Value::Array(calls) = calls else {
        return Err(bad(" must be a list".into()));
    };
    calls
        .into_iter()
        .enumerate()
        .map(|(c, call)| {
            let function = call
                .get("function")
                .ok_or_else(|| bad(format!("[{c}].function is missing")))?;
            let name = function
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("[{c}].function.name is missing")))?;
            let arguments = match function.get("arguments") {
                Some(Value::String(text)) => serde_json::from_str::<Value>(text)
                    .map_err(|e| bad(format!("[{c}].function.arguments is not JSON: {e}")))?,
                Some(object @ Value::Object(_)) => object.clone(),
                None => json!({}),
                Some(other) => {
                    return Err(bad(format!(
                        "[{c}].function.arguments must be a JSON string, not {other}"
                    )));
                }
            };
            let mut rendered = json!({
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            });
            if let Some(id) = call.get("id").and_then(Value::as_str) {
                rendered["id"] = id.into();
            }
            Ok(rendered)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::grammar::{GrammarMetrics, Grammars};

    /// Whether `grammar` takes `text`, one byte a token.
    fn accepts(grammar: String, text: &str) -> bool {
        let end = 256;
        let mut tokens: Vec<(Vec<u8>, bool)> = (0..=255u8).map(|b| (vec![b], false)).collect();
        tokens.push((b"end".to_vec(), true));
        let grammars = Grammars::new(tokens, end, GrammarMetrics::default()).unwrap();
        let mut constraint = grammars.lark(grammar).unwrap();
        for (at, &byte) in text.as_bytes().iter().enumerate() {
            let mut logits = vec![0.0f32; 257];
            constraint.apply(&mut logits, &[end]);
            if logits[byte as usize] == f32::NEG_INFINITY {
                eprintln!("refused at byte {at} of {text:?}");
                return false;
            }
            constraint.advance(byte as u32);
        }
        let mut logits = vec![0.0f32; 257];
        constraint.apply(&mut logits, &[end]);
        logits[end as usize] == 0.0
    }

    /// `get_weather(city: string, days: 1..=9, unit: "c" | "f")`, `required` as given.
    fn get_weather(required: &[&str]) -> Function {
        Function {
            name: "get_weather".into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer", "minimum": 1, "maximum": 9},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": required,
            }),
        }
    }

    #[test]
    fn a_forced_minimax_call_is_one_the_parser_reads_back() {
        let f = get_weather(&["city"]);
        let grammar = lark_call(ToolCallFormat::MiniMax, &[&f], literal);
        let call = "<minimax:tool_call>\n<invoke name=\"get_weather\">\n\
                    <parameter name=\"city\">Paris</parameter>\n\
                    <parameter name=\"days\">3</parameter>\n</invoke>\n</minimax:tool_call>";
        assert!(accepts(grammar.clone(), call), "{grammar}");
        let parsed = ToolCallFormat::MiniMax.parse(call);
        assert_eq!(parsed.calls[0].arguments, r#"{"city":"Paris","days":3}"#);
        let no_city = call.replace("<parameter name=\"city\">Paris</parameter>\n", "");
        assert!(!accepts(grammar, &no_city));
    }

    #[test]
    fn a_forced_glm_call_is_one_the_parser_reads_back() {
        let f = get_weather(&["city", "days"]);
        let grammar = lark_call(ToolCallFormat::Glm, &[&f], literal);
        let call = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n\
                    <arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>";
        assert!(accepts(grammar.clone(), call), "{grammar}");
        let parsed = ToolCallFormat::Glm.parse(call);
        assert_eq!(parsed.calls[0].arguments, r#"{"city":"Paris","days":3}"#);
        let with_unit = call.replace(
            "\n</tool_call>",
            "\n<arg_key>unit</arg_key>\n<arg_value>f</arg_value>\n</tool_call>",
        );
        assert!(accepts(grammar.clone(), &with_unit), "{grammar}");
        // A required argument left out, or a value outside its schema, is not a call.
        let no_days = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>";
        assert!(!accepts(grammar.clone(), no_days));
        assert!(!accepts(grammar, &call.replace(">3<", ">12<")));
    }

    #[test]
    fn a_forced_qwen3_coder_call_is_one_the_parser_reads_back() {
        let f = get_weather(&["city", "days"]);
        let grammar = lark_call(ToolCallFormat::Qwen3Coder, &[&f], literal);
        // As Qwen3.5's template writes a call.
        let call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n\
                    <parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        assert!(accepts(grammar.clone(), call), "{grammar}");
        let parsed = ToolCallFormat::Qwen3Coder.parse(call);
        assert_eq!(parsed.calls[0].arguments, r#"{"city":"New York","days":3}"#);
        let with_unit = call.replace(
            "\n</function>",
            "\n<parameter=unit>\nf\n</parameter>\n</function>",
        );
        assert!(accepts(grammar.clone(), &with_unit), "{grammar}");
        let parsed = ToolCallFormat::Qwen3Coder.parse(&with_unit);
        assert_eq!(
            parsed.calls[0].arguments,
            r#"{"city":"New York","days":3,"unit":"f"}"#
        );
        // A required argument left out, a value outside its schema, another function: no.
        let no_days = call.replace("<parameter=days>\n3\n</parameter>\n", "");
        assert!(!accepts(grammar.clone(), &no_days));
        assert!(!accepts(grammar.clone(), &call.replace("\n3\n", "\n12\n")));
        assert!(!accepts(grammar, &call.replace("get_weather", "get_time")));
    }

    #[test]
    fn forced_dsml_calls_are_ones_the_parser_reads_back() {
        let f = get_weather(&["city", "days"]);
        // DeepSeek-V3.2's block and V4's around the same invokes.
        for (format, block) in [
            (ToolCallFormat::DeepseekV32, "function_calls"),
            (ToolCallFormat::DeepseekV4, "tool_calls"),
        ] {
            let grammar = lark_call(format, &[&f], literal);
            let call = format!(
                "<｜DSML｜{block}>\n<｜DSML｜invoke name=\"get_weather\">\n\
                 <｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n\
                 <｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n\
                 </｜DSML｜invoke>\n</｜DSML｜{block}>"
            );
            assert!(accepts(grammar.clone(), &call), "{grammar}");
            let parsed = format.parse(&call);
            assert_eq!(parsed.calls[0].arguments, r#"{"city":"Paris","days":3}"#);
            let with_unit = call.replace(
                "\n</｜DSML｜invoke>",
                "\n<｜DSML｜parameter name=\"unit\" string=\"true\">f</｜DSML｜parameter>\n</｜DSML｜invoke>",
            );
            assert!(accepts(grammar.clone(), &with_unit), "{grammar}");
            assert_eq!(
                format.parse(&with_unit).calls[0].arguments,
                r#"{"city":"Paris","days":3,"unit":"f"}"#
            );
            // The string flag as the value is written, a required argument, the schema's
            // range, the other version's block.
            assert!(!accepts(
                grammar.clone(),
                &call.replace("\"days\" string=\"false\"", "\"days\" string=\"true\"")
            ));
            assert!(!accepts(grammar.clone(), &call.replace(">3<", ">12<")));
            let no_days = call.replace(
                "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n",
                "",
            );
            assert!(!accepts(grammar.clone(), &no_days));
            let other = if block == "tool_calls" {
                "function_calls"
            } else {
                "tool_calls"
            };
            assert!(!accepts(grammar, &call.replace(block, other)));
        }
    }

    #[test]
    fn forced_json_is_compact_unless_the_schema_sets_its_own_whitespace() {
        let compact = |mut schema: Value| {
            compact_json(&mut schema);
            format!("start: %json {schema}\n")
        };
        let city = json!({
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": false,
        });
        assert!(accepts(
            compact(city.clone()),
            r#"{"city":"Paris","days":3}"#
        ));
        for spaced in [
            r#"{ "city":"Paris","days":3}"#,
            r#"{"city": "Paris","days":3}"#,
            r#"{"city":"Paris", "days":3}"#,
            "{\"city\":\"Paris\",\"days\":3\n}",
        ] {
            assert!(!accepts(compact(city.clone()), spaced), "{spaced}");
        }
        // A schema that says how it wants its whitespace keeps it.
        let mut own = city;
        own["x-guidance"] = json!({"whitespace_pattern": " ?"});
        assert!(accepts(compact(own), r#"{"city": "Paris", "days": 3}"#));
    }
}
