//! Row values to and from their wire dtype: f32 as raw little-endian IEEE bits, bf16 rounded
//! to nearest even as the `half` crate rounds. Apart from the frame layout because this is
//! where the data plane spends its time per byte (the loops are compiled per vector width).

use std::mem::MaybeUninit;

use super::Dtype;

/// Writes `values` in `dtype` into `out` (exactly `values.len() × dtype.size()` bytes).
/// Branch-free per value and compiled per vector width, so the loops vectorise: at the
/// baseline x86-64 target the bf16 loops ran at about a nanosecond a value, byte by byte.
pub fn encode_values(values: &[f32], dtype: Dtype, out: &mut [u8]) {
    encode_into(values, dtype, as_uninit(out));
}

/// Appends `values` in `dtype` to `out`, written straight into its spare capacity: a frame
/// built this way is written once, not zeroed first and then written.
pub fn encode_values_append(values: &[f32], dtype: Dtype, out: &mut Vec<u8>) {
    let len = values.len() * dtype.size();
    out.reserve(len);
    encode_into(values, dtype, &mut out.spare_capacity_mut()[..len]);
    // SAFETY: encode_into initialised the `len` bytes after the old length.
    unsafe { out.set_len(out.len() + len) };
}

/// Reads `out.len()` values in `dtype` from `bytes` (exactly `out.len() × dtype.size()`).
pub fn decode_values(bytes: &[u8], dtype: Dtype, out: &mut [f32]) {
    decode_into(bytes, dtype, as_uninit(out));
}

/// Appends the values `bytes` holds in `dtype` (a whole number of them) to `out`, written
/// straight into its spare capacity (received rows are not zeroed first).
pub fn decode_values_append(bytes: &[u8], dtype: Dtype, out: &mut Vec<f32>) {
    let count = bytes.len() / dtype.size();
    out.reserve(count);
    decode_into(bytes, dtype, &mut out.spare_capacity_mut()[..count]);
    // SAFETY: decode_into initialised the `count` values after the old length.
    unsafe { out.set_len(out.len() + count) };
}

/// `values` as slots the conversions below write.
fn as_uninit<T>(values: &mut [T]) -> &mut [MaybeUninit<T>] {
    // SAFETY: same layout; the conversions only ever write initialised values through it,
    // so `values` stays initialised.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), values.len()) }
}

pub(crate) fn encode_into(values: &[f32], dtype: Dtype, out: &mut [MaybeUninit<u8>]) {
    match dtype {
        Dtype::F32 => {
            for (slot, value) in out.chunks_exact_mut(4).zip(values) {
                for (byte, b) in slot.iter_mut().zip(value.to_le_bytes()) {
                    byte.write(b);
                }
            }
        }
        Dtype::Bf16 => {
            // SAFETY: any bytes may be viewed as u16 slots; align_to keeps them in bounds.
            let (head, words, _) = unsafe { out.align_to_mut::<MaybeUninit<u16>>() };
            if head.is_empty() {
                encode_bf16(values, words);
            } else {
                encode_bf16_bytes(values, out);
            }
        }
    }
}

pub(crate) fn decode_into(bytes: &[u8], dtype: Dtype, out: &mut [MaybeUninit<f32>]) {
    match dtype {
        Dtype::F32 => {
            for (value, chunk) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                value.write(f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]));
            }
        }
        Dtype::Bf16 => match bytemuck::try_cast_slice::<u8, u16>(bytes) {
            Ok(words) => decode_bf16(words, out),
            Err(_) => decode_bf16_bytes(bytes, out),
        },
    }
}

// The bf16 conversions proper: over whole words when the buffer is aligned for them (it is,
// in practice: frames are allocations, and every part of a frame before the rows is a
// multiple of four bytes), over byte pairs when it is not. f32 rows are a plain copy.

#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2",
    "x86_64+avx2",
    "aarch64+neon"
))]
fn encode_bf16(values: &[f32], out: &mut [MaybeUninit<u16>]) {
    for (word, value) in out.iter_mut().zip(values) {
        word.write(f32_to_bf16_bits(*value).to_le());
    }
}

#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2",
    "x86_64+avx2",
    "aarch64+neon"
))]
fn encode_bf16_bytes(values: &[f32], out: &mut [MaybeUninit<u8>]) {
    for (slot, value) in out.chunks_exact_mut(2).zip(values) {
        let [low, high] = f32_to_bf16_bits(*value).to_le_bytes();
        slot[0].write(low);
        slot[1].write(high);
    }
}

#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2",
    "x86_64+avx2",
    "aarch64+neon"
))]
fn decode_bf16(words: &[u16], out: &mut [MaybeUninit<f32>]) {
    for (value, word) in out.iter_mut().zip(words) {
        value.write(bf16_bits_to_f32(u16::from_le(*word)));
    }
}

#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2",
    "x86_64+avx2",
    "aarch64+neon"
))]
fn decode_bf16_bytes(bytes: &[u8], out: &mut [MaybeUninit<f32>]) {
    for (value, chunk) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        value.write(bf16_bits_to_f32(u16::from_le_bytes([chunk[0], chunk[1]])));
    }
}

/// `half::bf16::from_f32(value).to_bits()`, written without branches: round to nearest
/// even, NaNs kept quiet.
pub(crate) fn f32_to_bf16_bits(value: f32) -> u16 {
    let bits = value.to_bits();
    let is_nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    let round_up = (bits & 0x8000) != 0 && (bits & 0x1_7fff) != 0;
    let rounded = (bits >> 16) + u32::from(round_up);
    let quiet_nan = (bits >> 16) | 0x40;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

/// `half::bf16::from_bits(bits).to_f32()`, written without branches.
pub(crate) fn bf16_bits_to_f32(bits: u16) -> f32 {
    let bits = u32::from(bits);
    let is_nan = (bits & 0x7fff) > 0x7f80;
    let bits = if is_nan { bits | 0x40 } else { bits };
    f32::from_bits(bits << 16)
}
