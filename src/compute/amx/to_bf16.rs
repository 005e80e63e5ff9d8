//! FP8 and INT4 weights made bf16 (exactly: bf16 holds every value of both), one pair of
//! 16-row blocks at a time, for the BF16 tiles.

use std::sync::OnceLock;

use half::bf16;

use crate::compute::quant::e4m3::e4m3_to_f32;

/// `bytes` (FP8 e4m3) as bf16 in `out`, exactly: e4m3's 3 mantissa bits fit bf16's 7 and its
/// exponents bf16's.
pub(super) fn e4m3_to_bf16(bytes: &[u8], out: &mut Vec<bf16>) {
    out.clear();
    out.reserve(bytes.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bw") {
        let whole = bytes.len() / 32 * 32;
        // SAFETY: the CPU has AVX-512 F and BW; `out` has room for every byte's value.
        unsafe {
            e4m3_to_bf16_avx512(&bytes[..whole], out.spare_capacity_mut());
            out.set_len(whole);
        }
        out.extend(bytes[whole..].iter().map(|&b| e4m3_bf16(b)));
        return;
    }
    out.extend(bytes.iter().map(|&b| e4m3_bf16(b)));
}

/// INT4 `words` (eight nibbles each, lowest first, each its value plus 8) as bf16 in `out`,
/// exactly: the values -8..7.
pub(super) fn int4_to_bf16(words: &[u32], out: &mut Vec<bf16>) {
    out.clear();
    out.reserve(8 * words.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bw") {
        let whole = words.len() / 4 * 4;
        // SAFETY: the CPU has AVX-512 F and BW; `out` has room for every word's values.
        unsafe {
            int4_to_bf16_avx512(&words[..whole], out.spare_capacity_mut());
            out.set_len(8 * whole);
        }
        out.extend(words[whole..].iter().flat_map(|&w| int4_values(w)));
        return;
    }
    out.extend(words.iter().flat_map(|&w| int4_values(w)));
}

/// The eight values of an INT4 word, as bf16.
fn int4_values(word: u32) -> [bf16; 8] {
    std::array::from_fn(|j| bf16::from_f32(((word >> (4 * j)) & 0xf) as f32 - 8.0))
}

/// [`int4_to_bf16`] with AVX-512, four words (32 values) at a time: the nibbles masked apart
/// and interleaved (low nibble first), widened to words, and looked up in a 16-entry table of
/// the bf16 of `nibble - 8`.
///
/// # Safety
/// The CPU has AVX-512 F and BW; `words.len()` is a multiple of 4 and `out` has room for
/// eight values per word.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn int4_to_bf16_avx512(words: &[u32], out: &mut [std::mem::MaybeUninit<half::bf16>]) {
    use std::arch::x86_64::*;
    assert!(words.len().is_multiple_of(4) && out.len() >= 8 * words.len());
    let table: [u16; 32] =
        std::array::from_fn(|i| half::bf16::from_f32((i % 16) as f32 - 8.0).to_bits());
    // SAFETY (the whole body): the assert bounds every load and store; `table` is 64 bytes.
    unsafe {
        let table = _mm512_loadu_si512(table.as_ptr().cast());
        let low4 = _mm_set1_epi8(0x0f);
        for (i, at) in (0..words.len()).step_by(4).enumerate() {
            let bytes = _mm_loadu_si128(words.as_ptr().add(at).cast());
            let low = _mm_and_si128(bytes, low4);
            let high = _mm_and_si128(_mm_srli_epi16::<4>(bytes), low4);
            // Byte b holds values 2b (low nibble) and 2b + 1 (high).
            let first = _mm_unpacklo_epi8(low, high);
            let second = _mm_unpackhi_epi8(low, high);
            let nibbles = _mm256_set_m128i(second, first);
            let values = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nibbles), table);
            _mm512_storeu_si512(out.as_mut_ptr().add(32 * i).cast(), values);
        }
    }
}

/// One e4m3 byte as bf16 (the upper half of its f32 value, which it holds exactly).
fn e4m3_bf16(byte: u8) -> bf16 {
    bf16::from_bits((e4m3_to_f32(byte).to_bits() >> 16) as u16)
}

/// The bf16 bits of the 128 unsigned e4m3 values, in the four 32-word registers the
/// two-register word permutes read.
fn e4m3_bf16_table() -> &'static [[u16; 32]; 4] {
    static TABLE: OnceLock<[[u16; 32]; 4]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = [[0u16; 32]; 4];
        for byte in 0..128u8 {
            table[byte as usize / 32][byte as usize % 32] = e4m3_bf16(byte).to_bits();
        }
        table
    })
}

/// [`e4m3_to_bf16`] with AVX-512, 32 bytes at a time: the low 7 bits of each byte look up its
/// magnitude (two table permutes, one per half of the table, and a blend on bit 6), the sign
/// moves to bit 15. About 8 instructions for 32 values, against the f32 route's 2 x 5 and a
/// narrowing.
///
/// # Safety
/// The CPU has AVX-512 F and BW; `bytes.len()` is a multiple of 32 and `out` has room for it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn e4m3_to_bf16_avx512(bytes: &[u8], out: &mut [std::mem::MaybeUninit<bf16>]) {
    use std::arch::x86_64::*;
    assert!(bytes.len().is_multiple_of(32) && out.len() >= bytes.len());
    let table = e4m3_bf16_table();
    // SAFETY (the whole body): the assert bounds every load and store; the table's rows are
    // 64 bytes each.
    unsafe {
        let t = table.map(|row| _mm512_loadu_si512(row.as_ptr().cast()));
        let low7 = _mm512_set1_epi16(0x7f);
        let bit6 = _mm512_set1_epi16(0x40);
        let sign = _mm512_set1_epi16(0x80);
        for at in (0..bytes.len()).step_by(32) {
            let b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(bytes.as_ptr().add(at).cast()));
            let index = _mm512_and_si512(b, low7);
            // Bits 0-5 pick a word of the register pair (bit 5: which register).
            let first = _mm512_permutex2var_epi16(t[0], index, t[1]);
            let second = _mm512_permutex2var_epi16(t[2], index, t[3]);
            let magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, bit6), first, second);
            let signs = _mm512_slli_epi16::<8>(_mm512_and_si512(b, sign));
            _mm512_storeu_si512(
                out.as_mut_ptr().add(at).cast(),
                _mm512_or_si512(magnitude, signs),
            );
        }
    }
}
