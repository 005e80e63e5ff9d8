//! The node configuration: `etc/moe-node.toml` merged with `MOE_NODE_*` environment
//! overrides, through `NodeConfig::load` (the file is written to a temporary directory, the
//! environment is a map as the tests give it). Input: the TOML text, then optionally a line
//! `#--env--` followed by `KEY=VALUE` lines.
#![no_main]

use std::collections::HashMap;

mod scratch;

use libfuzzer_sys::fuzz_target;
use moe_node::config::{ConfigSources, NodeConfig};

const ENV_MARKER: &str = "\n#--env--\n";

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (file, env) = text.split_once(ENV_MARKER).unwrap_or((text, ""));
    let env: HashMap<String, String> = env
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(key, value)| (key.to_string(), value.to_string()))
        .collect();
    let path = scratch::dir().join("moe-node.toml");
    std::fs::write(&path, file).expect("write the config");
    let loaded = NodeConfig::load(ConfigSources {
        file: Some(&path),
        env,
        overrides: Vec::new(),
    });
    if let Ok(config) = loaded {
        // A config that loads is one `check` passes and `serve` can start from.
        assert!(config.problems().is_empty());
        let _ = config.listen_addr();
    }
});
