//! Tool-call parsing and the reasoning split of generated text (`moe_node::api::tool_calls`,
//! `moe_node::api::reasoning`): the model writes the text, so any text may come. Input: one
//! byte choosing the formats and how the text is cut into streamed pieces, then the text.
//! Neither panics, the text streamed in pieces comes out as the whole text does, and text
//! with no call in it comes back unchanged from the tool-call parser.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moe_node::api::reasoning::{Part, ReasoningFormat, ReasoningStream};
use moe_node::api::tool_calls::{Parsed, Piece, ToolCallFormat, ToolCallStream};

const FORMATS: [ToolCallFormat; 10] = [
    ToolCallFormat::Hermes,
    ToolCallFormat::DeepseekV3,
    ToolCallFormat::KimiK2,
    ToolCallFormat::Mistral,
    ToolCallFormat::Glm,
    ToolCallFormat::MiniMax,
    ToolCallFormat::Harmony,
    ToolCallFormat::DeepseekV32,
    ToolCallFormat::DeepseekV4,
    ToolCallFormat::Qwen3Coder,
];

/// The reasoning formats, and whether the prompt opened the block.
const SPLITS: [(ReasoningFormat, bool); 3] = [
    (ReasoningFormat::Think, false),
    (ReasoningFormat::Think, true),
    (ReasoningFormat::Harmony, false),
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
            Piece::Reasoning(_) => unreachable!("the tool-call parser hands on no reasoning"),
        }
    }
    assert_eq!(streamed, whole);

    let (format, opened) = SPLITS[usize::from(selector) % SPLITS.len()];
    let whole = ReasoningStream::split(format, opened, text);
    let mut stream = ReasoningStream::new(format, opened);
    let mut parts = Vec::new();
    for window in bounds.windows(2) {
        parts.extend(stream.push(&text[window[0]..window[1]]));
    }
    parts.extend(stream.finish());
    let (mut reasoning, mut content) = (None::<String>, String::new());
    for part in parts {
        match part {
            Part::Reasoning(t) => reasoning.get_or_insert_default().push_str(&t),
            Part::Content(t) => content.push_str(&t),
        }
    }
    assert_eq!((reasoning, content), whole);
});
