//! Per-sequence key/value cache: what attention keeps of past tokens so that each decode
//! step computes only the new token. It lives where the engine runs attention: in host
//! memory, or on the GPU that runs the dense part of the model.

use crate::engine::gpu::model::DeviceCache;
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
#[derive(Debug)]
pub struct KvCache {
    /// Host layers; empty when the cache is on a GPU.
    pub(crate) layers: Vec<LayerCache>,
    pub(crate) device: Option<DeviceCache>,
    len: usize,
}

impl LayerCache {
    /// Values per position in `first`.
    pub fn first_width(&self) -> usize {
        self.first_width
    }

    /// Values per position in `second`.
    pub fn second_width(&self) -> usize {
        self.second_width
    }
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
            device: None,
            len: 0,
        }
    }

    /// An empty cache held on a GPU.
    pub(crate) fn on_device(cache: DeviceCache) -> Self {
        KvCache {
            layers: Vec::new(),
            device: Some(cache),
            len: 0,
        }
    }

    /// A copy of this cache when it is in host memory (`None` on a GPU: see
    /// [`crate::engine::Engine::fork_cache`]).
    pub fn host_copy(&self) -> Option<Self> {
        if self.device.is_some() {
            return None;
        }
        Some(KvCache {
            layers: self.layers.clone(),
            device: None,
            len: self.len,
        })
    }

    /// This cache holding `len` positions (a device cache filled by a copy).
    pub(crate) fn with_len(mut self, len: usize) -> Self {
        self.len = len;
        self
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
    /// half-way must leave the sequence as it was). On a GPU, positions past `len` are
    /// simply overwritten by the next step.
    pub(crate) fn rollback(&mut self) {
        for layer in &mut self.layers {
            layer.first.truncate(self.len * layer.first_width);
            layer.second.truncate(self.len * layer.second_width);
        }
    }

    /// Keeps only the first `len` cached positions.
    pub(crate) fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        self.rollback();
    }

    /// Forgets every cached position and gives the memory back (a preempted sequence
    /// recomputes its cache when it runs again).
    pub(crate) fn release(&mut self) {
        self.len = 0;
        for layer in &mut self.layers {
            layer.first = Vec::new();
            layer.second = Vec::new();
        }
        if let Some(device) = &mut self.device {
            device.release();
        }
    }

    /// Bytes one cached position takes in each of `layers` layers (f32 on the host and on
    /// a GPU alike).
    pub fn bytes_per_position(cfg: &ModelConfig) -> usize {
        let widths = match cfg.attention {
            AttentionConfig::Gqa {
                num_kv_heads,
                head_dim,
                ..
            } => 2 * num_kv_heads * head_dim,
            AttentionConfig::Mla {
                kv_lora_rank,
                qk_rope_head_dim,
                ..
            } => kv_lora_rank + qk_rope_head_dim,
        };
        cfg.num_layers * widths * 4
    }

    /// Bytes held, for memory accounting (GPU memory for a cache on a GPU).
    pub fn bytes(&self) -> usize {
        if let Some(device) = &self.device {
            return device.bytes();
        }
        let floats: usize = self
            .layers
            .iter()
            .map(|l| l.first.len() + l.second.len())
            .sum();
        floats * 4
    }
}
