//! Typed launchers of `kernels/linear.cu`: gated DeltaNet (Qwen3-Next's and Qwen3.5's linear
//! attention) over a step's segments, and the gathering and scattering of one layer's part of
//! the sequences' states between the KV pool's pages and one packed buffer. Arguments that are `u64` are
//! device addresses on the stream's GPU. `crate::engine::gpu::model` runs a linear layer with
//! them; the reference tests hold the whole model to the CPU's.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use super::kernels::{self, LINEAR};
use super::{CudaError, GpuInfo};

/// The longest convolution `conv_window` takes (`MAX_CONV_KERNEL` in linear.cu).
pub const MAX_CONV_KERNEL: usize = 16;

/// The kernels of `kernels/linear.cu`, loaded into one device's context.
pub struct LinearKernels {
    gather_state: CudaFunction,
    scatter_state: CudaFunction,
    causal_conv: CudaFunction,
    conv_window: CudaFunction,
    gated_delta: CudaFunction,
    gated_rms_norm: CudaFunction,
}

/// One layer's part of the sequences' states, packed for a step: `[seqs, floats]` f32 at
/// `states`, and where the step's segments lie (`seq_first_row`, `seq_len`: `[seqs]` i32;
/// `row_seq`: `[rows]` i32).
#[derive(Debug, Clone, Copy)]
pub struct PackedStates {
    pub states: u64,
    pub floats: usize,
    pub seqs: usize,
    pub rows: usize,
    pub row_seq: u64,
    pub seq_first_row: u64,
    pub seq_len: u64,
}

/// Where the sequences' state pages are: `[seqs, per_seq]` device addresses at `pages`, each
/// page `page_floats` f32; `fresh`: `[seqs]` i32, set for a sequence at its first position
/// (its states read as zeros).
#[derive(Debug, Clone, Copy)]
pub struct StatePages {
    pub pages: u64,
    pub per_seq: usize,
    pub page_floats: usize,
    pub fresh: u64,
}

/// One gated DeltaNet layer's shape and where its state lies in a sequence's.
#[derive(Debug, Clone, Copy)]
pub struct DeltaShape {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
    /// Floats into the packed states of a sequence: the layer's recurrent state, then its
    /// window.
    pub recurrent: usize,
    pub window: usize,
}

impl DeltaShape {
    /// Channels of the convolution: queries, keys and values.
    pub fn channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// A launch over each sequence's `floats` values: `(seqs, chunks)` blocks of 256.
fn per_sequence(seqs: usize, floats: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (seqs as u32, floats.div_ceil(256).clamp(1, 1024) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn blocks(n: usize, threads: u32, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

impl LinearKernels {
    pub fn load(
        ctx: &Arc<CudaContext>,
        gpu: &GpuInfo,
        cache_dir: Option<&std::path::Path>,
    ) -> Result<LinearKernels, CudaError> {
        let module = kernels::load_module(ctx, &LINEAR, gpu, cache_dir)?;
        Ok(LinearKernels {
            gather_state: module.load_function("gather_state")?,
            scatter_state: module.load_function("scatter_state")?,
            causal_conv: module.load_function("causal_conv")?,
            conv_window: module.load_function("conv_window")?,
            gated_delta: module.load_function("gated_delta")?,
            gated_rms_norm: module.load_function("gated_rms_norm")?,
        })
    }

    /// Copies `to.floats` values of every sequence's state from element `offset` on (one
    /// layer's part) out of its pages into `to` (zeros for a fresh sequence).
    ///
    /// # Safety
    /// `pages` names `per_seq` pages of `page_floats` f32 for each of `to.seqs` sequences,
    /// covering `offset + to.floats`; `to.states` room for `[seqs, floats]`.
    pub unsafe fn gather(
        &self,
        stream: &CudaStream,
        pages: &StatePages,
        offset: usize,
        to: &PackedStates,
    ) -> Result<(), CudaError> {
        let ints = [pages.per_seq, pages.page_floats, to.floats].map(|v| v as i32);
        let offset = offset as i64;
        // SAFETY: as the caller vouches; arguments match linear.cu.
        unsafe {
            stream
                .launch_builder(&self.gather_state)
                .arg(&pages.pages)
                .arg(&ints[0])
                .arg(&ints[1])
                .arg(&offset)
                .arg(&ints[2])
                .arg(&pages.fresh)
                .arg(&to.states)
                .launch(per_sequence(to.seqs, to.floats))?;
        }
        Ok(())
    }

    /// Copies every sequence's packed values back into its pages, from element `offset` on.
    ///
    /// # Safety
    /// As [`LinearKernels::gather`].
    pub unsafe fn scatter(
        &self,
        stream: &CudaStream,
        from: &PackedStates,
        pages: &StatePages,
        offset: usize,
    ) -> Result<(), CudaError> {
        let ints = [pages.per_seq, pages.page_floats, from.floats].map(|v| v as i32);
        let offset = offset as i64;
        // SAFETY: as the caller vouches; arguments match linear.cu.
        unsafe {
            stream
                .launch_builder(&self.scatter_state)
                .arg(&from.states)
                .arg(&pages.pages)
                .arg(&ints[0])
                .arg(&ints[1])
                .arg(&offset)
                .arg(&ints[2])
                .launch(per_sequence(from.seqs, from.floats))?;
        }
        Ok(())
    }

    /// The causal convolution and SiLU of `mixed` into `out`, then each sequence's window
    /// moved on past its segment.
    ///
    /// # Safety
    /// `mixed`, `out`: `[rows, channels]` f32; `weight`: `[channels, conv_kernel]` f32;
    /// `states` as [`PackedStates`] says, holding the layer's window at `shape.window`.
    pub unsafe fn convolve(
        &self,
        stream: &CudaStream,
        shape: &DeltaShape,
        mixed: u64,
        weight: u64,
        states: &PackedStates,
        out: u64,
    ) -> Result<(), CudaError> {
        if shape.conv_kernel == 0 || shape.conv_kernel > MAX_CONV_KERNEL {
            return Err(CudaError::Unsupported(format!(
                "a convolution of {} taps (the GPU takes 1 to {MAX_CONV_KERNEL})",
                shape.conv_kernel
            )));
        }
        let ints = [
            shape.channels(),
            shape.conv_kernel,
            states.floats,
            shape.window,
        ]
        .map(|v| v as i32);
        // SAFETY: as the caller vouches; arguments match linear.cu. The window is read by
        // every row's convolution before `conv_window` (after it in stream order) moves it.
        unsafe {
            stream
                .launch_builder(&self.causal_conv)
                .arg(&mixed)
                .arg(&ints[0])
                .arg(&weight)
                .arg(&ints[1])
                .arg(&states.states)
                .arg(&ints[2])
                .arg(&ints[3])
                .arg(&states.row_seq)
                .arg(&states.seq_first_row)
                .arg(&out)
                .launch(blocks(states.rows, 256, 0))?;
            stream
                .launch_builder(&self.conv_window)
                .arg(&mixed)
                .arg(&ints[0])
                .arg(&ints[1])
                .arg(&states.states)
                .arg(&ints[2])
                .arg(&ints[3])
                .arg(&states.seq_first_row)
                .arg(&states.seq_len)
                .launch(blocks(states.seqs, 256, 0))?;
        }
        Ok(())
    }

    /// The delta rule of every value head over each sequence's rows, from and into its state.
    ///
    /// # Safety
    /// `convolved`: `[rows, channels]` f32; `a`, `b`: `[rows, value_heads]` f32; `dt_bias`,
    /// `decay_scale`: `[value_heads]` f32; `states` holding the layer's recurrent state at
    /// `shape.recurrent`; `out`: room for `[rows, value_heads, value_dim]` f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn delta_rule(
        &self,
        stream: &CudaStream,
        shape: &DeltaShape,
        convolved: u64,
        (a, b): (u64, u64),
        (dt_bias, decay_scale): (u64, u64),
        states: &PackedStates,
        out: u64,
    ) -> Result<(), CudaError> {
        let ints = [
            shape.value_heads,
            shape.key_heads,
            shape.key_dim,
            shape.value_dim,
            states.floats,
            shape.recurrent,
        ]
        .map(|v| v as i32);
        // SAFETY: as the caller vouches; arguments match linear.cu.
        unsafe {
            stream
                .launch_builder(&self.gated_delta)
                .arg(&convolved)
                .arg(&a)
                .arg(&b)
                .arg(&dt_bias)
                .arg(&decay_scale)
                .arg(&ints[0])
                .arg(&ints[1])
                .arg(&ints[2])
                .arg(&ints[3])
                .arg(&states.states)
                .arg(&ints[4])
                .arg(&ints[5])
                .arg(&states.seq_first_row)
                .arg(&states.seq_len)
                .arg(&out)
                .launch(blocks(
                    states.seqs * shape.value_heads,
                    128,
                    2 * shape.key_dim * 4,
                ))?;
        }
        Ok(())
    }

    /// An RMSNorm of each `width`-wide head of `x` with `weight`, times silu of `gate`, in
    /// place.
    ///
    /// # Safety
    /// `x`, `gate`: `[heads, width]` f32 (`heads` over all rows); `weight`: `[width]` f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gated_norm(
        &self,
        stream: &CudaStream,
        x: u64,
        gate: u64,
        heads: usize,
        width: usize,
        weight: u64,
        eps: f32,
    ) -> Result<(), CudaError> {
        let width_i = width as i32;
        // SAFETY: as the caller vouches; arguments match linear.cu.
        unsafe {
            stream
                .launch_builder(&self.gated_rms_norm)
                .arg(&x)
                .arg(&gate)
                .arg(&weight)
                .arg(&width_i)
                .arg(&eps)
                .launch(blocks(heads, 128, 0))?;
        }
        Ok(())
    }
}
