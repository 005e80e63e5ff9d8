//! Rows that stay in device memory: the served path of a node whose dense part is on a GPU
//! hands each MoE layer's grouped rows to its GPUs' experts as device pointers. Rows from
//! this GPU are copied device to device into the work area, rows from another GPU of the
//! node peer to peer; the outputs go back the same way. No row passes through the host.

use std::sync::Arc;

use cudarc::driver::{CudaContext, result};

use super::{GpuExperts, RunOutcome};
use crate::compute::cuda::CudaError;

impl GpuExperts {
    /// Runs rows already on GPU `source` (this one or another of this process) through
    /// experts of `layer`: `input` holds the groups' bf16 rows consecutively (`sizes[g]`
    /// rows for `experts[g]`), and `output` takes their bf16 outputs in the same layout.
    /// Synchronised before it returns. Answers [`RunOutcome::Done`] with no vectors: the
    /// outputs are where `output` points.
    pub fn run_resident(
        &mut self,
        layer: usize,
        experts: &[u32],
        sizes: &[usize],
        source: usize,
        input: u64,
        output: u64,
    ) -> Result<RunOutcome, CudaError> {
        if let Some(&expert) = experts.iter().find(|&&e| !self.holds(layer, e)) {
            return Ok(RunOutcome::NotHeld(expert));
        }
        let row_bytes = self.shape.hidden * 2;
        let peer = if source == self.gpu.ordinal {
            None
        } else {
            Some(self.peer_context(source)?)
        };
        let mut first_row = 0;
        for batch in self.work_area_batches(sizes)? {
            let rows: usize = sizes[batch.clone()].iter().sum();
            let at = (first_row * row_bytes) as u64;
            let bytes = rows * row_bytes;
            self.copy_rows(peer.as_ref(), self.x, input + at, bytes, true)?;
            self.ffn(layer, &experts[batch.clone()], &sizes[batch])?;
            self.copy_rows(peer.as_ref(), output + at, self.y, bytes, false)?;
            first_row += rows;
        }
        self.stream.synchronize()?;
        Ok(RunOutcome::Done(Vec::new()))
    }

    /// Queues a copy of `bytes` between this GPU and `peer` (`None`: this GPU itself):
    /// into this GPU when `inbound`, out of it otherwise.
    fn copy_rows(
        &self,
        peer: Option<&Arc<CudaContext>>,
        dst: u64,
        src: u64,
        bytes: usize,
        inbound: bool,
    ) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        let cu = self.stream.cu_stream();
        // SAFETY: the callers hold buffers of at least `bytes` at both pointers; the stream
        // is synchronised before either side's owner reuses them.
        unsafe {
            match peer {
                None => result::memcpy_dtod_async(dst, src, bytes, cu)?,
                Some(peer) => {
                    let (ours, theirs) = (self.ctx.cu_ctx(), peer.cu_ctx());
                    let (dst_ctx, src_ctx) = if inbound {
                        (ours, theirs)
                    } else {
                        (theirs, ours)
                    };
                    result::memcpy_peer_async(dst_ctx, dst, src_ctx, src, bytes, cu)?
                }
            }
        }
        Ok(())
    }

    /// GPU `ordinal`'s context (its primary context, which the engine's work uses too).
    fn peer_context(&mut self, ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
        if let Some(ctx) = self.peers.get(&ordinal) {
            return Ok(ctx.clone());
        }
        let ctx = CudaContext::new(ordinal)?;
        // The copies run on this GPU's stream; the peer's context is only named.
        self.ctx.bind_to_thread()?;
        self.peers.insert(ordinal, ctx.clone());
        Ok(ctx)
    }
}
