//! Per-sequence key/value cache: what attention keeps of past tokens so that each decode
//! step computes only the new token.

use crate::model::config::{AttentionConfig, ModelConfig};

/// One layer's cache: two position-major arrays whose meaning depends on the attention kind.
/// GQA keeps keys and values (`kv_heads * head_dim` each per position); MLA keeps only the
/// normalised latent (`kv_lora_rank`) and the shared rotary key (`qk_rope_head_dim`).
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// Keys (GQA) or latents (MLA).
    pub first: Vec<f32>,
    /// Values (GQA) or rotary keys (MLA).
    pub second: Vec<f32>,
    first_width: usize,
    second_width: usize,
}

/// The cache of one sequence across all layers.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    len: usize,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig) -> Self {
        let (first_width, second_width) = match cfg.attention {
            AttentionConfig::Gqa {
                num_kv_heads,
                head_dim,
                ..
            } => (num_kv_heads * head_dim, num_kv_heads * head_dim),
            AttentionConfig::Mla {
                kv_lora_rank,
                qk_rope_head_dim,
                ..
            } => (kv_lora_rank, qk_rope_head_dim),
        };
        let layer = LayerCache {
            first: Vec::new(),
            second: Vec::new(),
            first_width,
            second_width,
        };
        KvCache {
            layers: vec![layer; cfg.num_layers],
            len: 0,
        }
    }

    /// Positions already cached; the next token goes at this position.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Counts `tokens` appended positions as cached.
    pub(crate) fn advance(&mut self, tokens: usize) {
        self.len += tokens;
    }

    /// Drops whatever a step appended beyond the cached positions (a step that failed
    /// half-way must leave the sequence as it was).
    pub(crate) fn rollback(&mut self) {
        for layer in &mut self.layers {
            layer.first.truncate(self.len * layer.first_width);
            layer.second.truncate(self.len * layer.second_width);
        }
    }

    /// Bytes held, for memory accounting.
    pub fn bytes(&self) -> usize {
        let floats: usize = self
            .layers
            .iter()
            .map(|l| l.first.len() + l.second.len())
            .sum();
        floats * 4
    }
}
