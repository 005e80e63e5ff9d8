//! KV caches in GPU memory, paged and in bf16: one pool per GPU holds every sequence's cached
//! positions in blocks of [`KV_BLOCK`] positions, and a sequence's cache is the list of its blocks (its block
//! table). The pool is allocated once, at the size of the KV budget the batcher admits by
//! ([`GpuModel::reserve_kv_cache`](super::GpuModel::reserve_kv_cache)), so what the batcher
//! counts is what the GPU holds: no cache grows by copying, none is over-allocated, and the
//! whole budget is usable (a cache that doubled as it grew needed half of it held back). The
//! attention kernels read through the block tables. And the work buffers of one step.

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
    layers: usize,
    blocks: usize,
    /// Blocks no cache holds.
    free: Mutex<Vec<u32>>,
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
        let layers = config.num_layers;
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
            layers,
            blocks,
            free: Mutex::new((0..blocks as u32).rev().collect()),
        })
    }

    /// Bytes one block takes over every layer and array.
    pub fn block_bytes(config: &ModelConfig) -> usize {
        let [a, b] = cache_widths(config);
        config.num_layers * KV_BLOCK * (a + b) * VALUE_BYTES
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Blocks no cache holds now.
    pub fn free_blocks(&self) -> usize {
        self.free_list().len()
    }

    /// Layer `layer`'s pool of array `which` (`[blocks, KV_BLOCK, width]` bf16); 0 where the
    /// array is not kept.
    pub(super) fn layer(&self, layer: usize, which: usize) -> u64 {
        self.arrays[which].as_ref().map_or(0, |b| {
            b.ptr + (layer * self.blocks * KV_BLOCK * self.widths[which] * VALUE_BYTES) as u64
        })
    }

    fn free_list(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `n` blocks, or none when fewer are free.
    fn take(&self, n: usize) -> Result<Vec<u32>, CudaError> {
        let mut free = self.free_list();
        if free.len() < n {
            return Err(CudaError::KvCacheFull {
                needed: n,
                free: free.len(),
                blocks: self.blocks,
            });
        }
        let at = free.len() - n;
        Ok(free.split_off(at))
    }

    fn give_back(&self, blocks: &mut Vec<u32>) {
        self.free_list().append(blocks);
    }
}

/// One sequence's cache on a GPU: its blocks of the GPU's [`KvPool`], in position order.
/// Empty (and of no pool) until its first step; the blocks go back to the pool when it is
/// released or dropped (later work on the GPU's one stream is ordered after this one's).
pub struct DeviceCache {
    pool: Option<Arc<KvPool>>,
    blocks: Vec<u32>,
    max_positions: usize,
}

impl std::fmt::Debug for DeviceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCache")
            .field("blocks", &self.blocks.len())
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
            max_positions: config.max_position_embeddings,
        }
    }

    /// Gives the blocks back; the cache grows again from empty.
    pub fn release(&mut self) {
        if let Some(pool) = &self.pool {
            pool.give_back(&mut self.blocks);
        }
    }

    /// Bytes of GPU memory held.
    pub fn bytes(&self) -> usize {
        self.pool.as_ref().map_or(0, |pool| {
            self.blocks.len()
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

    /// Makes room for `positions` positions, taking blocks of `pool` (the pool of every
    /// cache of this GPU).
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
        if needed > self.blocks.len() {
            let mut more = pool.take(needed - self.blocks.len())?;
            self.blocks.append(&mut more);
        }
        Ok(())
    }

    /// A new cache holding a copy of this one's first `positions` positions (copied in
    /// stream order, block by block).
    pub(super) fn copy(
        &self,
        stream: &Arc<CudaStream>,
        pool: &Arc<KvPool>,
        positions: usize,
    ) -> Result<DeviceCache, CudaError> {
        let mut copy = DeviceCache {
            pool: None,
            blocks: Vec::new(),
            max_positions: self.max_positions,
        };
        copy.reserve(pool, positions.max(1))?;
        let used = positions.div_ceil(KV_BLOCK);
        for layer in 0..pool.layers {
            for which in 0..2 {
                let width = pool.widths[which];
                let base = pool.layer(layer, which);
                if width == 0 {
                    continue;
                }
                let block_bytes = KV_BLOCK * width * VALUE_BYTES;
                for (&from, &to) in self.blocks[..used].iter().zip(&copy.blocks) {
                    // SAFETY: both blocks lie inside the layer's pool (indices below
                    // `pool.blocks`), `block_bytes` each.
                    unsafe {
                        result::memcpy_dtod_async(
                            base + (to as usize * block_bytes) as u64,
                            base + (from as usize * block_bytes) as u64,
                            block_bytes,
                            stream.cu_stream(),
                        )?
                    };
                }
            }
        }
        Ok(copy)
    }
}

/// Allocations of one step, freed (in stream order) when it ends.
pub(super) struct Scratch<'s> {
    pub(super) stream: &'s Arc<CudaStream>,
    pub(super) held: Vec<Buffer>,
}

impl Scratch<'_> {
    pub(super) fn f32(&mut self, n: usize) -> Result<u64, CudaError> {
        self.bytes(n * 4)
    }

    pub(super) fn bf16(&mut self, n: usize) -> Result<u64, CudaError> {
        self.bytes(n * 2)
    }

    fn bytes(&mut self, bytes: usize) -> Result<u64, CudaError> {
        self.hold(Buffer::new(self.stream, bytes)?)
    }

    pub(super) fn upload<T: DeviceRepr>(&mut self, values: &[T]) -> Result<u64, CudaError> {
        self.hold(Buffer::from_host(self.stream, values)?)
    }

    fn hold(&mut self, buffer: Buffer) -> Result<u64, CudaError> {
        let ptr = buffer.ptr;
        self.held.push(buffer);
        Ok(ptr)
    }
}
