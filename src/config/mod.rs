//! The node's configuration: built-in defaults, then `etc/moe-node.toml`, then
//! `MOE_NODE_<SECTION>__<KEY>` environment variables, then command-line flags. The merged
//! result is checked whole before anything starts: unknown keys, wrong types and bad values
//! are all reported together.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub mod credentials;
pub mod live;
mod sections;

use config::{Config, Environment, File, FileFormat};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Environment variables that override the file: `MOE_NODE_SERVER__LISTEN=0.0.0.0:8080`.
pub const ENV_PREFIX: &str = "MOE_NODE";

pub use sections::{
    Backend, BatchingConfig, ClusterConfig, ControlPlaneSection, DevicesConfig, GatewayConfig,
    LogFormat, LoggingConfig, MetricsConfig, ModelSection, NodeConfig, OnUnavailable, PeerSection,
    PeerTransport, PlacementConfig, ServerConfig, TelemetryConfig, mib_to_bytes,
};

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
        section(&merged, "telemetry", &mut config.telemetry, &mut problems);
        section(&merged, "gateway", &mut config.gateway, &mut problems);
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
        problems.extend(self.telemetry.problems());
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
        problems.extend(self.placement.problems());
        problems.extend(self.gateway.problems());
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
        if !(1..=16).contains(&self.devices.emulated_gpus) {
            problems.push(format!(
                "devices.emulated_gpus: {} is not in 1..=16",
                self.devices.emulated_gpus
            ));
        }
        if !(64..=1 << 20).contains(&self.devices.emulated_gpu_mib) {
            problems.push(format!(
                "devices.emulated_gpu_mib: {} is not in 64..=1048576",
                self.devices.emulated_gpu_mib
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
            remote: None,
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
mod tests;
