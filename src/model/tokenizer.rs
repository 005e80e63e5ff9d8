//! `tokenizer.json` through the `tokenizers` crate. A model without one runs on token ids.

use std::path::{Path, PathBuf};

use super::ModelError;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
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
        Ok(Some(Tokenizer { inner, path }))
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
