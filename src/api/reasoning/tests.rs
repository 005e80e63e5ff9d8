use super::*;
use crate::api::tool_calls::ToolCallFormat;

/// The split of `text` whole, checked against the same text streamed a character at a
/// time and in pieces of 3 bytes (where they fall on characters).
fn split(format: ReasoningFormat, opened: bool, text: &str) -> (Option<String>, String) {
    let whole = ReasoningStream::split(format, opened, text);
    for pieces in [1, 3] {
        let mut stream = ReasoningStream::new(format, opened);
        let (mut reasoning, mut content) = (None::<String>, String::new());
        let mut parts = Vec::new();
        let mut at = 0;
        while at < text.len() {
            let mut end = (at + pieces).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            parts.extend(stream.push(&text[at..end]));
            at = end;
        }
        parts.extend(stream.finish());
        for part in parts {
            match part {
                Part::Reasoning(t) => {
                    assert!(!t.is_empty(), "an empty part");
                    reasoning.get_or_insert_default().push_str(&t)
                }
                Part::Content(t) => {
                    assert!(!t.is_empty(), "an empty part");
                    content.push_str(&t)
                }
            }
        }
        assert_eq!(
            (reasoning, content),
            whole,
            "streamed in pieces of {pieces}: {text:?}"
        );
    }
    whole
}

fn some(s: &str) -> Option<String> {
    Some(s.to_string())
}

#[test]
fn a_think_block_opened_by_the_prompt_is_reasoning_up_to_its_close() {
    use ReasoningFormat::Think;
    assert_eq!(
        split(
            Think,
            true,
            "\nLet me add: 1 + 1 = 2.\n</think>\n\nIt is **2**."
        ),
        (some("Let me add: 1 + 1 = 2."), "It is **2**.".into())
    );
    // Never closed (cut by max_tokens): all of it is reasoning.
    assert_eq!(
        split(Think, true, "Still thinking about </thi"),
        (some("Still thinking about </thi"), String::new())
    );
    // Closed at once (a template's empty block): an answer only.
    assert_eq!(split(Think, true, "</think>Hi"), (None, "Hi".into()));
    // Whitespace inside the reasoning is kept, only its ends are trimmed.
    assert_eq!(
        split(Think, true, "a\n\n  b  </think>c  d "),
        (some("a\n\n  b"), "c  d ".into())
    );
}

#[test]
fn an_output_that_opens_its_own_block_or_none_is_split_accordingly() {
    use ReasoningFormat::Think;
    assert_eq!(
        split(Think, false, "  <think>\nhmm</think>\n\nYes."),
        (some("hmm"), "Yes.".into())
    );
    assert_eq!(
        split(Think, false, "Hello there"),
        (None, "Hello there".into())
    );
    // `<think>` later in an answer is the answer's text.
    assert_eq!(
        split(Think, false, "Write <think> tags"),
        (None, "Write <think> tags".into())
    );
    assert_eq!(split(Think, false, "<thi"), (None, "<thi".into()));
    assert_eq!(split(Think, false, ""), (None, String::new()));
    // Characters of several bytes around the markers.
    assert_eq!(
        split(Think, true, "日本語で考える</think>答え：はい"),
        (some("日本語で考える"), "答え：はい".into())
    );
}

#[test]
fn harmony_analysis_is_reasoning_and_final_the_answer() {
    use ReasoningFormat::Harmony;
    let text = "<|channel|>analysis<|message|>User asks for 2+2. Answer 4.<|end|>\
                <|start|>assistant<|channel|>final<|message|>2 + 2 = 4.";
    assert_eq!(
        split(Harmony, false, text),
        (some("User asks for 2+2. Answer 4."), "2 + 2 = 4.".into())
    );
    // A preamble on the commentary channel, to nobody, is part of the answer.
    let text = "<|channel|>commentary<|message|>Checking. <|end|>\
                <|start|>assistant<|channel|>final<|message|>Done.<|return|>";
    assert_eq!(
        split(Harmony, false, text),
        (None, "Checking. Done.".into())
    );
    // Text without harmony's markers is an answer as written.
    assert_eq!(
        split(Harmony, false, "Just text"),
        (None, "Just text".into())
    );
}

#[test]
fn a_harmony_call_reaches_the_tool_call_parser_and_leaves_no_markup() {
    let text = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant\
                <|channel|>commentary to=functions.get_weather <|constrain|>json\
                <|message|>{\"city\": \"Tokyo\"}<|call|>";
    let (reasoning, content) = split(ReasoningFormat::Harmony, false, text);
    assert_eq!(reasoning, some("Need the weather."));
    let parsed = ToolCallFormat::Harmony.parse(&content);
    assert_eq!(parsed.calls.len(), 1, "{content:?}");
    assert_eq!(parsed.calls[0].name, "get_weather");
    assert_eq!(parsed.content, "");
}

#[test]
fn the_format_comes_from_the_template_and_the_prompt_says_whether_it_opened() {
    use ReasoningFormat::*;
    let qwen3 = "{%- if '</think>' in content %}{%- set reasoning_content = ... %}";
    assert_eq!(
        ReasoningFormat::detect(qwen3, Family::Qwen3Moe),
        Some(Think)
    );
    assert_eq!(
        ReasoningFormat::detect("{{ '<|im_start|>' }}", Family::Qwen3Moe),
        None
    );
    assert_eq!(
        ReasoningFormat::detect("<|channel|>analysis", Family::Mixtral),
        Some(Harmony)
    );
    assert_eq!(ReasoningFormat::detect("", Family::GptOss), Some(Harmony));
    assert!(Think.opened_by("<｜Assistant｜><think>\n"));
    assert!(!Think.opened_by("<｜Assistant｜></think>"));
    assert!(!Harmony.opened_by("<|start|>assistant"));
    assert!(Harmony.needs_special_text(|_| false));
    assert!(!Think.needs_special_text(|_| false));
    assert!(Think.needs_special_text(|t| t == "</think>"));
}

/// Texts made of the markers' pieces, whitespace and other characters: streamed in pieces
/// they split as they do whole, in every format, and nothing is lost but markers and the
/// whitespace at the ends of the reasoning and before the answer.
#[test]
fn streamed_splits_equal_whole_ones_for_texts_of_marker_pieces() {
    const PIECES: [&str; 19] = [
        "<think>",
        "</think>",
        "</thi",
        "<|channel|>",
        "analysis",
        "final",
        "commentary",
        "<|message|>",
        "<|end|>",
        "<|start|>",
        "assistant",
        "<|call|>",
        "<|return|>",
        " to=functions.f",
        " ",
        "\n",
        "x",
        "<|",
        "日",
    ];
    let mut seed = 0x2545_f491_u32;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed as usize
    };
    for _ in 0..3000 {
        let text: String = (0..next() % 12)
            .map(|_| PIECES[next() % PIECES.len()])
            .collect();
        for (format, opened) in [
            (ReasoningFormat::Think, false),
            (ReasoningFormat::Think, true),
            (ReasoningFormat::Harmony, false),
        ] {
            let (reasoning, content) = split(format, opened, &text);
            let kept = |s: &str| s.chars().filter(|c| !c.is_whitespace()).count();
            let all = kept(&text);
            let out = kept(reasoning.as_deref().unwrap_or("")) + kept(&content);
            assert!(out <= all, "{text:?}");
        }
    }
}
