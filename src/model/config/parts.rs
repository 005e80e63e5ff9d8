//! The parts of a model's configuration as plain data (attention, rope, experts and gate),
//! the keys every family reads, the limits on sizes, and the list of problems a config
//! collects: what `super` (the reading of a config) and the families both build on.

use serde::Deserialize;
use serde_json::Value;

/// Rotary embedding parameters, from `rope_theta`/`rope_scaling` or `rope_parameters`.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    /// Number of rotated dimensions per head.
    pub dim: usize,
    pub scaling: RopeScaling,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Position interpolation by a constant factor.
    Linear {
        factor: f64,
    },
    /// Llama 3's (`rope_type: llama3`, Llama 4 too): long wavelengths divided by `factor`,
    /// short ones kept, a smooth ramp between, as `_compute_llama3_parameters`.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// YaRN as transformers' `_compute_yarn_parameters` defines it.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        attention_factor: Option<f64>,
        truncate: bool,
    },
}

/// How the attention block is built.
#[derive(Debug, Clone, PartialEq)]
pub enum AttentionConfig {
    /// Grouped-query attention (Qwen3-MoE, Mixtral, GLM-4.5). Rope turns the first
    /// [`RopeConfig::dim`] values of each head: all of it but in GLM (`partial_rotary_factor`).
    Gqa {
        num_kv_heads: usize,
        head_dim: usize,
        /// An RMSNorm of the queries and keys before rope, and over what.
        qk_norm: QkNorm,
        bias: bool,
        sliding_window: Option<usize>,
        /// Rope turns interleaved pairs (Llama 4's complex form) rather than the two halves.
        interleave: bool,
        /// Per layer where layers differ (Llama 4, gpt-oss); empty where every layer is alike
        /// (rope, the norm above, `sliding_window`).
        layers: Vec<LayerAttention>,
        /// A learned sink per head (gpt-oss `self_attn.sinks`): one more logit in each
        /// query's softmax, with no value.
        sinks: bool,
        /// The output projection has a bias (gpt-oss; read where present whatever this says,
        /// counted by `plan` where it says so).
        o_bias: bool,
        /// Each head's output is scaled by the sigmoid of a gate projected with the queries
        /// (Qwen3-Next, Qwen3.5): `q_proj` is twice as wide, each head's query followed by
        /// its gate.
        output_gate: bool,
    },
    /// Multi-head latent attention (DeepSeek-V3, Kimi K2).
    Mla {
        q_lora_rank: Option<usize>,
        kv_lora_rank: usize,
        qk_nope_head_dim: usize,
        qk_rope_head_dim: usize,
        v_head_dim: usize,
        /// Rope applied to interleaved pairs (DeepSeek's weight layout).
        interleave: bool,
        bias: bool,
        /// DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): each query attends only to the
        /// positions its layer's lightning indexer picks.
        indexer: Option<LightningIndexer>,
    },
}

/// DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5), as transformers'
/// `DeepseekV32Indexer` computes it: `num_heads` small queries (from the MLA's low-rank query)
/// score every position up to the query's own against one small key per position (`head_dim`
/// values, layer-normed, rope over its first `qk_rope_head_dim`), `sum_h w_h relu(q_h . k)`
/// with per-head weights projected from the input, and the MLA attends only to the `topk`
/// best (every position while there are no more than `topk`). The keys are a second cache
/// per layer beside the MLA latents: `head_dim` floats per position.
#[derive(Debug, Clone, PartialEq)]
pub struct LightningIndexer {
    pub num_heads: usize,
    pub head_dim: usize,
    pub topk: usize,
    /// Its rope turns interleaved pairs (GLM-5) rather than the two halves (DeepSeek-V3.2).
    pub rope_interleave: bool,
    /// Per layer: true where the layer runs an indexer of its own and keeps its keys; false
    /// where it reuses the choice of the last layer that did (GLM-5's `shared` layers).
    pub own: Vec<bool>,
}

impl LightningIndexer {
    /// Whether layer `layer` runs its own indexer.
    pub fn has_own(&self, layer: usize) -> bool {
        self.own.get(layer).copied().unwrap_or(false)
    }

    /// Layers that run their own indexer, and keep its keys.
    pub fn count(&self) -> usize {
        self.own.iter().filter(|&&own| own).count()
    }
}

/// Gated DeltaNet (Qwen3-Next, Qwen3.5), the linear attention of a hybrid model's
/// `linear_attention` layers: each value head keeps a `key_head_dim x value_head_dim` state
/// that decays and takes a delta-rule update per token, after a causal depthwise convolution
/// of `conv_kernel` positions over the projected q, k and v. What a sequence keeps of it is a
/// fixed size, not one entry per position ([`LinearAttention::state_floats`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LinearAttention {
    pub num_key_heads: usize,
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
    /// Per layer: true where the layer is linear attention (the others run the model's
    /// [`AttentionConfig`]).
    pub layers: Vec<bool>,
    /// Qwen3-Next stores the projections fused and grouped per key head (`in_proj_qkvz`,
    /// `in_proj_ba`); Qwen3.5 apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).
    pub fused_projections: bool,
}

impl LinearAttention {
    /// Width of the queries (and of the keys): every key head's.
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }

    /// Width of the values (and of the output gate).
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }

    /// Channels of the convolution: queries, keys and values.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Floats one sequence keeps per linear layer: the recurrent state of every value head
    /// and the convolution's window of the last `conv_kernel - 1` inputs.
    pub fn state_floats(&self) -> usize {
        self.num_value_heads * self.key_head_dim * self.value_head_dim
            + self.conv_dim() * self.conv_kernel.saturating_sub(1)
    }

    /// Layers that are linear attention.
    pub fn count(&self) -> usize {
        self.layers.iter().filter(|&&linear| linear).count()
    }

    /// Whether layer `layer` is linear attention.
    pub fn is_linear(&self, layer: usize) -> bool {
        self.layers.get(layer).copied().unwrap_or(false)
    }
}

/// What one GQA layer does where a family's layers differ.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerAttention {
    /// Rope turns its queries and keys (Llama 4's NoPE layers: not).
    pub rope: bool,
    /// Which earlier positions a query sees.
    pub span: Span,
    /// An RMSNorm without weight over each q and k head (Llama 4's `use_qk_norm`, on its
    /// rope layers).
    pub unit_qk_norm: bool,
    /// Llama 4's attention temperature tuning (on its NoPE layers): each query times
    /// `1 + attn_scale * ln(1 + floor((position + 1) / floor_scale))`.
    pub temperature: Option<Temperature>,
}

/// Which keys a query at a position sees, besides those after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Span {
    Full,
    /// The last `n` positions, its own included.
    Window(usize),
    /// Those in its own chunk of `n` positions (Llama 4's `attention_chunk_size`).
    Chunk(usize),
}

impl Span {
    /// The first position a query at `position` sees (a non-decreasing function of it).
    pub fn start(self, position: usize) -> usize {
        match self {
            Span::Full => 0,
            Span::Window(n) => (position + 1).saturating_sub(n),
            Span::Chunk(n) => position - position % n.max(1),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Temperature {
    pub floor_scale: f32,
    pub attn_scale: f32,
}

impl Temperature {
    /// The factor on the queries at `position`.
    pub fn scale(self, position: usize) -> f32 {
        let floor = ((position as f32 + 1.0) / self.floor_scale).floor();
        floor.ln_1p() * self.attn_scale + 1.0
    }
}

/// Where GQA's queries and keys are RMS-normed before rope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Over each head, one `head_dim` weight shared by the heads (Qwen3, GLM-4.5).
    PerHead,
    /// Over each row's whole projection, one weight per value (MiniMax-M2's
    /// `qk_norm_type: per_layer`): `q_norm` of `heads * head_dim`, `k_norm` of
    /// `kv_heads * head_dim`.
    PerLayer,
}

impl QkNorm {
    /// The widths of the q and k norms' weights.
    pub fn widths(self, heads: usize, kv_heads: usize, head_dim: usize) -> Option<(usize, usize)> {
        match self {
            QkNorm::None => None,
            QkNorm::PerHead => Some((head_dim, head_dim)),
            QkNorm::PerLayer => Some((heads * head_dim, kv_heads * head_dim)),
        }
    }
}

pub use crate::compute::gate::GatingConfig;

#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate_size: usize,
    /// Intermediate size of the always-on shared expert MLP, 0 when there is none.
    pub shared_intermediate_size: usize,
    pub gating: GatingConfig,
    /// The gate weight scales each expert's input rather than its output (Llama 4).
    pub weight_input: bool,
    /// The shared expert's output is scaled by the sigmoid of its own one-row gate
    /// (`shared_expert_gate`: Qwen3-Next, Qwen3.5).
    pub shared_expert_gate: bool,
    pub activation: ExpertActivation,
}

/// The routed experts' activation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertActivation {
    /// `down(silu(gate) * up)`.
    Silu,
    /// gpt-oss: `down((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g))` with
    /// `g = min(gate, limit)`, every projection with a bias. Loaded as a SwiGLU block whose
    /// gate is scaled by `alpha`, whose up has 1 added and is divided by `alpha`, each with
    /// its outputs clamped ([`crate::compute::cpu::Linear::clamp`]): the same function, so
    /// every executor computes it unchanged.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

/// The keys every family reads, under the same name and meaning. Everything is optional here
/// so that every missing key is reported at once by [`ModelConfig::from_raw`] rather than one
/// by one by serde.
#[derive(Debug, Default, Deserialize)]
pub(in crate::model) struct CommonKeys {
    pub model_type: Option<String>,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub hidden_act: Option<String>,
    pub rms_norm_eps: Option<f64>,
    pub max_position_embeddings: Option<usize>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<Value>,
    pub rope_parameters: Option<Value>,
    pub eos_token_id: Option<Value>,
    pub torch_dtype: Option<String>,
    pub dtype: Option<String>,
    pub quantization_config: Option<Value>,
    pub num_experts_per_tok: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    pub norm_topk_prob: Option<bool>,
}

/// Upper bound on `num_hidden_layers` accepted from a config.
pub const MAX_LAYERS: usize = 1024;
/// Upper bound on `max_position_embeddings`: 32 M tokens, above any published context.
pub const MAX_CONTEXT: usize = 1 << 25;

/// Collects every problem with a config before failing.
pub(in crate::model) struct Problems(pub Vec<String>);

impl Problems {
    /// A size the model cannot do without: present and greater than zero.
    pub fn require(&mut self, value: Option<usize>, key: &str) -> usize {
        match value {
            Some(0) => {
                self.0.push(format!("`{key}` must be greater than 0"));
                0
            }
            Some(v) => v,
            None => {
                self.0.push(format!("missing key `{key}`"));
                0
            }
        }
    }

    pub fn check(&mut self, ok: bool, message: impl FnOnce() -> String) {
        if !ok {
            self.0.push(message());
        }
    }
}
