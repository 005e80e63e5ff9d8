//! What a chat template renders: the conversation and the tools, as transformers passes
//! them. Plain data, shared by the renderer in this process and the worker processes
//! (`isolated`), which receive it as JSON.

use serde::{Deserialize, Serialize};

/// One chat message as the template sees it (the fields chat templates read, as
/// transformers passes them).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// `None` (the template sees `none`) for an assistant turn that only calls tools.
    pub content: Option<String>,
    /// An assistant turn's calls: `{"id", "type": "function", "function": {"name",
    /// "arguments"}}` with the arguments as an object, as templates expect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool turn: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's reasoning, sent back by the client (templates that keep the
    /// reasoning of the current turn read it, Qwen3's and DeepSeek's among them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A message with text content and nothing else.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: Some(content.into()),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }
}

/// What a chat template renders: the conversation, and the tools the model may call
/// (`{"type": "function", "function": {"name", "description", "parameters"}}`, as
/// transformers passes them).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ChatInput {
    pub messages: Vec<ChatMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<serde_json::Value>>,
    /// Further variables for the template (a request's `chat_template_kwargs`: Qwen3's
    /// `enable_thinking`, DeepSeek's `thinking`, `reasoning_effort`). They never replace the
    /// variables above.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

/// The variables a template is always given, which `kwargs` may not name.
pub const TEMPLATE_VARIABLES: [&str; 5] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

impl From<Vec<ChatMessage>> for ChatInput {
    fn from(messages: Vec<ChatMessage>) -> Self {
        ChatInput {
            messages,
            tools: None,
            kwargs: serde_json::Map::new(),
        }
    }
}
