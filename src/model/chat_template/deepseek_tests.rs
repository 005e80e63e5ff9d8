//! The built-in templates of the families that publish their prompt format as Python
//! (DeepSeek-V3.2's `encoding_dsv32.py`, V4's `encoding_dsv4.py`) against that format,
//! written out by hand.

use super::*;

/// DeepSeek-V4's built-in template against its published format (`encoding_dsv4.py`, chat
/// mode), written out by hand: the system text then the tools, a user turn and the turn
/// change to the assistant with `</think>`, an assistant's calls as a DSML block closed by
/// the end of sentence, and the tool's result merged with the next user text into one user
/// turn. A conversation without tools or a system message is only its turns.
#[test]
fn deepseek_v4s_built_in_template_writes_its_published_format() {
    let dir = tempfile::tempdir().unwrap();
    let builtin = crate::model::Family::DeepseekV4.builtin_chat_template();
    let t = ChatTemplate::load(dir.path(), builtin).unwrap().unwrap();
    let tool = serde_json::json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let mut call = ChatMessage::new("assistant", "");
    call.content = None;
    call.tool_calls = Some(vec![serde_json::json!({"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}})]);
    let mut result = ChatMessage::new("tool", "Sunny");
    result.tool_call_id = Some("c1".into());
    let chat = ChatInput {
        messages: vec![
            ChatMessage::new("system", "You are helpful."),
            ChatMessage::new("user", "Weather in Paris?"),
            call,
            result,
            ChatMessage::new("user", "And Lima?"),
        ],
        tools: Some(vec![tool]),
        kwargs: Default::default(),
    };
    let dsml = "｜DSML｜";
    let expected = format!(
        "<｜begin▁of▁sentence｜>You are helpful.\n\n## Tools\n\nYou have access to a set of \
         tools to help answer the user's question. You can invoke tools by writing a \
         \"<{dsml}tool_calls>\" block like the following:\n\n<{dsml}tool_calls>\n\
         <{dsml}invoke name=\"$TOOL_NAME\">\n<{dsml}parameter name=\"$PARAMETER_NAME\" \
         string=\"true|false\">$PARAMETER_VALUE</{dsml}parameter>\n...\n</{dsml}invoke>\n\
         <{dsml}invoke name=\"$TOOL_NAME2\">\n...\n</{dsml}invoke>\n</{dsml}tool_calls>\n\n\
         String parameters should be specified as is and set `string=\"true\"`. For all other \
         types (numbers, booleans, arrays, objects), pass the value in JSON format and set \
         `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST \
         output your complete reasoning inside <think>...</think> BEFORE any tool calls or \
         final response.\n\nOtherwise, output directly after </think> with tool calls or final \
         response.\n\n### Available Tool Schemas\n\n{{\"name\": \"get_weather\", \
         \"parameters\": {{\"type\": \"object\", \"properties\": {{\"city\": {{\"type\": \
         \"string\"}}}}}}}}\n\nYou MUST strictly follow the above defined tool name and \
         parameter schemas to invoke tool calls.\n\
         <｜User｜>Weather in Paris?<｜Assistant｜></think>\n\n<{dsml}tool_calls>\n\
         <{dsml}invoke name=\"get_weather\">\n\
         <{dsml}parameter name=\"city\" string=\"true\">Paris</{dsml}parameter>\n\
         <{dsml}parameter name=\"days\" string=\"false\">3</{dsml}parameter>\n\
         </{dsml}invoke>\n</{dsml}tool_calls><｜end▁of▁sentence｜>\
         <｜User｜><tool_result>Sunny</tool_result>\n\nAnd Lima?<｜Assistant｜></think>"
    );
    assert_eq!(t.render(&chat).unwrap(), expected);
    let plain = vec![ChatMessage::new("user", "Hi")].into();
    assert_eq!(
        t.render(&plain).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    );
    // Tools without a system message follow an empty one.
    let mut chat = ChatInput::from(vec![ChatMessage::new("user", "Hi")]);
    chat.tools = Some(vec![serde_json::json!({"type": "function",
        "function": {"name": "f"}})]);
    let rendered = t.render(&chat).unwrap();
    assert!(
        rendered.starts_with("<｜begin▁of▁sentence｜>\n\n## Tools\n\n"),
        "{rendered}"
    );
    assert!(rendered.ends_with("{\"name\": \"f\"}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n<｜User｜>Hi<｜Assistant｜></think>"), "{rendered}");
    // A model that ships a template keeps its own.
    std::fs::write(dir.path().join("chat_template.jinja"), "{{ 'own' }}").unwrap();
    let own = ChatTemplate::load(dir.path(), builtin).unwrap().unwrap();
    assert_eq!(own.render(&plain).unwrap(), "own");
}

/// DeepSeek-V3.2's built-in template against its published format (`encoding_dsv32.py`, chat
/// mode), written out by hand: the tools after the system text, each user turn handing over
/// with `</think>`, two calls in one DSML block, and both results in one `<function_results>`
/// block after which the assistant goes on.
#[test]
fn deepseek_v32s_built_in_template_writes_its_published_format() {
    let dir = tempfile::tempdir().unwrap();
    let builtin = crate::model::Family::DeepseekV32.builtin_chat_template();
    let t = ChatTemplate::load(dir.path(), builtin).unwrap().unwrap();
    let tool = serde_json::json!({"type": "function", "function": {"name": "get_time",
        "parameters": {"type": "object"}}});
    let mut calls = ChatMessage::new("assistant", "Looking.");
    calls.tool_calls = Some(vec![
        serde_json::json!({"type": "function",
            "function": {"name": "get_time", "arguments": {"zone": "CET"}}}),
        serde_json::json!({"type": "function",
            "function": {"name": "get_time", "arguments": {"zone": "UTC", "dst": false}}}),
    ]);
    let chat = ChatInput {
        messages: vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Times?"),
            calls,
            ChatMessage::new("tool", "12:00"),
            ChatMessage::new("tool", "11:00"),
        ],
        tools: Some(vec![tool]),
        kwargs: Default::default(),
    };
    let d = "｜DSML｜";
    let expected = format!(
        "<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\nYou have access to a set of tools you \
         can use to answer the user's question.\nYou can invoke functions by writing a \
         \"<{d}function_calls>\" block like the following as part of your reply to the user:\n\
         <{d}function_calls>\n<{d}invoke name=\"$FUNCTION_NAME\">\n<{d}parameter \
         name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{d}parameter>\n...\n\
         </{d}invoke>\n<{d}invoke name=\"$FUNCTION_NAME2\">\n...\n</{d}invoke>\n\
         </{d}function_calls>\nString and scalar parameters should be specified as is without \
         any escaping or quotes, while lists and objects should use JSON format. The \"string\" \
         attribute should be set to \"true\" for string type parameters and \"false\" for other \
         types (numbers, booleans, arrays, objects).\nIf the thinking_mode is enabled, then \
         after function results you should strongly consider outputting a thinking block. Here \
         is an example:\n<{d}function_calls>\n...\n</{d}function_calls>\n<function_results>\n\
         ...\n</function_results>\n<think>...thinking about results</think>\nHere are the \
         functions available in JSONSchema format:\n<functions>\n{{\"name\": \"get_time\", \
         \"parameters\": {{\"type\": \"object\"}}}}\n</functions>\n\
         <｜User｜>Times?<｜Assistant｜></think>Looking.\n\n<{d}function_calls>\n\
         <{d}invoke name=\"get_time\">\n<{d}parameter name=\"zone\" string=\"true\">CET</{d}parameter>\n\
         </{d}invoke>\n<{d}invoke name=\"get_time\">\n\
         <{d}parameter name=\"zone\" string=\"true\">UTC</{d}parameter>\n\
         <{d}parameter name=\"dst\" string=\"false\">false</{d}parameter>\n</{d}invoke>\n\
         </{d}function_calls><｜end▁of▁sentence｜>\n\n<function_results>\n<result>12:00</result>\n\
         <result>11:00</result>\n</function_results>\n\n</think>"
    );
    assert_eq!(t.render(&chat).unwrap(), expected);
    // A result with no call before it is refused, naming why.
    let stray = vec![
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("tool", "12:00"),
    ];
    let err = t.render(&stray.into()).unwrap_err();
    assert!(err.contains("a tool result without its call"), "{err}");
}

/// A V3.2 or V4 chat in thinking mode (`thinking` or `enable_thinking` among the kwargs).
fn thinking(messages: Vec<ChatMessage>, kwargs: serde_json::Value) -> ChatInput {
    let mut chat = ChatInput::from(messages);
    chat.kwargs = kwargs.as_object().unwrap().clone();
    chat
}

fn with_reasoning(content: &str, reasoning: &str) -> ChatMessage {
    let mut m = ChatMessage::new("assistant", content);
    m.reasoning_content = Some(reasoning.into());
    m
}

/// V3.2's thinking mode as `encoding_dsv32.py` writes it: the last user turn hands over with
/// `<think>`; an earlier turn keeps `</think>` and loses its reasoning; an assistant turn
/// after the last user turn (a tool loop) carries its reasoning, and the results after it
/// hand over with `<think>` again.
#[test]
fn deepseek_v32s_thinking_mode_writes_its_published_format() {
    let dir = tempfile::tempdir().unwrap();
    let builtin = crate::model::Family::DeepseekV32.builtin_chat_template();
    let t = ChatTemplate::load(dir.path(), builtin).unwrap().unwrap();
    let bos = "<｜begin▁of▁sentence｜>";
    let chat = thinking(
        vec![
            ChatMessage::new("user", "hello"),
            with_reasoning("Hello! I am DeepSeek.", "thinking..."),
            ChatMessage::new("user", "1+1=?"),
        ],
        serde_json::json!({"thinking": true}),
    );
    assert_eq!(
        t.render(&chat).unwrap(),
        format!(
            "{bos}<｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek.<｜end▁of▁sentence｜>\
             <｜User｜>1+1=?<｜Assistant｜><think>"
        )
    );
    let mut call = with_reasoning("Looking.", "Need the time.");
    call.tool_calls = Some(vec![serde_json::json!({"type": "function",
        "function": {"name": "get_time", "arguments": {"zone": "CET"}}})]);
    let chat = thinking(
        vec![
            ChatMessage::new("user", "Time?"),
            call,
            ChatMessage::new("tool", "12:00"),
        ],
        serde_json::json!({"enable_thinking": true}),
    );
    let d = "｜DSML｜";
    assert_eq!(
        t.render(&chat).unwrap(),
        format!(
            "{bos}<｜User｜>Time?<｜Assistant｜><think>Need the time.</think>Looking.\n\n\
             <{d}function_calls>\n<{d}invoke name=\"get_time\">\n\
             <{d}parameter name=\"zone\" string=\"true\">CET</{d}parameter>\n</{d}invoke>\n\
             </{d}function_calls><｜end▁of▁sentence｜>\n\n<function_results>\n\
             <result>12:00</result>\n</function_results>\n\n<think>"
        )
    );
    // Off (or not asked for): chat mode, the reasoning sent back is left out.
    let chat = thinking(
        vec![
            ChatMessage::new("user", "hello"),
            with_reasoning("Hi.", "thinking..."),
            ChatMessage::new("user", "1+1=?"),
        ],
        serde_json::json!({"thinking": false}),
    );
    assert_eq!(
        t.render(&chat).unwrap(),
        format!(
            "{bos}<｜User｜>hello<｜Assistant｜></think>Hi.<｜end▁of▁sentence｜>\
             <｜User｜>1+1=?<｜Assistant｜></think>"
        )
    );
}

/// V4's thinking mode as `encoding_dsv4.py` writes it: without tools an earlier turn loses
/// its reasoning and its developer messages; with tools every turn keeps its reasoning and
/// hands over with `<think>`; `reasoning_effort` "max" puts the format's instruction first,
/// "none" is chat mode.
#[test]
fn deepseek_v4s_thinking_mode_writes_its_published_format() {
    let dir = tempfile::tempdir().unwrap();
    let builtin = crate::model::Family::DeepseekV4.builtin_chat_template();
    let t = ChatTemplate::load(dir.path(), builtin).unwrap().unwrap();
    let bos = "<｜begin▁of▁sentence｜>";
    let eos = "<｜end▁of▁sentence｜>";
    let messages = || {
        vec![
            ChatMessage::new("user", "hello"),
            with_reasoning("Hi!", "r1"),
            ChatMessage::new("developer", "Be terse."),
            ChatMessage::new("user", "1+1=?"),
        ]
    };
    let chat = thinking(messages(), serde_json::json!({"thinking": true}));
    assert_eq!(
        t.render(&chat).unwrap(),
        format!(
            "{bos}<｜User｜>hello<｜Assistant｜></think>Hi!{eos}<｜User｜>1+1=?<｜Assistant｜><think>"
        )
    );
    let max = thinking(
        messages(),
        serde_json::json!({"thinking": true, "reasoning_effort": "max"}),
    );
    let rendered = t.render(&max).unwrap();
    assert!(
        rendered.starts_with(&format!(
            "{bos}Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        )) && rendered.ends_with("<｜User｜>1+1=?<｜Assistant｜><think>"),
        "{rendered}"
    );
    let none = thinking(
        messages(),
        serde_json::json!({"thinking": true, "reasoning_effort": "none"}),
    );
    assert_eq!(
        t.render(&none).unwrap(),
        format!(
            "{bos}<｜User｜>hello<｜Assistant｜></think>Hi!{eos}<｜User｜>Be terse.\n\n1+1=?\
             <｜Assistant｜></think>"
        )
    );
    let mut tools = thinking(messages(), serde_json::json!({"enable_thinking": true}));
    tools.tools = Some(vec![serde_json::json!({"type": "function",
        "function": {"name": "f"}})]);
    let rendered = t.render(&tools).unwrap();
    assert!(
        rendered.ends_with(&format!(
            "<｜User｜>hello<｜Assistant｜><think>r1</think>Hi!{eos}<｜User｜>Be terse.\n\n\
             1+1=?<｜Assistant｜><think>"
        )),
        "{rendered}"
    );
}

/// V4's results are written in the order of the calls they answer (matched by
/// `tool_call_id`), as `encoding_dsv4.py` sorts them; where they do not match one call each,
/// in the order given.
#[test]
fn deepseek_v4s_results_follow_the_order_of_their_calls() {
    let dir = tempfile::tempdir().unwrap();
    let builtin = crate::model::Family::DeepseekV4.builtin_chat_template();
    let t = ChatTemplate::load(dir.path(), builtin).unwrap().unwrap();
    let call = |id: &str, city: &str| {
        serde_json::json!({"id": id, "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": city}}})
    };
    let result = |id: Option<&str>, text: &str| {
        let mut m = ChatMessage::new("tool", text);
        m.tool_call_id = id.map(str::to_string);
        m
    };
    let mut calls = ChatMessage::new("assistant", "");
    calls.content = None;
    calls.tool_calls = Some(vec![call("c1", "Paris"), call("c2", "Lima")]);
    let rendered = |results: Vec<ChatMessage>| {
        let mut messages = vec![ChatMessage::new("user", "Weather?"), calls.clone()];
        messages.extend(results);
        let text = t.render(&messages.into()).unwrap();
        text[text.find("<｜end▁of▁sentence｜>").unwrap()..].to_string()
    };
    let in_order = "<｜end▁of▁sentence｜><｜User｜><tool_result>Paris: sun</tool_result>\n\n\
                    <tool_result>Lima: fog</tool_result><｜Assistant｜></think>";
    assert_eq!(
        rendered(vec![
            result(Some("c2"), "Lima: fog"),
            result(Some("c1"), "Paris: sun")
        ]),
        in_order
    );
    assert_eq!(
        rendered(vec![
            result(Some("c1"), "Paris: sun"),
            result(Some("c2"), "Lima: fog")
        ]),
        in_order
    );
    // Without ids (or with ids that do not match one call each): as given.
    assert_eq!(
        rendered(vec![result(None, "Lima: fog"), result(None, "Paris: sun")]),
        "<｜end▁of▁sentence｜><｜User｜><tool_result>Lima: fog</tool_result>\n\n\
         <tool_result>Paris: sun</tool_result><｜Assistant｜></think>"
    );
    assert_eq!(
        rendered(vec![
            result(Some("c2"), "Lima: fog"),
            result(Some("c2"), "Paris: sun")
        ]),
        "<｜end▁of▁sentence｜><｜User｜><tool_result>Lima: fog</tool_result>\n\n\
         <tool_result>Paris: sun</tool_result><｜Assistant｜></think>"
    );
}
