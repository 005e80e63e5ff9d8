//! One whole MoE layer on a GPU, from bf16 hidden rows to the combined f32 output: the router
//! GEMM, top-k gating, the permutation that groups rows by expert, the grouped expert FFN
//! ([`GpuExperts::ffn`]) and the weighted combine. The benchmark runs it at Kimi shapes; the
//! GPU tests hold it to the CPU's `moe_forward`.
//!
//! The group sizes come back to the host once per layer (cuBLAS's grouped GEMM takes its
//! problem sizes from host memory): one small copy and a synchronisation.

use cudarc::driver::result;
use half::bf16;

use super::blas::{self, Gemm, Output};
use super::experts::{Buffer, ExpertShape};
use super::moe::check_gating;
use super::{CudaError, GpuExperts, GpuInfo};
use crate::compute::gate::GatingConfig;

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
    _buffers: Vec<Buffer>,
}

/// An MoE layer (layer index 0 of its [`GpuExperts`]) on one GPU.
pub struct GpuMoeLayer {
    pub experts: GpuExperts,
    gate: Gate,
    routing: Routing,
    max_tokens: usize,
    /// Experts that received rows in the last forward pass, and the most rows any of them
    /// received.
    pub last_active_experts: usize,
    pub last_max_rows: usize,
}

impl GpuMoeLayer {
    /// A layer of `shape` on `gpu` for up to `max_tokens` tokens a pass. Expert weights are
    /// written afterwards through `experts` (upload or fill_repeated).
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
        check_gating(e, k, &gate.gating)?;
        assert!(
            shape.max_rows >= max_tokens * k,
            "the expert work area must take max_tokens × top_k rows"
        );
        let layer_experts: Vec<(usize, u32)> = (0..e as u32).map(|x| (0, x)).collect();
        let experts = GpuExperts::new(gpu, shape, &layer_experts, memory_fraction, cache_dir)?;
        let stream = experts.stream.clone();
        let pairs = max_tokens * k;
        let mut buffers = Vec::new();
        let mut take = |bytes: usize| -> Result<u64, CudaError> {
            let buffer = Buffer::new(&stream, bytes)?;
            let ptr = buffer.ptr;
            buffers.push(buffer);
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
            last_max_rows: 0,
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
        let pairs = tokens * k;

        // logits[t, e] = x[t] · router[e], f32 out of bf16 in.
        // SAFETY: shapes as allocated: router [E, H], x [tokens, H], logits [tokens, E].
        unsafe {
            blas::gemm(
                &self.experts.blas,
                Gemm::linear(e, tokens, h),
                r.router,
                r.x,
                r.logits,
                Output::F32,
            )?;
        }

        let kernels = &self.experts.kernels;
        // SAFETY: every buffer was sized for max_tokens ≥ tokens (see `new`).
        unsafe {
            kernels.gate_topk(
                &stream,
                r.logits,
                tokens,
                e,
                k,
                &self.gate.gating,
                r.bias,
                r.ids,
                r.weights,
            )?;
            kernels.plan(
                &stream,
                r.ids,
                pairs,
                k,
                e,
                r.counts,
                r.offsets,
                r.cursor,
                r.slot_of_pair,
                r.source_row,
            )?;
            kernels.gather_rows(&stream, r.x, r.source_row, pairs, h, self.experts.x)?;
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
        self.last_max_rows = sizes.iter().copied().max().unwrap_or(0);
        self.experts.ffn(0, &active, &sizes)?;
        let r = &self.routing;
        // SAFETY: the expert outputs hold `pairs` rows; the rest as above.
        unsafe {
            self.experts.kernels.combine_rows(
                &stream,
                self.experts.y,
                r.slot_of_pair,
                r.weights,
                tokens,
                k,
                h,
                r.out,
            )?;
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
