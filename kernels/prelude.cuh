// Shared by every kernel file (prepended to each before NVRTC compiles it): bf16 held as its
// 16 bits, so no CUDA header is needed at run time, and block-wide reductions.

typedef unsigned short bf16;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(bf16 v) {
    return __uint_as_float(((unsigned int)v) << 16);
}

// Round to nearest even, as torch and the half crate do; NaN stays NaN.
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// (value, index) order for top-k: larger value first, ties to the lower index. NaN marks an
// entry already taken: it is never better than anything.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

struct Best {
    float value;
    int index;
};

// The best (value, index) over a warp, in lane 0. Every lane of the warp must call it.
__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_down_sync(0xffffffffu, bv, off);
        int oi = __shfl_down_sync(0xffffffffu, bi, off);
        if (better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

// The best entry of vals[0..n) over the whole block. Every thread gets the answer.
// Needs blockDim.x a multiple of 32, at most 1024.
__device__ Best block_argmax(const float* vals, int n) {
    __shared__ float red_v[32];
    __shared__ int red_i[32];
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        if (better(vals[j], j, bv, bi)) {
            bv = vals[j];
            bi = j;
        }
    }
    warp_argmax(bv, bi);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        red_v[warp] = bv;
        red_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        int warps = blockDim.x / 32;
        bv = lane < warps ? red_v[lane] : NEG_INF;
        bi = lane < warps ? red_i[lane] : 0x7fffffff;
        warp_argmax(bv, bi);
        if (lane == 0) {
            red_v[0] = bv;
            red_i[0] = bi;
        }
    }
    __syncthreads();
    Best best = {red_v[0], red_i[0]};
    __syncthreads();
    return best;
}

// The sum of one value per thread over the whole block. Every thread gets the answer.
__device__ float block_sum(float v) {
    __shared__ float red[32];
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_down_sync(0xffffffffu, v, off);
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        red[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x / 32) ? red[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) {
            v += __shfl_down_sync(0xffffffffu, v, off);
        }
        if (lane == 0) {
            red[0] = v;
        }
    }
    __syncthreads();
    float total = red[0];
    __syncthreads();
    return total;
}
