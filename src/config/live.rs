//! The settings a running node changes without a restart: on SIGHUP (`systemctl reload`,
//! the config file and credentials read again) and from a control plane. Everything else
//! in the configuration is read once at start.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::NodeConfig;

/// The keys a reload applies to the running node; `etc/moe-node.toml` marks each one.
pub const LIVE_KEYS: [&str; 3] = [
    "server.api_keys",
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
    /// From the control plane's desired state; `None` until it has sent one.
    control_plane_api_keys: RwLock<Option<Arc<Vec<String>>>>,
    rebalance_interval_seconds: AtomicU64,
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
    }

    /// Keys the control plane accepts for this node's cluster, replacing the ones it sent
    /// before; they are accepted besides the configuration's.
    pub fn set_control_plane_api_keys(&self, keys: Vec<String>) {
        *self
            .control_plane_api_keys
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(keys));
    }

    /// The bearer keys accepted now: the configuration's and the control plane's. None at
    /// all: no authentication.
    pub fn api_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .local_api_keys
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .to_vec();
        if let Some(remote) = &*self
            .control_plane_api_keys
            .read()
            .unwrap_or_else(|e| e.into_inner())
        {
            keys.extend(remote.iter().cloned());
        }
        keys
    }

    /// `placement.rebalance_interval_seconds` as it is now.
    pub fn rebalance_interval_seconds(&self) -> u64 {
        self.rebalance_interval_seconds.load(Ordering::Acquire)
    }
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
        assert!(live.api_keys().is_empty());
        live.set_control_plane_api_keys(vec!["remote".into()]);
        config.server.api_keys = vec!["local".into()];
        config.placement.rebalance_interval_seconds = 30;
        live.apply(&config);
        assert_eq!(live.api_keys(), vec!["local", "remote"]);
        assert_eq!(live.rebalance_interval_seconds(), 30);
        live.set_control_plane_api_keys(Vec::new());
        assert_eq!(live.api_keys(), vec!["local"]);
    }
}
