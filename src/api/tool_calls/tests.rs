use super::*;

fn call(name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: None,
        name: name.into(),
        arguments: arguments.into(),
    }
}

/// The same text fed one character at a time gives the same content and calls, and
/// no text piece holds a marker or part of one that became a call.
fn parse_both_ways(format: ToolCallFormat, text: &str) -> Parsed {
    let whole = format.parse(text);
    let mut stream = ToolCallStream::new(format);
    let mut pieces = Vec::new();
    for c in text.chars() {
        pieces.extend(stream.push(c.encode_utf8(&mut [0; 4])));
    }
    pieces.extend(stream.finish());
    let mut streamed = Parsed::default();
    for piece in pieces {
        match piece {
            Piece::Text(t) => streamed.content.push_str(&t),
            Piece::Call(c) => streamed.calls.push(c),
            Piece::Reasoning(r) => panic!("reasoning from the tool-call parser: {r}"),
        }
    }
    assert_eq!(
        streamed, whole,
        "streamed and whole parses differ for {text:?}"
    );
    whole
}

#[test]
fn qwen3_hermes_calls_with_text_before_them() {
    let text = "I will look both up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \
                \"arguments\": {\"zone\": \"CET\"}}\n</tool_call>";
    let parsed = parse_both_ways(ToolCallFormat::Hermes, text);
    assert_eq!(parsed.content, "I will look both up.\n");
    assert_eq!(
        parsed.calls,
        vec![
            call("get_weather", r#"{"city":"Paris"}"#),
            call("get_time", r#"{"zone":"CET"}"#)
        ]
    );
}

#[test]
fn glm_calls_with_and_without_newlines() {
    // GLM-4.5 and 4.6 write newlines between the tags, 4.7 none.
    let text = "Looking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n\
                <arg_value>New York</arg_value>\n<arg_key>days</arg_key>\n\
                <arg_value>3</arg_value>\n<arg_key>hourly</arg_key>\n\
                <arg_value>{\"from\": 6}</arg_value>\n</tool_call>\
                <tool_call>get_time<arg_key>zone</arg_key><arg_value>CET</arg_value></tool_call>\
                <tool_call>ping</tool_call>";
    let parsed = parse_both_ways(ToolCallFormat::Glm, text);
    assert_eq!(parsed.content, "Looking.\n");
    assert_eq!(
        parsed.calls,
        vec![
            call(
                "get_weather",
                r#"{"city":"New York","days":3,"hourly":{"from":6}}"#
            ),
            call("get_time", r#"{"zone":"CET"}"#),
            call("ping", "{}"),
        ]
    );
    let template = "{{ '<tool_call>' + tc.name }}<arg_key>{{ k }}</arg_key>";
    assert_eq!(ToolCallFormat::detect(template), Some(ToolCallFormat::Glm));
    assert_eq!(
        ToolCallFormat::for_model(template, Family::Glm4Moe),
        Some(ToolCallFormat::Glm)
    );
}

#[test]
fn harmony_calls_on_the_commentary_channel() {
    let text = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant\
                <|channel|>commentary to=functions.get_weather <|constrain|>json\
                <|message|>{\"city\": \"Tokyo\"}<|call|>";
    let parsed = parse_both_ways(ToolCallFormat::Harmony, text);
    assert_eq!(
        parsed.calls,
        vec![call("get_weather", r#"{"city": "Tokyo"}"#)]
    );
    assert_eq!(
        parsed.content,
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant\
         <|channel|>commentary "
    );
    let template = "{{- '<|start|>assistant<|channel|>commentary to=functions.' + name }}";
    assert_eq!(
        ToolCallFormat::for_model(template, Family::GptOss),
        Some(ToolCallFormat::Harmony)
    );
    let broken = "<|channel|>commentary to=functions.f <|message|>{oops}<|call|>";
    let parsed = parse_both_ways(ToolCallFormat::Harmony, broken);
    assert!(parsed.calls.is_empty(), "{parsed:?}");
    assert_eq!(parsed.content, broken);
}

#[test]
fn minimax_calls_several_in_one_block() {
    let text = "Checking.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n\
                <parameter name=\"city\">New York</parameter>\n\
                <parameter name=\"days\">3</parameter>\n</invoke>\n\
                <invoke name=\"get_time\">\n<parameter name=\"zone\">CET</parameter>\n\
                </invoke>\n</minimax:tool_call>";
    let parsed = parse_both_ways(ToolCallFormat::MiniMax, text);
    assert_eq!(parsed.content, "Checking.\n");
    assert_eq!(
        parsed.calls,
        vec![
            call("get_weather", r#"{"city":"New York","days":3}"#),
            call("get_time", r#"{"zone":"CET"}"#),
        ]
    );
    let template = "{{- '<minimax:tool_call>\\n' }}<invoke name=\"{{ tc.name }}\">";
    assert_eq!(
        ToolCallFormat::detect(template),
        Some(ToolCallFormat::MiniMax)
    );
    assert_eq!(
        ToolCallFormat::for_model(template, Family::MiniMaxM2),
        Some(ToolCallFormat::MiniMax)
    );
    // A parameter without its end tag is not a call: the text comes back.
    let broken = "<minimax:tool_call><invoke name=\"f\"><parameter name=\"a\">1</invoke></minimax:tool_call>";
    let parsed = parse_both_ways(ToolCallFormat::MiniMax, broken);
    assert!(parsed.calls.is_empty(), "{parsed:?}");
    assert_eq!(parsed.content, broken);
}

#[test]
fn deepseek_v3_and_v3_1_calls() {
    let v3 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n\
              ```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>\
              function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>\
              <｜tool▁calls▁end｜>";
    let parsed = parse_both_ways(ToolCallFormat::DeepseekV3, v3);
    assert_eq!(parsed.content, "");
    assert_eq!(
        parsed.calls,
        vec![
            call("get_weather", r#"{"city": "Paris"}"#),
            call("get_time", "{}")
        ]
    );
    let v3_1 = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>\
                {\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    let parsed = parse_both_ways(ToolCallFormat::DeepseekV3, v3_1);
    assert_eq!(parsed.content, "Checking.");
    assert_eq!(
        parsed.calls,
        vec![call("get_weather", r#"{"city": "Paris"}"#)]
    );
}

#[test]
fn kimi_k2_calls_keep_their_ids() {
    let text = "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>\
                functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Beijing\"}\
                <|tool_call_end|><|tool_call_begin|>functions.get_time:1\
                <|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
    let parsed = parse_both_ways(ToolCallFormat::KimiK2, text);
    assert_eq!(parsed.content, "Let me check.");
    let ids: Vec<_> = parsed.calls.iter().map(|c| c.id.clone().unwrap()).collect();
    assert_eq!(ids, ["functions.get_weather:0", "functions.get_time:1"]);
    let names: Vec<_> = parsed.calls.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["get_weather", "get_time"]);
    assert_eq!(parsed.calls[0].arguments, r#"{"city": "Beijing"}"#);
}

#[test]
fn mistral_list_and_named_calls() {
    let list = "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, \
                {\"name\": \"get_time\", \"arguments\": \"{\\\"zone\\\": \\\"CET\\\"}\"}]";
    let parsed = parse_both_ways(ToolCallFormat::Mistral, list);
    assert_eq!(parsed.content, "");
    assert_eq!(
        parsed.calls,
        vec![
            call("get_weather", r#"{"city":"Paris"}"#),
            call("get_time", r#"{"zone": "CET"}"#)
        ]
    );
    let named = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[ARGS]{}";
    let parsed = parse_both_ways(ToolCallFormat::Mistral, named);
    assert_eq!(
        parsed.calls,
        vec![
            call("get_weather", r#"{"city":"Paris"}"#),
            call("get_time", "{}")
        ]
    );
}

#[test]
fn malformed_calls_are_returned_as_text() {
    let cases = [
        (
            ToolCallFormat::Hermes,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",
        ),
        (
            ToolCallFormat::Hermes,
            "<tool_call>not json</tool_call> and more",
        ),
        (
            ToolCallFormat::Hermes,
            "<tool_call>{\"arguments\": {}}</tool_call>",
        ),
        (
            ToolCallFormat::Hermes,
            "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
        ),
        (
            ToolCallFormat::KimiK2,
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0\
             <|tool_call_argument_begin|>{oops}<|tool_call_end|><|tool_calls_section_end|>",
        ),
        (
            ToolCallFormat::DeepseekV3,
            "<｜tool▁calls▁begin｜>no call here<｜tool▁calls▁end｜>",
        ),
        (ToolCallFormat::Mistral, "[TOOL_CALLS] oops, not a call"),
        (
            ToolCallFormat::Glm,
            "<tool_call>f<arg_key>a</arg_key>no value tag</tool_call>",
        ),
        (ToolCallFormat::Glm, "<tool_call>not a name!</tool_call>"),
        (
            ToolCallFormat::Mistral,
            "[TOOL_CALLS][{\"name\": \"f\"}, 3]",
        ),
    ];
    for (format, text) in cases {
        let parsed = parse_both_ways(format, text);
        assert!(parsed.calls.is_empty(), "{format:?} {text:?}: {parsed:?}");
        assert_eq!(parsed.content, text, "{format:?}");
    }
}

#[test]
fn text_without_calls_passes_through_even_when_it_looks_like_a_marker() {
    for text in [
        "plain text",
        "a < b and <tool",
        "<tool_cal",
        "[TOOL",
        "",
        "x<",
    ] {
        let parsed = parse_both_ways(ToolCallFormat::Hermes, text);
        assert_eq!(parsed.content, text);
        assert!(parsed.calls.is_empty());
    }
}

#[test]
fn text_after_calls_is_kept_and_whitespace_between_them_dropped() {
    let text = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n\n\
                <tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>\nDone.";
    let parsed = parse_both_ways(ToolCallFormat::Hermes, text);
    assert_eq!(parsed.calls.len(), 2);
    assert_eq!(parsed.content, "\nDone.");
}

/// Found by the tool_calls fuzz target: a space between text and a second call was
/// dropped when streamed (taken for whitespace between calls) and kept when whole.
#[test]
fn whitespace_before_a_call_after_text_is_kept_however_the_text_is_cut() {
    let text = "[TOOL_CALLS]f[ARGS]{}said: [TOOL_CALLS]g[ARGS]{} done";
    let parsed = parse_both_ways(ToolCallFormat::Mistral, text);
    assert_eq!(parsed.content, "said:  done");
    assert_eq!(parsed.calls.len(), 2);
}

/// Found by the tool_calls fuzz target: a Mistral section whose "name" was not one
/// waited for arguments when whole (an `[ARGS]` far on) but was text when streamed.
#[test]
fn a_mistral_section_without_a_name_is_text_however_the_text_is_cut() {
    let text = "[TOOL_CALLS]!h [TOOL_CALLS]g[ARGS]{} x[ARGS]{\"L}";
    let parsed = parse_both_ways(ToolCallFormat::Mistral, text);
    assert_eq!(parsed.calls, vec![call("g", "{}")]);
}

#[test]
fn formats_are_detected_from_the_chat_template() {
    let cases = [
        (
            "{{ '<|tool_calls_section_begin|>' }}",
            Some(ToolCallFormat::KimiK2),
        ),
        (
            "{{'<｜tool▁calls▁begin｜>'}}",
            Some(ToolCallFormat::DeepseekV3),
        ),
        (
            "[TOOL_CALLS] {{ tool_calls|tojson }}",
            Some(ToolCallFormat::Mistral),
        ),
        (
            "<tool_call>\n{{ tool_call|tojson }}\n</tool_call>",
            Some(ToolCallFormat::Hermes),
        ),
        ("{{ messages }}", None),
    ];
    for (template, format) in cases {
        assert_eq!(ToolCallFormat::detect(template), format, "{template}");
    }
}

#[test]
fn a_familys_own_format_is_looked_for_first() {
    let both = "[TOOL_CALLS] or <tool_call>";
    assert_eq!(ToolCallFormat::detect(both), Some(ToolCallFormat::Mistral));
    assert_eq!(
        ToolCallFormat::for_model(both, Family::Qwen3Moe),
        Some(ToolCallFormat::Hermes)
    );
    // A template without the family's markers falls back to the others.
    assert_eq!(
        ToolCallFormat::for_model("<tool_call>", Family::DeepseekV3),
        Some(ToolCallFormat::Hermes)
    );
    assert_eq!(
        ToolCallFormat::for_model("{{ messages }}", Family::Mixtral),
        None
    );
}

/// Text made of pieces of every format's markers, JSON and noise, cut anywhere: the
/// parser never panics, streamed equals whole, and nothing is lost (content and calls
/// together account for every call's name).
#[test]
fn any_text_parses_without_panicking() {
    use rand::{Rng, SeedableRng};
    let atoms = [
        HERMES_BEGIN,
        HERMES_END,
        DEEPSEEK_SECTION_BEGIN,
        DEEPSEEK_CALL_BEGIN,
        DEEPSEEK_SEP,
        DEEPSEEK_CALL_END,
        DEEPSEEK_SECTION_END,
        KIMI_SECTION_BEGIN,
        KIMI_CALL_BEGIN,
        KIMI_ARGUMENT_BEGIN,
        KIMI_CALL_END,
        KIMI_SECTION_END,
        MISTRAL_BEGIN,
        MISTRAL_ARGS,
        "{\"name\": \"f\", \"arguments\": {\"a\": 1}}",
        "{",
        "}",
        "[",
        "]",
        "\"",
        "function",
        "\n```json\n",
        "```",
        "functions.f:0",
        " ",
        "é",
        "<",
        "|",
        "｜",
        "<function=f>",
        DSML_V32_BEGIN,
        DSML_V4_BEGIN,
        DSML_INVOKE,
        "f\">",
        "<｜DSML｜parameter name=\"a\" string=\"false\">1",
        DSML_PARAMETER_END,
        DSML_INVOKE_END,
        DSML_V32_END,
        DSML_V4_END,
        "<parameter=a>\n1\n</parameter>",
        QWEN_FUNCTION_END,
        MINIMAX_PARAMETER_END,
        "\n",
    ];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for _ in 0..3000 {
        let text: String = (0..rng.random_range(0..12))
            .map(|_| atoms[rng.random_range(0..atoms.len())])
            .collect();
        for format in [
            ToolCallFormat::Hermes,
            ToolCallFormat::DeepseekV3,
            ToolCallFormat::KimiK2,
            ToolCallFormat::Mistral,
            ToolCallFormat::Glm,
            ToolCallFormat::MiniMax,
            ToolCallFormat::Harmony,
            ToolCallFormat::Qwen3Coder,
            ToolCallFormat::DeepseekV32,
            ToolCallFormat::DeepseekV4,
        ] {
            let parsed = parse_both_ways(format, &text);
            if parsed.calls.is_empty() {
                assert_eq!(parsed.content, text, "{format:?}");
            }
        }
    }
}

#[test]
fn qwen3_coder_calls_as_qwen3_5_writes_them() {
    let text = "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n\
                </parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hourly>\n\
                {\"from\": 6}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n\
                <function=write_file>\n<parameter=text>\nline one\nline two\n</parameter>\n\
                </function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>";
    let parsed = parse_both_ways(ToolCallFormat::Qwen3Coder, text);
    assert_eq!(parsed.content, "Let me check.\n");
    assert_eq!(
        parsed.calls,
        vec![
            call(
                "get_weather",
                r#"{"city":"New York","days":3,"hourly":{"from":6}}"#
            ),
            call("write_file", r#"{"text":"line one\nline two"}"#),
            call("ping", "{}"),
        ]
    );
    // Anything after the function, or a call without one, is text.
    for malformed in [
        "<tool_call>\n<function=ping>\n</function>\nmore\n</tool_call>",
        "<tool_call>\n{\"name\": \"ping\"}\n</tool_call>",
        "<tool_call>\n<function=ping>\n<parameter=x>1\n</function>\n</tool_call>",
    ] {
        let parsed = parse_both_ways(ToolCallFormat::Qwen3Coder, malformed);
        assert!(parsed.calls.is_empty(), "{malformed}");
        assert_eq!(parsed.content, malformed);
    }
}

#[test]
fn qwen3_5_and_qwen3_next_templates_are_told_apart() {
    // Qwen3.5's template (its instructions and its rendering of earlier calls), and
    // Qwen3-Next's, which writes Hermes JSON.
    let qwen3_5 = "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\
                   {{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}";
    let qwen3_next = "{{- '<tool_call>\\n{\"name\": \"' }}{{ tool_call.name }}";
    assert_eq!(
        ToolCallFormat::for_model(qwen3_5, Family::Qwen3Next),
        Some(ToolCallFormat::Qwen3Coder)
    );
    assert_eq!(
        ToolCallFormat::detect(qwen3_5),
        Some(ToolCallFormat::Qwen3Coder)
    );
    assert_eq!(
        ToolCallFormat::for_model(qwen3_next, Family::Qwen3Next),
        Some(ToolCallFormat::Hermes)
    );
    // Llama 3's `<function=NAME>` calls, without `<tool_call>`, are not Qwen3.5's.
    assert_eq!(
        ToolCallFormat::detect("{{- '<function=' + tool_call.name + '>' }}"),
        None
    );
    // A Qwen3-MoE fine-tuned on Qwen3.5's template writes as Qwen3.5 does.
    assert_eq!(
        ToolCallFormat::for_model(qwen3_5, Family::Qwen3Moe),
        Some(ToolCallFormat::Qwen3Coder)
    );
    assert_eq!(
        ToolCallFormat::for_model(qwen3_next, Family::Qwen3Moe),
        Some(ToolCallFormat::Hermes)
    );
}

#[test]
fn dsml_calls_as_deepseek_v3_2_writes_them() {
    let text = "Checking.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
                <｜DSML｜parameter name=\"city\" string=\"true\">42</｜DSML｜parameter>\n\
                <｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n\
                <｜DSML｜parameter name=\"hourly\" string=\"false\">{\"from\": 6}</｜DSML｜parameter>\n\
                </｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_time\">\n\
                <｜DSML｜parameter name=\"zone\" string=\"true\">CET</｜DSML｜parameter>\n\
                </｜DSML｜invoke>\n</｜DSML｜function_calls>";
    let parsed = parse_both_ways(ToolCallFormat::DeepseekV32, text);
    assert_eq!(parsed.content, "Checking.\n\n");
    // `string="true"` keeps "42" a string, where GLM's and MiniMax's formats cannot tell.
    assert_eq!(
        parsed.calls,
        vec![
            call(
                "get_weather",
                r#"{"city":"42","days":3,"hourly":{"from":6}}"#
            ),
            call("get_time", r#"{"zone":"CET"}"#),
        ]
    );
    // A `string="false"` value that is not JSON, or another attribute, is not a call.
    for broken in [
        "<｜DSML｜function_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"a\" \
         string=\"false\">Paris</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>",
        "<｜DSML｜function_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"a\" \
         kind=\"x\">1</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>",
    ] {
        let parsed = parse_both_ways(ToolCallFormat::DeepseekV32, broken);
        assert!(parsed.calls.is_empty(), "{parsed:?}");
        assert_eq!(parsed.content, broken);
    }
    let template = "{{- '<｜DSML｜function_calls>' }}<｜DSML｜invoke name=\"{{ tc.name }}\">";
    assert_eq!(
        ToolCallFormat::detect(template),
        Some(ToolCallFormat::DeepseekV32)
    );
    assert_eq!(
        ToolCallFormat::for_model(template, Family::DeepseekV32),
        Some(ToolCallFormat::DeepseekV32)
    );
}

/// DeepSeek-V4 writes V3.2's invokes in a `<｜DSML｜tool_calls>` block (its
/// `encoding_dsv4.py`); a V3.2 block is text to it, as V4's is to V3.2.
#[test]
fn dsml_calls_as_deepseek_v4_writes_them() {
    let block = |name: &str| {
        format!(
            "<｜DSML｜{name}>\n<｜DSML｜invoke name=\"get_time\">\n\
             <｜DSML｜parameter name=\"zone\" string=\"true\">CET</｜DSML｜parameter>\n\
             </｜DSML｜invoke>\n</｜DSML｜{name}>"
        )
    };
    let v4 = format!("</think>Checking.\n\n{}", block("tool_calls"));
    let parsed = parse_both_ways(ToolCallFormat::DeepseekV4, &v4);
    assert_eq!(parsed.content, "</think>Checking.\n\n");
    assert_eq!(parsed.calls, vec![call("get_time", r#"{"zone":"CET"}"#)]);
    for (format, other) in [
        (ToolCallFormat::DeepseekV4, block("function_calls")),
        (ToolCallFormat::DeepseekV32, block("tool_calls")),
    ] {
        let parsed = parse_both_ways(format, &other);
        assert!(
            parsed.calls.is_empty() && parsed.content == other,
            "{format:?}"
        );
    }
    let template = "{{- '<｜DSML｜tool_calls>\\n' }}<｜DSML｜invoke name=\"{{ tc.name }}\">";
    assert_eq!(
        ToolCallFormat::for_model(template, Family::DeepseekV4),
        Some(ToolCallFormat::DeepseekV4)
    );
    assert_eq!(
        ToolCallFormat::detect(template),
        Some(ToolCallFormat::DeepseekV4)
    );
}

/// The templates built in for the families that publish their prompt format as code write
/// calls that the family's own format reads.
#[test]
fn built_in_templates_are_read_by_their_familys_format() {
    for (family, format) in [
        (Family::DeepseekV32, ToolCallFormat::DeepseekV32),
        (Family::DeepseekV4, ToolCallFormat::DeepseekV4),
    ] {
        let template = family.builtin_chat_template().unwrap();
        assert_eq!(
            ToolCallFormat::for_model(template, family),
            Some(format),
            "{family:?}"
        );
    }
}
