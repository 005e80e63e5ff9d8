//! Attention of one layer on the GPU: GQA, and MLA in its absorbed form (the cache holds
//! `[latent | rotary key]` per position; queries are absorbed into the latent space and the
//! attended latents expanded per head with strided-batched products).

use super::cache::Scratch;
use super::weights::{Attention, Query};
use super::{GpuModel, Step, StepResult};
use crate::compute::cuda::CudaError;
use crate::compute::cuda::blas::{self, Batch, Gemm, Output};
use crate::compute::cuda::dense::AttentionShape;
use crate::model::config::AttentionConfig;

impl GpuModel {
    /// Attention of layer `l` over bf16 normalised rows `x`; returns f32 `[rows, H]` and
    /// appends the rows' keys to the caches.
    pub(super) fn attention(
        &self,
        l: usize,
        attention: &Attention,
        step: &Step,
        scratch: &mut Scratch,
        x: u64,
    ) -> Result<u64, CudaError> {
        let stream = &self.stream;
        let rows = step.rows;
        let heads = self.config.num_heads;
        let h = self.config.hidden_size;
        match (attention, &self.config.attention) {
            (
                Attention::Gqa {
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                },
                &AttentionConfig::Gqa {
                    num_kv_heads,
                    head_dim,
                    sliding_window,
                    ..
                },
            ) => {
                let kv_width = num_kv_heads * head_dim;
                let queries = scratch.f32(rows * heads * head_dim)?;
                let keys = scratch.f32(rows * kv_width)?;
                let values = scratch.f32(rows * kv_width)?;
                self.linear(q, x, rows, queries, Output::F32)?;
                self.linear(k, x, rows, keys, Output::F32)?;
                self.linear(v, x, rows, values, Output::F32)?;
                if let Some(n) = q_norm {
                    self.norm(n, queries, rows * heads, head_dim, queries)?;
                }
                if let Some(n) = k_norm {
                    self.norm(n, keys, rows * num_kv_heads, head_dim, keys)?;
                }
                let out = scratch.f32(rows * heads * head_dim)?;
                // SAFETY: buffers sized above from the same shapes; the block tables name
                // a block for every row's position (reserved by `forward`).
                unsafe {
                    self.rotate(step, queries, heads, head_dim, 0)?;
                    self.rotate(step, keys, num_kv_heads, head_dim, 0)?;
                    let cache = step.cache(l);
                    let d = &self.dense;
                    d.store_rows(
                        stream,
                        keys,
                        rows,
                        kv_width,
                        cache.keys,
                        &cache.table,
                        step.row_seq,
                        step.row_pos,
                    )?;
                    d.store_rows(
                        stream,
                        values,
                        rows,
                        kv_width,
                        cache.values,
                        &cache.table,
                        step.row_seq,
                        step.row_pos,
                    )?;
                    let shape = AttentionShape {
                        heads,
                        group: heads / num_kv_heads,
                        key_width: head_dim,
                        value_width: head_dim,
                        kv_stride: kv_width,
                        key_head_stride: head_dim,
                        value_head_stride: head_dim,
                        window: sliding_window,
                        scale: self.softmax_scale,
                    };
                    d.attend(
                        stream,
                        &shape,
                        queries,
                        rows,
                        &cache,
                        step.row_seq,
                        step.row_pos,
                        out,
                    )?;
                }
                let ob = self.bf16_of(scratch, out, rows * heads * head_dim)?;
                let y = scratch.f32(rows * h)?;
                self.linear(o, ob, rows, y, Output::F32)?;
                Ok(y)
            }
            (
                Attention::Mla {
                    q,
                    kv_down,
                    kv_norm,
                    kv_up,
                    o,
                },
                &AttentionConfig::Mla {
                    kv_lora_rank: lora,
                    qk_nope_head_dim: nope,
                    qk_rope_head_dim: rope,
                    v_head_dim,
                    ..
                },
            ) => {
                let q_width = nope + rope;
                let queries = scratch.f32(rows * heads * q_width)?;
                match q {
                    Query::Direct(p) => self.linear(p, x, rows, queries, Output::F32)?,
                    Query::LowRank { down, norm, up } => {
                        let low = scratch.f32(rows * down.out)?;
                        self.linear(down, x, rows, low, Output::F32)?;
                        self.norm(norm, low, rows, down.out, low)?;
                        let lb = self.bf16_of(scratch, low, rows * down.out)?;
                        self.linear(up, lb, rows, queries, Output::F32)?;
                    }
                }
                let key_width = lora + rope;
                let compressed = scratch.f32(rows * key_width)?;
                self.linear(kv_down, x, rows, compressed, Output::F32)?;
                let d = &self.dense;
                // SAFETY: buffers sized above; the block tables name a block for every row's
                // position (reserved by `forward`).
                unsafe {
                    self.rotate(step, queries, heads, q_width, nope)?;
                    d.rms_norm(
                        stream,
                        compressed,
                        rows,
                        key_width,
                        lora,
                        kv_norm.weight.ptr,
                        kv_norm.eps,
                        compressed,
                    )?;
                    self.rotate(step, compressed, 1, key_width, lora)?;
                    let cache = step.cache(l);
                    d.store_rows(
                        stream,
                        compressed,
                        rows,
                        key_width,
                        cache.keys,
                        &cache.table,
                        step.row_seq,
                        step.row_pos,
                    )?;
                }
                // The attention query per head: [q_nope · W_uk (lora) | q_rope (rope)].
                let qb = self.bf16_of(scratch, queries, rows * heads * q_width)?;
                let query = scratch.f32(rows * heads * key_width)?;
                let mla = MlaShape {
                    heads,
                    nope,
                    rope,
                    lora,
                    v: v_head_dim,
                };
                let (absorb, per_head) = mla.absorb(rows);
                let latent_out = scratch.f32(rows * heads * lora)?;
                // SAFETY: per head, A = rows [h·up_rows, h·up_rows + nope) of kv_up
                // ([nope, lora] row-major = lora × nope column-major), B = the head's nope
                // values of each row, C = the first lora values of the head's query.
                unsafe {
                    blas::gemm_batched(
                        &self.blas,
                        absorb,
                        per_head,
                        kv_up.ptr,
                        qb,
                        query,
                        Output::F32,
                    )?;
                    d.copy_rows(
                        stream,
                        queries + (nope * 4) as u64,
                        q_width,
                        query + (lora * 4) as u64,
                        key_width,
                        rows * heads,
                        rope,
                    )?;
                    let cache = step.cache(l);
                    let shape = AttentionShape {
                        heads,
                        group: heads,
                        key_width,
                        value_width: lora,
                        kv_stride: key_width,
                        key_head_stride: 0,
                        value_head_stride: 0,
                        window: None,
                        scale: self.softmax_scale,
                    };
                    d.attend(
                        stream,
                        &shape,
                        query,
                        rows,
                        &cache,
                        step.row_seq,
                        step.row_pos,
                        latent_out,
                    )?;
                }
                // Expand the attended latents through kv_b's value half, head by head.
                let lb = self.bf16_of(scratch, latent_out, rows * heads * lora)?;
                let values = scratch.bf16(rows * heads * v_head_dim)?;
                let (expand, per_head) = mla.expand(rows);
                // SAFETY: per head, A = rows [h·up_rows + nope, (h+1)·up_rows) of kv_up
                // ([v, lora] row-major, transposed), B = the head's latent, C = its values.
                unsafe {
                    blas::gemm_batched(
                        &self.blas,
                        expand,
                        per_head,
                        kv_up.ptr + (mla.value_offset() * 2) as u64,
                        lb,
                        values,
                        Output::Bf16,
                    )?;
                }
                let y = scratch.f32(rows * h)?;
                self.linear(o, values, rows, y, Output::F32)?;
                Ok(y)
            }
            _ => Err(CudaError::Unsupported(
                "attention weights of another kind than the config".into(),
            )),
        }
    }

    /// Rotary embedding of `rope_dim` values at `offset` of every head.
    ///
    /// # Safety
    /// `x`: `[rows, heads, head_width]` f32.
    unsafe fn rotate(
        &self,
        step: &Step,
        x: u64,
        heads: usize,
        head_width: usize,
        offset: usize,
    ) -> StepResult {
        // SAFETY: as the caller vouches; the tables hold `[rows, rope_dim / 2]`.
        unsafe {
            self.dense.rope(
                &self.stream,
                x,
                step.rows,
                heads,
                head_width,
                offset,
                step.rope_dim,
                step.cos,
                step.sin,
                self.interleaved,
            )
        }
    }
}

/// MLA's per-head products in cuBLAS's column-major terms. `kv_up` is `[heads · (nope + v),
/// lora]` row-major: for head h, rows `h·(nope+v) ..+ nope` are its key block W_uk (`[nope,
/// lora]`), the next `v` its value block W_uv (`[v, lora]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MlaShape {
    heads: usize,
    nope: usize,
    rope: usize,
    lora: usize,
    v: usize,
}

impl MlaShape {
    /// Elements from the start of `kv_up` to the first value block.
    fn value_offset(&self) -> usize {
        self.nope * self.lora
    }

    /// Query absorption, per head: `query[r, h, ..lora] = q[r, h, ..nope] · W_uk` — A is
    /// W_uk (lora × nope column-major), B the head's non-rotary queries in `[rows, heads,
    /// nope + rope]`, C the first `lora` of each head's slot in `[rows, heads, lora + rope]`.
    fn absorb(&self, rows: usize) -> (Gemm, Batch) {
        let q_width = self.nope + self.rope;
        let key_width = self.lora + self.rope;
        let gemm = Gemm {
            a_transposed: false,
            m: self.lora,
            n: rows,
            k: self.nope,
            lda: self.lora,
            ldb: self.heads * q_width,
            ldc: self.heads * key_width,
        };
        let batch = Batch {
            count: self.heads,
            stride_a: (self.nope + self.v) * self.lora,
            stride_b: q_width,
            stride_c: key_width,
        };
        (gemm, batch)
    }

    /// Value expansion, per head: `out[r, h, ..] = latent[r, h, ..] · W_uvᵀ` — A is W_uv
    /// transposed (from [`MlaShape::value_offset`]), B the attended latents `[rows, heads,
    /// lora]`, C `[rows, heads, v]`.
    fn expand(&self, rows: usize) -> (Gemm, Batch) {
        let gemm = Gemm {
            a_transposed: true,
            m: self.v,
            n: rows,
            k: self.lora,
            lda: self.lora,
            ldb: self.heads * self.lora,
            ldc: self.heads * self.v,
        };
        let batch = Batch {
            count: self.heads,
            stride_a: (self.nope + self.v) * self.lora,
            stride_b: self.lora,
            stride_c: self.v,
        };
        (gemm, batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::cuda::blas::host_gemm;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i + seed) * 7919 % 1009) as f32 / 504.5 - 1.0)
            .collect()
    }

    const MLA: MlaShape = MlaShape {
        heads: 3,
        nope: 4,
        rope: 2,
        lora: 5,
        v: 6,
    };

    #[test]
    fn absorption_puts_each_heads_latent_query_before_its_rotary_slot() {
        let MlaShape {
            heads,
            nope,
            rope,
            lora,
            v,
        } = MLA;
        let rows = 2;
        let kv_up = values(heads * (nope + v) * lora, 1);
        let q = values(rows * heads * (nope + rope), 2);
        let untouched = 9.0;
        let mut query = vec![untouched; rows * heads * (lora + rope)];
        let (gemm, batch) = MLA.absorb(rows);
        host_gemm(gemm, batch, &kv_up, &q, &mut query);
        for r in 0..rows {
            for h in 0..heads {
                for i in 0..lora {
                    let want: f32 = (0..nope)
                        .map(|j| {
                            q[(r * heads + h) * (nope + rope) + j]
                                * kv_up[(h * (nope + v) + j) * lora + i]
                        })
                        .sum();
                    let got = query[(r * heads + h) * (lora + rope) + i];
                    assert!((got - want).abs() < 1e-5, "row {r} head {h} [{i}]");
                }
                for i in lora..lora + rope {
                    assert_eq!(query[(r * heads + h) * (lora + rope) + i], untouched);
                }
            }
        }
    }

    #[test]
    fn expansion_applies_each_heads_value_block() {
        let MlaShape {
            heads,
            nope,
            lora,
            v,
            ..
        } = MLA;
        let rows = 2;
        let kv_up = values(heads * (nope + v) * lora, 3);
        let latent = values(rows * heads * lora, 4);
        let mut out = vec![0.0; rows * heads * v];
        let (gemm, batch) = MLA.expand(rows);
        host_gemm(gemm, batch, &kv_up[MLA.value_offset()..], &latent, &mut out);
        for r in 0..rows {
            for h in 0..heads {
                for o in 0..v {
                    let want: f32 = (0..lora)
                        .map(|i| {
                            latent[(r * heads + h) * lora + i]
                                * kv_up[(h * (nope + v) + nope + o) * lora + i]
                        })
                        .sum();
                    let got = out[(r * heads + h) * v + o];
                    assert!((got - want).abs() < 1e-5, "row {r} head {h} [{o}]");
                }
            }
        }
    }
}
