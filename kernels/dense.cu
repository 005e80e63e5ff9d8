// The dense part of a decoder layer on a GPU: RMSNorm, rotary embeddings and attention over
// the KV cache. They follow src/compute/cpu.rs (rms_norm), src/engine/rope.rs (Rope::apply)
// and src/engine/attention.rs (attend), in f32.

// One block per row: out = x / sqrt(mean(x²) + eps) * weight over the first `width` values
// of rows `stride` apart (in x and in out). `out` may be `x`.
extern "C" __global__ void rms_norm(const float* x, int stride, const float* weight, int width,
                                    float eps, float* out) {
    const float* row = x + (size_t)blockIdx.x * stride;
    float part = 0.0f;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        part += row[c] * row[c];
    }
    float scale = 1.0f / sqrtf(block_sum(part) / width + eps);
    float* dst = out + (size_t)blockIdx.x * stride;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        dst[c] = row[c] * scale * weight[c];
    }
}

// Rotates the `rope_dim` values at `offset` of every `head_width`-wide head of every row, in
// place. cos and sin are `[rows, rope_dim / 2]` (the host folds YaRN's scaling into them).
// Interleaved pairs (x[2i], x[2i+1]) are written back in rotate-half order, as transformers
// does. One block per (row, head); dynamic shared memory: rope_dim floats.
extern "C" __global__ void rope(float* x, int heads, int head_width, int offset, int rope_dim,
                                const float* cos, const float* sin, int interleaved) {
    extern __shared__ float smem[];
    int row = blockIdx.x / heads;
    float* head = x + (size_t)blockIdx.x * head_width + offset;
    int half = rope_dim / 2;
    for (int i = threadIdx.x; i < rope_dim; i += blockDim.x) {
        smem[i] = head[i];
    }
    __syncthreads();
    const float* c = cos + (size_t)row * half;
    const float* s = sin + (size_t)row * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float a = interleaved ? smem[2 * i] : smem[i];
        float b = interleaved ? smem[2 * i + 1] : smem[i + half];
        head[i] = a * c[i] - b * s[i];
        head[i + half] = b * c[i] + a * s[i];
    }
}

#define ATTEND_TILE 256

// Positions of one sequence per block of a paged cache (KvBudget::BLOCK_TOKENS).
#define KV_BLOCK 16

// The pool row holding position `pos` of the sequence whose block table is `table`: block
// table[pos / KV_BLOCK] holds its positions KV_BLOCK * (pos / KV_BLOCK) onwards.
__device__ __forceinline__ size_t cached_row(const int* table, int pos) {
    return (size_t)table[pos / KV_BLOCK] * KV_BLOCK + pos % KV_BLOCK;
}

// Attention of one query row and head over its sequence's cached keys and values (bf16,
// widened to f32 as read; the query and every sum are f32), causal,
// optionally within a sliding window; softmax computed a tile of positions at a time with a
// running maximum (no score array as long as the context).
//
// Block (row, head) = (blockIdx.x / heads, blockIdx.x % heads). Query: q[row][head][0..dk)
// (row stride heads * dk). The row's sequence `seq = row_seq[row]` has its block table at
// blocks + seq * table_stride, and a position's key at key_pool + cached_row * kv_stride +
// kv_head * k_head_stride (dk values), its value at value_pool + cached_row * kv_stride +
// kv_head * v_head_stride (dv values), kv_head = head / group. The row is at position row_pos[row] and sees positions up to it (the last
// `window` of them when window > 0). out[row][head][0..dv).
//
// GQA: dk = dv = head_dim, kv_stride = kv_heads * head_dim. MLA in its absorbed form: one
// kv head whose key is [latent | rotary key] and whose value is the latent (values = keys).
// `sinks` (gpt-oss; null: none): one more logit per head in the softmax, with no value.
// `chunk` > 0 (Llama 4's chunked layers): a row sees only the positions of its own chunk of
// `chunk` positions.
// Dynamic shared memory: dk + ATTEND_TILE + dv floats.
extern "C" __global__ void attend(const float* q, int heads, int group, int dk, int dv,
                                  const bf16* key_pool, const bf16* value_pool,
                                  const int* blocks, int table_stride,
                                  int kv_stride, int k_head_stride, int v_head_stride,
                                  const int* row_seq, const int* row_pos, int window,
                                  int chunk, float scale, const float* sinks, float* out) {
    extern __shared__ float smem[];
    float* query = smem;
    float* tile = smem + dk;
    float* acc = tile + ATTEND_TILE;
    int row = blockIdx.x / heads, head = blockIdx.x % heads;
    int seq = row_seq[row], pos = row_pos[row];
    int first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
    if (chunk > 0) {
        first = pos - pos % chunk;
    }
    const int* table = blocks + (size_t)seq * table_stride;
    const bf16* k = key_pool + (size_t)(head / group) * k_head_stride;
    const bf16* v = value_pool + (size_t)(head / group) * v_head_stride;

    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        query[i] = q[((size_t)row * heads + head) * dk + i];
    }
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        acc[d] = 0.0f;
    }
    __syncthreads();

    float running_max = NEG_INF, total = 0.0f;
    for (int start = first; start <= pos; start += ATTEND_TILE) {
        int len = min(ATTEND_TILE, pos + 1 - start);
        for (int j = threadIdx.x; j < len; j += blockDim.x) {
            const bf16* key = k + cached_row(table, start + j) * kv_stride;
            float dot = 0.0f;
            for (int i = 0; i < dk; ++i) {
                dot += query[i] * bf16_to_f32(key[i]);
            }
            tile[j] = dot * scale;
        }
        __syncthreads();
        float tile_max = block_argmax(tile, len).value;
        float new_max = fmaxf(running_max, tile_max);
        float rescale = expf(running_max - new_max);  // 0 on the first tile
        float part = 0.0f;
        for (int j = threadIdx.x; j < len; j += blockDim.x) {
            tile[j] = expf(tile[j] - new_max);
            part += tile[j];
        }
        total = total * rescale + block_sum(part);
        __syncthreads();  // every exponent in `tile` is written before any thread reads them
        for (int d = threadIdx.x; d < dv; d += blockDim.x) {
            float sum = 0.0f;
            for (int j = 0; j < len; ++j) {
                sum += tile[j] * bf16_to_f32(v[cached_row(table, start + j) * kv_stride + d]);
            }
            acc[d] = acc[d] * rescale + sum;
        }
        running_max = new_max;
        __syncthreads();
    }
    float rescale = 1.0f;
    if (sinks) {
        float sink = sinks[head], new_max = fmaxf(running_max, sink);
        rescale = expf(running_max - new_max);
        total = total * rescale + expf(sink - new_max);
    }
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        out[((size_t)row * heads + head) * dv + d] = acc[d] * rescale / total;
    }
}

// Query rows per tile of attend_tiles and key positions per pass (ATTEND_TILES_KEYS).
#define ATTEND_TILES_KEYS 16

// The same attention as `attend`, for a prefill: a block per (tile, head), a tile being up to
// `tile_rows` consecutive rows of one sequence at consecutive positions (tile t: rows
// tile_first[t] .. + tile_len[t]). Each pass loads ATTEND_TILES_KEYS cached keys and values
// of the sequence once into shared memory, for every row of the tile, where `attend` reads
// each key again for every row. Per row: scores over the pass, a running maximum and sum
// (online softmax), the weighted values added up; masked by each row's own span (causal,
// window, chunk). Dynamic shared memory: tile_rows * (dk + dv + ATTEND_TILES_KEYS + 3) +
// ATTEND_TILES_KEYS * (dk + dv) floats.
extern "C" __global__ void attend_tiles(const float* q, int heads, int group, int dk, int dv,
                                        const bf16* key_pool, const bf16* value_pool,
                                        const int* blocks, int table_stride, int kv_stride,
                                        int k_head_stride, int v_head_stride,
                                        const int* row_seq, const int* row_pos, int window,
                                        int chunk, float scale, const float* sinks,
                                        const int* tile_first, const int* tile_len,
                                        int tile_rows, float* out) {
    extern __shared__ float smem[];
    const int KT = ATTEND_TILES_KEYS;
    float* query = smem;                          // [tile_rows][dk]
    float* acc = query + tile_rows * dk;          // [tile_rows][dv]
    float* scores = acc + tile_rows * dv;         // [tile_rows][KT]
    float* running = scores + tile_rows * KT;     // [tile_rows]
    float* total = running + tile_rows;           // [tile_rows]
    float* rescale = total + tile_rows;           // [tile_rows]
    float* keys = rescale + tile_rows;            // [KT][dk]
    float* values = keys + KT * dk;               // [KT][dv]
    int tile = blockIdx.x / heads, head = blockIdx.x % heads;
    int first_row = tile_first[tile], n = tile_len[tile];
    int seq = row_seq[first_row], pos0 = row_pos[first_row];
    const int* table = blocks + (size_t)seq * table_stride;
    const bf16* k = key_pool + (size_t)(head / group) * k_head_stride;
    const bf16* v = value_pool + (size_t)(head / group) * v_head_stride;
    // The first position any row of the tile sees; each row's own is checked per score.
    int lowest = 0;
    if (chunk > 0) {
        lowest = pos0 - pos0 % chunk;
    } else if (window > 0 && pos0 + 1 > window) {
        lowest = pos0 + 1 - window;
    }
    int last = pos0 + n - 1;

    for (int i = threadIdx.x; i < n * dk; i += blockDim.x) {
        int r = i / dk, c = i % dk;
        query[i] = q[((size_t)(first_row + r) * heads + head) * dk + c];
    }
    for (int i = threadIdx.x; i < n * dv; i += blockDim.x) {
        acc[i] = 0.0f;
    }
    for (int r = threadIdx.x; r < n; r += blockDim.x) {
        running[r] = NEG_INF;
        total[r] = 0.0f;
    }
    __syncthreads();

    for (int start = lowest; start <= last; start += KT) {
        int len = min(KT, last + 1 - start);
        for (int i = threadIdx.x; i < len * dk; i += blockDim.x) {
            int j = i / dk, c = i % dk;
            keys[i] = bf16_to_f32(k[cached_row(table, start + j) * kv_stride + c]);
        }
        for (int i = threadIdx.x; i < len * dv; i += blockDim.x) {
            int j = i / dv, c = i % dv;
            values[i] = bf16_to_f32(v[cached_row(table, start + j) * kv_stride + c]);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n * KT; i += blockDim.x) {
            int r = i / KT, j = i % KT, pos = pos0 + r, at = start + j;
            int first = 0;
            if (chunk > 0) {
                first = pos - pos % chunk;
            } else if (window > 0 && pos + 1 > window) {
                first = pos + 1 - window;
            }
            float score = NEG_INF;
            if (j < len && at >= first && at <= pos) {
                float dot = 0.0f;
                for (int c = 0; c < dk; ++c) {
                    dot += query[r * dk + c] * keys[j * dk + c];
                }
                score = dot * scale;
            }
            scores[i] = score;
        }
        __syncthreads();
        // One thread per row: the pass's maximum, the rescaling of what came before, the
        // exponents in place of the scores.
        for (int r = threadIdx.x; r < n; r += blockDim.x) {
            float* row = scores + r * KT;
            float pass_max = NEG_INF;
            for (int j = 0; j < KT; ++j) {
                pass_max = fmaxf(pass_max, row[j]);
            }
            float new_max = fmaxf(running[r], pass_max);
            if (new_max == NEG_INF) {
                // Nothing seen yet by this row.
                rescale[r] = 1.0f;
                for (int j = 0; j < KT; ++j) {
                    row[j] = 0.0f;
                }
                continue;
            }
            rescale[r] = expf(running[r] - new_max);  // 0 while nothing was seen
            float sum = 0.0f;
            for (int j = 0; j < KT; ++j) {
                row[j] = expf(row[j] - new_max);  // 0 where masked
                sum += row[j];
            }
            total[r] = total[r] * rescale[r] + sum;
            running[r] = new_max;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n * dv; i += blockDim.x) {
            int r = i / dv, d = i % dv;
            float sum = 0.0f;
            for (int j = 0; j < len; ++j) {
                sum += scores[r * KT + j] * values[j * dv + d];
            }
            acc[i] = acc[i] * rescale[r] + sum;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < n * dv; i += blockDim.x) {
        int r = i / dv, d = i % dv;
        float factor = 1.0f, sum = total[r];
        if (sinks) {
            float sink = sinks[head], new_max = fmaxf(running[r], sink);
            factor = expf(running[r] - new_max);
            sum = sum * factor + expf(sink - new_max);
        }
        out[((size_t)(first_row + r) * heads + head) * dv + d] = acc[i] * factor / sum;
    }
}

// Attention where every head reads the same keys, and the values are the keys' first `dv`
// values: MLA in its absorbed form (keys `[latent | rotary key]`, values the latent). A block
// per (row, group of up to `heads_per_block` heads); each pass loads ATTEND_TILES_KEYS cached
// keys once, as bf16, for every head of the group, where `attend` reads each key again for
// every head (128 of them for DeepSeek-V3 and Kimi K2). Causal, no window, no sinks. Per
// head: scores over the pass, a running maximum and sum (online softmax), the weighted
// values added up. Dynamic shared memory: heads_per_block * (dk + dv + ATTEND_TILES_KEYS +
// 3) floats, then ATTEND_TILES_KEYS * dk bf16.
extern "C" __global__ void attend_heads(const float* q, int heads, int dk, int dv,
                                        const bf16* key_pool, const int* blocks,
                                        int table_stride, int kv_stride, const int* row_seq,
                                        const int* row_pos, float scale, int heads_per_block,
                                        float* out) {
    extern __shared__ float smem[];
    const int KT = ATTEND_TILES_KEYS;
    int groups = (heads + heads_per_block - 1) / heads_per_block;
    int row = blockIdx.x / groups, first_head = (blockIdx.x % groups) * heads_per_block;
    int n = min(heads_per_block, heads - first_head);
    float* query = smem;                          // [n][dk]
    float* acc = query + heads_per_block * dk;    // [n][dv]
    float* scores = acc + heads_per_block * dv;   // [n][KT]
    float* running = scores + heads_per_block * KT;
    float* total = running + heads_per_block;
    float* rescale = total + heads_per_block;
    bf16* keys = (bf16*)(rescale + heads_per_block);  // [KT][dk]
    int seq = row_seq[row], pos = row_pos[row];
    const int* table = blocks + (size_t)seq * table_stride;

    for (int i = threadIdx.x; i < n * dk; i += blockDim.x) {
        query[i] = q[((size_t)row * heads + first_head) * dk + i];
    }
    for (int i = threadIdx.x; i < n * dv; i += blockDim.x) {
        acc[i] = 0.0f;
    }
    for (int h = threadIdx.x; h < n; h += blockDim.x) {
        running[h] = NEG_INF;
        total[h] = 0.0f;
    }
    __syncthreads();

    for (int start = 0; start <= pos; start += KT) {
        int len = min(KT, pos + 1 - start);
        for (int i = threadIdx.x; i < len * dk; i += blockDim.x) {
            int j = i / dk, c = i % dk;
            keys[i] = key_pool[cached_row(table, start + j) * kv_stride + c];
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n * KT; i += blockDim.x) {
            int h = i / KT, j = i % KT;
            float score = NEG_INF;
            if (j < len) {
                float dot = 0.0f;
                for (int c = 0; c < dk; ++c) {
                    dot += query[h * dk + c] * bf16_to_f32(keys[j * dk + c]);
                }
                score = dot * scale;
            }
            scores[i] = score;
        }
        __syncthreads();
        // One thread per head: the pass's maximum, the rescaling of what came before, the
        // exponents in place of the scores (every pass has a key at or before `pos`).
        for (int h = threadIdx.x; h < n; h += blockDim.x) {
            float* head = scores + h * KT;
            float pass_max = NEG_INF;
            for (int j = 0; j < KT; ++j) {
                pass_max = fmaxf(pass_max, head[j]);
            }
            float new_max = fmaxf(running[h], pass_max);
            rescale[h] = expf(running[h] - new_max);  // 0 on the first pass
            float sum = 0.0f;
            for (int j = 0; j < KT; ++j) {
                head[j] = expf(head[j] - new_max);  // 0 past the pass's keys
                sum += head[j];
            }
            total[h] = total[h] * rescale[h] + sum;
            running[h] = new_max;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n * dv; i += blockDim.x) {
            int h = i / dv, d = i % dv;
            float sum = 0.0f;
            for (int j = 0; j < len; ++j) {
                sum += scores[h * KT + j] * bf16_to_f32(keys[j * dk + d]);
            }
            acc[i] = acc[i] * rescale[h] + sum;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < n * dv; i += blockDim.x) {
        int h = i / dv;
        out[((size_t)row * heads + first_head) * dv + i] = acc[i] / total[h];
    }
}

// x[i] += y[i]: the residual connection.
extern "C" __global__ void add_rows(float* x, const float* y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        x[i] += y[i];
    }
}

// x[i] += bias[i % width]: a projection's bias on every row.
extern "C" __global__ void add_bias(float* x, const float* bias, int width, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        x[i] += bias[i % width];
    }
}

// One block per row: the first `width` values of row r of `src` (rows `src_stride` apart) to
// row r of `dst` (rows `dst_stride` apart). Puts MLA's rotary query beside its absorbed one.
extern "C" __global__ void copy_rows(const float* src, int src_stride, float* dst,
                                     int dst_stride, int width) {
    const float* from = src + (size_t)blockIdx.x * src_stride;
    float* to = dst + (size_t)blockIdx.x * dst_stride;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        to[c] = from[c];
    }
}

// One block per row: appends the step's rows to their sequences' paged caches, rounded to
// bf16. Row r (`width` f32 of `src`, packed) goes to position row_pos[r] of sequence
// row_seq[r]: the pool's row that the sequence's block table maps it to, rows `width` apart.
extern "C" __global__ void store_rows(const float* src, int width, bf16* pool,
                                      const int* blocks, int table_stride, const int* row_seq,
                                      const int* row_pos) {
    const float* from = src + (size_t)blockIdx.x * width;
    const int* table = blocks + (size_t)row_seq[blockIdx.x] * table_stride;
    bf16* to = pool + cached_row(table, row_pos[blockIdx.x]) * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        to[c] = f32_to_bf16(from[c]);
    }
}

// x[i] *= sigmoid(gate[i]): a gated attention output (Qwen3-Next's `attn_output_gate`), each
// head's output times the sigmoid of the gate projected with its query.
extern "C" __global__ void sigmoid_gate(float* x, const float* gate, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        x[i] /= 1.0f + expf(-gate[i]);
    }
}

// x[i] *= sigmoid(logits[i / width]): each row times the sigmoid of its one gate logit (the
// shared expert's gate, `shared_expert_gate`).
extern "C" __global__ void scale_rows_by_sigmoid(float* x, const float* logits, int width,
                                                 size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        x[i] /= 1.0f + expf(-logits[i / width]);
    }
}

// x[i] *= 1 + attn_scale * ln(1 + floor((pos + 1) / floor_scale)), pos the position of row
// i / width: Llama 4's attention temperature on its NoPE layers' queries.
extern "C" __global__ void scale_by_temperature(float* x, const int* row_pos, int width,
                                                float floor_scale, float attn_scale, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float floor_ = floorf(((float)row_pos[i / width] + 1.0f) / floor_scale);
        x[i] *= log1pf(floor_) * attn_scale + 1.0f;
    }
}
