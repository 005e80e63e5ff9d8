//! A cluster of real `moe-node serve` processes for the integration tests: their configs,
//! starting, killing and restarting them, and reading what a client and an operator see.
//! Shared by the cluster, gateway, hub, partition and trace tests.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use reqwest::blocking::{Client, Response};
use serde_json::{Value, json};

use super::common;
use super::serve::{BIN, Process};

pub const SECRET: &str = "cluster-test-secret-0123456789";

/// A DeepSeek-V3-shaped checkpoint: 16 routed experts, top-4, a shared expert.
pub fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v3")
}

pub fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Node {
    pub name: String,
    pub process: Process,
    pub base: String,
    pub client: Client,
    pub config_path: PathBuf,
    pub model: PathBuf,
}

/// How the nodes of one test cluster are configured.
pub struct ClusterSpec {
    pub gossip_ports: Vec<u16>,
    pub dir: tempfile::TempDir,
    /// How long a dead node keeps its share before its copies are made again.
    pub rereplicate_after_ms: u64,
    /// `peer.transport` of every node.
    pub transport: Transport,
}

/// The peer transport a test cluster runs over.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Transport {
    Tcp,
    Ucx,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Ucx => "ucx",
        }
    }

    /// Whether the test can run: UCX variants need libucp (SKIPPED without it, unless
    /// `MOE_TEST_REQUIRE_UCX=1`).
    pub fn available(self) -> bool {
        if self == Transport::Tcp {
            return true;
        }
        match moe_node::transport::ucx::Library::load(None, true) {
            Ok(_) => true,
            Err(why) => {
                assert!(
                    std::env::var("MOE_TEST_REQUIRE_UCX").as_deref() != Ok("1"),
                    "MOE_TEST_REQUIRE_UCX=1 but UCX does not load: {why}"
                );
                common::skipped(&format!("the UCX variant needs libucp: {why}"));
                false
            }
        }
    }
}

impl ClusterSpec {
    pub fn new(nodes: usize, transport: Transport) -> Self {
        ClusterSpec {
            gossip_ports: (0..nodes).map(|_| free_udp_port()).collect(),
            dir: tempfile::tempdir().unwrap(),
            // Longer than any test takes: a killed node keeps its share until restarted.
            rereplicate_after_ms: 600_000,
            transport,
        }
    }

    /// The config of node `i`; `secret` and `extra` let a test make a misfit.
    pub fn config(&self, i: usize, node_id: &str, secret: &str, gossip_port: u16) -> PathBuf {
        let seeds: Vec<String> = self
            .gossip_ports
            .iter()
            .filter(|&&p| p != gossip_port)
            .map(|p| format!("\"127.0.0.1:{p}\""))
            .collect();
        let text = format!(
            "[devices]\nbackend = \"cpu\"\ncpu_slots = 1\n\
             [batching]\nmax_sequences = 32\n\
             [cluster]\nnode_id = \"{node_id}\"\nsecrets = [\"{secret}\"]\n\
             gossip_listen = \"127.0.0.1:{gossip_port}\"\npeer_listen = \"127.0.0.1:0\"\n\
             seeds = [{}]\nexpect_nodes = 3\nreplication = 2\n\
             probe_period_ms = 200\nsuspicion_timeout_ms = 2000\nhedge_after_ms = 100\n\
             join_timeout_seconds = 4\nrereplicate_after_ms = {}\n\
             [peer]\ntransport = \"{}\"\n",
            seeds.join(", "),
            self.rereplicate_after_ms,
            self.transport.name()
        );
        let path = self.dir.path().join(format!("node{i}-{node_id}.toml"));
        std::fs::write(&path, text).unwrap();
        path
    }

    /// The name and config of node `i` of a cluster where each expert has one copy (each
    /// node holds its share alone, so a step calls the other nodes), `extra` appended.
    pub fn one_copy_config(&self, i: usize, extra: &str) -> (String, PathBuf) {
        let name = format!("node{}", i + 1);
        let config = self.config(i, &name, SECRET, self.gossip_ports[i]);
        let nodes = format!("expect_nodes = {}", self.gossip_ports.len());
        let text = std::fs::read_to_string(&config)
            .unwrap()
            .replace("expect_nodes = 3", &nodes)
            .replace("replication = 2", "replication = 1")
            + extra;
        std::fs::write(&config, text).unwrap();
        (name, config)
    }

    pub fn start(&self, i: usize) -> Node {
        let name = format!("node{}", i + 1);
        let config = self.config(i, &name, SECRET, self.gossip_ports[i]);
        Node::start(&name, config, model())
    }
}

impl Node {
    pub fn start(name: &str, config_path: PathBuf, model: PathBuf) -> Node {
        Node::start_with_env(name, config_path, model, &[])
    }

    /// As [`Node::start`], with `env` added to the node's environment.
    pub fn start_with_env(
        name: &str,
        config_path: PathBuf,
        model: PathBuf,
        env: &[(&str, &OsStr)],
    ) -> Node {
        let process = Process::serve_with_env(
            &[
                OsStr::new("--config"),
                config_path.as_os_str(),
                OsStr::new("--model"),
                model.as_os_str(),
            ],
            env,
        );
        Node {
            name: name.to_string(),
            base: process.base.clone(),
            process,
            client: Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap(),
            config_path,
            model,
        }
    }

    /// The same node again, after it died: same config, same gossip address.
    pub fn restart(&mut self) {
        let _ = self.process.child.wait();
        let again = Node::start(&self.name, self.config_path.clone(), self.model.clone());
        *self = again;
    }

    /// GET `path`, once more if the first try finds its kept-alive connection closed (a
    /// node resumed after a pause closes the connections that idled past its keep-alive).
    pub fn get(&self, path: &str) -> Response {
        let url = format!("{}{path}", self.base);
        self.client
            .get(&url)
            .send()
            .or_else(|_| self.client.get(&url).send())
            .unwrap()
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        self.client
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .unwrap()
    }

    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(90);
        while Instant::now() < deadline {
            if self.get("/ready").status() == StatusCode::OK {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{} not ready in time: {:?}", self.name, self.log());
    }

    pub fn log(&self) -> Vec<String> {
        self.process.log_lines()
    }

    /// A counter or gauge summed over all its series.
    pub fn metric_sum(&self, name: &str) -> f64 {
        let text = self.get("/metrics").text().unwrap();
        text.lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    pub fn cluster(&self) -> Value {
        self.get("/admin/cluster").json().unwrap()
    }

    /// State of `node` as this node's gossip sees it (its newest entry).
    pub fn member_state(&self, node: &str) -> Option<String> {
        let cluster = self.cluster();
        let members = cluster["members"].as_array()?.clone();
        let rank = |s: &str| match s {
            "alive" => 2,
            "suspect" => 1,
            _ => 0,
        };
        members
            .iter()
            .filter(|m| m["node"] == node)
            .map(|m| m["state"].as_str().unwrap().to_string())
            .max_by_key(|s| rank(s))
    }

    pub fn wait_member_state(&self, node: &str, state: &str, within: Duration) {
        self.wait_until(within, &format!("saw {node} {state}"), || {
            self.member_state(node).as_deref() == Some(state)
        });
    }

    /// Polls `done` until it holds; fails naming `what` and showing /admin/cluster.
    pub fn wait_until(&self, within: Duration, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + within;
        while !done() {
            assert!(
                Instant::now() < deadline,
                "{} never {what}: {}",
                self.name,
                self.cluster()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        let _ = self.process.child.kill();
        let _ = self.process.child.wait();
    }

    /// This node's own entry in /admin/cluster.
    pub fn me(&self) -> Value {
        let cluster = self.cluster();
        cluster["members"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["self"] == true)
            .unwrap()
            .clone()
    }

    pub fn placement(&self) -> Value {
        self.get("/admin/placement").json().unwrap()
    }

    pub fn wait_placement_version(&self, version: u64, within: Duration) {
        self.wait_until(within, &format!("served placement {version}"), || {
            self.placement()["version"] == version
        });
    }

    /// Waits until the node's devices hold exactly what its placement gives it (a change
    /// of placement ends with the experts placed elsewhere let go).
    pub fn wait_holds_its_share(&self, within: Duration) -> f64 {
        let deadline = Instant::now() + within;
        loop {
            let placement = self.placement();
            let share = placement["layers"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|l| l["experts"].as_array().unwrap())
                .filter(|replicas| {
                    replicas
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|r| r["node"] == self.name.as_str())
                })
                .count() as f64;
            let held = self.metric_sum("moe_node_device_experts");
            if held == share {
                return held;
            }
            assert!(
                Instant::now() < deadline,
                "{} holds {held} experts, its share is {share}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.process.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

/// Greedy tokens of one node alone, for `prompt`.
pub fn generate_alone(prompt: &[u32], max_tokens: usize) -> Vec<u64> {
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let out = Command::new(BIN)
        .arg("generate")
        .arg("--model")
        .arg(model())
        .args(["--prompt-ids", &ids.join(",")])
        .args(["--max-tokens", &max_tokens.to_string(), "--json"])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success());
    let value: Value = serde_json::from_slice(&out.stdout).unwrap();
    value["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

pub fn completion(node: &Node, prompt: &[u32], max_tokens: usize) -> Vec<u64> {
    let resp = node.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true,
                "return_token_ids": true, "temperature": 0}),
    );
    let status = resp.status();
    let body: Value = resp.json().unwrap();
    assert_eq!(status, StatusCode::OK, "{} answered {body}", node.name);
    body["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// Streams a completion, returning the tokens and whether the stream ended with [DONE]
/// after a final chunk with a finish reason; `started` is signalled at the first token.
pub fn stream_completion(
    base: String,
    prompt: Vec<u32>,
    max_tokens: usize,
    started: std::sync::mpsc::Sender<()>,
) -> Result<Vec<u64>, String> {
    let client = Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let resp = post_stream(&client, &base, &greedy_stream(&prompt, max_tokens))?;
    let mut tokens = Vec::new();
    let mut finished = false;
    let done = read_events(resp, |event| {
        let choice = &event["choices"][0];
        if let Some(ids) = choice["token_ids"].as_array() {
            if tokens.is_empty() && !ids.is_empty() {
                let _ = started.send(());
            }
            tokens.extend(ids.iter().map(|t| t.as_u64().unwrap()));
        }
        if choice["finish_reason"].is_string() {
            finished = true;
        }
    })?;
    if !(done && finished) {
        return Err(format!("stream cut after {} tokens", tokens.len()));
    }
    Ok(tokens)
}

/// The body of a greedy streamed completion of `prompt` that returns its token ids.
pub fn greedy_stream(prompt: &[u32], max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true,
           "return_token_ids": true, "stream": true, "temperature": 0})
}

/// Posts `body` to `base`'s `/v1/completions`: the response once it is 200, else what
/// went wrong.
pub fn post_stream(client: &Client, base: &str, body: &Value) -> Result<Response, String> {
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(body)
        .send()
        .map_err(|e| e.to_string())?;
    if response.status() != StatusCode::OK {
        let status = response.status();
        return Err(format!(
            "status {status}: {}",
            response.text().unwrap_or_default()
        ));
    }
    Ok(response)
}

/// Reads a stream's server-sent events, handing each one's JSON to `each`, until `[DONE]`
/// (`Ok(true)`) or the end of the body (`Ok(false)`); an error event or a line that does
/// not read is an `Err` naming it.
pub fn read_events(response: Response, mut each: impl FnMut(&Value)) -> Result<bool, String> {
    for line in BufReader::new(response).lines() {
        let line = line.map_err(|e| e.to_string())?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return Ok(true);
        }
        let event: Value = serde_json::from_str(data).map_err(|e| e.to_string())?;
        if event.get("error").is_some() {
            return Err(format!("error event: {event}"));
        }
        each(&event);
    }
    Ok(false)
}

/// The tokens of a greedy stream of `prompt` through `base` (a node or a gateway), or what
/// was wrong with it: a status, an error event, or a cut before `[DONE]`.
pub fn stream_tokens(
    client: &Client,
    base: &str,
    prompt: &[u32],
    max_tokens: usize,
) -> Result<Vec<u64>, String> {
    let response = post_stream(client, base, &greedy_stream(prompt, max_tokens))?;
    let mut tokens = Vec::new();
    let done = read_events(response, |event| {
        if let Some(ids) = event["choices"][0]["token_ids"].as_array() {
            tokens.extend(ids.iter().filter_map(Value::as_u64));
        }
    })?;
    if !done {
        return Err(format!("stream cut after {} tokens", tokens.len()));
    }
    Ok(tokens)
}

/// How long the test gateway waits for a ready node before it answers 503.
pub const GATEWAY_WAIT_READY: Duration = Duration::from_secs(2);

/// A `moe-node gateway` process in front of a test cluster.
pub struct Gateway {
    pub process: Process,
    pub client: Client,
    _config: PathBuf,
}

impl Gateway {
    /// A gateway that joins `spec`'s cluster through its gossip ports.
    pub fn start(spec: &ClusterSpec) -> Gateway {
        let seeds: Vec<String> = spec
            .gossip_ports
            .iter()
            .map(|p| format!("\"127.0.0.1:{p}\""))
            .collect();
        let config = spec.dir.path().join("gateway.toml");
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"127.0.0.1:0\"\n\
                 [cluster]\nnode_id = \"gateway1\"\nsecrets = [\"{SECRET}\"]\n\
                 gossip_listen = \"127.0.0.1:0\"\nseeds = [{}]\n\
                 probe_period_ms = 200\nsuspicion_timeout_ms = 2000\n\
                 [gateway]\nstall_seconds = 5\nready_poll_ms = 100\nwait_ready_seconds = {}\n",
                seeds.join(", "),
                GATEWAY_WAIT_READY.as_secs(),
            ),
        )
        .unwrap();
        let process = Process::start(&[
            OsStr::new("gateway"),
            OsStr::new("--config"),
            config.as_os_str(),
        ]);
        Gateway {
            process,
            client: Client::builder()
                .timeout(Duration::from_secs(120))
                .build()
                .unwrap(),
            _config: config,
        }
    }

    pub fn get(&self, path: &str) -> reqwest::blocking::Response {
        self.client
            .get(format!("{}{path}", self.process.base))
            .send()
            .unwrap()
    }

    /// Waits until the gateway knows `n` ready nodes.
    pub fn wait_nodes_ready(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready: Value = self.get("/ready").json().unwrap_or_default();
            if ready["nodes_ready"] == n {
                return;
            }
            assert!(Instant::now() < deadline, "the gateway sees {ready}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").text().unwrap();
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}
