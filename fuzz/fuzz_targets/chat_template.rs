//! Chat templates as a checkpoint ships them (hostile ones included), rendered with the
//! limits the node sets: fuel, recursion depth and output size. Input: the template source,
//! the line `--8<--`, then messages as `role: content` lines. The render runs in process on
//! its own large-stack thread, as in the node's template worker processes (which add a
//! memory limit and a deadline that libFuzzer's `-rss_limit_mb` and `-timeout` stand for).
#![no_main]

use libfuzzer_sys::fuzz_target;
use moe_node::model::chat_template::{ChatMessage, ChatTemplate};

const SEPARATOR: &str = "\n--8<--\n";

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (source, messages) = text.split_once(SEPARATOR).unwrap_or((text, "user: hi"));
    let messages: Vec<ChatMessage> = messages
        .lines()
        .map(|line| {
            let (role, content) = line.split_once(": ").unwrap_or(("user", line));
            ChatMessage::new(role, content)
        })
        .collect();
    let Ok(template) = ChatTemplate::new(source.into(), "<s>".into(), "</s>".into()) else {
        return;
    };
    // Errors are expected (a template may raise, run out of fuel, ...); panics are not.
    let _ = template.render(&messages.into());
});
