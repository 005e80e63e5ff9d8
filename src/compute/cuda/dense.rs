//! Typed launchers of `kernels/dense.cu`: RMSNorm, rotary embeddings, attention over the KV
//! cache, and the small copies and additions around them. Arguments that are `u64` are
//! device addresses on the stream's GPU. [`super::model::GpuModel`] runs the dense part of a
//! model with them; the GPU tests hold them to the CPU's arithmetic.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use super::kernels::{self, DENSE, elementwise};
use super::{CudaError, GpuInfo};

/// Positions per tile of the attention kernel (`ATTEND_TILE` in dense.cu).
const ATTEND_TILE: usize = 256;

/// Key positions per pass of `attend_tiles` (`ATTEND_TILES_KEYS` in dense.cu).
const ATTEND_TILES_KEYS: usize = 16;

/// Dynamic shared memory a block may take without opting in: every CUDA GPU's.
const SHARED_MEMORY: usize = 48 * 1024;

/// A prefill's query rows in tiles for [`DenseKernels::attend_tiles`]: tile `t` is
/// `len[t]` consecutive rows of one sequence from row `first[t]` (`[count]` i32 each), at
/// most `rows_per_tile`.
#[derive(Debug, Clone, Copy)]
pub struct RowTiles {
    pub first: u64,
    pub len: u64,
    pub count: usize,
    pub rows_per_tile: usize,
}

/// Query rows per tile of `attend_tiles` for keys of `key_width` and values of `value_width`:
/// the most (16, 8, 4, 2 or 1) whose tile fits the shared memory every GPU gives a block;
/// `None` where not even one row does (the per-row kernel then serves).
pub fn rows_per_tile(key_width: usize, value_width: usize) -> Option<usize> {
    [16, 8, 4, 2, 1]
        .into_iter()
        .find(|&rows| tiles_shared_bytes(rows, key_width, value_width) <= SHARED_MEMORY)
}

/// Heads per block of `attend_heads` for keys of `key_width` and values of `value_width`:
/// as many as shared memory holds, spread evenly over the blocks of a row; `None` where not
/// one fits.
pub fn heads_per_block(heads: usize, key_width: usize, value_width: usize) -> Option<usize> {
    let keys = ATTEND_TILES_KEYS * key_width * 2;
    let per_head = (key_width + value_width + ATTEND_TILES_KEYS + 3) * 4;
    let most = SHARED_MEMORY.checked_sub(keys)? / per_head;
    if most == 0 || heads == 0 {
        return None;
    }
    let groups = heads.div_ceil(most.min(heads));
    Some(heads.div_ceil(groups))
}

fn tiles_shared_bytes(rows: usize, key_width: usize, value_width: usize) -> usize {
    (rows * (key_width + value_width + ATTEND_TILES_KEYS + 3)
        + ATTEND_TILES_KEYS * (key_width + value_width))
        * 4
}

/// The kernels of `kernels/dense.cu`, loaded into one device's context.
pub struct DenseKernels {
    rms_norm: CudaFunction,
    rope: CudaFunction,
    attend: CudaFunction,
    add_rows: CudaFunction,
    add_bias: CudaFunction,
    copy_rows: CudaFunction,
    store_rows: CudaFunction,
    sigmoid_gate: CudaFunction,
    scale_rows_by_sigmoid: CudaFunction,
    scale_by_temperature: CudaFunction,
    attend_tiles: CudaFunction,
    attend_heads: CudaFunction,
}

/// One block per row, as the row kernels take.
fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Positions of one sequence per block of a paged KV cache: `KV_BLOCK` in dense.cu.
pub const KV_BLOCK: usize = 16;

/// The step's block tables as the kernels read them: `[seqs, stride]` i32 on the GPU, block
/// `table[s][b]` of the pool holding positions `KV_BLOCK·b ..` of sequence `s`.
#[derive(Debug, Clone, Copy)]
pub struct BlockTable {
    pub blocks: u64,
    pub stride: usize,
}

/// One layer's paged KV cache: its key and value pools (`[blocks, KV_BLOCK, kv_stride]` bf16;
/// the same pool twice for MLA, whose values are inside its keys) and the step's tables.
#[derive(Debug, Clone, Copy)]
pub struct PagedCache {
    pub keys: u64,
    pub values: u64,
    pub table: BlockTable,
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
    /// Only the positions of the row's own chunk of this many are seen, when set (Llama 4's
    /// chunked layers).
    pub chunk: Option<usize>,
    pub scale: f32,
}

impl AttentionShape {
    /// The shape's integer arguments in `attend`'s order: heads, group, dk, dv, kv_stride,
    /// k_head_stride, v_head_stride, window (0: none), chunk (0: none).
    pub fn kernel_ints(&self) -> [i32; 9] {
        [
            self.heads,
            self.group,
            self.key_width,
            self.value_width,
            self.kv_stride,
            self.key_head_stride,
            self.value_head_stride,
            self.window.unwrap_or(0),
            self.chunk.unwrap_or(0),
        ]
        .map(|v| v as i32)
    }
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
            add_rows: module.load_function("add_rows")?,
            add_bias: module.load_function("add_bias")?,
            copy_rows: module.load_function("copy_rows")?,
            store_rows: module.load_function("store_rows")?,
            sigmoid_gate: module.load_function("sigmoid_gate")?,
            scale_rows_by_sigmoid: module.load_function("scale_rows_by_sigmoid")?,
            scale_by_temperature: module.load_function("scale_by_temperature")?,
            attend_tiles: module.load_function("attend_tiles")?,
            attend_heads: module.load_function("attend_heads")?,
        })
    }

    /// RMSNorm of the first `width` f32 of `rows` rows `stride` apart; `out` (same layout)
    /// may be `x`.
    ///
    /// # Safety
    /// `x`, `out`: `[rows, stride]` f32; `weight`: `[width]` f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rms_norm(
        &self,
        stream: &CudaStream,
        x: u64,
        rows: usize,
        stride: usize,
        width: usize,
        weight: u64,
        eps: f32,
        out: u64,
    ) -> Result<(), CudaError> {
        let (stride_i, width_i) = (stride as i32, width as i32);
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            stream
                .launch_builder(&self.rms_norm)
                .arg(&x)
                .arg(&stride_i)
                .arg(&weight)
                .arg(&width_i)
                .arg(&eps)
                .arg(&out)
                .launch(per_row(rows, 256))?;
        }
        Ok(())
    }

    /// `x[i] += y[i]` for `n` f32.
    ///
    /// # Safety
    /// `x`, `y`: `[n]` f32.
    pub unsafe fn add_rows(
        &self,
        stream: &CudaStream,
        x: u64,
        y: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            stream
                .launch_builder(&self.add_rows)
                .arg(&x)
                .arg(&y)
                .arg(&n)
                .launch(elementwise(n))?;
        }
        Ok(())
    }

    /// `x[r, c] += bias[c]` over `rows` rows of `width` f32.
    ///
    /// # Safety
    /// `x`: `[rows, width]` f32; `bias`: `[width]` f32.
    pub unsafe fn add_bias(
        &self,
        stream: &CudaStream,
        x: u64,
        rows: usize,
        width: usize,
        bias: u64,
    ) -> Result<(), CudaError> {
        let (width_i, n) = (width as i32, rows * width);
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            stream
                .launch_builder(&self.add_bias)
                .arg(&x)
                .arg(&bias)
                .arg(&width_i)
                .arg(&n)
                .launch(elementwise(n))?;
        }
        Ok(())
    }

    /// `x[i] *= sigmoid(gate[i])` for `n` f32 (a gated attention output).
    ///
    /// # Safety
    /// `x`, `gate`: `[n]` f32.
    pub unsafe fn sigmoid_gate(
        &self,
        stream: &CudaStream,
        x: u64,
        gate: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            stream
                .launch_builder(&self.sigmoid_gate)
                .arg(&x)
                .arg(&gate)
                .arg(&n)
                .launch(elementwise(n))?;
        }
        Ok(())
    }

    /// `x[r, c] *= sigmoid(logits[r])` over `rows` rows of `width` f32 (a gated shared
    /// expert).
    ///
    /// # Safety
    /// `x`: `[rows, width]` f32; `logits`: `[rows]` f32.
    pub unsafe fn scale_rows_by_sigmoid(
        &self,
        stream: &CudaStream,
        x: u64,
        logits: u64,
        rows: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        let (width_i, n) = (width as i32, rows * width);
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            stream
                .launch_builder(&self.scale_rows_by_sigmoid)
                .arg(&x)
                .arg(&logits)
                .arg(&width_i)
                .arg(&n)
                .launch(elementwise(n))?;
        }
        Ok(())
    }

    /// Each of `rows` rows of `width` f32 times Llama 4's attention temperature at its
    /// position: `1 + attn_scale * ln(1 + floor((pos + 1) / floor_scale))`.
    ///
    /// # Safety
    /// `x`: `[rows, width]` f32; `row_pos`: `[rows]` i32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn scale_by_temperature(
        &self,
        stream: &CudaStream,
        x: u64,
        row_pos: u64,
        rows: usize,
        width: usize,
        (floor_scale, attn_scale): (f32, f32),
    ) -> Result<(), CudaError> {
        let (width_i, n) = (width as i32, rows * width);
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            stream
                .launch_builder(&self.scale_by_temperature)
                .arg(&x)
                .arg(&row_pos)
                .arg(&width_i)
                .arg(&floor_scale)
                .arg(&attn_scale)
                .arg(&n)
                .launch(elementwise(n))?;
        }
        Ok(())
    }

    /// Copies the first `width` f32 of `rows` rows `src_stride` apart to rows `dst_stride`
    /// apart.
    ///
    /// # Safety
    /// `src`: `[rows, src_stride]` f32, `dst`: `[rows, dst_stride]` f32 (each counted from
    /// the given address).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn copy_rows(
        &self,
        stream: &CudaStream,
        src: u64,
        src_stride: usize,
        dst: u64,
        dst_stride: usize,
        rows: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        let ints = [src_stride, dst_stride, width].map(|v| v as i32);
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            stream
                .launch_builder(&self.copy_rows)
                .arg(&src)
                .arg(&ints[0])
                .arg(&dst)
                .arg(&ints[1])
                .arg(&ints[2])
                .launch(per_row(rows, 64))?;
        }
        Ok(())
    }

    /// Appends `rows` packed rows of `width` f32 to their sequences' paged caches, rounded to
    /// bf16: row `r` to position `row_pos[r]` of sequence `row_seq[r]`, in the row of `pool`
    /// its block table maps that position to.
    ///
    /// # Safety
    /// `src`: `[rows, width]` f32; `pool`: `[blocks, KV_BLOCK, width]` bf16; `table` as
    /// [`PagedCache`] says, naming a block for every position in `row_pos` for its rows;
    /// `row_seq`, `row_pos`: `[rows]` i32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn store_rows(
        &self,
        stream: &CudaStream,
        src: u64,
        rows: usize,
        width: usize,
        pool: u64,
        table: &BlockTable,
        row_seq: u64,
        row_pos: u64,
    ) -> Result<(), CudaError> {
        let width_i = width as i32;
        let stride = table.stride as i32;
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            stream
                .launch_builder(&self.store_rows)
                .arg(&src)
                .arg(&width_i)
                .arg(&pool)
                .arg(&table.blocks)
                .arg(&stride)
                .arg(&row_seq)
                .arg(&row_pos)
                .launch(per_row(rows, 128))?;
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

    /// Causal attention of `rows` query rows, each over its own sequence's paged cache, with
    /// a sink logit per head where `sinks` is not 0 (gpt-oss). A block per row and head; or,
    /// given `tiles` (a prefill), a block per tile of rows and head (`attend_tiles`: each pass
    /// over the cache loads its keys and values once for every row of the tile).
    ///
    /// # Safety
    /// `q`: `[rows, heads, key_width]` f32; `cache`'s pools hold positions laid out as `shape`
    /// says, its table naming a block for every position up to each row's; `row_seq`,
    /// `row_pos`: `[rows]` i32; `sinks`: 0 or `[heads]` f32; `out`: room for
    /// `[rows, heads, value_width]` f32; `tiles` cover every row once, each tile's rows of one
    /// sequence at consecutive positions, at most `tiles.rows_per_tile`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend(
        &self,
        stream: &CudaStream,
        shape: &AttentionShape,
        q: u64,
        (rows, tiles): (usize, Option<&RowTiles>),
        cache: &PagedCache,
        (row_seq, row_pos): (u64, u64),
        sinks: u64,
        out: u64,
    ) -> Result<(), CudaError> {
        let ints = shape.kernel_ints();
        let (function, blocks, shared) = match tiles {
            Some(tiles) => (
                &self.attend_tiles,
                tiles.count,
                tiles_shared_bytes(tiles.rows_per_tile, shape.key_width, shape.value_width),
            ),
            None => (
                &self.attend,
                rows,
                (shape.key_width + ATTEND_TILE + shape.value_width) * 4,
            ),
        };
        if shared > SHARED_MEMORY {
            return Err(CudaError::Unsupported(format!(
                "attention blocks of {shared} bytes of shared memory (heads of {} and {} values)",
                shape.key_width, shape.value_width
            )));
        }
        let table_stride = cache.table.stride as i32;
        let rows_per_tile = tiles.map_or(0, |t| t.rows_per_tile as i32);
        let mut launch = stream.launch_builder(function);
        launch
            .arg(&q)
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(&cache.keys)
            .arg(&cache.values)
            .arg(&cache.table.blocks)
            .arg(&table_stride)
            .arg(&ints[4])
            .arg(&ints[5])
            .arg(&ints[6])
            .arg(&row_seq)
            .arg(&row_pos)
            .arg(&ints[7])
            .arg(&ints[8])
            .arg(&shape.scale)
            .arg(&sinks);
        if let Some(tiles) = tiles {
            launch.arg(&tiles.first).arg(&tiles.len).arg(&rows_per_tile);
        }
        launch.arg(&out);
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: ((blocks * shape.heads) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: shared as u32,
            })?;
        }
        Ok(())
    }

    /// Causal attention of `rows` query rows where every head reads the same keys and the
    /// values are the keys' first `value_width` values (MLA in its absorbed form): a block
    /// per row and group of `heads_per_block` heads ([`heads_per_block`]), each pass over
    /// the cache loading its keys once for every head of the group.
    ///
    /// # Safety
    /// As [`DenseKernels::attend`], with `shape.group == shape.heads` and the values inside
    /// the keys.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_heads(
        &self,
        stream: &CudaStream,
        shape: &AttentionShape,
        heads_per_block: usize,
        q: u64,
        rows: usize,
        cache: &PagedCache,
        (row_seq, row_pos): (u64, u64),
        out: u64,
    ) -> Result<(), CudaError> {
        let (dk, dv) = (shape.key_width, shape.value_width);
        let shared =
            heads_per_block * (dk + dv + ATTEND_TILES_KEYS + 3) * 4 + ATTEND_TILES_KEYS * dk * 2;
        if shape.group != shape.heads || heads_per_block == 0 || shared > SHARED_MEMORY {
            return Err(CudaError::Unsupported(format!(
                "attention over shared keys with {heads_per_block} heads a block ({shared} \
                 bytes of shared memory)"
            )));
        }
        let groups = shape.heads.div_ceil(heads_per_block);
        let ints = [
            shape.heads as i32,
            dk as i32,
            dv as i32,
            cache.table.stride as i32,
            shape.kv_stride as i32,
            heads_per_block as i32,
        ];
        let mut launch = stream.launch_builder(&self.attend_heads);
        launch
            .arg(&q)
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&cache.keys)
            .arg(&cache.table.blocks)
            .arg(&ints[3])
            .arg(&ints[4])
            .arg(&row_seq)
            .arg(&row_pos)
            .arg(&shape.scale)
            .arg(&ints[5])
            .arg(&out);
        // SAFETY: as the caller vouches; arguments match dense.cu.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: ((rows * groups) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: shared as u32,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_per_block_fill_shared_memory_evenly() {
        // DeepSeek-V3 and Kimi K2: 128 heads over 576-wide keys, 512-wide values; 6 heads
        // a block fit in 48 KiB (7 would not: 18 KiB of keys + 4.3 KiB a head).
        let k2 = heads_per_block(128, 576, 512).unwrap();
        assert_eq!(k2, 6);
        let shared = k2 * (576 + 512 + ATTEND_TILES_KEYS + 3) * 4 + ATTEND_TILES_KEYS * 576 * 2;
        assert!(shared <= SHARED_MEMORY);
        // Few narrow heads: all in one block. Groups spread evenly: 7 heads where 6 fit
        // make 2 blocks of 4, not 6 and 1.
        assert_eq!(heads_per_block(4, 24, 16), Some(4));
        assert_eq!(heads_per_block(7, 576, 512), Some(4));
        // Keys too wide for one head: none.
        assert_eq!(heads_per_block(8, 2048, 2048), None);
    }
}
