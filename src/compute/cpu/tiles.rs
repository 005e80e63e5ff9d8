//! Products of 4 to 64 input rows with weights read once: register tiles over weights
//! widened a slice at a time (dot-product tiles; on AVX-512 the broadcast tiles from 9
//! rows), and the choice between them and the decode kernels.

#[cfg(target_arch = "x86_64")]
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::decode::COLUMNS_PER_TASK;
use super::decode::{dot_few_rows, dot_rows, few_rows_by_columns};
use super::element::WeightElement;
#[cfg(target_arch = "x86_64")]
use super::parallel::{PARALLEL_MIN_FLOPS, SharedOut};

/// The same limit for weights held narrower than f32 (bf16, FP8), which the packed GEMM can
/// only read after widening: the few-row tiles widen a few weight rows at a time and win up
/// to 32 rows with AVX-512 tiles (`benches/roofline.rs`, 128 bf16 experts of 384 x 1024 on 2
/// cores of an AVX-512 Xeon: 106 against 120 ms at 32 rows each; at 48 rows 208 against
/// 151), up to 16 with AVX2 ones (on an AMD EPYC, tiles against widening: 16 rows 85-93
/// against 90-125 ms, 24 rows 118-120 against 101-116, 32 rows 170-172 against 117-118; FP8
/// 9 rows 56 against 92, 16 rows 76 against 103, 20 rows equal, 32 rows 189 against 131).
pub(crate) fn few_rows_widened() -> usize {
    if avx2_tiles() { 16 } else { 32 }
}

/// Whether the few-row tiles run with AVX2 (not AVX-512) here.
pub(crate) fn avx2_tiles() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(TileKernel::detect(), Some(TileKernel::Avx2))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `out [m, n] = x [m, k] · w [n, k]ᵀ` for small `m`: each weight row is read from memory once
/// and dotted with every input row while it sits in L1. With few rows the product is bound by
/// reading weights, and packing them (as a GEMM does) would read them twice.
pub(super) fn matmul_few_rows<W: WeightElement>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    out: &mut [f32],
    parallel: bool,
) {
    // The broadcast tiles' transposed inputs, made once for every task.
    #[cfg(target_arch = "x86_64")]
    if let Some(inputs) = BroadcastInputs::new(x, m, k) {
        assert!(w.len() >= out.len() / m * k, "rhs size");
        inputs.run(out, parallel, |row, from, len, panel| {
            W::extend_widened(&w[row * k + from..][..len], panel)
        });
        return;
    }
    let columns = |first: usize, out_t: &mut [f32]| {
        let count = out_t.len() / m;
        dot_tiles(x, m, k, &w[first * k..(first + count) * k], out_t);
    };
    few_rows_by_columns(m, k, out, parallel, columns);
}

/// Input rows of one register tile of [`dot_tiles`].
pub(super) const TILE_ROWS: usize = 4;

/// Bytes of input rows one pass of [`dot_tiles`] keeps in L1 (of 32 KiB or more): the
/// products run over slices of `k` short enough that every input row's slice fits.
const TILE_INPUT_BYTES: usize = 24 * 1024;

thread_local! {
    /// The widened weights of one column tile of [`dot_tiles`] (bf16, FP8, ... as f32).
    static TILE_WEIGHTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out_t[c * m + i] = x[i] · w[c]` for the `m` rows of `x` and each of the `out_t.len() / m`
/// rows of `w` (all `k` wide): the few-row product, output-transposed. Tiles of four input
/// rows and several weight rows keep their sums in registers, so that each load feeds several
/// multiply-adds, where [`dot_rows`] (one weight row at a time) loads an input value for every
/// multiply-add and stays near half the peak. The products run over slices of `k` whose input
/// rows fit L1 together; a tile's weight slices are widened once into a buffer that serves
/// every input row. Products the decode kernel takes (one to three rows on AVX-512, up to
/// [`FEW_ROWS`] on AVX2: [`DecodeKernel::max_rows`]) go through it instead; below four rows
/// where the CPU has no decode kernel, every column goes through [`dot_rows`], as do the rows
/// and columns left over by the tiles.
pub(crate) fn dot_tiles<W: WeightElement>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    out_t: &mut [f32],
) {
    if dot_few_rows(x, m, k, w, out_t) {
        return;
    }
    let n = out_t.len() / m;
    let kernel = if m < TILE_ROWS {
        None
    } else {
        TileKernel::detect()
    };
    let columns = kernel.map_or(0, TileKernel::columns);
    let tiled_rows = m / TILE_ROWS * TILE_ROWS;
    let tiled_columns = n.checked_div(columns).map_or(0, |tiles| tiles * columns);
    // Rows and columns outside the tiles, whole.
    for (c, column) in out_t.chunks_exact_mut(m).enumerate() {
        let weights = &w[c * k..][..k];
        if c >= tiled_columns {
            dot_rows(x, k, weights, column);
        } else if tiled_rows < m {
            dot_rows(&x[tiled_rows * k..], k, weights, &mut column[tiled_rows..]);
        }
    }
    let Some(kernel) = kernel else { return };
    let slice = (TILE_INPUT_BYTES / (4 * m)).max(64) / 16 * 16;
    TILE_WEIGHTS.with(|buffer| {
        let mut buffer = buffer.borrow_mut();
        for from in (0..k).step_by(slice) {
            let len = slice.min(k - from);
            for first in (0..tiled_columns).step_by(columns) {
                buffer.clear();
                for c in first..first + columns {
                    W::extend_widened(&w[c * k + from..][..len], &mut buffer);
                }
                for i in (0..tiled_rows).step_by(TILE_ROWS) {
                    let sums = kernel.tile(&x[i * k + from..], k, &buffer, len);
                    for c in 0..columns {
                        let out = &mut out_t[(first + c) * m + i..][..TILE_ROWS];
                        for (o, sum) in out.iter_mut().zip(&sums[c * TILE_ROWS..]) {
                            *o = if from == 0 { *sum } else { *o + sum };
                        }
                    }
                }
            }
        }
    });
}

/// From this many input rows to [`BROADCAST_MAX_ROWS`], AVX-512 few-row products run the
/// broadcast tiles ([`BroadcastInputs`]) instead of the dot-product tiles.
#[cfg(target_arch = "x86_64")]
const BROADCAST_MIN_ROWS: usize = 9;

/// The most input rows the broadcast tiles take: four registers of 16. Above it the packed
/// GEMM on widened panels wins
/// (`benches/roofline.rs`, 128 bf16 experts of 384 x 1024 on 2 cores of an AVX-512 Xeon, ms,
/// tiles against GEMM: 33 rows 83 / 104, 48 rows 96 / 124, 64 rows 118 / 135, 96 rows 194 /
/// 181, 128 rows 244 / 210).
#[cfg(target_arch = "x86_64")]
const BROADCAST_MAX_ROWS: usize = 64;

/// Whether products of `m` input rows with weights held narrower than f32 run the broadcast
/// tiles (and not panels widened for the packed GEMM).
pub(crate) fn broadcast_tiles_take(m: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        (BROADCAST_MIN_ROWS..=BROADCAST_MAX_ROWS).contains(&m)
            && matches!(TileKernel::detect(), Some(TileKernel::Avx512))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = m;
        false
    }
}

/// Weight values of one row the broadcast tiles widen at a time: the slice's weight rows
/// (16 KiB at 16 rows) and the inputs' (16 KiB at 16 rows) stay in L1 together.
#[cfg(target_arch = "x86_64")]
const BROADCAST_SLICE: usize = 256;

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The widened weight rows of a [`BroadcastInputs::run`] slice.
    static BROADCAST_PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The input rows of a few-row product for the broadcast tiles, shaped as a GEMM's
/// microkernel wants them: transposed once (`k` rows of the `m` input values, padded to 16
/// or 32), for every task of the product. For each `k`, every weight of a tile of output
/// columns is broadcast and multiplied into one or two registers of 16 input rows. Each
/// output's sum stays in one register lane for all of `k`, so no horizontal sums end a tile
/// (as they end [`dot_tiles`]' dot-product tiles), and every weight loaded feeds one or two
/// multiply-adds of 16 lanes. Weight rows are widened a slice of `k` at a time, by the
/// caller's function (bf16 shifted, FP8 and INT4 dequantized).
#[cfg(target_arch = "x86_64")]
pub(crate) struct BroadcastInputs {
    transposed: Vec<f32>,
    m: usize,
    k: usize,
}

#[cfg(target_arch = "x86_64")]
impl BroadcastInputs {
    /// The inputs `x [m, k]` transposed, where the CPU has AVX-512 and `m` is 9 to 64.
    pub(crate) fn new(x: &[f32], m: usize, k: usize) -> Option<Self> {
        if !broadcast_tiles_take(m) {
            return None;
        }
        let padded = m.div_ceil(16) * 16;
        let mut transposed = Vec::with_capacity(k * padded);
        for kk in 0..k {
            transposed.extend((0..padded).map(|r| if r < m { x[r * k + kk] } else { 0.0 }));
        }
        Some(BroadcastInputs { transposed, m, k })
    }

    /// `out [m, n] = x · wᵀ` for the `n = out.len() / m` weight rows that
    /// `widen(row, from, len, panel)` appends to `panel` as f32 (values `from..from + len`
    /// of row `row`, `from` a multiple of [`BROADCAST_SLICE`]), over the pool where
    /// `parallel` and the product is large enough.
    pub(crate) fn run(
        &self,
        out: &mut [f32],
        parallel: bool,
        widen: impl Fn(usize, usize, usize, &mut Vec<f32>) + Sync,
    ) {
        let (m, k) = (self.m, self.k);
        let n = out.len() / m;
        let padded = m.div_ceil(16) * 16;
        let at = SharedOut::new(out);
        // Blocks of four registers take six columns a tile: a task's columns a multiple of
        // both widths.
        let per_task = if m > 48 { 48 } else { COLUMNS_PER_TASK };
        let columns = |task: usize| {
            let first = task * per_task;
            let count = per_task.min(n - first);
            BROADCAST_PANEL.with(|panel| {
                let panel = &mut *panel.borrow_mut();
                let mut slice = |tile: usize, columns: usize, from: usize, len: usize| {
                    panel.clear();
                    for c in tile..tile + columns {
                        if c < count {
                            widen(first + c, from, len, panel);
                        } else {
                            panel.resize(panel.len() + len, 0.0);
                        }
                    }
                    panel.as_ptr()
                };
                let out = Outputs {
                    at: at.get().wrapping_add(first),
                    stride: n,
                    rows: m,
                    columns: count,
                };
                let xt = &self.transposed;
                // SAFETY: new() saw AVX-512F; `transposed` holds k rows of `padded` values
                // (16 per register the kernel reads); `slice` gives `columns` rows of `len`;
                // this task alone writes columns first..first + count of the m output rows
                // (row stride n), and `out` outlives the tasks.
                unsafe {
                    match padded / 16 {
                        1 => broadcast_avx512::<1, 16>(xt, k, &mut slice, out),
                        2 => broadcast_avx512::<2, 8>(xt, k, &mut slice, out),
                        3 => broadcast_avx512::<3, 8>(xt, k, &mut slice, out),
                        _ => broadcast_avx512::<4, 6>(xt, k, &mut slice, out),
                    }
                }
            });
        };
        let tasks = n.div_ceil(per_task);
        if parallel && m * n * k >= PARALLEL_MIN_FLOPS {
            (0..tasks).into_par_iter().for_each(columns);
        } else {
            (0..tasks).for_each(columns);
        }
    }
}

/// Where a task of the broadcast tiles writes: `columns` columns of `rows` outputs, output
/// `(r, c)` at `at + r * stride + c`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Outputs {
    at: *mut f32,
    stride: usize,
    rows: usize,
    columns: usize,
}

/// The broadcast tiles' kernel ([`BroadcastInputs`]): `C` output columns by `RB` registers of
/// 16 input rows. `slice(first, C, from, len)` returns `C` weight rows from column `first`,
/// values `from..from + len` each, as f32 (rows from `out.columns` on zero).
///
/// # Safety
/// The CPU has AVX-512F; `xt` holds `k` rows of `16 · RB` values; `slice` returns a pointer
/// to `C · len` values that stay until its next call; `out` addresses its outputs, which
/// nothing else touches while this runs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn broadcast_avx512<const RB: usize, const C: usize>(
    xt: &[f32],
    k: usize,
    slice: &mut dyn FnMut(usize, usize, usize, usize) -> *const f32,
    out: Outputs,
) {
    use std::arch::x86_64::*;
    let stride = 16 * RB;
    debug_assert!(xt.len() >= k * stride);
    for first in (0..out.columns).step_by(C) {
        let mut acc = [[_mm512_setzero_ps(); RB]; C];
        for from in (0..k).step_by(BROADCAST_SLICE) {
            let len = BROADCAST_SLICE.min(k - from);
            let panel = slice(first, C, from, len);
            // SAFETY: row `from` of xt exists (from < k).
            let inputs = unsafe { xt.as_ptr().add(from * stride) };
            for kk in 0..len {
                // SAFETY: row from + kk of xt, and value kk of each panel row, exist.
                let xv: [__m512; RB] = std::array::from_fn(|b| unsafe {
                    _mm512_loadu_ps(inputs.add(kk * stride + 16 * b))
                });
                for (c, acc) in acc.iter_mut().enumerate() {
                    let wv = _mm512_set1_ps(unsafe { *panel.add(c * len + kk) });
                    for (acc, xv) in acc.iter_mut().zip(&xv) {
                        *acc = _mm512_fmadd_ps(wv, *xv, *acc);
                    }
                }
            }
        }
        // Every register stored whole first: read only at constant places, the accumulators
        // stay in registers through the loop above (a loop over a run-time count of them
        // here made the compiler keep some on the stack, loaded and stored at every k).
        let mut lanes = [[[0.0f32; 16]; RB]; C];
        for (acc, lanes) in acc.iter().zip(lanes.iter_mut()) {
            for (acc, lanes) in acc.iter().zip(lanes.iter_mut()) {
                // SAFETY: 16 f32 into a 16-value array.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *acc) };
            }
        }
        for (c, lanes) in lanes.iter().enumerate().take(out.columns - first) {
            for (b, lanes) in lanes.iter().enumerate() {
                let rows = out.rows.saturating_sub(16 * b).min(16);
                for (r, v) in lanes.iter().enumerate().take(rows) {
                    // SAFETY: row 16b + r < rows and column first + c < columns are the
                    // caller's outputs.
                    unsafe { *out.at.add((16 * b + r) * out.stride + first + c) = *v };
                }
            }
        }
    }
}

/// The register tiles this CPU can run.
#[derive(Clone, Copy)]
pub(super) enum TileKernel {
    /// Four weight rows by four input rows of 16 lanes: 16 of the 32 registers accumulate.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// Three weight rows by four input rows of 8 lanes: 12 of the 16 registers accumulate.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl TileKernel {
    pub(super) fn detect() -> Option<TileKernel> {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Some(TileKernel::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Some(TileKernel::Avx2);
            }
        }
        None
    }

    /// The instruction set, as `moe-node devices` names it.
    pub(super) fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx512 => "AVX-512 (9 to 64 rows: weights broadcast into 16-row registers)",
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx2 => "AVX2",
        }
    }

    /// Weight rows per tile.
    pub(super) fn columns(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx512 => 4,
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx2 => 3,
        }
    }

    /// `sums[c * TILE_ROWS + r] = x[r * stride..][..len] · w[c * len..][..len]`: the
    /// products of [`TILE_ROWS`] input rows (`stride` apart in `x`) with `columns()` weight
    /// rows (packed in `w`), over `len` values each.
    pub(super) fn tile(self, x: &[f32], stride: usize, w: &[f32], len: usize) -> [f32; 16] {
        assert!(
            len <= stride && x.len() >= (TILE_ROWS - 1) * stride + len,
            "tile input rows"
        );
        assert_eq!(w.len(), self.columns() * len, "tile weight rows");
        match self {
            // SAFETY: detect() saw AVX-512F; the asserts above bound every row it reads.
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx512 => unsafe { tile_avx512(x, stride, w, len) },
            // SAFETY: detect() saw AVX2 and FMA; the asserts above bound every row it reads.
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx2 => unsafe { tile_avx2(x, stride, w, len) },
        }
    }
}

/// [`TileKernel::tile`] with AVX-512: 4 weight rows by 4 input rows, 16 lanes; the last
/// partial chunk of `len` is read with masked loads.
///
/// # Safety
/// The CPU has AVX-512F; `x` holds [`TILE_ROWS`] rows of `len` values `stride` apart and `w`
/// four rows of `len` values, packed.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512(x: &[f32], stride: usize, w: &[f32], len: usize) -> [f32; 16] {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 16];
    let (x, w) = (x.as_ptr(), w.as_ptr());
    // One chunk of 16 lanes at `at` of every row, each read by `$load(pointer)`.
    macro_rules! chunk {
        ($at:expr, $load:expr) => {{
            // SAFETY: the rows hold `len` values (the caller's contract); `$at` addresses a
            // whole chunk below `len`, or the last, partial one, read through a mask.
            let wv: [__m512; 4] = std::array::from_fn(|c| unsafe { $load(w.add(c * len + $at)) });
            for r in 0..TILE_ROWS {
                let xv = unsafe { $load(x.add(r * stride + $at)) };
                for c in 0..4 {
                    acc[c * TILE_ROWS + r] = _mm512_fmadd_ps(xv, wv[c], acc[c * TILE_ROWS + r]);
                }
            }
        }};
    }
    let whole = len / 16 * 16;
    for at in (0..whole).step_by(16) {
        chunk!(at, |p| _mm512_loadu_ps(p));
    }
    if whole < len {
        let mask: __mmask16 = (1u16 << (len - whole)) - 1;
        chunk!(whole, |p| _mm512_maskz_loadu_ps(mask, p));
    }
    let mut sums = [0.0f32; 16];
    for (s, v) in sums.iter_mut().zip(acc) {
        *s = _mm512_reduce_add_ps(v);
    }
    sums
}

/// [`TileKernel::tile`] with AVX2 and FMA: 3 weight rows by 4 input rows, 8 lanes; the last
/// partial chunk of `len` is summed in scalars.
///
/// # Safety
/// The CPU has AVX2 and FMA; `x` holds [`TILE_ROWS`] rows of `len` values `stride` apart and
/// `w` three rows of `len` values, packed.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(x: &[f32], stride: usize, w: &[f32], len: usize) -> [f32; 16] {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 12];
    let whole = len / 8 * 8;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    for at in (0..whole).step_by(8) {
        // SAFETY: every row holds 8 values from `at` (at + 8 <= whole <= len).
        let wv: [__m256; 3] =
            std::array::from_fn(|c| unsafe { _mm256_loadu_ps(wp.add(c * len + at)) });
        for r in 0..TILE_ROWS {
            // SAFETY: as above, for the input rows.
            let xv = unsafe { _mm256_loadu_ps(xp.add(r * stride + at)) };
            for c in 0..3 {
                acc[c * TILE_ROWS + r] = _mm256_fmadd_ps(xv, wv[c], acc[c * TILE_ROWS + r]);
            }
        }
    }
    let mut sums = [0.0f32; 16];
    for c in 0..3 {
        for r in 0..TILE_ROWS {
            let mut lanes = [0.0f32; 8];
            // SAFETY: lanes holds 8 f32, the width of the store.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[c * TILE_ROWS + r]) };
            let tail: f32 = (whole..len)
                .map(|q| x[r * stride + q] * w[c * len + q])
                .sum();
            sums[c * TILE_ROWS + r] = lanes.iter().sum::<f32>() + tail;
        }
    }
    sums
}
