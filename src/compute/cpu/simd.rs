//! Small pieces of the hand-written kernels: the multiply-add each compiled version picks,
//! the prefetch hint, sixteen-lane chunks and their sum.

/// The sum of sixteen lanes as a tree (halves added to halves): four dependent additions
/// that vectorise, where a sum in order is fifteen.
#[inline(always)]
pub(crate) fn hsum16(a: [f32; 16]) -> f32 {
    let h: [f32; 8] = std::array::from_fn(|i| a[i] + a[i + 8]);
    let q: [f32; 4] = std::array::from_fn(|i| h[i] + h[i + 4]);
    (q[0] + q[2]) + (q[1] + q[3])
}

/// `a * b + c`: one fused instruction when `fused` (the kernel's target has FMA; callers
/// pass `target_cfg_f!`, a constant in each compiled version), else a multiply and an add.
/// Rust never fuses them itself, and `mul_add` without FMA is a slow library call.
#[inline(always)]
pub(crate) fn madd(fused: bool, a: f32, b: f32, c: f32) -> f32 {
    if fused { a.mul_add(b, c) } else { a * b + c }
}

/// Asks the cache for the weights 4 KiB past `chunk`: with a few rows per weight row the
/// kernel computes between loads long enough that the hardware prefetcher falls behind.
#[inline(always)]
pub(super) fn prefetch_ahead<T>(chunk: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let ahead = (chunk.as_ptr() as *const i8).wrapping_add(4096);
        // SAFETY: a prefetch is a hint; it never faults or reads into the program, whatever
        // the address (which is computed with wrapping arithmetic, not dereferenced).
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ahead) };
    }
}

/// The first `whole` elements of `r` in chunks of 16 (one AVX-512 register of f32).
#[inline(always)]
pub(super) fn lanes<T>(r: &[T], whole: usize) -> std::slice::ChunksExact<'_, T> {
    r[..whole].chunks_exact(16)
}
