//! The dense part of a model on one GPU: every decoder layer's norms, attention over a KV
//! cache kept on the GPU, the dense MLPs and shared experts, the final norm and the lm head,
//! with bf16 weights, bf16 inputs to the products and f32 everywhere else (the residual
//! stream, norms, rotary, softmax). The host sends the step's embedding rows and rotary
//! tables and gets the logits back. Routed experts stay behind the engine's
//! [`crate::experts::ExpertExecutor`] (device actors, other nodes). At each MoE layer the
//! rows stay on the GPU where the executor takes device rows ([`routed`]); otherwise the
//! normalised rows go to the host, the host routes them (the CPU's gate), and the combined
//! expert output comes back.

use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream, result, sys};

use crate::compute::cuda::blas::{self, Gemm, Output};
use crate::compute::cuda::dense::{BlockTable, DenseKernels, PagedCache, RowTiles, rows_per_tile};
use crate::compute::cuda::experts::Buffer;
use crate::compute::cuda::linear::{LinearKernels, PackedStates, StatePages};
use crate::compute::cuda::moe::MoeKernels;
use crate::compute::cuda::{CudaError, GpuInfo};
use crate::compute::layout::{RopeAngles, Segment};
use crate::experts::{ExpertError, ExpertExecutor};
use crate::model::config::{AttentionConfig, ModelConfig};
use crate::model::weights::DenseWeights;
use cache::Scratch;
pub use cache::{DeviceCache, KvPool};
use graphs::Graphs;
use routed::{DeviceGate, RoutedError, RoutedRows};
use weights::{Layer, Matrix, Mlp, Norm, Uploaded, weight_bytes};

mod attention;
mod cache;
mod graphs;
mod linear;
mod routed;
mod weights;

/// The dense part of a model, resident on one GPU.
pub struct GpuModel {
    /// Decode steps captured as CUDA graphs ([`graphs`]); first, so that they go before
    /// the kernels, weights and pool they use.
    graphs: Mutex<Graphs>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    dense: DenseKernels,
    moe: MoeKernels,
    /// A hybrid model's gated DeltaNet kernels.
    linear: Option<LinearKernels>,
    /// Ones of a head's width with the model's epsilon: Llama 4's weightless q/k norm.
    unit_norm: Option<Norm>,
    layers: Vec<Layer>,
    final_norm: Norm,
    lm_head: Matrix,
    config: ModelConfig,
    softmax_scale: f32,
    interleaved: bool,
    /// The GPU's ordinal.
    gpu: usize,
    /// Each layer's router where MoE layers route on the GPU (empty where they route on the
    /// host: see [`routed`]).
    gates: Vec<Option<DeviceGate>>,
    /// The pool every KV cache of this GPU takes its blocks from: sized by
    /// [`GpuModel::reserve_kv_cache`], or at the first step for
    /// [`DEFAULT_POOL_SEQUENCES`] whole contexts within what the GPU has free.
    kv: Mutex<Option<Arc<KvPool>>>,
    /// cuBLAS's work area, set so that its products allocate nothing while a graph is
    /// captured.
    _blas_workspace: Buffer,
}

/// cuBLAS's work area: what NVIDIA advises for Hopper.
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Whole contexts a KV pool not sized by the node holds (`generate`, the tests): the GPU's
/// free memory bounds it too.
const DEFAULT_POOL_SEQUENCES: usize = 8;

/// Lets the GPU's default memory pool keep what a step frees: each step's work buffers come
/// from the pool (stream-ordered) and, with the default threshold of 0, would go back to the
/// driver at every synchronisation (once per MoE layer) and be mapped again.
fn keep_freed_memory(ctx: &CudaContext) -> Result<(), CudaError> {
    let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
    let mut threshold = u64::MAX;
    // SAFETY: `pool` is written by the driver before it is read; the attribute takes a u64.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool.assume_init(),
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .result()?;
    }
    Ok(())
}

impl GpuModel {
    /// Uploads `weights` to GPU `gpu` after checking that they fit in `memory_fraction` of
    /// its free memory.
    pub fn load(
        gpu: &GpuInfo,
        config: &ModelConfig,
        weights: &DenseWeights,
        softmax_scale: f32,
        interleaved: bool,
        memory_fraction: f64,
        cache_dir: Option<&std::path::Path>,
    ) -> Result<GpuModel, CudaError> {
        if let Some(refused) = super::deepseek_v4_refused(config) {
            return Err(refused);
        }
        if let Some(part) = dense_part_the_gpu_lacks(config) {
            return Err(CudaError::Unsupported(format!(
                "{}: the GPU's dense part has no {part}; serve it with the dense part on the \
                 CPU (experts may still go to the GPU)",
                config.model_type
            )));
        }
        let ctx = CudaContext::new(gpu.ordinal)?;
        // SAFETY: one stream, used by one thread at a time (the engine holds a lock).
        unsafe { ctx.disable_event_tracking() };
        let (free, _) = ctx.mem_get_info()?;
        let need = weight_bytes(weights);
        let usable = (free as f64 * memory_fraction) as usize;
        if need > usable {
            return Err(CudaError::DenseDoesNotFit {
                gpu: gpu.ordinal,
                need_mib: need.div_ceil(1 << 20),
                usable_mib: usable >> 20,
            });
        }
        keep_freed_memory(&ctx)?;
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let blas_workspace = Buffer::new(&stream, BLAS_WORKSPACE_BYTES)?;
        // SAFETY: the buffer lives as long as the handle (both fields of the model).
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                blas_workspace.ptr as *mut std::ffi::c_void,
                BLAS_WORKSPACE_BYTES,
            )
            .result()?
        };
        let dense = DenseKernels::load(&ctx, gpu, cache_dir)?;
        let moe = MoeKernels::load(&ctx, gpu, cache_dir)?;
        let linear = match config.linear_attention {
            Some(_) => Some(LinearKernels::load(&ctx, gpu, cache_dir)?),
            None => None,
        };

        let Uploaded {
            layers,
            final_norm,
            lm_head,
        } = weights::upload(&stream, weights)?;
        let gates = match routed::upload_gates(&stream, config, weights)? {
            Ok(gates) => gates,
            Err(why) => {
                tracing::info!(gpu = gpu.ordinal, %why, "MoE layers route on the host");
                Vec::new()
            }
        };
        let unit_norm = match &config.attention {
            AttentionConfig::Gqa {
                layers, head_dim, ..
            } if layers.iter().any(|a| a.unit_qk_norm) => Some(Norm {
                weight: Buffer::from_host(&stream, &vec![1f32; *head_dim])?,
                eps: config.rms_norm_eps,
            }),
            _ => None,
        };
        let model = GpuModel {
            unit_norm,
            gpu: gpu.ordinal,
            gates,
            kv: Mutex::new(None),
            graphs: Mutex::new(Graphs::new()),
            _blas_workspace: blas_workspace,
            final_norm,
            lm_head,
            blas,
            dense,
            moe,
            linear,
            layers,
            config: config.clone(),
            softmax_scale,
            interleaved,
            stream,
        };
        model.stream.synchronize()?;
        tracing::info!(
            gpu = gpu.ordinal,
            weight_mib = need >> 20,
            "dense part of the model on the GPU"
        );
        Ok(model)
    }

    /// `y[rows, out] = x[rows, in] · Wᵀ (+ bias)`, x bf16 on the GPU.
    fn linear(&self, m: &Matrix, x: u64, rows: usize, y: u64, output: Output) -> StepResult {
        // SAFETY: `x` holds `[rows, in]` bf16 and `y` room for `[rows, out]` (the callers
        // size them from the same matrix).
        unsafe {
            blas::gemm(
                &self.blas,
                Gemm::linear(m.out, rows, m.inp),
                m.weight.ptr,
                x,
                y,
                output,
            )?;
            if let Some(bias) = &m.bias {
                // Only f32 outputs carry biases (MLP gate/up biases are refused at load).
                self.dense
                    .add_bias(&self.stream, y, rows, m.out, bias.ptr)?;
            }
        }
        Ok(())
    }

    /// f32 → bf16 of `n` values into a new scratch buffer.
    fn bf16_of(&self, scratch: &mut Scratch, x: u64, n: usize) -> Result<u64, CudaError> {
        let out = scratch.bf16(n)?;
        // SAFETY: `x` holds `n` f32; `out` room for `n` bf16.
        unsafe { self.moe.to_bf16(&self.stream, x, n, out)? };
        Ok(out)
    }

    /// RMSNorm of `rows` rows of `width` (packed) into `out`.
    fn norm(&self, n: &Norm, x: u64, rows: usize, width: usize, out: u64) -> StepResult {
        // SAFETY: `x`, `out`: `[rows, width]` f32; the weight has `width` values.
        unsafe {
            self.dense.rms_norm(
                &self.stream,
                x,
                rows,
                width,
                width,
                n.weight.ptr,
                n.eps,
                out,
            )
        }
    }

    /// A SwiGLU block over `rows` bf16 rows; returns f32 `[rows, H]`.
    fn mlp(&self, m: &Mlp, scratch: &mut Scratch, x: u64, rows: usize) -> Result<u64, CudaError> {
        let inter = m.gate_up.out / 2;
        let gate_up = scratch.bf16(rows * m.gate_up.out)?;
        self.linear(&m.gate_up, x, rows, gate_up, Output::Bf16)?;
        let act = scratch.bf16(rows * inter)?;
        // SAFETY: `gate_up`: `[rows, 2·I]` bf16; `act`: room for `[rows, I]` bf16.
        // The dense MLPs and shared experts this backend takes are plain SwiGLU.
        unsafe {
            self.moe.swiglu(
                &self.stream,
                gate_up,
                (rows, inter),
                crate::compute::quant::SwiGluActivation::Silu,
                act,
            )?
        };
        let out = scratch.f32(rows * m.down.out)?;
        self.linear(&m.down, act, rows, out, Output::F32)?;
        Ok(out)
    }

    /// Free memory on this model's GPU now.
    pub fn free_memory(&self) -> Result<usize, CudaError> {
        Ok(self.stream.context().mem_get_info()?.0)
    }

    /// The GPU's ordinal.
    pub fn gpu(&self) -> usize {
        self.gpu
    }

    /// Allocates the pool of KV cache blocks every sequence of this GPU takes its cache from:
    /// `blocks` blocks of [`KV_BLOCK`](crate::compute::cuda::dense::KV_BLOCK) positions
    /// (the batcher's budget, so that what it admits fits). Refused once caches hold blocks
    /// of an earlier pool.
    pub fn reserve_kv_cache(&self, blocks: usize) -> Result<(), CudaError> {
        let mut kv = self.kv.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pool) = kv.as_ref()
            && pool.free_blocks() < pool.blocks()
        {
            return Err(CudaError::Unsupported(
                "resizing a KV cache pool whose blocks are in use".into(),
            ));
        }
        *kv = None;
        // The graphs read the old pool's addresses.
        self.graphs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .forget();
        let pool = KvPool::new(&self.stream, &self.config, blocks.max(1))?;
        self.stream.synchronize()?;
        tracing::info!(
            gpu = self.gpu,
            blocks,
            mib = (blocks * KvPool::block_bytes(&self.config)) >> 20,
            "KV cache pool on the GPU"
        );
        *kv = Some(Arc::new(pool));
        Ok(())
    }

    /// The KV pool's free blocks and all its blocks (`None` before its first use).
    pub fn kv_blocks(&self) -> Option<(usize, usize)> {
        let kv = self.kv.lock().unwrap_or_else(|e| e.into_inner());
        kv.as_ref().map(|pool| (pool.free_blocks(), pool.blocks()))
    }

    /// The KV pool, allocated at its default size on first use.
    fn kv_pool(&self) -> Result<Arc<KvPool>, CudaError> {
        let mut kv = self.kv.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pool) = kv.as_ref() {
            return Ok(pool.clone());
        }
        let block = KvPool::block_bytes(&self.config).max(1);
        let wanted = DEFAULT_POOL_SEQUENCES
            * self
                .config
                .max_position_embeddings
                .div_ceil(crate::compute::cuda::dense::KV_BLOCK);
        let room = self.free_memory()? / 10 * 9 / block;
        let pool = Arc::new(KvPool::new(
            &self.stream,
            &self.config,
            wanted.min(room).max(1),
        )?);
        *kv = Some(pool.clone());
        Ok(pool)
    }

    /// A copy of the first `positions` positions of `cache`, in blocks of its own.
    pub fn copy_cache(
        &self,
        cache: &DeviceCache,
        positions: usize,
    ) -> Result<DeviceCache, CudaError> {
        let copy = cache.copy(&self.stream, &self.kv_pool()?, positions)?;
        self.stream.synchronize()?;
        Ok(copy)
    }

    /// What every layer of a step reads: rotary tables, each row's sequence and position,
    /// the block tables and, for a hybrid model, the sequences' states gathered from their
    /// pages (see `linear`). Block tables are `stride` wide where given (a graph's, which
    /// must not change from step to step), else as wide as the longest.
    fn step(
        &self,
        scratch: &mut Scratch,
        of: &StepRows,
        caches: &[&mut DeviceCache],
        stride: Option<usize>,
    ) -> Result<Step, CudaError> {
        let (angles, segments) = (of.angles, of.segments);
        let rows = angles.len();
        let cos: Vec<f32> = angles.iter().flat_map(|a| a.cos.iter().copied()).collect();
        let sin: Vec<f32> = angles.iter().flat_map(|a| a.sin.iter().copied()).collect();
        let rope_dim = angles.first().map_or(0, |a| a.cos.len() * 2);
        let mut row_seq = Vec::with_capacity(rows);
        let mut row_pos = Vec::with_capacity(rows);
        for (s, segment) in segments.iter().enumerate() {
            for i in 0..segment.rows.len() {
                row_seq.push(s as i32);
                row_pos.push((segment.start_position + i) as i32);
            }
        }
        // Each sequence's blocks, `[seqs, stride]` (shared by every layer).
        let longest = caches.iter().map(|c| c.blocks().len()).max().unwrap_or(0);
        let stride = stride.unwrap_or(longest).max(longest).max(1);
        let mut table = vec![0i32; caches.len() * stride];
        for (row, cache) in table.chunks_mut(stride).zip(caches.iter()) {
            for (slot, &block) in row.iter_mut().zip(cache.blocks()) {
                *slot = block as i32;
            }
        }
        let states = match &self.linear {
            Some(_) => Some(self.state_step(scratch, segments, caches)?),
            None => None,
        };
        let tiles = self.row_tiles(scratch, segments)?;
        Ok(Step {
            rows,
            cos: scratch.upload(&cos)?,
            sin: scratch.upload(&sin)?,
            rope_dim,
            row_seq: scratch.upload(&row_seq)?,
            row_pos: scratch.upload(&row_pos)?,
            table: BlockTable {
                blocks: scratch.upload(&table)?,
                stride,
            },
            states,
            tiles,
            pool: of.pool.clone(),
        })
    }

    /// A step's GQA rows in tiles for the prefill attention kernel, where some sequence
    /// prefills more than one row (a step of single rows, a decode, attends row by row) and
    /// the heads fit a tile.
    fn row_tiles(
        &self,
        scratch: &mut Scratch,
        segments: &[Segment],
    ) -> Result<Option<RowTiles>, CudaError> {
        let AttentionConfig::Gqa { head_dim, .. } = self.config.attention else {
            return Ok(None);
        };
        let Some(per_tile) = rows_per_tile(head_dim, head_dim) else {
            return Ok(None);
        };
        if segments.iter().all(|s| s.rows.len() <= 1) {
            return Ok(None);
        }
        let (mut first, mut len) = (Vec::new(), Vec::new());
        for segment in segments {
            for start in segment.rows.clone().step_by(per_tile) {
                first.push(start as i32);
                len.push((segment.rows.end - start).min(per_tile) as i32);
            }
        }
        Ok(Some(RowTiles {
            count: first.len(),
            first: scratch.upload(&first)?,
            len: scratch.upload(&len)?,
            rows_per_tile: per_tile,
        }))
    }

    /// Runs every layer over the step's rows, then the final norm and the lm head on rows
    /// `logit_rows` (each segment's last row, or all of a segment's rows when its logits
    /// are all wanted). `hidden` holds the rows' embeddings; caches are extended (their
    /// lengths are the caller's to advance); `routed(layer, normed, rows)` returns the
    /// combined routed-expert output of an MoE layer from host rows, where `executor` (when
    /// given) does not take the rows on the GPU. Returns `[logit_rows, vocab]` logits. A
    /// decode step runs from CUDA graphs where it can ([`graphs`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward<E: From<CudaError> + From<ExpertError>>(
        &self,
        hidden: &[f32],
        angles: &[RopeAngles],
        segments: &[Segment],
        logit_rows: &[usize],
        caches: &mut [&mut DeviceCache],
        executor: Option<&dyn ExpertExecutor>,
        routed: &mut RoutedExperts<E>,
    ) -> Result<Vec<f32>, E> {
        let pool = self.kv_pool()?;
        for (cache, segment) in caches.iter_mut().zip(segments) {
            cache.reserve(&pool, segment.start_position + segment.rows.len())?;
            cache.make_writable(&self.stream, segment.start_position)?;
        }
        let step = StepRows {
            hidden,
            angles,
            segments,
            logit_rows,
            pool,
        };
        let experts = Experts { executor, routed };
        match self.graph_shape(&step, caches, experts.executor) {
            Some(shape) => self.forward_graphed(shape, &step, caches, experts),
            None => Ok(self.forward_plain(&step, caches, experts, None)?.0),
        }
    }

    /// [`GpuModel::forward`] kernel by kernel, its work buffers from the stream's allocator;
    /// block tables `stride` wide where given. Returns the logits and the most work-buffer
    /// bytes held at once (what a graph of the same step needs for its arena).
    fn forward_plain<E: From<CudaError> + From<ExpertError>>(
        &self,
        step: &StepRows,
        caches: &[&mut DeviceCache],
        mut experts: Experts<E>,
        stride: Option<usize>,
    ) -> Result<(Vec<f32>, usize), E> {
        let mut phases = Phases::new();
        let mut scratch = Scratch::new(&self.stream);
        let io = self.inputs(&mut scratch, step, caches, stride)?;
        let layer_start = scratch.mark();
        phases.end(0, &self.stream)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let gate = self.gates.get(l).and_then(Option::as_ref).filter(|_| {
                experts
                    .executor
                    .is_some_and(|e| !e.avoid(l).is_some_and(|a| a.iter().any(|&x| x)))
            });
            let grouped = self.before_experts(l, layer, &io, &mut scratch, &mut phases, gate)?;
            self.after_experts(l, grouped.as_ref(), &io, &mut experts, &mut scratch)?;
            phases.end(3, &self.stream)?;
            // This layer's temporaries are no longer needed (freed in stream order).
            scratch.release(layer_start);
        }
        let logits = self.head(&io, &mut scratch)?;
        let out = self.logits_to_host(logits, io.wanted)?;
        phases.end(4, &self.stream)?;
        phases.log(io.rows, caches.len());
        Ok((out, scratch.peak()))
    }

    /// The step's inputs on the GPU: the rows' embeddings, what every layer reads, the
    /// normalised rows' buffer and the indices of the rows whose logits are wanted.
    fn inputs(
        &self,
        scratch: &mut Scratch,
        step: &StepRows,
        caches: &[&mut DeviceCache],
        stride: Option<usize>,
    ) -> Result<Inputs, CudaError> {
        let rows = step.hidden.len() / self.config.hidden_size;
        let x = scratch.upload(step.hidden)?;
        let layers = self.step(scratch, step, caches, stride)?;
        let normed = scratch.f32(step.hidden.len())?;
        let wanted: Vec<i32> = step
            .logit_rows
            .iter()
            .filter(|&&r| r < rows)
            .map(|&r| r as i32)
            .collect();
        Ok(Inputs {
            rows,
            x,
            normed,
            wanted: wanted.len(),
            wanted_rows: scratch.upload(&wanted)?,
            step: layers,
        })
    }

    /// Layer `l` up to its routed experts: norms, attention, the dense MLP or shared
    /// experts, and with `gate` the routing and grouping of the rows on the GPU. Kernels
    /// only, nothing waited for: what a graph of the layer captures.
    fn before_experts(
        &self,
        l: usize,
        layer: &Layer,
        io: &Inputs,
        scratch: &mut Scratch,
        phases: &mut Phases,
        gate: Option<&DeviceGate>,
    ) -> Result<Option<RoutedRows>, CudaError> {
        let stream = &self.stream;
        let (x, normed, rows, h) = (io.x, io.normed, io.rows, self.config.hidden_size);
        self.norm(&layer.input_norm, x, rows, h, normed)?;
        let xb = self.bf16_of(scratch, normed, rows * h)?;
        phases.end(2, stream)?;
        let attended = self.attention(l, &layer.attention, &io.step, scratch, xb)?;
        phases.end(1, stream)?;
        // SAFETY: both `[rows, H]` f32.
        unsafe { self.dense.add_rows(stream, x, attended, rows * h)? };
        self.norm(&layer.post_norm, x, rows, h, normed)?;
        let xb = self.bf16_of(scratch, normed, rows * h)?;
        if let Some(mlp) = &layer.mlp {
            let out = self.mlp(mlp, scratch, xb, rows)?;
            if let Some(gate) = &layer.shared_gate {
                let logits = scratch.f32(rows)?;
                self.linear(gate, xb, rows, logits, Output::F32)?;
                // SAFETY: `out`: `[rows, H]` f32; `logits`: `[rows]` f32.
                unsafe {
                    self.dense
                        .scale_rows_by_sigmoid(stream, out, logits, rows, h)?
                };
            }
            // SAFETY: both `[rows, H]` f32.
            unsafe { self.dense.add_rows(stream, x, out, rows * h)? };
        }
        phases.end(2, stream)?;
        gate.map(|gate| self.route_rows(gate, scratch, xb, rows))
            .transpose()
    }

    /// Layer `l`'s routed experts over its rows and the add of their output: from the rows
    /// `grouped` on the GPU where the executor takes them, else from the normalised rows
    /// brought to the host (nothing for a dense layer).
    fn after_experts<E: From<CudaError> + From<ExpertError>>(
        &self,
        l: usize,
        grouped: Option<&RoutedRows>,
        io: &Inputs,
        experts: &mut Experts<E>,
        scratch: &mut Scratch,
    ) -> Result<(), E> {
        let stream = &self.stream;
        let (rows, h) = (io.rows, self.config.hidden_size);
        let on_device = match (grouped, experts.executor) {
            (Some(grouped), Some(executor)) => self
                .run_routed(l, grouped, executor, rows)
                .map_err(|e| match e {
                    RoutedError::Cuda(e) => E::from(e),
                    RoutedError::Expert(e) => E::from(e),
                })?,
            _ => None,
        };
        let out = match on_device {
            Some(out) => out,
            None if self.layers[l].moe => {
                let mut normed = vec![0f32; rows * h];
                // SAFETY: `normed` holds `[rows, H]` f32; synchronised before it is read.
                unsafe {
                    result::memcpy_dtoh_async(&mut normed[..], io.normed, stream.cu_stream())
                        .map_err(CudaError::from)?
                };
                stream.synchronize().map_err(CudaError::from)?;
                let out = (experts.routed)(l, &normed, rows)?;
                scratch.upload(&out)?
            }
            None => return Ok(()),
        };
        // SAFETY: both `[rows, H]` f32.
        unsafe { self.dense.add_rows(stream, io.x, out, rows * h)? };
        Ok(())
    }

    /// The final norm and the lm head over the wanted rows: f32 `[wanted, vocab]` logits
    /// on the GPU.
    fn head(&self, io: &Inputs, scratch: &mut Scratch) -> Result<u64, CudaError> {
        let h = self.config.hidden_size;
        self.norm(&self.final_norm, io.x, io.rows, h, io.normed)?;
        let xb = self.bf16_of(scratch, io.normed, io.rows * h)?;
        let wanted_rows = scratch.bf16(io.wanted * h)?;
        // SAFETY: `xb`: `[rows, H]` bf16, every index < rows; `wanted_rows` room for them.
        unsafe {
            self.moe
                .gather_rows(&self.stream, xb, io.wanted_rows, io.wanted, h, wanted_rows)?
        };
        let logits = scratch.f32(io.wanted * self.lm_head.out)?;
        self.linear(&self.lm_head, wanted_rows, io.wanted, logits, Output::F32)?;
        Ok(logits)
    }

    /// `rows` rows of logits from the GPU.
    fn logits_to_host(&self, logits: u64, rows: usize) -> Result<Vec<f32>, CudaError> {
        let mut out = vec![0f32; rows * self.lm_head.out];
        // SAFETY: `logits` holds `[rows, vocab]` f32; synchronised before it is read.
        unsafe { result::memcpy_dtoh_async(&mut out[..], logits, self.stream.cu_stream())? };
        self.stream.synchronize()?;
        Ok(out)
    }
}

/// The rows of one step and what the host knows of them.
struct StepRows<'a> {
    hidden: &'a [f32],
    angles: &'a [RopeAngles],
    segments: &'a [Segment],
    logit_rows: &'a [usize],
    pool: Arc<KvPool>,
}

/// Where a step's routed experts run: `executor` on the rows on the GPU, else `routed` on
/// the host's copy.
struct Experts<'a, 'r, E> {
    executor: Option<&'a dyn ExpertExecutor>,
    routed: &'a mut RoutedExperts<'r, E>,
}

/// A step's inputs on the GPU ([`GpuModel::inputs`]).
struct Inputs {
    rows: usize,
    /// f32 `[rows, H]`: the residual stream.
    x: u64,
    /// f32 `[rows, H]`: the normalised rows of the last norm.
    normed: u64,
    /// How many rows' logits are wanted, and their indices (i32).
    wanted: usize,
    wanted_rows: u64,
    step: Step,
}

/// A part of the dense forward pass that a family needs and the GPU's dense part
/// (`gpu::model`) does not implement, which would otherwise load and compute something else.
fn dense_part_the_gpu_lacks(config: &ModelConfig) -> Option<&'static str> {
    if let Some(linear) = &config.linear_attention
        && linear.conv_kernel > crate::compute::cuda::linear::MAX_CONV_KERNEL
    {
        return Some("a linear-attention convolution wider than 16 (`linear_conv_kernel_dim`)");
    }
    matches!(
        &config.attention,
        AttentionConfig::Mla {
            indexer: Some(_),
            ..
        }
    )
    .then_some("the lightning indexer of DeepSeek Sparse Attention (`index_topk`)")
}

type StepResult = Result<(), CudaError>;

/// Where a step's time goes, phase by phase (`MOE_GPU_STEP_PROFILE=1`): the stream is
/// synchronised after each phase, which costs speed, and each step logs its phases.
struct Phases {
    enabled: bool,
    last: std::time::Instant,
    /// Milliseconds: set-up and uploads, attention, norms and dense MLPs, routed experts
    /// (to the host, routed, back), output head and logits to the host.
    ms: [f64; 5],
}

impl Phases {
    const NAMES: [&'static str; 5] = ["setup", "attention", "norms_mlp", "routed", "head"];

    fn new() -> Phases {
        static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        Phases {
            enabled: *ENABLED
                .get_or_init(|| std::env::var_os("MOE_GPU_STEP_PROFILE").is_some_and(|v| v != "0")),
            ..Phases::off()
        }
    }

    /// Phases not measured: while a graph is captured, when nothing may wait for the GPU.
    fn off() -> Phases {
        Phases {
            enabled: false,
            last: std::time::Instant::now(),
            ms: [0.0; 5],
        }
    }

    /// Ends phase `i` (the time since the previous phase ended).
    fn end(&mut self, i: usize, stream: &CudaStream) -> StepResult {
        if self.enabled {
            stream.synchronize().map_err(CudaError::from)?;
            let now = std::time::Instant::now();
            self.ms[i] += (now - self.last).as_secs_f64() * 1e3;
            self.last = now;
        }
        Ok(())
    }

    fn log(&self, rows: usize, seqs: usize) {
        if self.enabled {
            let phases: Vec<String> = Self::NAMES
                .iter()
                .zip(self.ms)
                .map(|(name, ms)| format!("{name} {ms:.2}"))
                .collect();
            tracing::info!(
                rows,
                seqs,
                total_ms = self.ms.iter().sum::<f64>(),
                "GPU step phases (ms): {}",
                phases.join(", ")
            );
        }
    }
}

/// `(layer, normed rows, rows)` → the combined output of the layer's routed experts.
pub type RoutedExperts<'a, E> = dyn FnMut(usize, &[f32], usize) -> Result<Vec<f32>, E> + 'a;

/// What every layer of one step reads.
struct Step {
    rows: usize,
    cos: u64,
    sin: u64,
    rope_dim: usize,
    row_seq: u64,
    row_pos: u64,
    /// Each sequence's blocks of `pool`.
    table: BlockTable,
    /// A hybrid model's linear-attention states: where they lie, and how each layer's part
    /// is packed for the step.
    states: Option<(PackedStates, StatePages)>,
    /// The rows in tiles for the prefill attention kernel (GQA, where some sequence
    /// prefills).
    tiles: Option<RowTiles>,
    pool: Arc<KvPool>,
}

impl Step {
    /// The device array of sequences' pointers to array `which` of layer `layer`.
    /// Layer `layer`'s paged cache (MLA's values are inside its keys: the same pool).
    fn cache(&self, layer: usize) -> PagedCache {
        let keys = self.pool.layer(layer, 0);
        let values = match self.pool.layer(layer, 1) {
            0 => keys,
            values => values,
        };
        PagedCache {
            keys,
            values,
            table: self.table,
        }
    }
}
