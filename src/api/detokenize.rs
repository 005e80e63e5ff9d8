//! Generated ids to text one token at a time, at a cost per token that does not grow with
//! the output: each token decodes only a short window of the last ids (the prefix-offset
//! scheme of the `tokenizers` crate's `DecodeStream`), and stop strings are looked for only
//! in the text's tail.

use super::stop::StopStrings;
use crate::model::Tokenizer;

/// Tokens held back at most while their text ends in an incomplete character. A character
/// is at most four bytes, so a run this long that still ends incomplete is invalid UTF-8,
/// sent as replacement characters (as a whole decode would).
const MAX_HELD_TOKENS: usize = 8;

/// The text of a growing list of ids.
#[derive(Debug, Default)]
pub struct IncrementalText {
    /// Special tokens' text is kept (tool-call markers are special tokens).
    special: bool,
    /// The ids decoded together: the context (`..prefix_index`), whose text was sent
    /// already, then the tokens whose text is held back.
    window: Vec<u32>,
    /// The text of `window[..prefix_index]`.
    prefix: String,
    prefix_index: usize,
    text: String,
}

impl IncrementalText {
    /// Adds token `id` and returns the text it completes: empty while a character is
    /// incomplete (the rest comes with a later token).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> &str {
        let start = self.text.len();
        self.window.push(id);
        let held = self.window.len() - self.prefix_index;
        let Ok(decoded) = self.decode(tokenizer, &self.window) else {
            return "";
        };
        if decoded.ends_with('\u{FFFD}') && held <= MAX_HELD_TOKENS {
            return "";
        }
        self.text.push_str(past_prefix(&decoded, &self.prefix));
        // The tokens just sent are the next token's context.
        self.window.drain(..self.prefix_index);
        self.prefix_index = self.window.len();
        self.prefix = self.decode(tokenizer, &self.window).unwrap_or(decoded);
        &self.text[start..]
    }

    fn decode(
        &self,
        tokenizer: &Tokenizer,
        ids: &[u32],
    ) -> Result<String, crate::model::ModelError> {
        if self.special {
            tokenizer.decode(ids)
        } else {
            tokenizer.decode_text(ids)
        }
    }

    /// Ends the text: tokens still held back (an incomplete last character) are decoded
    /// as they are. Returns what that added.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> &str {
        let start = self.text.len();
        if self.window.len() > self.prefix_index
            && let Ok(decoded) = self.decode(tokenizer, &self.window)
        {
            self.text.push_str(past_prefix(&decoded, &self.prefix));
        }
        self.window.clear();
        self.prefix.clear();
        self.prefix_index = 0;
        &self.text[start..]
    }

    pub fn text(&self) -> &str {
        &self.text
    }
}

/// `decoded` past its first `prefix.len()` bytes: what the newest tokens added. A
/// tokenizer may re-decode the context differently; then the part past the prefix's
/// length is taken, from a character boundary.
fn past_prefix<'a>(decoded: &'a str, prefix: &str) -> &'a str {
    if let Some(new) = decoded.strip_prefix(prefix) {
        return new;
    }
    let at = (prefix.len()..decoded.len())
        .find(|&i| decoded.is_char_boundary(i))
        .unwrap_or(decoded.len());
    &decoded[at..]
}

/// One choice's text as it streams: what was sent, and where a stop string cut it. Text
/// from a stop string on is never sent; a tail that may be the start of a stop string is
/// held back until the next token tells. Without a tokenizer the text stays empty and
/// clients read token ids.
pub struct ChoiceText {
    text: IncrementalText,
    stops: StopStrings,
    /// Bytes of the text already sent.
    sent: usize,
    /// Bytes of the text already searched for stop strings (a stop string may still end
    /// in the next token, so each search starts a stop string's length before this).
    searched: usize,
    /// Where the first stop string begins, once one is found.
    stop_at: Option<usize>,
    /// With special tokens' text kept: the tokens that end a generation, whose text is
    /// still left out.
    hidden: Vec<u32>,
}

impl ChoiceText {
    pub fn new(stops: StopStrings) -> Self {
        ChoiceText {
            text: IncrementalText::default(),
            stops,
            sent: 0,
            searched: 0,
            stop_at: None,
            hidden: Vec::new(),
        }
    }

    /// Keeps special tokens' text (where tool-call markers are special tokens), except
    /// that of `hidden`, the tokens that end the generation.
    pub fn keeping_special_tokens(mut self, hidden: Vec<u32>) -> Self {
        self.text.special = true;
        self.hidden = hidden;
        self
    }

    /// Adds a generated token; returns whether a stop string has been reached.
    pub fn push(&mut self, tokenizer: Option<&Tokenizer>, id: u32) -> bool {
        if let Some(tokenizer) = tokenizer
            && self.stop_at.is_none()
            && !self.hidden.contains(&id)
        {
            self.text.push(tokenizer, id);
            self.look_for_stops();
        }
        self.stop_at.is_some()
    }

    fn look_for_stops(&mut self) {
        if self.stops.is_empty() {
            return;
        }
        let text = self.text.text();
        let mut from = self
            .searched
            .saturating_sub(self.stops.longest().saturating_sub(1));
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        self.stop_at = self.stops.find(&text[from..]).map(|at| from + at);
        self.searched = text.len();
    }

    /// The next piece of text to stream: everything new up to a stop string, or up to a
    /// tail that may begin one.
    pub fn delta(&mut self) -> String {
        let text = self.text.text();
        let end = match self.stop_at {
            Some(at) => at,
            None => self.stops.safe_len(text),
        };
        self.take(end)
    }

    /// Whatever is left at the end (tokens held back included), up to a stop string.
    pub fn rest(&mut self, tokenizer: Option<&Tokenizer>) -> String {
        if let Some(tokenizer) = tokenizer
            && self.stop_at.is_none()
        {
            self.text.finish(tokenizer);
            self.look_for_stops();
        }
        let end = self.stop_at.unwrap_or(self.text.text().len());
        self.take(end)
    }

    /// The whole text, cut before the first stop string (for a response sent whole).
    pub fn final_text(&mut self, tokenizer: Option<&Tokenizer>) -> String {
        self.rest(tokenizer);
        let text = self.text.text();
        text[..self.stop_at.unwrap_or(text.len())].to_string()
    }

    /// `text[sent..end]`, after which `end` counts as sent.
    fn take(&mut self, end: usize) -> String {
        match self.text.text().get(self.sent..end) {
            Some(delta) => {
                let delta = delta.to_string();
                self.sent = end;
                delta
            }
            None => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo_tokenizer() -> Tokenizer {
        let dir = tempfile::tempdir().unwrap();
        let json = serde_json::to_string(&crate::model::demo::tokenizer_json()).unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
        Tokenizer::load_optional(dir.path()).unwrap().unwrap()
    }

    /// The demo tokenizer's tokens are single bytes, so every multi-byte character is
    /// split across tokens: the pieces must add up to the whole decode all the same.
    #[test]
    fn pieces_add_up_to_the_whole_decode_across_split_characters() {
        let tokenizer = demo_tokenizer();
        let mut cases: Vec<Vec<u32>> = ["plain ascii", "naïve café — 東京 🚀!", "🚀🚀", "é"]
            .iter()
            .map(|s| s.bytes().map(u32::from).collect())
            .collect();
        // Invalid UTF-8: a lone continuation byte, a character cut short mid-text, one
        // cut short at the end, and special tokens (left out of the text).
        cases.push(vec![0x61, 0x80, 0x62]);
        cases.push(vec![0xE2, 0x82, 0x61, 0xE2, 0x82, 0xAC]);
        cases.push(vec![0x61, 0xF0, 0x9F, 0x9A]);
        cases.push(vec![0x61, 256, 0xC3, 257, 0xA9]);
        cases.push(vec![0x80; 20]);
        for ids in cases {
            let whole = tokenizer.decode_text(&ids).unwrap();
            let mut text = IncrementalText::default();
            let mut pieces = String::new();
            for &id in &ids {
                pieces.push_str(text.push(&tokenizer, id));
            }
            pieces.push_str(text.finish(&tokenizer));
            assert_eq!(pieces, whole, "ids {ids:?}");
            assert_eq!(text.text(), whole);
            assert!(text.window.len() <= 2 * (MAX_HELD_TOKENS + 1));
        }
    }

    #[test]
    fn a_split_character_is_held_until_complete() {
        let tokenizer = demo_tokenizer();
        let mut text = IncrementalText::default();
        assert_eq!(text.push(&tokenizer, 0xC3), "");
        assert_eq!(text.push(&tokenizer, 0xA9), "é");
        assert_eq!(text.push(&tokenizer, u32::from(b'!')), "!");
    }

    #[test]
    fn stop_strings_cut_the_text_and_partial_ones_are_held_back() {
        let tokenizer = demo_tokenizer();
        let mut choice = ChoiceText::new(StopStrings::new(vec!["END".into()]));
        let mut streamed = String::new();
        let mut stopped = false;
        for byte in "abc EN".bytes() {
            assert!(!choice.push(Some(&tokenizer), u32::from(byte)));
            streamed.push_str(&choice.delta());
        }
        assert_eq!(streamed, "abc ", "a possible start of END is held back");
        for byte in "D tail".bytes() {
            stopped |= choice.push(Some(&tokenizer), u32::from(byte));
            streamed.push_str(&choice.delta());
        }
        assert!(stopped);
        streamed.push_str(&choice.rest(Some(&tokenizer)));
        assert_eq!(streamed, "abc ");
        assert_eq!(choice.final_text(Some(&tokenizer)), "abc ");

        // A stop string that ends far into a long text is still found from the tail.
        let mut long = ChoiceText::new(StopStrings::new(vec!["\n\n".into()]));
        let text = format!("{}\n\nafter", "x".repeat(1000));
        let at = text.bytes().position(|b| b == b'\n').unwrap();
        for (i, byte) in text.bytes().enumerate() {
            let stopped = long.push(Some(&tokenizer), u32::from(byte));
            assert_eq!(stopped, i > at, "byte {i}");
        }
        assert_eq!(long.final_text(Some(&tokenizer)), "x".repeat(1000));
    }
}
