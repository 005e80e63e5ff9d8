//! Per-sequence key/value cache: what attention keeps of past tokens so that each decode
//! step computes only the new token. It lives where the engine runs attention: in host
//! memory, or on the GPU that runs the dense part of the model.

use crate::engine::deepseek_v4::V4LayerState;
use crate::engine::gpu::model::DeviceCache;
use crate::model::config::{AttentionConfig, ModelConfig};

/// One layer's cache: two position-major arrays whose meaning depends on the attention kind.
/// GQA keeps keys and values (`kv_heads * head_dim` each per position); MLA keeps only the
/// normalised latent (`kv_lora_rank`) and the shared rotary key (`qk_rope_head_dim`). A
/// linear-attention layer keeps no position: its arrays stay empty and it holds a
/// [`LinearState`] instead. A layer with a lightning indexer of its own (DeepSeek Sparse
/// Attention) keeps a third array beside the MLA's: the indexer's key per position. A
/// DeepSeek-V4 layer keeps no array either: it holds a [`CompressedState`].
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// Keys (GQA) or latents (MLA).
    pub first: Vec<f32>,
    /// Values (GQA) or rotary keys (MLA).
    pub second: Vec<f32>,
    first_width: usize,
    second_width: usize,
    /// A linear-attention layer's state (Qwen3-Next's gated DeltaNet).
    pub(crate) linear: Option<LinearState>,
    /// The lightning indexer's keys (`indexer_width` per position); empty on layers without
    /// an indexer of their own.
    pub(crate) indexer_keys: Vec<f32>,
    indexer_width: usize,
    /// A DeepSeek-V4 layer's state.
    pub(crate) compressed: Option<CompressedState>,
}

/// What a linear-attention layer keeps of a sequence: the summary of every position so far,
/// a fixed size whatever their number. It cannot be cut back to fewer positions (a prefix
/// is reused only where it ends exactly: see `super::prefix`), and a preempted sequence
/// recomputes it from its tokens.
#[derive(Debug, Clone, Default)]
pub struct LinearState {
    /// `[value_heads, key_head_dim, value_head_dim]`; empty (all zeros) before the first step.
    pub recurrent: Vec<f32>,
    /// `[kernel - 1, conv_dim]`: the convolution's last inputs, oldest first; empty (zeros)
    /// before the first step.
    pub conv: Vec<f32>,
    /// The state after the step in flight (recurrent, conv), which becomes the state when
    /// the whole step succeeds.
    pub next: Option<(Vec<f32>, Vec<f32>)>,
}

/// What a DeepSeek-V4 layer keeps of a sequence (`super::deepseek_v4`): the window of its last
/// keys, the compressor's entries and the indexer's keys (one each every `ratio` positions),
/// and the compressors' unfinished windows. Its entries grow with the positions, but the
/// window forgets the oldest keys and the unfinished windows are those of the last positions:
/// like a [`LinearState`] it cannot be cut back to fewer positions, so a prefix is reused only
/// where it ends exactly and a preempted sequence recomputes it.
#[derive(Debug, Clone, Default)]
pub struct CompressedState {
    pub(crate) state: V4LayerState,
    /// The state after the step in flight, which becomes the state when the whole step
    /// succeeds.
    pub(crate) next: Option<V4LayerState>,
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

    /// Values per position in the indexer's keys (0 without an indexer of its own).
    pub fn indexer_width(&self) -> usize {
        self.indexer_width
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
            linear: None,
            indexer_keys: Vec::new(),
            indexer_width: 0,
            compressed: None,
        };
        let mut layers = vec![layer; cfg.num_layers];
        if let AttentionConfig::Mla {
            indexer: Some(indexer),
            ..
        } = &cfg.attention
        {
            for (l, cache) in layers.iter_mut().enumerate() {
                if indexer.has_own(l) {
                    cache.indexer_width = indexer.head_dim;
                }
            }
        }
        if let Some(linear) = &cfg.linear_attention {
            for (l, cache) in layers.iter_mut().enumerate() {
                if linear.is_linear(l) {
                    cache.first_width = 0;
                    cache.second_width = 0;
                    cache.linear = Some(LinearState::default());
                }
            }
        }
        if cfg.deepseek_v4.is_some() {
            for cache in &mut layers {
                cache.first_width = 0;
                cache.second_width = 0;
                cache.compressed = Some(CompressedState::default());
            }
        }
        KvCache {
            layers,
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

    /// Counts `tokens` appended positions as cached; linear and DeepSeek-V4 layers' states
    /// move on to what the step computed.
    pub(crate) fn advance(&mut self, tokens: usize) {
        self.len += tokens;
        for state in self.layers.iter_mut().filter_map(|l| l.linear.as_mut()) {
            if let Some((recurrent, conv)) = state.next.take() {
                state.recurrent = recurrent;
                state.conv = conv;
            }
        }
        for compressed in self.layers.iter_mut().filter_map(|l| l.compressed.as_mut()) {
            if let Some(next) = compressed.next.take() {
                compressed.state = next;
            }
        }
    }

    /// Drops whatever a step appended beyond the cached positions (a step that failed
    /// half-way must leave the sequence as it was). On a GPU, positions past `len` are
    /// simply overwritten by the next step, and blocks past them go back to the pool (the
    /// batcher counts the blocks of `len` positions).
    pub(crate) fn rollback(&mut self) {
        if let Some(device) = &mut self.device {
            device.keep_positions(self.len);
        }
        for layer in &mut self.layers {
            layer.first.truncate(self.len * layer.first_width);
            layer.second.truncate(self.len * layer.second_width);
            layer.indexer_keys.truncate(self.len * layer.indexer_width);
            if let Some(state) = &mut layer.linear {
                state.next = None;
            }
            if let Some(compressed) = &mut layer.compressed
                && let Some(next) = compressed.next.take()
            {
                compressed.state.restore(next);
            }
        }
    }

    /// Of the blocks this cache's positions take, what other caches hold too, each block
    /// counted as this cache's share of it (`1 - 1/holders`): on a GPU, copies of a cache (a
    /// kept prompt prefix, a prompt's choices) share its whole blocks. 0 in host memory,
    /// where a copy is a copy.
    pub fn shared_blocks(&self) -> f64 {
        self.device.as_ref().map_or(0.0, |d| d.shared_blocks())
    }

    /// Whether the cache is on a GPU, where copies share blocks.
    pub fn on_gpu(&self) -> bool {
        self.device.is_some()
    }

    /// Whether some layer keeps a state that cannot be cut back to fewer positions (linear
    /// attention, DeepSeek-V4's windows).
    pub fn has_state(&self) -> bool {
        self.device.as_ref().is_some_and(|d| d.keeps_state())
            || self
                .layers
                .iter()
                .any(|l| l.linear.is_some() || l.compressed.is_some())
    }

    /// Whether [`KvCache::truncate`] can keep `len` positions exactly: any number where
    /// every layer keeps positions, only all of them where a layer keeps a state.
    pub fn can_truncate_to(&self, len: usize) -> bool {
        len >= self.len || !self.has_state()
    }

    /// Keeps only the first `len` cached positions. A cache with a linear layer's state
    /// cannot go back to fewer positions: it forgets everything instead (the sequence then
    /// recomputes), so that it never holds a state of other positions than it counts.
    pub(crate) fn truncate(&mut self, len: usize) {
        if !self.can_truncate_to(len) {
            self.release();
            return;
        }
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
            layer.indexer_keys = Vec::new();
            if let Some(state) = &mut layer.linear {
                *state = LinearState::default();
            }
            if let Some(compressed) = &mut layer.compressed {
                *compressed = CompressedState::default();
            }
        }
        if let Some(device) = &mut self.device {
            device.release();
        }
    }

    /// Bytes one sequence's linear-attention states (or DeepSeek-V4's windows and unfinished
    /// windows) take, however long it is (f32): the fixed part of its cache, 0 for a model
    /// without such layers.
    pub fn state_bytes(cfg: &ModelConfig) -> usize {
        if let Some(v4) = &cfg.deepseek_v4 {
            return v4.cache_bytes_per_sequence() as usize;
        }
        cfg.linear_attention
            .as_ref()
            .map_or(0, |linear| linear.count() * linear.state_floats() * 4)
    }

    /// Bytes one cached position takes in the lightning indexers' keys (f32), 0 for a model
    /// without DeepSeek Sparse Attention: a part of [`KvCache::bytes_per_position`].
    pub fn indexer_bytes_per_position(cfg: &ModelConfig) -> usize {
        match &cfg.attention {
            AttentionConfig::Mla {
                indexer: Some(indexer),
                ..
            } => {
                let layers = indexer.own.iter().take(cfg.num_layers).filter(|&&o| o);
                layers.count() * indexer.head_dim * 4
            }
            _ => 0,
        }
    }

    /// Bytes one cached position takes on a GPU: bf16, in the GPU's pool of blocks
    /// ([`KvPool`](crate::engine::gpu::model::KvPool)).
    pub fn gpu_bytes_per_position(cfg: &ModelConfig) -> usize {
        crate::engine::gpu::model::KvPool::block_bytes(cfg) / crate::compute::cuda::dense::KV_BLOCK
    }

    /// Bytes one cached position takes in host memory, in each of the layers that keep
    /// positions (f32), the indexers' keys included. DeepSeek-V4's: its compressed entries
    /// and indexer keys, one every `ratio` positions, averaged (rounded up).
    pub fn bytes_per_position(cfg: &ModelConfig) -> usize {
        if let Some(v4) = &cfg.deepseek_v4 {
            return v4.cache_bytes_per_position() as usize;
        }
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
        let linear = cfg.linear_attention.as_ref().map_or(0, |l| l.count());
        cfg.num_layers.saturating_sub(linear) * widths * 4 + Self::indexer_bytes_per_position(cfg)
    }

    /// Bytes held, for memory accounting (GPU memory for a cache on a GPU).
    pub fn bytes(&self) -> usize {
        if let Some(device) = &self.device {
            return device.bytes();
        }
        let floats: usize = self
            .layers
            .iter()
            .map(|l| {
                let state = l
                    .linear
                    .as_ref()
                    .map_or(0, |s| s.recurrent.len() + s.conv.len())
                    + l.compressed.as_ref().map_or(0, |c| c.state.floats());
                l.first.len() + l.second.len() + l.indexer_keys.len() + state
            })
            .sum();
        floats * 4
    }
}
