//! Gated DeltaNet on the GPU, a hybrid model's linear-attention layers (Qwen3-Next,
//! Qwen3.5), as `crate::engine::linear_attention` runs it on the CPU in its recurrent form.
//! A step gathers every sequence's states out of their pages of the KV pool into one packed
//! buffer ([`GpuModel::gather_states`]); each linear layer reads and updates its part there;
//! once the whole step has run, `forward` scatters them back. A step that fails half-way
//! leaves the sequences' states as they were, as the CPU's caches do.

use super::cache::{DeviceCache, Scratch};
use super::weights::LinearLayer;
use super::{GpuModel, Step};
use crate::compute::cuda::CudaError;
use crate::compute::cuda::blas::Output;
use crate::compute::cuda::linear::{DeltaShape, LinearKernels, PackedStates, StatePages};
use crate::compute::layout::Segment;

impl GpuModel {
    /// Every sequence's states, out of their pages into one packed `[seqs, floats]` buffer
    /// (zeros for a sequence at its first position), and the pages to scatter them back to.
    pub(super) fn gather_states(
        &self,
        kernels: &LinearKernels,
        scratch: &mut Scratch,
        segments: &[Segment],
        caches: &[&mut DeviceCache],
    ) -> Result<(PackedStates, StatePages), CudaError> {
        let floats = super::cache::state_floats(&self.config);
        let mut pages = Vec::new();
        let mut per_seq = 0;
        let mut page_floats = 0;
        for cache in caches {
            let own = cache.state_pages();
            per_seq = own.len();
            page_floats = cache.page_floats();
            pages.extend(own);
        }
        if per_seq * page_floats < floats || pages.len() != per_seq * caches.len() {
            return Err(CudaError::Unsupported(
                "a sequence's states without the pages to hold them".into(),
            ));
        }
        let fresh: Vec<i32> = segments
            .iter()
            .map(|s| (s.start_position == 0) as i32)
            .collect();
        let first: Vec<i32> = segments.iter().map(|s| s.rows.start as i32).collect();
        let lens: Vec<i32> = segments.iter().map(|s| s.rows.len() as i32).collect();
        let row_seq: Vec<i32> = segments
            .iter()
            .enumerate()
            .flat_map(|(i, s)| s.rows.clone().map(move |_| i as i32))
            .collect();
        let pages = StatePages {
            pages: scratch.upload(&pages)?,
            per_seq,
            page_floats,
        };
        let packed = PackedStates {
            states: scratch.f32(segments.len() * floats)?,
            floats,
            seqs: segments.len(),
            rows: row_seq.len(),
            row_seq: scratch.upload(&row_seq)?,
            seq_first_row: scratch.upload(&first)?,
            seq_len: scratch.upload(&lens)?,
        };
        let fresh = scratch.upload(&fresh)?;
        // SAFETY: `pages` names `per_seq` pages of `page_floats` f32 for every sequence,
        // covering `floats` (checked above); the other arrays are sized from the segments.
        unsafe { kernels.gather(&self.stream, &pages, fresh, &packed)? };
        Ok((packed, pages))
    }

    /// Gated DeltaNet of layer `l` over bf16 normalised rows `x`; returns f32 `[rows, H]` and
    /// moves the sequences' packed states on.
    pub(super) fn linear_attention(
        &self,
        l: usize,
        layer: &LinearLayer,
        step: &Step,
        scratch: &mut Scratch,
        x: u64,
    ) -> Result<u64, CudaError> {
        let missing = || CudaError::Unsupported("linear attention without its states".into());
        let (Some(la), Some(kernels), Some(states)) = (
            self.config.linear_attention.as_ref(),
            self.linear.as_ref(),
            step.states.as_ref().map(|(packed, _)| packed),
        ) else {
            return Err(missing());
        };
        // The layer's part of a sequence's states: its recurrent state, then its window.
        let before = la.layers[..l].iter().filter(|&&linear| linear).count();
        let recurrent = before * la.state_floats();
        let shape = DeltaShape {
            key_heads: la.num_key_heads,
            value_heads: la.num_value_heads,
            key_dim: la.key_head_dim,
            value_dim: la.value_head_dim,
            conv_kernel: la.conv_kernel,
            recurrent,
            window: recurrent + la.num_value_heads * la.key_head_dim * la.value_head_dim,
        };
        let rows = step.rows;
        let (channels, width) = (shape.channels(), la.value_dim());
        let mixed = scratch.f32(rows * channels)?;
        let z = scratch.f32(rows * width)?;
        let b = scratch.f32(rows * shape.value_heads)?;
        let a = scratch.f32(rows * shape.value_heads)?;
        self.linear(&layer.qkv, x, rows, mixed, Output::F32)?;
        self.linear(&layer.z, x, rows, z, Output::F32)?;
        self.linear(&layer.b, x, rows, b, Output::F32)?;
        self.linear(&layer.a, x, rows, a, Output::F32)?;
        let convolved = scratch.f32(rows * channels)?;
        let out = scratch.f32(rows * width)?;
        // SAFETY: every buffer sized above from the layer's shape; `states` packed for this
        // step's sequences with every linear layer's part (`gather_states`).
        unsafe {
            kernels.convolve(
                &self.stream,
                &shape,
                mixed,
                layer.conv.ptr,
                states,
                convolved,
            )?;
            kernels.delta_rule(
                &self.stream,
                &shape,
                convolved,
                (a, b),
                (layer.dt_bias.ptr, layer.decay_scale.ptr),
                states,
                out,
            )?;
            kernels.gated_norm(
                &self.stream,
                out,
                z,
                rows * shape.value_heads,
                shape.value_dim,
                layer.norm.weight.ptr,
                self.config.rms_norm_eps,
            )?;
        }
        let ob = self.bf16_of(scratch, out, rows * width)?;
        let y = scratch.f32(rows * self.config.hidden_size)?;
        self.linear(&layer.out, ob, rows, y, Output::F32)?;
        Ok(y)
    }
}
