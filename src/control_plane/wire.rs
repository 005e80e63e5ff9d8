//! What nodes and the control plane say to each other (JSON over HTTP), and how each side
//! proves itself: the node sends its bearer token; the control plane, which keeps only the
//! token's SHA-256, answers with an HMAC-SHA256 keyed by that hash over the node's nonce
//! and the answer's body, so a node never acts on an answer from a server that does not
//! know its token.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

pub use crate::config::credentials::{SaltedKey, hex, is_sha256_hex, sha256_hex};

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
    /// The API keys nodes accept besides their own configured ones, each salted and
    /// hashed ([`SaltedKey`]).
    pub api_keys: Vec<SaltedKey>,
    /// Placement overrides (recorded and shown; not applied by nodes yet).
    pub placement_overrides: serde_json::Value,
}

/// A change of the desired state (`PUT /api/v1/clusters/{cluster}/desired`): as
/// [`DesiredState`], but API keys are given in plain text (`api_keys`, at least
/// [`SaltedKey::MIN_KEY_LEN`] characters) or salted already (`api_keys_salted`); only salted
/// hashes are stored.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DesiredUpdate {
    pub model_name: String,
    pub model_fingerprint: String,
    pub replication: Option<usize>,
    pub rebalance_interval_seconds: Option<u64>,
    pub api_keys: Vec<String>,
    pub api_keys_salted: Vec<SaltedKey>,
    /// Unsalted hashes, as older control planes took them: refused with a message that
    /// says what to give instead.
    pub api_key_sha256: Vec<String>,
    pub placement_overrides: serde_json::Value,
}

/// Most API keys one cluster's desired state holds.
pub const MAX_API_KEYS: usize = 64;
/// Longest API key taken in plain text.
pub const MAX_API_KEY_LEN: usize = 256;
/// Largest `placement_overrides`, as JSON.
pub const MAX_OVERRIDES_BYTES: usize = 64 * 1024;

impl DesiredUpdate {
    /// The desired state this update asks for (version 0: the store numbers it), every key
    /// salted and hashed; or why it is refused.
    pub fn into_desired(self) -> Result<DesiredState, String> {
        if !self.api_key_sha256.is_empty() {
            return Err(
                "api_key_sha256: unsalted hashes are not taken; give `api_keys` (stored \
                        salted) or `api_keys_salted` ({\"salt\", \"sha256\"} each)"
                    .into(),
            );
        }
        for (what, text) in [
            ("model_name", &self.model_name),
            ("model_fingerprint", &self.model_fingerprint),
        ] {
            if let Some(problem) = super::identity::text_problem(text) {
                return Err(format!("{what}: {problem}"));
            }
        }
        if self.api_keys.len() + self.api_keys_salted.len() > MAX_API_KEYS {
            return Err(format!("api_keys: at most {MAX_API_KEYS} keys"));
        }
        for key in &self.api_keys {
            let len = key.chars().count();
            if !(SaltedKey::MIN_KEY_LEN..=MAX_API_KEY_LEN).contains(&len)
                || key.chars().any(|c| c.is_control() || c.is_whitespace())
            {
                return Err(format!(
                    "api_keys: each key {} to {MAX_API_KEY_LEN} characters, no spaces or \
                     control characters (a key's length is what stands against guessing it)",
                    SaltedKey::MIN_KEY_LEN
                ));
            }
        }
        if let Some(bad) = self.api_keys_salted.iter().find(|k| !k.is_well_formed()) {
            return Err(format!(
                "api_keys_salted: `{}` / `{}` is not a 32-hex-digit salt and a SHA-256 in hex",
                bad.salt.escape_debug(),
                bad.sha256.escape_debug()
            ));
        }
        let overrides = serde_json::to_vec(&self.placement_overrides).map_or(0, |v| v.len());
        if overrides > MAX_OVERRIDES_BYTES {
            return Err(format!(
                "placement_overrides: at most {MAX_OVERRIDES_BYTES} bytes of JSON"
            ));
        }
        let mut api_keys: Vec<SaltedKey> =
            self.api_keys.iter().map(|k| SaltedKey::new(k)).collect();
        api_keys.extend(self.api_keys_salted.into_iter().map(|k| SaltedKey {
            salt: k.salt.to_ascii_lowercase(),
            sha256: k.sha256.to_ascii_lowercase(),
        }));
        Ok(DesiredState {
            version: 0,
            model_name: self.model_name,
            model_fingerprint: self.model_fingerprint,
            replication: self.replication,
            rebalance_interval_seconds: self.rebalance_interval_seconds,
            api_keys,
            placement_overrides: self.placement_overrides,
        })
    }
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

    #[test]
    fn desired_keys_are_stored_salted_and_bad_updates_are_refused() {
        let update = DesiredUpdate {
            api_keys: vec![
                "a-long-enough-api-key".into(),
                "a-long-enough-api-key".into(),
            ],
            ..DesiredUpdate::default()
        };
        let desired = update.into_desired().expect("taken");
        assert_eq!(desired.api_keys.len(), 2);
        assert_ne!(desired.api_keys[0], desired.api_keys[1], "one salt per key");
        assert!(
            desired
                .api_keys
                .iter()
                .all(|k| k.matches("a-long-enough-api-key"))
        );
        assert!(!desired.api_keys[0].matches("another-api-key-xx"));
        let refused = |update: DesiredUpdate| update.into_desired().expect_err("refused");
        assert!(
            refused(DesiredUpdate {
                api_keys: vec!["short".into()],
                ..DesiredUpdate::default()
            })
            .starts_with("api_keys:")
        );
        assert!(
            refused(DesiredUpdate {
                api_key_sha256: vec![sha256_hex("k")],
                ..DesiredUpdate::default()
            })
            .starts_with("api_key_sha256:")
        );
        assert!(
            refused(DesiredUpdate {
                model_name: "x".repeat(900_000),
                ..DesiredUpdate::default()
            })
            .starts_with("model_name:")
        );
        assert!(
            refused(DesiredUpdate {
                placement_overrides: serde_json::json!({"big": "x".repeat(MAX_OVERRIDES_BYTES)}),
                ..DesiredUpdate::default()
            })
            .starts_with("placement_overrides:")
        );
    }
}
