//! Gated DeltaNet on the GPU, a hybrid model's linear-attention layers (Qwen3-Next,
//! Qwen3.5), as `crate::engine::linear_attention` runs it on the CPU in its recurrent form.
//! Each linear layer gathers its part of every sequence's states out of their pages of the KV
//! pool into one packed buffer, updates it there and scatters it back: a step holds one
//! layer's states beside the pool at a time (2.2 MB per layer and sequence at Qwen3.5-35B-A3B's
//! shapes, tens of layers). So the states are updated in place, layer by layer: a step that fails half-way
//! leaves them part-way, and the engine then forgets them (`Engine::forward_on_gpu`): the
//! batcher ends such a step's sequences anyway, and any other caller recomputes.

use super::cache::{DeviceCache, Scratch};
use super::weights::LinearLayer;
use super::{GpuModel, Step};
use crate::compute::cuda::CudaError;
use crate::compute::cuda::blas::Output;
use crate::compute::cuda::linear::{DeltaShape, PackedStates, StatePages};
use crate::compute::layout::Segment;

impl GpuModel {
    /// Where every sequence's states lie (their pages, which are fresh) and where the step's
    /// segments lie, for the linear layers' gathers: the packed buffer itself is each layer's
    /// own (`states` is 0 here; `floats` is a layer's part).
    pub(super) fn state_step(
        &self,
        scratch: &mut Scratch,
        segments: &[Segment],
        caches: &[&mut DeviceCache],
    ) -> Result<(PackedStates, StatePages), CudaError> {
        let la = self
            .config
            .linear_attention
            .as_ref()
            .ok_or_else(|| CudaError::Unsupported("states without linear layers".into()))?;
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
            fresh: scratch.upload(&fresh)?,
        };
        let packed = PackedStates {
            states: 0,
            floats: la.state_floats(),
            seqs: segments.len(),
            rows: row_seq.len(),
            row_seq: scratch.upload(&row_seq)?,
            seq_first_row: scratch.upload(&first)?,
            seq_len: scratch.upload(&lens)?,
        };
        Ok((packed, pages))
    }

    /// Gated DeltaNet of layer `l` over bf16 normalised rows `x`; returns f32 `[rows, H]` and
    /// moves the layer's part of the sequences' states on, in their pages.
    pub(super) fn linear_attention(
        &self,
        l: usize,
        layer: &LinearLayer,
        step: &Step,
        scratch: &mut Scratch,
        x: u64,
    ) -> Result<u64, CudaError> {
        let missing = || CudaError::Unsupported("linear attention without its states".into());
        let (Some(la), Some(kernels), Some((template, pages))) = (
            self.config.linear_attention.as_ref(),
            self.linear.as_ref(),
            step.states.as_ref(),
        ) else {
            return Err(missing());
        };
        // The layer's part of a sequence's states (its recurrent state, then its window),
        // `offset` floats into them.
        let before = la.layers[..l].iter().filter(|&&linear| linear).count();
        let offset = before * la.state_floats();
        let shape = DeltaShape {
            key_heads: la.num_key_heads,
            value_heads: la.num_value_heads,
            key_dim: la.key_head_dim,
            value_dim: la.value_head_dim,
            conv_kernel: la.conv_kernel,
            recurrent: 0,
            window: la.num_value_heads * la.key_head_dim * la.value_head_dim,
        };
        let states = &PackedStates {
            states: scratch.f32(template.seqs * template.floats)?,
            ..*template
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
        // SAFETY: every buffer sized above from the layer's shape; `pages` hold every
        // sequence's states (`state_step`), the layer's part `offset` floats in.
        unsafe {
            kernels.gather(&self.stream, pages, offset, states)?;
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
            kernels.scatter(&self.stream, states, pages, offset)?;
        }
        let ob = self.bf16_of(scratch, out, rows * width)?;
        let y = scratch.f32(rows * self.config.hidden_size)?;
        self.linear(&layer.out, ob, rows, y, Output::F32)?;
        Ok(y)
    }
}
