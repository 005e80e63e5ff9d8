//! The settings a running node changes without a restart: on SIGHUP (`systemctl reload`,
//! the config file and credentials read again) and from a control plane. Everything else
//! in the configuration is read once at start.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::NodeConfig;
use super::credentials::SaltedKey;

/// The keys a reload applies to the running node; `etc/moe-node.toml` marks each one.
pub const LIVE_KEYS: [&str; 4] = [
    "server.api_keys",
    "cluster.secrets",
    "logging.filter",
    "placement.rebalance_interval_seconds",
];

/// The live values, shared by the parts that read them (the auth middleware, the
/// rebalancing loop) and the parts that change them (the SIGHUP handler, the control-plane
/// client).
#[derive(Debug, Default)]
pub struct LiveSettings {
    /// From the configuration (file, environment, credentials).
    local_api_keys: RwLock<Arc<Vec<String>>>,
    /// The keys in the control plane's desired state, salted and hashed.
    control_plane_api_keys: RwLock<Arc<Vec<SaltedKey>>>,
    rebalance_interval_seconds: AtomicU64,
    /// `cluster.secrets` as last read: a node joining its cluster takes them from here, so
    /// that a reload while it loads is not lost.
    cluster_secrets: RwLock<Arc<Vec<String>>>,
}

impl LiveSettings {
    /// Sets `placement.rebalance_interval_seconds` (the control plane's desired state).
    pub fn set_rebalance_interval_seconds(&self, seconds: u64) {
        self.rebalance_interval_seconds
            .store(seconds, Ordering::Release);
    }
}

impl LiveSettings {
    pub fn new(config: &NodeConfig) -> Self {
        let live = LiveSettings::default();
        live.apply(config);
        live
    }

    /// Takes the live keys of `config`.
    pub fn apply(&self, config: &NodeConfig) {
        *self
            .local_api_keys
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Arc::new(config.server.api_keys.clone());
        self.rebalance_interval_seconds.store(
            config.placement.rebalance_interval_seconds,
            Ordering::Release,
        );
        *self
            .cluster_secrets
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Arc::new(config.cluster.secrets.clone());
    }

    /// `cluster.secrets` as last read (at start or by the latest reload).
    pub fn cluster_secrets(&self) -> Arc<Vec<String>> {
        self.cluster_secrets
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The keys (salted hashes) the control plane accepts for this node's cluster,
    /// replacing the ones it sent before; they are accepted besides the configuration's.
    pub fn set_control_plane_api_keys(&self, keys: Vec<SaltedKey>) {
        *self
            .control_plane_api_keys
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Arc::new(keys);
    }

    /// How many keys are accepted now (configured, and from the control plane).
    pub fn api_key_count(&self) -> usize {
        self.local_keys().len() + self.remote_keys().len()
    }

    /// Whether a request offering bearer key `offered` may pass: always when no key is
    /// configured or sent by a control plane, else when it is one of them.
    pub fn authorize(&self, offered: Option<&str>) -> bool {
        let (local, remote) = (self.local_keys(), self.remote_keys());
        if local.is_empty() && remote.is_empty() {
            return true;
        }
        let Some(offered) = offered else {
            return false;
        };
        if local.iter().any(|k| constant_time_eq(k, offered)) {
            return true;
        }
        remote.iter().any(|key| key.matches(offered))
    }

    /// The configured keys as they are now (file, environment, credentials; a reload
    /// changes them): what this node presents to other members' APIs. The control plane's
    /// keys are known as hashes only, so they are never presented.
    pub fn local_api_keys(&self) -> Arc<Vec<String>> {
        self.local_keys()
    }

    fn local_keys(&self) -> Arc<Vec<String>> {
        self.local_api_keys
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn remote_keys(&self) -> Arc<Vec<SaltedKey>> {
        self.control_plane_api_keys
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// `placement.rebalance_interval_seconds` as it is now.
    pub fn rebalance_interval_seconds(&self) -> u64 {
        self.rebalance_interval_seconds.load(Ordering::Acquire)
    }
}

/// Compares without stopping at the first difference, so timing does not leak the key.
fn constant_time_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |diff, (x, y)| diff | (x ^ y))
            == 0
}

/// What a configuration read again changes, key by key.
#[derive(Debug, Default, PartialEq)]
pub struct Changes {
    /// Live keys whose value differs from the one in force: applied now.
    pub applied: Vec<String>,
    /// Other keys whose value differs from the one the node started with: they take
    /// effect at the next restart, and the node runs on the old value until then.
    pub need_restart: Vec<String>,
}

impl Changes {
    /// Compares `new` to the settings in force (`live_now`, for the live keys) and to the
    /// configuration the node started with (`started`, for the rest).
    pub fn between(started: &NodeConfig, live_now: &NodeConfig, new: &NodeConfig) -> Changes {
        let (started, live_now, new) = (leaves(started), leaves(live_now), leaves(new));
        let mut changes = Changes::default();
        for (key, value) in &new {
            if LIVE_KEYS.contains(&key.as_str()) {
                if live_now.get(key) != Some(value) {
                    changes.applied.push(key.clone());
                }
            } else if started.get(key) != Some(value) {
                changes.need_restart.push(key.clone());
            }
        }
        changes
    }
}

/// Every `section.key` of a configuration and its value.
fn leaves(config: &NodeConfig) -> BTreeMap<String, serde_json::Value> {
    let mut out = BTreeMap::new();
    if let Ok(serde_json::Value::Object(sections)) = serde_json::to_value(config) {
        for (section, inner) in sections {
            if let serde_json::Value::Object(fields) = inner {
                for (key, value) in fields {
                    out.insert(format!("{section}.{key}"), value);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_keys_are_applied_and_the_rest_wait_for_a_restart() {
        let started = NodeConfig::default();
        let mut new = started.clone();
        new.server.api_keys = vec!["new".into()];
        new.logging.filter = "debug".into();
        new.placement.window_seconds = 30;
        new.devices.cpu_slots = 4;
        let changes = Changes::between(&started, &started, &new);
        assert_eq!(changes.applied, vec!["logging.filter", "server.api_keys"]);
        assert_eq!(
            changes.need_restart,
            vec!["devices.cpu_slots", "placement.window_seconds"]
        );
        // Read again unchanged: nothing more to apply, the restart is still needed.
        let again = Changes::between(&started, &new, &new);
        assert!(again.applied.is_empty());
        assert_eq!(again.need_restart.len(), 2);
    }

    #[test]
    fn keys_from_the_control_plane_are_accepted_besides_the_configured_ones() {
        let mut config = NodeConfig::default();
        let live = LiveSettings::new(&config);
        assert!(live.authorize(None), "no keys: no authentication");
        live.set_control_plane_api_keys(vec![SaltedKey::new("remote")]);
        assert!(!live.authorize(None));
        assert!(live.authorize(Some("remote")));
        config.server.api_keys = vec!["local".into()];
        config.placement.rebalance_interval_seconds = 30;
        live.apply(&config);
        assert!(live.authorize(Some("local")) && live.authorize(Some("remote")));
        assert!(!live.authorize(Some("other")));
        assert_eq!(live.api_key_count(), 2);
        assert_eq!(live.rebalance_interval_seconds(), 30);
        // Each key gets its own salt: equal keys do not look alike.
        assert_ne!(SaltedKey::new("remote"), SaltedKey::new("remote"));
        assert!(SaltedKey::new("remote").is_well_formed());
        live.set_control_plane_api_keys(Vec::new());
        assert!(!live.authorize(Some("remote")));
        assert!(live.authorize(Some("local")));
    }
}
