//! Experts in GPU memory: every expert a device holds in one allocation, in the form the
//! checkpoint stores it (bf16, FP8, INT4: [`ExpertStorage`]), a work area sized from the
//! config, and the expert FFN of a whole step: two grouped products with the SwiGLU kernel
//! between them. A step whose experts get a few rows each runs the grouped GEMV kernel,
//! which decodes quantized weights as it reads them; a larger one runs cuBLAS's grouped GEMM,
//! on bf16 copies of quantized experts made for the step in a scratch area
//! ([`ExpertShape::scratch_experts`] at a time).
//!
//! All work goes to one CUDA stream per device; the device actor's thread is the only one
//! that touches it, so cudarc's cross-stream event tracking is turned off.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{CudaBlas, sys as blas};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice, result};
use half::bf16;
use rayon::prelude::*;

use super::moe::MoeKernels;
use super::storage::{ExpertStorage, MatrixForm};
use super::{CudaError, GpuInfo};
use crate::compute::fill::DummyFill;
use crate::compute::quant::SwiGluActivation;

/// Bytes cuBLAS may use for its own work on top of the sized buffers.
const BLAS_RESERVE: usize = 64 << 20;

/// The bf16 copies of quantized experts one grouped GEMM works on take at most this much
/// (and at least one expert): a Kimi K2 expert is 88 MB in bf16, so 12 at a time.
const WIDEN_SCRATCH_BYTES: usize = 1 << 30;

/// Pointer arrays per group: A, B, C of both products, and the quantized slots' two
/// matrices (what the widening kernel reads).
const POINTER_ARRAYS: usize = 8;

/// The shape of the experts one device holds and the most rows one call may bring.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertShape {
    pub hidden: usize,
    pub intermediate: usize,
    /// Experts per layer in the model (bounds the groups of one call).
    pub num_experts: usize,
    /// Grouped rows one call runs at most: tokens per step × top-k.
    pub max_rows: usize,
    /// Rows arrive from and return to host memory in f32 ([`GpuExperts::run`], the device
    /// actors), rather than staying on the GPU (a whole layer on the GPU): f32 buffers on
    /// both sides are then needed.
    pub host_io: bool,
    /// The form the experts are held in.
    pub storage: ExpertStorage,
    /// How the gate and up products join: every expert of a device alike.
    pub activation: SwiGluActivation,
    /// The experts have biases (gpt-oss's): f32, gate's, up's and down's, after each slot's
    /// matrices ([`ExpertStorage::biases_of`]), added to each product's rows.
    pub biases: bool,
}

impl ExpertShape {
    /// Elements of one expert: gate and up `[intermediate, hidden]`, down `[hidden,
    /// intermediate]`, stored in that order (gate and up together form one `[2·I, H]`
    /// matrix).
    pub fn expert_elems(&self) -> usize {
        3 * self.hidden * self.intermediate
    }

    /// Bytes one expert takes in GPU memory, in its stored form (and its biases).
    pub fn slot_bytes(&self) -> usize {
        let biases = if self.biases {
            ((2 * self.intermediate + self.hidden) * 4).next_multiple_of(256)
        } else {
            0
        };
        self.bias_offset() + biases
    }

    /// Where a slot's biases start: after what its storage form lays out.
    pub fn bias_offset(&self) -> usize {
        self.storage.layout(self.hidden, self.intermediate).bytes
    }

    /// Quantized experts a step widens to bf16 at a time for the grouped GEMM (0 for bf16
    /// experts, which it reads as they are).
    pub fn scratch_experts(&self) -> usize {
        if !self.storage.is_quantized() {
            return 0;
        }
        (WIDEN_SCRATCH_BYTES / (self.expert_elems() * 2).max(1)).clamp(1, self.num_experts.max(1))
    }

    /// Bytes of GPU memory `experts` experts and the work area take.
    pub fn bytes_needed(&self, experts: usize) -> usize {
        let weights = experts * self.slot_bytes();
        let scratch = self.scratch_experts() * self.expert_elems() * 2;
        // Input, gate|up, activation and output rows, in bf16; input and output rows as the
        // router sends and wants them, in f32.
        let mut rows = self.max_rows * (self.hidden + 3 * self.intermediate + self.hidden) * 2;
        if self.host_io {
            rows += self.max_rows * 2 * self.hidden * 4;
        }
        // The pointer arrays and the rows of each group, one entry per group.
        let pointers = POINTER_ARRAYS * self.num_experts * 8 + self.num_experts * 4;
        weights + scratch + rows + pointers + BLAS_RESERVE
    }
}

/// Whether `experts` experts of `shape` fit in the `free` bytes of GPU `gpu`, of which
/// `fraction` may be used.
pub fn check_fit(
    gpu: usize,
    shape: &ExpertShape,
    experts: usize,
    free: usize,
    fraction: f64,
) -> Result<(), CudaError> {
    let need = shape.bytes_needed(experts);
    let usable = (free as f64 * fraction) as usize;
    if need > usable {
        return Err(CudaError::DoesNotFit {
            gpu,
            experts,
            need_mib: need.div_ceil(1 << 20),
            usable_mib: usable >> 20,
            free_mib: free >> 20,
        });
    }
    Ok(())
}

/// A device allocation and its address (stable for its life).
pub(crate) struct Buffer {
    _slice: CudaSlice<u8>,
    pub(crate) ptr: u64,
}

impl Buffer {
    /// A new buffer holding a copy of `values` (a copy from pageable memory has read them
    /// when this returns; the device side lands in stream order).
    pub(crate) fn from_host<T: cudarc::driver::DeviceRepr>(
        stream: &Arc<CudaStream>,
        values: &[T],
    ) -> Result<Buffer, CudaError> {
        let buffer = Buffer::new(stream, std::mem::size_of_val(values))?;
        // SAFETY: the buffer holds `values`.
        unsafe { result::memcpy_htod_async(buffer.ptr, values, stream.cu_stream())? };
        Ok(buffer)
    }

    pub(crate) fn new(stream: &Arc<CudaStream>, bytes: usize) -> Result<Buffer, CudaError> {
        // SAFETY: every buffer is written before it is read (weights at load, the work area
        // by each call before its kernels read it).
        let slice = unsafe { stream.alloc::<u8>(bytes.max(1)) }?;
        let (ptr, _) = slice.device_ptr(stream);
        Ok(Buffer { _slice: slice, ptr })
    }
}

/// One device's experts and the means to run them.
pub struct GpuExperts {
    pub gpu: GpuInfo,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    pub kernels: MoeKernels,
    pub shape: ExpertShape,
    /// The experts placed at load, one slot each, and the buffers of those taken since
    /// ([`GpuExperts::take`]).
    weights: Vec<Buffer>,
    /// (layer, expert) → address of its slot.
    index: HashMap<(usize, u32), u64>,
    /// Slots let go of ([`GpuExperts::release`]), for the next experts taken.
    free_slots: Vec<u64>,
    /// Grouped input rows `[max_rows, hidden]`, bf16.
    pub x: u64,
    /// Gate and up outputs `[max_rows, 2·I]`, bf16.
    gate_up: u64,
    /// SwiGLU outputs `[max_rows, I]`, bf16.
    act: u64,
    /// Expert outputs `[max_rows, hidden]`, bf16.
    pub y: u64,
    /// Pointer arrays, [`POINTER_ARRAYS`] per group: `[num_experts, POINTER_ARRAYS]` entries,
    /// a batch of groups using `POINTER_ARRAYS` consecutive arrays from its first group's.
    pointers: u64,
    /// bf16 copies of [`ExpertShape::scratch_experts`] quantized experts (0: none).
    scratch: u64,
    /// How the kernels read a slot's gate|up and down matrices.
    forms: [MatrixForm; 2],
    /// Bytes from a slot's start to its down matrix.
    down_offset: usize,
    /// Rows of each group, `[num_experts]` i32 (for the GEMV kernel).
    group_rows: u64,
    /// The router's rows in and out, `[max_rows, hidden]` f32 each: converted to and from
    /// bf16 on the GPU (on the host it would cost ~1 ns a value, milliseconds a layer).
    x_f32: u64,
    y_f32: u64,
    _work: Vec<Buffer>,
    /// Host staging for inputs and outputs, page-locked so copies run at full speed and
    /// asynchronously: `[max_rows, hidden]` f32 each; with `host_io` only.
    host_in: Option<PinnedHostSlice<f32>>,
    host_out: Option<PinnedHostSlice<f32>>,
    /// Set when cuBLAS refuses grouped GEMMs: then one GEMM per expert.
    per_expert_gemm: bool,
    /// Other GPUs' contexts, for peer copies of rows that stay on the GPUs.
    peers: HashMap<usize, Arc<CudaContext>>,
    /// Host side of the pointer arrays, page-locked so their upload is truly asynchronous
    /// (a copy from pageable memory waits for the stream). Rewritten only after the
    /// previous call has synchronised.
    ptrs: PinnedHostSlice<u64>,
    rows_host: PinnedHostSlice<i32>,
    /// Steps whose every expert has at most this many rows (up to
    /// [`GEMV_MAX_ROWS`]) run the grouped GEMV kernel instead of cuBLAS's grouped GEMM;
    /// 0: always cuBLAS. For bf16 experts off until the GPU benchmark, which times both,
    /// says where the kernel wins; for quantized ones [`GEMV_MAX_ROWS`], since their grouped
    /// GEMM first widens every expert of the step.
    pub gemv_rows: usize,
    /// Quantized experts widened per grouped GEMM: at most (and by default)
    /// [`ExpertShape::scratch_experts`]; tests lower it to run a step in several batches.
    pub widen_batch: usize,
}

/// Most rows per expert the grouped GEMV kernel takes (`GEMV_MAX_ROWS` in moe.cu).
pub const GEMV_MAX_ROWS: usize = 8;

impl GpuExperts {
    /// Sets up GPU `gpu` for `experts` experts of `shape`, checking first that they fit in
    /// `memory_fraction` of its free memory. Weights are written by [`GpuExperts::upload`].
    pub fn new(
        gpu: &GpuInfo,
        shape: ExpertShape,
        experts: &[(usize, u32)],
        memory_fraction: f64,
        cache_dir: Option<&std::path::Path>,
    ) -> Result<GpuExperts, CudaError> {
        let ctx = CudaContext::new(gpu.ordinal)?;
        // SAFETY: one stream per device, used by one thread: nothing to track across streams.
        unsafe { ctx.disable_event_tracking() };
        let (free, _) = ctx.mem_get_info()?;
        check_fit(gpu.ordinal, &shape, experts.len(), free, memory_fraction)?;
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let kernels = MoeKernels::load(&ctx, gpu, cache_dir)?;
        let weights = Buffer::new(&stream, experts.len() * shape.slot_bytes())?;
        // Zeroed, so that a slot's padding reads as [`ExpertStorage::pack`] writes it,
        // whichever way its matrices are written.
        // SAFETY: the buffer holds this many bytes.
        unsafe {
            result::memset_d8_async(
                weights.ptr,
                0,
                experts.len() * shape.slot_bytes(),
                stream.cu_stream(),
            )?
        };
        let index = experts
            .iter()
            .enumerate()
            .map(|(i, &k)| (k, weights.ptr + (i * shape.slot_bytes()) as u64))
            .collect();
        let (h, i, rows) = (shape.hidden, shape.intermediate, shape.max_rows);
        let f32_rows = if shape.host_io { rows * h * 4 } else { 0 };
        let work: Vec<Buffer> = [
            rows * h * 2,
            rows * 2 * i * 2,
            rows * i * 2,
            rows * h * 2,
            POINTER_ARRAYS * shape.num_experts * 8,
            f32_rows,
            f32_rows,
            shape.num_experts * 4,
            shape.scratch_experts() * shape.expert_elems() * 2,
        ]
        .into_iter()
        .map(|bytes| Buffer::new(&stream, bytes))
        .collect::<Result<_, _>>()?;
        // SAFETY: written before each upload.
        let ptrs = unsafe { ctx.alloc_pinned::<u64>(POINTER_ARRAYS * shape.num_experts) }?;
        // SAFETY: written before each upload.
        let rows_host = unsafe { ctx.alloc_pinned::<i32>(shape.num_experts) }?;
        let staging = || -> Result<Option<PinnedHostSlice<f32>>, CudaError> {
            if !shape.host_io {
                return Ok(None);
            }
            // SAFETY: written before read (inputs by each call, outputs by the copy back).
            Ok(Some(unsafe { ctx.alloc_pinned::<f32>(rows * h) }?))
        };
        Ok(GpuExperts {
            gpu: gpu.clone(),
            x: work[0].ptr,
            gate_up: work[1].ptr,
            act: work[2].ptr,
            y: work[3].ptr,
            pointers: work[4].ptr,
            x_f32: work[5].ptr,
            y_f32: work[6].ptr,
            group_rows: work[7].ptr,
            scratch: work[8].ptr,
            forms: shape.storage.forms(h, i),
            down_offset: shape.storage.layout(h, i).down,
            _work: work,
            host_in: staging()?,
            host_out: staging()?,
            ctx,
            stream,
            blas,
            kernels,
            shape,
            weights: vec![weights],
            index,
            free_slots: Vec::new(),
            per_expert_gemm: false,
            peers: HashMap::new(),
            ptrs,
            rows_host,
            // Quantized experts: the kernel that reads them as stored wherever it can; the
            // grouped GEMM would first widen every expert of the step.
            gemv_rows: if shape.storage.is_quantized() {
                GEMV_MAX_ROWS
            } else {
                0
            },
            widen_batch: shape.scratch_experts(),
        })
    }

    pub fn holds(&self, layer: usize, expert: u32) -> bool {
        self.index.contains_key(&(layer, expert))
    }

    pub fn experts_held(&self) -> usize {
        self.index.len()
    }

    /// Bytes of GPU memory the held experts take, in their stored form.
    pub fn weight_bytes(&self) -> usize {
        self.index.len() * self.shape.slot_bytes()
    }

    /// Bytes of experts this GPU could still take: its free slots, and `memory_fraction` of
    /// its free memory (as [`GpuExperts::take`] counts it).
    pub fn room_bytes(&self, memory_fraction: f64) -> Result<usize, CudaError> {
        let (free, _) = self.ctx.mem_get_info()?;
        Ok(self.free_slots.len() * self.shape.slot_bytes()
            + (free as f64 * memory_fraction) as usize)
    }

    /// Address of expert `(layer, expert)`'s slot (its gate|up matrix first).
    fn expert_ptr(&self, layer: usize, expert: u32) -> Option<u64> {
        self.index.get(&(layer, expert)).copied()
    }

    /// Makes one expert's weights on the device from a dummy checkpoint's `fills` (gate, up,
    /// down; src/model/dummy.rs): the values [`upload`] would copy from the host, without
    /// making and copying tens of GB per layer.
    ///
    /// [`upload`]: GpuExperts::upload
    pub fn fill_dummy(
        &mut self,
        layer: usize,
        expert: u32,
        fills: &[DummyFill; 3],
    ) -> Result<(), CudaError> {
        let ptr = self
            .expert_ptr(layer, expert)
            .expect("fill of an expert not placed on this device");
        if self.shape.storage != ExpertStorage::Bf16 {
            return Err(CudaError::Unsupported(format!(
                "dummy weights are bf16; this device holds {}",
                self.shape.storage.describe()
            )));
        }
        let matrix = self.shape.hidden * self.shape.intermediate;
        let at = [0, matrix * 2, self.down_offset];
        for (&fill, at) in fills.iter().zip(at) {
            // SAFETY: each matrix lands inside this expert's slot of the weight buffer.
            unsafe {
                self.kernels
                    .fill_dummy(&self.stream, fill, matrix, ptr + at as u64)?;
            }
        }
        Ok(())
    }

    /// The bytes of expert `(layer, expert)`'s slot (`None`: not held here), as
    /// [`ExpertStorage::pack`] lays them out. For checks; it synchronises.
    pub fn download(&self, layer: usize, expert: u32) -> Result<Option<Vec<u8>>, CudaError> {
        let Some(ptr) = self.expert_ptr(layer, expert) else {
            return Ok(None);
        };
        let mut out = vec![0u8; self.shape.slot_bytes()];
        // SAFETY: the copy reads this expert's slot of the weight buffer into `out`, which
        // outlives it (synchronised below).
        unsafe { result::memcpy_dtoh_async(&mut out, ptr, self.stream.cu_stream())? };
        self.stream.synchronize()?;
        Ok(Some(out))
    }

    /// Fills every held expert's slot with `slot` (one expert as [`ExpertStorage::pack`]
    /// makes it): for the benchmark, where a Kimi-sized layer is tens of GB and the time of a
    /// pass does not depend on the values.
    pub fn fill_repeated(&mut self, slot: &[u8]) -> Result<(), CudaError> {
        let bytes = self.shape.slot_bytes();
        assert_eq!(slot.len(), bytes, "one slot's bytes");
        let cu = self.stream.cu_stream();
        // SAFETY: every copy lands inside the weight buffer (one slot per held expert);
        // `slot` outlives the upload (synchronised below). The other slots are copied on the
        // GPU from the first.
        let mut slots = self.index.values().copied();
        let Some(first) = slots.next() else {
            return Ok(());
        };
        unsafe {
            result::memcpy_htod_async(first, slot, cu)?;
            for ptr in slots {
                result::memcpy_dtod_async(ptr, first, bytes, cu)?;
            }
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// Runs host rows through experts of `layer`: `groups[g] = (expert, rows × hidden f32)`.
    /// Returns one output per group, as the CPU devices do.
    pub fn run(&mut self, layer: usize, groups: &[(u32, &[f32])]) -> Result<RunOutcome, CudaError> {
        let h = self.shape.hidden;
        for &(expert, _) in groups {
            if !self.holds(layer, expert) {
                return Ok(RunOutcome::NotHeld(expert));
            }
        }
        let mut outputs = Vec::with_capacity(groups.len());
        let sizes: Vec<usize> = groups.iter().map(|(_, x)| x.len() / h).collect();
        for batch in self.work_area_batches(&sizes)? {
            let rows: usize = sizes[batch.clone()].iter().sum();
            let chunk = &groups[batch.clone()];
            let no_host_io = || {
                CudaError::Unsupported(
                    "rows from the host on experts set up without host_io".into(),
                )
            };
            let host_in = self.host_in.as_mut().ok_or_else(no_host_io)?;
            let staged = &mut host_in.as_mut_slice()?[..rows * h];
            copy_in_parallel(chunk.iter().map(|(_, input)| *input), staged);
            let cu = self.stream.cu_stream();
            // SAFETY: `rows` rows fit the f32 input buffer and, as bf16, the grouped input;
            // the staging buffer is not touched until the stream is synchronised below.
            unsafe {
                result::memcpy_htod_async(self.x_f32, &*staged, cu)?;
                self.kernels
                    .to_bf16(&self.stream, self.x_f32, rows * h, self.x)?;
            }
            let experts: Vec<u32> = chunk.iter().map(|(e, _)| *e).collect();
            let sizes = &sizes[batch];
            self.ffn(layer, &experts, sizes)?;
            let host_out = self.host_out.as_mut().ok_or_else(no_host_io)?;
            let out_host = &mut host_out.as_mut_slice()?[..rows * h];
            // SAFETY: the output buffer holds `rows` rows after ffn; synchronised below.
            unsafe {
                self.kernels
                    .to_f32(&self.stream, self.y, rows * h, self.y_f32)?;
                result::memcpy_dtoh_async(&mut *out_host, self.y_f32, cu)?;
            }
            self.stream.synchronize()?;
            // Each group's output into its own vector, spread over the pool: at prefill
            // sizes these are hundreds of MB, and one thread copying them (and faulting in
            // the new pages) took longer than the GPU's work.
            let mut pieces = Vec::with_capacity(sizes.len());
            let mut rest: &[f32] = out_host;
            for &size in sizes {
                let (piece, tail) = rest.split_at(size * h);
                pieces.push(piece);
                rest = tail;
            }
            if rows * h >= PARALLEL_COPY_VALUES {
                outputs.par_extend(pieces.into_par_iter().map(<[f32]>::to_vec));
            } else {
                outputs.extend(pieces.into_iter().map(<[f32]>::to_vec));
            }
        }
        Ok(RunOutcome::Done(outputs))
    }

    /// Consecutive groups (of `sizes[g]` rows) as the work area takes them: as many as fit
    /// `max_rows` at a time, a group larger than it an error.
    fn work_area_batches(&self, sizes: &[usize]) -> Result<Vec<std::ops::Range<usize>>, CudaError> {
        let max_rows = self.shape.max_rows;
        if let Some(&rows) = sizes.iter().find(|&&r| r > max_rows) {
            return Err(CudaError::TooManyRows { rows, max_rows });
        }
        let mut batches = Vec::new();
        let (mut start, mut rows) = (0, 0);
        for (g, &r) in sizes.iter().enumerate() {
            if g > start && rows + r > max_rows {
                batches.push(start..g);
                (start, rows) = (g, 0);
            }
            rows += r;
        }
        if start < sizes.len() {
            batches.push(start..sizes.len());
        }
        Ok(batches)
    }

    /// The expert FFN over the grouped rows in `x` (group `g`: `sizes[g]` rows for
    /// `experts[g]` of `layer`, consecutive), leaving the outputs in `y`. Queued on the
    /// stream; the caller synchronises.
    pub fn ffn(&mut self, layer: usize, experts: &[u32], sizes: &[usize]) -> Result<(), CudaError> {
        let groups: Vec<Group> = experts
            .iter()
            .zip(sizes)
            .scan(0usize, |offset, (&e, &n)| {
                let at = *offset;
                *offset += n;
                Some((e, at, n))
            })
            .filter(|&(_, _, n)| n > 0)
            .map(|(e, at, rows)| Group {
                slot: self.expert_ptr(layer, e).expect("checked by the caller"),
                at,
                rows,
            })
            .collect();
        if groups.len() > self.shape.num_experts {
            return Err(CudaError::TooManyRows {
                rows: groups.len(),
                max_rows: self.shape.num_experts,
            });
        }
        let (h, i) = (self.shape.hidden, self.shape.intermediate);
        let gemv_rows = if h.is_multiple_of(8) && i.is_multiple_of(8) {
            self.gemv_rows.min(GEMV_MAX_ROWS)
        } else {
            0
        };
        if !self.shape.storage.is_quantized() {
            // bf16: one product for the whole step, the GEMV where every group takes it.
            let gemv = groups.iter().all(|g| g.rows <= gemv_rows);
            return self.ffn_batch(&groups, 0, gemv);
        }
        // Quantized: the groups the GEMV takes read their experts as stored; the others are
        // widened to bf16 a scratch area's worth at a time for the grouped GEMM.
        let (few, many): (Vec<Group>, Vec<Group>) =
            groups.iter().partition(|g| g.rows <= gemv_rows);
        self.ffn_batch(&few, 0, true)?;
        let per_batch = self.widen_batch.clamp(1, self.shape.scratch_experts());
        for (b, batch) in many.chunks(per_batch).enumerate() {
            self.ffn_batch(batch, few.len() + b * per_batch, false)?;
        }
        Ok(())
    }

    /// The expert FFN of `groups` (in the order of their rows), with pointer arrays from
    /// group `first` on: the grouped GEMV kernel on the slots as they are (`gemv`), or the
    /// grouped GEMM on bf16 weights (quantized slots widened into the scratch area first).
    /// The SwiGLU between the products runs over every row from the first group's to the
    /// last's: rows of other groups between them are rewritten by their own batch before
    /// their down product reads them, or were read by it already (one stream, in order).
    fn ffn_batch(&mut self, groups: &[Group], first: usize, gemv: bool) -> Result<(), CudaError> {
        let (Some(head), Some(last)) = (groups.first(), groups.last()) else {
            return Ok(());
        };
        let (start, end) = (head.at, last.at + last.rows);
        let (h, i) = (self.shape.hidden, self.shape.intermediate);
        let g = groups.len();
        let widen = !gemv && self.shape.storage.is_quantized();
        // Pointer arrays: [A1, B1, C1, A2, B2, C2, Q1, Q2], g entries each.
        let (x, gate_up, act, y) = (self.x, self.gate_up, self.act, self.y);
        let (scratch, expert_bytes, down) = (
            self.scratch,
            self.shape.expert_elems() * 2,
            self.down_offset as u64,
        );
        let region = &mut self.ptrs.as_mut_slice()?[POINTER_ARRAYS * first..][..POINTER_ARRAYS * g];
        for (k, group) in groups.iter().enumerate() {
            let (a1, a2) = if widen {
                let copy = scratch + (k * expert_bytes) as u64;
                (copy, copy + (2 * i * h * 2) as u64)
            } else {
                (group.slot, group.slot + down)
            };
            let at = group.at;
            region[k] = a1;
            region[g + k] = x + (at * h * 2) as u64;
            region[2 * g + k] = gate_up + (at * 2 * i * 2) as u64;
            region[3 * g + k] = a2;
            region[4 * g + k] = act + (at * i * 2) as u64;
            region[5 * g + k] = y + (at * h * 2) as u64;
            region[6 * g + k] = group.slot;
            region[7 * g + k] = group.slot + down;
        }
        let arrays = self.pointers + (POINTER_ARRAYS * first * 8) as u64;
        let array = |n: usize| arrays + (n * g * 8) as u64;
        // SAFETY: this batch's region of the pinned arrays is not written again before the
        // stream is synchronised (every caller synchronises before its next call, and the
        // batches of one call use regions apart).
        unsafe {
            result::memcpy_htod_async(arrays, &*region, self.stream.cu_stream())?;
        }
        let host_ptrs: Vec<u64> = region[..6 * g].to_vec();
        let ns: Vec<usize> = groups.iter().map(|g| g.rows).collect();
        if widen {
            let [gate_up_form, down_form] = self.forms;
            // SAFETY: the Q arrays point at g quantized slots of this device's form; the
            // scratch area takes g ≤ scratch_experts bf16 experts, gate|up then down.
            unsafe {
                self.kernels.widen(
                    &self.stream,
                    gate_up_form,
                    array(6),
                    (scratch, self.shape.expert_elems()),
                    g,
                    (2 * i, h),
                )?;
                self.kernels.widen(
                    &self.stream,
                    down_form,
                    array(7),
                    (scratch + (2 * i * h * 2) as u64, self.shape.expert_elems()),
                    g,
                    (h, i),
                )?;
            }
        }
        let group_rows = if gemv || self.shape.biases {
            let rows_host = &mut self.rows_host.as_mut_slice()?[first..][..g];
            for (r, &n) in rows_host.iter_mut().zip(&ns) {
                *r = n as i32;
            }
            let rows_device = self.group_rows + (first * 4) as u64;
            // SAFETY: as for the pointer arrays above.
            unsafe {
                result::memcpy_htod_async(rows_device, &*rows_host, self.stream.cu_stream())?
            };
            Some(rows_device)
        } else {
            None
        };
        let gemv = group_rows.filter(|_| gemv);
        let forms = if widen {
            [MatrixForm::Bf16; 2]
        } else {
            self.forms
        };
        // gate|up: out[n, 2I] = x[n, H] · W[2I, H]ᵀ.
        self.gemm(
            GemmShape { m: 2 * i, k: h },
            forms[0],
            gemv,
            &ns,
            [array(0), array(1), array(2)],
            &host_ptrs[..3 * g],
        )?;
        let bias_offset = self.shape.bias_offset() as i64;
        if let (true, Some(rows)) = (self.shape.biases, group_rows) {
            // SAFETY: array(2) holds each group's gate|up rows, array(6) its slot, whose
            // biases start `bias_offset` bytes in; `rows` the groups' row counts.
            unsafe {
                self.kernels.add_bias(
                    &self.stream,
                    [array(2), array(6)],
                    rows,
                    g,
                    bias_offset,
                    2 * i,
                )?
            };
        }
        // SAFETY: gate_up holds rows `start..end` of 2I, act has room for them as rows of I.
        unsafe {
            self.kernels.swiglu(
                &self.stream,
                gate_up + (start * 2 * i * 2) as u64,
                (end - start, i),
                self.shape.activation,
                act + (start * i * 2) as u64,
            )?
        };
        // down: out[n, H] = act[n, I] · W[H, I]ᵀ.
        self.gemm(
            GemmShape { m: h, k: i },
            forms[1],
            gemv,
            &ns,
            [array(3), array(4), array(5)],
            &host_ptrs[3 * g..],
        )?;
        if let (true, Some(rows)) = (self.shape.biases, group_rows) {
            let down_biases = bias_offset + (2 * i * 4) as i64;
            // SAFETY: as for gate|up's, with array(5) each group's output rows.
            unsafe {
                self.kernels.add_bias(
                    &self.stream,
                    [array(5), array(6)],
                    rows,
                    g,
                    down_biases,
                    h,
                )?
            };
        }
        Ok(())
    }

    /// `C_g[n_g, m] = B_g[n_g, k] · A_g[m, k]ᵀ` for every group (row-major), as one grouped
    /// cuBLAS call: in cuBLAS's column-major terms `C_g = op(A_g) · B_g` with A transposed.
    /// `device_arrays` are the A, B, C pointer arrays in GPU memory, `host_ptrs` the same
    /// pointers (for the one-GEMM-per-expert fallback). With `gemv` (the groups' row counts
    /// in GPU memory), the grouped GEMV kernel runs instead, reading A in `form`; cuBLAS
    /// reads bf16 only.
    fn gemm(
        &mut self,
        shape: GemmShape,
        form: MatrixForm,
        gemv: Option<u64>,
        ns: &[usize],
        device_arrays: [u64; 3],
        host_ptrs: &[u64],
    ) -> Result<(), CudaError> {
        let g = ns.len();
        if let Some(rows) = gemv {
            // SAFETY: the pointer arrays and row counts describe g groups of the stated
            // shapes, at most GEMV_MAX_ROWS rows each, k a multiple of 8, A in `form`.
            return unsafe {
                self.kernels.grouped_gemv(
                    &self.stream,
                    form,
                    device_arrays,
                    rows,
                    g,
                    (shape.m, shape.k),
                )
            };
        }
        assert_eq!(form, MatrixForm::Bf16, "cuBLAS reads bf16 weights only");
        let (m, k) = (shape.m as i32, shape.k as i32);
        let handle = *self.blas.handle();
        let data = blas::cudaDataType_t::CUDA_R_16BF;
        let compute = blas::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        if !self.per_expert_gemm {
            let transa = vec![blas::cublasOperation_t::CUBLAS_OP_T; g];
            let transb = vec![blas::cublasOperation_t::CUBLAS_OP_N; g];
            let ms = vec![m; g];
            let ns_i: Vec<i32> = ns.iter().map(|&n| n as i32).collect();
            let ks = vec![k; g];
            let alpha = vec![1.0f32; g];
            let beta = vec![0.0f32; g];
            let ones = vec![1i32; g];
            // SAFETY: host arrays of g entries; device pointer arrays of g entries each,
            // pointing at matrices of the stated shapes.
            let status = unsafe {
                blas::cublasGemmGroupedBatchedEx(
                    handle,
                    transa.as_ptr(),
                    transb.as_ptr(),
                    ms.as_ptr(),
                    ns_i.as_ptr(),
                    ks.as_ptr(),
                    alpha.as_ptr() as *const c_void,
                    device_arrays[0] as *const *const c_void,
                    data,
                    ks.as_ptr(),
                    device_arrays[1] as *const *const c_void,
                    data,
                    ks.as_ptr(),
                    beta.as_ptr() as *const c_void,
                    device_arrays[2] as *const *mut c_void,
                    data,
                    ms.as_ptr(),
                    g as i32,
                    ones.as_ptr(),
                    compute,
                )
            };
            match status {
                blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS => return Ok(()),
                blas::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => {
                    tracing::warn!(
                        gpu = self.gpu.ordinal,
                        "cuBLAS has no grouped GEMM here: one GEMM per expert"
                    );
                    self.per_expert_gemm = true;
                }
                other => return Err(CudaError::Blas(cudarc::cublas::result::CublasError(other))),
            }
        }
        for (idx, &n) in ns.iter().enumerate() {
            // SAFETY: as above, one group at a time.
            unsafe {
                super::blas::gemm(
                    &self.blas,
                    super::blas::Gemm::linear(shape.m, n, shape.k),
                    host_ptrs[idx],
                    host_ptrs[g + idx],
                    host_ptrs[2 * g + idx],
                    super::blas::Output::Bf16,
                )?;
            }
        }
        Ok(())
    }
}

/// Copies `sources` one after another into `dst`, spread over the rayon pool (the staging
/// copy into pinned memory is hundreds of MB at prefill sizes).
fn copy_in_parallel<'a>(sources: impl Iterator<Item = &'a [f32]>, dst: &mut [f32]) {
    let parallel = dst.len() >= PARALLEL_COPY_VALUES;
    let mut pairs = Vec::new();
    let mut rest = dst;
    for source in sources {
        let (piece, tail) = rest.split_at_mut(source.len());
        pairs.push((piece, source));
        rest = tail;
    }
    if parallel {
        pairs
            .into_par_iter()
            .for_each(|(piece, source)| piece.copy_from_slice(source));
    } else {
        for (piece, source) in pairs {
            piece.copy_from_slice(source);
        }
    }
}

/// Below this many values (4 MiB), copies stay on the calling thread: handing them to the
/// pool costs more than it saves.
const PARALLEL_COPY_VALUES: usize = 1 << 20;

/// `n` reproducible values in `[-scale, scale)` (xorshift: plausible weights and
/// activations for tests and benchmarks, not good randomness).
pub fn random_bf16(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
            bf16::from_f32((unit * 2.0 - 1.0) * scale)
        })
        .collect()
}

/// One group of a step: the slot of its expert and its rows in the grouped buffers.
#[derive(Debug, Clone, Copy)]
struct Group {
    slot: u64,
    /// Its first row.
    at: usize,
    rows: usize,
}

#[derive(Debug, Clone, Copy)]
struct GemmShape {
    m: usize,
    k: usize,
}

/// What a call to [`GpuExperts::run`] came to.
#[derive(Debug)]
pub enum RunOutcome {
    Done(Vec<Vec<f32>>),
    /// The first requested expert this device does not hold.
    NotHeld(u32),
}

mod resident;
mod slots;
#[cfg(test)]
mod tests;
