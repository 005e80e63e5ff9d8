//! What products share to spread their work over the rayon pool: the size from which that
//! pays, and the output pointer their tasks write apart. Here, below every kernel, because
//! the AMX tiles use them as the other kernels do.

/// Below this many multiply-adds a product runs on the calling thread: splitting it over the
/// pool costs more than it saves.
pub(crate) const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// The output of a product whose tasks write disjoint columns ([`matmul_widening`], the
/// AMX tiles).
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(*mut f32);

// SAFETY: tasks write through the pointer only at disjoint elements (see matmul_widening).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub(crate) fn new(out: &mut [f32]) -> Self {
        SharedOut(out.as_mut_ptr())
    }

    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}
