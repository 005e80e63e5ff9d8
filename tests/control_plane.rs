//! `moe-node control-plane` and nodes peering with it, as real processes on loopback: the
//! desired state reaches running nodes, nodes keep serving without the control plane, the
//! control plane keeps its state over a restart, wrong credentials are refused on both
//! sides, peering works over HTTPS and mTLS (certificates made at test time) and refuses
//! the wrong certificates, and a cluster's gossip does not depend on the control plane.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use moe_node::control_plane::wire::{SaltedKey, sha256_hex};
use reqwest::StatusCode;
use reqwest::blocking::Client;
use serde_json::{Value, json};

mod serve;
use serve::{Process, Server};

mod common;

const NODE_TOKEN: &str = "node-token-0123456789";
const ADMIN_TOKEN: &str = "admin-token-0123456789";
/// An API key set at the control plane (16 characters at least).
const CP_KEY: &str = "cp-key-0123456789abcdef";

/// A `moe-node control-plane` process; killed when dropped.
struct ControlPlane {
    process: Process,
    base: String,
}

impl ControlPlane {
    /// Writes its config into `dir` (database there too) and starts it on `listen`.
    fn start(dir: &Path, listen: &str) -> ControlPlane {
        Self::start_with(dir, listen, "")
    }

    /// As [`ControlPlane::start`], with `extra` lines in its config (TLS, limits). With
    /// mTLS, `NODE_TOKEN` is good for any node (the certificate names it); without,
    /// `NODE_TOKEN` is for the nodes of cluster c1, and `tokens` adds more
    /// `[[node_tokens]]` (token, cluster, node).
    fn start_with(dir: &Path, listen: &str, extra: &str) -> ControlPlane {
        Self::start_with_tokens(dir, listen, extra, &[])
    }

    fn start_with_tokens(
        dir: &Path,
        listen: &str,
        extra: &str,
        tokens: &[(&str, &str, &str)],
    ) -> ControlPlane {
        let config = dir.join("control-plane.toml");
        let mut text = format!(
            "listen = \"{listen}\"\ndatabase = \"{}\"\n\
             admin_token_sha256 = [\"{}\"]\nstale_after_seconds = 2\nhistory_per_node = 5\n\
             {extra}\n",
            dir.join("state.db").display(),
            sha256_hex(ADMIN_TOKEN),
        );
        if extra.contains("tls_client_ca") {
            text.push_str(&format!(
                "node_token_sha256 = [\"{}\"]\n",
                sha256_hex(NODE_TOKEN)
            ));
        } else {
            for (token, cluster, node) in [(NODE_TOKEN, "c1", "")].iter().chain(tokens) {
                text.push_str(&format!(
                    "[[node_tokens]]\nsha256 = \"{}\"\ncluster = \"{cluster}\"\nnode = \"{node}\"\n",
                    sha256_hex(token)
                ));
            }
        }
        std::fs::write(&config, text).unwrap();
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
        self.base
            .trim_start_matches("https://")
            .trim_start_matches("http://")
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
    assert_eq!(models(&server, CP_KEY), StatusCode::UNAUTHORIZED);

    // A new key, set at the control plane, is accepted by the running node.
    let (status, desired) = cp.admin(
        &client,
        reqwest::Method::PUT,
        "/api/v1/clusters/c1/desired",
        Some(json!({"api_keys": [CP_KEY], "rebalance_interval_seconds": 0})),
    );
    assert_eq!(status, StatusCode::OK, "{desired}");
    assert_eq!(desired["version"], 1);
    let stored = desired["api_keys"].clone();
    let salt = stored[0]["salt"].as_str().unwrap();
    assert_eq!(
        stored[0]["sha256"],
        sha256_hex(&format!("{salt}{CP_KEY}")),
        "stored salted: {desired}"
    );
    assert!(
        !desired.to_string().contains(CP_KEY) && !desired.to_string().contains(&sha256_hex(CP_KEY)),
        "stored salted only: {desired}"
    );
    wait_until("the node accepts the new key", || {
        models(&server, CP_KEY) == StatusCode::OK
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
        !page.contains(stored[0]["sha256"].as_str().unwrap()),
        "no key hashes on the page"
    );

    // Killed, the control plane is missed, but the node serves on what it last knew.
    drop(cp);
    server.wait_for_log("serving on the last known state");
    assert_eq!(models(&server, CP_KEY), StatusCode::OK);
    // (The test client's own key is the configured local-key.)
    let completion = server.post_ok(
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 2, "ignore_eos": true}),
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
    assert_eq!(desired["api_keys"], stored);
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
            let evil = SaltedKey::new("evil-key-0123456789");
            let body = json!({"desired": {"version": 7, "api_keys": [evil]}}).to_string();
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
    assert_eq!(
        models(&fooled, "evil-key-0123456789"),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(models(&fooled, "local-key"), StatusCode::OK);
}

/// Certificates made for one test: a CA the control plane and the good nodes trust, the
/// control plane's certificate for 127.0.0.1, a node's client certificate, and a second CA
/// nobody trusts with a client certificate of its own. PEM files in `dir`.
struct Certificates {
    ca: String,
    server_certificate: String,
    server_key: String,
    client_certificate: String,
    client_key: String,
    rogue_ca: String,
    rogue_client_certificate: String,
    rogue_client_key: String,
}

impl Certificates {
    fn make(dir: &Path) -> Certificates {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair,
        };
        let write = |name: &str, pem: String| {
            let path = dir.join(name);
            std::fs::write(&path, pem).unwrap();
            path.to_str().unwrap().to_string()
        };
        let ca = |name: &str| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, name);
            let certificate = params.self_signed(&key).unwrap();
            (certificate.pem(), Issuer::new(params, key))
        };
        let leaf = |issuer: &Issuer<KeyPair>, names: &[&str], usage| {
            let key = KeyPair::generate().unwrap();
            let (uris, hosts): (Vec<&str>, Vec<&str>) =
                names.iter().partition(|n| n.starts_with("moe-node://"));
            let mut params =
                CertificateParams::new(hosts.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                    .unwrap();
            for uri in uris {
                params
                    .subject_alt_names
                    .push(rcgen::SanType::URI(uri.try_into().unwrap()));
            }
            params.extended_key_usages = vec![usage];
            let certificate = params.signed_by(&key, issuer).unwrap();
            (certificate.pem(), key.serialize_pem())
        };
        let (ca_pem, ca_issuer) = ca("moe-node test CA");
        let (rogue_pem, rogue_issuer) = ca("someone else's CA");
        let (server_pem, server_key) = leaf(
            &ca_issuer,
            &["127.0.0.1", "localhost"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        // A node's certificate names it and its cluster: moe-node://CLUSTER/NODE.
        let (client_pem, client_key) = leaf(
            &ca_issuer,
            &["n1", "moe-node://c1/n1"],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let (rogue_client_pem, rogue_client_key) = leaf(
            &rogue_issuer,
            &["moe-node://c1/n1"],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        Certificates {
            ca: write("ca.pem", ca_pem),
            server_certificate: write("server.pem", server_pem),
            server_key: write("server.key", server_key),
            client_certificate: write("client.pem", client_pem),
            client_key: write("client.key", client_key),
            rogue_ca: write("rogue-ca.pem", rogue_pem),
            rogue_client_certificate: write("rogue-client.pem", rogue_client_pem),
            rogue_client_key: write("rogue-client.key", rogue_client_key),
        }
    }
}

/// A node (demo model, CPU) peering under name `name` with `control_plane` lines for its
/// `[control_plane]` section (url, token or not, TLS files), with `env` added; not waited on.
fn node_starting(name: &str, control_plane: &str, env: &[(&str, &OsStr)]) -> Server {
    Server::start_with_env(
        &format!(
            "[server]\napi_keys = [\"local-key\"]\n[devices]\nbackend = \"cpu\"\n\
             [control_plane]\ncluster = \"c1\"\nnode_name = \"{name}\"\nheartbeat_seconds = 1\n\
             {control_plane}"
        ),
        &["--model", serve::demo_model().to_str().unwrap()],
        env,
    )
}

#[test]
fn peering_over_https_with_mtls_works_and_the_wrong_certificates_are_refused_on_both_sides() {
    let dir = tempfile::tempdir().unwrap();
    let certs = Certificates::make(dir.path());
    let cp = ControlPlane::start_with(
        dir.path(),
        "127.0.0.1:0",
        &format!(
            "tls_certificate = \"{}\"\ntls_key = \"{}\"\ntls_client_ca = \"{}\"\n",
            certs.server_certificate, certs.server_key, certs.ca
        ),
    );
    assert!(cp.base.starts_with("https://"), "{}", cp.base);
    let url = &cp.base;

    // The good node: it trusts the CA, presents a client certificate the CA signed, and
    // takes its token from systemd's credentials directory (LoadCredential=), not its file.
    let credentials = tempfile::tempdir().unwrap();
    std::fs::write(
        credentials.path().join("control_plane_token"),
        format!("# the node token\n{NODE_TOKEN}\n"),
    )
    .unwrap();
    let good = node_starting(
        "n1",
        &format!(
            "url = \"{url}\"\nca = \"{}\"\nclient_certificate = \"{}\"\nclient_key = \"{}\"\n",
            certs.ca, certs.client_certificate, certs.client_key
        ),
        &[("CREDENTIALS_DIRECTORY", credentials.path().as_os_str())],
    );
    // No client certificate: the control plane requires one.
    let anonymous = node_starting(
        "anonymous",
        &format!(
            "url = \"{url}\"\ntoken = \"{NODE_TOKEN}\"\nca = \"{}\"\n",
            certs.ca
        ),
        &[],
    );
    // A client certificate from a CA the control plane does not trust.
    let stranger = node_starting(
        "stranger",
        &format!(
            "url = \"{url}\"\ntoken = \"{NODE_TOKEN}\"\nca = \"{}\"\n\
             client_certificate = \"{}\"\nclient_key = \"{}\"\n",
            certs.ca, certs.rogue_client_certificate, certs.rogue_client_key
        ),
        &[],
    );
    // A node that trusts another CA than the one that signed the control plane's certificate.
    let doubter = node_starting(
        "doubter",
        &format!(
            "url = \"{url}\"\ntoken = \"{NODE_TOKEN}\"\nca = \"{}\"\n\
             client_certificate = \"{}\"\nclient_key = \"{}\"\n",
            certs.rogue_ca, certs.client_certificate, certs.client_key
        ),
        &[],
    );

    good.wait_for_log_within("registered with the control plane", 120);
    cp.wait_for_log("node registered");
    anonymous.wait_for_log_within(
        "it refused this node (403 Forbidden): a client certificate signed by the control \
         plane's tls_client_ca is required",
        120,
    );
    cp.wait_for_log(
        "refused a node: it presented no client certificate (tls_client_ca requires one)",
    );
    stranger.wait_for_log_within(
        "it refused this node's client certificate (control_plane.client_certificate must be \
         signed by its tls_client_ca)",
        120,
    );
    cp.wait_for_log(
        "refused a TLS connection: the client certificate is not signed by tls_client_ca",
    );
    doubter.wait_for_log_within(
        "this node does not trust the control plane's certificate (UnknownIssuer): set \
         control_plane.ca to the CA that signed it",
        120,
    );

    // Over HTTPS the control plane shows the good node only; an admin needs no client
    // certificate (the bearer token is its credential there).
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&certs.ca).unwrap()).unwrap();
    let client = Client::builder()
        .tls_certs_only([ca.clone()])
        .build()
        .unwrap();
    wait_until("the good node reports", || {
        node_status(&cp, &client, "n1")["status"] == "reporting"
    });
    // With n1's certificate (and the token), a heartbeat as another node, or as a node of
    // another cluster, is refused: the certificate names moe-node://c1/n1 only.
    let mut pem = std::fs::read(&certs.client_certificate).unwrap();
    pem.extend(std::fs::read(&certs.client_key).unwrap());
    let as_n1 = Client::builder()
        .tls_certs_only([ca])
        .identity(reqwest::Identity::from_pem(&pem).unwrap())
        .build()
        .unwrap();
    for (cluster, node) in [("c1", "n2"), ("prod", "ghost")] {
        let response = as_n1
            .post(format!("{url}/api/v1/heartbeat"))
            .bearer_auth(NODE_TOKEN)
            .json(&json!({"cluster": cluster, "node": node}))
            .send()
            .unwrap();
        assert_eq!(response.status(), StatusCode::FORBIDDEN, "{cluster}/{node}");
        let body: Value = response.json().unwrap();
        let expected = format!(
            "its client certificate names [moe-node://c1/n1], not moe-node://{cluster}/{node}"
        );
        assert!(
            body["error"].as_str().unwrap().contains(&expected),
            "{body}"
        );
    }
    let (_, all) = cp.admin(&client, reqwest::Method::GET, "/api/v1/clusters", None);
    assert!(
        !all.to_string().contains("ghost") && node_status(&cp, &client, "n2").is_null(),
        "{all}"
    );
    for refused in ["anonymous", "stranger", "doubter"] {
        assert!(
            node_status(&cp, &client, refused).is_null(),
            "{refused} got in"
        );
    }
    // Each node serves regardless.
    for node in [&good, &anonymous, &stranger, &doubter] {
        node.wait_ready();
        assert_eq!(models(node, "local-key"), StatusCode::OK);
    }
    // Plain HTTP to an HTTPS control plane is not answered as HTTP.
    assert!(
        Client::new()
            .get(format!("http://{}/health", cp.addr()))
            .send()
            .map(|r| !r.status().is_success())
            .unwrap_or(true)
    );

    // Certificate files that are missing or not PEM are configuration errors that name
    // the key and the file (exit 78, before anything starts).
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let config = dir.path().join("bad-tls.toml");
    std::fs::write(
        &config,
        format!(
            "[control_plane]\nurl = \"{url}\"\ntoken = \"{NODE_TOKEN}\"\n\
             ca = \"{}\"\nclient_certificate = \"{}\"\nclient_key = \"{}\"\n",
            garbage.display(),
            dir.path().join("missing.pem").display(),
            certs.client_key
        ),
    )
    .unwrap();
    let check = std::process::Command::new(serve::BIN)
        .args([
            OsStr::new("check"),
            OsStr::new("--config"),
            config.as_os_str(),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert_eq!(check.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "control_plane.client_certificate: cannot read {}",
            dir.path().join("missing.pem").display()
        )) && stderr.contains(&format!(
            "control_plane.ca: {} holds no PEM certificate",
            garbage.display()
        )),
        "{stderr}"
    );
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Each member's (node, state, incarnation) as `node` sees them.
fn membership(node: &Server) -> Vec<(String, String, u64)> {
    let body: Value = node.get("/admin/cluster").json().unwrap();
    body["members"]
        .as_array()
        .unwrap_or_else(|| panic!("{body}"))
        .iter()
        .map(|m| {
            (
                m["node"].as_str().unwrap().to_string(),
                m["state"].as_str().unwrap().to_string(),
                m["incarnation"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_cluster_keeps_its_gossip_membership_without_the_control_plane_and_peers_use_reloaded_keys() {
    let dir = tempfile::tempdir().unwrap();
    let client = Client::new();
    let cp = ControlPlane::start(dir.path(), "127.0.0.1:0");
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v3");
    let ports = [free_udp_port(), free_udp_port()];
    let cp_url = cp.base.clone();
    let config = |i: usize, key: &str| {
        format!(
            "[server]\napi_keys = [\"{key}\"]\nadmin_actions = true\n\
             [devices]\nbackend = \"cpu\"\ncpu_slots = 1\n\
             [placement]\nredundant_slots_per_device = 4\n\
             [cluster]\nnode_id = \"node{}\"\nsecrets = [\"control-plane-test-secret-0123\"]\n\
             gossip_listen = \"127.0.0.1:{}\"\npeer_listen = \"127.0.0.1:0\"\n\
             seeds = [\"127.0.0.1:{}\"]\nexpect_nodes = 2\nreplication = 2\n\
             probe_period_ms = 200\nsuspicion_timeout_ms = 2000\n\
             join_timeout_seconds = 20\nrereplicate_after_ms = 600000\n\
             [control_plane]\nurl = \"{}\"\ntoken = \"{NODE_TOKEN}\"\ncluster = \"c1\"\n\
             heartbeat_seconds = 1\n",
            i + 1,
            ports[i],
            ports[1 - i],
            cp_url
        )
    };
    let start =
        |i: usize| Server::start_with(&config(i, "old-key"), &["--model", model.to_str().unwrap()]);
    let mut nodes = [start(0), start(1)];
    for node in &nodes {
        node.wait_ready();
        node.wait_for_log_within("registered with the control plane", 30);
    }
    wait_until("the control plane shows both nodes reporting", || {
        ["node1", "node2"]
            .iter()
            .all(|n| node_status(&cp, &client, n)["status"] == "reporting")
    });
    let alive = |node: &Server| {
        let members = membership(node);
        members.len() == 2 && members.iter().all(|(_, state, _)| state == "alive")
    };
    wait_until("both nodes see both alive", || nodes.iter().all(alive));
    let before: Vec<_> = nodes.iter().map(membership).collect();

    // The control plane goes away: gossip does not notice, and both nodes serve.
    drop(cp);
    for node in &nodes {
        node.wait_for_log("serving on the last known state");
    }
    // Ten probe periods and then some, with the control plane still gone.
    std::thread::sleep(Duration::from_secs(3));
    let after: Vec<_> = nodes.iter().map(membership).collect();
    assert_eq!(
        before, after,
        "membership changed with the control plane gone"
    );
    for node in &nodes {
        assert!(
            !node.log_contains("member down") && !node.log_contains("declared down"),
            "{:?}",
            node.process.log_lines()
        );
        let completion = node.post_ok(
            "/v1/completions",
            &json!({"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": true}),
        );
        assert_eq!(completion["usage"]["completion_tokens"], 4, "{completion}");
    }

    // Keys rotated by a reload reach the path peers use: node1 reads node2's load with the
    // key it holds now, not the one it started with.
    for (i, node) in nodes.iter_mut().enumerate() {
        std::fs::write(node.config_path(), config(i, "new-key")).unwrap();
        node.hang_up();
        node.wait_for_log("configuration reloaded");
        node.key = Some("new-key".into());
        assert_eq!(models(node, "old-key"), StatusCode::UNAUTHORIZED);
    }
    let report = nodes[0].post_ok("/admin/rebalance", &json!({}));
    assert_eq!(report["nodes_profiled"], 2, "{report}");
    assert!(
        !nodes[0].log_contains("cannot read a member's recent load"),
        "{:?}",
        nodes[0].process.log_lines()
    );
    assert!(nodes.iter().all(alive));
}

/// A registration or heartbeat sent straight to the control plane with `token`.
fn post_report(base: &str, token: &str, report: &Value) -> (StatusCode, Value) {
    let response = Client::new()
        .post(format!("{base}/api/v1/heartbeat"))
        .bearer_auth(token)
        .json(report)
        .send()
        .unwrap();
    let status = response.status();
    (status, response.json().unwrap_or(Value::Null))
}

#[test]
fn a_node_reports_only_as_itself_within_bounds_and_token_guesses_are_refused() {
    const N1_TOKEN: &str = "token-of-node-n1-only-0123";
    const B_TOKEN: &str = "token-of-cluster-b-0123456";
    let dir = tempfile::tempdir().unwrap();
    let client = Client::new();
    let cp = ControlPlane::start_with_tokens(
        dir.path(),
        "127.0.0.1:0",
        "max_nodes_per_cluster = 16\ntoken_failures_per_minute = 10",
        &[(N1_TOKEN, "c1", "n1"), (B_TOKEN, "b", "")],
    );
    let report = |cluster: &str, node: &str| json!({"cluster": cluster, "node": node});
    let error = |body: &Value| body["error"].as_str().unwrap_or_default().to_string();

    // A node's own token: as itself only.
    assert_eq!(
        post_report(&cp.base, N1_TOKEN, &report("c1", "n1")).0,
        StatusCode::OK
    );
    let (status, body) = post_report(&cp.base, N1_TOKEN, &report("c1", "n2"));
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(
        error(&body).contains("its token is for c1/n1, not for c1/n2"),
        "{body}"
    );
    // A cluster's token: any node of that cluster, no node of another.
    let (status, body) = post_report(&cp.base, B_TOKEN, &report("c1", "n1"));
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(
        error(&body).contains("any node of cluster b, not for c1/n1"),
        "{body}"
    );
    assert_eq!(
        post_report(&cp.base, B_TOKEN, &report("b", "b1")).0,
        StatusCode::OK
    );

    // Each cluster's nodes get their own cluster's desired state, never another's.
    let key_of = |cluster: &str| format!("api-key-of-cluster-{cluster}-0123");
    for cluster in ["c1", "b"] {
        let (status, body) = cp.admin(
            &client,
            reqwest::Method::PUT,
            &format!("/api/v1/clusters/{cluster}/desired"),
            Some(json!({"api_keys": [key_of(cluster)]})),
        );
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    for (token, cluster, node) in [(N1_TOKEN, "c1", "n1"), (B_TOKEN, "b", "b1")] {
        let (status, answer) = post_report(&cp.base, token, &report(cluster, node));
        assert_eq!(status, StatusCode::OK, "{answer}");
        let keys: Vec<SaltedKey> =
            serde_json::from_value(answer["desired"]["api_keys"].clone()).unwrap();
        assert_eq!(keys.len(), 1, "{answer}");
        assert!(keys[0].matches(&key_of(cluster)), "{answer}");
        let other = if cluster == "b" { "c1" } else { "b" };
        assert!(
            !keys[0].matches(&key_of(other)),
            "{cluster} got {other}'s key"
        );
    }

    // A 900 KB field, a 100 KB one, and a name with a newline: refused, never stored.
    let huge = json!({"cluster": "c1", "node": "n1", "phase": "x".repeat(900_000)});
    let (status, body) = post_report(&cp.base, N1_TOKEN, &huge);
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let large = json!({"cluster": "c1", "node": "n1", "phase": "x".repeat(100_000)});
    let (status, body) = post_report(&cp.base, N1_TOKEN, &large);
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(error(&body).contains("phase: at most 256 bytes"), "{body}");
    let forged = report("c1", "n9\nWARN forged log line");
    let (status, body) = post_report(&cp.base, NODE_TOKEN, &forged);
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(error(&body).contains("node: only letters"), "{body}");
    let (_, all) = cp.admin(&client, reqwest::Method::GET, "/api/v1/clusters", None);
    assert!(!all.to_string().contains("xxxxxxxx") && !all.to_string().contains("forged"));
    assert!(
        !cp.process
            .log_lines()
            .iter()
            .any(|line| line.starts_with("WARN forged")),
        "a forged log line"
    );

    // 200 fake nodes with cluster c1's token: kept up to max_nodes_per_cluster (16).
    let started = Instant::now();
    let mut kept = 0;
    for i in 0..200 {
        let (status, body) = post_report(&cp.base, NODE_TOKEN, &report("c1", &format!("fake{i}")));
        match status {
            StatusCode::OK => kept += 1,
            StatusCode::FORBIDDEN => {
                assert!(error(&body).contains("max_nodes_per_cluster"), "{body}")
            }
            other => panic!("fake{i}: {other} {body}"),
        }
    }
    let (_, all) = cp.admin(&client, reqwest::Method::GET, "/api/v1/clusters", None);
    let c1 = all["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "c1")
        .unwrap();
    assert_eq!(c1["nodes"].as_array().unwrap().len(), 16, "{c1}");
    assert_eq!(kept, 15, "n1 was there first");
    eprintln!(
        "200 fake nodes in {:.1} s: {kept} kept, {} refused",
        started.elapsed().as_secs_f64(),
        200 - kept
    );
    // A known node reports on.
    assert_eq!(
        post_report(&cp.base, N1_TOKEN, &report("c1", "n1")).0,
        StatusCode::OK
    );

    // Token guesses: 10 wrong tokens from this address are answered 401, then 429 for
    // anything that needs a token, the right ones included, until it earns another try.
    let mut statuses = Vec::new();
    for i in 0..25 {
        let guess = format!("guess-{i}");
        statuses.push(post_report(&cp.base, &guess, &report("c1", "n1")).0);
    }
    let unauthorized = statuses
        .iter()
        .filter(|s| **s == StatusCode::UNAUTHORIZED)
        .count();
    let limited = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!((unauthorized, limited), (10, 15), "{statuses:?}");
    let response = Client::new()
        .post(format!("{}/api/v1/heartbeat", cp.base))
        .bearer_auth(N1_TOKEN)
        .json(&report("c1", "n1"))
        .send()
        .unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = response.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=6).contains(&retry), "retry after {retry} s");
    let (status, _) = cp.admin(&client, reqwest::Method::GET, "/api/v1/clusters", None);
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "admins too");
    // One try earned back (one every 6 s at 10 a minute): the right token passes again.
    std::thread::sleep(Duration::from_secs(retry));
    assert_eq!(
        post_report(&cp.base, N1_TOKEN, &report("c1", "n1")).0,
        StatusCode::OK
    );
}

/// Chromium on PATH (Debian's `chromium`), or `None`; with `MOE_TEST_REQUIRE_CHROMIUM` set
/// (CI installs it), a missing browser fails the test instead of skipping it.
fn chromium() -> Option<PathBuf> {
    let found = ["chromium", "chromium-browser"].iter().find_map(|name| {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join(name))
                .find(|path| path.is_file())
        })
    });
    if found.is_none() {
        assert!(
            std::env::var_os("MOE_TEST_REQUIRE_CHROMIUM").is_none(),
            "MOE_TEST_REQUIRE_CHROMIUM is set but no chromium is on PATH (apt-get install chromium)"
        );
    }
    found
}

/// Runs headless chromium on `url` with `what` (`--dump-dom`, `--screenshot=FILE`), a
/// fresh profile and nothing that reaches out; its stdout. Killed after 60 s.
fn render(browser: &Path, url: &str, what: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--window-size=1400,500",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(what)
        .arg(url)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "chromium {what} failed: {status}");
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium {what} took over 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    reader.join().unwrap()
}

/// How many pixels of the PNG at `path` have exactly the colour `rgb`.
fn pixels_of_colour(path: &Path, rgb: [u8; 3]) -> usize {
    let mut decoder =
        png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder.read_info().unwrap();
    let mut buffer = vec![0; reader.output_buffer_size().unwrap()];
    let frame = reader.next_frame(&mut buffer).unwrap();
    let channels = frame.color_type.samples();
    assert!(channels >= 3, "{:?}", frame.color_type);
    buffer[..frame.buffer_size()]
        .chunks_exact(channels)
        .filter(|pixel| pixel[..3] == rgb)
        .count()
}

#[test]
fn the_status_page_shows_a_person_in_a_real_browser_which_nodes_report_and_which_are_stale() {
    let Some(browser) = chromium() else {
        common::skipped("no chromium on PATH: the status page was not rendered in a browser");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let cp = ControlPlane::start(dir.path(), "127.0.0.1:0");
    let client = Client::new();
    let report = |node: &str, path: &str| {
        let report = moe_node::control_plane::wire::Report {
            cluster: "c1".into(),
            node: node.into(),
            phase: "ready".into(),
            model: "demo".into(),
            devices: 2,
            devices_up: 2,
            ..Default::default()
        };
        let status = client
            .post(format!("{}/api/v1/{path}", cp.base))
            .bearer_auth(NODE_TOKEN)
            .json(&report)
            .send()
            .unwrap()
            .status();
        assert_eq!(status, StatusCode::OK);
    };
    // `gone-node` reports once and falls silent (stale after 2 s); `busy-node` keeps
    // heartbeating while the browser renders.
    report("gone-node", "register");
    report("busy-node", "register");
    std::thread::sleep(Duration::from_millis(2500));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let heartbeats = {
        let (stop, base) = (stop.clone(), cp.base.clone());
        std::thread::spawn(move || {
            let client = Client::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = client
                    .post(format!("{base}/api/v1/heartbeat"))
                    .bearer_auth(NODE_TOKEN)
                    .json(
                        &json!({"cluster": "c1", "node": "busy-node", "phase": "ready",
                                  "model": "demo", "devices": 2, "devices_up": 2}),
                    )
                    .send();
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    let started = Instant::now();
    let dom = render(&browser, &cp.base, "--dump-dom");
    let screenshot = dir.path().join("status.png");
    render(
        &browser,
        &cp.base,
        &format!("--screenshot={}", screenshot.display()),
    );
    let rendering = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    heartbeats.join().unwrap();

    // The DOM the browser built: each node in its own row, named, with its mark.
    assert!(dom.contains("<h2>Cluster c1</h2>"), "{dom}");
    assert!(
        dom.contains("<tr class=\"stale\"><td>gone-node</td><td>stale</td>"),
        "{dom}"
    );
    assert!(
        dom.contains("<tr class=\"reporting\"><td>busy-node</td><td>reporting</td>"),
        "{dom}"
    );
    assert!(!dom.contains("<td>dead</td>"), "never shown dead: {dom}");
    // What was painted: the stale row's amber and the reporting row's green backgrounds.
    let amber = pixels_of_colour(&screenshot, [0xfd, 0xe2, 0xa8]);
    let green = pixels_of_colour(&screenshot, [0xd4, 0xf5, 0xd4]);
    assert!(
        amber > 1000 && green > 1000,
        "amber {amber} px, green {green} px"
    );
    if let Some(keep) = std::env::var_os("MOE_TEST_KEEP_SCREENSHOT") {
        std::fs::copy(&screenshot, keep).unwrap();
    }
    eprintln!(
        "status page rendered by {} in {:.1} s: stale row {amber} px, reporting row {green} px",
        browser.display(),
        rendering.as_secs_f32()
    );
}
