//! Typed launchers of `kernels/dense.cu`: RMSNorm, rotary embeddings and attention over the
//! KV cache. Arguments that are `u64` are device addresses on the stream's GPU. The engine
//! does not use them yet (its dense part runs on the CPU); the GPU tests hold them to the
//! CPU's arithmetic.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use super::kernels::{self, DENSE};
use super::{CudaError, GpuInfo};

/// Positions per tile of the attention kernel (`ATTEND_TILE` in dense.cu).
const ATTEND_TILE: usize = 256;

/// The kernels of `kernels/dense.cu`, loaded into one device's context.
pub struct DenseKernels {
    rms_norm: CudaFunction,
    rope: CudaFunction,
    attend: CudaFunction,
}

/// Where a layer's queries, keys and values lie, for [`DenseKernels::attend`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    pub heads: usize,
    /// Query heads per key/value head.
    pub group: usize,
    /// Width of a query and a key; of a value.
    pub key_width: usize,
    pub value_width: usize,
    /// Floats from one cached position to the next; from one kv head's key (value) to the
    /// next. MLA's absorbed form: one kv head, values inside the keys.
    pub kv_stride: usize,
    pub key_head_stride: usize,
    pub value_head_stride: usize,
    /// Only the last `window` positions are seen, when set.
    pub window: Option<usize>,
    pub scale: f32,
}

impl DenseKernels {
    pub fn load(
        ctx: &Arc<CudaContext>,
        gpu: &GpuInfo,
        cache_dir: Option<&std::path::Path>,
    ) -> Result<DenseKernels, CudaError> {
        let module = kernels::load_module(ctx, &DENSE, gpu, cache_dir)?;
        Ok(DenseKernels {
            rms_norm: module.load_function("rms_norm")?,
            rope: module.load_function("rope")?,
            attend: module.load_function("attend")?,
        })
    }

    /// RMSNorm of `rows` rows of `width` f32; `out` may be `x`.
    ///
    /// # Safety
    /// `x`, `out`: `[rows, width]` f32; `weight`: `[width]` f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rms_norm(
        &self,
        stream: &CudaStream,
        x: u64,
        rows: usize,
        width: usize,
        weight: u64,
        eps: f32,
        out: u64,
    ) -> Result<(), CudaError> {
        let width_i = width as i32;
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            stream
                .launch_builder(&self.rms_norm)
                .arg(&x)
                .arg(&weight)
                .arg(&width_i)
                .arg(&eps)
                .arg(&out)
                .launch(LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })?;
        }
        Ok(())
    }

    /// Rotates `rope_dim` values at `offset` in every `head_width`-wide head, in place.
    ///
    /// # Safety
    /// `x`: `[rows, heads, head_width]` f32; `cos`, `sin`: `[rows, rope_dim / 2]` f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rope(
        &self,
        stream: &CudaStream,
        x: u64,
        rows: usize,
        heads: usize,
        head_width: usize,
        offset: usize,
        rope_dim: usize,
        cos: u64,
        sin: u64,
        interleaved: bool,
    ) -> Result<(), CudaError> {
        let args = [heads, head_width, offset, rope_dim].map(|v| v as i32);
        let interleaved = interleaved as i32;
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            stream
                .launch_builder(&self.rope)
                .arg(&x)
                .arg(&args[0])
                .arg(&args[1])
                .arg(&args[2])
                .arg(&args[3])
                .arg(&cos)
                .arg(&sin)
                .arg(&interleaved)
                .launch(LaunchConfig {
                    grid_dim: ((rows * heads) as u32, 1, 1),
                    block_dim: (64, 1, 1),
                    shared_mem_bytes: (rope_dim * 4) as u32,
                })?;
        }
        Ok(())
    }

    /// Causal attention of `rows` query rows, each over its own sequence's cache.
    ///
    /// # Safety
    /// `q`: `[rows, heads, key_width]` f32; `keys`, `values`: device arrays of one device
    /// pointer per sequence, each to that sequence's cached positions laid out as `shape`
    /// says, covering every row's position; `row_seq`, `row_pos`: `[rows]` i32; `out`: room
    /// for `[rows, heads, value_width]` f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend(
        &self,
        stream: &CudaStream,
        shape: &AttentionShape,
        q: u64,
        rows: usize,
        keys: u64,
        values: u64,
        row_seq: u64,
        row_pos: u64,
        out: u64,
    ) -> Result<(), CudaError> {
        let ints = [
            shape.heads,
            shape.group,
            shape.key_width,
            shape.value_width,
            shape.kv_stride,
            shape.key_head_stride,
            shape.value_head_stride,
            shape.window.unwrap_or(0),
        ]
        .map(|v| v as i32);
        let shared = (shape.key_width + ATTEND_TILE + shape.value_width) * 4;
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            stream
                .launch_builder(&self.attend)
                .arg(&q)
                .arg(&ints[0])
                .arg(&ints[1])
                .arg(&ints[2])
                .arg(&ints[3])
                .arg(&keys)
                .arg(&values)
                .arg(&ints[4])
                .arg(&ints[5])
                .arg(&ints[6])
                .arg(&row_seq)
                .arg(&row_pos)
                .arg(&ints[7])
                .arg(&shape.scale)
                .arg(&out)
                .launch(LaunchConfig {
                    grid_dim: ((rows * shape.heads) as u32, 1, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: shared as u32,
                })?;
        }
        Ok(())
    }
}
