//! `tokenizer.json` through the `tokenizers` crate. A model without one runs on token ids.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use super::ModelError;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same, reading special-token text (`<|im_start|>`) as plain text.
    plain: tokenizers::Tokenizer,
    /// The text of every special token.
    special: Vec<String>,
    /// Ids of the added tokens (special or not): their text is not byte-level encoded.
    added: HashSet<u32>,
    /// Whether the decoder is byte-level (GPT-2's table of bytes as characters).
    byte_level: bool,
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
        let added_tokens = inner.get_added_tokens_decoder();
        let added = added_tokens.keys().copied().collect();
        let mut special: Vec<String> = added_tokens
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        special.sort();
        let byte_level = matches!(
            inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        Ok(Some(Tokenizer {
            inner,
            plain,
            special,
            added,
            byte_level,
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

    /// The bytes token `id` stands for. Exact for byte-level tokenizers (GPT-2, Qwen,
    /// DeepSeek), where a token may hold part of a character; otherwise the UTF-8 of the
    /// token decoded alone.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        if self.byte_level
            && !self.added.contains(&id)
            && let Some(piece) = self.inner.id_to_token(id)
            && let Some(bytes) = piece.chars().map(byte_of_char).collect::<Option<Vec<u8>>>()
        {
            return bytes;
        }
        self.inner
            .decode(&[id], false)
            .map(String::into_bytes)
            .unwrap_or_default()
    }

    /// Every token's bytes for a grammar engine, and whether it is special (a grammar
    /// names it; text never matches it). Ids the tokenizer does not use, up to the model's
    /// `vocab_size`, have no bytes.
    pub fn vocabulary(&self, vocab_size: usize) -> Vec<(Vec<u8>, bool)> {
        let special = self.inner.get_added_tokens_decoder();
        (0..vocab_size as u32)
            .map(|id| match special.get(&id) {
                Some(added) if added.special => (added.content.clone().into_bytes(), true),
                Some(added) => (added.content.clone().into_bytes(), false),
                None if self.inner.id_to_token(id).is_some() => (self.token_bytes(id), false),
                None => (Vec::new(), false),
            })
            .collect()
    }

    /// The id of special token `text`, if this tokenizer has it.
    pub fn special_token_id(&self, text: &str) -> Option<u32> {
        self.special
            .iter()
            .any(|s| s == text)
            .then(|| self.inner.token_to_id(text))
            .flatten()
    }

    fn error(&self, e: tokenizers::Error) -> ModelError {
        ModelError::Tokenizer {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }
}

/// The byte a character of GPT-2's byte-level alphabet stands for: printable bytes are
/// themselves, the others were moved to code points from 256 up, in order.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let code = c as u32;
    if code < 256 {
        let byte = code as u8;
        return printable(byte).then_some(byte);
    }
    let rank = code.checked_sub(256)? as usize;
    (0..=255u8).filter(|&b| !printable(b)).nth(rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_tokens_give_back_their_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let json = serde_json::to_string(&crate::model::demo::tokenizer_json()).unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
        let tokenizer = Tokenizer::load_optional(dir.path()).unwrap().unwrap();
        // The demo tokenizer's token `b` is byte `b`, printable or not, half a character
        // or whole.
        for id in 0..=255u32 {
            assert_eq!(tokenizer.token_bytes(id), vec![id as u8], "token {id}");
        }
        assert_eq!(tokenizer.token_bytes(256), b"<|im_start|>".to_vec());
        assert_eq!(byte_of_char('\u{400}'), None);
    }
}
