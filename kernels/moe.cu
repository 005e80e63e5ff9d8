// The mixture-of-experts layer on a GPU: gate scores to top-k experts, the token permutation
// that groups rows by expert and its inverse (the weighted combine), and SwiGLU between the
// two grouped GEMMs (which cuBLAS runs). They follow src/moe/gating.rs and
// src/moe/dispatch.rs, which follow transformers.

#define MAX_GROUPS 64

// One block per token row. `scoring` 0: softmax over all experts, top-k, weights optionally
// renormalised to sum 1. `scoring` 1: sigmoid scores; the choice is biased by `bias` (may be
// null) and limited to the best `topk_group` of `n_group` groups (a group scores the sum of
// its two best biased scores); weights are the unbiased scores, optionally normalised, times
// `scale`. Dynamic shared memory: 2 * experts floats.
extern "C" __global__ void gate_topk(const float* logits, int experts, int k, int scoring,
                                     const float* bias, int n_group, int topk_group,
                                     int renormalize, float scale, int* out_ids,
                                     float* out_weights) {
    extern __shared__ float smem[];
    float* score = smem;
    float* choice = smem + experts;
    __shared__ int kept[MAX_GROUPS];
    __shared__ float picked[64];
    const float* x = logits + (size_t)blockIdx.x * experts;

    if (scoring == 0) {
        float max = block_argmax(x, experts).value;
        float part = 0.0f;
        for (int j = threadIdx.x; j < experts; j += blockDim.x) {
            score[j] = expf(x[j] - max);
            part += score[j];
        }
        float sum = block_sum(part);
        for (int j = threadIdx.x; j < experts; j += blockDim.x) {
            score[j] /= sum;
            choice[j] = score[j];
        }
    } else {
        for (int j = threadIdx.x; j < experts; j += blockDim.x) {
            score[j] = 1.0f / (1.0f + expf(-x[j]));
            choice[j] = score[j] + (bias ? bias[j] : 0.0f);
        }
    }
    __syncthreads();

    if (scoring == 1 && topk_group < n_group) {
        int group_size = experts / n_group;
        __shared__ float group_score[MAX_GROUPS];
        for (int g = threadIdx.x; g < n_group; g += blockDim.x) {
            float b1 = NEG_INF, b2 = NEG_INF;
            for (int j = g * group_size; j < (g + 1) * group_size; ++j) {
                float v = choice[j];
                if (v > b1) {
                    b2 = b1;
                    b1 = v;
                } else if (v > b2) {
                    b2 = v;
                }
            }
            group_score[g] = b1 + b2;
            kept[g] = 0;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // topk_group of at most 64 groups: a few hundred comparisons on one thread.
            for (int t = 0; t < topk_group; ++t) {
                float bv = NEG_INF;
                int bi = 0x7fffffff;
                for (int g = 0; g < n_group; ++g) {
                    if (!kept[g] && better(group_score[g], g, bv, bi)) {
                        bv = group_score[g];
                        bi = g;
                    }
                }
                kept[bi] = 1;
            }
        }
        __syncthreads();
        for (int j = threadIdx.x; j < experts; j += blockDim.x) {
            if (!kept[j / group_size]) {
                choice[j] = NEG_INF;
            }
        }
        __syncthreads();
    }

    int* ids = out_ids + (size_t)blockIdx.x * k;
    for (int t = 0; t < k; ++t) {
        Best best = block_argmax(choice, experts);
        if (threadIdx.x == 0) {
            ids[t] = best.index;
            picked[t] = score[best.index];
            choice[best.index] = __int_as_float(0x7fc00000);  // NaN: taken
        }
        __syncthreads();
    }

    if (threadIdx.x == 0) {
        float* w = out_weights + (size_t)blockIdx.x * k;
        float sum = 0.0f;
        for (int t = 0; t < k; ++t) {
            sum += picked[t];
        }
        if (scoring == 1) {
            sum += 1e-20f;
        }
        for (int t = 0; t < k; ++t) {
            float v = renormalize ? picked[t] / sum : picked[t];
            w[t] = scoring == 1 ? v * scale : v;
        }
    }
}

// Rows routed to each expert: counts[e] += 1 for every (token, expert) pair.
extern "C" __global__ void count_experts(const int* ids, int pairs, int* counts) {
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += gridDim.x * blockDim.x) {
        atomicAdd(&counts[ids[p]], 1);
    }
}

// offsets[e] = rows of experts before e (offsets[experts] = pairs); cursor starts as offsets.
// One thread: a few hundred additions.
extern "C" __global__ void expert_offsets(const int* counts, int experts, int* offsets,
                                          int* cursor) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        int total = 0;
        for (int e = 0; e < experts; ++e) {
            offsets[e] = total;
            cursor[e] = total;
            total += counts[e];
        }
        offsets[experts] = total;
    }
}

// Places every (token, expert) pair in its expert's group: slot_of_pair[p] is where pair p
// went, source_row[slot] the token it came from. Order within a group is arbitrary; no result
// depends on it (each grouped row is computed alone and combined through slot_of_pair).
extern "C" __global__ void scatter_pairs(const int* ids, int pairs, int k, int* cursor,
                                         int* slot_of_pair, int* source_row) {
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += gridDim.x * blockDim.x) {
        int slot = atomicAdd(&cursor[ids[p]], 1);
        slot_of_pair[p] = slot;
        source_row[slot] = p / k;
    }
}

// grouped[slot] = x[source_row[slot]]: rows of `width` bf16.
extern "C" __global__ void gather_rows(const bf16* x, const int* source_row, int slots,
                                       int width, bf16* grouped) {
    size_t n = (size_t)slots * width;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t slot = i / width, c = i % width;
        grouped[i] = x[(size_t)source_row[slot] * width + c];
    }
}

// out[t] = sum over t's k experts of weight * expert_out[slot]: the inverse permutation and
// the weighted combine in one pass, f32 accumulation, no atomics (each output is one thread's).
extern "C" __global__ void combine_rows(const bf16* expert_out, const int* slot_of_pair,
                                        const float* weights, int tokens, int k, int width,
                                        float* out) {
    size_t n = (size_t)tokens * width;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / width, c = i % width;
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) {
            size_t p = t * k + j;
            acc += weights[p] * bf16_to_f32(expert_out[(size_t)slot_of_pair[p] * width + c]);
        }
        out[i] = acc;
    }
}

// SwiGLU between the expert GEMMs: gate_up holds rows of [gate (inter) | up (inter)];
// out rows of `inter`, by `mode` (SwiGluActivation):
//   0: silu(gate) * up;
//   1: gpt-oss's (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit);
//   2: DeepSeek-V4's silu(min(gate, limit)) * clamp(up, -limit, limit).
// A NaN stays NaN through the clamps, as in torch and the CPU's.
extern "C" __global__ void swiglu(const bf16* gate_up, int rows, int inter, int mode,
                                  float alpha, float limit, bf16* out) {
    size_t n = (size_t)rows * inter;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / inter, c = i % inter;
        const bf16* row = gate_up + r * 2 * inter;
        float g = bf16_to_f32(row[c]);
        float u = bf16_to_f32(row[inter + c]);
        float v;
        if (mode == 0) {
            v = g / (1.0f + expf(-g)) * u;
        } else {
            float g0 = g > limit ? limit : g;
            float u0 = u > limit ? limit : (u < -limit ? -limit : u);
            v = mode == 1 ? (u0 + 1.0f) * g0 / (1.0f + expf(-alpha * g0))
                          : g0 / (1.0f + expf(-g0)) * u0;
        }
        out[i] = f32_to_bf16(v);
    }
}

// Adds each group's bias to its rows of a grouped product's output: group g (blockIdx.y)
// has rows[g] rows of `width` at c[g], and its f32 bias `bias_offset` bytes into its slot.
extern "C" __global__ void add_group_bias(bf16* const* c, const unsigned char* const* slots,
                                          const int* rows, long long bias_offset, int width) {
    int g = blockIdx.y;
    const float* bias = (const float*)(slots[g] + bias_offset);
    bf16* out = c[g];
    size_t n = (size_t)rows[g] * width;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(bf16_to_f32(out[i]) + bias[i % width]);
    }
}

// f32 rows to bf16 (the router's activations to the experts' precision).
extern "C" __global__ void to_bf16(const float* in, size_t n, bf16* out) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(in[i]);
    }
}

// bf16 rows to f32 (the experts' outputs back to the router's precision).
extern "C" __global__ void to_f32(const bf16* in, size_t n, float* out) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = bf16_to_f32(in[i]);
    }
}

// SplitMix64's output function (src/model/dummy.rs).
__device__ __forceinline__ unsigned long long splitmix(unsigned long long x) {
    unsigned long long z = x + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// The n values of a `--load-format dummy` tensor, made where they are used (a Kimi K2 MoE
// layer is 34 GB of bf16): value i from the i-th output of SplitMix64 started at `stream`,
// uniform on [-half_width, half_width), as src/model/dummy.rs's DummyFill::value makes it on
// the host. The unit value is exact in f32 (even if the compiler fuses its multiply and
// subtract), and the one product rounds as the host's does, so the bf16 bits are the same.
extern "C" __global__ void fill_dummy(bf16* out, size_t n, unsigned long long stream,
                                      float half_width) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        unsigned long long bits = splitmix(stream + (unsigned long long)i * 0x9e3779b97f4a7c15ull);
        float unit = (float)(bits >> 40) * (1.0f / 8388608.0f) - 1.0f;
        out[i] = f32_to_bf16(unit * half_width);
    }
}

// The `a` matrices of the expert products (`[m, k]` row-major, one per group) in the form a
// device holds them (src/compute/cuda/storage.rs), read eight weights at a time: `row(g, r,
// k)` finds row r of group g, its `chunk(v, w)` writes weights 8v..8v+8 as f32, scaled. k is
// a multiple of 8 and rows start 16-byte aligned (bf16), 8-byte (FP8) or 4-byte (INT4).

struct Bf16Rows {
    const bf16* const* a;

    struct Row {
        const uint4* w;
        __device__ __forceinline__ void chunk(int v, float* out) const {
            uint4 q = w[v];
            unsigned words[4] = {q.x, q.y, q.z, q.w};
            for (int i = 0; i < 4; ++i) {
                out[2 * i] = bf16_to_f32((bf16)(words[i] & 0xffffu));
                out[2 * i + 1] = bf16_to_f32((bf16)(words[i] >> 16));
            }
        }
    };

    __device__ __forceinline__ Row row(int g, int r, int k) const {
        return Row{(const uint4*)(a[g] + (size_t)r * k)};
    }
};

// A quantized weight's value as the device computes with it: rounded once to bf16, in the
// GEMV as in the widening for the grouped GEMM, so that a step's arithmetic does not depend
// on which of the two its rows per expert choose (the emulated GPU found logits moving by
// 0.06 with the batch when only the widening rounded).
__device__ __forceinline__ float as_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// The value of an e4m3fn byte, as src/compute/quant.rs's e4m3_to_f32 reads it: exponent and
// mantissa moved to an f32's positions give the value times 2^-120.
__device__ __forceinline__ float e4m3_to_f32(unsigned byte) {
    unsigned bits = ((unsigned)(int)(signed char)byte << 20) & 0x87f00000u;
    return __uint_as_float(bits) * __uint_as_float((127u + 120u) << 23);
}

// FP8 e4m3 bytes; one f32 scale per [block_rows, block_cols] block, at `scale_offset` bytes
// after the matrix's first weight, a row of blocks per block_rows rows. The first `split`
// rows and the rest are two matrices stacked (gate and up), each with its own blocks.
struct Fp8Rows {
    const unsigned char* const* a;
    long long scale_offset;
    int block_rows, block_cols, split;

    struct Row {
        const uint2* w;
        const float* scales;
        int block_cols;
        __device__ __forceinline__ void chunk(int v, float* out) const {
            uint2 q = w[v];
            unsigned words[2] = {q.x, q.y};
            int col = 8 * v;
            bool one_block = col / block_cols == (col + 7) / block_cols;
            float s = scales[col / block_cols];
            for (int j = 0; j < 8; ++j) {
                float scale = one_block ? s : scales[(col + j) / block_cols];
                out[j] = as_bf16(e4m3_to_f32((words[j / 4] >> (8 * (j % 4))) & 0xffu) * scale);
            }
        }
    };

    __device__ __forceinline__ Row row(int g, int r, int k) const {
        int blocks_per_row = (k + block_cols - 1) / block_cols;
        int block_row = r < split ? r / block_rows
                                  : (split + block_rows - 1) / block_rows + (r - split) / block_rows;
        const float* scales = (const float*)(a[g] + scale_offset) + (size_t)block_row * blocks_per_row;
        return Row{(const uint2*)(a[g] + (size_t)r * k), scales, block_cols};
    }
};

// 4-bit integers, eight to a 32-bit word, lowest nibble first, each stored as value + 8; one
// scale per `group` weights of a row (bf16 when `scales_bf16`, else f32), at `scale_offset`
// bytes after the matrix's first word, a row of groups per weight row.
struct Int4Rows {
    const unsigned char* const* a;
    long long scale_offset;
    int group, scales_bf16;

    struct Row {
        const unsigned* w;
        const unsigned char* scales;
        int group, scales_bf16;
        __device__ __forceinline__ float scale(int i) const {
            return scales_bf16 ? bf16_to_f32(((const bf16*)scales)[i]) : ((const float*)scales)[i];
        }
        __device__ __forceinline__ void chunk(int v, float* out) const {
            unsigned word = w[v];
            int col = 8 * v;
            bool one_group = col / group == (col + 7) / group;
            float s = scale(col / group);
            for (int j = 0; j < 8; ++j) {
                float value = (float)((int)((word >> (4 * j)) & 0xfu) - 8);
                out[j] = as_bf16(value * (one_group ? s : scale((col + j) / group)));
            }
        }
    };

    __device__ __forceinline__ Row row(int g, int r, int k) const {
        int groups = (k + group - 1) / group;
        const unsigned char* scales =
            a[g] + scale_offset + (size_t)r * groups * (scales_bf16 ? 2 : 4);
        return Row{(const unsigned*)(a[g] + (size_t)r * (k / 2)), scales, group, scales_bf16};
    }
};

// The expert products of a decode step, where each expert gets a few rows: a grouped
// matrix-vector product that reads every weight once, at full memory bandwidth, instead of
// a GEMM tiled for many rows, and decodes quantized weights in registers as it reads them.
// For each group g, C_g[j][r] = Σ_c A_g[r][c] · B_g[j][c] for output rows r < m and the
// group's n_g ≤ GEMV_MAX_ROWS input rows j (A: [m, k] in `weights`' form, B: [n_g, k] bf16,
// C: [n_g, m] bf16; the layouts of the grouped GEMM). One warp per output row, lanes over
// k eight weights at a time. Grid: (ceil(m / warps per block), groups).
#define GEMV_MAX_ROWS 8

template <class Weights>
__device__ __forceinline__ void gemv(const Weights& weights, const bf16* const* b,
                                     bf16* const* c, const int* rows, int m, int k) {
    int g = blockIdx.y;
    int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int r = blockIdx.x * warps + warp;
    int n = rows[g];
    if (r >= m) {
        return;  // a whole warp leaves together: no shuffle below is left waiting
    }
    auto row = weights.row(g, r, k);
    const bf16* x = b[g];
    float acc[GEMV_MAX_ROWS];
    for (int j = 0; j < GEMV_MAX_ROWS; ++j) {
        acc[j] = 0.0f;
    }
    for (int v = lane; v < k / 8; v += 32) {
        float wf[8];
        row.chunk(v, wf);
        for (int j = 0; j < GEMV_MAX_ROWS; ++j) {
            if (j < n) {
                uint4 xv = ((const uint4*)(x + (size_t)j * k))[v];
                unsigned xs[4] = {xv.x, xv.y, xv.z, xv.w};
                for (int i = 0; i < 4; ++i) {
                    acc[j] += wf[2 * i] * bf16_to_f32((bf16)(xs[i] & 0xffffu)) +
                              wf[2 * i + 1] * bf16_to_f32((bf16)(xs[i] >> 16));
                }
            }
        }
    }
    for (int j = 0; j < GEMV_MAX_ROWS; ++j) {
        float sum = acc[j];
        for (int off = 16; off > 0; off >>= 1) {
            sum += __shfl_down_sync(0xffffffffu, sum, off);
        }
        if (lane == 0 && j < n) {
            c[g][(size_t)j * m + r] = f32_to_bf16(sum);
        }
    }
}

extern "C" __global__ void grouped_gemv(const bf16* const* a, const bf16* const* b,
                                        bf16* const* c, const int* rows, int m, int k) {
    gemv(Bf16Rows{a}, b, c, rows, m, k);
}

extern "C" __global__ void grouped_gemv_fp8(const unsigned char* const* a, long long scale_offset,
                                            int block_rows, int block_cols, int split,
                                            const bf16* const* b, bf16* const* c,
                                            const int* rows, int m, int k) {
    gemv(Fp8Rows{a, scale_offset, block_rows, block_cols, split}, b, c, rows, m, k);
}

extern "C" __global__ void grouped_gemv_int4(const unsigned char* const* a, long long scale_offset,
                                             int group, int scales_bf16, const bf16* const* b,
                                             bf16* const* c, const int* rows, int m, int k) {
    gemv(Int4Rows{a, scale_offset, group, scales_bf16}, b, c, rows, m, k);
}

// Quantized `a` matrices widened to bf16 for the grouped GEMM (steps with more rows per
// expert than the GEMV takes): group g's [m, k] matrix into out + g * out_stride, each
// weight rounded once from its f32 value (the host's widening, bit for bit; `chunk` rounds). Grid: (any,
// groups); a grid-stride loop over the matrix's chunks of eight.
template <class Weights>
__device__ __forceinline__ void widen(const Weights& weights, bf16* out, size_t out_stride,
                                      int m, int k) {
    int g = blockIdx.y;
    size_t per_row = k / 8, chunks = (size_t)m * per_row;
    bf16* dst = out + g * out_stride;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < chunks;
         i += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(i / per_row), v = (int)(i % per_row);
        float w[8];
        weights.row(g, r, k).chunk(v, w);
        unsigned packed[4];
        for (int j = 0; j < 4; ++j) {
            packed[j] = (unsigned)f32_to_bf16(w[2 * j]) | ((unsigned)f32_to_bf16(w[2 * j + 1]) << 16);
        }
        ((uint4*)(dst + (size_t)r * k))[v] = uint4{packed[0], packed[1], packed[2], packed[3]};
    }
}

extern "C" __global__ void widen_fp8(const unsigned char* const* a, long long scale_offset,
                                     int block_rows, int block_cols, int split, bf16* out,
                                     size_t out_stride, int m, int k) {
    widen(Fp8Rows{a, scale_offset, block_rows, block_cols, split}, out, out_stride, m, k);
}

extern "C" __global__ void widen_int4(const unsigned char* const* a, long long scale_offset,
                                      int group, int scales_bf16, bf16* out, size_t out_stride,
                                      int m, int k) {
    widen(Int4Rows{a, scale_offset, group, scales_bf16}, out, out_stride, m, k);
}
