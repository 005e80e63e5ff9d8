//! The model families moe-node serves, one file each: which `model_type`s a family answers
//! to, the `config.json` keys it reads beyond the common ones, the names its tensors are
//! published under, its gate and attention variants and its tool-call format.
//!
//! A family used to be spread over the config reader, the weight loader, the planner and the
//! API, with checks written as `==` and `_ =>` that the compiler could not follow; now the
//! rest of the engine asks [`Family`], whose every answer comes from the family's own
//! [`FamilySpec`], so a new family is one file here, its variant of [`Family`] listed in
//! [`Family::ALL`] (model_type lookup and error messages go through it) and its arm in
//! [`Family::spec`] (see `docs/adding-a-model.md`).

mod deepseek_v3;
mod deepseek_v32;
mod deepseek_v4;
mod glm4_moe;
mod glm_moe_dsa;
mod gpt_oss;
mod llama4;
mod minimax_m2;
mod mixtral;
mod qwen3_moe;
mod qwen3_next;

use serde::Deserialize;
use serde_json::Value;

pub(super) use deepseek_v4::deepseek_v4;
pub use deepseek_v4::{DeepseekV4, V4ExpertDtype, V4LayerKind, V4Shape};

use super::config::parts::{
    AttentionConfig, CommonKeys, ExpertActivation, GatingConfig, LinearAttention, MoeConfig,
    Problems, QkNorm,
};

/// Which forward-pass code a checkpoint runs through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `qwen3_moe`: GQA with per-head q/k norm, softmax gating.
    Qwen3Moe,
    /// `mixtral`: GQA, softmax gating with renormalised top-k weights.
    Mixtral,
    /// `deepseek_v3` and `kimi_k2` (and the `kimi_k25` wrapper): MLA, sigmoid group-limited
    /// gating, shared experts.
    DeepseekV3,
    /// `glm4_moe` (GLM-4.5 to 4.7): GQA with q/k/v biases, partial rotary and q/k norm;
    /// DeepSeek-V3's gate and shared experts.
    Glm4Moe,
    /// `minimax_m2` (MiniMax-M2 to M2.7): GQA with q/k norm over the whole projection and
    /// partial rotary; a sigmoid gate with a routing bias and no groups.
    MiniMaxM2,
    /// `llama4_text` and the `llama4` wrapper (Llama 4 Scout, Maverick): GQA whose layers
    /// differ (chunked with rope, or full without), top-1 sigmoid routing on the expert's
    /// input, a shared expert, fused experts.
    Llama4,
    /// `gpt_oss` (gpt-oss 20b, 120b): GQA with biases, sinks and alternating sliding
    /// windows; softmax over the top-k router logits; fused experts under a clamped SwiGLU.
    GptOss,
    /// `qwen3_next` and `qwen3_5_moe_text` (and the `qwen3_5_moe` wrapper): hybrid layers of
    /// gated DeltaNet and gated GQA, softmax gating with a gated shared expert.
    Qwen3Next,
    /// `deepseek_v32` (DeepSeek-V3.2): DeepSeek-V3's shape with DeepSeek Sparse Attention (a
    /// lightning indexer per layer picks the positions MLA attends to).
    DeepseekV32,
    /// `glm_moe_dsa` (GLM-5): MLA with DeepSeek Sparse Attention (layers may share an
    /// indexer), the grouped sigmoid gate, a shared expert.
    GlmMoeDsa,
    /// `deepseek_v4` (DeepSeek-V4 Pro and Flash): one shared 512-wide key-value head with a
    /// window and compressed entries, hash-routed first layers, sqrtsoftplus gating,
    /// hyper-connections ([`DeepseekV4`]).
    DeepseekV4,
}

/// What a family answers. Each family's file implements it on a unit struct; nothing has a
/// default, so a new family answers every question.
pub(super) trait FamilySpec: Sync {
    /// The `model_type`s of its published configs, as written there.
    fn model_types(&self) -> &'static [&'static str];
    /// Outer `model_type`s of multimodal wrappers whose `text_config` is this family's
    /// (the vision tower is not served).
    fn wrapper_types(&self) -> &'static [&'static str];
    /// Values for keys its published configs may leave out.
    fn defaults(&self) -> Defaults;
    /// Its own size keys with the largest value accepted: they are multiplied into tables
    /// and tensor shapes, so values no published model comes near are refused first.
    fn size_limits(&self) -> &'static [(&'static str, usize)];
    /// Its part of `config.json`: attention, experts and which layers have them. Every
    /// problem goes to `p`; `Err` only where its keys cannot be read at all.
    fn read(
        &self,
        config: &Value,
        common: &Common,
        p: &mut Problems,
    ) -> Result<FamilyParts, Vec<String>>;
    /// Tensor-name prefix of layer `layer`'s MLP (dense, or the gate and the experts).
    fn mlp_prefix(&self, layer: usize) -> String;
    /// Names of a routed expert's three projections.
    fn expert_names(&self) -> ExpertNames;
    /// Where a layer's routed experts are stored as two tensors for all of them under
    /// `{mlp_prefix}.experts` rather than one per expert and projection.
    fn fused_experts(&self) -> Option<FusedExperts>;
    /// The router's name under [`FamilySpec::mlp_prefix`].
    fn router(&self) -> &'static str;
    /// The shared experts' name under [`FamilySpec::mlp_prefix`] (where there are any).
    fn shared_experts(&self) -> &'static str;
    /// Where its gate's per-expert routing bias (`e_score_correction_bias`) lies under
    /// [`FamilySpec::mlp_prefix`], if its gate has one (read when present).
    fn correction_bias(&self) -> Option<&'static str>;
    /// The tool-call formats its published chat templates write, most specific first.
    fn tool_call_formats(&self) -> &'static [ToolCallFormat];
    /// A chat template for checkpoints that ship none, where the family publishes its prompt
    /// format otherwise (DeepSeek-V4: as Python).
    fn builtin_chat_template(&self) -> Option<&'static str> {
        None
    }
}

impl Family {
    /// Every family, in the order errors list them.
    pub const ALL: [Family; 11] = [
        Family::Qwen3Moe,
        Family::Mixtral,
        Family::DeepseekV3,
        Family::Glm4Moe,
        Family::MiniMaxM2,
        Family::Llama4,
        Family::GptOss,
        Family::Qwen3Next,
        Family::DeepseekV32,
        Family::GlmMoeDsa,
        Family::DeepseekV4,
    ];

    fn spec(self) -> &'static dyn FamilySpec {
        match self {
            Family::Qwen3Moe => &qwen3_moe::Qwen3Moe,
            Family::Mixtral => &mixtral::Mixtral,
            Family::DeepseekV3 => &deepseek_v3::DeepseekV3,
            Family::Glm4Moe => &glm4_moe::Glm4Moe,
            Family::MiniMaxM2 => &minimax_m2::MiniMaxM2,
            Family::Llama4 => &llama4::Llama4,
            Family::GptOss => &gpt_oss::GptOss,
            Family::Qwen3Next => &qwen3_next::Qwen3Next,
            Family::DeepseekV32 => &deepseek_v32::DeepseekV32,
            Family::GlmMoeDsa => &glm_moe_dsa::GlmMoeDsa,
            Family::DeepseekV4 => &deepseek_v4::DeepseekV4Spec,
        }
    }

    /// The family whose configs carry `model_type`.
    pub fn of_model_type(model_type: &str) -> Option<Family> {
        Family::ALL
            .into_iter()
            .find(|family| family.model_types().contains(&model_type))
    }

    /// The `model_type`s it answers to.
    pub fn model_types(self) -> &'static [&'static str] {
        self.spec().model_types()
    }

    /// Every supported `model_type`, for messages: "a, b and c".
    pub fn supported_model_types() -> String {
        let all: Vec<&str> = Family::ALL
            .into_iter()
            .flat_map(|family| family.model_types().iter().copied())
            .collect();
        match all.split_last() {
            Some((last, [])) => last.to_string(),
            Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
            None => String::new(),
        }
    }

    pub(super) fn defaults(self) -> Defaults {
        self.spec().defaults()
    }

    pub(super) fn size_limits(self) -> &'static [(&'static str, usize)] {
        self.spec().size_limits()
    }

    pub(super) fn read(
        self,
        config: &Value,
        common: &Common,
        p: &mut Problems,
    ) -> Result<FamilyParts, Vec<String>> {
        self.spec().read(config, common, p)
    }

    /// Tensor-name prefix of layer `layer`'s MLP: the dense MLP, or the MoE block's gate,
    /// shared experts and routed experts.
    pub fn mlp_prefix(self, layer: usize) -> String {
        self.spec().mlp_prefix(layer)
    }

    /// The tensor-name prefix and projection names of routed expert `expert` of `layer`.
    pub fn routed_expert(self, layer: usize, expert: usize) -> (String, ExpertNames) {
        let spec = self.spec();
        let prefix = format!("{}.experts.{expert}", spec.mlp_prefix(layer));
        (prefix, spec.expert_names())
    }

    /// Layer `layer`'s fused experts: the tensor-name prefix and how they are stored, where
    /// the family stores them fused.
    pub fn fused_experts(self, layer: usize) -> Option<(String, FusedExperts)> {
        let spec = self.spec();
        let fused = spec.fused_experts()?;
        Some((format!("{}.experts", spec.mlp_prefix(layer)), fused))
    }

    /// The tensor-name prefix of layer `layer`'s router.
    pub fn router(self, layer: usize) -> String {
        let spec = self.spec();
        format!("{}.{}", spec.mlp_prefix(layer), spec.router())
    }

    /// The tensor-name prefix of layer `layer`'s shared experts.
    pub fn shared_experts(self, layer: usize) -> String {
        let spec = self.spec();
        format!("{}.{}", spec.mlp_prefix(layer), spec.shared_experts())
    }

    /// Whether the gate may carry `e_score_correction_bias`, which biases the choice.
    pub fn gate_correction_bias(self) -> bool {
        self.spec().correction_bias().is_some()
    }

    /// The tensor name of layer `layer`'s routing bias, where the family's gate has one.
    pub fn correction_bias_name(self, layer: usize) -> Option<String> {
        let spec = self.spec();
        let name = spec.correction_bias()?;
        Some(format!("{}.{name}", spec.mlp_prefix(layer)))
    }

    /// The chat template moe-node uses where a checkpoint of this family ships none.
    pub fn builtin_chat_template(self) -> Option<&'static str> {
        self.spec().builtin_chat_template()
    }

    /// The tool-call formats its chat templates write, most specific first.
    pub fn tool_call_formats(self) -> &'static [ToolCallFormat] {
        self.spec().tool_call_formats()
    }
}

/// Values a family's configs may leave out.
#[derive(Debug, Clone, Copy)]
pub(super) struct Defaults {
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
}

/// What every family reads alike, handed to the family's own part.
pub(super) struct Common<'a> {
    pub keys: &'a CommonKeys,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_layers: usize,
}

/// A family's part of the config.
pub(super) struct FamilyParts {
    pub attention: AttentionConfig,
    /// Rotated dimensions per head.
    pub rope_dim: usize,
    pub moe: MoeConfig,
    /// Per layer: true where the MLP is a mixture of experts.
    pub moe_layers: Vec<bool>,
    /// Intermediate size of the dense MLP layers.
    pub intermediate_size: usize,
    /// The linear-attention layers of a hybrid model (Qwen3-Next, Qwen3.5).
    pub linear_attention: Option<LinearAttention>,
    /// Its RMSNorm weights are stored as offsets from 1 (`x * (1 + w)`).
    pub centered_norms: bool,
}

/// Reads a family's own keys from the config (unknown keys are ignored).
fn keys<'de, T: Deserialize<'de>>(config: &'de Value) -> Result<T, Vec<String>> {
    T::deserialize(config).map_err(|e| vec![format!("cannot read it: {e}")])
}

/// Grouped-query attention as the GQA families configure it.
struct Gqa {
    qk_norm: QkNorm,
    bias: bool,
    sliding_window: Option<usize>,
}

/// Reads and checks GQA's head counts: the attention and its rotary width (all of a head).
fn gqa(common: &Common, p: &mut Problems, variant: Gqa) -> (AttentionConfig, usize) {
    let num_heads = common.num_heads;
    let num_kv_heads = common.keys.num_key_value_heads.unwrap_or(num_heads);
    let head_dim = common
        .keys
        .head_dim
        .unwrap_or(common.hidden_size.checked_div(num_heads).unwrap_or(0));
    p.check(
        num_kv_heads > 0 && num_heads.is_multiple_of(num_kv_heads.max(1)),
        || {
            format!(
                "num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        },
    );
    p.check(head_dim > 0 && head_dim.is_multiple_of(2), || {
        format!("head_dim ({head_dim}) must be even and greater than 0")
    });
    let attention = AttentionConfig::Gqa {
        num_kv_heads,
        head_dim,
        qk_norm: variant.qk_norm,
        bias: variant.bias,
        sliding_window: variant.sliding_window,
        interleave: false,
        layers: Vec::new(),
        sinks: false,
        o_bias: false,
        output_gate: false,
    };
    (attention, head_dim)
}

/// The keys of the group-limited sigmoid gate with shared experts (DeepSeek-V3, GLM-4.5).
#[derive(Deserialize)]
struct GroupedKeys {
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    first_k_dense_replace: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    routed_scaling_factor: Option<f64>,
    scoring_func: Option<String>,
    topk_method: Option<String>,
}

/// Where a family's configs leave the grouped gate's keys out.
struct GroupedDefaults {
    first_k_dense_replace: usize,
    n_group: usize,
    topk_group: usize,
    routed_scaling_factor: f64,
}

/// Routed and shared experts under the group-limited sigmoid gate (transformers'
/// `DeepseekV3TopkRouter`, `Glm4MoeTopkRouter`), and which layers are MoE: all from
/// `first_k_dense_replace` on.
fn grouped_sigmoid_experts(
    family: &str,
    own: &GroupedKeys,
    defaults: GroupedDefaults,
    common: &Common,
    p: &mut Problems,
) -> (MoeConfig, Vec<bool>) {
    let num_experts = p.require(own.n_routed_experts, "n_routed_experts");
    let expert_intermediate = p.require(common.keys.moe_intermediate_size, "moe_intermediate_size");
    let first_dense = own
        .first_k_dense_replace
        .unwrap_or(defaults.first_k_dense_replace);
    let n_group = own.n_group.unwrap_or(defaults.n_group);
    let topk_group = own.topk_group.unwrap_or(defaults.topk_group);
    if let Some(f) = &own.scoring_func {
        p.check(f == "sigmoid", || {
            format!("unsupported scoring_func `{f}`: {family} gating is sigmoid")
        });
    }
    if let Some(m) = &own.topk_method {
        p.check(m == "noaux_tc", || {
            format!("unsupported topk_method `{m}`: only noaux_tc is supported")
        });
    }
    p.check(
        n_group > 0 && num_experts.is_multiple_of(n_group.max(1)),
        || format!("n_routed_experts ({num_experts}) must be a multiple of n_group ({n_group})"),
    );
    p.check(topk_group >= 1 && topk_group <= n_group, || {
        format!("topk_group ({topk_group}) must be between 1 and n_group ({n_group})")
    });
    if n_group > 0 && num_experts.is_multiple_of(n_group.max(1)) {
        p.check(num_experts / n_group >= 2, || {
            "each expert group needs at least 2 experts (group score is the sum of the top 2)"
                .into()
        });
    }
    let moe = MoeConfig {
        num_experts,
        top_k: common.keys.num_experts_per_tok.unwrap_or(8),
        expert_intermediate_size: expert_intermediate,
        shared_intermediate_size: expert_intermediate * own.n_shared_experts.unwrap_or(1),
        gating: GatingConfig::SigmoidGrouped {
            n_group,
            topk_group,
            normalize: common.keys.norm_topk_prob.unwrap_or(true),
            routed_scaling_factor: own
                .routed_scaling_factor
                .unwrap_or(defaults.routed_scaling_factor)
                as f32,
        },
        weight_input: false,
        shared_expert_gate: false,
        activation: ExpertActivation::Silu,
    };
    let moe_layers = (0..common.num_layers).map(|l| l >= first_dense).collect();
    (moe, moe_layers)
}

/// Tensor names of the three projections of a SwiGLU block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertNames {
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

impl ExpertNames {
    /// `gate_proj`, `up_proj`, `down_proj`: dense MLPs and shared experts of every family,
    /// routed experts of most.
    pub const PROJ: ExpertNames = ExpertNames {
        gate: "gate_proj",
        up: "up_proj",
        down: "down_proj",
    };
}

/// Routed experts stored fused, all of a layer's in two tensors: `{prefix}.{gate_up}` of `[experts, hidden, 2 * intermediate]` (the input dimension first,
/// as `torch.bmm` takes it) and `{prefix}.{down}` of `[experts, intermediate, hidden]`, or
/// each expert's matrices `[out, in]` where [`FusedExperts::outputs_first`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedExperts {
    pub gate_up: &'static str,
    pub down: &'static str,
    /// Gate and up alternate along the last dimension (gpt-oss); else the gate's half comes
    /// first (Llama 4).
    pub interleaved: bool,
    /// Biases beside them: `{gate_up}_bias` `[experts, 2 * intermediate]` and `{down}_bias`
    /// `[experts, hidden]` (gpt-oss).
    pub bias: bool,
    /// Each expert's matrices `[out, in]`, as `nn.functional.linear` takes them: `{gate_up}`
    /// `[experts, 2 * intermediate, hidden]`, `{down}` `[experts, hidden, intermediate]`
    /// (Qwen3.5-MoE).
    pub outputs_first: bool,
    /// A checkpoint may store the experts apart instead, under the per-expert names
    /// ([`Family::routed_expert`]): transformers' `save_pretrained` writes Qwen3.5-MoE so while
    /// Qwen's releases hold them fused. Whether `{gate_up}` is present decides.
    pub or_apart: bool,
}

/// How a model writes tool calls (parsed by `crate::api::tool_calls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallFormat {
    /// Qwen3 (and Qwen2.5, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Hermes,
    /// DeepSeek-V3 and V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`
    /// (V3.1 writes `NAME<｜tool▁sep｜>ARGS` without the fence).
    DeepseekV3,
    /// Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>ARGS<|tool_call_end|>...<|tool_calls_section_end|>`.
    KimiK2,
    /// Mistral and Mixtral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or in
    /// newer tokenizers `[TOOL_CALLS]NAME[ARGS]{...}`.
    Mistral,
    /// GLM-4.5 to 4.7: `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>`
    /// (4.7 without the newlines), a string value as it is, any other as JSON.
    Glm,
    /// MiniMax-M2: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>\n</invoke>\n</minimax:tool_call>`,
    /// several `<invoke>`s in one block, a value read as GLM's are.
    MiniMax,
    /// gpt-oss (harmony): a call on the `commentary` channel addressed to a function,
    /// `...to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`.
    Harmony,
    /// DeepSeek-V3.2's DSML: `<｜DSML｜function_calls>\n<｜DSML｜invoke name="NAME">\n<｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>`,
    /// several invokes in one block; `string="true"` marks a value written as it is,
    /// `"false"` one written as JSON.
    DeepseekV32,
    /// DeepSeek-V4's DSML: V3.2's invokes in a `<｜DSML｜tool_calls>` block.
    DeepseekV4,
    /// Qwen3.5 (and Qwen3-Coder; vLLM's `qwen3_coder` parser): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`,
    /// a value read as GLM's are.
    Qwen3Coder,
}

/// Keys a multimodal wrapper keeps at its top level that belong to the text model too.
const WRAPPER_KEYS_FOR_TEXT: [&str; 5] = [
    "quantization_config",
    "eos_token_id",
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
];

/// The text model's config. A multimodal wrapper (Kimi K2.5: `model_type = "kimi_k25"`,
/// `KimiK25ForConditionalGeneration`) nests it under `text_config` beside a vision tower's,
/// with `quantization_config` at the top level; moe-node serves the text model. Returns the
/// config to read and, for a wrapper, its `model_type` (for display).
pub(super) fn text_model_config(value: Value) -> Result<(Value, Option<String>), Vec<String>> {
    let Value::Object(mut outer) = value else {
        return Err(vec!["cannot read it: not a JSON object".into()]);
    };
    let outer_type = outer.get("model_type").and_then(Value::as_str);
    let Some((family, wrapper)) = Family::ALL.into_iter().find_map(|family| {
        let wrapper = family
            .spec()
            .wrapper_types()
            .iter()
            .find(|&&w| Some(w) == outer_type)?;
        Some((family, *wrapper))
    }) else {
        return Ok((Value::Object(outer), None));
    };
    let Some(Value::Object(mut text)) = outer.remove("text_config") else {
        return Err(vec![format!(
            "model_type `{wrapper}` needs `text_config`, the text model's config"
        )]);
    };
    let text_type = text.get("model_type").and_then(Value::as_str);
    if !text_type.is_some_and(|t| family.model_types().contains(&t)) {
        return Err(vec![format!(
            "{wrapper}: text_config.model_type is {text_type:?}; moe-node serves {} text models",
            family.model_types().join(" or ")
        )]);
    }
    for key in WRAPPER_KEYS_FOR_TEXT {
        if !text.contains_key(key)
            && let Some(v) = outer.remove(key)
        {
            text.insert(key.to_string(), v);
        }
    }
    Ok((Value::Object(text), Some(wrapper.into())))
}

#[cfg(test)]
mod tests;
