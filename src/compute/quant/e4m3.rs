//! FP8 e4m3fn (OCP) values: the byte's value, the element type the decode kernels read, and
//! the widening of a run of bytes to f32. Low in the layers: the AMX tiles convert FP8 with it.

use crate::compute::cpu::decode::decode_kernel_available;
use crate::compute::cpu::element::{Stored, WeightElement};

/// The value of an e4m3fn byte. Its exponent and mantissa fields, moved to an f32's
/// positions, give the value times 2^-120 (for the subnormals too); 0x7f/0xff, e4m3fn's NaN,
/// reads as ±480, which no quantizer writes. Branch-free, so it vectorises.
#[inline(always)]
pub fn e4m3_to_f32(byte: u8) -> f32 {
    const TWO_POW_120: f32 = f32::from_bits((127 + 120) << 23);
    // The byte sign-extended and shifted puts its sign at bit 31 and copies of it at bits
    // 27..=30, which the mask clears: three integer operations per lane.
    let bits = ((byte as i8 as i32) << 20) as u32 & 0x87f0_0000;
    f32::from_bits(bits) * TWO_POW_120
}

/// An e4m3fn byte as the few-row kernel reads it, decoded as it is loaded (unscaled).
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
pub(crate) struct E4m3(u8);

impl E4m3 {
    pub(crate) fn slice(bytes: &[u8]) -> &[E4m3] {
        // SAFETY: E4m3 is a transparent wrapper around u8 (same size, alignment and valid
        // values), so the same memory read as E4m3 is the same length of valid values.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<E4m3>(), bytes.len()) }
    }
}

impl WeightElement for E4m3 {
    const STORED: Stored = Stored::E4m3;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        e4m3_to_f32(self.0)
    }

    fn widen(weights: &[E4m3]) -> std::borrow::Cow<'_, [f32]> {
        let mut out = Vec::with_capacity(weights.len());
        Self::extend_widened(weights, &mut out);
        std::borrow::Cow::Owned(out)
    }

    fn extend_widened(weights: &[E4m3], buffer: &mut Vec<f32>) {
        let at = buffer.len();
        buffer.resize(at + weights.len(), 0.0);
        // SAFETY: E4m3 is a transparent wrapper around u8.
        let bytes =
            unsafe { std::slice::from_raw_parts(weights.as_ptr().cast::<u8>(), weights.len()) };
        widen_e4m3(bytes, &mut buffer[at..]);
    }
}

/// `out[j] = e4m3(bytes[j])`. With AVX-512 (F, BW, VL) through the half-precision
/// conversion, which takes e4m3's subnormals as ordinary values; [`e4m3_to_f32`]'s multiply
/// makes them f32 subnormals, which most x86 cores multiply on a slow path (random bytes,
/// one in sixteen subnormal, decoded 10x slower).
pub fn widen_e4m3(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(bytes.len(), out.len(), "one f32 per byte");
    #[cfg(target_arch = "x86_64")]
    if decode_kernel_available() {
        // SAFETY: the CPU has the kernel's features; the slices are one length.
        unsafe { widen_e4m3_avx512(bytes, out) };
        return;
    }
    for (o, b) in out.iter_mut().zip(bytes) {
        *o = e4m3_to_f32(*b);
    }
}

/// [`widen_e4m3`] with AVX-512, sixteen bytes at a time, the last chunk masked.
///
/// # Safety
/// The CPU has AVX-512F, BW and VL; `bytes` and `out` are one length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
pub(super) unsafe fn widen_e4m3_avx512(bytes: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    // The f16 route reads each value times 2^-8 (f16's exponent bias is 8 more than e4m3's).
    let scale = _mm512_set1_ps(256.0);
    let sign_exponent_mantissa = _mm256_set1_epi16(0xbf80u16 as i16);
    for at in (0..bytes.len()).step_by(16) {
        let mask: __mmask16 = match bytes.len() - at {
            left if left >= 16 => 0xffff,
            left => ((1u32 << left) - 1) as __mmask16,
        };
        // SAFETY: the mask covers only bytes below the slices' common length.
        unsafe {
            let b = _mm_maskz_loadu_epi8(mask, bytes.as_ptr().add(at).cast());
            // Sign-extended to 16 bits and shifted by 7: the sign lands on f16's sign, the
            // exponent and mantissa on f16's; the mask clears the sign's copies between.
            let half = _mm256_and_si256(
                _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(b)),
                sign_exponent_mantissa,
            );
            let v = _mm512_mul_ps(_mm512_cvtph_ps(half), scale);
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(at), mask, v);
        }
    }
}
