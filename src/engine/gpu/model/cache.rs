//! KV caches in GPU memory, paged and in bf16: one pool per GPU holds every sequence's cached
//! positions in blocks of [`KV_BLOCK`] positions, and a sequence's cache is the list of its blocks (its block
//! table). The pool is allocated once, at the size of the KV budget the batcher admits by
//! ([`GpuModel::reserve_kv_cache`](super::GpuModel::reserve_kv_cache)), so what the batcher
//! counts is what the GPU holds: no cache grows by copying, none is over-allocated, and the
//! whole budget is usable (a cache that doubled as it grew needed half of it held back). The
//! attention kernels read through the block tables. A hybrid model's sequences also keep the
//! states of its linear-attention layers, a fixed size per sequence: in blocks of the same
//! pool (those blocks' pages in every full-attention layer), which is how the batcher counts
//! them too (`KvBudget::state_blocks`). And the work buffers of one step.
//!
//! A copy of a cache (a kept prompt prefix, a prompt's `n` choices) shares the source's
//! whole blocks, counted per holder, and copies only its last, partial block and its states:
//! a sequence writes only at positions past its length, which lie in blocks of its own, and
//! a block that is shared where a step will write (a copy cut back to fewer positions) is
//! made its own first ([`DeviceCache::make_writable`]).

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaStream, DeviceRepr, result};

use crate::compute::cuda::CudaError;
use crate::compute::cuda::dense::KV_BLOCK;
use crate::compute::cuda::experts::Buffer;
use crate::model::config::{AttentionConfig, ModelConfig};

/// Every sequence's cached positions on one GPU: per array (keys and values for GQA; MLA
/// keeps one, `[latent | rotary key]` per position, and its values are the keys) one
/// allocation of `[layers, blocks, KV_BLOCK, width]` bf16, handed out a block (the same block
/// in every layer) at a time. bf16 as the serving systems keep it: half of f32, and the
/// attention's sums stay f32.
pub struct KvPool {
    arrays: [Option<Buffer>; 2],
    widths: [usize; 2],
    /// Per model layer, its index among the layers that keep positions (a linear-attention
    /// layer keeps none, and has no part of the arrays).
    slots: Vec<Option<usize>>,
    /// Layers that keep positions.
    layers: usize,
    blocks: usize,
    /// Blocks one sequence's linear-attention states take (0: the model has none).
    state_blocks: usize,
    /// Blocks no cache holds, and how many caches hold each block.
    held: Mutex<Held>,
}

/// The pool's bookkeeping: the free blocks, and per block the caches holding it.
struct Held {
    free: Vec<u32>,
    holders: Vec<u32>,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("widths", &self.widths)
            .field("layers", &self.layers)
            .field("blocks", &self.blocks)
            .finish()
    }
}

/// Bytes of one cached value.
const VALUE_BYTES: usize = 2;

/// Per layer, its index among those that keep positions: every layer but a hybrid model's
/// linear-attention ones.
fn position_slots(config: &ModelConfig) -> Vec<Option<usize>> {
    let mut next = 0;
    (0..config.num_layers)
        .map(|l| match &config.linear_attention {
            Some(linear) if linear.is_linear(l) => None,
            _ => {
                next += 1;
                Some(next - 1)
            }
        })
        .collect()
}

/// f32 values a sequence's linear-attention states take (every linear layer's recurrent state
/// and convolution window), 0 for a model without them.
pub(super) fn state_floats(config: &ModelConfig) -> usize {
    config
        .linear_attention
        .as_ref()
        .map_or(0, |l| l.count() * l.state_floats())
}

/// The widths (values) of a position's two cached arrays (0: the array is not kept).
fn cache_widths(config: &ModelConfig) -> [usize; 2] {
    match config.attention {
        AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            ..
        } => [num_kv_heads * head_dim, num_kv_heads * head_dim],
        AttentionConfig::Mla {
            kv_lora_rank,
            qk_rope_head_dim,
            ..
        } => [kv_lora_rank + qk_rope_head_dim, 0],
    }
}

impl KvPool {
    /// A pool of `blocks` blocks for `config`'s caches on `stream`'s GPU.
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        config: &ModelConfig,
        blocks: usize,
    ) -> Result<KvPool, CudaError> {
        let widths = cache_widths(config);
        let slots = position_slots(config);
        let layers = slots.iter().flatten().count();
        let state_floats = state_floats(config);
        let state_blocks = Self::state_blocks(config);
        if state_floats > 0 && (layers == 0 || widths[0] != widths[1]) {
            return Err(CudaError::Unsupported(
                "linear-attention states beside no GQA layer to page them in".into(),
            ));
        }
        let mut arrays = [None, None];
        for (array, &width) in arrays.iter_mut().zip(&widths) {
            if width > 0 {
                *array = Some(Buffer::new(
                    stream,
                    layers * blocks * KV_BLOCK * width * VALUE_BYTES,
                )?);
            }
        }
        Ok(KvPool {
            arrays,
            widths,
            slots,
            layers,
            blocks,
            state_blocks,
            held: Mutex::new(Held {
                free: (0..blocks as u32).rev().collect(),
                holders: vec![0; blocks],
            }),
        })
    }

    /// Bytes one block takes over every layer that keeps positions and each of its arrays.
    pub fn block_bytes(config: &ModelConfig) -> usize {
        let [a, b] = cache_widths(config);
        let layers = position_slots(config).iter().flatten().count();
        layers * KV_BLOCK * (a + b) * VALUE_BYTES
    }

    /// Blocks one sequence's linear-attention states take (0 for a model without them): as
    /// `KvBudget::with_state` counts them.
    pub fn state_blocks(config: &ModelConfig) -> usize {
        (state_floats(config) * 4).div_ceil(Self::block_bytes(config).max(1))
    }

    /// f32 values of a page: one block of one array of one layer.
    fn page_floats(&self) -> usize {
        KV_BLOCK * self.widths[0] * VALUE_BYTES / 4
    }

    /// The pages of `blocks`, in order: each block's page in every layer and array.
    fn pages<'a>(&'a self, blocks: &'a [u32]) -> impl Iterator<Item = u64> + 'a {
        let page_bytes = KV_BLOCK * self.widths[0] * VALUE_BYTES;
        blocks.iter().flat_map(move |&block| {
            (0..self.layers).flat_map(move |slot| {
                self.arrays.iter().flatten().map(move |array| {
                    array.ptr + ((slot * self.blocks + block as usize) * page_bytes) as u64
                })
            })
        })
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Blocks no cache holds now.
    pub fn free_blocks(&self) -> usize {
        self.held().free.len()
    }

    /// Layer `layer`'s pool of array `which` (`[blocks, KV_BLOCK, width]` bf16); 0 where the
    /// array is not kept (or the layer keeps no positions).
    pub(super) fn layer(&self, layer: usize, which: usize) -> u64 {
        let Some(Some(slot)) = self.slots.get(layer) else {
            return 0;
        };
        self.slots_array(*slot, which)
    }

    fn slots_array(&self, slot: usize, which: usize) -> u64 {
        self.arrays[which].as_ref().map_or(0, |b| {
            b.ptr + (slot * self.blocks * KV_BLOCK * self.widths[which] * VALUE_BYTES) as u64
        })
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `n` blocks, each held once, or none when fewer are free.
    fn take(&self, n: usize) -> Result<Vec<u32>, CudaError> {
        let mut held = self.held();
        if held.free.len() < n {
            return Err(CudaError::KvCacheFull {
                needed: n,
                free: held.free.len(),
                blocks: self.blocks,
            });
        }
        let at = held.free.len() - n;
        let taken = held.free.split_off(at);
        for &block in &taken {
            held.holders[block as usize] = 1;
        }
        Ok(taken)
    }

    /// `blocks` held once more (by a copy of a cache that holds them).
    fn share(&self, blocks: &[u32]) {
        let mut held = self.held();
        for &block in blocks {
            held.holders[block as usize] += 1;
        }
    }

    /// Whether more than one cache holds `block`.
    fn shared(&self, block: u32) -> bool {
        self.held().holders[block as usize] > 1
    }

    /// What counting `blocks` as one cache's whole overstates: `1 - 1/holders` for each
    /// block others hold too, over the leading run of such blocks (a copy shares its
    /// source's first blocks, and nothing after them).
    fn shared_excess(&self, blocks: &[u32]) -> f64 {
        let held = self.held();
        blocks
            .iter()
            .map(|&b| held.holders[b as usize])
            .take_while(|&holders| holders > 1)
            .map(|holders| 1.0 - 1.0 / holders as f64)
            .sum()
    }

    /// Lets go of `blocks` (emptied): a block no cache holds any more is free again.
    fn give_back(&self, blocks: &mut Vec<u32>) {
        let mut held = self.held();
        for block in blocks.drain(..) {
            let holders = &mut held.holders[block as usize];
            *holders = holders.saturating_sub(1);
            if *holders == 0 {
                held.free.push(block);
            }
        }
    }

    /// The copies, as (from, to, bytes), that make blocks `to` hold what blocks `from` hold,
    /// in every layer and array.
    fn block_copies(&self, from: &[u32], to: &[u32]) -> Vec<(u64, u64, usize)> {
        let mut pairs = Vec::new();
        for slot in 0..self.layers {
            for which in 0..2 {
                let width = self.widths[which];
                if width == 0 {
                    continue;
                }
                let base = self.slots_array(slot, which);
                let block_bytes = KV_BLOCK * width * VALUE_BYTES;
                for (&from, &to) in from.iter().zip(to) {
                    pairs.push((
                        base + (from as usize * block_bytes) as u64,
                        base + (to as usize * block_bytes) as u64,
                        block_bytes,
                    ));
                }
            }
        }
        pairs
    }
}

/// One sequence's cache on a GPU: its blocks of the GPU's [`KvPool`], in position order, and
/// the blocks holding its linear-attention states (a hybrid model's; taken with the first
/// positions). Empty (and of no pool) until its first step; the blocks go back to the pool
/// when it is released or dropped (later work on the GPU's one stream is ordered after this
/// one's).
pub struct DeviceCache {
    pool: Option<Arc<KvPool>>,
    blocks: Vec<u32>,
    state: Vec<u32>,
    max_positions: usize,
    keeps_state: bool,
}

impl std::fmt::Debug for DeviceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCache")
            .field("blocks", &self.blocks.len())
            .field("state_blocks", &self.state.len())
            .finish()
    }
}

impl Drop for DeviceCache {
    fn drop(&mut self) {
        self.release();
    }
}

impl DeviceCache {
    /// An empty cache for one sequence of a model; it takes blocks as it grows.
    pub fn new(config: &ModelConfig) -> DeviceCache {
        DeviceCache {
            pool: None,
            blocks: Vec::new(),
            state: Vec::new(),
            max_positions: config.max_position_embeddings,
            keeps_state: state_floats(config) > 0,
        }
    }

    /// Whether the cache keeps linear-attention states, which sum up all its positions and
    /// cannot be cut back to fewer.
    pub fn keeps_state(&self) -> bool {
        self.keeps_state
    }

    /// Gives the blocks back; the cache grows again from empty.
    pub fn release(&mut self) {
        if let Some(pool) = &self.pool {
            pool.give_back(&mut self.blocks);
            pool.give_back(&mut self.state);
        }
    }

    /// Blocks this cache holds with others, each counted as its share: what the batcher
    /// takes off its count of the cache's blocks, so that a shared block counts once over
    /// all its holders.
    pub fn shared_blocks(&self) -> f64 {
        self.pool
            .as_ref()
            .map_or(0.0, |pool| pool.shared_excess(&self.blocks))
    }

    /// Gives back the blocks past the first `positions` positions.
    pub fn keep_positions(&mut self, positions: usize) {
        let keep = positions.div_ceil(KV_BLOCK);
        if let Some(pool) = &self.pool
            && self.blocks.len() > keep
        {
            pool.give_back(&mut self.blocks.split_off(keep));
        }
    }

    /// Bytes of GPU memory held.
    pub fn bytes(&self) -> usize {
        self.pool.as_ref().map_or(0, |pool| {
            (self.blocks.len() + self.state.len())
                * pool.layers
                * KV_BLOCK
                * (pool.widths[0] + pool.widths[1])
                * VALUE_BYTES
        })
    }

    /// The cache's blocks, in position order.
    pub(super) fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// The addresses of the pages holding the cache's states, in order, each
    /// [`DeviceCache::page_floats`] f32 (none before its first step or without states).
    pub(super) fn state_pages(&self) -> Vec<u64> {
        self.pool
            .as_ref()
            .map_or(Vec::new(), |pool| pool.pages(&self.state).collect())
    }

    /// f32 values of one state page.
    pub(super) fn page_floats(&self) -> usize {
        self.pool.as_ref().map_or(0, |pool| pool.page_floats())
    }

    /// Makes room for `positions` positions, taking blocks of `pool` (the pool of every
    /// cache of this GPU), and for the states where the model keeps them.
    pub(super) fn reserve(
        &mut self,
        pool: &Arc<KvPool>,
        positions: usize,
    ) -> Result<(), CudaError> {
        match &self.pool {
            Some(own) if !Arc::ptr_eq(own, pool) => {
                return Err(CudaError::Unsupported(
                    "a KV cache of another GPU's pool".into(),
                ));
            }
            Some(_) => {}
            None => self.pool = Some(pool.clone()),
        }
        let positions = positions.min(self.max_positions.max(positions));
        let needed = positions.div_ceil(KV_BLOCK);
        let state = if self.state.is_empty() {
            pool.state_blocks
        } else {
            0
        };
        if needed + state > self.blocks.len() {
            let mut more = pool.take(needed.saturating_sub(self.blocks.len()) + state)?;
            self.state.extend(more.drain(..state));
            self.blocks.append(&mut more);
        }
        Ok(())
    }

    /// A new cache holding this one's first `positions` positions: its whole blocks shared
    /// (held once more), its last, partial block and its states copied in stream order. The
    /// states are those of all its positions, so `positions` must be all of them where it
    /// keeps states (the engine's caches see to it: `KvCache::can_truncate_to`).
    pub(super) fn copy(
        &self,
        stream: &Arc<CudaStream>,
        pool: &Arc<KvPool>,
        positions: usize,
    ) -> Result<DeviceCache, CudaError> {
        if self
            .pool
            .as_ref()
            .is_some_and(|own| !Arc::ptr_eq(own, pool))
        {
            return Err(CudaError::Unsupported(
                "a KV cache of another GPU's pool".into(),
            ));
        }
        let whole = (positions / KV_BLOCK).min(self.blocks.len());
        let shared = self.blocks[..whole].to_vec();
        pool.share(&shared);
        let mut copy = DeviceCache {
            pool: Some(pool.clone()),
            blocks: shared,
            state: Vec::new(),
            max_positions: self.max_positions,
            keeps_state: self.keeps_state,
        };
        copy.reserve(pool, positions.max(1))?;
        let used = positions.div_ceil(KV_BLOCK).min(self.blocks.len());
        let mut pairs = pool.block_copies(&self.blocks[whole..used], &copy.blocks[whole..used]);
        if !self.state.is_empty() {
            let bytes = pool.page_floats() * 4;
            for (from, to) in pool.pages(&self.state).zip(pool.pages(&copy.state)) {
                pairs.push((from, to, bytes));
            }
        }
        copy_all(stream, pairs)?;
        Ok(copy)
    }

    /// Makes the blocks a step writes into (those holding positions `start` on) this
    /// cache's own: a shared one is replaced by a block of its own, which first takes a copy
    /// of the shared one's positions before `start` when the block holds some.
    pub(super) fn make_writable(
        &mut self,
        stream: &Arc<CudaStream>,
        start: usize,
    ) -> Result<(), CudaError> {
        let Some(pool) = self.pool.clone() else {
            return Ok(());
        };
        let first = start / KV_BLOCK;
        let shared: Vec<usize> = (first..self.blocks.len())
            .filter(|&i| pool.shared(self.blocks[i]))
            .collect();
        if shared.is_empty() {
            return Ok(());
        }
        let fresh = pool.take(shared.len())?;
        let mut pairs = Vec::new();
        let mut old = Vec::with_capacity(shared.len());
        for (&i, &block) in shared.iter().zip(&fresh) {
            if i == first && !start.is_multiple_of(KV_BLOCK) {
                pairs.extend(pool.block_copies(&[self.blocks[i]], &[block]));
            }
            old.push(std::mem::replace(&mut self.blocks[i], block));
        }
        copy_all(stream, pairs)?;
        pool.give_back(&mut old);
        Ok(())
    }
}

/// Device-to-device copies on `stream`, in order.
fn copy_all(stream: &Arc<CudaStream>, pairs: Vec<(u64, u64, usize)>) -> Result<(), CudaError> {
    for (from, to, bytes) in pairs {
        // SAFETY: both ranges lie inside the pool's arrays (block indices below
        // `pool.blocks`), `bytes` each.
        unsafe { result::memcpy_dtod_async(to, from, bytes, stream.cu_stream())? };
    }
    Ok(())
}

/// The work buffers of one step: each from the stream's allocator and dropped (in stream
/// order) when released, or, for a step a CUDA graph captures or replays, laid out in an
/// arena at the same offsets every time, so that the graph's addresses hold.
pub(super) struct Scratch<'s> {
    pub(super) stream: &'s Arc<CudaStream>,
    held: Vec<Buffer>,
    /// Bytes held now as an arena would lay them out, and the most held at once: what the
    /// arena of a graph of the same step needs.
    bytes: usize,
    peak: usize,
    /// `(address, size)` of the arena buffers come from, where they do.
    arena: Option<(u64, usize)>,
}

/// What a [`Scratch`] held at one point, to release what came after ([`Scratch::release`]).
#[derive(Clone, Copy)]
pub(super) struct Mark {
    held: usize,
    bytes: usize,
}

impl Mark {
    /// Bytes held at this mark, as an arena lays them out.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }
}

/// Where an arena places each buffer: at a multiple of this.
const ARENA_ALIGN: usize = 256;

impl<'s> Scratch<'s> {
    pub(super) fn new(stream: &'s Arc<CudaStream>) -> Scratch<'s> {
        Scratch {
            stream,
            held: Vec::new(),
            bytes: 0,
            peak: 0,
            arena: None,
        }
    }

    /// Buffers laid out in `[base, base + size)` from its start.
    pub(super) fn in_arena(stream: &'s Arc<CudaStream>, base: u64, size: usize) -> Scratch<'s> {
        Scratch {
            arena: Some((base, size)),
            ..Scratch::new(stream)
        }
    }

    pub(super) fn f32(&mut self, n: usize) -> Result<u64, CudaError> {
        self.bytes(n * 4)
    }

    pub(super) fn bf16(&mut self, n: usize) -> Result<u64, CudaError> {
        self.bytes(n * 2)
    }

    fn bytes(&mut self, bytes: usize) -> Result<u64, CudaError> {
        let at = self.bytes;
        self.bytes += bytes.max(1).next_multiple_of(ARENA_ALIGN);
        self.peak = self.peak.max(self.bytes);
        match self.arena {
            Some((base, size)) if self.bytes <= size => Ok(base + at as u64),
            Some((_, size)) => Err(CudaError::Unsupported(format!(
                "a step's work buffers past its graph's arena of {size} bytes"
            ))),
            None => {
                let buffer = Buffer::new(self.stream, bytes)?;
                let ptr = buffer.ptr;
                self.held.push(buffer);
                Ok(ptr)
            }
        }
    }

    pub(super) fn upload<T: DeviceRepr>(&mut self, values: &[T]) -> Result<u64, CudaError> {
        let ptr = self.bytes(std::mem::size_of_val(values))?;
        // SAFETY: the buffer holds `values`; a copy from pageable memory has read them when
        // it returns.
        unsafe { result::memcpy_htod_async(ptr, values, self.stream.cu_stream())? };
        Ok(ptr)
    }

    pub(super) fn mark(&self) -> Mark {
        Mark {
            held: self.held.len(),
            bytes: self.bytes,
        }
    }

    /// Lets go of the buffers taken since `mark` (freed in stream order; an arena's are
    /// handed out again).
    pub(super) fn release(&mut self, mark: Mark) {
        self.held.truncate(mark.held);
        self.bytes = mark.bytes;
    }

    /// The most bytes held at once so far, as an arena lays them out.
    pub(super) fn peak(&self) -> usize {
        self.peak
    }
}
