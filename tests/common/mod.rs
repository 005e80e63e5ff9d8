//! Inputs and CPU answers shared by the kernel tests (on the CPU emulation and on a GPU).
#![allow(dead_code)]

use moe_node::compute::cpu::softmax_in_place;
use moe_node::compute::cuda::dense::AttentionShape;
use moe_node::compute::cuda::{self, CudaRuntime, EmulatedGpus};
use moe_node::engine::rope::Rope;
use moe_node::model::config::{RopeConfig, RopeScaling};

/// Says that a test did not check what it is for, where the log shows it: a `SKIPPED:`
/// line written to stderr directly, which the test harness does not capture (`eprintln!`
/// is captured, so a skip would read as a plain `ok`).
pub fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}

/// The GPUs the emulated GPU tests get: two, so that the paths between GPUs run too.
pub const TEST_GPUS: EmulatedGpus = EmulatedGpus {
    count: 2,
    bytes: 4 << 30,
};

/// The GPUs the GPU tests run on: the real ones where `MOE_TEST_REQUIRE_GPU` is set
/// (`tests/gpu/run.sh` on a GPU machine), else [`TEST_GPUS`] emulated on the CPU, which
/// needs g++. Without g++ the test says it skipped `what`, unless `MOE_TEST_REQUIRE_GXX` is
/// set (CI sets it): then that is a failure.
pub fn gpus(what: &str) -> Option<&'static CudaRuntime> {
    if std::env::var_os("MOE_TEST_REQUIRE_GPU").is_some() {
        return Some(
            cuda::runtime(None).unwrap_or_else(|e| panic!("MOE_TEST_REQUIRE_GPU is set: {e}")),
        );
    }
    match cuda::emulated_runtime(TEST_GPUS) {
        Ok(runtime) => Some(runtime),
        Err(e) if std::env::var_os("MOE_TEST_REQUIRE_GXX").is_some() => {
            panic!("MOE_TEST_REQUIRE_GXX is set, but GPUs could not be emulated: {e}")
        }
        Err(e) => {
            skipped(&format!("{what} not checked: {e}"));
            None
        }
    }
}

/// The engine of fixture `fixture` (under `tests/fixtures/`) with its dense part and experts
/// on GPU 0 (emulated where there is no GPU); `None`, said as a skip, where GPUs cannot be
/// had.
pub fn engine_on_gpu(what: &str, fixture: &str) -> Option<moe_node::engine::Engine> {
    gpus(what)?;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(fixture);
    let source = moe_node::model::ModelSource::files(&dir);
    Some(moe_node::engine::gpu::engine_on_gpu(&source, 0, true, None, None).unwrap())
}

/// Reproducible values in [-1, 1), with some exact repeats (ties for top-k).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let v = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            // Every 7th value repeats its predecessor's bucket: quantised, so ties happen.
            if i % 7 == 0 {
                (v * 8.0).round() / 8.0
            } else {
                v
            }
        })
        .collect()
}

/// Kimi K2's rotary scaling.
pub fn yarn() -> RopeScaling {
    RopeScaling::Yarn {
        factor: 40.0,
        original_max_position_embeddings: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: Some(1.0),
        mscale_all_dim: Some(1.0),
        attention_factor: None,
        truncate: true,
    }
}

/// MLA-like heads (16 values without rotation, then 8 rotated) at three positions, with the
/// host's cos/sin tables.
pub struct RopeCase {
    pub rope: Rope,
    pub rows: usize,
    pub heads: usize,
    pub head_width: usize,
    pub offset: usize,
    pub rope_dim: usize,
    pub x: Vec<f32>,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    angles: Vec<moe_node::engine::rope::RopeAngles>,
}

impl RopeCase {
    pub fn new(interleaved: bool, scaling: RopeScaling) -> RopeCase {
        let (rows, heads, head_width, offset, rope_dim) = (3, 2, 24, 16, 8);
        let rope = Rope::new(
            &RopeConfig {
                theta: 10000.0,
                dim: rope_dim,
                scaling,
            },
            interleaved,
        );
        let angles: Vec<_> = [0usize, 7, 4000].iter().map(|&p| rope.angles(p)).collect();
        RopeCase {
            x: values(rows * heads * head_width, 51),
            cos: angles.iter().flat_map(|a| a.cos.clone()).collect(),
            sin: angles.iter().flat_map(|a| a.sin.clone()).collect(),
            rope,
            rows,
            heads,
            head_width,
            offset,
            rope_dim,
            angles,
        }
    }

    /// `x` rotated by the engine's own `Rope::apply`.
    pub fn expected(&self) -> Vec<f32> {
        let mut out = self.x.clone();
        for (row, a) in out
            .chunks_exact_mut(self.heads * self.head_width)
            .zip(&self.angles)
        {
            for head in row.chunks_exact_mut(self.head_width) {
                self.rope
                    .apply(&mut head[self.offset..self.offset + self.rope_dim], a);
            }
        }
        out
    }
}

/// Query rows over per-sequence caches: a sequence longer than the kernel's tile of 256
/// positions (a decode row at its end) and a short one (a 3-row prefill chunk). GQA: 4 query
/// heads over 2 kv heads of 16. MLA (absorbed): 4 heads over one latent of 16 plus a rotary
/// key of 8; the value is the latent.
/// Sequences' caches paged as a GPU keeps them (see `kernels/dense.cu`, `cached_row`).
pub struct Paged {
    /// `[blocks, KV_BLOCK, stride]` f32; rows no sequence holds are 1e30 (read by mistake,
    /// they would swamp the result).
    pub pool: Vec<f32>,
    /// `[seqs, table_stride]` block ids.
    pub table: Vec<i32>,
    pub table_stride: usize,
    pub blocks: usize,
}

/// `caches` (each `[positions, stride]` f32) paged into blocks of `KV_BLOCK` positions, the
/// blocks handed out last to first and the sequences interleaved, so that only reading
/// through the table finds each position.
pub fn paged(caches: &[Vec<f32>], stride: usize) -> Paged {
    use moe_node::compute::cuda::dense::KV_BLOCK;
    let counts: Vec<usize> = caches
        .iter()
        .map(|c| (c.len() / stride).div_ceil(KV_BLOCK))
        .collect();
    let blocks: usize = counts.iter().sum();
    let table_stride = counts.iter().copied().max().unwrap_or(1).max(1);
    let mut table = vec![0i32; caches.len() * table_stride];
    let mut pool = vec![1e30f32; blocks * KV_BLOCK * stride];
    let mut next = blocks;
    for b in 0..table_stride {
        for (s, cache) in caches.iter().enumerate() {
            if b >= counts[s] {
                continue;
            }
            next -= 1;
            table[s * table_stride + b] = next as i32;
            let from = &cache[b * KV_BLOCK * stride..];
            let from = &from[..from.len().min(KV_BLOCK * stride)];
            pool[next * KV_BLOCK * stride..][..from.len()].copy_from_slice(from);
        }
    }
    Paged {
        pool,
        table,
        table_stride,
        blocks,
    }
}

/// `v` rounded to the nearest bf16: a value a GPU's KV cache (bf16) holds exactly.
pub fn bf16_exact(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// A case for the attention kernels: cached keys and values (bf16-exact, as the GPU's
/// caches hold them, so that the f32 reference is the kernels' exact target), queries and
/// the rows they are at.
pub struct AttentionCase {
    pub shape: AttentionShape,
    pub keys: Vec<Vec<f32>>,
    /// Equal to `keys` for MLA.
    pub values: Vec<Vec<f32>>,
    /// (sequence, position) of each query row.
    pub rows: Vec<(usize, usize)>,
    pub q: Vec<f32>,
}

impl AttentionCase {
    pub fn new(mla: bool, window: usize) -> AttentionCase {
        let (heads, group, key_width, value_width, kv_stride, key_head_stride, value_head_stride) =
            if mla {
                (4, 4, 24, 16, 24, 0, 0)
            } else {
                (4, 2, 16, 16, 32, 16, 16)
            };
        let shape = AttentionShape {
            heads,
            group,
            key_width,
            value_width,
            kv_stride,
            key_head_stride,
            value_head_stride,
            window: (window > 0).then_some(window),
            chunk: None,
            scale: (key_width as f32).powf(-0.5),
        };
        let lengths = [300usize, 5];
        // Keys grow along the sequence, so a later tile holds a larger score than the first
        // and the running maximum has to move (the rescaling of earlier sums is exercised).
        let keys: Vec<Vec<f32>> = lengths
            .iter()
            .enumerate()
            .map(|(s, &n)| {
                let mut k = values(n * kv_stride, 60 + s as u64);
                for (j, position) in k.chunks_exact_mut(kv_stride).enumerate() {
                    position
                        .iter_mut()
                        .for_each(|v| *v = bf16_exact(*v * (1.0 + j as f32 / 100.0)));
                }
                k
            })
            .collect();
        let values_ = if mla {
            keys.clone()
        } else {
            lengths
                .iter()
                .enumerate()
                .map(|(s, &n)| {
                    values(n * kv_stride, 70 + s as u64)
                        .into_iter()
                        .map(bf16_exact)
                        .collect()
                })
                .collect()
        };
        let rows = vec![(0usize, 299usize), (1, 2), (1, 3), (1, 4)];
        let q = values(rows.len() * heads * key_width, 80)
            .iter()
            .map(|v| v * 2.0)
            .collect();
        AttentionCase {
            shape,
            keys,
            values: values_,
            rows,
            q,
        }
    }

    /// As the engine's `attend` computes it: softmax of scaled dot products over the
    /// positions seen, then the weighted values.
    pub fn expected(&self) -> Vec<f32> {
        let c = &self.shape;
        let (dk, dv) = (c.key_width, c.value_width);
        let mut out = Vec::new();
        for (r, &(seq, pos)) in self.rows.iter().enumerate() {
            for head in 0..c.heads {
                let query = &self.q[(r * c.heads + head) * dk..][..dk];
                let kv = head / c.group;
                let first = match (c.window, c.chunk) {
                    (_, Some(chunk)) => pos - pos % chunk,
                    (Some(w), None) => (pos + 1).saturating_sub(w),
                    (None, None) => 0,
                };
                let mut scores: Vec<f32> = (first..=pos)
                    .map(|j| {
                        let key = &self.keys[seq][j * c.kv_stride + kv * c.key_head_stride..][..dk];
                        query.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() * c.scale
                    })
                    .collect();
                softmax_in_place(&mut scores);
                let mut o = vec![0f32; dv];
                for (w, j) in scores.iter().zip(first..=pos) {
                    let value =
                        &self.values[seq][j * c.kv_stride + kv * c.value_head_stride..][..dv];
                    for (acc, v) in o.iter_mut().zip(value) {
                        *acc += w * v;
                    }
                }
                out.extend(o);
            }
        }
        out
    }
}

/// Every value within `tolerance` of the expected one (relative above magnitude 1).
pub fn assert_close(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tolerance * w.abs().max(1.0),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}
