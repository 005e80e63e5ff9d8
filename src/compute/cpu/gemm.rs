//! Products through the `gemm` crate (packed, SIMD, multi-threaded): plain and strided f32
//! products, and weights held narrower than f32 widened to it panel by panel.

use gemm::Parallelism;
use rayon::prelude::*;

use super::parallel::{PARALLEL_MIN_FLOPS, SharedOut};

/// `out [m, n] = x [m, k] · w [k, n]` for a row-major `w`.
pub fn matmul(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, out: &mut [f32], parallel: bool) {
    assert_eq!(w.len(), k * n, "rhs size");
    matmul_strided(x, m, k, (w, n), n, out, parallel);
}

/// `out [m, n] (+)= x [m, k] · w [n, k]ᵀ` on this thread, with the rows of `x` `x_stride`
/// apart and those of `w` `w_stride` apart: a block of attention queries against cached keys
/// that lie interleaved with other heads' (no copy). `accumulate` adds the product to `out`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_transposed_strided(
    (x, x_stride): (&[f32], usize),
    m: usize,
    k: usize,
    (w, w_stride): (&[f32], usize),
    n: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    check_strided(x.len(), m, x_stride, k, "lhs");
    check_strided(w.len(), n, w_stride, k, "rhs");
    assert_eq!(out.len(), m * n, "output size");
    gemm_strided(
        x,
        m,
        k,
        (x_stride as isize, 1),
        w,
        n,
        (1, w_stride as isize),
        out,
        false,
        accumulate,
    );
}

/// `out [m, n] = x [m, k] · w [k, n]` with the rows of `w` `w_stride` apart (attention
/// weights times the cached values of one head, interleaved with other heads').
pub fn matmul_strided(
    x: &[f32],
    m: usize,
    k: usize,
    (w, w_stride): (&[f32], usize),
    n: usize,
    out: &mut [f32],
    parallel: bool,
) {
    assert_eq!(x.len(), m * k, "lhs size");
    check_strided(w.len(), k, w_stride, n, "rhs");
    assert_eq!(out.len(), m * n, "output size");
    gemm_strided(
        x,
        m,
        k,
        (k as isize, 1),
        w,
        n,
        (w_stride as isize, 1),
        out,
        parallel,
        false,
    );
}

/// Checks that `len` values hold `rows` rows of `width`, `stride` apart.
fn check_strided(len: usize, rows: usize, stride: usize, width: usize, what: &str) {
    assert!(
        width <= stride,
        "{what}: rows of {width} values {stride} apart overlap"
    );
    assert!(
        rows == 0 || len >= (rows - 1) * stride + width,
        "{what}: {len} values cannot hold {rows} rows of {width}, {stride} apart"
    );
}

/// Row and column strides of a matrix, in elements.
type Strides = (isize, isize);

#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_strided(
    lhs: &[f32],
    m: usize,
    k: usize,
    (lhs_rs, lhs_cs): Strides,
    rhs: &[f32],
    n: usize,
    (rhs_rs, rhs_cs): Strides,
    out: &mut [f32],
    parallel: bool,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    let parallelism = if parallel && m * n * k >= PARALLEL_MIN_FLOPS {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    // SAFETY: the callers checked that lhs holds m*k, rhs k*n and out m*n elements at the
    // strides they pass (which address nothing outside them); out does not alias the inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs,
            lhs_rs,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Bytes of f32 weights one task of [`matmul_widening`] widens at a time: small enough to
/// stay in L2 while the GEMM reads it once per block of input rows.
const PANEL_BYTES: usize = 256 * 1024;

thread_local! {
    /// A task's widened panel, reused from product to product (a fresh allocation of this
    /// size would be mapped and faulted in each time).
    static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out [m, n] = x [m, k] · wᵀ` for weights held in another form than f32 (bf16, FP8,
/// INT4), over more rows than the few-row kernels take: panels of weight rows are widened into
/// an f32 buffer that stays in cache, and each goes through the packed GEMM. Widening the
/// whole matrix first would write and read it again at f32 size, in a fresh allocation, for
/// every product. `widen(first, panel)` writes weight rows `first..` into `panel` (`k`
/// values per row, as many rows as `panel` holds).
pub fn matmul_widening(
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
    parallel: bool,
    widen: impl Fn(usize, &mut [f32]) + Sync,
) {
    assert_eq!(x.len(), m * k, "lhs size");
    assert_eq!(out.len(), m * n, "output size");
    if m == 0 || n == 0 || k == 0 {
        out.fill(0.0);
        return;
    }
    let parallel = parallel && m * n * k >= PARALLEL_MIN_FLOPS;
    let mut panel_rows = (PANEL_BYTES / (4 * k)).clamp(16, 256);
    if parallel {
        // Enough panels for every thread to take several.
        panel_rows = panel_rows.min(n.div_ceil(4 * rayon::current_num_threads()).max(16));
    }
    let panels = n.div_ceil(panel_rows);
    let out_at = SharedOut::new(out);
    let run = |p: usize| {
        let first = p * panel_rows;
        let rows = panel_rows.min(n - first);
        PANEL.with(|buffer| {
            let mut buffer = buffer.borrow_mut();
            buffer.resize(rows * k, 0.0);
            widen(first, &mut buffer);
            // SAFETY: x holds m*k and the panel rows*k elements, addressed by the strides
            // given; this task writes only columns first..first+rows of each of the m output
            // rows (row stride n), which no other task writes, and out outlives the tasks.
            unsafe {
                gemm::gemm(
                    m,
                    rows,
                    k,
                    out_at.get().add(first),
                    1,
                    n as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    buffer.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    Parallelism::None,
                );
            }
        });
    };
    if parallel {
        (0..panels).into_par_iter().for_each(run);
    } else {
        (0..panels).for_each(run);
    }
}
