//! `quantization_config` of a published checkpoint: which stored forms moe-node reads, and
//! which modules a config leaves unquantized.

use serde_json::Value;

/// How a checkpoint's linear weights are stored.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Quantization {
    /// bf16, f16 or f32 as they are.
    #[default]
    None,
    /// `quant_method = "fp8"`: a linear weight stored as `float8_e4m3fn` has a f32
    /// `weight_scale_inv` per `[rows, cols]` block (published: `[128, 128]`). Which weights are
    /// FP8 is read from each tensor's dtype (routers, norms, embeddings and the output head
    /// stay in bf16).
    Fp8 { block: [usize; 2] },
    /// `quant_method = "compressed-tensors"`, `format = "pack-quantized"`: symmetric 4-bit
    /// integers, `weight_packed` (int32, eight values each), `weight_scale` per `group_size`
    /// inputs, `weight_shape`; every linear layer not in `ignore` is stored so.
    PackedInt4 {
        group_size: usize,
        ignore: IgnoreList,
    },
    /// `quant_method = "mxfp4"` (gpt-oss): fused experts stored as `{name}_blocks` (two FP4
    /// e2m1 values a byte, 32 a block) with `{name}_scales` (one E8M0 exponent a block);
    /// everything else unquantized. The experts are held as stored
    /// ([`crate::compute::quant::QuantFormat::Mxfp4`]).
    Mxfp4,
}

/// compressed-tensors' `ignore`: module names, or `re:` patterns matched at the start of the
/// name (Python's `re.match`).
#[derive(Debug, Clone)]
pub struct IgnoreList {
    entries: Vec<String>,
    patterns: Vec<regex::Regex>,
}

impl PartialEq for IgnoreList {
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries
    }
}

impl IgnoreList {
    fn parse(entries: Vec<String>) -> Result<Self, String> {
        let mut patterns = Vec::new();
        for entry in &entries {
            if let Some(pattern) = entry.strip_prefix("re:") {
                let anchored = format!("^(?:{pattern})");
                patterns.push(regex::Regex::new(&anchored).map_err(|e| {
                    format!(
                        "quantization_config.ignore: pattern `{pattern}` is not understood: {e}"
                    )
                })?);
            }
        }
        Ok(IgnoreList { entries, patterns })
    }

    /// Whether module `name` (a weight's name less `.weight`, as the checkpoint stores it) is
    /// left unquantized.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.iter().any(|e| e == name) || self.patterns.iter().any(|p| p.is_match(name))
    }
}

/// The methods Hugging Face checkpoints name that moe-node does not read, for the error.
const READ: &str = "moe-node reads quant_method `fp8` (e4m3, block-scaled), \
                    `compressed-tensors` with format `pack-quantized` (4-bit symmetric, \
                    group strategy) and `mxfp4` (gpt-oss's experts)";

impl Quantization {
    /// Reads a `quantization_config` object; on failure, every problem found.
    pub fn parse(q: &Value) -> Result<Quantization, Vec<String>> {
        if q.is_null() {
            return Ok(Quantization::None);
        }
        let method = q
            .get("quant_method")
            .and_then(Value::as_str)
            .unwrap_or("(none)");
        match method {
            "fp8" => parse_fp8(q),
            "compressed-tensors" => parse_compressed_tensors(q),
            "mxfp4" => Ok(Quantization::Mxfp4),
            other => Err(vec![format!(
                "quantization_config: quant_method `{other}` is not supported: {READ}; \
                 use such a copy, or a bf16, f16 or f32 one"
            )]),
        }
    }

    pub fn is_quantized(&self) -> bool {
        !matches!(self, Quantization::None)
    }
}

fn parse_fp8(q: &Value) -> Result<Quantization, Vec<String>> {
    let mut problems = Vec::new();
    // DeepSeek's configs write the format `e4m3`, MiniMax-M2's with torch's dtype name.
    if let Some(fmt) = q.get("fmt").and_then(Value::as_str)
        && !matches!(fmt, "e4m3" | "float8_e4m3fn")
    {
        problems.push(format!(
            "quantization_config: fp8 format `{fmt}` is not supported (e4m3, also written \
             float8_e4m3fn, is)"
        ));
    }
    if let Some(scheme) = q.get("activation_scheme").and_then(Value::as_str)
        && scheme != "dynamic"
    {
        problems.push(format!(
            "quantization_config: activation_scheme `{scheme}` is not supported (dynamic is)"
        ));
    }
    let block = match q.get("weight_block_size") {
        Some(Value::Array(sizes)) if sizes.len() == 2 => {
            let sizes: Vec<Option<u64>> = sizes.iter().map(Value::as_u64).collect();
            match sizes[..] {
                [Some(rows), Some(cols)]
                    if (1..=1 << 16).contains(&rows) && (1..=1 << 16).contains(&cols) =>
                {
                    Some([rows as usize, cols as usize])
                }
                _ => None,
            }
        }
        _ => None,
    };
    let Some(block) = block else {
        problems.push(
            "quantization_config: fp8 needs `weight_block_size`, two sizes between 1 and 65536 \
             (per-tensor FP8 scales are not supported)"
                .into(),
        );
        return Err(problems);
    };
    if !problems.is_empty() {
        return Err(problems);
    }
    Ok(Quantization::Fp8 { block })
}

fn parse_compressed_tensors(q: &Value) -> Result<Quantization, Vec<String>> {
    let mut problems = Vec::new();
    let top_format = q.get("format").and_then(Value::as_str);
    let groups = match q.get("config_groups") {
        Some(Value::Object(groups)) if !groups.is_empty() => groups,
        _ => {
            return Err(vec![
                "quantization_config: compressed-tensors needs `config_groups`".into(),
            ]);
        }
    };
    if groups.len() != 1 {
        problems.push(format!(
            "quantization_config: {} config_groups; moe-node reads one (every quantized linear \
             layer in the same scheme)",
            groups.len()
        ));
    }
    let mut group_size = 0;
    for (name, group) in groups {
        let format = group
            .get("format")
            .and_then(Value::as_str)
            .or(top_format)
            .unwrap_or("(none)");
        if format != "pack-quantized" {
            problems.push(format!(
                "quantization_config: compressed-tensors format `{format}` (group `{name}`) is \
                 not supported: {READ}"
            ));
        }
        if group.get("input_activations").is_some_and(|a| !a.is_null()) {
            problems.push(format!(
                "quantization_config: group `{name}` quantizes input activations; only \
                 weight-only schemes are supported"
            ));
        }
        let weights = group.get("weights").unwrap_or(&Value::Null);
        let field = |key: &str| weights.get(key);
        let checks = [
            (
                "num_bits",
                field("num_bits").and_then(Value::as_u64) == Some(4),
                "4",
            ),
            (
                "type",
                field("type").and_then(Value::as_str) == Some("int"),
                "int",
            ),
            (
                "symmetric",
                field("symmetric").and_then(Value::as_bool) == Some(true),
                "true",
            ),
            (
                "strategy",
                field("strategy").and_then(Value::as_str) == Some("group"),
                "group",
            ),
        ];
        for (key, ok, wanted) in checks {
            if !ok {
                let found = field(key).map_or("missing".to_string(), Value::to_string);
                problems.push(format!(
                    "quantization_config: group `{name}` weights.{key} is {found}; moe-node reads \
                     {wanted}"
                ));
            }
        }
        match field("group_size").and_then(Value::as_u64) {
            Some(size) if (1..=1 << 16).contains(&size) => group_size = size as usize,
            other => problems.push(format!(
                "quantization_config: group `{name}` weights.group_size must be between 1 and \
                 65536, found {other:?}"
            )),
        }
    }
    let ignore = match q.get("ignore") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(entries)) => entries
            .iter()
            .filter_map(|e| match e.as_str() {
                Some(s) => Some(s.to_string()),
                None => {
                    problems.push(format!("quantization_config.ignore: `{e}` is not a string"));
                    None
                }
            })
            .collect(),
        Some(other) => {
            problems.push(format!(
                "quantization_config.ignore must be a list, not {other}"
            ));
            Vec::new()
        }
    };
    let ignore = IgnoreList::parse(ignore).map_err(|e| {
        problems.push(e);
    });
    match ignore {
        Ok(ignore) if problems.is_empty() => Ok(Quantization::PackedInt4 { group_size, ignore }),
        _ => Err(problems),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Quantization, Vec<String>> {
        Quantization::parse(&serde_json::from_str(text).unwrap())
    }

    /// Kimi K2 Thinking's `quantization_config`, as published.
    const KIMI_K2_THINKING: &str = r#"{
        "config_groups": {"group_0": {"input_activations": null, "output_activations": null,
            "targets": ["Linear"], "weights": {"actorder": null, "block_structure": null,
            "dynamic": false, "group_size": 32, "num_bits": 4, "observer": "minmax",
            "observer_kwargs": {}, "strategy": "group", "symmetric": true, "type": "int"}}},
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": null, "quant_method": "compressed-tensors",
        "quantization_status": "compressed"}"#;

    #[test]
    fn reads_deepseek_fp8_config() {
        let q = parse(
            r#"{"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}"#,
        )
        .unwrap();
        assert_eq!(q, Quantization::Fp8 { block: [128, 128] });
    }

    #[test]
    fn reads_kimi_int4_config_and_its_ignore_list() {
        let Quantization::PackedInt4 { group_size, ignore } = parse(KIMI_K2_THINKING).unwrap()
        else {
            panic!("not int4")
        };
        assert_eq!(group_size, 32);
        assert!(ignore.contains("lm_head"));
        assert!(ignore.contains("model.layers.3.self_attn.kv_b_proj"));
        assert!(ignore.contains("model.layers.3.mlp.shared_experts.down_proj"));
        assert!(ignore.contains("model.layers.0.mlp.gate_proj"));
        assert!(!ignore.contains("model.layers.3.mlp.experts.7.gate_proj"));
        assert!(!ignore.contains("language_model.lm_head"));
    }

    #[test]
    fn minimax_m2_writes_the_fp8_format_as_torch_names_it() {
        let text = r#"{"activation_scheme": "dynamic", "fmt": "float8_e4m3fn",
            "quant_method": "fp8", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}"#;
        assert_eq!(
            parse(text).unwrap(),
            Quantization::Fp8 { block: [128, 128] }
        );
    }

    #[test]
    fn other_methods_and_formats_are_refused_by_name() {
        for (text, named) in [
            (r#"{"quant_method": "awq", "bits": 4}"#, "`awq`"),
            (r#"{"quant_method": "gptq", "bits": 4}"#, "`gptq`"),
            (r#"{"quant_method": "bitsandbytes"}"#, "`bitsandbytes`"),
            (
                r#"{"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}"#,
                "`e5m2`",
            ),
            (
                r#"{"quant_method": "fp8", "fmt": "e4m3"}"#,
                "weight_block_size",
            ),
        ] {
            let err = parse(text).unwrap_err();
            assert!(err.iter().any(|m| m.contains(named)), "{named}: {err:?}");
        }
        for (from, to, named) in [
            ("pack-quantized", "float-quantized", "`float-quantized`"),
            ("pack-quantized", "marlin-24", "`marlin-24`"),
            (r#""num_bits": 4"#, r#""num_bits": 8"#, "num_bits"),
            (r#""symmetric": true"#, r#""symmetric": false"#, "symmetric"),
            (
                r#""strategy": "group""#,
                r#""strategy": "channel""#,
                "strategy",
            ),
            (
                r#""input_activations": null"#,
                r#""input_activations": {"num_bits": 8}"#,
                "activations",
            ),
            (r#""re:.*self_attn.*""#, r#""re:(?<=x)y""#, "pattern"),
        ] {
            let err = parse(&KIMI_K2_THINKING.replace(from, to)).unwrap_err();
            assert!(err.iter().any(|m| m.contains(named)), "{named}: {err:?}");
        }
    }
}
