//! What nodes and the control plane say to each other (JSON over HTTP), and how each side
//! proves itself: the node sends its bearer token; the control plane, which keeps only the
//! token's SHA-256, answers with an HMAC-SHA256 keyed by that hash over the node's nonce
//! and the answer's body, so a node never acts on an answer from a server that does not
//! know its token.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

pub use crate::config::credentials::{hex, is_sha256_hex, sha256_hex};

/// The node's random nonce, per request.
pub const NONCE_HEADER: &str = "x-moe-node-nonce";
/// The control plane's proof: hex HMAC-SHA256(key = SHA-256(token), nonce || body).
pub const PROOF_HEADER: &str = "x-moe-control-plane-proof";

/// A node's report, sent when it registers and with every heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Report {
    pub cluster: String,
    pub node: String,
    /// moe-node's version.
    pub version: String,
    /// "loading", "ready" or "draining".
    pub phase: String,
    pub model: String,
    /// The checkpoint's fingerprint, 16 hex digits.
    pub model_fingerprint: String,
    pub in_flight: usize,
    pub devices: usize,
    pub devices_up: usize,
    pub placement_version: Option<u64>,
    /// Most loaded device over the mean, worst MoE layer, over the recent window.
    pub imbalance: f64,
    /// The desired-state version the node applied last.
    pub desired_version: u64,
}

/// What the control plane wants of one cluster's nodes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DesiredState {
    /// Bumped on every change.
    pub version: u64,
    /// The model the cluster should serve (empty: any); a node serving another says so.
    pub model_name: String,
    pub model_fingerprint: String,
    /// Copies of every expert the cluster should keep (recorded; a node applies its own
    /// `cluster.replication` at start).
    pub replication: Option<usize>,
    /// `placement.rebalance_interval_seconds` for every node, applied live.
    pub rebalance_interval_seconds: Option<u64>,
    /// SHA-256 (hex) of the API keys nodes accept besides their own configured ones.
    pub api_key_sha256: Vec<String>,
    /// Placement overrides (recorded and shown; not applied by nodes yet).
    pub placement_overrides: serde_json::Value,
}

/// A change of the desired state (`PUT /api/v1/clusters/{cluster}/desired`): as
/// [`DesiredState`], but API keys may be given in plain text (`api_keys`); only their
/// hashes are stored.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DesiredUpdate {
    pub model_name: String,
    pub model_fingerprint: String,
    pub replication: Option<usize>,
    pub rebalance_interval_seconds: Option<u64>,
    pub api_keys: Vec<String>,
    pub api_key_sha256: Vec<String>,
    pub placement_overrides: serde_json::Value,
}

/// The control plane's answer to a registration or heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Answer {
    pub desired: DesiredState,
}

/// The proof the control plane sends: keyed by the token's hash (`token_sha256`, hex).
pub fn proof(token_sha256: &str, nonce: &str, body: &[u8]) -> String {
    // HMAC takes keys of any length: this cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(token_sha256.as_bytes())
        .expect("HMAC accepts any key length");
    mac.update(nonce.as_bytes());
    mac.update(body);
    hex(&mac.finalize().into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_only_for_the_same_token_nonce_and_body() {
        let hash = sha256_hex("node-token-0123456789");
        assert!(is_sha256_hex(&hash));
        let p = proof(&hash, "n1", b"{}");
        assert_eq!(p, proof(&hash, "n1", b"{}"));
        assert_ne!(p, proof(&hash, "n2", b"{}"));
        assert_ne!(p, proof(&hash, "n1", b"{ }"));
        assert_ne!(p, proof(&sha256_hex("another-token-xxxx"), "n1", b"{}"));
    }
}
