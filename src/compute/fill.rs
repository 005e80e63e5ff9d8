//! Dummy weights' values (`model.load_format = "dummy"`): a rule that gives value `i` of a
//! tensor from `i` alone, the same on the host and on a GPU.

use half::bf16;

/// How a dummy tensor's values are made: value `i` depends on `i` alone, so any part of a
/// tensor can be made anywhere (a thread's chunk on the host, a GPU thread's element) and
/// come out the same. `kernels/moe.cu`'s `fill_dummy` is the device's copy of [`value`].
///
/// [`value`]: DummyFill::value
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DummyFill {
    Constant(f32),
    /// Uniform on `[-half_width, half_width)`: value `i` from the `i`-th output of SplitMix64
    /// started at `stream`.
    Uniform {
        stream: u64,
        half_width: f32,
    },
}

impl DummyFill {
    /// Value `index` of the tensor, as bf16.
    pub fn value(&self, index: u64) -> bf16 {
        match *self {
            DummyFill::Constant(v) => bf16::from_f32(v),
            DummyFill::Uniform { stream, half_width } => {
                let bits = splitmix(stream.wrapping_add(index.wrapping_mul(GOLDEN_GAMMA)));
                // The top 24 bits as a value in [-1, 1): exact in f32, as is the one product,
                // so the device rounds to the same bf16.
                let unit = (bits >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                bf16::from_f32(unit * half_width)
            }
        }
    }
}

/// SplitMix64's increment: its `i`-th output is `splitmix(start + i * GOLDEN_GAMMA)`.
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function: a well-mixed 64-bit value from any 64-bit input.
pub(crate) fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
