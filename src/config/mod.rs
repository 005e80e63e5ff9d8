//! The node's configuration: built-in defaults, then `etc/moe-node.toml`, then
//! `MOE_NODE_<SECTION>__<KEY>` environment variables, then command-line flags. The merged
//! result is checked whole before anything starts: unknown keys, wrong types and bad values
//! are all reported together.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub mod credentials;
pub mod live;

use config::{Config, Environment, File, FileFormat};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Environment variables that override the file: `MOE_NODE_SERVER__LISTEN=0.0.0.0:8080`.
pub const ENV_PREFIX: &str = "MOE_NODE";

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    pub server: ServerConfig,
    pub model: ModelSection,
    pub devices: DevicesConfig,
    pub batching: BatchingConfig,
    pub metrics: MetricsConfig,
    pub logging: LoggingConfig,
    pub cluster: ClusterConfig,
    pub peer: PeerSection,
    pub placement: PlacementConfig,
    pub control_plane: ControlPlaneSection,
}

/// Peering with a control plane (`moe-node control-plane`): outbound only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ControlPlaneSection {
    /// The control plane's URL, e.g. http://10.0.0.9:9090. Empty: no control plane.
    pub url: String,
    /// Bearer token this node presents (its SHA-256 is in the control plane's config).
    pub token: String,
    /// The cluster this node reports under.
    pub cluster: String,
    /// This node's name at the control plane. Empty: `cluster.node_id`, else the host name.
    pub node_name: String,
    /// Seconds between heartbeats while the control plane answers.
    pub heartbeat_seconds: u64,
    /// https:// only: the CA (PEM) that signed the control plane's certificate; it is then
    /// the only one trusted. Empty: the system's trusted CAs.
    pub ca: String,
    /// https:// only, for mTLS: this node's client certificate (PEM chain).
    pub client_certificate: String,
    /// The private key (PEM) of `client_certificate`.
    pub client_key: String,
}

impl Default for ControlPlaneSection {
    fn default() -> Self {
        ControlPlaneSection {
            url: String::new(),
            token: String::new(),
            cluster: "default".into(),
            node_name: String::new(),
            heartbeat_seconds: 10,
            ca: String::new(),
            client_certificate: String::new(),
            client_key: String::new(),
        }
    }
}

impl ControlPlaneSection {
    pub fn enabled(&self) -> bool {
        !self.url.is_empty()
    }

    /// The client certificate chain and key as one PEM buffer (what reqwest's rustls
    /// `Identity::from_pem` takes), both read and checked now; `None` without mTLS.
    pub fn tls_identity(&self) -> Result<Option<Vec<u8>>, String> {
        use credentials::{read_certificates, read_private_key};
        match (self.client_certificate.as_str(), self.client_key.as_str()) {
            ("", "") => Ok(None),
            ("", _) => {
                Err("control_plane.client_certificate: give the certificate of client_key".into())
            }
            (_, "") => Err("control_plane.client_key: give the key of client_certificate".into()),
            (certificate, key) => {
                let (certificate, key) = (Path::new(certificate), Path::new(key));
                read_certificates("control_plane.client_certificate", certificate)?;
                read_private_key("control_plane.client_key", key)?;
                let read = |k: &str, path: &Path| {
                    std::fs::read(path)
                        .map_err(|e| format!("{k}: cannot read {}: {e}", path.display()))
                };
                let mut pem = read("control_plane.client_certificate", certificate)?;
                pem.push(b'\n');
                pem.extend(read("control_plane.client_key", key)?);
                Ok(Some(pem))
            }
        }
    }

    fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if !self.enabled() {
            return problems;
        }
        let https = self.url.starts_with("https://") && self.url.len() > "https://".len();
        if !https && (!self.url.starts_with("http://") || self.url.len() <= "http://".len()) {
            problems.push(format!(
                "control_plane.url: `{}` is not a URL like https://cp.example.com:9090 or \
                 http://10.0.0.9:9090",
                self.url
            ));
        }
        let tls_files = [
            ("control_plane.ca", &self.ca),
            ("control_plane.client_certificate", &self.client_certificate),
            ("control_plane.client_key", &self.client_key),
        ];
        if !https {
            for (key, value) in tls_files {
                if !value.is_empty() {
                    problems.push(format!("{key}: only used with an https:// url"));
                }
            }
        } else {
            problems.extend(self.tls_identity().err());
            if !self.ca.is_empty()
                && let Err(problem) =
                    credentials::read_roots("control_plane.ca", Path::new(&self.ca))
            {
                problems.push(problem);
            }
        }
        if self.token.len() < 16 {
            problems.push("control_plane.token: at least 16 characters".into());
        }
        if self.cluster.is_empty() || self.cluster.len() > 128 {
            problems.push("control_plane.cluster: 1 to 128 characters".into());
        }
        if self.node_name.len() > 128 {
            problems.push("control_plane.node_name: at most 128 characters".into());
        }
        if !(1..=3600).contains(&self.heartbeat_seconds) {
            problems.push("control_plane.heartbeat_seconds: between 1 and 3600".into());
        }
        problems
    }
}

/// Hot-expert copies: spare expert slots per device, filled from the activation profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlacementConfig {
    /// Extra experts each device may hold per MoE layer, for copies of hot experts (memory
    /// permitting). 0: every expert has exactly its `replication` copies.
    pub redundant_slots_per_device: usize,
    /// Rebalance (recompute the hot-expert copies from the recent window) this often; 0:
    /// only on `POST /admin/rebalance`.
    pub rebalance_interval_seconds: u64,
    /// How far back the recent activation window (profiles, rebalancing) looks.
    pub window_seconds: u64,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        PlacementConfig {
            redundant_slots_per_device: 0,
            rebalance_interval_seconds: 0,
            window_seconds: 60,
        }
    }
}

impl PlacementConfig {
    /// One bucket of the recent window's ring.
    pub fn window_bucket(&self) -> std::time::Duration {
        std::time::Duration::from_millis(
            self.window_seconds.saturating_mul(1000)
                / crate::placement::load::WINDOW_BUCKETS as u64,
        )
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the HTTP API listens on; port 0 picks a free port.
    pub listen: String,
    /// Bearer keys accepted on `/v1`, `/admin` and `/tokenize`; empty means no authentication.
    pub api_keys: Vec<String>,
    /// Largest request body accepted, in bytes (413 beyond it).
    pub max_request_bytes: usize,
    /// On SIGTERM, how long in-flight requests may run before the node exits anyway.
    pub drain_seconds: u64,
    /// A request body not all received this long after its headers gets 408.
    pub body_read_timeout_seconds: u64,
    /// Allow the admin actions (`POST /admin/devices/{id}/stop` and `.../start`). Off by
    /// default: with it on, set `api_keys` too, or any client that reaches the port can
    /// take devices out of service.
    pub admin_actions: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// Model directory (config.json, safetensors, tokenizer.json). Empty: the built-in demo
    /// model, written into `cache_dir` on first start.
    pub path: String,
    /// Where the demo model is kept. Empty: `$XDG_CACHE_HOME/moe-node`, else
    /// `~/.cache/moe-node`.
    pub cache_dir: String,
    /// Name clients use in the `model` field. Empty: the model directory's name.
    pub served_name: String,
    /// `safetensors`: the weights beside config.json; `dummy`: random bf16 weights made from
    /// config.json alone, to measure a published shape without its weights (the answers are
    /// noise). Dummy needs `path`.
    pub load_format: crate::model::LoadFormat,
    /// Serve only the first this many decoder layers (0: all): with `dummy`, a few layers of
    /// a published shape on one machine.
    pub num_layers: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DevicesConfig {
    /// Where experts run: on every GPU when CUDA is usable, else on CPU slots (`auto`);
    /// only on GPUs, refusing to start without (`cuda`); only on CPU slots (`cpu`).
    pub backend: Backend,
    /// Device slots to run experts on when the node has no GPU.
    pub cpu_slots: usize,
    /// Copies of each expert, each on a different device.
    pub replication: usize,
    /// Share of each GPU's free memory the experts and their work buffers may take.
    pub gpu_memory_fraction: f64,
    /// When experts run on GPUs, the dense part of the model (attention and its KV caches,
    /// norms, dense MLPs, shared experts, lm head) runs on GPU 0 too; `false` keeps it on
    /// the CPU.
    pub dense_on_gpu: bool,
    /// Extra directory searched for NVRTC and cuBLAS (after the loader's path, before
    /// `$CUDA_HOME/lib64` and `/usr/local/cuda*/lib64`). Empty: none.
    pub cuda_lib_dir: String,
    /// Products of many rows with bf16 weights on the CPU's AMX tiles where the CPU and Linux
    /// allow (exact to f32, as the other kernels); `false` keeps them on AVX-512/AVX2.
    pub cpu_amx: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    #[default]
    Auto,
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BatchingConfig {
    /// Sequences stepped together at most.
    pub max_sequences: usize,
    /// Tokens (prompt chunks plus one per decoding sequence) in one step at most.
    pub max_tokens_per_step: usize,
    /// Requests waiting for a place in the batch at most; more are refused with 429.
    pub max_waiting: usize,
    /// Longest prompt accepted, in tokens (413 beyond it).
    pub max_prompt_tokens: usize,
    /// `max_tokens` of a request that does not set it.
    pub default_max_tokens: usize,
    /// KV cache memory the running sequences may hold, in MiB; 0: sized after loading, from
    /// half of the host's available memory (caches on the host) or 90% of the GPU's free
    /// memory, halved because caches there grow by doubling (caches on a GPU), less what
    /// the spare expert slots in that memory will hold (`placement.redundant_slots_per_device`).
    /// Sequences
    /// wait while it is full, and the latest are preempted (recomputed later) rather than
    /// failed; the node serves a context no longer than it holds.
    pub kv_cache_mib: usize,
    /// Prompt prefixes whose KV caches are kept for reuse (whole blocks of 16 positions): a
    /// prompt starting with one prefills only the rest. The copies count against the KV
    /// budget and go first when it is short. 0: none kept.
    pub prefix_cache_entries: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Export one series per (layer, expert) on /metrics. Off by default: a large model has
    /// tens of thousands of them; /admin/experts serves the same table as JSON.
    pub per_expert: bool,
}

/// What to do when a group's expert has no live replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnUnavailable {
    /// Fail the step's sequences at once (503 naming the experts).
    #[default]
    Fail,
    /// Wait for a replica to come back (a restart, a healed partition), up to
    /// `cluster.unavailable_wait_ms`, then fail.
    Wait,
    /// Route tokens to the next-best experts by gate score that have a live replica: the
    /// request is served, degraded (counted in `moe_node_dispatch_rerouted_total`).
    Reroute,
}

/// Several nodes serving one model together: gossip membership, experts placed over the
/// devices of every node, expert work sent between nodes over the peer port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// This node's name in the cluster, unique. Empty: the node serves alone.
    pub node_id: String,
    /// Shared secrets. The first encrypts gossip and proves this node to peers; every one
    /// is accepted from others (gossip and peer connections), so a new secret can be
    /// rolled out first and the old one removed later.
    pub secrets: Vec<String>,
    /// UDP address gossip listens on.
    pub gossip_listen: String,
    /// TCP address expert work from other nodes arrives on; every link starts here with the
    /// authenticated handshake, and moves to UCX after it when both nodes offer UCX (see
    /// [`PeerSection`]).
    pub peer_listen: String,
    /// Host other nodes reach this one at. Empty: the host of the listen addresses (which
    /// must then not be 0.0.0.0).
    pub advertise_host: String,
    /// Gossip addresses of nodes to join through.
    pub seeds: Vec<String>,
    /// At first start of a cluster, experts are placed once this many nodes are alive;
    /// a node joining a running cluster takes the placement it serves.
    pub expect_nodes: usize,
    /// Copies of every expert, on distinct nodes.
    pub replication: usize,
    /// Gossip: how often each node probes another.
    pub probe_period_ms: u64,
    /// Gossip: how long a member stays suspect before it is declared dead.
    pub suspicion_timeout_ms: u64,
    /// Expert work unanswered this long is also sent to another replica (hedged), or
    /// after four times the target's measured latency if that is longer.
    pub hedge_after_ms: u64,
    /// Expert work unanswered this long counts as failed.
    pub request_timeout_ms: u64,
    /// When an expert has no live replica: "fail" the affected requests at once (503
    /// naming the experts), "wait" up to `unavailable_wait_ms` for one to return, or
    /// "reroute" tokens to the next-best experts by gate score (served, degraded).
    pub on_expert_unavailable: OnUnavailable,
    pub unavailable_wait_ms: u64,
    /// How long start-up waits for `expect_nodes` members or a placement to join.
    pub join_timeout_seconds: u64,
    /// How long a node holding experts may be gone before its copies are made again on
    /// the others (a new placement version). Longer than a restart by systemd, so a node
    /// that crashes and comes back reloads its own share instead of copies moving twice.
    pub rereplicate_after_ms: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            node_id: String::new(),
            secrets: Vec::new(),
            gossip_listen: "127.0.0.1:7946".into(),
            peer_listen: "127.0.0.1:7947".into(),
            advertise_host: String::new(),
            seeds: Vec::new(),
            expect_nodes: 1,
            replication: 2,
            probe_period_ms: 1000,
            suspicion_timeout_ms: 2000,
            hedge_after_ms: 250,
            request_timeout_ms: 10_000,
            on_expert_unavailable: OnUnavailable::Fail,
            unavailable_wait_ms: 10_000,
            join_timeout_seconds: 300,
            rereplicate_after_ms: 10_000,
        }
    }
}

impl ClusterConfig {
    pub fn enabled(&self) -> bool {
        !self.node_id.is_empty()
    }

    fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if !self.enabled() {
            return problems;
        }
        if self.node_id.len() > 64
            || self
                .node_id
                .chars()
                .any(|c| c.is_control() || c.is_whitespace())
        {
            problems.push("cluster.node_id: at most 64 characters, no spaces".into());
        }
        if self.secrets.is_empty() {
            problems.push("cluster.secrets: a cluster needs a shared secret".into());
        }
        if self.secrets.iter().any(|k| k.len() < 16) {
            problems.push("cluster.secrets: each secret needs at least 16 characters".into());
        }
        let mut addrs = Vec::new();
        for (key, value) in [
            ("cluster.gossip_listen", &self.gossip_listen),
            ("cluster.peer_listen", &self.peer_listen),
        ] {
            match value.parse::<SocketAddr>() {
                Ok(addr) => {
                    if addr.ip().is_unspecified() && self.advertise_host.is_empty() {
                        problems.push(format!(
                            "{key}: `{value}` listens everywhere; set cluster.advertise_host to the address other nodes reach this one at"
                        ));
                    }
                    addrs.push((key, addr));
                }
                Err(_) => problems.push(format!(
                    "{key}: `{value}` is not an address like 127.0.0.1:7946"
                )),
            }
        }
        if let [(_, gossip), (_, peer)] = addrs[..]
            && gossip.port() != 0
            && gossip == peer
        {
            problems.push("cluster.gossip_listen and cluster.peer_listen: must differ".into());
        }
        if !self.advertise_host.is_empty()
            && self.advertise_host.parse::<std::net::IpAddr>().is_err()
        {
            problems.push(format!(
                "cluster.advertise_host: `{}` is not an IP address",
                self.advertise_host
            ));
        }
        for seed in &self.seeds {
            if seed.parse::<SocketAddr>().is_err() {
                problems.push(format!(
                    "cluster.seeds: `{seed}` is not an address like 10.0.0.2:7946"
                ));
            }
        }
        if self.expect_nodes == 0 {
            problems.push("cluster.expect_nodes: must be at least 1".into());
        }
        if self.replication == 0 {
            problems.push("cluster.replication: must be at least 1".into());
        } else if self.replication > self.expect_nodes {
            problems.push(format!(
                "cluster.replication ({}) needs as many nodes, but cluster.expect_nodes is {}",
                self.replication, self.expect_nodes
            ));
        }
        for (key, value, min) in [
            ("cluster.probe_period_ms", self.probe_period_ms, 10),
            (
                "cluster.suspicion_timeout_ms",
                self.suspicion_timeout_ms,
                10,
            ),
            ("cluster.hedge_after_ms", self.hedge_after_ms, 1),
            ("cluster.request_timeout_ms", self.request_timeout_ms, 10),
            ("cluster.join_timeout_seconds", self.join_timeout_seconds, 1),
            ("cluster.rereplicate_after_ms", self.rereplicate_after_ms, 0),
        ] {
            if value < min {
                problems.push(format!("{key}: must be at least {min}"));
            }
            if value > 86_400_000 {
                problems.push(format!("{key}: {value} is more than a day"));
            }
        }
        if self.request_timeout_ms <= self.hedge_after_ms {
            problems.push(
                "cluster.request_timeout_ms: must be longer than cluster.hedge_after_ms".into(),
            );
        }
        if self.unavailable_wait_ms > 3_600_000 {
            problems.push("cluster.unavailable_wait_ms: at most an hour".into());
        }
        problems
    }
}

/// How expert work travels between the nodes of a cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeerSection {
    /// `auto` (the default): UCX when libucp loads, else TCP (the log says which and why);
    /// `ucx`: UCX or refuse to start; `tcp`: TCP only. Either way a link starts as TCP on the peer port and moves to UCX after the
    /// handshake only when both nodes offer it, so nodes with different settings still talk
    /// (over TCP).
    pub transport: PeerTransport,
    /// Directory searched first for libucp.so.0 (e.g. the `lib` folder of PyPI's
    /// `libucx-cu13`, a UCX built with CUDA). Empty: none.
    pub ucx_lib_dir: String,
    /// After `ucx_lib_dir`, also search the dynamic loader's paths (the system's UCX);
    /// `false` uses only the UCX in `ucx_lib_dir`.
    pub ucx_system_search: bool,
}

impl Default for PeerSection {
    fn default() -> Self {
        PeerSection {
            transport: PeerTransport::default(),
            ucx_lib_dir: String::new(),
            ucx_system_search: true,
        }
    }
}

impl PeerSection {
    /// `ucx_lib_dir`, when set.
    pub fn ucx_lib_path(&self) -> Option<&Path> {
        (!self.ucx_lib_dir.is_empty()).then(|| Path::new(&self.ucx_lib_dir))
    }

    fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.transport != PeerTransport::Tcp
            && self.ucx_lib_dir.is_empty()
            && !self.ucx_system_search
        {
            problems.push(
                "peer.ucx_system_search: false with no peer.ucx_lib_dir leaves nowhere to \
                 look for UCX; set peer.ucx_lib_dir, or peer.transport = \"tcp\""
                    .into(),
            );
        }
        problems
    }
}

/// The transport of the peer links (see [`PeerSection::transport`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerTransport {
    #[default]
    Auto,
    Ucx,
    Tcp,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingConfig {
    pub format: LogFormat,
    /// Which events are written, in `RUST_LOG`'s syntax (e.g. "info" or
    /// "info,moe_node::cluster=debug"). Empty: `RUST_LOG`, else "info".
    pub filter: String,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:8080".into(),
            api_keys: Vec::new(),
            max_request_bytes: 1 << 20,
            drain_seconds: 30,
            body_read_timeout_seconds: 30,
            admin_actions: false,
        }
    }
}

impl DevicesConfig {
    /// `cuda_lib_dir`, when set.
    pub fn cuda_lib_path(&self) -> Option<&Path> {
        (!self.cuda_lib_dir.is_empty()).then(|| Path::new(&self.cuda_lib_dir))
    }
}

impl Default for DevicesConfig {
    fn default() -> Self {
        DevicesConfig {
            backend: Backend::Auto,
            cpu_slots: 2,
            replication: 1,
            gpu_memory_fraction: 0.9,
            dense_on_gpu: true,
            cuda_lib_dir: String::new(),
            cpu_amx: true,
        }
    }
}

impl Default for BatchingConfig {
    fn default() -> Self {
        BatchingConfig {
            max_sequences: 64,
            max_tokens_per_step: 512,
            max_waiting: 256,
            max_prompt_tokens: 8192,
            default_max_tokens: 256,
            kv_cache_mib: 0,
            prefix_cache_entries: 16,
        }
    }
}

/// The largest `server.max_request_bytes`.
const MAX_REQUEST_BYTES: usize = 1 << 30;

/// The configuration cannot be used; every problem found is listed.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration:\n  - {}", problems.join("\n  - "))]
pub struct ConfigError {
    pub problems: Vec<String>,
}

impl ConfigError {
    fn one(problem: String) -> Self {
        ConfigError {
            problems: vec![problem],
        }
    }
}

/// Where the layers come from: the file (optional), the environment (a map, so tests never
/// touch the process's), and command-line overrides as `section.key` → value.
#[derive(Debug, Default)]
pub struct ConfigSources<'a> {
    pub file: Option<&'a Path>,
    pub env: HashMap<String, String>,
    pub overrides: Vec<(&'static str, config::Value)>,
}

/// Secrets systemd hands the service as credentials (`LoadCredential=` in the unit), so
/// that they need not sit in the config file: the file named on the left in
/// `$CREDENTIALS_DIRECTORY`, one value per line (`#` comments and blank lines skipped),
/// replaces the key on the right. A credential file with no values changes nothing. The
/// keys that take one value (not a list) take a file with one value.
pub const CREDENTIALS: [(&str, &str); 3] = [
    ("api_keys", "server.api_keys"),
    ("cluster_secrets", "cluster.secrets"),
    ("control_plane_token", "control_plane.token"),
];

/// The credentials whose key takes one value, not a list.
const SINGLE_VALUE_CREDENTIALS: [&str; 1] = ["control_plane.token"];

/// A credential's values: a list, or the one value of a single-value key.
enum CredentialValue {
    List(Vec<String>),
    One(String),
}

/// The values of the credentials present, from the environment's `CREDENTIALS_DIRECTORY`.
fn credentials(
    env: &HashMap<String, String>,
) -> Result<Vec<(&'static str, CredentialValue)>, ConfigError> {
    let Some(dir) = env.get("CREDENTIALS_DIRECTORY") else {
        return Ok(Vec::new());
    };
    let mut found = Vec::new();
    for (file, key) in CREDENTIALS {
        let path = Path::new(dir).join(file);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(ConfigError::one(format!(
                    "{key}: cannot read the credential {}: {e}",
                    path.display()
                )));
            }
        };
        let mut values: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .map(str::to_string)
            .collect();
        if values.is_empty() {
            continue;
        }
        if SINGLE_VALUE_CREDENTIALS.contains(&key) {
            if values.len() > 1 {
                return Err(ConfigError::one(format!(
                    "{key}: the credential {} holds {} values; give one",
                    path.display(),
                    values.len()
                )));
            }
            found.push((key, CredentialValue::One(values.remove(0))));
        } else {
            found.push((key, CredentialValue::List(values)));
        }
    }
    Ok(found)
}

impl NodeConfig {
    /// Merges the layers and validates the result.
    pub fn load(sources: ConfigSources) -> Result<Self, ConfigError> {
        let defaults = Config::try_from(&NodeConfig::default())
            .map_err(|e| ConfigError::one(format!("built-in defaults: {e}")))?;
        let mut builder = Config::builder().add_source(defaults);
        if let Some(path) = sources.file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| ConfigError::one(format!("cannot read {}: {e}", path.display())))?;
            builder = builder.add_source(File::from_str(&text, FileFormat::Toml));
        }
        let credentials = credentials(&sources.env)?;
        builder = builder.add_source(
            Environment::with_prefix(ENV_PREFIX)
                .prefix_separator("_")
                .separator("__")
                .list_separator(",")
                .with_list_parse_key("server.api_keys")
                .with_list_parse_key("cluster.secrets")
                .with_list_parse_key("cluster.seeds")
                .try_parsing(true)
                .source(Some(sources.env.into_iter().collect())),
        );
        for (key, value) in credentials {
            builder = match value {
                CredentialValue::List(values) => builder.set_override(key, values),
                CredentialValue::One(value) => builder.set_override(key, value),
            }
            .map_err(|e| ConfigError::one(format!("credential for {key}: {e}")))?;
        }
        for (key, value) in sources.overrides {
            builder = builder
                .set_override(key, value)
                .map_err(|e| ConfigError::one(format!("--{key}: {e}")))?;
        }
        let merged = builder.build().map_err(|e| {
            let origin = sources.file.map(|p| format!(" in {}", p.display()));
            ConfigError::one(format!("{e}{}", origin.unwrap_or_default()))
        })?;

        let mut problems = unknown_keys(&merged)?;
        let mut config = NodeConfig::default();
        section(&merged, "server", &mut config.server, &mut problems);
        section(&merged, "model", &mut config.model, &mut problems);
        section(&merged, "devices", &mut config.devices, &mut problems);
        section(&merged, "batching", &mut config.batching, &mut problems);
        section(&merged, "metrics", &mut config.metrics, &mut problems);
        section(&merged, "logging", &mut config.logging, &mut problems);
        section(&merged, "cluster", &mut config.cluster, &mut problems);
        section(&merged, "peer", &mut config.peer, &mut problems);
        section(&merged, "placement", &mut config.placement, &mut problems);
        section(
            &merged,
            "control_plane",
            &mut config.control_plane,
            &mut problems,
        );
        problems.extend(config.problems());
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError { problems })
        }
    }

    /// Values that parse but cannot work.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.server.listen.parse::<SocketAddr>().is_err() {
            problems.push(format!(
                "server.listen: `{}` is not an address like 127.0.0.1:8080",
                self.server.listen
            ));
        }
        if !self.logging.filter.is_empty()
            && let Err(e) = tracing_subscriber::EnvFilter::builder().parse(&self.logging.filter)
        {
            problems.push(format!(
                "logging.filter: `{}` is not a filter like \"info,moe_node::cluster=debug\": {e}",
                self.logging.filter
            ));
        }
        if self.server.api_keys.iter().any(|k| k.trim().is_empty()) {
            problems.push("server.api_keys: keys must not be empty".into());
        }
        if self.server.max_request_bytes < 1024 {
            problems.push("server.max_request_bytes: must be at least 1024".into());
        }
        if self.server.max_request_bytes > MAX_REQUEST_BYTES {
            problems.push(format!(
                "server.max_request_bytes: at most {MAX_REQUEST_BYTES} (1 GiB)"
            ));
        }
        if self.server.drain_seconds > 86_400 {
            problems.push(format!(
                "server.drain_seconds: {} is more than a day",
                self.server.drain_seconds
            ));
        }
        if !(1..=3600).contains(&self.server.body_read_timeout_seconds) {
            problems.push(format!(
                "server.body_read_timeout_seconds: {} is not between 1 and 3600",
                self.server.body_read_timeout_seconds
            ));
        }
        if !(1..=86_400).contains(&self.placement.window_seconds) {
            problems.push("placement.window_seconds: between 1 and 86400".into());
        }
        if self.placement.rebalance_interval_seconds > 86_400 * 7 {
            problems.push("placement.rebalance_interval_seconds: at most a week".into());
        }
        if self.placement.redundant_slots_per_device > 4096 {
            problems.push("placement.redundant_slots_per_device: at most 4096".into());
        }
        if self.devices.cpu_slots == 0 {
            problems.push("devices.cpu_slots: at least one device slot is needed".into());
        }
        if self.model.load_format == crate::model::LoadFormat::Dummy && self.model.path.is_empty() {
            problems.push(
                "model.load_format: dummy needs model.path, a directory with the config.json \
                 of the model to imitate"
                    .into(),
            );
        }
        // Each slot is a thread; each count below sizes a table or a queue.
        for (name, value, max) in [
            ("devices.cpu_slots", self.devices.cpu_slots, 1024),
            ("devices.replication", self.devices.replication, 1024),
            (
                "batching.max_sequences",
                self.batching.max_sequences,
                1 << 16,
            ),
            (
                "batching.max_tokens_per_step",
                self.batching.max_tokens_per_step,
                1 << 20,
            ),
            ("batching.max_waiting", self.batching.max_waiting, 1 << 20),
            ("batching.kv_cache_mib", self.batching.kv_cache_mib, 1 << 30),
            (
                "batching.prefix_cache_entries",
                self.batching.prefix_cache_entries,
                4096,
            ),
            (
                "batching.max_prompt_tokens",
                self.batching.max_prompt_tokens,
                crate::model::config::MAX_CONTEXT,
            ),
            (
                "batching.default_max_tokens",
                self.batching.default_max_tokens,
                crate::model::config::MAX_CONTEXT,
            ),
            ("cluster.expect_nodes", self.cluster.expect_nodes, 1 << 12),
            ("cluster.replication", self.cluster.replication, 1 << 12),
        ] {
            if value > max {
                problems.push(format!("{name}: {value} is more than {max}"));
            }
        }
        if self.devices.replication == 0 {
            problems.push("devices.replication: must be at least 1".into());
        } else if self.devices.backend == Backend::Cpu
            && self.devices.replication > self.devices.cpu_slots.max(1)
        {
            problems.push(format!(
                "devices.replication: {} replicas need as many devices, but there are {}",
                self.devices.replication, self.devices.cpu_slots
            ));
        }
        let fraction = self.devices.gpu_memory_fraction;
        if fraction.is_nan() || fraction <= 0.0 || fraction > 1.0 {
            problems.push(format!(
                "devices.gpu_memory_fraction: {fraction} is not in (0, 1]"
            ));
        }
        let b = &self.batching;
        for (name, value) in [
            ("batching.max_sequences", b.max_sequences),
            ("batching.max_tokens_per_step", b.max_tokens_per_step),
            ("batching.max_prompt_tokens", b.max_prompt_tokens),
            ("batching.default_max_tokens", b.default_max_tokens),
        ] {
            if value == 0 {
                problems.push(format!("{name}: must be at least 1"));
            }
        }
        if b.max_tokens_per_step < b.max_sequences {
            problems.push(format!(
                "batching.max_tokens_per_step ({}) must be at least batching.max_sequences ({}): \
                 every decoding sequence needs one token per step",
                b.max_tokens_per_step, b.max_sequences
            ));
        }
        problems.extend(self.cluster.problems());
        problems.extend(self.peer.problems());
        problems.extend(self.control_plane.problems());
        problems
    }

    /// Values that work but are likely a mistake: printed by `moe-node check`, logged at
    /// start.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        let public = self
            .server
            .listen
            .parse::<SocketAddr>()
            .is_ok_and(|a| !a.ip().is_loopback());
        if public && self.server.api_keys.is_empty() {
            warnings.push(format!(
                "server.listen: `{}` is reachable from other machines and server.api_keys is \
                 empty: anyone who reaches it can use the API",
                self.server.listen
            ));
        }
        if self.server.admin_actions && self.server.api_keys.is_empty() {
            warnings.push(
                "server.admin_actions: on without server.api_keys: any client can stop devices"
                    .into(),
            );
        }
        warnings
    }

    pub fn listen_addr(&self) -> SocketAddr {
        self.server
            .listen
            .parse()
            .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 8080)))
    }

    /// The model directory, or `None` for the demo model.
    pub fn model_path(&self) -> Option<PathBuf> {
        (!self.model.path.is_empty()).then(|| PathBuf::from(&self.model.path))
    }

    /// The model in `dir` as `model.load_format` and `model.num_layers` say to load it.
    pub fn model_source(&self, dir: &Path) -> crate::model::ModelSource {
        crate::model::ModelSource {
            dir: dir.to_path_buf(),
            load_format: self.model.load_format,
            num_layers: (self.model.num_layers > 0).then_some(self.model.num_layers),
        }
    }

    pub fn cache_dir(&self) -> PathBuf {
        if !self.model.cache_dir.is_empty() {
            return PathBuf::from(&self.model.cache_dir);
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(std::env::temp_dir);
        base.join("moe-node")
    }
}

/// Every key of the merged configuration that the defaults do not have.
fn unknown_keys(merged: &Config) -> Result<Vec<String>, ConfigError> {
    let known = key_paths(
        &serde_json::to_value(NodeConfig::default())
            .map_err(|e| ConfigError::one(e.to_string()))?,
    );
    let given = key_paths(
        &merged
            .clone()
            .try_deserialize::<serde_json::Value>()
            .map_err(|e| ConfigError::one(e.to_string()))?,
    );
    Ok(given
        .difference(&known)
        .filter(|key| {
            // A key under an unknown section is reported once, as the section.
            let parent = key.rsplit_once('.').map(|(p, _)| p);
            parent.is_none_or(|p| known.contains(p))
        })
        .map(|key| format!("{key}: unknown key"))
        .collect())
}

fn key_paths(value: &serde_json::Value) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    if let serde_json::Value::Object(sections) = value {
        for (section, inner) in sections {
            keys.insert(section.clone());
            if let serde_json::Value::Object(fields) = inner {
                keys.extend(fields.keys().map(|k| format!("{section}.{k}")));
            }
        }
    }
    keys
}

/// Reads one section, leaving the default in place and noting the problem when it does not
/// fit its type. Unknown keys (reported already) are set aside first, and each section is
/// read separately, so every bad section is reported and the rest still validated.
fn section<T: Serialize + DeserializeOwned>(
    merged: &Config,
    name: &str,
    out: &mut T,
    problems: &mut Vec<String>,
) {
    let mut value = match merged.get::<serde_json::Value>(name) {
        Ok(value) => value,
        Err(config::ConfigError::NotFound(_)) => return,
        Err(e) => {
            problems.push(format!("{name}: {e}"));
            return;
        }
    };
    if let (serde_json::Value::Object(given), Ok(serde_json::Value::Object(known))) =
        (&mut value, serde_json::to_value(&*out))
    {
        given.retain(|key, _| known.contains_key(key));
        // Try each key alone (the defaults fill the rest) to name every key that does not
        // fit its type, then read the section without them.
        let mut bad = Vec::new();
        for (key, v) in given.iter() {
            let alone = serde_json::json!({ key.clone(): v.clone() });
            if let Err(e) = serde_json::from_value::<T>(alone) {
                problems.push(format!("{name}.{key}: {e}"));
                bad.push(key.clone());
            }
        }
        given.retain(|key, _| !bad.contains(key));
    }
    match serde_json::from_value(value) {
        Ok(parsed) => *out = parsed,
        Err(e) => problems.push(format!("{name}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(file: &str, env: &[(&str, &str)]) -> Result<NodeConfig, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("moe-node.toml");
        std::fs::write(&path, file).unwrap();
        NodeConfig::load(ConfigSources {
            file: Some(&path),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            overrides: Vec::new(),
        })
    }

    #[test]
    fn credentials_replace_the_secrets_of_the_file() {
        let credentials = tempfile::tempdir().unwrap();
        std::fs::write(
            credentials.path().join("api_keys"),
            "# rotated 2026-12-01\nkey-one\n\n  key-two  \n",
        )
        .unwrap();
        // No values: the file's secrets stay.
        std::fs::write(credentials.path().join("cluster_secrets"), "# none yet\n").unwrap();
        let dir = credentials.path().to_str().unwrap();
        let config = load(
            "[server]\napi_keys = [\"from-file\"]\n[cluster]\nsecrets = [\"0123456789abcdef\"]\n",
            &[("CREDENTIALS_DIRECTORY", dir)],
        )
        .unwrap();
        assert_eq!(config.server.api_keys, vec!["key-one", "key-two"]);
        assert_eq!(config.cluster.secrets, vec!["0123456789abcdef"]);

        // The control-plane token: one value, replacing the file's.
        let token_file = credentials.path().join("control_plane_token");
        std::fs::write(
            &token_file,
            "# for cp.example.com\ncredential-token-0123456789\n",
        )
        .unwrap();
        let peering = "[control_plane]\nurl = \"http://10.0.0.9:9090\"\n\
                       token = \"file-token-0123456789\"\n";
        let config = load(peering, &[("CREDENTIALS_DIRECTORY", dir)]).unwrap();
        assert_eq!(config.control_plane.token, "credential-token-0123456789");
        // Two tokens are a mistake that is named.
        std::fs::write(&token_file, "token-one-0123456789\ntoken-two-0123456789\n").unwrap();
        let problems = load(peering, &[("CREDENTIALS_DIRECTORY", dir)])
            .unwrap_err()
            .problems;
        assert!(
            problems[0].starts_with("control_plane.token: the credential")
                && problems[0].ends_with("holds 2 values; give one"),
            "{problems:?}"
        );
        std::fs::remove_file(&token_file).unwrap();

        // A credential that cannot be read is an error that names it.
        std::fs::remove_file(credentials.path().join("api_keys")).unwrap();
        std::fs::create_dir(credentials.path().join("api_keys")).unwrap();
        let problems = load("", &[("CREDENTIALS_DIRECTORY", dir)])
            .unwrap_err()
            .problems;
        assert!(
            problems[0].starts_with("server.api_keys: cannot read the credential"),
            "{problems:?}"
        );
    }

    #[test]
    fn layers_apply_in_order() {
        let config = load(
            "[server]\nlisten = \"0.0.0.0:9000\"\n[devices]\ncpu_slots = 4\n",
            &[
                ("MOE_NODE_DEVICES__CPU_SLOTS", "3"),
                ("MOE_NODE_DEVICES__CPU_AMX", "false"),
                ("MOE_NODE_SERVER__API_KEYS", "a,b"),
            ],
        )
        .unwrap();
        assert_eq!(config.server.listen, "0.0.0.0:9000");
        assert_eq!(config.devices.cpu_slots, 3);
        assert!(!config.devices.cpu_amx, "a typed bool from the environment");
        assert_eq!(config.server.api_keys, vec!["a", "b"]);
        assert_eq!(config.batching, BatchingConfig::default());

        let dir = tempfile::tempdir().unwrap();
        let overridden = NodeConfig::load(ConfigSources {
            file: None,
            env: [(
                "MOE_NODE_SERVER__LISTEN".to_string(),
                "1.2.3.4:1".to_string(),
            )]
            .into(),
            overrides: vec![("server.listen", "127.0.0.1:0".into())],
        })
        .unwrap();
        assert_eq!(overridden.server.listen, "127.0.0.1:0");
        drop(dir);
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let err = load(
            "[server]\nlisten = \"nowhere\"\nlisen = 1\n[devices]\nbackend = \"cpu\"\ncpu_slots = 0\nreplication = 2\n\
             gpu_memory_fraction = 1.5\n\
             [batching]\nmax_sequences = \"many\"\n[gpus]\nx = 1\n",
            &[],
        )
        .unwrap_err();
        let text = err.to_string();
        for expected in [
            "server.lisen: unknown key",
            "gpus: unknown key",
            "server.listen: `nowhere`",
            "devices.cpu_slots",
            "devices.replication",
            "devices.gpu_memory_fraction: 1.5 is not in (0, 1]",
            "batching.max_sequences: invalid type: string \"many\"",
        ] {
            assert!(
                text.contains(expected),
                "{expected:?} missing from:\n{text}"
            );
        }
    }

    #[test]
    fn sizes_from_outside_are_bounded_naming_the_key() {
        let err = load(
            "[server]\ndrain_seconds = 9223372036854775807\nbody_read_timeout_seconds = 0\n\
             [devices]\ncpu_slots = 100000000\n[batching]\nmax_tokens_per_step = 1099511627776\n",
            &[],
        )
        .unwrap_err();
        let text = err.to_string();
        for expected in [
            "server.drain_seconds: 9223372036854775807 is more than a day",
            "server.body_read_timeout_seconds: 0 is not between 1 and 3600",
            "devices.cpu_slots: 100000000 is more than 1024",
            "batching.max_tokens_per_step: 1099511627776 is more than 1048576",
        ] {
            assert!(
                text.contains(expected),
                "{expected:?} missing from:\n{text}"
            );
        }
    }

    #[test]
    fn an_open_listen_address_without_keys_is_warned_about() {
        let open = load(
            "[server]\nlisten = \"0.0.0.0:8080\"\nadmin_actions = true\n",
            &[],
        )
        .unwrap();
        let warnings = open.warnings().join("\n");
        assert!(
            warnings.contains("server.listen: `0.0.0.0:8080` is reachable"),
            "{warnings}"
        );
        assert!(warnings.contains("server.admin_actions"), "{warnings}");
        let keyed = load(
            "[server]\nlisten = \"0.0.0.0:8080\"\napi_keys = [\"k\"]\n",
            &[],
        )
        .unwrap();
        assert!(keyed.warnings().is_empty());
        assert!(NodeConfig::default().warnings().is_empty());
    }

    #[test]
    fn local_cluster_example_is_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("etc/examples/local-cluster");
        let mut gossip = Vec::new();
        for i in 1..=3 {
            let file = dir.join(format!("node{i}.toml"));
            let config = NodeConfig::load(ConfigSources {
                file: Some(&file),
                ..Default::default()
            })
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            assert!(config.cluster.enabled());
            assert_eq!(config.cluster.seeds.len(), 2);
            gossip.push(config.cluster.gossip_listen);
        }
        gossip.dedup();
        assert_eq!(gossip.len(), 3, "distinct gossip ports");
    }

    #[test]
    fn cluster_problems_are_reported() {
        let err = load(
            "[cluster]\nnode_id = \"a b\"\nsecrets = [\"short\"]\ngossip_listen = \"0.0.0.0:7946\"\n\
             peer_listen = \"nowhere\"\nseeds = [\"x\"]\nexpect_nodes = 1\nreplication = 2\n\
             request_timeout_ms = 5\non_expert_unavailable = \"panic\"\n",
            &[],
        )
        .unwrap_err();
        let text = err.to_string();
        for expected in [
            "cluster.node_id",
            "cluster.secrets: each secret needs at least 16 characters",
            "cluster.gossip_listen: `0.0.0.0:7946` listens everywhere",
            "cluster.peer_listen: `nowhere`",
            "cluster.seeds: `x`",
            "cluster.replication (2) needs as many nodes",
            "cluster.request_timeout_ms: must be at least 10",
            "cluster.on_expert_unavailable",
        ] {
            assert!(
                text.contains(expected),
                "{expected:?} missing from:\n{text}"
            );
        }
        // Alone (no node_id), the section is not checked.
        assert!(load("[cluster]\nreplication = 5\n", &[]).is_ok());
    }

    #[test]
    fn peer_transport_is_read_from_file_and_env_and_checked() {
        let config = load(
            "[peer]\ntransport = \"ucx\"\nucx_lib_dir = \"/opt/ucx/lib\"\n",
            &[("MOE_NODE_PEER__UCX_SYSTEM_SEARCH", "false")],
        )
        .unwrap();
        assert_eq!(config.peer.transport, PeerTransport::Ucx);
        assert_eq!(config.peer.ucx_lib_path(), Some(Path::new("/opt/ucx/lib")));
        assert!(!config.peer.ucx_system_search);

        let problems = load("[peer]\ntransport = \"rdma\"\nucx_dir = \"x\"\n", &[])
            .unwrap_err()
            .problems;
        let text = problems.join("\n");
        assert!(text.contains("peer.ucx_dir: unknown key"), "{text}");
        assert!(text.contains("peer.transport"), "{text}");

        let problems = load(
            "[peer]\ntransport = \"auto\"\nucx_system_search = false\n",
            &[],
        )
        .unwrap_err()
        .problems;
        assert!(
            problems[0].contains("nowhere to look for UCX"),
            "{problems:?}"
        );
        assert!(
            load(
                "[peer]\ntransport = \"tcp\"\nucx_system_search = false\n",
                &[]
            )
            .is_ok()
        );
    }

    #[test]
    fn shipped_file_is_valid_and_equals_the_defaults() {
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("etc/moe-node.toml");
        let config = NodeConfig::load(ConfigSources {
            file: Some(&shipped),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(config, NodeConfig::default());
    }
}
