//! `config.json` of a checkpoint: parsing and validation, as `ModelConfig::load` runs them.
//! A config that validates must be one the node can start from: its tables sized, its gate
//! able to route a token (what warm-up does first), its experts placed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moe_node::model::ModelConfig;
use moe_node::moe::gating::route;
use moe_node::placement::Placement;

fuzz_target!(|data: &[u8]| {
    // `load` reads the file with `read_to_string`: text that is not UTF-8 never gets here.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = ModelConfig::parse(text) else {
        return;
    };
    assert_eq!(config.moe_layers.len(), config.num_layers);
    let moe = &config.moe;
    // Large expert counts are valid; routing them would only make the target slow.
    if config.moe_layers.contains(&true) && moe.num_experts <= 4096 {
        let logits: Vec<f32> = (0..moe.num_experts).map(|e| (e % 7) as f32).collect();
        let routing = route(&moe.gating, &logits, moe.num_experts, moe.top_k, None);
        assert_eq!(routing.experts.len(), moe.top_k);
        assert!(
            routing
                .experts
                .iter()
                .all(|&e| (e as usize) < moe.num_experts)
        );
        let placement = Placement::single_node(&config.moe_layers, moe.num_experts, 2, 1);
        assert!(placement.is_ok(), "{placement:?}");
    }
});
