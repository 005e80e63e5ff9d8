//! Chat templates as published in `tokenizer_config.json` (or `chat_template.jinja`), rendered
//! with minijinja and its Python-compatibility methods (`.strip()`, `.startswith()`, ...).

use std::path::Path;

use minijinja::{Environment, Error, ErrorKind, context};
use serde::Serialize;

use super::ModelError;

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// One chat message as the template sees it.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Loads the model's chat template; `Ok(None)` when it has none.
    pub fn load_optional(dir: &Path) -> Result<Option<Self>, ModelError> {
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
        };
        let Some(source) = source else {
            return Ok(None);
        };
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| ModelError::Tokenizer {
                path: config_path.clone(),
                reason: format!("chat template does not parse: {e}"),
            })?;
        Ok(Some(ChatTemplate {
            env,
            bos_token: special_token(&config["bos_token"]),
            eos_token: special_token(&config["eos_token"]),
        }))
    }

    /// The prompt for `messages`, ending where the assistant's reply begins.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| e.to_string())?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| format!("the chat template failed: {e}"))
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
mod tests {
    use super::*;

    #[test]
    fn renders_python_style_templates_and_reports_their_exceptions() {
        let dir = tempfile::tempdir().unwrap();
        let template = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'system'] %}\
            {{ raise_exception('bad role ' + m.role) }}{% endif %}[{{ m.role.upper() }}] \
            {{ m.content.strip() }}\n{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}";
        let config = serde_json::json!({
            "bos_token": {"content": "<s>"},
            "eos_token": "</s>",
            "chat_template": [{"name": "default", "template": template}],
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::load_optional(dir.path()).unwrap().unwrap();
        let msg = |role: &str, content: &str| ChatMessage {
            role: role.into(),
            content: content.into(),
        };
        assert_eq!(
            t.render(&[msg("system", " be brief "), msg("user", "hi")])
                .unwrap(),
            "<s>[SYSTEM] be brief\n[USER] hi\n[ASSISTANT]"
        );
        let err = t.render(&[msg("robot", "x")]).unwrap_err();
        assert!(err.contains("bad role robot"), "{err}");
        assert!(
            ChatTemplate::load_optional(&dir.path().join("none"))
                .unwrap()
                .is_none()
        );
    }
}
