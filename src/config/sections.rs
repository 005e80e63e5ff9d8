//! The sections of the node's configuration as plain data: every key with its type, its
//! default and a line on what it does (`etc/moe-node.toml` documents the same keys, and a
//! test holds the two equal).

use std::net::SocketAddr;
use std::path::Path;

use serde::{Deserialize, Serialize};

pub use crate::compute::cpu::native_bf16::Precision;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    pub server: ServerConfig,
    pub model: ModelSection,
    pub devices: DevicesConfig,
    pub batching: BatchingConfig,
    pub metrics: MetricsConfig,
    pub logging: LoggingConfig,
    pub telemetry: TelemetryConfig,
    pub cluster: ClusterConfig,
    pub peer: PeerSection,
    pub placement: PlacementConfig,
    pub control_plane: ControlPlaneSection,
    pub gateway: GatewayConfig,
}

/// `moe-node gateway`: how it forwards requests to the nodes and moves the streams of a
/// node that fails. Nodes ignore it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// A stream whose node sends nothing for this long moves to another node (a node
    /// paused, or cut off without its connections closing). Longer than a prompt's prefill.
    pub stall_seconds: u64,
    /// How many times one request may move to another node before it fails.
    pub max_moves: usize,
    /// A request goes to the node that has its prompt's prefix cached, unless that node
    /// runs this many more of the gateway's requests than the least loaded node.
    pub balance_slack: usize,
    /// How often each node's `/ready` is read.
    pub ready_poll_ms: u64,
    /// While no node is ready (a placement change catching up after a partition, every
    /// node restarting), a request waits this long for one before it is answered 503.
    pub wait_ready_seconds: u64,
}

impl GatewayConfig {
    pub(super) fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if !(1..=3600).contains(&self.stall_seconds) {
            problems.push(format!(
                "gateway.stall_seconds: {} is not between 1 and 3600",
                self.stall_seconds
            ));
        }
        if self.max_moves > 16 {
            problems.push(format!(
                "gateway.max_moves: {} is more than 16",
                self.max_moves
            ));
        }
        if self.wait_ready_seconds > 600 {
            problems.push(format!(
                "gateway.wait_ready_seconds: {} is more than 600",
                self.wait_ready_seconds
            ));
        }
        if !(50..=60_000).contains(&self.ready_poll_ms) {
            problems.push(format!(
                "gateway.ready_poll_ms: {} is not between 50 and 60000",
                self.ready_poll_ms
            ));
        }
        problems
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            stall_seconds: 10,
            max_moves: 3,
            balance_slack: 4,
            ready_poll_ms: 500,
            wait_ready_seconds: 10,
        }
    }
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
        use super::credentials::{read_certificates, read_private_key};
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

    pub(super) fn problems(&self) -> Vec<String> {
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
                    super::credentials::read_roots("control_plane.ca", Path::new(&self.ca))
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

/// MiB (a finite number at least 0, as the configuration's checks make sure) in bytes.
pub fn mib_to_bytes(mib: f64) -> u64 {
    (mib.max(0.0) * (1u64 << 20) as f64) as u64
}

/// `placement.max_move_mib` unless set: 4 GiB per version, a few seconds of loading from
/// local NVMe, and at most that much held twice while a version switches, spread over the
/// devices that take copies (5% of one 80 GiB GPU if a single device took it all). An
/// 896-expert FP8 model (44 MiB an expert) moves about 90 copies per version.
pub const DEFAULT_MAX_MOVE_MIB: f64 = 4096.0;

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
    /// Expert weights one placement version of a rebalance loads at most, over all nodes
    /// (MiB); a larger rebalance goes in several versions, each copied, switched to and
    /// released while serving. It bounds what a version adds to memory before the copies
    /// it replaces are released (a node with spare slots holds that much back from its KV
    /// cache), and how long each takes to load. 0: no bound, nothing held back.
    /// Fractions are allowed (small test models).
    pub max_move_mib: f64,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        PlacementConfig {
            redundant_slots_per_device: 0,
            rebalance_interval_seconds: 0,
            window_seconds: 60,
            max_move_mib: DEFAULT_MAX_MOVE_MIB,
        }
    }
}

impl PlacementConfig {
    pub(super) fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if !(1..=86_400).contains(&self.window_seconds) {
            problems.push("placement.window_seconds: between 1 and 86400".into());
        }
        if self.rebalance_interval_seconds > 86_400 * 7 {
            problems.push("placement.rebalance_interval_seconds: at most a week".into());
        }
        if !(self.max_move_mib.is_finite() && self.max_move_mib >= 0.0) {
            problems
                .push("placement.max_move_mib: a number of MiB at least 0 (0: no bound)".into());
        }
        if self.redundant_slots_per_device > 4096 {
            problems.push("placement.redundant_slots_per_device: at most 4096".into());
        }
        problems
    }

    /// `max_move_mib` in bytes.
    pub fn max_move_bytes(&self) -> u64 {
        mib_to_bytes(self.max_move_mib)
    }

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
    /// Model directory (config.json, safetensors, tokenizer.json), or a Hugging Face name
    /// (`org/name[@revision]`, looked up in the Hugging Face cache when no such directory
    /// exists).
    /// Empty: the built-in demo model, written into `cache_dir` on first start.
    pub path: String,
    /// Where the demo model is kept. Empty: `$XDG_CACHE_HOME/moe-node`, else
    /// `~/.cache/moe-node`.
    pub cache_dir: String,
    /// Name clients use in the `model` field. Empty: the Hugging Face name, else the model
    /// directory's name.
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
    /// only on GPUs, refusing to start without (`cuda`); only on CPU slots (`cpu`); on GPUs
    /// emulated on the CPU (`cuda-emulated`: the GPU code path, kernels included, run
    /// slowly where there is no GPU, to check or trace it; needs g++).
    pub backend: Backend,
    /// With `backend = "cuda-emulated"`: how many GPUs to emulate, and the memory of each
    /// in MiB (what `plan`'s fit and the KV cache budget see).
    pub emulated_gpus: usize,
    pub emulated_gpu_mib: usize,
    /// Device slots to run experts on when the node has no GPU.
    pub cpu_slots: usize,
    /// Copies of each expert, each on a different device.
    pub replication: usize,
    /// Share of each GPU's free memory the experts and their work buffers may take.
    pub gpu_memory_fraction: f64,
    /// When experts run on GPUs, the dense part of the model (attention and its KV caches,
    /// norms, dense MLPs, shared experts, lm head) runs on the GPUs too; `false` keeps it on
    /// the CPU.
    pub dense_on_gpu: bool,
    /// GPUs holding a replica of the dense part, each with its own KV cache and batch of
    /// sequences (attention data-parallel, experts shared): the first `dense_replicas`; 0
    /// (the default): every GPU. 1 is the single-dense-GPU layout of earlier versions.
    pub dense_replicas: usize,
    /// Decode steps of a dense part on a GPU replay CUDA graphs (captured once per batch
    /// size and block-table width): one launch per layer instead of one per kernel.
    pub cuda_graphs: bool,
    /// Extra directory searched for NVRTC and cuBLAS (after the loader's path, before
    /// `$CUDA_HOME/lib64` and `/usr/local/cuda*/lib64`). Empty: none.
    pub cuda_lib_dir: String,
    /// Products of many rows with bf16 weights on the CPU's AMX tiles where the CPU and Linux
    /// allow (exact to f32, as the other kernels); `false` keeps them on AVX-512/AVX2.
    pub cpu_amx: bool,
    /// The arithmetic of CPU products with bf16 weights (dense part and experts): `exact`
    /// (widened to f32, equal to transformers' f32 reference) or `bf16` (inputs rounded to
    /// bf16, AVX512_BF16's native products where the CPU has them).
    pub cpu_precision: Precision,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    #[default]
    Auto,
    Cpu,
    Cuda,
    #[serde(rename = "cuda-emulated")]
    CudaEmulated,
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
    /// memory, allocated once as a pool of blocks (caches on a GPU, per dense replica), less what
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
    /// `moe-node plan` calls a placement ready even where one node failing leaves experts
    /// without a copy (replication 1, or too few nodes for it): the operator accepts the
    /// risk the report still names.
    pub accept_unavailable_on_failure: bool,
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
            accept_unavailable_on_failure: false,
            join_timeout_seconds: 300,
            rereplicate_after_ms: 10_000,
        }
    }
}

impl ClusterConfig {
    pub fn enabled(&self) -> bool {
        !self.node_id.is_empty()
    }

    pub(super) fn problems(&self) -> Vec<String> {
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
        for (index, secret) in self.secrets.iter().enumerate() {
            if let Some(why) = weak_secret(secret) {
                problems.push(format!(
                    "cluster.secrets: secret {} of {} {why}: it needs 128 bits of entropy, 32 hex \
                     characters or 22 base64 characters (e.g. `openssl rand -hex 16` or \
                     `openssl rand -base64 16`)",
                    index + 1,
                    self.secrets.len()
                ));
            }
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

/// Why a cluster secret has less than 128 bits of entropy, judged by its length in the
/// alphabet it is written in: 4 bits a character if it is hex, 6 otherwise (base64's, and a
/// generous guess for anything else). `None` when it is long enough. The secret itself is
/// never part of the answer.
pub(crate) fn weak_secret(secret: &str) -> Option<String> {
    let chars = secret.chars().count();
    let (alphabet, needed) = if secret.chars().all(|c| c.is_ascii_hexdigit()) {
        ("hex", 32)
    } else {
        ("characters", 22)
    };
    let mut distinct: Vec<char> = secret.chars().collect();
    distinct.sort_unstable();
    distinct.dedup();
    if chars < needed {
        Some(format!("has {chars} {alphabet}"))
    } else if distinct.len() < 8 {
        Some(format!("repeats {} characters only", distinct.len()))
    } else {
        None
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
    /// Connections the peer port holds at once, handshakes included; more are closed at
    /// accept.
    pub max_connections: usize,
    /// Authenticated connections from one node at once; more are closed after the handshake.
    pub max_connections_per_peer: usize,
    /// Requests one connection runs at once; more are answered "overloaded".
    pub max_inflight_per_connection: usize,
    /// Bytes of request rows (f32, as the devices take them) one connection holds at once,
    /// being received or worked on. Reading from the connection waits while they are spent;
    /// a frame larger than all of them closes it. Rows are allocated as they arrive, never
    /// from the length a header declares. With `max_connections`, this bounds what peers
    /// can make the node hold.
    pub max_bytes_per_connection: u64,
    /// Time a frame may take to arrive once its first bytes did; a frame stopped half-way
    /// longer than this closes its connection.
    pub frame_timeout_ms: u64,
}

impl Default for PeerSection {
    fn default() -> Self {
        PeerSection {
            transport: PeerTransport::default(),
            ucx_lib_dir: String::new(),
            ucx_system_search: true,
            max_connections: 64,
            max_connections_per_peer: 4,
            max_inflight_per_connection: 256,
            max_bytes_per_connection: 512 << 20,
            frame_timeout_ms: 30_000,
        }
    }
}

impl PeerSection {
    /// `ucx_lib_dir`, when set.
    pub fn ucx_lib_path(&self) -> Option<&Path> {
        (!self.ucx_lib_dir.is_empty()).then(|| Path::new(&self.ucx_lib_dir))
    }

    pub(super) fn problems(&self) -> Vec<String> {
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
        for (key, value, min) in [
            ("peer.max_connections", self.max_connections as u64, 1),
            (
                "peer.max_connections_per_peer",
                self.max_connections_per_peer as u64,
                1,
            ),
            (
                "peer.max_inflight_per_connection",
                self.max_inflight_per_connection as u64,
                1,
            ),
            (
                "peer.max_bytes_per_connection",
                self.max_bytes_per_connection,
                1 << 20,
            ),
            ("peer.frame_timeout_ms", self.frame_timeout_ms, 100),
        ] {
            if value < min {
                problems.push(format!("{key}: must be at least {min}"));
            }
        }
        if self.max_connections_per_peer > self.max_connections {
            problems.push(
                "peer.max_connections_per_peer: must not be above peer.max_connections".into(),
            );
        }
        if self.frame_timeout_ms > 3_600_000 {
            problems.push("peer.frame_timeout_ms: at most an hour".into());
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

/// OpenTelemetry traces: a span per generation request, its steps, each MoE layer's
/// dispatch and each call to another node (continued there as the same trace), exported over
/// OTLP. Off unless `otlp_endpoint` is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Where spans go: an OTLP/HTTP traces endpoint (protobuf bodies), e.g.
    /// "http://127.0.0.1:4318/v1/traces" for a local OpenTelemetry Collector. Empty: off.
    pub otlp_endpoint: String,
    /// The share of requests traced (0 to 1). A traced request of 1,000 tokens on a model of
    /// 60 MoE layers makes about 60,000 dispatch spans.
    pub sample_ratio: f64,
    /// `service.name` of the spans.
    pub service_name: String,
}

impl TelemetryConfig {
    /// Values that parse but cannot work.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if !self.otlp_endpoint.is_empty()
            && !reqwest::Url::parse(&self.otlp_endpoint)
                .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
        {
            problems.push(format!(
                "telemetry.otlp_endpoint: `{}` is not a URL like \
                 http://127.0.0.1:4318/v1/traces",
                self.otlp_endpoint
            ));
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            problems.push(format!(
                "telemetry.sample_ratio: {} is not between 0 and 1",
                self.sample_ratio
            ));
        }
        if self.service_name.trim().is_empty() {
            problems.push("telemetry.service_name: must not be empty".into());
        }
        problems
    }
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: String::new(),
            sample_ratio: 0.01,
            service_name: "moe-node".into(),
        }
    }
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

    /// The emulated GPUs `backend = "cuda-emulated"` asks for.
    pub fn emulated(&self) -> crate::compute::cuda::EmulatedGpus {
        crate::compute::cuda::EmulatedGpus {
            count: self.emulated_gpus,
            bytes: self.emulated_gpu_mib << 20,
        }
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
            dense_replicas: 0,
            cuda_graphs: true,
            cuda_lib_dir: String::new(),
            cpu_amx: true,
            cpu_precision: Precision::Exact,
            emulated_gpus: 1,
            emulated_gpu_mib: 4096,
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
