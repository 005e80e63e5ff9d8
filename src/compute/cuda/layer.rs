//! One whole MoE layer on a GPU, from bf16 hidden rows to the combined f32 output: the router
//! GEMM, top-k gating, the permutation that groups rows by expert, the grouped expert FFN
//! ([`GpuExperts::ffn`]) and the weighted combine. The benchmark runs it at Kimi shapes; the
//! GPU tests hold it to the CPU's `moe_forward`.
//!
//! The group sizes come back to the host once per layer (cuBLAS's grouped GEMM takes its
//! problem sizes from host memory): one small copy and a synchronisation.

use std::sync::Arc;

use cudarc::cublas::sys as blas;
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg, result};
use half::bf16;

use super::experts::{ExpertShape, elementwise};
use super::{CudaError, GpuExperts, GpuInfo};
use crate::model::config::GatingConfig;

/// The routing half of a layer: router weights and gating rule.
#[derive(Debug, Clone)]
pub struct Gate {
    /// `[num_experts, hidden]`.
    pub router: Vec<bf16>,
    /// DeepSeek's `e_score_correction_bias`, one per expert.
    pub correction_bias: Option<Vec<f32>>,
    pub gating: GatingConfig,
    pub top_k: usize,
}

/// Device buffers of one layer's routing, sized for `max_tokens`.
struct Routing {
    router: u64,
    bias: Option<u64>,
    /// Input rows `[max_tokens, hidden]` bf16.
    x: u64,
    logits: u64,
    ids: u64,
    weights: u64,
    counts: u64,
    offsets: u64,
    cursor: u64,
    slot_of_pair: u64,
    source_row: u64,
    /// Output rows `[max_tokens, hidden]` f32.
    out: u64,
    _buffers: Vec<cudarc::driver::CudaSlice<u8>>,
}

/// An MoE layer (layer index 0 of its [`GpuExperts`]) on one GPU.
pub struct GpuMoeLayer {
    pub experts: GpuExperts,
    gate: Gate,
    routing: Routing,
    max_tokens: usize,
    /// Experts that received rows in the last forward pass.
    pub last_active_experts: usize,
}

fn alloc(
    stream: &Arc<CudaStream>,
    bytes: usize,
) -> Result<(cudarc::driver::CudaSlice<u8>, u64), CudaError> {
    // SAFETY: each buffer is written before it is read.
    let slice = unsafe { stream.alloc::<u8>(bytes.max(4)) }?;
    let (ptr, _) = cudarc::driver::DevicePtr::device_ptr(&slice, stream);
    Ok((slice, ptr))
}

impl GpuMoeLayer {
    /// A layer of `shape` on `gpu` for up to `max_tokens` tokens a pass. Expert weights are
    /// written afterwards through `experts` (upload or fill_random).
    pub fn new(
        gpu: &GpuInfo,
        shape: ExpertShape,
        gate: Gate,
        max_tokens: usize,
        memory_fraction: f64,
        cache_dir: Option<&std::path::Path>,
    ) -> Result<GpuMoeLayer, CudaError> {
        let (e, h, k) = (shape.num_experts, shape.hidden, gate.top_k);
        assert_eq!(gate.router.len(), e * h, "router is [num_experts, hidden]");
        // The gating kernel keeps two floats per expert in 48 KiB of shared memory.
        if k > 64 || e > 6144 {
            return Err(CudaError::Unavailable(format!(
                "the gating kernel takes top-k up to 64 and up to 6144 experts, not {k} of {e}"
            )));
        }
        assert!(
            shape.max_rows >= max_tokens * k,
            "the expert work area must take max_tokens × top_k rows"
        );
        if let GatingConfig::SigmoidGrouped { n_group, .. } = gate.gating
            && (n_group > 64 || n_group == 0 || e % n_group != 0)
        {
            return Err(CudaError::Unavailable(format!(
                "the gating kernel takes up to 64 equal expert groups, not {n_group} of {e}"
            )));
        }
        let layer_experts: Vec<(usize, u32)> = (0..e as u32).map(|x| (0, x)).collect();
        let experts = GpuExperts::new(gpu, shape, &layer_experts, memory_fraction, cache_dir)?;
        let stream = experts.stream.clone();
        let pairs = max_tokens * k;
        let mut buffers = Vec::new();
        let mut take = |bytes: usize| -> Result<u64, CudaError> {
            let (slice, ptr) = alloc(&stream, bytes)?;
            buffers.push(slice);
            Ok(ptr)
        };
        let router = take(e * h * 2)?;
        let bias = match &gate.correction_bias {
            Some(b) => Some((take(b.len() * 4)?, b)),
            None => None,
        };
        let x = take(max_tokens * h * 2)?;
        let logits = take(max_tokens * e * 4)?;
        let ids = take(pairs * 4)?;
        let weights = take(pairs * 4)?;
        let counts = take(e * 4)?;
        let offsets = take((e + 1) * 4)?;
        let cursor = take(e * 4)?;
        let slot_of_pair = take(pairs * 4)?;
        let source_row = take(pairs * 4)?;
        let out = take(max_tokens * h * 4)?;
        let cu = stream.cu_stream();
        // SAFETY: copies into buffers of exactly these sizes; synchronised below.
        unsafe {
            result::memcpy_htod_async(router, &gate.router, cu)?;
            if let Some((ptr, values)) = bias {
                result::memcpy_htod_async(ptr, values, cu)?;
            }
        }
        stream.synchronize()?;
        Ok(GpuMoeLayer {
            routing: Routing {
                router,
                bias: bias.map(|(p, _)| p),
                x,
                logits,
                ids,
                weights,
                counts,
                offsets,
                cursor,
                slot_of_pair,
                source_row,
                out,
                _buffers: buffers,
            },
            experts,
            gate,
            max_tokens,
            last_active_experts: 0,
        })
    }

    /// Copies `tokens` rows of hidden states (bf16) in.
    pub fn set_input(&mut self, x: &[bf16]) -> Result<(), CudaError> {
        assert!(x.len() <= self.max_tokens * self.experts.shape.hidden);
        // SAFETY: fits the input buffer; synchronised before `x` can go away.
        unsafe { result::memcpy_htod_async(self.routing.x, x, self.experts.stream.cu_stream())? };
        self.experts.stream.synchronize()?;
        Ok(())
    }

    /// The layer over the first `tokens` input rows; the output stays on the GPU until
    /// [`GpuMoeLayer::output`].
    pub fn forward(&mut self, tokens: usize) -> Result<(), CudaError> {
        assert!(tokens >= 1 && tokens <= self.max_tokens);
        let shape = self.experts.shape;
        let (e, h, k) = (shape.num_experts, shape.hidden, self.gate.top_k);
        let r = &self.routing;
        let stream = self.experts.stream.clone();
        let kernels = &self.experts.kernels;
        let pairs = tokens * k;

        // logits[t, e] = x[t] · router[e], f32 out of bf16 in.
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: shapes as allocated: router [E, H], x [tokens, H], logits [tokens, E].
        unsafe {
            blas::cublasGemmEx(
                *self.experts.blas.handle(),
                blas::cublasOperation_t::CUBLAS_OP_T,
                blas::cublasOperation_t::CUBLAS_OP_N,
                e as i32,
                tokens as i32,
                h as i32,
                &alpha as *const f32 as *const std::ffi::c_void,
                r.router as *const std::ffi::c_void,
                blas::cudaDataType_t::CUDA_R_16BF,
                h as i32,
                r.x as *const std::ffi::c_void,
                blas::cudaDataType_t::CUDA_R_16BF,
                h as i32,
                &beta as *const f32 as *const std::ffi::c_void,
                r.logits as *mut std::ffi::c_void,
                blas::cudaDataType_t::CUDA_R_32F,
                e as i32,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()?;

        let (scoring, renormalize, n_group, topk_group, scale) = match self.gate.gating {
            GatingConfig::Softmax { renormalize } => (0i32, renormalize, 1, 1, 1.0f32),
            GatingConfig::SigmoidGrouped {
                n_group,
                topk_group,
                normalize,
                routed_scaling_factor,
            } => (
                1,
                normalize,
                n_group as i32,
                topk_group as i32,
                routed_scaling_factor,
            ),
        };
        let bias = r.bias.unwrap_or(0);
        let (e_i, k_i, renorm_i, pairs_i) = (e as i32, k as i32, renormalize as i32, pairs as i32);
        // SAFETY: every pointer is a buffer sized for max_tokens ≥ tokens; kernel
        // signatures as in kernels/moe.cu.
        unsafe {
            stream
                .launch_builder(&kernels.gate_topk)
                .arg(&r.logits)
                .arg(&e_i)
                .arg(&k_i)
                .arg(&scoring)
                .arg(&bias)
                .arg(&n_group)
                .arg(&topk_group)
                .arg(&renorm_i)
                .arg(&scale)
                .arg(&r.ids)
                .arg(&r.weights)
                .launch(LaunchConfig {
                    grid_dim: (tokens as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: (2 * e * 4) as u32,
                })?;
            result::memset_d8_async(r.counts, 0, e * 4, stream.cu_stream())?;
            stream
                .launch_builder(&kernels.count_experts)
                .arg(&r.ids)
                .arg(&pairs_i)
                .arg(&r.counts)
                .launch(elementwise(pairs))?;
            stream
                .launch_builder(&kernels.expert_offsets)
                .arg(&r.counts)
                .arg(&e_i)
                .arg(&r.offsets)
                .arg(&r.cursor)
                .launch(LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (32, 1, 1),
                    shared_mem_bytes: 0,
                })?;
            stream
                .launch_builder(&kernels.scatter_pairs)
                .arg(&r.ids)
                .arg(&pairs_i)
                .arg(&k_i)
                .arg(&r.cursor)
                .arg(&r.slot_of_pair)
                .arg(&r.source_row)
                .launch(elementwise(pairs))?;
            let h_i = h as i32;
            let grouped = self.experts.x;
            stream
                .launch_builder(&kernels.gather_rows)
                .arg(&r.x)
                .arg(&r.source_row)
                .arg(&pairs_i)
                .arg(&h_i)
                .arg(&grouped)
                .launch(elementwise(pairs * h))?;
        }
        let mut offsets = vec![0i32; e + 1];
        // SAFETY: E + 1 ints; synchronised before they are read.
        unsafe { result::memcpy_dtoh_async(&mut offsets, r.offsets, stream.cu_stream())? };
        stream.synchronize()?;
        let mut active = Vec::new();
        let mut sizes = Vec::new();
        for (expert, pair) in offsets.windows(2).enumerate() {
            if pair[1] > pair[0] {
                active.push(expert as u32);
                sizes.push((pair[1] - pair[0]) as usize);
            }
        }
        self.last_active_experts = active.len();
        self.experts.ffn(0, &active, &sizes)?;
        let r = &self.routing;
        let (tokens_i, k_i, h_i, y) = (tokens as i32, k as i32, h as i32, self.experts.y);
        // SAFETY: as above.
        unsafe {
            stream
                .launch_builder(&self.experts.kernels.combine_rows)
                .arg(&y)
                .arg(&r.slot_of_pair)
                .arg(&r.weights)
                .arg(&tokens_i)
                .arg(&k_i)
                .arg(&h_i)
                .arg(&r.out)
                .launch(elementwise(tokens * h))?;
        }
        stream.synchronize()?;
        Ok(())
    }

    /// The last pass's output, `[tokens, hidden]` f32.
    pub fn output(&self, tokens: usize) -> Result<Vec<f32>, CudaError> {
        let mut out = vec![0f32; tokens * self.experts.shape.hidden];
        // SAFETY: the output buffer holds at least `tokens` rows; synchronised below.
        unsafe {
            result::memcpy_dtoh_async(&mut out, self.routing.out, self.experts.stream.cu_stream())?
        };
        self.experts.stream.synchronize()?;
        Ok(out)
    }

    /// The last pass's routing: `tokens × top_k` expert ids and weights, and the logits.
    pub fn routing(&self, tokens: usize) -> Result<RoutingResult, CudaError> {
        let pairs = tokens * self.gate.top_k;
        let mut ids = vec![0i32; pairs];
        let mut weights = vec![0f32; pairs];
        let mut logits = vec![0f32; tokens * self.experts.shape.num_experts];
        let cu = self.experts.stream.cu_stream();
        // SAFETY: sizes within the buffers; synchronised below.
        unsafe {
            result::memcpy_dtoh_async(&mut ids, self.routing.ids, cu)?;
            result::memcpy_dtoh_async(&mut weights, self.routing.weights, cu)?;
            result::memcpy_dtoh_async(&mut logits, self.routing.logits, cu)?;
        }
        self.experts.stream.synchronize()?;
        Ok(RoutingResult {
            ids,
            weights,
            logits,
        })
    }
}

/// What the gate decided in a pass, read back for checking.
#[derive(Debug, Clone)]
pub struct RoutingResult {
    /// `[tokens, top_k]` experts chosen.
    pub ids: Vec<i32>,
    /// `[tokens, top_k]` their weights.
    pub weights: Vec<f32>,
    /// `[tokens, num_experts]` router logits.
    pub logits: Vec<f32>,
}
