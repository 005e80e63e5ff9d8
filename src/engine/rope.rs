//! Rotary position embeddings: plain, linear-scaled and YaRN, laid out as rotate-half or as
//! DeepSeek's interleaved pairs.

use crate::model::config::{RopeConfig, RopeScaling};

#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// YaRN's magnitude correction, applied to cos and sin.
    attention_scaling: f32,
    /// Pairs are `(x[2i], x[2i+1])` (DeepSeek) rather than `(x[i], x[i + d/2])`.
    interleaved: bool,
}

pub use crate::compute::layout::RopeAngles;

impl Rope {
    pub fn new(cfg: &RopeConfig, interleaved: bool) -> Self {
        let dim = cfg.dim;
        let base = cfg.theta;
        let pos_freqs: Vec<f64> = (0..dim / 2)
            .map(|i| base.powf((2 * i) as f64 / dim as f64))
            .collect();
        let (inv_freq, attention_scaling): (Vec<f64>, f64) = match &cfg.scaling {
            RopeScaling::None => (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0),
            RopeScaling::Linear { factor } => {
                (pos_freqs.iter().map(|p| 1.0 / (p * factor)).collect(), 1.0)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let original = *original_max_position_embeddings as f64;
                let low_freq_wavelen = original / low_freq_factor;
                let high_freq_wavelen = original / high_freq_factor;
                let inv_freq = pos_freqs
                    .iter()
                    .map(|p| {
                        let inv = 1.0 / p;
                        let wavelen = 2.0 * std::f64::consts::PI / inv;
                        if wavelen > low_freq_wavelen {
                            inv / factor
                        } else if wavelen < high_freq_wavelen || high_freq_factor == low_freq_factor
                        {
                            inv
                        } else {
                            let smooth = (original / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * inv / factor + smooth * inv
                        }
                    })
                    .collect();
                (inv_freq, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let attention_factor = attention_factor.unwrap_or(match (mscale, mscale_all_dim) {
                    (Some(m), Some(m_all)) if *m != 0.0 && *m_all != 0.0 => {
                        yarn_mscale(*factor, *m) / yarn_mscale(*factor, *m_all)
                    }
                    _ => yarn_mscale(*factor, 1.0),
                });
                let correction_dim = |rotations: f64| {
                    dim as f64
                        * ((*original_max_position_embeddings as f64)
                            / (rotations * 2.0 * std::f64::consts::PI))
                            .ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim as f64 - 1.0);
                if low == high {
                    high += 0.001;
                }
                let inv_freq = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (1.0 / (factor * p)) * (1.0 - extrapolation) + (1.0 / p) * extrapolation
                    })
                    .collect();
                (inv_freq, attention_factor)
            }
        };
        Rope {
            inv_freq: inv_freq.into_iter().map(|f| f as f32).collect(),
            attention_scaling: attention_scaling as f32,
            interleaved,
        }
    }

    /// Rotated values per head: all of a GQA head, or its first part where the family
    /// rotates only part of it (GLM-4.5's `partial_rotary_factor`).
    pub fn dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// Whether pairs are DeepSeek's interleaved ones.
    pub fn interleaved(&self) -> bool {
        self.interleaved
    }

    /// The same rotation over other pairs: DeepSeek-V3.2's indexer turns halves where its
    /// MLA turns interleaved pairs.
    pub fn paired(&self, interleaved: bool) -> Rope {
        Rope {
            interleaved,
            ..self.clone()
        }
    }

    pub fn angles(&self, position: usize) -> RopeAngles {
        let (cos, sin) = self
            .inv_freq
            .iter()
            .map(|f| {
                let angle = position as f32 * f;
                (
                    angle.cos() * self.attention_scaling,
                    angle.sin() * self.attention_scaling,
                )
            })
            .unzip();
        RopeAngles { cos, sin }
    }

    /// Rotates one head's rotary part in place. The interleaved layout is written back in
    /// rotate-half order (evens then odds), as transformers does; queries and keys get the
    /// same permutation, so their dot products are unchanged.
    pub fn apply(&self, x: &mut [f32], angles: &RopeAngles) {
        let half = x.len() / 2;
        if self.interleaved {
            let pairs: Vec<(f32, f32)> = (0..half).map(|i| (x[2 * i], x[2 * i + 1])).collect();
            for (i, (a, b)) in pairs.into_iter().enumerate() {
                let (c, s) = (angles.cos[i], angles.sin[i]);
                x[i] = a * c - b * s;
                x[i + half] = b * c + a * s;
            }
        } else {
            for i in 0..half {
                let (a, b) = (x[i], x[i + half]);
                let (c, s) = (angles.cos[i], angles.sin[i]);
                x[i] = a * c - b * s;
                x[i + half] = b * c + a * s;
            }
        }
    }
}

/// YaRN's `get_mscale`: `0.1 * mscale * ln(scale) + 1` above scale 1.
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(dim: usize) -> RopeConfig {
        RopeConfig {
            theta: 10000.0,
            dim,
            scaling: RopeScaling::None,
        }
    }

    #[test]
    fn position_zero_is_identity() {
        let rope = Rope::new(&plain(4), false);
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        rope.apply(&mut x, &rope.angles(0));
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn first_pair_rotates_by_position_radians() {
        let rope = Rope::new(&plain(2), false);
        let mut x = vec![1.0, 0.0];
        rope.apply(&mut x, &rope.angles(1));
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn interleaved_pairs_adjacent_elements() {
        let rope = Rope::new(&plain(4), true);
        // (x0, x1) is the first pair; after rotation it lands at indices 0 and 2.
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        rope.apply(&mut x, &rope.angles(1));
        assert!((x[0] - 1f32.cos()).abs() < 1e-6);
        assert!((x[2] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn yarn_keeps_high_frequencies_and_scales_low_ones() {
        let cfg = RopeConfig {
            theta: 10000.0,
            dim: 64,
            scaling: RopeScaling::Yarn {
                factor: 40.0,
                original_max_position_embeddings: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: Some(1.0),
                mscale_all_dim: Some(1.0),
                attention_factor: None,
                truncate: true,
            },
        };
        let yarn = Rope::new(&cfg, true);
        let base = Rope::new(&plain(64), true);
        assert_eq!(yarn.inv_freq[0], base.inv_freq[0]);
        let last = base.inv_freq.len() - 1;
        assert!((yarn.inv_freq[last] - base.inv_freq[last] / 40.0).abs() < 1e-12);
        assert_eq!(yarn.attention_scaling, 1.0);
    }
}
