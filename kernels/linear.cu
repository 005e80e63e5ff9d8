// Gated DeltaNet, the linear attention of Qwen3-Next's and Qwen3.5's `linear_attention`
// layers, on a GPU. They follow src/engine/linear_attention.rs (the recurrent form), in f32.
//
// A sequence's states (per linear layer: the `[value_heads, key_dim, value_dim]` recurrent
// state, then the convolution's window `[kernel - 1, channels]`) live in pages of the GPU's
// KV pool; each linear layer gathers its part of every sequence's state into one packed
// `[seqs, layer_floats]` buffer, updates it there and scatters it back to the pages (so a
// step holds one layer's states beside the pool at a time, not all of them).
//
// Segments: sequence `s` of the step has `seq_len[s]` rows from row `seq_first_row[s]`.

__device__ __forceinline__ float sigmoidf_(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// log(1 + exp(x)), as torch computes it: x itself above 20.
__device__ __forceinline__ float softplusf_(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

// Grid (seqs, chunks): states[s][e] = element offset + e of sequence s's state (page
// (offset + e) / page_floats, at its remainder), or 0 where fresh[s] (a sequence's first
// step). `pages`: `[seqs, pages_per_seq]` addresses.
extern "C" __global__ void gather_state(const unsigned long long* pages, int pages_per_seq,
                                        int page_floats, long long offset, int floats,
                                        const int* fresh, float* states) {
    int s = blockIdx.x;
    const unsigned long long* own = pages + (size_t)s * pages_per_seq;
    float* to = states + (size_t)s * floats;
    for (int e = blockIdx.y * blockDim.x + threadIdx.x; e < floats;
         e += gridDim.y * blockDim.x) {
        long long at = offset + e;
        to[e] = fresh[s] ? 0.0f : ((const float*)own[at / page_floats])[at % page_floats];
    }
}

// The inverse of gather_state: the packed states back into their pages.
extern "C" __global__ void scatter_state(const float* states, const unsigned long long* pages,
                                         int pages_per_seq, int page_floats, long long offset,
                                         int floats) {
    int s = blockIdx.x;
    const unsigned long long* own = pages + (size_t)s * pages_per_seq;
    const float* from = states + (size_t)s * floats;
    for (int e = blockIdx.y * blockDim.x + threadIdx.x; e < floats;
         e += gridDim.y * blockDim.x) {
        long long at = offset + e;
        ((float*)own[at / page_floats])[at % page_floats] = from[e];
    }
}

// One block per row: the causal depthwise convolution of `kernel` taps and SiLU over every
// channel of `mixed` (`[rows, channels]`). A row at offset t of its segment reads the rows
// before it in the segment and, before the segment, the window kept in its sequence's state
// (`window` floats into it: `[kernel - 1, channels]`, oldest first).
extern "C" __global__ void causal_conv(const float* mixed, int channels, const float* weight,
                                       int kernel, const float* states, int state_floats,
                                       int window, const int* row_seq,
                                       const int* seq_first_row, float* out) {
    int row = blockIdx.x;
    int s = row_seq[row];
    int t = row - seq_first_row[s];
    const float* kept = states + (size_t)s * state_floats + window;
    for (int c = threadIdx.x; c < channels; c += blockDim.x) {
        float sum = 0.0f;
        for (int j = 0; j < kernel; ++j) {
            // Tap j reads the input kernel - 1 - j rows back.
            int at = t - (kernel - 1) + j;
            float x = at >= 0 ? mixed[(size_t)(row - (t - at)) * channels + c]
                              : kept[(size_t)(at + kernel - 1) * channels + c];
            sum += weight[(size_t)c * kernel + j] * x;
        }
        out[(size_t)row * channels + c] = sum * sigmoidf_(sum);
    }
}

// The longest convolution this file takes (the window held in registers below).
#define MAX_CONV_KERNEL 16

// One block per sequence, a thread per channel: the window after the segment, its last
// `kernel - 1` inputs (from the segment's rows of `mixed`, and the old window where the
// segment is shorter). Each channel's entries are read before any is written.
extern "C" __global__ void conv_window(const float* mixed, int channels, int kernel,
                                       float* states, int state_floats, int window,
                                       const int* seq_first_row, const int* seq_len) {
    int s = blockIdx.x;
    int first = seq_first_row[s], n = seq_len[s], past = kernel - 1;
    float* kept = states + (size_t)s * state_floats + window;
    for (int c = threadIdx.x; c < channels; c += blockDim.x) {
        float next[MAX_CONV_KERNEL];
        for (int i = 0; i < past; ++i) {
            int at = n - past + i;
            next[i] = at >= 0 ? mixed[(size_t)(first + at) * channels + c]
                              : kept[(size_t)(n + i) * channels + c];
        }
        for (int i = 0; i < past; ++i) {
            kept[(size_t)i * channels + c] = next[i];
        }
    }
}

// One block per (sequence, value head): the delta rule over the sequence's rows in order,
// from and into the head's `[key_dim, value_dim]` state (`recurrent` floats into the
// sequence's state, head after head). Per row, with q and k L2-normed (q also scaled by
// 1/sqrt(key_dim)), g = decay_scale * softplus(a + dt_bias) and beta = sigmoid(b):
//   S = exp(g) S;  delta = beta (v - S^T k);  S += k delta^T;  o = S^T q.
// `convolved`: `[rows, 2 * key_heads * key_dim + value_heads * value_dim]` (queries, keys,
// values); `a`, `b`: `[rows, value_heads]`; `out`: `[rows, value_heads, value_dim]`. A
// thread owns columns j of the state, so only q and k are shared.
// Dynamic shared memory: 2 * key_dim floats.
extern "C" __global__ void gated_delta(const float* convolved, const float* a, const float* b,
                                       const float* dt_bias, const float* decay_scale,
                                       int value_heads, int key_heads, int key_dim,
                                       int value_dim, float* states, int state_floats,
                                       int recurrent, const int* seq_first_row,
                                       const int* seq_len, float* out) {
    extern __shared__ float smem[];
    float* q = smem;
    float* k = smem + key_dim;
    int s = blockIdx.x / value_heads, head = blockIdx.x % value_heads;
    int group = key_heads > 0 ? value_heads / key_heads : 1;
    int key_head = head / (group > 0 ? group : 1);
    int channels = 2 * key_heads * key_dim + value_heads * value_dim;
    float* state = states + (size_t)s * state_floats + recurrent +
                   (size_t)head * key_dim * value_dim;
    float scale = 1.0f / sqrtf((float)key_dim);
    for (int t = 0; t < seq_len[s]; ++t) {
        int row = seq_first_row[s] + t;
        const float* in = convolved + (size_t)row * channels;
        float qq = 0.0f, kk = 0.0f;
        for (int i = threadIdx.x; i < key_dim; i += blockDim.x) {
            q[i] = in[key_head * key_dim + i];
            k[i] = in[key_heads * key_dim + key_head * key_dim + i];
            qq += q[i] * q[i];
            kk += k[i] * k[i];
        }
        // (block_sum synchronises: every q and k is written before it returns.)
        float q_factor = 1.0f / sqrtf(block_sum(qq) + 1e-6f) * scale;
        float k_factor = 1.0f / sqrtf(block_sum(kk) + 1e-6f);
        for (int i = threadIdx.x; i < key_dim; i += blockDim.x) {
            q[i] *= q_factor;
            k[i] *= k_factor;
        }
        __syncthreads();
        float g = decay_scale[head] *
                  softplusf_(a[(size_t)row * value_heads + head] + dt_bias[head]);
        float beta = sigmoidf_(b[(size_t)row * value_heads + head]);
        float decay = expf(g);
        const float* v = in + 2 * key_heads * key_dim + head * value_dim;
        float* o = out + ((size_t)row * value_heads + head) * value_dim;
        for (int j = threadIdx.x; j < value_dim; j += blockDim.x) {
            float recalled = 0.0f;
            for (int i = 0; i < key_dim; ++i) {
                float sij = state[(size_t)i * value_dim + j] * decay;
                state[(size_t)i * value_dim + j] = sij;
                recalled += sij * k[i];
            }
            float delta = beta * (v[j] - recalled);
            float sum = 0.0f;
            for (int i = 0; i < key_dim; ++i) {
                float sij = state[(size_t)i * value_dim + j] + k[i] * delta;
                state[(size_t)i * value_dim + j] = sij;
                sum += sij * q[i];
            }
            o[j] = sum;
        }
        __syncthreads();  // q and k are read by every thread before the next row writes them
    }
}

// One block per (row, head): an RMSNorm of the head's `width` outputs with `weight`, times
// silu(gate), in place. `x`, `gate`: `[rows * heads, width]`.
extern "C" __global__ void gated_rms_norm(float* x, const float* gate, const float* weight,
                                          int width, float eps) {
    float* row = x + (size_t)blockIdx.x * width;
    const float* z = gate + (size_t)blockIdx.x * width;
    float part = 0.0f;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        part += row[c] * row[c];
    }
    float inv = 1.0f / sqrtf(block_sum(part) / width + eps);
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        row[c] = row[c] * inv * weight[c] * (z[c] * sigmoidf_(z[c]));
    }
}
