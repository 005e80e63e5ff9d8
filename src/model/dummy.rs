//! Random weights for a model known only by its `config.json` (`--load-format dummy`, vLLM's
//! name for it): a published shape such as Kimi K2 or DeepSeek-V3 can be served and
//! benchmarked on one machine without downloading a terabyte. The tensors are the ones a bf16
//! checkpoint of that config holds, made when a loader reads them, from a seed and the
//! tensor's name, so every node of a cluster and every run makes the same values.
//!
//! Values: linear weights uniform with a standard deviation of 1/sqrt(inputs) (so
//! activations keep their scale through a layer), embeddings with 1, norm weights 1, the
//! router's score-correction bias 0. The answers are noise; the speed and memory are real.

use rayon::prelude::*;

pub use crate::compute::fill::DummyFill;
use crate::compute::fill::splitmix;

/// Values made per independent random stream; the unit of parallel work.
const CHUNK: usize = 1 << 16;

/// What a dummy checkpoint holds, and how its values are made.
#[derive(Debug, Clone)]
pub struct DummyWeights {
    seed: u64,
    /// The output head is the embedding matrix: `lm_head.weight` is absent.
    tied: bool,
}

impl DummyWeights {
    /// The version of how values are made from the seed (2: counter-based, [`DummyFill`]);
    /// part of the model's fingerprint, so nodes that would make different values from the
    /// same config do not form one cluster.
    pub const FORMULA: u32 = 2;

    pub fn new(seed: u64, tied: bool) -> Self {
        DummyWeights { seed, tied }
    }

    /// Whether a bf16 checkpoint of the config holds tensor `name`: every weight the
    /// loaders ask for, no biases of linear layers (none of the served families has them),
    /// no quantization tensors (dummy weights are bf16), no `lm_head.weight` when tied.
    pub fn has(&self, name: &str) -> bool {
        if name.ends_with(".bias")
            || name.ends_with("weight_scale_inv")
            || name.ends_with("weight_scale")
            || name.ends_with("weight_packed")
            || name.ends_with("weight_shape")
        {
            return false;
        }
        !(self.tied && name == "lm_head.weight")
    }

    /// How the values of tensor `name` of `shape` are made. A GPU makes its experts' values
    /// on the device from this (a Kimi K2 MoE layer is 34 GB of bf16), equal to [`bytes`].
    ///
    /// [`bytes`]: DummyWeights::bytes
    pub fn fill(&self, name: &str, shape: &[usize]) -> DummyFill {
        if shape.len() < 2 {
            return DummyFill::Constant(if name.contains("norm") { 1.0 } else { 0.0 });
        }
        let std = if name.contains("embed_tokens") {
            1.0
        } else {
            (shape[shape.len() - 1] as f32).powf(-0.5)
        };
        DummyFill::Uniform {
            stream: splitmix(self.seed ^ fnv1a(name.as_bytes())),
            // Uniform on [-a, a] has standard deviation a / sqrt(3).
            half_width: std * 3f32.sqrt(),
        }
    }

    /// The bf16 values of tensor `name` of `shape`, little-endian, as a checkpoint stores
    /// them.
    pub fn bytes(&self, name: &str, shape: &[usize]) -> Vec<u8> {
        let count: usize = shape.iter().product();
        let fill = self.fill(name, shape);
        let mut out = vec![0u8; count * 2];
        out.par_chunks_mut(CHUNK * 2)
            .enumerate()
            .for_each(|(chunk, bytes)| {
                let first = (chunk * CHUNK) as u64;
                for (i, pair) in bytes.chunks_exact_mut(2).enumerate() {
                    pair.copy_from_slice(&fill.value(first + i as u64).to_le_bytes());
                }
            });
        out
    }
}

/// FNV-1a over a tensor name: each tensor its own stream.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn values(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    }

    #[test]
    fn linear_weights_have_the_intended_spread_and_are_reproducible() {
        let dummy = DummyWeights::new(7, false);
        let name = "model.layers.1.mlp.experts.3.up_proj.weight";
        let w = values(&dummy.bytes(name, &[300, 1024]));
        assert_eq!(w.len(), 300 * 1024);
        let mean = w.iter().sum::<f32>() / w.len() as f32;
        let std = (w.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / w.len() as f32).sqrt();
        assert!(mean.abs() < 2e-3, "mean {mean}");
        assert!((std * 32.0 - 1.0).abs() < 0.02, "std {std}, want 1/32");
        assert_eq!(
            dummy.bytes(name, &[300, 1024]),
            dummy.bytes(name, &[300, 1024])
        );
        // Another tensor, or another seed, draws other values.
        let other =
            values(&dummy.bytes("model.layers.1.mlp.experts.4.up_proj.weight", &[300, 1024]));
        assert_ne!(w, other);
        assert_ne!(
            w,
            values(&DummyWeights::new(8, false).bytes(name, &[300, 1024]))
        );
    }

    #[test]
    fn norms_are_one_and_biases_zero() {
        let dummy = DummyWeights::new(1, true);
        let norm = values(&dummy.bytes("model.layers.0.input_layernorm.weight", &[64]));
        assert!(norm.iter().all(|&v| v == 1.0));
        let bias = values(&dummy.bytes("model.layers.1.mlp.gate.e_score_correction_bias", &[8]));
        assert!(bias.iter().all(|&v| v == 0.0));
        assert!(
            !dummy.has("lm_head.weight"),
            "tied: the head is the embedding"
        );
        assert!(!dummy.has("model.layers.0.self_attn.q_proj.bias"));
        assert!(!dummy.has("model.layers.0.self_attn.q_proj.weight_scale_inv"));
        assert!(dummy.has("model.layers.0.self_attn.q_proj.weight"));
        assert!(DummyWeights::new(1, false).has("lm_head.weight"));
    }
}
