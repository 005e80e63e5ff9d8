//! The shipped Grafana dashboard (`etc/grafana/moe-node.json`) and Prometheus alerts
//! (`etc/prometheus/moe-node-alerts.yml`) against what a node exports: every metric they
//! name is one a live node's `/metrics` serves, with the labels they select and group by;
//! and, where promtool is installed, `promtool check rules` accepts the alerts and
//! `promtool check metrics` the node's output. The node is a one-node cluster with
//! per-expert series on, so that the cluster's metrics are there too. promtool also runs
//! the alerts' unit tests: each fires on its series after its `for`, and not before.

use std::collections::{BTreeMap, BTreeSet};
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

mod common;
mod serve;

/// Names that appear on `/metrics` only once they have a series: the peer round trip has
/// one per peer, after the first expert work sent to another node. Each is checked to be
/// registered in the source, with the labels it has then.
const AFTER_FIRST_USE: &[(&str, &str, &[&str])] = &[(
    "moe_node_peer_dispatch_latency_seconds",
    "src/metrics.rs",
    &["peer"],
)];

/// Labels Prometheus adds to every series it scrapes, and the histogram bucket label.
const SCRAPE_LABELS: &[&str] = &["instance", "job", "le"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `/metrics` of a one-node cluster after one request. One node at a time: two tests scrape,
/// and the gossip port, free when it is chosen, could be chosen by both before either binds.
fn scrape() -> String {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let gossip = UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = format!(
        "[devices]\nbackend = \"cpu\"\ncpu_slots = 1\n[metrics]\nper_expert = true\n\
         [cluster]\nnode_id = \"lone\"\nsecrets = [\"dashboards-test-secret-0123456789\"]\n\
         gossip_listen = \"127.0.0.1:{gossip}\"\npeer_listen = \"127.0.0.1:0\"\n\
         expect_nodes = 1\nreplication = 1\njoin_timeout_seconds = 4\n\
         [peer]\ntransport = \"tcp\"\n"
    );
    let model = root().join("tests/fixtures/deepseek_v3");
    let server = serve::Server::start_with(&config, &["--model", model.to_str().unwrap()]);
    server.wait_ready();
    server.post_ok(
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 3}),
    );
    server.get("/metrics").text().unwrap()
}

/// Sample name → label names, from Prometheus text.
fn exported(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut names: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = names.entry(line[..end].to_string()).or_default();
        if let Some(inside) = line[end..]
            .strip_prefix('{')
            .and_then(|rest| rest.split_once('}'))
            .map(|(inside, _)| inside)
        {
            for pair in inside.split("\",") {
                if let Some((label, _)) = pair.split_once('=') {
                    labels.insert(label.trim().to_string());
                }
            }
        }
    }
    names
}

/// Every `expr` of the dashboard and the alerts, with where it is.
fn expressions() -> Vec<(String, String)> {
    fn walk(value: &Value, out: &mut Vec<(String, String)>) {
        match value {
            Value::Object(map) => {
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("expr" | "query" | "definition", Value::String(e)) => {
                            out.push(("etc/grafana/moe-node.json".into(), e.clone()))
                        }
                        _ => walk(value, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let dashboard = std::fs::read_to_string(root().join("etc/grafana/moe-node.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&dashboard).unwrap();
    let mut out = Vec::new();
    walk(&dashboard, &mut out);
    let alerts =
        std::fs::read_to_string(root().join("etc/prometheus/moe-node-alerts.yml")).unwrap();
    for line in alerts.lines() {
        if let Some(expr) = line.trim().strip_prefix("expr:") {
            out.push((
                "etc/prometheus/moe-node-alerts.yml".into(),
                expr.trim().to_string(),
            ));
        }
    }
    out
}

/// The identifiers of a PromQL expression, each with the label names its `{...}` selects
/// on (none after a function or keyword), and the label names of its `by (...)` clauses.
fn parse(expr: &str) -> (Vec<(String, Vec<String>)>, Vec<String>) {
    let bytes = expr.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let (mut names, mut grouped) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                // A string: skip it whole.
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += 1 + usize::from(bytes[i] == b'\\');
                }
                i += 1;
            }
            b'[' => i = expr[i..].find(']').map_or(bytes.len(), |end| i + end + 1),
            b if ident(b) && !b.is_ascii_digit() => {
                let start = i;
                while i < bytes.len() && ident(bytes[i]) {
                    i += 1;
                }
                let word = &expr[start..i];
                let rest = expr[i..].trim_start();
                if matches!(word, "by" | "without") && rest.starts_with('(') {
                    let inside = &rest[1..rest.find(')').unwrap_or(rest.len())];
                    grouped.extend(inside.split(',').map(|l| l.trim().to_string()));
                    i += expr[i..].find(')').map_or(bytes.len() - i, |e| e + 1);
                } else if rest.starts_with('{') {
                    let open = i + (expr[i..].len() - rest.len());
                    let (labels, close) = matchers(expr, open + 1);
                    names.push((word.to_string(), labels));
                    i = close;
                } else {
                    names.push((word.to_string(), Vec::new()));
                }
            }
            _ => i += 1,
        }
    }
    (names, grouped)
}

/// The label names of the matchers from `at` (just past a `{`), and where the `}` ends:
/// `label op "value"` separated by commas, values quoted with `\` escapes.
fn matchers(expr: &str, mut at: usize) -> (Vec<String>, usize) {
    let bytes = expr.as_bytes();
    let mut labels = Vec::new();
    while at < bytes.len() {
        match bytes[at] {
            b'}' => return (labels, at + 1),
            b'"' => {
                at += 1;
                while at < bytes.len() && bytes[at] != b'"' {
                    at += 1 + usize::from(bytes[at] == b'\\');
                }
                at += 1;
            }
            b if b.is_ascii_alphabetic() || b == b'_' => {
                let start = at;
                while at < bytes.len() && (bytes[at].is_ascii_alphanumeric() || bytes[at] == b'_') {
                    at += 1;
                }
                labels.push(expr[start..at].to_string());
            }
            _ => at += 1,
        }
    }
    (labels, at)
}

/// Where `histogram_quantile(..., ...x_bucket...)` names a bucket: the family's samples.
fn sample_names_of(family: &str) -> [String; 4] {
    ["", "_bucket", "_sum", "_count"].map(|suffix| format!("{family}{suffix}"))
}

#[test]
fn the_dashboard_and_alerts_name_only_metrics_and_labels_a_node_exports() {
    let text = scrape();
    let mut exported = exported(&text);
    for (family, source, labels) in AFTER_FIRST_USE {
        let short = family.trim_start_matches("moe_node_");
        let code = std::fs::read_to_string(root().join(source)).unwrap();
        assert!(
            code.contains(&format!("\"{short}\"")),
            "{family} is not registered in {source}"
        );
        assert!(
            !exported.contains_key(*family),
            "{family} is exported now: list it no more"
        );
        for name in sample_names_of(family) {
            let set = labels.iter().map(|l| l.to_string()).collect();
            exported.insert(name, set);
        }
    }
    let mut wrong = Vec::new();
    let mut named = BTreeSet::new();
    for (file, expr) in expressions() {
        let (names, grouped) = parse(&expr);
        let mut labels_here: BTreeSet<String> =
            SCRAPE_LABELS.iter().map(|l| l.to_string()).collect();
        for (name, selected) in &names {
            if !name.starts_with("moe_node_") {
                // Prometheus's own `up`, functions and keywords; a selector on anything else
                // is a name we do not know.
                if !selected.is_empty() && name != "up" {
                    wrong.push(format!("{file}: `{name}` in {expr}"));
                }
                continue;
            }
            named.insert(name.clone());
            let Some(labels) = exported.get(name) else {
                wrong.push(format!("{file}: {name} is not exported (in {expr})"));
                continue;
            };
            labels_here.extend(labels.iter().cloned());
            for label in selected {
                if !labels.contains(label) && !SCRAPE_LABELS.contains(&label.as_str()) {
                    wrong.push(format!("{file}: {name} has no label `{label}` (in {expr})"));
                }
            }
        }
        for label in &grouped {
            if !labels_here.contains(label) {
                wrong.push(format!("{file}: no metric of {expr} has label `{label}`"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // The files are not empty of what they are for.
    assert!(named.len() >= 30, "{named:?}");
}

#[test]
fn the_parser_finds_names_selected_labels_and_groupings() {
    let (names, grouped) = parse(
        "histogram_quantile(0.99, sum by (le, peer) (rate(moe_node_x_bucket{instance=~\"a{b}\", \
         state!=\"dead\"}[5m]))) > up{job=\"moe-node\"}",
    );
    let names: Vec<(&str, Vec<&str>)> = names
        .iter()
        .map(|(n, l)| (n.as_str(), l.iter().map(String::as_str).collect()))
        .collect();
    assert_eq!(
        names,
        [
            ("histogram_quantile", vec![]),
            ("sum", vec![]),
            ("rate", vec![]),
            ("moe_node_x_bucket", vec!["instance", "state"]),
            ("up", vec!["job"]),
        ]
    );
    assert_eq!(grouped, ["le", "peer"]);
}

/// promtool, where installed (Debian's `prometheus` package): the rules load, pass their
/// unit tests (`tests/prometheus/moe-node-alerts.test.yml`), and the node's output passes
/// its lint.
#[test]
fn promtool_accepts_the_alerts_and_the_nodes_metrics() {
    let present = Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success());
    if !present {
        assert!(
            std::env::var_os("MOE_TEST_REQUIRE_PROMTOOL").is_none(),
            "MOE_TEST_REQUIRE_PROMTOOL is set but promtool is not installed"
        );
        common::skipped("promtool is not installed (apt-get install prometheus)");
        return;
    }
    let rules = root().join("etc/prometheus/moe-node-alerts.yml");
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&rules)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The alerts fire on the series they are for, after their `for`, and not before.
    let cases = root().join("tests/prometheus/moe-node-alerts.test.yml");
    let out = Command::new("promtool")
        .args(["test", "rules"])
        .arg(&cases)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = scrape();
    let mut lint = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    lint.stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = lint.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(Path::new(&rules).exists());
}
