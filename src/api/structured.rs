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
             (Kimi K2, DeepSeek-V3, Qwen3 / Hermes, Mistral)",
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
            match spec.get("schema") {
                Some(schema @ Value::Object(_)) => schema.clone(),
                None => json!({"type": "object"}),
                Some(other) => {
                    return Err(bad(format!(
                        "response_format.json_schema.schema must be a JSON schema object, not \
                         {other}"
                    )));
                }
            }
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
    let schema = |value: Value| {
        let mut value = value;
        crate::engine::grammar::bound_whitespace(&mut value);
        format!("%json {value}")
    };
    let alternatives: Vec<String> = functions
        .iter()
        .map(|f| match format {
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
        })
        .collect();
    let call = alternatives.join(" | ");
    let start = match format {
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
    };
    format!("start: {start}\ncall: {call}\n")
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
