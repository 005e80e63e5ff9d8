//! How weights are held in memory ([`WeightElement`]: f32 and bf16 here, FP8 beside the
//! quantized formats) and how the kernels widen them to f32. The bottom of the CPU kernels:
//! it imports none of them, so every kernel, the AMX tiles included, can build on it.

use std::borrow::Cow;

use half::bf16;

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
