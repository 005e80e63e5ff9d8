use super::*;
use crate::model::ModelConfig;

#[test]
fn every_model_type_finds_its_family_and_errors_name_them_all() {
    for family in Family::ALL {
        for model_type in family.model_types() {
            assert_eq!(Family::of_model_type(model_type), Some(family));
        }
    }
    assert_eq!(
        Family::supported_model_types(),
        "qwen3_moe, mixtral, deepseek_v3 and kimi_k2"
    );
    let err = ModelConfig::parse(r#"{"model_type": "llama"}"#).unwrap_err();
    for family in Family::ALL {
        for model_type in family.model_types() {
            assert!(err[0].contains(model_type), "{model_type} not in {err:?}");
        }
    }
}

#[test]
fn routed_experts_are_named_as_each_family_publishes_them() {
    let (prefix, names) = Family::Mixtral.routed_expert(2, 5);
    assert_eq!(prefix, "model.layers.2.block_sparse_moe.experts.5");
    assert_eq!((names.gate, names.up, names.down), ("w1", "w3", "w2"));
    for family in [Family::Qwen3Moe, Family::DeepseekV3] {
        let (prefix, names) = family.routed_expert(2, 5);
        assert_eq!(prefix, "model.layers.2.mlp.experts.5");
        assert_eq!(names, ExpertNames::PROJ);
    }
    assert!(Family::DeepseekV3.gate_correction_bias());
    assert!(!Family::Qwen3Moe.gate_correction_bias());
}

#[test]
fn a_wrapper_names_the_text_model_types_it_accepts() {
    let text = r#"{"model_type": "kimi_k25", "text_config": {"model_type": "qwen3_moe"}}"#;
    let err = ModelConfig::parse(text).unwrap_err();
    assert!(err[0].contains("deepseek_v3 or kimi_k2"), "{err:?}");
}

#[test]
fn every_family_names_a_tool_call_format() {
    for family in Family::ALL {
        assert!(!family.tool_call_formats().is_empty(), "{family:?}");
    }
}
