//! Tool-call parsing of generated text (`moe_node::api::tool_calls`): the model writes the
//! text, so any text may come. Input: one byte choosing the format and how the text is cut
//! into streamed pieces, then the text. Parsing never panics, the text streamed in pieces
//! parses as the whole text does, and text with no call in it comes back unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moe_node::api::tool_calls::{Parsed, Piece, ToolCallFormat, ToolCallStream};

const FORMATS: [ToolCallFormat; 7] = [
    ToolCallFormat::Hermes,
    ToolCallFormat::DeepseekV3,
    ToolCallFormat::KimiK2,
    ToolCallFormat::Mistral,
    ToolCallFormat::Glm,
    ToolCallFormat::MiniMax,
    ToolCallFormat::Harmony,
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let format = FORMATS[usize::from(selector) % FORMATS.len()];
    let whole = format.parse(text);
    if whole.calls.is_empty() {
        assert_eq!(whole.content, text);
    }
    // The same text in pieces of `step` characters, as tokens stream it.
    let step = usize::from(selector / 4) % 7 + 1;
    let mut stream = ToolCallStream::new(format);
    let mut pieces = Vec::new();
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .step_by(step)
        .chain([text.len()])
        .collect();
    for window in bounds.windows(2) {
        pieces.extend(stream.push(&text[window[0]..window[1]]));
    }
    pieces.extend(stream.finish());
    let mut streamed = Parsed::default();
    for piece in pieces {
        match piece {
            Piece::Text(t) => streamed.content.push_str(&t),
            Piece::Call(call) => streamed.calls.push(call),
        }
    }
    assert_eq!(streamed, whole);
});
