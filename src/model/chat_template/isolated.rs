//! Chat templates rendered in child processes.
//!
//! A chat template ships with the checkpoint and is a program. Fuel, a recursion limit, an
//! output limit and a large stack ([`super::limits`]) stop the runaway ones, but not every
//! template written to exhaust the machine: `{% set ns.s = ns.s ~ ns.s %}` in a loop doubles
//! a string forty times in a few instructions, and filters such as `indent` do work the fuel
//! does not count. So the server renders in worker processes (this program, run as
//! `moe-node chat-template-worker`: [`crate::model::template_worker`]) that live under an
//! address-space limit and a deadline: a render that exhausts either kills its worker, the
//! request gets an error saying what happened, and the next render starts a fresh worker.
//!
//! The protocol is one JSON line each way on the worker's stdin and stdout: first the
//! template (`{"source", "bos_token", "eos_token"}`), then per render the conversation
//! (`{"messages", "tools"}`), answered by `{"text": ...}` or `{"error": ...}`. A worker
//! exits at the end of its input, so workers end with the server (under systemd,
//! `KillMode=control-group` also stops one that is mid-render). This module is the server's
//! side and needs only the conversation type and the limits, not the template itself.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, mpsc};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::input::ChatInput;
use super::limits::{MAX_OUTPUT_BYTES, RENDER_STACK_BYTES};

/// The subcommand that runs a worker.
pub const WORKER_SUBCOMMAND: &str = "chat-template-worker";
/// Longest a render may take. Fuel ends a runaway template within a second; this catches
/// work the fuel does not count.
pub const RENDER_DEADLINE: Duration = Duration::from_secs(10);
/// A worker's address space: the render thread's reserved stack, and room for the program,
/// the output limit and the values a template builds.
pub const WORKER_ADDRESS_SPACE_BYTES: u64 = RENDER_STACK_BYTES as u64 + (768 << 20);
/// Longest reply line a worker may send: the output limit with every byte escaped.
const MAX_REPLY_BYTES: u64 = MAX_OUTPUT_BYTES as u64 * 6 + 1024;

/// The first line a worker reads: the template it renders.
#[derive(Serialize, Deserialize)]
pub(in crate::model) struct Setup {
    pub(in crate::model) source: String,
    pub(in crate::model) bos_token: String,
    pub(in crate::model) eos_token: String,
}

/// A worker's answer to one render.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(in crate::model) enum Reply {
    Text(String),
    Error(String),
}

/// Renders a template in worker processes; workers are started on demand, one per render
/// running at once, and kept for the next render.
pub struct IsolatedRenderer {
    exe: PathBuf,
    setup: String,
    deadline: Duration,
    idle: Mutex<Vec<Worker>>,
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    replies: mpsc::Receiver<std::io::Result<String>>,
}

impl Worker {
    fn send(&mut self, line: &str) -> std::io::Result<()> {
        writeln!(self.stdin, "{line}")?;
        self.stdin.flush()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl IsolatedRenderer {
    pub fn new(exe: PathBuf, source: &str, bos_token: &str, eos_token: &str) -> Self {
        let setup = serde_json::to_string(&Setup {
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
        .expect("strings serialise");
        IsolatedRenderer {
            exe,
            setup,
            deadline: RENDER_DEADLINE,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Stops renders at `deadline` instead of [`RENDER_DEADLINE`].
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    pub fn render(&self, chat: &ChatInput) -> Result<String, String> {
        let idle = self.idle.lock().map(|mut idle| idle.pop());
        let mut worker = match idle {
            Ok(Some(worker)) => worker,
            _ => self.start()?,
        };
        let request = serde_json::to_string(chat).expect("strings serialise");
        if worker.send(&request).is_err() {
            // A worker that died while idle: one fresh attempt.
            worker = self.start()?;
            worker
                .send(&request)
                .map_err(|e| format!("cannot reach the chat template's worker process: {e}"))?;
        }
        let line = match worker.replies.recv_timeout(self.deadline) {
            Ok(Ok(line)) => line,
            Ok(Err(e)) => return Err(format!("the chat template's worker process failed: {e}")),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(format!(
                    "the chat template ran over {:.1} s and was stopped",
                    self.deadline.as_secs_f32()
                ));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = worker
                    .child
                    .wait()
                    .map(|s| s.to_string())
                    .unwrap_or_else(|e| e.to_string());
                tracing::warn!(%status, "a chat template worker process died during a render");
                return Err(format!(
                    "the chat template exhausted its worker process ({status}): it nests or \
                     builds values beyond the limits a render runs under"
                ));
            }
        };
        let reply: Reply = serde_json::from_str(&line)
            .map_err(|e| format!("the chat template's worker process replied badly: {e}"))?;
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(worker);
        }
        match reply {
            Reply::Text(text) => Ok(text),
            Reply::Error(error) => Err(error),
        }
    }

    fn start(&self) -> Result<Worker, String> {
        let cannot = |e: std::io::Error| {
            format!(
                "cannot start a chat template worker process ({} {WORKER_SUBCOMMAND}): {e}",
                self.exe.display()
            )
        };
        let mut child = Command::new(&self.exe)
            .arg(WORKER_SUBCOMMAND)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(cannot)?;
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err("a chat template worker process started without pipes".into());
        };
        writeln!(stdin, "{}", self.setup).map_err(cannot)?;
        let (send, replies) = mpsc::channel();
        std::thread::Builder::new()
            .name("chat-template-reader".into())
            .spawn(move || {
                let mut stdout = BufReader::new(stdout);
                loop {
                    let mut line = String::new();
                    match (&mut stdout).take(MAX_REPLY_BYTES).read_line(&mut line) {
                        Ok(0) => return,
                        Ok(_) if !line.ends_with('\n') => {
                            let _ = send.send(Err(std::io::Error::other("reply too long")));
                            return;
                        }
                        Ok(_) => {
                            if send.send(Ok(line)).is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            let _ = send.send(Err(e));
                            return;
                        }
                    }
                }
            })
            .map_err(cannot)?;
        Ok(Worker {
            child,
            stdin,
            replies,
        })
    }
}
