//! An MoE layer's routed experts with the rows kept on the GPU: the router product, top-k
//! gating and the grouping by expert run on the dense part's GPU, the grouped rows go to
//! the experts as device memory ([`ExpertExecutor::run_on_device`]), and the weighted
//! combine reads their outputs there. Only the group sizes (one small copy) come to the
//! host; rows leave the GPU only for groups computed elsewhere (a CPU slot, another node),
//! through [`Staging`].
//!
//! The gate takes bf16 rows and weights with f32 sums, as every other product of the dense
//! part on the GPU does; the CPU backend's gate multiplies in f32, so tokens within that
//! rounding of a tie between experts may choose differently (the reference tests bound
//! such flips). Routing around experts with no live replica routes on the host (the
//! gating kernel takes no mask). A gate whose weight scales the experts' inputs (Llama 4)
//! has no kernel either; such models' dense part is refused on the GPU before this.

use cudarc::driver::{CudaStream, result};
use half::bf16;
use std::sync::Arc;

use super::weights::{Matrix, matrix_of};
use super::{GpuModel, Scratch};
use crate::compute::cuda::CudaError;
use crate::compute::cuda::blas::Output;
use crate::compute::cuda::experts::Buffer;
use crate::compute::cuda::moe::check_gating;
use crate::compute::gate::GatingConfig;
use crate::experts::{DeviceRows, ExpertError, ExpertExecutor, RowStaging, StagingError};
use crate::model::config::ModelConfig;
use crate::model::weights::{DenseWeights, FeedForward};

/// One MoE layer's router on the GPU.
pub(super) struct DeviceGate {
    /// bf16 `[experts, hidden]`.
    router: Matrix,
    /// DeepSeek's `e_score_correction_bias`, f32 `[experts]`.
    bias: Option<Buffer>,
    gating: GatingConfig,
    top_k: usize,
}

/// The routers of the MoE layers (`None` for the others), or why the model routes on the
/// host.
pub(super) fn upload_gates(
    stream: &std::sync::Arc<CudaStream>,
    config: &ModelConfig,
    weights: &DenseWeights,
) -> Result<Result<Vec<Option<DeviceGate>>, String>, CudaError> {
    let moe = &config.moe;
    if moe.weight_input {
        return Ok(Err("the gate weight scales the experts' inputs".into()));
    }
    if let Err(e) = check_gating(moe.num_experts, moe.top_k, &moe.gating) {
        return Ok(Err(e.to_string()));
    }
    let mut gates = Vec::with_capacity(weights.layers.len());
    for layer in &weights.layers {
        gates.push(match &layer.feed_forward {
            FeedForward::Dense(_) => None,
            FeedForward::Moe(w) => Some(DeviceGate {
                router: matrix_of(stream, &w.router)?,
                bias: w
                    .correction_bias
                    .as_deref()
                    .map(|b| Buffer::from_host(stream, b))
                    .transpose()?,
                gating: moe.gating.clone(),
                top_k: moe.top_k,
            }),
        });
    }
    stream.synchronize()?;
    Ok(Ok(gates))
}

/// One MoE layer's rows routed and grouped on the GPU, and the buffers its experts' outputs
/// and their combination go to: what [`GpuModel::route_rows`] leaves for
/// [`GpuModel::run_routed`]. Its buffers are the step's (a graph's arena, where one
/// captured the routing).
#[derive(Clone, Copy)]
pub(super) struct RoutedRows {
    /// `[experts + 1]` i32: where each expert's group starts in `grouped`.
    offsets: u64,
    slot_of_pair: u64,
    weights: u64,
    /// bf16 `[rows · k, H]`: the rows grouped by expert, and the experts' outputs.
    grouped: u64,
    output: u64,
    /// f32 `[rows, H]`: the combined output.
    pub(super) combined: u64,
    experts: usize,
    top_k: usize,
}

impl GpuModel {
    /// Routes MoE layer `layer`'s normalised rows `xb` (bf16 `[rows, H]`) on the GPU and
    /// groups them by expert: kernels only, nothing waited for (a graph can capture it).
    pub(super) fn route_rows(
        &self,
        gate: &DeviceGate,
        scratch: &mut Scratch,
        xb: u64,
        rows: usize,
    ) -> Result<RoutedRows, CudaError> {
        let stream = &self.stream;
        let (e, h, k) = (gate.router.out, self.config.hidden_size, gate.top_k);
        let pairs = rows * k;
        let logits = scratch.f32(rows * e)?;
        self.linear(&gate.router, xb, rows, logits, Output::F32)?;
        // i32 and f32 buffers alike: 4 bytes a value.
        let ids = scratch.f32(pairs)?;
        let weights = scratch.f32(pairs)?;
        let counts = scratch.f32(e)?;
        let offsets = scratch.f32(e + 1)?;
        let cursor = scratch.f32(e)?;
        let slot_of_pair = scratch.f32(pairs)?;
        let source_row = scratch.f32(pairs)?;
        let grouped = scratch.bf16(pairs * h)?;
        let output = scratch.bf16(pairs * h)?;
        let combined = scratch.f32(rows * h)?;
        let bias = gate.bias.as_ref().map(|b| b.ptr);
        // SAFETY: every buffer is sized above for `rows` rows, `e` experts, top-`k`.
        unsafe {
            let m = &self.moe;
            m.gate_topk(stream, logits, rows, e, k, &gate.gating, bias, ids, weights)?;
            m.plan(
                stream,
                ids,
                pairs,
                k,
                e,
                counts,
                offsets,
                cursor,
                slot_of_pair,
                source_row,
            )?;
            m.gather_rows(stream, xb, source_row, pairs, h, grouped)?;
        }
        Ok(RoutedRows {
            offsets,
            slot_of_pair,
            weights,
            grouped,
            output,
            combined,
            experts: e,
            top_k: k,
        })
    }

    /// The combined output of MoE layer `layer`'s routed experts over rows `routed` holds,
    /// the rows kept on the GPU (`routed.combined`, f32 `[rows, H]`, once the stream gets
    /// there); `None` when `executor` takes rows from the host only or must route around
    /// experts (the caller then routes on the host). Only the group sizes come to the host.
    pub(super) fn run_routed(
        &self,
        layer: usize,
        routed: &RoutedRows,
        executor: &dyn ExpertExecutor,
        rows: usize,
    ) -> Result<Option<u64>, RoutedError> {
        if executor.avoid(layer).is_some_and(|a| a.iter().any(|&x| x)) {
            return Ok(None);
        }
        let stream = &self.stream;
        let (e, h, k) = (routed.experts, self.config.hidden_size, routed.top_k);
        let mut starts = vec![0i32; e + 1];
        // SAFETY: `e + 1` i32; synchronised before they are read.
        unsafe {
            result::memcpy_dtoh_async(&mut starts, routed.offsets, stream.cu_stream())
                .map_err(CudaError::from)?
        };
        stream.synchronize().map_err(CudaError::from)?;
        let (mut experts, mut sizes) = (Vec::new(), Vec::new());
        for (expert, pair) in starts.windows(2).enumerate() {
            if pair[1] > pair[0] {
                experts.push(expert as u32);
                sizes.push((pair[1] - pair[0]) as usize);
            }
        }
        let staging = Staging {
            stream,
            input: routed.grouped,
            output: routed.output,
            width: h,
        };
        let device_rows = DeviceRows {
            gpu: self.gpu,
            input: routed.grouped,
            output: routed.output,
            staging: &staging,
        };
        match executor.run_on_device(layer, &experts, &sizes, &device_rows) {
            None => return Ok(None),
            Some(done) => done?,
        }
        // SAFETY: `output` holds the `rows · k` rows the executor wrote; the rest as
        // `route_rows` sized them.
        unsafe {
            self.moe.combine_rows(
                stream,
                routed.output,
                routed.slot_of_pair,
                routed.weights,
                rows,
                k,
                h,
                routed.combined,
            )?
        };
        Ok(Some(routed.combined))
    }
}

/// Why a layer's routed experts failed on the device path.
#[derive(Debug, thiserror::Error)]
pub enum RoutedError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    Expert(#[from] ExpertError),
}

/// The host side of one layer's [`DeviceRows`], on the dense part's stream (the dispatch
/// calls it from the engine's thread, where that GPU's context is current).
struct Staging<'a> {
    stream: &'a CudaStream,
    input: u64,
    output: u64,
    width: usize,
}

impl RowStaging for Staging<'_> {
    fn download(&self, first: usize, rows: usize) -> Result<Vec<f32>, StagingError> {
        let mut host = vec![bf16::ZERO; rows * self.width];
        let at = (first * self.width * 2) as u64;
        let copied = self.stream.context().bind_to_thread().and_then(|()| {
            // SAFETY: the input holds every row of the layer's groups; synchronised below.
            unsafe {
                result::memcpy_dtoh_async(&mut host[..], self.input + at, self.stream.cu_stream())
            }?;
            self.stream.synchronize()
        });
        copied.map_err(|e| StagingError::Download(Arc::new(e.into())))?;
        Ok(host.iter().map(|v| v.to_f32()).collect())
    }

    fn upload(&self, first: usize, values: &[f32]) -> Result<(), StagingError> {
        let host: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        let at = (first * self.width * 2) as u64;
        let copied = self.stream.context().bind_to_thread().and_then(|()| {
            // SAFETY: the output holds every row of the layer's groups, these among them;
            // synchronised before `host` goes.
            unsafe {
                result::memcpy_htod_async(self.output + at, &host[..], self.stream.cu_stream())
            }?;
            self.stream.synchronize()
        });
        copied.map_err(|e| StagingError::Upload(Arc::new(e.into())))
    }
}
