//! The worker process's side of the isolated chat template renders (the server's side, and
//! why, are in `chat_template/isolated.rs`): run as `moe-node chat-template-worker`, it limits
//! its own address space, then renders each conversation it reads on stdin.

use std::io::{BufRead, BufReader, Read, Write};

pub use super::chat_template::isolated::{
    IsolatedRenderer, RENDER_DEADLINE, WORKER_ADDRESS_SPACE_BYTES, WORKER_SUBCOMMAND,
};
use super::chat_template::isolated::{Reply, Setup};
use super::chat_template::{ChatInput, ChatTemplate};

/// The worker's side: limits itself, then renders each request from `input` until it ends.
pub fn serve(input: impl Read, mut output: impl Write) -> Result<(), String> {
    limit_address_space(WORKER_ADDRESS_SPACE_BYTES)?;
    let mut input = BufReader::new(input);
    let mut line = String::new();
    input
        .read_line(&mut line)
        .map_err(|e| format!("reading the template: {e}"))?;
    let setup: Setup =
        serde_json::from_str(&line).map_err(|e| format!("the template line is not valid: {e}"))?;
    let template = ChatTemplate::new(setup.source, setup.bos_token, setup.eos_token)?;
    loop {
        line.clear();
        match input.read_line(&mut line) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) => return Err(format!("reading a request: {e}")),
        }
        let reply = match serde_json::from_str::<ChatInput>(&line) {
            Ok(chat) => match template.render_in_process(&chat) {
                Ok(text) => Reply::Text(text),
                Err(error) => Reply::Error(error),
            },
            Err(e) => Reply::Error(format!("the request is not valid: {e}")),
        };
        let reply = serde_json::to_string(&reply).expect("strings serialise");
        writeln!(output, "{reply}")
            .and_then(|()| output.flush())
            .map_err(|e| format!("writing a reply: {e}"))?;
    }
}

fn limit_address_space(bytes: u64) -> Result<(), String> {
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    // SAFETY: setrlimit reads the struct it is given, which lives through the call.
    let failed = unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) } != 0;
    if failed {
        return Err(format!(
            "cannot limit the worker's address space: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}
