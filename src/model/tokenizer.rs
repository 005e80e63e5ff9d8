//! `tokenizer.json` through the `tokenizers` crate. A model without one runs on token ids.

use std::path::{Path, PathBuf};

use super::ModelError;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same, reading special-token text (`<|im_start|>`) as plain text.
    plain: tokenizers::Tokenizer,
    /// The text of every special token.
    special: Vec<String>,
    path: PathBuf,
}

impl Tokenizer {
    /// Loads `tokenizer.json` from `dir`; `Ok(None)` when the model has none.
    pub fn load_optional(dir: &Path) -> Result<Option<Self>, ModelError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| ModelError::Tokenizer {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        let mut special: Vec<String> = inner
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        special.sort();
        Ok(Some(Tokenizer {
            inner,
            plain,
            special,
            path,
        }))
    }

    /// Ids of `text` with special-token text in it read as plain text: `<|im_end|>` in a
    /// user's message becomes the characters, never the token.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        self.plain
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| self.error(e))
    }

    /// Whether `text` holds the text of a special token.
    pub fn has_special_text(&self, text: &str) -> bool {
        self.special.iter().any(|s| text.contains(s.as_str()))
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| self.error(e))
    }

    /// Text of `ids`, special tokens (`<|im_end|>`, ...) included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.inner.decode(ids, false).map_err(|e| self.error(e))
    }

    /// Text of `ids` as a user reads it: special tokens left out.
    pub fn decode_text(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.inner.decode(ids, true).map_err(|e| self.error(e))
    }

    fn error(&self, e: tokenizers::Error) -> ModelError {
        ModelError::Tokenizer {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }
}
