//! CPU kernels: matrix products through the `gemm` crate (packed, SIMD, multi-threaded),
//! a hand-written matrix-vector product for single rows (where packing costs more than it
//! saves), and the element-wise operations of a transformer block.

use std::borrow::Cow;

use gemm::Parallelism;
use half::bf16;
use rayon::prelude::*;

use super::amx::{self, PackedInputs, TileWeights};

/// Below this many multiply-adds a product runs on the calling thread: splitting it over the
/// pool costs more than it saves.
pub(crate) const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// The instruction set the CPU kernels run with on this machine, as their run-time dispatch
/// (`multiversion`, the first of the kernels' targets whose features the CPU has) picks it,
/// the register tiles of products of 4 to 32 rows (`dot_tiles`), the decode kernels, and
/// whether products of many rows with bf16 weights run on AMX tiles (`compute::amx`). Other
/// products widen bf16, FP8 and INT4 weights to f32 and accumulate in f32; AVX512_BF16's
/// `vdpbf16ps` is not used (`benches/roofline.rs` measures why: on the Xeon it ran on, it runs
/// at half the AVX-512 FMA rate and rounds its inputs to bf16).
pub fn kernel_path() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        // The kernels' targets, in their order of preference.
        let path = if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            "AVX-512 with FMA"
        } else if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            "AVX2 with FMA"
        } else {
            "portable (no AVX2 and FMA: the compiler's baseline x86_64)"
        };
        let tiles = TileKernel::detect().map_or("none: one weight row at a time", TileKernel::name);
        let decode = DecodeKernel::detect().map_or("one weight row at a time", DecodeKernel::name);
        format!(
            "{path}; few-row tiles {tiles}; decode rows {decode}; INT4 decode rows {}; {}; other \
             weights widened to f32 as they are loaded",
            super::quant::int4_decode_path(),
            amx_path()
        )
    }
    #[cfg(target_arch = "aarch64")]
    {
        "NEON with FMA; weights widened to f32 as they are loaded".to_string()
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "portable (the compiler's baseline)".to_string()
    }
}

/// What products of many rows with bf16 weights run on, as [`kernel_path`] says it.
#[cfg(target_arch = "x86_64")]
fn amx_path() -> String {
    match amx::status() {
        amx::AmxStatus::Enabled if amx::is_set_aside() => {
            "AMX tiles not used (devices.cpu_amx = false)".to_string()
        }
        amx::AmxStatus::Enabled => {
            let int4_tiles = super::quant::INT4_BF16_TILES_MIN_ROWS;
            let int4 = if amx::int4::int8_enabled() {
                format!(
                    "; INT4 weights by {} to {} rows on AMX-INT8 tiles (inputs as four 8-bit \
                     digits: to within 2^-28 of each row's largest)",
                    amx::int4::MIN_ROWS,
                    int4_tiles - 1
                )
            } else {
                String::new()
            };
            format!(
                "products of {} or more rows with bf16 or FP8 weights, and of {int4_tiles} or \
                 more with INT4, on AMX-BF16 tiles (inputs split into three bf16 parts: exact \
                 to f32){int4}",
                amx::MIN_ROWS
            )
        }
        amx::AmxStatus::Unavailable(why) => format!("no AMX tiles ({why})"),
    }
}

/// How weights may be held in memory. Arithmetic is always f32; a bf16 checkpoint's expert
/// weights stay bf16 (exactly as stored, half the bytes to read per token) and are widened
/// as the kernels load them.
pub trait WeightElement: Copy + Send + Sync + std::fmt::Debug + 'static {
    /// Whether the element is f32 already (products read it as it is, without widening).
    const IS_F32: bool = false;

    /// How the element is stored, for the kernels that decode it with explicit vector
    /// instructions ([`Stored::Other`]: only through [`WeightElement::to_f32`]).
    const STORED: Stored = Stored::Other;

    fn to_f32(self) -> f32;

    /// The matrix as f32, borrowed when it already is.
    fn widen(weights: &[Self]) -> Cow<'_, [f32]>;

    /// Appends `weights` widened to f32 to `buffer`.
    fn extend_widened(weights: &[Self], buffer: &mut Vec<f32>) {
        buffer.extend(weights.iter().map(|v| v.to_f32()));
    }

    /// The weights as bf16 when that is how they are held (the AMX tiles read them as
    /// they are).
    fn as_bf16(_weights: &[Self]) -> Option<&[bf16]> {
        None
    }
}

/// The stored forms the explicit vector kernels decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    F32,
    Bf16,
    /// FP8 e4m3fn, unscaled.
    E4m3,
    Other,
}

impl WeightElement for f32 {
    const IS_F32: bool = true;
    const STORED: Stored = Stored::F32;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    fn widen(weights: &[f32]) -> Cow<'_, [f32]> {
        Cow::Borrowed(weights)
    }
}

impl WeightElement for bf16 {
    const STORED: Stored = Stored::Bf16;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        // bf16 is the top half of an f32: widening is a shift, which vectorises.
        f32::from_bits((self.to_bits() as u32) << 16)
    }

    fn widen(weights: &[bf16]) -> Cow<'_, [f32]> {
        let mut out = Vec::with_capacity(weights.len());
        Self::extend_widened(weights, &mut out);
        Cow::Owned(out)
    }

    fn extend_widened(weights: &[bf16], buffer: &mut Vec<f32>) {
        let at = buffer.len();
        buffer.resize(at + weights.len(), 0.0);
        widen_bf16(weights, &mut buffer[at..]);
    }

    fn as_bf16(weights: &[bf16]) -> Option<&[bf16]> {
        Some(weights)
    }
}

/// `out[j] = bf16 weight j` as f32: a shift, sixteen lanes at a time where the CPU has
/// AVX-512 (the few-row tiles widen every weight of a product this way).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
fn widen_bf16(weights: &[bf16], out: &mut [f32]) {
    for (o, w) in out.iter_mut().zip(weights) {
        *o = f32::from_bits((w.to_bits() as u32) << 16);
    }
}

/// A dense row-major weight matrix `[out_features, in_features]` with an optional bias, as
/// `torch.nn.Linear` stores it.
#[derive(Debug, Clone)]
pub struct Linear<W: WeightElement = f32> {
    pub weight: Vec<W>,
    pub bias: Option<Vec<f32>>,
    pub out_features: usize,
    pub in_features: usize,
}

impl<W: WeightElement> Linear<W> {
    pub fn without_bias(weight: Vec<W>, out_features: usize, in_features: usize) -> Self {
        Linear {
            weight,
            bias: None,
            out_features,
            in_features,
        }
    }

    /// `x [rows, in] -> [rows, out]`, using all cores when the product is large enough.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.forward_with(x, rows, true)
    }

    /// As [`Linear::forward`]; `parallel = false` keeps the work on this thread (the caller
    /// is already spreading work over the pool).
    pub fn forward_with(&self, x: &[f32], rows: usize, parallel: bool) -> Vec<f32> {
        self.forward_packed(x, rows, self.pack(x, rows).as_ref(), parallel)
    }

    /// `x` split and packed for the AMX tiles, where they take this product (bf16 weights,
    /// enough rows, `in_features` whole tiles): done once for products that share `x`.
    fn pack(&self, x: &[f32], rows: usize) -> Option<PackedInputs> {
        W::as_bf16(&self.weight)?;
        if !amx::takes_outputs(self.out_features) {
            return None;
        }
        PackedInputs::new(x, rows, self.in_features)
    }

    /// As [`Linear::forward_with`], with `x` already packed for the AMX tiles (`None`: not).
    fn forward_packed(
        &self,
        x: &[f32],
        rows: usize,
        packed: Option<&PackedInputs>,
        parallel: bool,
    ) -> Vec<f32> {
        let mut out = vec![0.0; rows * self.out_features];
        let on_tiles = match (packed, W::as_bf16(&self.weight)) {
            (Some(packed), Some(weight)) => {
                let n = self.out_features;
                amx::matmul_transposed(packed, TileWeights::Bf16(weight), n, &mut out, n, parallel)
            }
            _ => false,
        };
        if !on_tiles {
            matmul_transposed(
                x,
                rows,
                self.in_features,
                &self.weight,
                self.out_features,
                &mut out,
                parallel,
            );
        }
        if let Some(bias) = &self.bias {
            for row in out.chunks_exact_mut(self.out_features) {
                for (o, b) in row.iter_mut().zip(bias) {
                    *o += b;
                }
            }
        }
        out
    }
}

/// The SwiGLU feed-forward block used by every supported family, dense or expert:
/// `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct SwiGlu<W: WeightElement = f32> {
    pub gate: Linear<W>,
    pub up: Linear<W>,
    pub down: Linear<W>,
}

impl<W: WeightElement> SwiGlu<W> {
    pub fn forward_with(&self, x: &[f32], rows: usize, parallel: bool) -> Vec<f32> {
        // gate and up read the same input: split and pack it once.
        let packed = self.gate.pack(x, rows);
        let mut gate = self.gate.forward_packed(x, rows, packed.as_ref(), parallel);
        let up = self.up.forward_packed(x, rows, packed.as_ref(), parallel);
        silu_mul(&mut gate, &up);
        self.down.forward_with(&gate, rows, parallel)
    }

    /// Bytes of weights this block reads per forward pass.
    pub fn weight_bytes(&self) -> usize {
        std::mem::size_of::<W>()
            * (self.gate.weight.len() + self.up.weight.len() + self.down.weight.len())
    }
}

/// `out [m, n] = x [m, k] · w [n, k]ᵀ`: the product `nn.Linear` computes.
pub fn matmul_transposed<W: WeightElement>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    n: usize,
    out: &mut [f32],
    parallel: bool,
) {
    assert_eq!(x.len(), m * k, "lhs size");
    assert_eq!(w.len(), n * k, "rhs size");
    assert_eq!(out.len(), m * n, "output size");
    if m == 0 || n == 0 || k == 0 {
        out.fill(0.0);
        return;
    }
    if let Some(weights) = W::as_bf16(w)
        && amx::takes_outputs(n)
        && let Some(packed) = PackedInputs::new(x, m, k)
        && amx::matmul_transposed(&packed, TileWeights::Bf16(weights), n, out, n, parallel)
    {
        return;
    }
    if m <= FEW_ROWS || (!W::IS_F32 && (m <= few_rows_widened() || broadcast_tiles_take(m))) {
        matmul_few_rows(x, m, k, w, out, parallel);
        return;
    }
    if !W::IS_F32 {
        matmul_widening(x, m, k, n, out, parallel, |first, panel| {
            for (v, w) in panel.iter_mut().zip(&w[first * k..]) {
                *v = w.to_f32();
            }
        });
        return;
    }
    // rhs is wᵀ: element (kk, nn) lies at w[nn * k + kk].
    let w = W::widen(w);
    gemm_strided(
        x,
        m,
        k,
        (k as isize, 1),
        &w,
        n,
        (1, k as isize),
        out,
        parallel,
        false,
    );
}

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
fn gemm_strided(
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

/// Up to this many rows, products stream the weights once and reuse each weight row for
/// every input row from L1 ([`matmul_few_rows`]); above it the packed GEMM wins.
pub(crate) const FEW_ROWS: usize = 8;

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

/// Output columns per parallel task in [`matmul_few_rows`].
const COLUMNS_PER_TASK: usize = 32;

/// `out [m, n] = x [m, k] · w [n, k]ᵀ` for small `m`: each weight row is read from memory once
/// and dotted with every input row while it sits in L1. With few rows the product is bound by
/// reading weights, and packing them (as a GEMM does) would read them twice.
fn matmul_few_rows<W: WeightElement>(
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
const TILE_ROWS: usize = 4;

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
enum TileKernel {
    /// Four weight rows by four input rows of 16 lanes: 16 of the 32 registers accumulate.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// Three weight rows by four input rows of 8 lanes: 12 of the 16 registers accumulate.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl TileKernel {
    fn detect() -> Option<TileKernel> {
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
    fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx512 => "AVX-512 (9 to 64 rows: weights broadcast into 16-row registers)",
            #[cfg(target_arch = "x86_64")]
            TileKernel::Avx2 => "AVX2",
        }
    }

    /// Weight rows per tile.
    fn columns(self) -> usize {
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
    fn tile(self, x: &[f32], stride: usize, w: &[f32], len: usize) -> [f32; 16] {
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

/// `out_t[c * m + r] = x[r] · w[c]` for the few input rows the explicit kernel the CPU runs
/// takes ([`DecodeKernel::max_rows`]: decode), where the weights are f32, bf16 or FP8; false,
/// having done nothing, where not.
fn dot_few_rows<W: WeightElement>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    out_t: &mut [f32],
) -> bool {
    let Some(kernel) = DecodeKernel::detect() else {
        return false;
    };
    if W::STORED == Stored::Other || !(1..=kernel.max_rows()).contains(&m) {
        return false;
    }
    kernel.run(x, m, k, w, out_t);
    true
}

/// The explicit decode kernels (one to three input rows) this CPU can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DecodeKernel {
    /// [`rows_avx512`]: AVX-512 F, BW and VL.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// [`rows_avx2`]: AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl DecodeKernel {
    /// Every decode kernel the CPU can run (an AVX-512 CPU runs the AVX2 one too), for tests.
    #[cfg(test)]
    pub(crate) fn all() -> Vec<DecodeKernel> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if decode_kernel_available() {
                kernels.push(DecodeKernel::Avx512);
            }
            if avx2_decode_available() {
                kernels.push(DecodeKernel::Avx2);
            }
        }
        if kernels.is_empty() {
            crate::compute::skipped(
                "this CPU has no explicit decode kernel (x86-64 AVX2 or AVX-512)",
            );
        }
        kernels
    }

    fn detect() -> Option<DecodeKernel> {
        #[cfg(target_arch = "x86_64")]
        {
            if decode_kernel_available() {
                return Some(DecodeKernel::Avx512);
            }
            if avx2_decode_available() {
                return Some(DecodeKernel::Avx2);
            }
        }
        None
    }

    /// As `moe-node devices` names it.
    fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx512 => "AVX-512, four weight rows a pass",
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx2 => "AVX2, three weight rows a pass (two from four input rows)",
        }
    }

    /// The most input rows the kernel takes: three on AVX-512 (more go to the tiles), up to
    /// [`FEW_ROWS`] on AVX2, which decodes each pass's weights in registers for every group
    /// of input rows rather than widening them into a buffer for [`dot_tiles`].
    fn max_rows(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx512 => 3,
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx2 => FEW_ROWS,
        }
    }

    /// `out_t[c * m + r] = x[r] · w[c]` for `m` of 1 to [`DecodeKernel::max_rows`] and
    /// weights of a [`Stored`] form other than `Other`.
    pub(crate) fn run<W: WeightElement>(
        self,
        x: &[f32],
        m: usize,
        k: usize,
        w: &[W],
        out_t: &mut [f32],
    ) {
        assert!(
            (1..=self.max_rows()).contains(&m) && W::STORED != Stored::Other,
            "a decode product"
        );
        let n = out_t.len() / m;
        assert!(
            x.len() >= m * k && w.len() >= n * k,
            "few-row product sizes"
        );
        // SAFETY: detect() or all() saw the kernel's features; the asserts bound the rows it
        // reads, and it writes only `out_t`.
        match self {
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx512 => match m {
                1 => unsafe { rows_avx512::<W, 1>(x, k, w, out_t) },
                2 => unsafe { rows_avx512::<W, 2>(x, k, w, out_t) },
                _ => unsafe { rows_avx512::<W, 3>(x, k, w, out_t) },
            },
            #[cfg(target_arch = "x86_64")]
            DecodeKernel::Avx2 => match m {
                1 => unsafe { rows_avx2::<W, 3, 1>(x, m, k, w, out_t) },
                2 => unsafe { rows_avx2::<W, 3, 2>(x, m, k, w, out_t) },
                3 => unsafe { rows_avx2::<W, 3, 3>(x, m, k, w, out_t) },
                _ => unsafe { rows_avx2::<W, 2, 4>(x, m, k, w, out_t) },
            },
        }
    }
}

/// What the decode kernels settle before their passes.
struct DecodePlan {
    /// The factor of the vector sums: the half-precision route reads an e4m3 value times
    /// 2^-8 (f16's exponent bias is 8 more than e4m3's), so FP8 sums are scaled back, exactly.
    scale: f32,
    /// Elements ahead to prefetch: the same place in the rows of a pass at least 4 KiB on.
    ahead: usize,
    /// Chunks per cache line (a chunk of narrow weights is less than a line): one prefetch
    /// each.
    line_chunks: usize,
}

impl DecodePlan {
    fn new<W: WeightElement>(columns: usize, k: usize, lanes: usize) -> Self {
        let size = std::mem::size_of::<W>();
        DecodePlan {
            scale: if W::STORED == Stored::E4m3 {
                256.0
            } else {
                1.0
            },
            ahead: columns * k * (4096usize).div_ceil(columns * k * size),
            line_chunks: (64 / (lanes * size)).max(1),
        }
    }

    /// The weight rows of the pass from row `first` (of `n`, `k` apart): the last pass
    /// repeats the last row where fewer than `C` are left.
    fn rows<W, const C: usize>(
        &self,
        w: *const W,
        first: usize,
        n: usize,
        k: usize,
    ) -> [*const W; C] {
        std::array::from_fn(|c| w.wrapping_add((first + c).min(n - 1) * k))
    }
}

/// Whether the CPU runs [`rows_avx2`].
#[cfg(target_arch = "x86_64")]
fn avx2_decode_available() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// [`DecodeKernel::Avx2`]: [`rows_avx512`] with 8 lanes and `COLUMNS` weight rows a pass, for
/// one to [`FEW_ROWS`] input rows in groups of `R` (`COLUMNS` x `R` accumulators of the 16
/// registers): each pass's weight rows (in L1 after the first group) are decoded in registers
/// for every group; the last group repeats the last input row where fewer than `R` are left
/// (its outputs not written). The last partial chunk of each row is summed in scalars.
///
/// Three weight rows a pass for one to three input rows, two for four to eight in groups of
/// four: fewer groups decode each pass's weights fewer times (8 rows: 2 groups, against 3 of
/// three), and one weight row a pass with all eight inputs (decoded once) was no faster, its
/// eight input rows (32 KiB at k = 1024) no longer held in L1 beside the weights.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `x` holds `m` rows of `k` and `w` the `out_t.len() / m`
/// rows of `k`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2<W: WeightElement, const COLUMNS: usize, const R: usize>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    out_t: &mut [f32],
) {
    use std::arch::x86_64::*;
    let n = out_t.len() / m;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let plan = DecodePlan::new::<W>(COLUMNS, k, 8);
    // Eight weights from `$p` (see rows_avx512 for the FP8 route).
    macro_rules! load_w {
        ($p:expr) => {
            match W::STORED {
                Stored::F32 => _mm256_loadu_ps($p.cast::<f32>()),
                Stored::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128($p.cast())),
                )),
                _ => _mm256_cvtph_ps(_mm_and_si128(
                    _mm_slli_epi16::<7>(_mm_cvtepi8_epi16(_mm_loadl_epi64($p.cast()))),
                    _mm_set1_epi16(0xbf80u16 as i16),
                )),
            }
        };
    }
    let whole = k / 8 * 8;
    for first in (0..n).step_by(COLUMNS) {
        let rows: [*const W; COLUMNS] = plan.rows(wp, first, n, k);
        for r0 in (0..m).step_by(R) {
            let inputs: [*const f32; R] =
                std::array::from_fn(|r| xp.wrapping_add((r0 + r).min(m - 1) * k));
            let mut acc = [[_mm256_setzero_ps(); R]; COLUMNS];
            for at in (0..whole).step_by(8) {
                if r0 == 0 && (at / 8).is_multiple_of(plan.line_chunks) {
                    for row in rows {
                        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(plan.ahead + at).cast::<i8>());
                    }
                }
                // SAFETY: every row holds `k` values (the caller's contract) and the chunk at
                // `at` ends at or before `whole <= k`.
                let wv: [__m256; COLUMNS] =
                    std::array::from_fn(|c| unsafe { load_w!(rows[c].add(at)) });
                // SAFETY: as above, for the input rows.
                let xv: [__m256; R] =
                    std::array::from_fn(|r| unsafe { _mm256_loadu_ps(inputs[r].add(at)) });
                for (acc, wv) in acc.iter_mut().zip(wv) {
                    for (acc, xv) in acc.iter_mut().zip(xv) {
                        *acc = _mm256_fmadd_ps(xv, wv, *acc);
                    }
                }
            }
            for (c, acc) in acc.iter().enumerate().take(n - first) {
                for (r, acc) in acc.iter().enumerate().take(m - r0) {
                    let half = _mm_add_ps(
                        _mm256_castps256_ps128(*acc),
                        _mm256_extractf128_ps::<1>(*acc),
                    );
                    let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
                    let sum = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
                    let tail: f32 = (whole..k)
                        .map(|i| x[(r0 + r) * k + i] * w[(first + c) * k + i].to_f32())
                        .sum();
                    out_t[(first + c) * m + r0 + r] = sum * plan.scale + tail;
                }
            }
        }
    }
}

/// Whether the CPU runs [`rows_avx512`].
pub(crate) fn decode_kernel_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`dot_few_rows`] for `R` input rows: four weight rows per pass, each decoded from its
/// stored form in registers as it is loaded (bf16 by a shift; FP8 through the half-precision
/// conversion, which takes e4m3's subnormals without the slow path that f32 subnormals take)
/// and used for every input row, in 4 x `R` independent accumulators. The pass's weight rows
/// are read as four streams, with the next pass's prefetched.
///
/// # Safety
/// The CPU has AVX-512F, BW and VL; `x` holds `R` rows of `k` and `w` the `out_t.len() / R`
/// rows of `k`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn rows_avx512<W: WeightElement, const R: usize>(
    x: &[f32],
    k: usize,
    w: &[W],
    out_t: &mut [f32],
) {
    use std::arch::x86_64::*;
    const COLUMNS: usize = 4;
    let n = out_t.len() / R;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let plan = DecodePlan::new::<W>(COLUMNS, k, 16);
    // Sixteen weights from `$p`, the lanes outside `$mask` zero.
    macro_rules! load_w {
        ($p:expr, $mask:expr) => {
            match W::STORED {
                Stored::F32 => _mm512_maskz_loadu_ps($mask, $p.cast::<f32>()),
                Stored::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16($mask, $p.cast::<i16>())),
                )),
                // Sign-extended to 16 bits and shifted by 7, the byte's sign lands on the
                // f16 sign and its exponent and mantissa on f16's low exponent bits and high
                // mantissa bits; the mask clears the copies of the sign between them.
                _ => _mm512_cvtph_ps(_mm256_and_si256(
                    _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(
                        $mask,
                        $p.cast::<i8>(),
                    ))),
                    _mm256_set1_epi16(0xbf80u16 as i16),
                )),
            }
        };
    }
    let whole = k / 16 * 16;
    let tail: __mmask16 = ((1u32 << (k - whole)) - 1) as __mmask16;
    for first in (0..n).step_by(COLUMNS) {
        let rows: [*const W; COLUMNS] = plan.rows(wp, first, n, k);
        let mut acc = [[_mm512_setzero_ps(); R]; COLUMNS];
        // One chunk of 16 lanes at `$at` of every row, read through `$mask`.
        macro_rules! chunk {
            ($at:expr, $mask:expr) => {{
                // SAFETY: every row holds `k` values (the caller's contract) and `$mask`
                // covers only lanes below `k`. (A prefetch is a hint that never faults.)
                if ($at / 16).is_multiple_of(plan.line_chunks) {
                    for row in rows {
                        _mm_prefetch::<_MM_HINT_T0>(
                            row.wrapping_add(plan.ahead + $at).cast::<i8>(),
                        );
                    }
                }
                let wv: [__m512; COLUMNS] =
                    std::array::from_fn(|c| unsafe { load_w!(rows[c].add($at), $mask) });
                for r in 0..R {
                    let xv = unsafe { _mm512_maskz_loadu_ps($mask, xp.add(r * k + $at)) };
                    for c in 0..COLUMNS {
                        acc[c][r] = _mm512_fmadd_ps(xv, wv[c], acc[c][r]);
                    }
                }
            }};
        }
        // FP8 takes 32 bytes a step: one sign extension, shift and mask for both halves
        // (16-20% faster than two 16-byte steps with the weights in cache).
        let mut at = 0;
        if W::STORED == Stored::E4m3 {
            while at + 32 <= whole {
                if (at / 16).is_multiple_of(plan.line_chunks) {
                    for row in rows {
                        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(plan.ahead + at).cast::<i8>());
                    }
                }
                let halves: [[__m512; 2]; COLUMNS] = std::array::from_fn(|c| {
                    // SAFETY: 32 values from `at` lie within every row (at + 32 <= k).
                    let bytes = unsafe { _mm256_loadu_si256(rows[c].add(at).cast()) };
                    let h = _mm512_and_si512(
                        _mm512_slli_epi16::<7>(_mm512_cvtepi8_epi16(bytes)),
                        _mm512_set1_epi16(0xbf80u16 as i16),
                    );
                    [
                        _mm512_cvtph_ps(_mm512_castsi512_si256(h)),
                        _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h)),
                    ]
                });
                // SAFETY: as above, for the input rows.
                let xs: [[__m512; 2]; R] = std::array::from_fn(|r| unsafe {
                    [0, 16].map(|offset| _mm512_loadu_ps(xp.add(r * k + at + offset)))
                });
                for (acc, halves) in acc.iter_mut().zip(&halves) {
                    for (acc, xs) in acc.iter_mut().zip(&xs) {
                        *acc = _mm512_fmadd_ps(xs[0], halves[0], *acc);
                        *acc = _mm512_fmadd_ps(xs[1], halves[1], *acc);
                    }
                }
                at += 32;
            }
        }
        while at < whole {
            chunk!(at, 0xffff);
            at += 16;
        }
        if whole < k {
            chunk!(whole, tail);
        }
        for (c, acc) in acc.iter().enumerate().take(n - first) {
            for (r, acc) in acc.iter().enumerate() {
                out_t[(first + c) * R + r] = _mm512_reduce_add_ps(*acc) * plan.scale;
            }
        }
    }
}

/// The frame of a few-row product `out [m, n]` with `k`-wide inputs: `columns(first, block)`
/// computes output columns `first..` into `block`, output-transposed (`[column][row]`) so that
/// parallel tasks own disjoint memory; the blocks are scattered into `out` at the end.
pub(crate) fn few_rows_by_columns(
    m: usize,
    k: usize,
    out: &mut [f32],
    parallel: bool,
    columns: impl Fn(usize, &mut [f32]) + Sync,
) {
    let n = out.len() / m;
    let mut out_t = vec![0.0f32; n * m];
    if parallel && m * n * k >= PARALLEL_MIN_FLOPS {
        out_t
            .par_chunks_mut(COLUMNS_PER_TASK * m)
            .enumerate()
            .for_each(|(task, block)| columns(task * COLUMNS_PER_TASK, block));
    } else {
        columns(0, &mut out_t);
    }
    for (j, column) in out_t.chunks_exact(m).enumerate() {
        for (i, v) in column.iter().enumerate() {
            out[i * n + j] = *v;
        }
    }
}

/// `out[i] = x[i] · w` for each of the `out.len()` rows of `x` (each `k` wide).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn dot_rows<W: WeightElement>(x: &[f32], k: usize, w: &[W], out: &mut [f32]) {
    const LANES: usize = 16;
    let fused =
        multiversion::target::target_cfg_f!(any(target_feature = "fma", target_feature = "neon"));
    let whole = k / LANES * LANES;
    let tail = |xr: &[f32]| (whole..k).map(|i| xr[i] * w[i].to_f32()).sum::<f32>();
    let mut rows = x.chunks_exact(k);
    let mut left = out.len();
    let mut outs = out.iter_mut();
    // Four input rows at a time share each load of the weight row.
    while left >= 4 {
        let (Some(x0), Some(x1), Some(x2), Some(x3)) =
            (rows.next(), rows.next(), rows.next(), rows.next())
        else {
            break;
        };
        let (mut a0, mut a1, mut a2, mut a3) =
            ([0.0f32; LANES], [0.0; LANES], [0.0; LANES], [0.0; LANES]);
        for (((wc, c0), c1), (c2, c3)) in lanes(w, whole)
            .zip(lanes(x0, whole))
            .zip(lanes(x1, whole))
            .zip(lanes(x2, whole).zip(lanes(x3, whole)))
        {
            prefetch_ahead(wc);
            let wc: [f32; LANES] = std::array::from_fn(|l| wc[l].to_f32());
            for l in 0..LANES {
                a0[l] = madd(fused, c0[l], wc[l], a0[l]);
                a1[l] = madd(fused, c1[l], wc[l], a1[l]);
                a2[l] = madd(fused, c2[l], wc[l], a2[l]);
                a3[l] = madd(fused, c3[l], wc[l], a3[l]);
            }
        }
        for (a, xr) in [(a0, x0), (a1, x1), (a2, x2), (a3, x3)] {
            if let Some(o) = outs.next() {
                *o = hsum16(a) + tail(xr);
            }
        }
        left -= 4;
    }
    // The rows left over (fewer than four), one at a time, in two accumulators: one chain of
    // multiply-adds would wait on its own latency at every chunk.
    for (xr, o) in rows.zip(outs) {
        let (mut even, mut odd) = ([0.0f32; LANES], [0.0f32; LANES]);
        let pairs = whole / (2 * LANES) * (2 * LANES);
        for (xc, wc) in xr[..pairs]
            .chunks_exact(2 * LANES)
            .zip(w[..pairs].chunks_exact(2 * LANES))
        {
            prefetch_ahead(wc);
            for l in 0..LANES {
                even[l] = madd(fused, xc[l], wc[l].to_f32(), even[l]);
                odd[l] = madd(fused, xc[LANES + l], wc[LANES + l].to_f32(), odd[l]);
            }
        }
        if pairs < whole {
            for l in 0..LANES {
                even[l] = madd(fused, xr[pairs + l], w[pairs + l].to_f32(), even[l]);
            }
        }
        *o = hsum16(std::array::from_fn(|l| even[l] + odd[l])) + tail(xr);
    }
}

/// The sum of sixteen lanes as a tree (halves added to halves): four dependent additions
/// that vectorise, where a sum in order is fifteen.
#[inline(always)]
pub(crate) fn hsum16(a: [f32; 16]) -> f32 {
    let h: [f32; 8] = std::array::from_fn(|i| a[i] + a[i + 8]);
    let q: [f32; 4] = std::array::from_fn(|i| h[i] + h[i + 4]);
    (q[0] + q[2]) + (q[1] + q[3])
}

/// `out[j] = x · rows[j * stride..][..x.len()]`: one vector against many, as attention
/// scores a query against every cached key. One call per query, not per key: the per-call
/// cost of a kernel chosen at run time is paid once.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn dot_strided(x: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let fused =
        multiversion::target::target_cfg_f!(any(target_feature = "fma", target_feature = "neon"));
    let k = x.len();
    let whole = k / 16 * 16;
    let tail = |row: &[f32]| (whole..k).map(|i| x[i] * row[i]).sum::<f32>();
    // Four rows at a time: four independent chains of multiply-adds, where one row's chain
    // waits on each step's latency. Each row's sum is made the same way in both loops (its
    // lanes, then the same tree), so a score does not depend on its neighbours.
    let grouped = out.len() / 4 * 4;
    for (j, o) in out[..grouped].chunks_exact_mut(4).enumerate() {
        let row = |t: usize| &rows[(4 * j + t) * stride..][..k];
        let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
        let (mut a0, mut a1, mut a2, mut a3) =
            ([0.0f32; 16], [0.0f32; 16], [0.0f32; 16], [0.0f32; 16]);
        let chunks = lanes(x, whole)
            .zip(lanes(r0, whole))
            .zip(lanes(r1, whole))
            .zip(lanes(r2, whole))
            .zip(lanes(r3, whole));
        for ((((xc, c0), c1), c2), c3) in chunks {
            for l in 0..16 {
                a0[l] = madd(fused, xc[l], c0[l], a0[l]);
                a1[l] = madd(fused, xc[l], c1[l], a1[l]);
                a2[l] = madd(fused, xc[l], c2[l], a2[l]);
                a3[l] = madd(fused, xc[l], c3[l], a3[l]);
            }
        }
        o[0] = hsum16(a0) + tail(r0);
        o[1] = hsum16(a1) + tail(r1);
        o[2] = hsum16(a2) + tail(r2);
        o[3] = hsum16(a3) + tail(r3);
    }
    for (j, o) in out.iter_mut().enumerate().skip(grouped) {
        let row = &rows[j * stride..][..k];
        let mut acc = [0.0f32; 16];
        for (xc, rc) in lanes(x, whole).zip(lanes(row, whole)) {
            for l in 0..16 {
                acc[l] = madd(fused, xc[l], rc[l], acc[l]);
            }
        }
        *o = hsum16(acc) + tail(row);
    }
}

/// `out[i] = Σ_j weights[j] · values[j * stride + i]`, summed in order of `j`: attention's
/// weighted sum of the cached values. The output is made 128 values at a time (eight AVX-512
/// registers), kept in registers across the rows instead of loaded and stored per row.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn weighted_rows(weights: &[f32], values: &[f32], stride: usize, out: &mut [f32]) {
    let fused =
        multiversion::target::target_cfg_f!(any(target_feature = "fma", target_feature = "neon"));
    const BLOCK: usize = 128;
    let whole = out.len() / BLOCK * BLOCK;
    for (c, o) in out[..whole].chunks_exact_mut(BLOCK).enumerate() {
        let mut acc = [0.0f32; BLOCK];
        for (j, &w) in weights.iter().enumerate() {
            let v: &[f32; BLOCK] = values[j * stride + c * BLOCK..][..BLOCK]
                .try_into()
                .expect("a block");
            for l in 0..BLOCK {
                acc[l] = madd(fused, w, v[l], acc[l]);
            }
        }
        o.copy_from_slice(&acc);
    }
    let rest = &mut out[whole..];
    rest.fill(0.0);
    for (j, &w) in weights.iter().enumerate() {
        let v = &values[j * stride + whole..][..rest.len()];
        for (o, &v) in rest.iter_mut().zip(v) {
            *o = madd(fused, w, v, *o);
        }
    }
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
fn prefetch_ahead<T>(chunk: &[T]) {
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
fn lanes<T>(r: &[T], whole: usize) -> std::slice::ChunksExact<'_, T> {
    r[..whole].chunks_exact(16)
}

/// Dot product of two equal-length slices.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut out = [0.0];
    dot_rows(a, a.len(), b, &mut out);
    out[0]
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// RMSNorm of each `weight.len()`-wide row of `x`, in place: `x / sqrt(mean(x²) + eps) * w`.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(weight.len()) {
        let mean_square = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
        let scale = 1.0 / (mean_square + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

/// RMSNorm into a new buffer.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm_in_place(&mut out, weight, eps);
    out
}

/// `acc[i] += x[i]`.
pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// Softmax of `x` in place, numerically stable.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `x [m, k] · w [n, k]ᵀ`, element by element: the reference the products are held to.
    pub(crate) fn naive(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
            }
        }
        out
    }

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-4 * (1.0 + y.abs()))
    }

    #[test]
    fn attention_scores_and_weighted_sums_equal_the_plain_loops() {
        // Keys and values `stride` apart (other heads between them); widths below, at and
        // above a 16-lane chunk and a 128-value block, with tails; row counts that leave
        // rows over after the groups of four.
        for (width, stride, count) in [(128, 512, 37), (64, 64, 4), (200, 300, 9), (20, 21, 3)] {
            let x: Vec<f32> = (0..width)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
                .collect();
            let rows: Vec<f32> = (0..count * stride)
                .map(|i| ((i * 11 % 17) as f32 - 8.0) / 9.0)
                .collect();
            let mut scores = vec![0.0; count];
            dot_strided(&x, &rows, stride, &mut scores);
            for (j, &got) in scores.iter().enumerate() {
                let want: f32 = (0..width).map(|i| x[i] * rows[j * stride + i]).sum();
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "score {j}: {got} vs {want}"
                );
            }
            // A row's score is the same whatever rows are scored beside it (the first is
            // scored in a group of four above, alone here).
            let mut alone = vec![0.0; 1];
            dot_strided(&x, &rows, stride, &mut alone);
            assert_eq!(alone[0].to_bits(), scores[0].to_bits());
            let weights: Vec<f32> = (0..count).map(|j| 1.0 / (1 + j) as f32).collect();
            let mut out = vec![f32::NAN; width];
            weighted_rows(&weights, &rows, stride, &mut out);
            for (i, &got) in out.iter().enumerate() {
                let want: f32 = (0..count).map(|j| weights[j] * rows[j * stride + i]).sum();
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "value {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn transposed_product_matches_naive_for_one_and_many_rows() {
        let (k, n) = (37, 130);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
            .collect();
        for m in [1, 3, 4, 7, 8, 9, 64] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
                .collect();
            for parallel in [false, true] {
                let mut out = vec![0.0; m * n];
                matmul_transposed(&x, m, k, &w, n, &mut out, parallel);
                assert!(close(&out, &naive(&x, m, k, &w, n)), "m={m}");
            }
        }
    }

    #[test]
    fn bf16_weights_give_the_product_of_their_f32_values() {
        // (300, 530): above FEW_ROWS rows the weights are widened in panels of 218 rows
        // (fewer when parallel), the last one partial; 9 to 64 rows take the broadcast tiles
        // on AVX-512: one to four registers of 16 rows (the last partial at 33, 40 and 49
        // rows), tasks of 32 columns (48 from 49 rows, in tiles of six), the last task and
        // tile partial; 65 rows and more go to the packed GEMM.
        for (k, n) in [(40, 24), (300, 530)] {
            let w: Vec<bf16> = (0..n * k)
                .map(|i| bf16::from_f32(((i * 7 % 13) as f32 - 6.0) / 5.0))
                .collect();
            let widened: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            for m in [1, 4, 6, 9, 12, 20, 32, 33, 40, 48, 49, 64, 65, 100] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
                    .collect();
                let expected = naive(&x, m, k, &widened, n);
                for parallel in [false, true] {
                    let mut out = vec![f32::NAN; m * n];
                    matmul_transposed(&x, m, k, &w, n, &mut out, parallel);
                    assert!(close(&out, &expected), "k={k} n={n} m={m} {parallel}");
                }
            }
        }
    }

    #[test]
    fn few_row_tiles_match_the_naive_product_at_every_edge() {
        // Rows left over by the tiles of four (5, 7, 33), weight rows left over by the tiles
        // of three or four (10), inputs that leave a partial chunk of lanes (37, 1000), and
        // inputs long enough to be cut into several slices at 33 rows (1000); below four rows,
        // the decode kernel (four weight rows a pass: 9 and 10 leave one and two over).
        for (m, k, n) in [
            (1, 37, 10),
            (2, 1000, 9),
            (3, 16, 4),
            (1, 8, 3),
            (4, 16, 4),
            (5, 37, 10),
            (7, 64, 9),
            (16, 1000, 12),
            (33, 1000, 10),
            // The broadcast tiles (9 to 32 rows, AVX-512): rows padded to one or two
            // registers (9, 24, 32), weight rows left over by tiles of 16 or 8 (17, 19),
            // slices of 256 whole (256) or with one value over (513).
            (9, 300, 17),
            (24, 256, 8),
            (32, 513, 19),
        ] {
            // The same product from bf16 weights and from the same weights in f32.
            let (x, w, wide, expected) = few_row_case(m, k, n);
            let mut from_bf16 = vec![f32::NAN; n * m];
            dot_tiles(&x, m, k, &w, &mut from_bf16);
            let mut from_f32 = vec![f32::NAN; n * m];
            dot_tiles(&x, m, k, &wide, &mut from_f32);
            for out_t in [from_bf16, from_f32] {
                assert_transposed_matches(&out_t, &expected, m, n, "dot_tiles");
            }
        }
    }

    #[test]
    fn the_portable_row_kernel_matches_the_naive_product() {
        // dot_rows is what products below four rows run where the CPU has no AVX-512 (and
        // what `dot` always runs): one to six input rows (the passes of four and the rows
        // left over), inputs that leave no, a partial, or a whole odd chunk of 16 lanes.
        for m in 1..=6 {
            for k in [1, 15, 16, 17, 32, 33, 48, 100] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.0)
                    .collect();
                let w: Vec<bf16> = (0..k)
                    .map(|i| bf16::from_f32(((i * 5 % 19) as f32 - 9.0) / 16.0))
                    .collect();
                let wide: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
                let expected = naive(&x, m, k, &wide, 1);
                let mut out = vec![0.0f32; m];
                dot_rows(&x, k, &w, &mut out);
                for (got, want) in out.iter().zip(&expected) {
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "m={m}, k={k}: {got} against {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_decode_kernel_the_cpu_has_matches_the_naive_product() {
        // One to eight input rows (as many as the kernel takes: AVX2 in groups of up to
        // four, the last group short); weight rows left over by passes of two, three and
        // four (5, 7); inputs with and without a partial chunk of 8 or 16 lanes.
        let cases = [
            (1, 16, 4),
            (1, 37, 5),
            (2, 1000, 7),
            (3, 8, 3),
            (3, 100, 9),
            (4, 37, 7),
            (5, 100, 5),
            (6, 16, 3),
            (7, 1000, 4),
            (8, 100, 9),
        ];
        for kernel in DecodeKernel::all() {
            for (m, k, n) in cases.into_iter().filter(|c| c.0 <= kernel.max_rows()) {
                let (x, w, wide, expected) = few_row_case(m, k, n);
                let mut from_bf16 = vec![f32::NAN; n * m];
                kernel.run(&x, m, k, &w, &mut from_bf16);
                let mut from_f32 = vec![f32::NAN; n * m];
                kernel.run(&x, m, k, &wide, &mut from_f32);
                for out_t in [from_bf16, from_f32] {
                    assert_transposed_matches(&out_t, &expected, m, n, &format!("{kernel:?}"));
                }
            }
        }
    }

    /// Inputs `[m, k]`, bf16 weights `[n, k]`, the same weights in f32, and the naive product.
    fn few_row_case(m: usize, k: usize, n: usize) -> (Vec<f32>, Vec<bf16>, Vec<f32>, Vec<f32>) {
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.0)
            .collect();
        let w: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32(((i * 5 % 19) as f32 - 9.0) / 16.0))
            .collect();
        let wide: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let expected = naive(&x, m, k, &wide, n);
        (x, w, wide, expected)
    }

    /// `out_t[j * m + i]` (output-transposed) is `expected[i * n + j]` within f32 rounding.
    fn assert_transposed_matches(out_t: &[f32], expected: &[f32], m: usize, n: usize, what: &str) {
        for i in 0..m {
            for j in 0..n {
                let (got, want) = (out_t[j * m + i], expected[i * n + j]);
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "{what} ({m}, {n}) at row {i}, column {j}: {got} against {want}"
                );
            }
        }
    }

    #[test]
    fn every_tile_kernel_the_cpu_has_computes_its_tile() {
        #[cfg(target_arch = "x86_64")]
        {
            let mut kernels = Vec::new();
            if std::arch::is_x86_feature_detected!("avx512f") {
                kernels.push(TileKernel::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                kernels.push(TileKernel::Avx2);
            }
            if kernels.is_empty() {
                crate::compute::skipped("this CPU has neither AVX-512 nor AVX2 with FMA");
            }
            for kernel in kernels {
                let c = kernel.columns();
                for len in [8, 16, 37, 100] {
                    let stride = len + 3;
                    let x: Vec<f32> = (0..TILE_ROWS * stride)
                        .map(|i| (i % 13) as f32 - 6.0)
                        .collect();
                    let w: Vec<f32> = (0..c * len).map(|i| (i % 7) as f32 * 0.5 - 1.5).collect();
                    let sums = kernel.tile(&x, stride, &w, len);
                    for col in 0..c {
                        for r in 0..TILE_ROWS {
                            let want: f32 =
                                (0..len).map(|q| x[r * stride + q] * w[col * len + q]).sum();
                            assert_eq!(
                                sums[col * TILE_ROWS + r],
                                want,
                                "column {col}, row {r}, {len} values"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn plain_product_matches_transposed_of_transpose() {
        let (m, k, n) = (4, 6, 5);
        let x: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.1).collect();
        let w_kn: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.3).sin()).collect();
        let mut w_nk = vec![0.0; n * k];
        for r in 0..k {
            for c in 0..n {
                w_nk[c * k + r] = w_kn[r * n + c];
            }
        }
        let mut out = vec![0.0; m * n];
        matmul(&x, m, k, &w_kn, n, &mut out, false);
        assert!(close(&out, &naive(&x, m, k, &w_nk, n)));
    }

    #[test]
    fn rms_norm_and_softmax_hand_checked() {
        let mut x = vec![3.0, 4.0];
        rms_norm_in_place(&mut x, &[1.0, 2.0], 0.0);
        let rms = (12.5f32).sqrt();
        assert!(close(&x, &[3.0 / rms, 8.0 / rms]));
        let mut s = vec![0.0, (2.0f32).ln()];
        softmax_in_place(&mut s);
        assert!(close(&s, &[1.0 / 3.0, 2.0 / 3.0]));
    }
}
