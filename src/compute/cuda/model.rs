//! The dense part of a model on one GPU: every decoder layer's norms, attention over a KV
//! cache kept on the GPU, the dense MLPs and shared experts, the final norm and the lm head,
//! with bf16 weights, bf16 inputs to the products and f32 everywhere else (the residual
//! stream, norms, rotary, softmax). The host sends the step's embedding rows and rotary
//! tables and gets the logits back. Routed experts stay behind the engine's
//! [`crate::moe::ExpertExecutor`] (device actors, other nodes): at each MoE layer the
//! normalised rows go to the host, the host routes them (the CPU's gate, so routing equals
//! the CPU backend's for the same rows), and the combined expert output comes back.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream, DeviceRepr, result, sys};
use half::bf16;

use super::blas::{self, Batch, Gemm, Output};
use super::dense::{AttentionShape, DenseKernels};
use super::experts::Buffer;
use super::moe::MoeKernels;
use super::{CudaError, GpuInfo};
use crate::compute::cpu::{Linear, SwiGlu};
use crate::engine::attention::Segment;
use crate::engine::rope::RopeAngles;
use crate::model::config::{AttentionConfig, ModelConfig};
use crate::model::weights::{
    AttentionWeights, DenseWeights, FeedForward, QueryProjection, RmsNorm,
};

/// A projection: bf16 `[out, in]` and its f32 bias.
struct Matrix {
    weight: Buffer,
    bias: Option<Buffer>,
    out: usize,
    inp: usize,
}

struct Norm {
    weight: Buffer,
    eps: f32,
}

/// A SwiGLU block with gate and up stacked into one `[2·I, H]` product.
struct Mlp {
    gate_up: Matrix,
    down: Matrix,
}

// One per layer: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum Query {
    Direct(Matrix),
    LowRank {
        down: Matrix,
        norm: Norm,
        up: Matrix,
    },
}

enum Attention {
    Gqa {
        q: Matrix,
        k: Matrix,
        v: Matrix,
        o: Matrix,
        q_norm: Option<Norm>,
        k_norm: Option<Norm>,
    },
    Mla {
        q: Query,
        kv_down: Matrix,
        kv_norm: Norm,
        /// `kv_b_proj` as bf16 `[heads · (nope + v), kv_lora_rank]`, used per head.
        kv_up: Buffer,
        o: Matrix,
    },
}

struct Layer {
    input_norm: Norm,
    attention: Attention,
    post_norm: Norm,
    /// The dense MLP, or the shared expert of an MoE layer.
    mlp: Option<Mlp>,
    moe: bool,
}

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
    /// Bytes of GPU memory held.
    pub fn bytes(&self) -> usize {
        self.layers.len() * self.capacity * (self.widths[0] + self.widths[1]) * 4
    }

    /// Makes room for `positions` positions, keeping the first `kept`: capacity doubles (a
    /// sequence's growth costs O(length) copies in all), bounded by the model's context.
    fn reserve(
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

    fn ptr(&self, layer: usize, which: usize) -> u64 {
        self.layers[layer][which].as_ref().map_or(0, |b| b.ptr)
    }
}

/// Allocations of one step, freed (in stream order) when it ends.
struct Scratch<'s> {
    stream: &'s Arc<CudaStream>,
    held: Vec<Buffer>,
}

impl Scratch<'_> {
    fn f32(&mut self, n: usize) -> Result<u64, CudaError> {
        self.bytes(n * 4)
    }

    fn bf16(&mut self, n: usize) -> Result<u64, CudaError> {
        self.bytes(n * 2)
    }

    fn bytes(&mut self, bytes: usize) -> Result<u64, CudaError> {
        let buffer = Buffer::new(self.stream, bytes)?;
        let ptr = buffer.ptr;
        self.held.push(buffer);
        Ok(ptr)
    }

    fn upload<T: DeviceRepr>(&mut self, values: &[T]) -> Result<u64, CudaError> {
        let ptr = self.bytes(std::mem::size_of_val(values))?;
        // SAFETY: the buffer holds `values`; a copy from pageable memory has read it before
        // returning.
        unsafe { result::memcpy_htod_async(ptr, values, self.stream.cu_stream())? };
        Ok(ptr)
    }
}

/// The dense part of a model, resident on one GPU.
pub struct GpuModel {
    pub gpu: GpuInfo,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    dense: DenseKernels,
    moe: MoeKernels,
    layers: Vec<Layer>,
    final_norm: Norm,
    lm_head: Matrix,
    config: ModelConfig,
    softmax_scale: f32,
    interleaved: bool,
    weight_bytes: usize,
}

/// Everything the weights will take on the GPU, in bytes.
fn weight_bytes(weights: &DenseWeights) -> usize {
    fn linear(l: &Linear) -> usize {
        l.weight.len() * 2 + l.bias.as_ref().map_or(0, |b| b.len() * 4)
    }
    fn mlp(m: &SwiGlu) -> usize {
        linear(&m.gate) + linear(&m.up) + linear(&m.down)
    }
    let norm = |n: &RmsNorm| n.weight.len() * 4;
    let layers: usize = weights
        .layers
        .iter()
        .map(|l| {
            let attention = match &l.attention {
                AttentionWeights::Gqa {
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                } => {
                    linear(q)
                        + linear(k)
                        + linear(v)
                        + linear(o)
                        + q_norm.as_ref().map_or(0, norm)
                        + k_norm.as_ref().map_or(0, norm)
                }
                AttentionWeights::Mla {
                    q,
                    kv_down,
                    kv_norm,
                    kv_up,
                    o,
                } => {
                    let q = match q {
                        QueryProjection::Direct(p) => linear(p),
                        QueryProjection::LowRank { down, norm: n, up } => {
                            linear(down) + norm(n) + linear(up)
                        }
                    };
                    q + linear(kv_down) + norm(kv_norm) + linear(kv_up) + linear(o)
                }
            };
            let ff = match &l.feed_forward {
                FeedForward::Dense(m) => mlp(m),
                FeedForward::Moe(moe) => moe.shared_expert.as_ref().map_or(0, mlp),
            };
            attention + ff + norm(&l.input_norm) + norm(&l.post_attention_norm)
        })
        .sum();
    layers + linear(weights.lm_head()) + norm(&weights.final_norm)
}

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

fn to_bf16(values: &[f32]) -> Vec<bf16> {
    values.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// Uploads host values into a new buffer (synchronised by the caller before `values` go).
fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, values: &[T]) -> Result<Buffer, CudaError> {
    let buffer = Buffer::new(stream, std::mem::size_of_val(values))?;
    // SAFETY: the buffer holds `values`; a copy from pageable memory has read it before
    // returning.
    unsafe { result::memcpy_htod_async(buffer.ptr, values, stream.cu_stream())? };
    Ok(buffer)
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
        let dense = DenseKernels::load(&ctx, gpu, cache_dir)?;
        let moe = MoeKernels::load(&ctx, gpu, cache_dir)?;

        let matrix = |l: &Linear| -> Result<Matrix, CudaError> {
            Ok(Matrix {
                weight: upload(&stream, &to_bf16(&l.weight))?,
                bias: l.bias.as_deref().map(|b| upload(&stream, b)).transpose()?,
                out: l.out_features,
                inp: l.in_features,
            })
        };
        let norm = |n: &RmsNorm| -> Result<Norm, CudaError> {
            Ok(Norm {
                weight: upload(&stream, &n.weight)?,
                eps: n.eps,
            })
        };
        let mlp = |m: &SwiGlu| -> Result<Mlp, CudaError> {
            if m.gate.bias.is_some() || m.up.bias.is_some() {
                return Err(CudaError::Unsupported(
                    "biases on an MLP's gate or up projection".into(),
                ));
            }
            let mut stacked = to_bf16(&m.gate.weight);
            stacked.extend(to_bf16(&m.up.weight));
            Ok(Mlp {
                gate_up: Matrix {
                    weight: upload(&stream, &stacked)?,
                    bias: None,
                    out: m.gate.out_features + m.up.out_features,
                    inp: m.gate.in_features,
                },
                down: matrix(&m.down)?,
            })
        };
        let mut layers = Vec::with_capacity(weights.layers.len());
        for l in &weights.layers {
            let attention = match &l.attention {
                AttentionWeights::Gqa {
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                } => Attention::Gqa {
                    q: matrix(q)?,
                    k: matrix(k)?,
                    v: matrix(v)?,
                    o: matrix(o)?,
                    q_norm: q_norm.as_ref().map(norm).transpose()?,
                    k_norm: k_norm.as_ref().map(norm).transpose()?,
                },
                AttentionWeights::Mla {
                    q,
                    kv_down,
                    kv_norm,
                    kv_up,
                    o,
                } => Attention::Mla {
                    q: match q {
                        QueryProjection::Direct(p) => Query::Direct(matrix(p)?),
                        QueryProjection::LowRank { down, norm: n, up } => Query::LowRank {
                            down: matrix(down)?,
                            norm: norm(n)?,
                            up: matrix(up)?,
                        },
                    },
                    kv_down: matrix(kv_down)?,
                    kv_norm: norm(kv_norm)?,
                    kv_up: upload(&stream, &to_bf16(&kv_up.weight))?,
                    o: matrix(o)?,
                },
            };
            let (ff, moe) = match &l.feed_forward {
                FeedForward::Dense(m) => (Some(mlp(m)?), false),
                FeedForward::Moe(w) => (w.shared_expert.as_ref().map(mlp).transpose()?, true),
            };
            layers.push(Layer {
                input_norm: norm(&l.input_norm)?,
                attention,
                post_norm: norm(&l.post_attention_norm)?,
                mlp: ff,
                moe,
            });
            // Each layer's host copies go before the next layer's are made.
            stream.synchronize()?;
        }
        let model = GpuModel {
            gpu: gpu.clone(),
            final_norm: norm(&weights.final_norm)?,
            lm_head: matrix(weights.lm_head())?,
            blas,
            dense,
            moe,
            layers,
            config: config.clone(),
            softmax_scale,
            interleaved,
            weight_bytes: need,
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

    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// An empty cache for one sequence; it takes GPU memory as it grows.
    pub fn new_cache(&self) -> DeviceCache {
        let widths = match self.config.attention {
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
            layers: (0..self.config.num_layers).map(|_| [None, None]).collect(),
            widths,
            capacity: 0,
            max_positions: self.config.max_position_embeddings,
        }
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
        unsafe { self.moe.swiglu(&self.stream, gate_up, rows, inter, act)? };
        let out = scratch.f32(rows * m.down.out)?;
        self.linear(&m.down, act, rows, out, Output::F32)?;
        Ok(out)
    }

    /// Runs every layer over the step's rows, then the final norm and the lm head on each
    /// segment's last row. `hidden` holds the rows' embeddings; caches are extended (their
    /// lengths are the caller's to advance); `routed(layer, normed, rows)` returns the
    /// combined routed-expert output of an MoE layer. Returns `[segments, vocab]` logits.
    pub fn forward<E: From<CudaError>>(
        &self,
        hidden: &[f32],
        angles: &[RopeAngles],
        segments: &[Segment],
        caches: &mut [&mut DeviceCache],
        routed: &mut RoutedExperts<E>,
    ) -> Result<Vec<f32>, E> {
        let stream = &self.stream;
        let cfg = &self.config;
        let h = cfg.hidden_size;
        let rows = hidden.len() / h;
        for (cache, segment) in caches.iter_mut().zip(segments) {
            let end = segment.start_position + segment.rows.len();
            cache.reserve(stream, end, segment.start_position)?;
        }
        let mut scratch = Scratch {
            stream,
            held: Vec::new(),
        };
        let x = scratch.upload(hidden)?;
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
        // One pointer per (layer, array, sequence).
        let seqs = caches.len();
        let mut table = Vec::with_capacity(self.layers.len() * 2 * seqs);
        for l in 0..self.layers.len() {
            for which in 0..2 {
                table.extend(caches.iter().map(|c| c.ptr(l, which)));
            }
        }
        let step = Step {
            rows,
            cos: scratch.upload(&cos)?,
            sin: scratch.upload(&sin)?,
            rope_dim,
            row_seq: scratch.upload(&row_seq)?,
            row_pos: scratch.upload(&row_pos)?,
            table: scratch.upload(&table)?,
            seqs,
        };

        let normed = scratch.f32(rows * h)?;
        // Buffers of the whole step; each layer's own are dropped after it.
        let step_buffers = scratch.held.len();
        let mut normed_host = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            self.norm(&layer.input_norm, x, rows, h, normed)?;
            let xb = self.bf16_of(&mut scratch, normed, rows * h)?;
            let attended = self.attention(l, &layer.attention, &step, &mut scratch, xb)?;
            // SAFETY: both `[rows, H]` f32.
            unsafe { self.dense.add_rows(stream, x, attended, rows * h)? };
            self.norm(&layer.post_norm, x, rows, h, normed)?;
            let xb = self.bf16_of(&mut scratch, normed, rows * h)?;
            if let Some(mlp) = &layer.mlp {
                let out = self.mlp(mlp, &mut scratch, xb, rows)?;
                // SAFETY: both `[rows, H]` f32.
                unsafe { self.dense.add_rows(stream, x, out, rows * h)? };
            }
            if layer.moe {
                normed_host.resize(rows * h, 0.0);
                // SAFETY: `normed` holds `[rows, H]` f32; synchronised before it is read.
                unsafe {
                    result::memcpy_dtoh_async(&mut normed_host[..], normed, stream.cu_stream())
                        .map_err(CudaError::from)?
                };
                stream.synchronize().map_err(CudaError::from)?;
                let out = routed(l, &normed_host, rows)?;
                let out = scratch.upload(&out)?;
                // SAFETY: both `[rows, H]` f32.
                unsafe { self.dense.add_rows(stream, x, out, rows * h)? };
            }
            // This layer's temporaries are no longer needed (freed in stream order).
            scratch.held.truncate(step_buffers);
        }

        self.norm(&self.final_norm, x, rows, h, normed)?;
        let xb = self.bf16_of(&mut scratch, normed, rows * h)?;
        let last: Vec<i32> = segments.iter().map(|s| (s.rows.end - 1) as i32).collect();
        let last_ptr = scratch.upload(&last)?;
        let last_rows = scratch.bf16(segments.len() * h)?;
        // SAFETY: `xb`: `[rows, H]` bf16, every index < rows; `last_rows` room for them.
        unsafe {
            self.moe
                .gather_rows(stream, xb, last_ptr, segments.len(), h, last_rows)?
        };
        let vocab = self.lm_head.out;
        let logits = scratch.f32(segments.len() * vocab)?;
        self.linear(
            &self.lm_head,
            last_rows,
            segments.len(),
            logits,
            Output::F32,
        )?;
        let mut out = vec![0f32; segments.len() * vocab];
        // SAFETY: `logits` holds `[segments, vocab]` f32; synchronised before it is read.
        unsafe {
            result::memcpy_dtoh_async(&mut out[..], logits, stream.cu_stream())
                .map_err(CudaError::from)?
        };
        stream.synchronize().map_err(CudaError::from)?;
        Ok(out)
    }

    /// Attention of layer `l` over bf16 normalised rows `x`; returns f32 `[rows, H]` and
    /// appends the rows' keys to the caches.
    fn attention(
        &self,
        l: usize,
        attention: &Attention,
        step: &Step,
        scratch: &mut Scratch,
        x: u64,
    ) -> Result<u64, CudaError> {
        let stream = &self.stream;
        let rows = step.rows;
        let heads = self.config.num_heads;
        let h = self.config.hidden_size;
        match (attention, &self.config.attention) {
            (
                Attention::Gqa {
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                },
                &AttentionConfig::Gqa {
                    num_kv_heads,
                    head_dim,
                    sliding_window,
                    ..
                },
            ) => {
                let kv_width = num_kv_heads * head_dim;
                let queries = scratch.f32(rows * heads * head_dim)?;
                let keys = scratch.f32(rows * kv_width)?;
                let values = scratch.f32(rows * kv_width)?;
                self.linear(q, x, rows, queries, Output::F32)?;
                self.linear(k, x, rows, keys, Output::F32)?;
                self.linear(v, x, rows, values, Output::F32)?;
                if let Some(n) = q_norm {
                    self.norm(n, queries, rows * heads, head_dim, queries)?;
                }
                if let Some(n) = k_norm {
                    self.norm(n, keys, rows * num_kv_heads, head_dim, keys)?;
                }
                let out = scratch.f32(rows * heads * head_dim)?;
                // SAFETY: buffers sized above from the same shapes; the cache pointers of
                // this layer have room for every row's position (reserved by `forward`).
                unsafe {
                    self.rotate(step, queries, heads, head_dim, 0)?;
                    self.rotate(step, keys, num_kv_heads, head_dim, 0)?;
                    let (key_table, value_table) = (step.pointers(l, 0), step.pointers(l, 1));
                    let d = &self.dense;
                    d.store_rows(
                        stream,
                        keys,
                        rows,
                        kv_width,
                        key_table,
                        step.row_seq,
                        step.row_pos,
                    )?;
                    d.store_rows(
                        stream,
                        values,
                        rows,
                        kv_width,
                        value_table,
                        step.row_seq,
                        step.row_pos,
                    )?;
                    let shape = AttentionShape {
                        heads,
                        group: heads / num_kv_heads,
                        key_width: head_dim,
                        value_width: head_dim,
                        kv_stride: kv_width,
                        key_head_stride: head_dim,
                        value_head_stride: head_dim,
                        window: sliding_window,
                        scale: self.softmax_scale,
                    };
                    d.attend(
                        stream,
                        &shape,
                        queries,
                        rows,
                        key_table,
                        value_table,
                        step.row_seq,
                        step.row_pos,
                        out,
                    )?;
                }
                let ob = self.bf16_of(scratch, out, rows * heads * head_dim)?;
                let y = scratch.f32(rows * h)?;
                self.linear(o, ob, rows, y, Output::F32)?;
                Ok(y)
            }
            (
                Attention::Mla {
                    q,
                    kv_down,
                    kv_norm,
                    kv_up,
                    o,
                },
                &AttentionConfig::Mla {
                    kv_lora_rank: lora,
                    qk_nope_head_dim: nope,
                    qk_rope_head_dim: rope,
                    v_head_dim,
                    ..
                },
            ) => {
                let q_width = nope + rope;
                let queries = scratch.f32(rows * heads * q_width)?;
                match q {
                    Query::Direct(p) => self.linear(p, x, rows, queries, Output::F32)?,
                    Query::LowRank { down, norm, up } => {
                        let low = scratch.f32(rows * down.out)?;
                        self.linear(down, x, rows, low, Output::F32)?;
                        self.norm(norm, low, rows, down.out, low)?;
                        let lb = self.bf16_of(scratch, low, rows * down.out)?;
                        self.linear(up, lb, rows, queries, Output::F32)?;
                    }
                }
                let key_width = lora + rope;
                let compressed = scratch.f32(rows * key_width)?;
                self.linear(kv_down, x, rows, compressed, Output::F32)?;
                let d = &self.dense;
                // SAFETY: buffers sized above; the cache pointers of this layer have room for
                // every row's position (reserved by `forward`).
                unsafe {
                    self.rotate(step, queries, heads, q_width, nope)?;
                    d.rms_norm(
                        stream,
                        compressed,
                        rows,
                        key_width,
                        lora,
                        kv_norm.weight.ptr,
                        kv_norm.eps,
                        compressed,
                    )?;
                    self.rotate(step, compressed, 1, key_width, lora)?;
                    d.store_rows(
                        stream,
                        compressed,
                        rows,
                        key_width,
                        step.pointers(l, 0),
                        step.row_seq,
                        step.row_pos,
                    )?;
                }
                // The attention query per head: [q_nope · W_uk (lora) | q_rope (rope)].
                let qb = self.bf16_of(scratch, queries, rows * heads * q_width)?;
                let query = scratch.f32(rows * heads * key_width)?;
                let mla = MlaShape {
                    heads,
                    nope,
                    rope,
                    lora,
                    v: v_head_dim,
                };
                let (absorb, per_head) = mla.absorb(rows);
                let latent_out = scratch.f32(rows * heads * lora)?;
                // SAFETY: per head, A = rows [h·up_rows, h·up_rows + nope) of kv_up
                // ([nope, lora] row-major = lora × nope column-major), B = the head's nope
                // values of each row, C = the first lora values of the head's query.
                unsafe {
                    blas::gemm_batched(
                        &self.blas,
                        absorb,
                        per_head,
                        kv_up.ptr,
                        qb,
                        query,
                        Output::F32,
                    )?;
                    d.copy_rows(
                        stream,
                        queries + (nope * 4) as u64,
                        q_width,
                        query + (lora * 4) as u64,
                        key_width,
                        rows * heads,
                        rope,
                    )?;
                    let table = step.pointers(l, 0);
                    let shape = AttentionShape {
                        heads,
                        group: heads,
                        key_width,
                        value_width: lora,
                        kv_stride: key_width,
                        key_head_stride: 0,
                        value_head_stride: 0,
                        window: None,
                        scale: self.softmax_scale,
                    };
                    d.attend(
                        stream,
                        &shape,
                        query,
                        rows,
                        table,
                        table,
                        step.row_seq,
                        step.row_pos,
                        latent_out,
                    )?;
                }
                // Expand the attended latents through kv_b's value half, head by head.
                let lb = self.bf16_of(scratch, latent_out, rows * heads * lora)?;
                let values = scratch.bf16(rows * heads * v_head_dim)?;
                let (expand, per_head) = mla.expand(rows);
                // SAFETY: per head, A = rows [h·up_rows + nope, (h+1)·up_rows) of kv_up
                // ([v, lora] row-major, transposed), B = the head's latent, C = its values.
                unsafe {
                    blas::gemm_batched(
                        &self.blas,
                        expand,
                        per_head,
                        kv_up.ptr + (mla.value_offset() * 2) as u64,
                        lb,
                        values,
                        Output::Bf16,
                    )?;
                }
                let y = scratch.f32(rows * h)?;
                self.linear(o, values, rows, y, Output::F32)?;
                Ok(y)
            }
            _ => Err(CudaError::Unsupported(
                "attention weights of another kind than the config".into(),
            )),
        }
    }

    /// Rotary embedding of `rope_dim` values at `offset` of every head.
    ///
    /// # Safety
    /// `x`: `[rows, heads, head_width]` f32.
    unsafe fn rotate(
        &self,
        step: &Step,
        x: u64,
        heads: usize,
        head_width: usize,
        offset: usize,
    ) -> StepResult {
        // SAFETY: as the caller vouches; the tables hold `[rows, rope_dim / 2]`.
        unsafe {
            self.dense.rope(
                &self.stream,
                x,
                step.rows,
                heads,
                head_width,
                offset,
                step.rope_dim,
                step.cos,
                step.sin,
                self.interleaved,
            )
        }
    }
}

/// MLA's per-head products in cuBLAS's column-major terms. `kv_up` is `[heads · (nope + v),
/// lora]` row-major: for head h, rows `h·(nope+v) ..+ nope` are its key block W_uk (`[nope,
/// lora]`), the next `v` its value block W_uv (`[v, lora]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MlaShape {
    heads: usize,
    nope: usize,
    rope: usize,
    lora: usize,
    v: usize,
}

impl MlaShape {
    /// Elements from the start of `kv_up` to the first value block.
    fn value_offset(&self) -> usize {
        self.nope * self.lora
    }

    /// Query absorption, per head: `query[r, h, ..lora] = q[r, h, ..nope] · W_uk` — A is
    /// W_uk (lora × nope column-major), B the head's non-rotary queries in `[rows, heads,
    /// nope + rope]`, C the first `lora` of each head's slot in `[rows, heads, lora + rope]`.
    fn absorb(&self, rows: usize) -> (Gemm, Batch) {
        let q_width = self.nope + self.rope;
        let key_width = self.lora + self.rope;
        let gemm = Gemm {
            a_transposed: false,
            m: self.lora,
            n: rows,
            k: self.nope,
            lda: self.lora,
            ldb: self.heads * q_width,
            ldc: self.heads * key_width,
        };
        let batch = Batch {
            count: self.heads,
            stride_a: (self.nope + self.v) * self.lora,
            stride_b: q_width,
            stride_c: key_width,
        };
        (gemm, batch)
    }

    /// Value expansion, per head: `out[r, h, ..] = latent[r, h, ..] · W_uvᵀ` — A is W_uv
    /// transposed (from [`MlaShape::value_offset`]), B the attended latents `[rows, heads,
    /// lora]`, C `[rows, heads, v]`.
    fn expand(&self, rows: usize) -> (Gemm, Batch) {
        let gemm = Gemm {
            a_transposed: true,
            m: self.v,
            n: rows,
            k: self.lora,
            lda: self.lora,
            ldb: self.heads * self.lora,
            ldc: self.heads * self.v,
        };
        let batch = Batch {
            count: self.heads,
            stride_a: (self.nope + self.v) * self.lora,
            stride_b: self.lora,
            stride_c: self.v,
        };
        (gemm, batch)
    }
}

type StepResult = Result<(), CudaError>;

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
    /// `[layers, 2, seqs]` cache pointers.
    table: u64,
    seqs: usize,
}

impl Step {
    /// The device array of sequences' pointers to array `which` of layer `layer`.
    fn pointers(&self, layer: usize, which: usize) -> u64 {
        self.table + (((layer * 2 + which) * self.seqs) * 8) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::cuda::blas::host_gemm;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i + seed) * 7919 % 1009) as f32 / 504.5 - 1.0)
            .collect()
    }

    const MLA: MlaShape = MlaShape {
        heads: 3,
        nope: 4,
        rope: 2,
        lora: 5,
        v: 6,
    };

    #[test]
    fn absorption_puts_each_heads_latent_query_before_its_rotary_slot() {
        let MlaShape {
            heads,
            nope,
            rope,
            lora,
            v,
        } = MLA;
        let rows = 2;
        let kv_up = values(heads * (nope + v) * lora, 1);
        let q = values(rows * heads * (nope + rope), 2);
        let untouched = 9.0;
        let mut query = vec![untouched; rows * heads * (lora + rope)];
        let (gemm, batch) = MLA.absorb(rows);
        host_gemm(gemm, batch, &kv_up, &q, &mut query);
        for r in 0..rows {
            for h in 0..heads {
                for i in 0..lora {
                    let want: f32 = (0..nope)
                        .map(|j| {
                            q[(r * heads + h) * (nope + rope) + j]
                                * kv_up[(h * (nope + v) + j) * lora + i]
                        })
                        .sum();
                    let got = query[(r * heads + h) * (lora + rope) + i];
                    assert!((got - want).abs() < 1e-5, "row {r} head {h} [{i}]");
                }
                for i in lora..lora + rope {
                    assert_eq!(query[(r * heads + h) * (lora + rope) + i], untouched);
                }
            }
        }
    }

    #[test]
    fn expansion_applies_each_heads_value_block() {
        let MlaShape {
            heads,
            nope,
            lora,
            v,
            ..
        } = MLA;
        let rows = 2;
        let kv_up = values(heads * (nope + v) * lora, 3);
        let latent = values(rows * heads * lora, 4);
        let mut out = vec![0.0; rows * heads * v];
        let (gemm, batch) = MLA.expand(rows);
        host_gemm(gemm, batch, &kv_up[MLA.value_offset()..], &latent, &mut out);
        for r in 0..rows {
            for h in 0..heads {
                for o in 0..v {
                    let want: f32 = (0..lora)
                        .map(|i| {
                            latent[(r * heads + h) * lora + i]
                                * kv_up[(h * (nope + v) + nope + o) * lora + i]
                        })
                        .sum();
                    let got = out[(r * heads + h) * v + o];
                    assert!((got - want).abs() < 1e-5, "row {r} head {h} [{o}]");
                }
            }
        }
    }
}
