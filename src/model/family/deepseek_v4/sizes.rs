//! DeepSeek-V4's bytes as published, from config.json alone (for `moe-node plan`): the routed
//! experts in MXFP4 (`expert_dtype: fp4`: half a byte per weight and a one-byte power-of-two
//! scale per 32) or FP8 (Flash-Base), the dense projections in FP8 e4m3 with one ue8m0 byte per
//! 128 x 128 block, what the reference keeps in bf16 (embeddings, head, router, the
//! compressors' and indexer's pooling projections) in bf16, and norms, sinks, window biases and
//! hyper-connection mixers in f32. The caches are counted as this node keeps them, in f32.

use super::{DeepseekV4, V4ExpertDtype, V4LayerKind};

/// Bytes of an FP8 `[out, in]` matrix with one ue8m0 scale byte per 128 x 128 block.
fn fp8(out: u64, inp: u64) -> u64 {
    out * inp + out.div_ceil(128) * inp.div_ceil(128)
}

/// Bytes of a bf16 `[out, in]` matrix.
fn bf16(out: u64, inp: u64) -> u64 {
    2 * out * inp
}

/// Bytes of f32 values.
fn f32s(n: u64) -> u64 {
    4 * n
}

/// The shape numbers the byte counts need.
pub struct V4Shape {
    pub vocab: u64,
    pub hidden: u64,
    pub heads: u64,
    pub experts: u64,
    pub top_k: u64,
    pub expert_intermediate: u64,
    pub shared_intermediate: u64,
}

impl DeepseekV4 {
    /// One routed expert's bytes as published: MXFP4 unless `expert_dtype` says FP8.
    pub fn expert_bytes(&self, shape: &V4Shape) -> u64 {
        let (h, i) = (shape.hidden, shape.expert_intermediate);
        match self.expert_dtype {
            Some(V4ExpertDtype::Fp8) => 2 * fp8(i, h) + fp8(h, i),
            // Two e2m1 values a byte and an e8m0 exponent per 32 along the input.
            _ => 2 * (i * h / 2 + i * h.div_ceil(32)) + (h * i / 2 + h * i.div_ceil(32)),
        }
    }

    /// Everything but the routed experts, as published (see the module comment).
    pub fn dense_bytes(&self, shape: &V4Shape) -> u64 {
        let h = shape.hidden;
        let m = self.hc_mult as u64;
        let hd = self.head_dim as u64;
        let q = self.q_lora_rank as u64;
        let (g, r) = (self.o_groups as u64, self.o_lora_rank as u64);
        let (ih, ihd) = (self.index_n_heads as u64, self.index_head_dim as u64);
        let mixer = |outputs: u64| f32s(outputs * m * h + outputs) + f32s(3);
        let mut total = 2 * bf16(shape.vocab, h) + f32s(h) + f32s(m * m * h + m + 1);
        for (l, kind) in self.layers.iter().enumerate() {
            let attention = fp8(q, h)
                + f32s(q)
                + fp8(shape.heads * hd, q)
                + fp8(hd, h)
                + f32s(hd)
                + fp8(g * r, shape.heads * hd / g.max(1))
                + fp8(h, g * r)
                + f32s(shape.heads);
            // A compressor pooling `width`-wide entries, two series where it overlaps.
            let compressor = |width: u64, ratio: usize, series: u64| {
                2 * bf16(series * width, h) + f32s(ratio as u64 * series * width) + f32s(width)
            };
            let compressed = match kind {
                V4LayerKind::Sliding => 0,
                V4LayerKind::Hca => compressor(hd, self.hca_ratio, 1),
                V4LayerKind::Csa => {
                    compressor(hd, self.csa_ratio, 2)
                        + compressor(ihd, self.csa_ratio, 2)
                        + fp8(ih * ihd, q)
                        + bf16(ih, h)
                }
            };
            let router = bf16(shape.experts, h)
                + if self.is_hash_layer(l) {
                    4 * shape.vocab * shape.top_k
                } else {
                    f32s(shape.experts)
                };
            let shared = 2 * fp8(shape.shared_intermediate, h) + fp8(h, shape.shared_intermediate);
            total +=
                attention + compressed + router + shared + f32s(2 * h) + 2 * mixer((2 + m) * m);
        }
        total
    }

    /// Bytes one sequence keeps per position, averaged over a long sequence (f32).
    pub fn cache_bytes_per_position(&self) -> u64 {
        (4.0 * self.floats_per_position()).ceil() as u64
    }

    /// Bytes one sequence keeps whatever its length (f32): windows and unfinished blocks.
    pub fn cache_bytes_per_sequence(&self) -> u64 {
        4 * self.fixed_floats() as u64
    }
}
