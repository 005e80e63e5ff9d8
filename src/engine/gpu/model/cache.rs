//! Per-sequence KV caches in GPU memory, and the work buffers of one step.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DeviceRepr, result};

use crate::compute::cuda::CudaError;
use crate::compute::cuda::experts::Buffer;
use crate::model::config::{AttentionConfig, ModelConfig};

/// Where a layer's cached positions lie for one sequence: two arrays (keys and values for
/// GQA; MLA keeps one, `[latent | rotary key]` per position, and its values are the keys).
pub struct DeviceCache {
    layers: Vec<[Option<Buffer>; 2]>,
    widths: [usize; 2],
    capacity: usize,
    max_positions: usize,
}

impl std::fmt::Debug for DeviceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCache")
            .field("layers", &self.layers.len())
            .field("widths", &self.widths)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl DeviceCache {
    /// An empty cache for one sequence of a model; it takes GPU memory as it grows.
    pub fn new(config: &ModelConfig) -> DeviceCache {
        let widths = match config.attention {
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
        };
        DeviceCache {
            layers: (0..config.num_layers).map(|_| [None, None]).collect(),
            widths,
            capacity: 0,
            max_positions: config.max_position_embeddings,
        }
    }

    /// Gives the GPU memory back (freed in stream order); the cache grows again from empty.
    pub fn release(&mut self) {
        for layer in &mut self.layers {
            *layer = [None, None];
        }
        self.capacity = 0;
    }

    /// Bytes of GPU memory held.
    pub fn bytes(&self) -> usize {
        self.layers.len() * self.capacity * (self.widths[0] + self.widths[1]) * 4
    }

    /// Makes room for `positions` positions, keeping the first `kept`: capacity doubles (a
    /// sequence's growth costs O(length) copies in all), bounded by the model's context.
    pub(super) fn reserve(
        &mut self,
        stream: &Arc<CudaStream>,
        positions: usize,
        kept: usize,
    ) -> Result<(), CudaError> {
        if positions <= self.capacity {
            return Ok(());
        }
        let capacity = positions
            .max(self.capacity * 2)
            .max(64)
            .min(self.max_positions.max(positions));
        for layer in &mut self.layers {
            for (slot, &width) in layer.iter_mut().zip(&self.widths) {
                if width == 0 {
                    continue;
                }
                let grown = Buffer::new(stream, capacity * width * 4)?;
                if let Some(old) = slot.as_ref()
                    && kept > 0
                {
                    // SAFETY: both buffers hold at least `kept` positions of `width` f32; the
                    // old one is freed in stream order, after the copy.
                    unsafe {
                        result::memcpy_dtod_async(
                            grown.ptr,
                            old.ptr,
                            kept * width * 4,
                            stream.cu_stream(),
                        )?
                    };
                }
                *slot = Some(grown);
            }
        }
        self.capacity = capacity;
        Ok(())
    }

    /// A new cache holding a copy of this one's first `positions` positions (copied in
    /// stream order).
    pub(super) fn copy(
        &self,
        stream: &Arc<CudaStream>,
        positions: usize,
    ) -> Result<DeviceCache, CudaError> {
        let mut copy = DeviceCache {
            layers: (0..self.layers.len()).map(|_| [None, None]).collect(),
            widths: self.widths,
            capacity: 0,
            max_positions: self.max_positions,
        };
        copy.reserve(stream, positions.max(1), 0)?;
        for (to, from) in copy.layers.iter().zip(&self.layers) {
            for ((to, from), &width) in to.iter().zip(from).zip(&self.widths) {
                if let (Some(to), Some(from)) = (to, from)
                    && positions > 0
                {
                    // SAFETY: both buffers hold at least `positions` positions of `width`
                    // f32 (`from` has cached them; `to` was reserved for them).
                    unsafe {
                        result::memcpy_dtod_async(
                            to.ptr,
                            from.ptr,
                            positions * width * 4,
                            stream.cu_stream(),
                        )?
                    };
                }
            }
        }
        Ok(copy)
    }

    pub(super) fn ptr(&self, layer: usize, which: usize) -> u64 {
        self.layers[layer][which].as_ref().map_or(0, |b| b.ptr)
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
