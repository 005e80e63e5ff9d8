//! Attention of one layer on the GPU: GQA, and MLA in its absorbed form (the cache holds
//! `[latent | rotary key]` per position; queries are absorbed into the latent space and the
//! attended latents expanded per head with strided-batched products).

use super::cache::Scratch;
use super::weights::{Attention, Matrix, Norm, Query};
use super::{GpuModel, Step, StepResult};
use crate::compute::cuda::CudaError;
use crate::compute::cuda::blas::{self, Batch, Gemm, Output};
use crate::compute::cuda::dense::{AttentionShape, heads_per_block};
use crate::compute::cuda::experts::Buffer;
use crate::model::config::{AttentionConfig, LayerAttention, Span};

/// One GQA layer's projections and shape, as [`GpuModel::attention`] matched them.
struct GqaLayer<'a> {
    q: &'a Matrix,
    k: &'a Matrix,
    v: &'a Matrix,
    o: &'a Matrix,
    q_norm: &'a Option<Norm>,
    k_norm: &'a Option<Norm>,
    kv_heads: usize,
    head_dim: usize,
    /// What this layer does where layers differ (rope or not, the span seen, Llama 4's
    /// weightless q/k norm and temperature).
    this: LayerAttention,
    /// Each head's output times the sigmoid of a gate projected with its query.
    output_gate: bool,
    /// A sink logit per head (gpt-oss).
    sinks: Option<&'a Buffer>,
    /// The widths the q and k norms take at a time: a head's, or (MiniMax-M2's
    /// `qk_norm_type: per_layer`) all of a row's heads.
    norm_widths: (usize, usize),
}

/// One MLA layer's projections and shape, as [`GpuModel::attention`] matched them.
struct MlaLayer<'a> {
    q: &'a Query,
    kv_down: &'a Matrix,
    kv_norm: &'a Norm,
    /// `kv_b_proj`, used per head (see [`MlaShape`]).
    kv_up: &'a Buffer,
    o: &'a Matrix,
    shape: MlaShape,
}

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
        match (attention, &self.config.attention) {
            (
                Attention::Gqa {
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                    sinks,
                },
                AttentionConfig::Gqa {
                    num_kv_heads,
                    head_dim,
                    sliding_window,
                    output_gate,
                    qk_norm,
                    layers,
                    ..
                },
            ) => {
                let (heads, num_kv_heads, head_dim) =
                    (self.config.num_heads, *num_kv_heads, *head_dim);
                // As the CPU's GQA reads it (`engine/attention.rs`).
                let this = layers.get(l).copied().unwrap_or(LayerAttention {
                    rope: true,
                    span: sliding_window.map_or(Span::Full, Span::Window),
                    unit_qk_norm: false,
                    temperature: None,
                });
                let layer = GqaLayer {
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                    kv_heads: num_kv_heads,
                    head_dim,
                    this,
                    output_gate: *output_gate,
                    sinks: sinks.as_ref(),
                    norm_widths: qk_norm
                        .widths(heads, num_kv_heads, head_dim)
                        .unwrap_or((head_dim, head_dim)),
                };
                self.gqa_attention(l, &layer, step, scratch, x)
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
                let layer = MlaLayer {
                    q,
                    kv_down,
                    kv_norm,
                    kv_up,
                    o,
                    shape: MlaShape {
                        heads: self.config.num_heads,
                        nope,
                        rope,
                        lora,
                        v: v_head_dim,
                    },
                };
                self.mla_attention(l, &layer, step, scratch, x)
            }
            (Attention::Linear(layer), _) => self.linear_attention(l, layer, step, scratch, x),
            _ => Err(CudaError::Unsupported(
                "attention weights of another kind than the config".into(),
            )),
        }
    }

    /// GQA: projections (and their norms), rotary embedding, the rows' keys and values
    /// stored in the cache, attention over it, the output projection.
    fn gqa_attention(
        &self,
        l: usize,
        layer: &GqaLayer,
        step: &Step,
        scratch: &mut Scratch,
        x: u64,
    ) -> Result<u64, CudaError> {
        let stream = &self.stream;
        let rows = step.rows;
        let heads = self.config.num_heads;
        let (kv_heads, head_dim) = (layer.kv_heads, layer.head_dim);
        let kv_width = kv_heads * head_dim;
        let queries = scratch.f32(rows * heads * head_dim)?;
        let keys = scratch.f32(rows * kv_width)?;
        let values = scratch.f32(rows * kv_width)?;
        let gate = match layer.output_gate {
            // Each head's query, then its gate: split into two packed arrays.
            true => {
                let both = scratch.f32(rows * heads * 2 * head_dim)?;
                let gate = scratch.f32(rows * heads * head_dim)?;
                self.linear(layer.q, x, rows, both, Output::F32)?;
                // SAFETY: `both`: `[rows * heads, 2 * head_dim]` f32; `queries`, `gate`:
                // `[rows * heads, head_dim]`.
                unsafe {
                    for (from, to) in [(both, queries), (both + 4 * head_dim as u64, gate)] {
                        self.dense.copy_rows(
                            stream,
                            from,
                            2 * head_dim,
                            to,
                            head_dim,
                            rows * heads,
                            head_dim,
                        )?;
                    }
                }
                Some(gate)
            }
            false => {
                self.linear(layer.q, x, rows, queries, Output::F32)?;
                None
            }
        };
        self.linear(layer.k, x, rows, keys, Output::F32)?;
        self.linear(layer.v, x, rows, values, Output::F32)?;
        let (q_width, k_width) = layer.norm_widths;
        if let Some(n) = layer.q_norm {
            self.norm(
                n,
                queries,
                rows * heads * head_dim / q_width,
                q_width,
                queries,
            )?;
        }
        if let Some(n) = layer.k_norm {
            self.norm(n, keys, rows * kv_width / k_width, k_width, keys)?;
        }
        let out = scratch.f32(rows * heads * head_dim)?;
        // SAFETY: buffers sized above from the same shapes; the block tables name
        // a block for every row's position (reserved by `forward`).
        unsafe {
            self.turn_queries_and_keys(layer, step, queries, keys)?;
            let cache = step.cache(l);
            let d = &self.dense;
            for (rows_in, to) in [(keys, cache.keys), (values, cache.values)] {
                d.store_rows(
                    stream,
                    rows_in,
                    rows,
                    kv_width,
                    to,
                    &cache.table,
                    step.row_seq,
                    step.row_pos,
                )?;
            }
            let shape = AttentionShape {
                heads,
                group: heads / kv_heads,
                key_width: head_dim,
                value_width: head_dim,
                kv_stride: kv_width,
                key_head_stride: head_dim,
                value_head_stride: head_dim,
                window: match layer.this.span {
                    Span::Window(n) => Some(n),
                    _ => None,
                },
                chunk: match layer.this.span {
                    Span::Chunk(n) => Some(n),
                    _ => None,
                },
                scale: self.softmax_scale,
            };
            d.attend(
                stream,
                &shape,
                queries,
                (rows, step.tiles.as_ref()),
                &cache,
                (step.row_seq, step.row_pos),
                layer.sinks.map_or(0, |s| s.ptr),
                out,
            )?;
        }
        if let Some(gate) = gate {
            // SAFETY: both `[rows, heads, head_dim]` f32.
            unsafe {
                self.dense
                    .sigmoid_gate(stream, out, gate, rows * heads * head_dim)?
            };
        }
        let ob = self.bf16_of(scratch, out, rows * heads * head_dim)?;
        let y = scratch.f32(rows * self.config.hidden_size)?;
        self.linear(layer.o, ob, rows, y, Output::F32)?;
        Ok(y)
    }

    /// Rope over the queries and keys where the layer turns them, then Llama 4's weightless
    /// RMSNorm of each head and its temperature on the queries where the layer has them.
    ///
    /// # Safety
    /// `queries`: `[rows, heads, head_dim]` f32, `keys`: `[rows, kv_heads, head_dim]` f32.
    unsafe fn turn_queries_and_keys(
        &self,
        layer: &GqaLayer,
        step: &Step,
        queries: u64,
        keys: u64,
    ) -> StepResult {
        let (heads, kv_heads, head_dim) = (self.config.num_heads, layer.kv_heads, layer.head_dim);
        let rows = step.rows;
        // SAFETY: as the caller vouches.
        unsafe {
            if layer.this.rope {
                self.rotate(step, queries, heads, head_dim, 0)?;
                self.rotate(step, keys, kv_heads, head_dim, 0)?;
            }
            if layer.this.unit_qk_norm {
                let ones = self.unit_norm.as_ref().ok_or_else(|| {
                    CudaError::Unsupported("a weightless q/k norm without its weight".into())
                })?;
                self.norm(ones, queries, rows * heads, head_dim, queries)?;
                self.norm(ones, keys, rows * kv_heads, head_dim, keys)?;
            }
            if let Some(t) = layer.this.temperature {
                self.dense.scale_by_temperature(
                    &self.stream,
                    queries,
                    step.row_pos,
                    rows,
                    heads * head_dim,
                    (t.floor_scale, t.attn_scale),
                )?;
            }
        }
        Ok(())
    }

    /// MLA in its absorbed form: the queries and the rows' compressed keys (stored in the
    /// cache), attention in the latent space, the attended latents expanded per head, the
    /// output projection.
    fn mla_attention(
        &self,
        l: usize,
        layer: &MlaLayer,
        step: &Step,
        scratch: &mut Scratch,
        x: u64,
    ) -> Result<u64, CudaError> {
        let rows = step.rows;
        let queries = self.mla_queries(layer, rows, scratch, x)?;
        self.mla_store_keys(l, layer, step, scratch, x, queries)?;
        let latent_out = self.mla_attend(l, layer, step, scratch, queries)?;
        // Expand the attended latents through kv_b's value half, head by head.
        let MlaShape { heads, lora, v, .. } = layer.shape;
        let lb = self.bf16_of(scratch, latent_out, rows * heads * lora)?;
        let values = scratch.bf16(rows * heads * v)?;
        let (expand, per_head) = layer.shape.expand(rows);
        // SAFETY: per head, A = rows [h·up_rows + nope, (h+1)·up_rows) of kv_up
        // ([v, lora] row-major, transposed), B = the head's latent, C = its values.
        unsafe {
            blas::gemm_batched(
                &self.blas,
                expand,
                per_head,
                layer.kv_up.ptr + (layer.shape.value_offset() * 2) as u64,
                lb,
                values,
                Output::Bf16,
            )?;
        }
        let y = scratch.f32(rows * self.config.hidden_size)?;
        self.linear(layer.o, values, rows, y, Output::F32)?;
        Ok(y)
    }

    /// MLA's queries, f32 `[rows, heads, nope + rope]`, not yet rotated: one projection, or
    /// down, norm and up.
    fn mla_queries(
        &self,
        layer: &MlaLayer,
        rows: usize,
        scratch: &mut Scratch,
        x: u64,
    ) -> Result<u64, CudaError> {
        let MlaShape {
            heads, nope, rope, ..
        } = layer.shape;
        let queries = scratch.f32(rows * heads * (nope + rope))?;
        match layer.q {
            Query::Direct(p) => self.linear(p, x, rows, queries, Output::F32)?,
            Query::LowRank { down, norm, up } => {
                let low = scratch.f32(rows * down.out)?;
                self.linear(down, x, rows, low, Output::F32)?;
                self.norm(norm, low, rows, down.out, low)?;
                let lb = self.bf16_of(scratch, low, rows * down.out)?;
                self.linear(up, lb, rows, queries, Output::F32)?;
            }
        }
        Ok(queries)
    }

    /// Rotates the MLA `queries` and stores the rows' compressed keys `[latent | rotary
    /// key]` (normalised latent, rotated key) in layer `l`'s cache.
    fn mla_store_keys(
        &self,
        l: usize,
        layer: &MlaLayer,
        step: &Step,
        scratch: &mut Scratch,
        x: u64,
        queries: u64,
    ) -> StepResult {
        let stream = &self.stream;
        let rows = step.rows;
        let MlaShape {
            heads,
            nope,
            rope,
            lora,
            ..
        } = layer.shape;
        let key_width = lora + rope;
        let compressed = scratch.f32(rows * key_width)?;
        self.linear(layer.kv_down, x, rows, compressed, Output::F32)?;
        let d = &self.dense;
        // SAFETY: buffers sized above; the block tables name a block for every row's
        // position (reserved by `forward`).
        unsafe {
            self.rotate(step, queries, heads, nope + rope, nope)?;
            d.rms_norm(
                stream,
                compressed,
                rows,
                key_width,
                lora,
                layer.kv_norm.weight.ptr,
                layer.kv_norm.eps,
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
            )
        }
    }

    /// MLA attention in the latent space: each head's query absorbed into it (`[q_nope ·
    /// W_uk (lora) | q_rope (rope)]`), attended over layer `l`'s cache; returns the attended
    /// latents, f32 `[rows, heads, lora]`.
    fn mla_attend(
        &self,
        l: usize,
        layer: &MlaLayer,
        step: &Step,
        scratch: &mut Scratch,
        queries: u64,
    ) -> Result<u64, CudaError> {
        let stream = &self.stream;
        let d = &self.dense;
        let rows = step.rows;
        let mla = layer.shape;
        let MlaShape {
            heads,
            nope,
            rope,
            lora,
            ..
        } = mla;
        let (q_width, key_width) = (nope + rope, lora + rope);
        let qb = self.bf16_of(scratch, queries, rows * heads * q_width)?;
        let query = scratch.f32(rows * heads * key_width)?;
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
                layer.kv_up.ptr,
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
                chunk: None,
                scale: self.softmax_scale,
            };
            // Every head reads the same latent keys: loaded once for a group of heads.
            match heads_per_block(heads, key_width, lora) {
                Some(per_block) => d.attend_heads(
                    stream,
                    &shape,
                    per_block,
                    query,
                    rows,
                    &cache,
                    (step.row_seq, step.row_pos),
                    latent_out,
                )?,
                None => d.attend(
                    stream,
                    &shape,
                    query,
                    (rows, None),
                    &cache,
                    (step.row_seq, step.row_pos),
                    0,
                    latent_out,
                )?,
            }
        }
        Ok(latent_out)
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
