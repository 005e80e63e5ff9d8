// Just enough of CUDA to run kernels/*.cu on the CPU, for tests that check the kernels'
// logic where there is no GPU (tests/kernels_on_cpu.rs). Every thread of a block is an OS
// thread; blocks run one after another; __syncthreads is a barrier over the block and warp
// shuffles exchange through a buffer behind a barrier over the warp. Slow, and only as
// faithful as these kernels need: no warp divergence inside shuffles (none of them has it),
// shared memory as statics (one block at a time), dynamic shared memory through `smem_`.
// A warp that returns early must return whole (as the kernels' early exits do).

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct uint4 {
    unsigned x, y, z, w;
};

struct uint2 {
    unsigned x, y;
};

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static std::barrier<>* block_barrier_;
static std::vector<std::unique_ptr<std::barrier<>>> warp_barriers_;
static uint64_t shuffle_[32][32];
static std::vector<unsigned char> smem_;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() block_barrier_->arrive_and_wait()

inline float __int_as_float(int v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline float __uint_as_float(unsigned v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned v;
    std::memcpy(&v, &f, 4);
    return v;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }

template <class T>
T __shfl_down_sync(unsigned, T v, int offset) {
    unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    std::memcpy(&shuffle_[warp][lane], &v, sizeof(T));
    warp_barriers_[warp]->arrive_and_wait();
    T result = v;
    if (lane + offset < 32 && warp * 32 + lane + offset < blockDim.x) {
        std::memcpy(&result, &shuffle_[warp][lane + offset], sizeof(T));
    }
    warp_barriers_[warp]->arrive_and_wait();
    return result;
}

// Runs `kernel` over `grid` blocks of `block` threads.
inline void launch(unsigned grid, unsigned block, size_t dynamic_smem,
                   const std::function<void()>& kernel, unsigned grid_y = 1) {
    gridDim.x = grid;
    gridDim.y = grid_y;
    blockDim.x = block;
    smem_.assign(dynamic_smem + 16, 0);
    for (unsigned b = 0; b < grid * grid_y; ++b) {
        std::barrier<> block_barrier(block);
        block_barrier_ = &block_barrier;
        warp_barriers_.clear();
        for (unsigned w = 0; w * 32 < block; ++w) {
            unsigned n = std::min(32u, block - w * 32);
            warp_barriers_.push_back(std::make_unique<std::barrier<>>(n));
        }
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < block; ++t) {
            threads.emplace_back([&, b, t] {
                blockIdx.x = b % grid;
                blockIdx.y = b / grid;
                threadIdx.x = t;
                kernel();
            });
        }
        for (auto& th : threads) th.join();
    }
}
