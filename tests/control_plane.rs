//! `moe-node control-plane` and nodes peering with it, as real processes on loopback: the
//! desired state reaches running nodes, nodes keep serving without the control plane, the
//! control plane keeps its state over a restart, and wrong credentials are refused on both
//! sides.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

use moe_node::control_plane::wire::sha256_hex;
use reqwest::StatusCode;
use reqwest::blocking::Client;
use serde_json::{Value, json};

mod serve;
use serve::{Process, Server};

const NODE_TOKEN: &str = "node-token-0123456789";
const ADMIN_TOKEN: &str = "admin-token-0123456789";

/// A `moe-node control-plane` process; killed when dropped.
struct ControlPlane {
    process: Process,
    base: String,
}

impl ControlPlane {
    /// Writes its config into `dir` (database there too) and starts it on `listen`.
    fn start(dir: &Path, listen: &str) -> ControlPlane {
        let config = dir.join("control-plane.toml");
        std::fs::write(
            &config,
            format!(
                "listen = \"{listen}\"\ndatabase = \"{}\"\nnode_token_sha256 = [\"{}\"]\n\
                 admin_token_sha256 = [\"{}\"]\nstale_after_seconds = 2\nhistory_per_node = 5\n",
                dir.join("state.db").display(),
                sha256_hex(NODE_TOKEN),
                sha256_hex(ADMIN_TOKEN),
            ),
        )
        .unwrap();
        let process = Process::start(&[
            OsStr::new("control-plane"),
            OsStr::new("--config"),
            config.as_os_str(),
        ]);
        ControlPlane {
            base: process.base.clone(),
            process,
        }
    }

    fn addr(&self) -> &str {
        self.base.trim_start_matches("http://")
    }

    fn wait_for_log(&self, needle: &str) {
        wait_until(&format!("control plane logs {needle:?}"), || {
            self.process.log_contains(needle)
        });
    }

    fn admin(
        &self,
        client: &Client,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut req = client
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(ADMIN_TOKEN);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req.send().unwrap();
        let status = resp.status();
        (status, resp.json().unwrap_or(Value::Null))
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A node (demo model, CPU) peering with the control plane at `url` under name `node`.
fn node(url: &str, token: &str, node: &str) -> Server {
    let server = Server::start(&format!(
        "[server]\napi_keys = [\"local-key\"]\n[devices]\nbackend = \"cpu\"\n\
         [control_plane]\nurl = \"{url}\"\ntoken = \"{token}\"\ncluster = \"c1\"\n\
         node_name = \"{node}\"\nheartbeat_seconds = 1\n"
    ));
    server.wait_ready();
    server
}

fn models(server: &Server, key: &str) -> StatusCode {
    server
        .client
        .get(format!("{}/v1/models", server.base))
        .bearer_auth(key)
        .send()
        .unwrap()
        .status()
}

fn node_status(cp: &ControlPlane, client: &Client, node: &str) -> Value {
    let (status, body) = cp.admin(client, reqwest::Method::GET, "/api/v1/clusters", None);
    assert_eq!(status, StatusCode::OK, "{body}");
    body["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["name"] == "c1")
        .flat_map(|c| c["nodes"].as_array().unwrap().clone())
        .find(|n| n["node"] == node)
        .unwrap_or(Value::Null)
}

#[test]
fn a_key_set_at_the_control_plane_reaches_a_running_node_which_keeps_serving_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let client = Client::new();
    let cp = ControlPlane::start(dir.path(), "127.0.0.1:0");
    let listen = cp.addr().to_string();
    let server = node(&cp.base, NODE_TOKEN, "n1");
    cp.wait_for_log("node registered");
    server.wait_for_log("registered with the control plane");
    assert_eq!(models(&server, "cp-key"), StatusCode::UNAUTHORIZED);

    // A new key, set at the control plane, is accepted by the running node.
    let (status, desired) = cp.admin(
        &client,
        reqwest::Method::PUT,
        "/api/v1/clusters/c1/desired",
        Some(json!({"api_keys": ["cp-key"], "rebalance_interval_seconds": 0})),
    );
    assert_eq!(status, StatusCode::OK, "{desired}");
    assert_eq!(desired["version"], 1);
    assert_eq!(desired["api_key_sha256"], json!([sha256_hex("cp-key")]));
    assert!(
        !desired.to_string().contains("\"cp-key\""),
        "stored hashed only: {desired}"
    );
    wait_until("the node accepts the new key", || {
        models(&server, "cp-key") == StatusCode::OK
    });
    assert_eq!(models(&server, "local-key"), StatusCode::OK);
    assert_eq!(models(&server, "other-key"), StatusCode::UNAUTHORIZED);

    // The control plane shows the node's report, and its status page names it.
    wait_until("the node reports the desired version it applied", || {
        node_status(&cp, &client, "n1")["report"]["desired_version"] == 1
    });
    let shown = node_status(&cp, &client, "n1");
    assert_eq!(shown["status"], "reporting", "{shown}");
    assert_eq!(shown["report"]["phase"], "ready", "{shown}");
    assert_eq!(shown["report"]["devices_up"], 2, "{shown}");
    let page = client.get(&cp.base).send().unwrap().text().unwrap();
    assert!(page.contains("<td>n1</td><td>reporting</td>"), "{page}");
    assert!(
        !page.contains(&sha256_hex("cp-key")),
        "no key hashes on the page"
    );

    // Killed, the control plane is missed, but the node serves on what it last knew.
    drop(cp);
    server.wait_for_log("serving on the last known state");
    assert_eq!(models(&server, "cp-key"), StatusCode::OK);
    // (The test client's own key is the configured local-key.)
    let completion = server.post_ok(
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 2}),
    );
    assert_eq!(completion["usage"]["completion_tokens"], 2, "{completion}");
    assert_eq!(server.get("/ready").status(), StatusCode::OK);

    // Started again on its address, it has kept everything; the node comes back to it.
    let cp = ControlPlane::start(dir.path(), &listen);
    let (status, desired) = cp.admin(
        &client,
        reqwest::Method::GET,
        "/api/v1/clusters/c1/desired",
        None,
    );
    assert_eq!(status, StatusCode::OK);
    assert_eq!(desired["version"], 1);
    assert_eq!(desired["api_key_sha256"], json!([sha256_hex("cp-key")]));
    assert_eq!(node_status(&cp, &client, "n1")["node"], "n1");
    server.wait_for_log("the control plane answers again");
    let (_, history) = cp.admin(
        &client,
        reqwest::Method::GET,
        "/api/v1/clusters/c1/nodes/n1/history",
        None,
    );
    assert!(
        (1..=5).contains(&history.as_array().unwrap().len()),
        "history_per_node = 5 bounds it: {history}"
    );

    // A node not heard from is stale, not dead.
    drop(server);
    wait_until("the stopped node is shown stale", || {
        node_status(&cp, &client, "n1")["status"] == "stale"
    });
    let page = client.get(&cp.base).send().unwrap().text().unwrap();
    assert!(page.contains("<td>n1</td><td>stale</td>"), "{page}");
}

/// A stand-in control plane that answers every request 200 with a desired state (a key it
/// wants accepted) but cannot prove it knows the node's token.
fn impostor() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request = Vec::new();
            let mut buffer = [0u8; 4096];
            // Headers, then as much body as Content-Length says.
            while let Ok(n) = stream.read(&mut buffer) {
                if n == 0 {
                    break;
                }
                request.extend_from_slice(&buffer[..n]);
                let text = String::from_utf8_lossy(&request).to_string();
                if let Some(end) = text.find("\r\n\r\n") {
                    let length = text
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    if request.len() >= end + 4 + length {
                        break;
                    }
                }
            }
            let body =
                json!({"desired": {"version": 7, "api_key_sha256": [sha256_hex("evil-key")]}})
                    .to_string();
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    format!("http://{addr}")
}

#[test]
fn wrong_credentials_are_refused_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let client = Client::new();
    let cp = ControlPlane::start(dir.path(), "127.0.0.1:0");

    // A node with a token the control plane does not know: refused, and both say so.
    let intruder = node(&cp.base, "not-the-node-token-42", "intruder");
    cp.wait_for_log("refused a request: the bearer token is not a known node token");
    intruder.wait_for_log("refused this node's token (401 Unauthorized)");
    assert!(node_status(&cp, &client, "intruder").is_null());
    assert_eq!(
        models(&intruder, "local-key"),
        StatusCode::OK,
        "it serves regardless"
    );

    // A wrong admin token cannot change the desired state.
    let resp = client
        .put(format!("{}/api/v1/clusters/c1/desired", cp.base))
        .bearer_auth(NODE_TOKEN)
        .json(&json!({"api_keys": ["sneaky"]}))
        .send()
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    cp.wait_for_log("not a known admin token");

    // A control plane that cannot prove it knows the node's token is not obeyed.
    let fake = impostor();
    let fooled = node(&fake, NODE_TOKEN, "n2");
    fooled.wait_for_log("does not prove it knows this node's token");
    assert_eq!(models(&fooled, "evil-key"), StatusCode::UNAUTHORIZED);
    assert_eq!(models(&fooled, "local-key"), StatusCode::OK);
}
