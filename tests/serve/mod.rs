//! A `moe-node serve` process for the integration tests: started with its log captured, its
//! HTTP address read from the log once it listens, killed when dropped.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use reqwest::blocking::{Client, Response};
use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_moe-node");

pub struct Process {
    pub child: Child,
    /// `http://ADDR` (or `https://ADDR`) of its API.
    pub base: String,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Process {
    /// `moe-node serve --listen 127.0.0.1:0 ARGS...`, waiting until it listens.
    pub fn serve(args: &[&std::ffi::OsStr]) -> Process {
        Process::serve_with_env(args, &[])
    }

    /// As [`Process::serve`], with `env` added to the environment.
    pub fn serve_with_env(args: &[&OsStr], env: &[(&str, &OsStr)]) -> Process {
        let mut all = vec![
            OsStr::new("serve"),
            OsStr::new("--listen"),
            OsStr::new("127.0.0.1:0"),
        ];
        all.extend(args);
        Process::start_with_env(&all, env)
    }

    /// `moe-node ARGS...` (a command that serves HTTP and logs where), waiting until it
    /// listens.
    pub fn start(args: &[&std::ffi::OsStr]) -> Process {
        Process::start_with_env(args, &[])
    }

    /// As [`Process::start`], with `env` added to the environment.
    pub fn start_with_env(args: &[&OsStr], env: &[(&str, &OsStr)]) -> Process {
        Process::start_under(&[], args, env)
    }

    /// `moe-node ARGS...` run by the command `under` names (e.g. `ip netns exec NS`, which
    /// execs it: the child is the node itself), waiting until it listens.
    pub fn start_under(under: &[&OsStr], args: &[&OsStr], env: &[(&str, &OsStr)]) -> Process {
        let mut command = match under.split_first() {
            Some((program, rest)) => {
                let mut command = Command::new(program);
                command.args(rest).arg(BIN);
                command
            }
            None => Command::new(BIN),
        };
        let mut child = command
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                for scheme in ["http", "https"] {
                    if let Some(rest) = line.split(&format!("listening on {scheme}://")).nth(1) {
                        let addr = rest.split_whitespace().next().unwrap_or_default();
                        let _ = addr_tx.send(format!("{scheme}://{addr}"));
                    }
                }
                lines.lock().unwrap().push(line);
            }
        });
        let base = addr_rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("server did not start: {:?}", log.lock().unwrap()));
        Process { child, base, log }
    }

    pub fn log_lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    pub fn log_contains(&self, needle: &str) -> bool {
        self.log.lock().unwrap().iter().any(|l| l.contains(needle))
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // A failing test shows the end of each node's log with its failure (the harness
        // prints what a failed test wrote).
        if std::thread::panicking() {
            let lines = self.log_lines();
            let tail = &lines[lines.len().saturating_sub(80)..];
            eprintln!(
                "--- last {} log lines of the node at {} ---\n{}",
                tail.len(),
                self.base,
                tail.join("\n")
            );
        }
        // A paused process would not die of SIGKILL before it is waited on otherwise.
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The resident memory of process `pid`, in KiB (0 once it is gone).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The demo model, written once for all tests of this binary.
pub fn demo_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| demo_model_variant("demo-model", &[]))
}

/// The demo model under `name` in this binary's temporary directory with `template` as its
/// chat template (its other files linked).
pub fn demo_model_with_template(name: &str, template: &str) -> PathBuf {
    let demo = demo_model();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        let link = dir.join(file);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(demo.join(file), &link).unwrap();
    }
    std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
    dir
}

/// A chat template that opens the `<think>` block in thinking mode (`chat_template_kwargs`
/// `thinking`), as DeepSeek-V3.1 to V4 do, and renders an assistant's reasoning sent back.
pub const THINKING_TEMPLATE: &str = "{%- for m in messages -%}\
    <|im_start|>{{ m.role }}\n\
    {%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif -%}\
    {{ m.content }}<|im_end|>\n\
    {%- endfor -%}\
    <|im_start|>assistant\n\
    {%- if thinking is defined and thinking %}<think>\n{% else %}</think>{% endif -%}";

/// The demo model written by `moe-node demo-model <args>` under `name` in this binary's
/// temporary directory, once (a lock keeps two tests from writing one at the same time).
pub fn demo_model_variant(name: &str, args: &[&str]) -> PathBuf {
    static WRITING: Mutex<()> = Mutex::new(());
    let _one_writer = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    if !dir.join("config.json").exists() {
        let status = Command::new(BIN)
            .arg("demo-model")
            .args(args)
            .arg("--out")
            .arg(&dir)
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
    } else {
        // Written by an earlier build: its chat template may be older.
        moe_node::model::demo::refresh_demo_tokenizer(&dir).unwrap();
    }
    dir
}

/// The engine's logits after `prompt` (token ids), from `moe-node generate` on the CPU
/// with the demo model.
#[allow(dead_code)]
pub fn engine_last_logits(prompt: &[impl ToString]) -> Vec<f64> {
    let prompt_ids: Vec<String> = prompt.iter().map(ToString::to_string).collect();
    let out = Command::new(BIN)
        .args(["generate", "--model", demo_model().to_str().unwrap()])
        .args(["--prompt-ids", &prompt_ids.join(",")])
        .args(["--max-tokens", "1", "--json"])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success());
    let value: Value = serde_json::from_slice(&out.stdout).unwrap();
    value["last_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_f64().unwrap())
        .collect()
}

pub struct Server {
    pub process: Process,
    pub base: String,
    pub client: Client,
    pub key: Option<String>,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Starts `moe-node serve` with `config` (TOML) and waits until it listens.
    pub fn start(config: &str) -> Server {
        Self::start_with(config, &["--model", demo_model().to_str().unwrap()])
    }

    pub fn start_with(config: &str, args: &[&str]) -> Server {
        Self::start_with_env(config, args, &[])
    }

    /// As [`Server::start_with`], with `env` added to the environment.
    pub fn start_with_env(config: &str, args: &[&str], env: &[(&str, &OsStr)]) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let config_path = dir.path().join("moe-node.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut all: Vec<&OsStr> = vec![OsStr::new("--config"), config_path.as_os_str()];
        all.extend(args.iter().map(OsStr::new));
        let mut serve = vec![
            OsStr::new("serve"),
            OsStr::new("--listen"),
            OsStr::new("127.0.0.1:0"),
        ];
        serve.extend(all);
        let process = Process::start_with_env(&serve, env);
        let key = config
            .lines()
            .find_map(|l| l.strip_prefix("api_keys = [\""))
            .and_then(|rest| rest.split('"').next())
            .map(str::to_string);
        Server {
            base: process.base.clone(),
            process,
            // Longer than the server's own limits (a cluster rebalance waits up to 120 s for
            // its members), so that a test sees the server's error rather than its own.
            client: Client::builder()
                .timeout(Duration::from_secs(180))
                .build()
                .unwrap(),
            key,
            _dir: dir,
        }
    }

    /// The configuration file the server was started with (a test may rewrite it).
    pub fn config_path(&self) -> PathBuf {
        self._dir.path().join("moe-node.toml")
    }

    /// Sends the server SIGHUP (what `systemctl reload` does).
    pub fn hang_up(&self) {
        let status = Command::new("kill")
            .args(["-HUP", &self.process.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Log lines containing `needle`.
    pub fn count_log(&self, needle: &str) -> usize {
        self.process
            .log_lines()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if self.get("/ready").status() == StatusCode::OK {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("not ready in time: {:?}", self.process.log_lines());
    }

    pub fn get(&self, path: &str) -> Response {
        let mut req = self.client.get(format!("{}{path}", self.base));
        if let Some(key) = &self.key {
            req = req.bearer_auth(key);
        }
        req.send().unwrap()
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        let mut req = self.client.post(format!("{}{path}", self.base)).json(body);
        if let Some(key) = &self.key {
            req = req.bearer_auth(key);
        }
        req.send().unwrap()
    }

    pub fn post_ok(&self, path: &str, body: &Value) -> Value {
        let resp = self.post(path, body);
        let status = resp.status();
        let body: Value = resp.json().unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        body
    }

    pub fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").text().unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
            .trim()
            .parse()
            .unwrap()
    }

    /// Waits (a little) for a line the server logs from another thread.
    pub fn wait_for_log(&self, needle: &str) {
        self.wait_for_log_within(needle, 10);
    }

    /// Waits up to `seconds` for a line the server logs.
    pub fn wait_for_log_within(&self, needle: &str, seconds: u64) {
        let deadline = Instant::now() + Duration::from_secs(seconds);
        while !self.log_contains(needle) {
            assert!(
                Instant::now() < deadline,
                "{needle:?} not logged: {:?}",
                self.process.log_lines()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_contains(&self, needle: &str) -> bool {
        self.process.log_contains(needle)
    }
}

/// Reads a server-sent event stream to its end: the JSON of every `data:` line, and
/// whether it ended with `data: [DONE]`.
pub fn read_sse(resp: Response) -> (Vec<Value>, bool) {
    assert_eq!(resp.status(), StatusCode::OK);
    let content_type = resp.headers()["content-type"].to_str().unwrap().to_string();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let mut events = Vec::new();
    let mut done = false;
    for line in BufReader::new(resp).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            assert!(line.is_empty(), "unexpected line {line:?}");
            continue;
        };
        assert!(!done, "data after [DONE]");
        if data == "[DONE]" {
            done = true;
        } else {
            events.push(serde_json::from_str(data).unwrap());
        }
    }
    (events, done)
}

/// Generated ids of a streamed completion with `return_token_ids`.
pub fn streamed_ids(events: &[Value]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| e["choices"].get(0))
        .filter_map(|c| c["token_ids"].as_array())
        .flatten()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

pub fn ids(value: &Value) -> Vec<u64> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

pub fn assert_envelope(resp: Response, status: StatusCode, message_part: &str) -> Value {
    assert_eq!(resp.status(), status);
    let body: Value = resp.json().unwrap();
    let error = &body["error"];
    for field in ["message", "type", "param", "code"] {
        assert!(error.get(field).is_some(), "{field} missing: {body}");
    }
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains(message_part),
        "{message_part:?} not in {message:?}"
    );
    body
}
