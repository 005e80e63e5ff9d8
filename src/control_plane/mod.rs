//! `moe-node control-plane`: an HTTP service that nodes register with and heartbeat to
//! (outbound from the nodes: nothing connects to a node). It holds the desired state of
//! each cluster (model, replication, rebalancing interval, accepted API keys, placement
//! overrides), records what each node last reported with a bounded history, and shows it
//! on a status page. Nodes it has not heard from lately are shown as stale, never as dead:
//! gossip owns liveness, and a node goes on serving without the control plane.

pub mod client;
mod guesses;
pub mod identity;
pub mod server;
mod store;
mod tls;
pub mod wire;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ControlPlaneConfig {
    /// Address the HTTP service listens on.
    pub listen: String,
    /// The SQLite database file (created on first start).
    pub database: String,
    /// SHA-256 (hex) of bearer tokens any node may present: only with `tls_client_ca`,
    /// whose certificates then name the node (`moe-node://CLUSTER/NODE`).
    pub node_token_sha256: Vec<String>,
    /// Tokens scoped to a cluster, or to one node of it: what a node presents where mTLS
    /// is off (and may with it).
    pub node_tokens: Vec<identity::NodeToken>,
    /// SHA-256 (hex) of the bearer tokens that may read the cluster state and change the
    /// desired state.
    pub admin_token_sha256: Vec<String>,
    /// A node not heard from for this long is shown as stale.
    pub stale_after_seconds: u64,
    /// Reports kept per node (older ones are dropped).
    pub history_per_node: usize,
    /// Clusters kept at most (named by a node or a desired state); a new one past it is
    /// refused.
    pub max_clusters: usize,
    /// Nodes kept per cluster at most; a new one past it is refused.
    pub max_nodes_per_cluster: usize,
    /// Wrong tokens one source address may present a minute (and in a burst); past it,
    /// its requests needing a token get 429 until it earns another try.
    pub token_failures_per_minute: u32,
    /// HTTPS: the service's certificate chain (PEM). Empty: plain HTTP.
    pub tls_certificate: String,
    /// HTTPS: the private key of `tls_certificate` (PEM).
    pub tls_key: String,
    /// mTLS: a CA (PEM). Nodes must then present a client certificate it signed to register
    /// and heartbeat; the admin API and the status page do not need one.
    pub tls_client_ca: String,
}

impl Default for ControlPlaneConfig {
    fn default() -> Self {
        ControlPlaneConfig {
            listen: "127.0.0.1:9090".into(),
            database: "/var/lib/moe-node-control-plane/state.db".into(),
            node_token_sha256: Vec::new(),
            node_tokens: Vec::new(),
            admin_token_sha256: Vec::new(),
            stale_after_seconds: 60,
            history_per_node: 100,
            max_clusters: 64,
            max_nodes_per_cluster: 256,
            token_failures_per_minute: 10,
            tls_certificate: String::new(),
            tls_key: String::new(),
            tls_client_ca: String::new(),
        }
    }
}

impl ControlPlaneConfig {
    /// Reads and validates `path`, listing every problem.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            problems: vec![format!("cannot read {}: {e}", path.display())],
        })?;
        let config: ControlPlaneConfig = toml_value(&text).map_err(|e| ConfigError {
            problems: vec![format!("{}: {e}", path.display())],
        })?;
        let mut problems = Vec::new();
        if config.listen.parse::<std::net::SocketAddr>().is_err() {
            problems.push(format!(
                "listen: `{}` is not an address like 127.0.0.1:9090",
                config.listen
            ));
        }
        if config.database.is_empty() {
            problems.push("database: give a file path".into());
        }
        if config.node_token_sha256.is_empty() && config.node_tokens.is_empty() {
            problems.push(
                "node_tokens: no node could register; add a [[node_tokens]] with the SHA-256 \
                 of a node token (printf %s \"$TOKEN\" | sha256sum) and its cluster"
                    .into(),
            );
        }
        if !config.node_token_sha256.is_empty() && config.tls_client_ca.is_empty() {
            problems.push(
                "node_token_sha256: a token for any node lets its holder report as any node of \
                 any cluster; without tls_client_ca (whose certificates name the node) give \
                 tokens per cluster or node in [[node_tokens]]"
                    .into(),
            );
        }
        for token in &config.node_tokens {
            if !wire::is_sha256_hex(&token.sha256) {
                problems.push(format!(
                    "node_tokens: `{}` is not a SHA-256 in hex (64 hex digits); store the hash, not the token",
                    token.sha256
                ));
            }
            if let Some(problem) = identity::name_problem(&token.cluster) {
                problems.push(format!(
                    "node_tokens: cluster `{}`: {problem}",
                    token.cluster
                ));
            }
            if !token.node.is_empty()
                && let Some(problem) = identity::name_problem(&token.node)
            {
                problems.push(format!("node_tokens: node `{}`: {problem}", token.node));
            }
        }
        for (key, hashes) in [
            ("node_token_sha256", &config.node_token_sha256),
            ("admin_token_sha256", &config.admin_token_sha256),
        ] {
            for hash in hashes {
                if !wire::is_sha256_hex(hash) {
                    problems.push(format!(
                        "{key}: `{hash}` is not a SHA-256 in hex (64 hex digits); store the hash, not the token"
                    ));
                }
            }
        }
        if !(1..=86_400).contains(&config.stale_after_seconds) {
            problems.push("stale_after_seconds: between 1 and 86400".into());
        }
        if !(1..=100_000).contains(&config.history_per_node) {
            problems.push("history_per_node: between 1 and 100000".into());
        }
        for (key, value) in [
            ("max_clusters", config.max_clusters),
            ("max_nodes_per_cluster", config.max_nodes_per_cluster),
            (
                "token_failures_per_minute",
                config.token_failures_per_minute as usize,
            ),
        ] {
            if !(1..=100_000).contains(&value) {
                problems.push(format!("{key}: between 1 and 100000"));
            }
        }
        if let Err(problem) = config.tls() {
            problems.push(problem);
        }
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError { problems })
        }
    }

    /// The TLS configuration (reading the files now), or `None` for plain HTTP.
    pub fn tls(&self) -> Result<Option<rustls::ServerConfig>, String> {
        let optional = |s: &str| (!s.is_empty()).then(|| Path::new(s).to_path_buf());
        match (
            optional(&self.tls_certificate),
            optional(&self.tls_key),
            optional(&self.tls_client_ca),
        ) {
            (None, None, None) => Ok(None),
            (Some(certificate), Some(key), client_ca) => {
                tls::server_config(&certificate, &key, client_ca.as_deref()).map(Some)
            }
            (None, None, Some(_)) => Err(
                "tls_client_ca: client certificates need HTTPS; set tls_certificate and tls_key"
                    .into(),
            ),
            (Some(_), None, _) => Err("tls_key: give the key of tls_certificate".into()),
            (None, Some(_), _) => Err("tls_certificate: give the certificate of tls_key".into()),
        }
    }

    pub fn database_path(&self) -> PathBuf {
        PathBuf::from(&self.database)
    }
}

fn toml_value<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, config::ConfigError> {
    config::Config::builder()
        .add_source(config::File::from_str(text, config::FileFormat::Toml))
        .build()?
        .try_deserialize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_config_lists_every_problem() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cp.toml");
        std::fs::write(
            &path,
            "listen = \"nowhere\"\nnode_token_sha256 = [\"secret-token\"]\nstale_after_seconds = 0\n",
        )
        .unwrap();
        let text = ControlPlaneConfig::load(&path).unwrap_err().to_string();
        for expected in [
            "listen: `nowhere`",
            "store the hash, not the token",
            "stale_after_seconds",
            "node_token_sha256: a token for any node lets its holder report as any node",
        ] {
            assert!(text.contains(expected), "{expected:?} missing: {text}");
        }
        std::fs::write(
            &path,
            format!(
                "node_token_sha256 = [\"{}\"]\ntls_certificate = \"/nonexistent/cert.pem\"\n\
                 tls_key = \"/nonexistent/key.pem\"\n",
                wire::sha256_hex("a node token")
            ),
        )
        .unwrap();
        let text = ControlPlaneConfig::load(&path).unwrap_err().to_string();
        assert!(
            text.contains("tls_certificate: cannot read /nonexistent/cert.pem"),
            "{text}"
        );
        std::fs::write(
            &path,
            format!(
                "node_token_sha256 = [\"{}\"]\ntls_client_ca = \"/etc/ca.pem\"\n",
                wire::sha256_hex("a node token")
            ),
        )
        .unwrap();
        let text = ControlPlaneConfig::load(&path).unwrap_err().to_string();
        assert!(
            text.contains("tls_client_ca: client certificates need HTTPS"),
            "{text}"
        );
        std::fs::write(
            &path,
            format!(
                "max_nodes_per_cluster = 0\n[[node_tokens]]\nsha256 = \"{}\"\ncluster = \"a\\nb\"\n",
                wire::sha256_hex("a node token")
            ),
        )
        .unwrap();
        let text = ControlPlaneConfig::load(&path).unwrap_err().to_string();
        for expected in [
            "max_nodes_per_cluster: between 1 and 100000",
            "node_tokens: cluster `a\nb`: only letters",
        ] {
            assert!(text.contains(expected), "{expected:?} missing: {text}");
        }
        std::fs::write(&path, "lisen = 1\n").unwrap();
        let text = ControlPlaneConfig::load(&path).unwrap_err().to_string();
        assert!(text.contains("lisen"), "{text}");
    }
}
