//! `config.json` of a checkpoint: parsing and validation, as `ModelConfig::load` runs them.
//! A config that validates must describe a model the loader can size without overflow.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moe_node::model::ModelConfig;

fuzz_target!(|data: &[u8]| {
    // `load` reads the file with `read_to_string`: text that is not UTF-8 never gets here.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(config) = ModelConfig::parse(text) {
        assert_eq!(config.moe_layers.len(), config.num_layers);
        assert!(config.moe.num_experts == 0 || config.moe.top_k <= config.moe.num_experts);
    }
});
