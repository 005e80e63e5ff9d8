// Just enough of CUDA to run kernels/*.cu on the CPU: the emulated CUDA device
// (kernels/emulated/driver.cpp) compiles each kernel file against this header, and
// tests/kernels_on_cpu.rs runs single kernels through tests/emulated/harness.cpp.
//
// Every thread of a block is a fiber (its own stack); the threads of
// a block run on one OS thread, each until it waits at a barrier, and blocks are shared out
// to one OS thread per core. __syncthreads waits for every thread of the block that has not
// returned, a warp shuffle for every such thread of its warp (exchanging through a buffer),
// as on a GPU; threads waiting at barriers that can never all be reached are reported as a
// deadlock. Shared memory is thread_local static storage (one block per OS thread at a
// time), dynamic shared memory is `smem_`. Only as faithful as these kernels need: no warp
// divergence inside shuffles (none of them has it), one-dimensional blocks.

#include <ucontext.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
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
static thread_local uint64_t shuffle_[32][32];
static thread_local std::vector<unsigned char> smem_;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static thread_local

// Switching between fibers. On x86-64, six callee-saved registers and the stack pointer
// (glibc's swapcontext also saves the signal mask, a system call per switch, which made the
// emulation several times slower); elsewhere, ucontext.
#if defined(__x86_64__)
extern "C" void moe_emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl moe_emu_switch
    .hidden moe_emu_switch
    .type moe_emu_switch, @function
moe_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size moe_emu_switch, .-moe_emu_switch
)");

struct FiberContext {
    void* sp = nullptr;

    // A context that starts `entry` on the stack [stack, stack + size).
    void start(char* stack, size_t size, void (*entry)()) {
        uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
        void** frame = reinterpret_cast<void**>(top - 64);
        for (int i = 0; i < 6; ++i) frame[i] = nullptr;  // r15 .. rbp
        frame[6] = reinterpret_cast<void*>(entry);        // where `ret` goes
        frame[7] = nullptr;                               // entry never returns
        sp = frame;
    }

    static void swap(FiberContext& from, FiberContext& to) { moe_emu_switch(&from.sp, to.sp); }
};
#else
struct FiberContext {
    ucontext_t context;

    void start(char* stack, size_t size, void (*entry)()) {
        getcontext(&context);
        context.uc_stack.ss_sp = stack;
        context.uc_stack.ss_size = size;
        context.uc_link = nullptr;
        makecontext(&context, entry, 0);
    }

    static void swap(FiberContext& from, FiberContext& to) {
        swapcontext(&from.context, &to.context);
    }
};
#endif

// The threads of the block an OS thread is running, as fibers.
class Block {
  public:
    enum State { RUNNABLE, AT_BLOCK, AT_WARP, DONE };

    // Runs `kernel` on `threads` fibers until all have returned.
    void run(unsigned threads, const std::function<void()>& kernel) {
        kernel_ = &kernel;
        if (fibers_.size() < threads) fibers_.resize(threads);
        for (unsigned t = 0; t < threads; ++t) {
            Fiber& f = fibers_[t];
            if (!f.stack) f.stack.reset(new char[STACK]);
            f.context.start(f.stack.get(), STACK, entry);
            f.state = RUNNABLE;
        }
        for (;;) {
            bool ran = false;
            for (unsigned t = 0; t < threads; ++t) {
                if (fibers_[t].state != RUNNABLE) continue;
                threadIdx.x = t;
                current_ = t;
                FiberContext::swap(scheduler_, fibers_[t].context);
                ran = true;
            }
            unsigned live = 0, at_block = 0;
            for (unsigned t = 0; t < threads; ++t) {
                live += fibers_[t].state != DONE;
                at_block += fibers_[t].state == AT_BLOCK;
            }
            if (live == 0) return;
            bool released = false;
            if (at_block == live) {
                for (unsigned t = 0; t < threads; ++t) {
                    if (fibers_[t].state == AT_BLOCK) fibers_[t].state = RUNNABLE;
                }
                released = true;
            }
            for (unsigned w = 0; w * 32 < threads; ++w) {
                unsigned end = std::min(threads, w * 32 + 32), waiting = 0, alive = 0;
                for (unsigned t = w * 32; t < end; ++t) {
                    alive += fibers_[t].state != DONE;
                    waiting += fibers_[t].state == AT_WARP;
                }
                if (alive > 0 && waiting == alive) {
                    for (unsigned t = w * 32; t < end; ++t) {
                        if (fibers_[t].state == AT_WARP) fibers_[t].state = RUNNABLE;
                    }
                    released = true;
                }
            }
            if (!ran && !released) {
                fprintf(stderr,
                        "emulated GPU: deadlock in a kernel: the threads of block (%u, %u) "
                        "wait at barriers that cannot all be reached\n",
                        blockIdx.x, blockIdx.y);
                abort();
            }
        }
    }

    // The running thread waits for the others (`state` says which).
    void wait(State state) {
        unsigned t = current_;
        fibers_[t].state = state;
        FiberContext::swap(fibers_[t].context, scheduler_);
        threadIdx.x = t;
    }

  private:
    static constexpr size_t STACK = 64 * 1024;

    struct Fiber {
        FiberContext context;
        std::unique_ptr<char[]> stack;
        State state = DONE;
    };

    // Where each fiber starts: runs the kernel, then hands back to the scheduler for good.
    static void entry();

    std::vector<Fiber> fibers_;
    FiberContext scheduler_;
    unsigned current_ = 0;
    const std::function<void()>* kernel_ = nullptr;
};

static thread_local Block block_;

inline void Block::entry() {
    (*block_.kernel_)();
    unsigned t = block_.current_;
    block_.fibers_[t].state = DONE;
    FiberContext::swap(block_.fibers_[t].context, block_.scheduler_);
    abort();  // a finished fiber is never resumed
}

#define __syncthreads() block_.wait(Block::AT_BLOCK)

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
    block_.wait(Block::AT_WARP);
    T result = v;
    if (lane + offset < 32 && warp * 32 + lane + offset < blockDim.x) {
        std::memcpy(&result, &shuffle_[warp][lane + offset], sizeof(T));
    }
    block_.wait(Block::AT_WARP);
    return result;
}

// One OS thread per core, kept for the process; each takes blocks until none is left.
class BlockPool {
  public:
    void run(dim3 grid, unsigned threads, size_t smem, const std::function<void()>& kernel) {
        std::unique_lock<std::mutex> lock(mutex_);
        job_ = Job{&kernel, grid, threads, smem};
        next_ = 0;
        busy_ = workers_;
        ++generation_;
        start_.notify_all();
        lock.unlock();
        work_on(job_);
        lock.lock();
        done_.wait(lock, [&] { return busy_ == 0; });
    }

    BlockPool() {
        unsigned n = std::thread::hardware_concurrency();
        workers_ = n > 1 ? n - 1 : 0;
        for (unsigned i = 0; i < workers_; ++i) std::thread([this] { serve(); }).detach();
    }

  private:
    struct Job {
        const std::function<void()>* kernel;
        dim3 grid;
        unsigned threads;
        size_t smem;
    };

    void serve() {
        uint64_t seen = 0;
        for (;;) {
            Job job;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                start_.wait(lock, [&] { return generation_ != seen; });
                seen = generation_;
                job = job_;
            }
            work_on(job);
            std::lock_guard<std::mutex> lock(mutex_);
            if (--busy_ == 0) done_.notify_all();
        }
    }

    void work_on(const Job& job) {
        unsigned blocks = job.grid.x * job.grid.y * job.grid.z;
        for (unsigned b = next_++; b < blocks; b = next_++) {
            blockIdx.x = b % job.grid.x;
            blockIdx.y = (b / job.grid.x) % job.grid.y;
            blockIdx.z = b / (job.grid.x * job.grid.y);
            smem_.assign(job.smem + 16, 0);
            block_.run(job.threads, *job.kernel);
        }
    }

    std::mutex mutex_;
    std::condition_variable start_, done_;
    unsigned workers_ = 0, busy_ = 0;
    uint64_t generation_ = 0;
    Job job_{};
    std::atomic<unsigned> next_{0};
};

// Runs `kernel` over a grid of `grid` × `grid_y` (× `grid_z`) blocks of `block` threads
// with `dynamic_smem` bytes of dynamic shared memory. One launch at a time.
inline void launch(unsigned grid, unsigned block, size_t dynamic_smem,
                   const std::function<void()>& kernel, unsigned grid_y = 1,
                   unsigned grid_z = 1) {
    // Never destroyed: its threads wait on it until the process ends.
    static BlockPool* pool = new BlockPool;
    gridDim.x = grid;
    gridDim.y = grid_y;
    gridDim.z = grid_z;
    blockDim.x = block;
    pool->run(gridDim, block, dynamic_smem, kernel);
}
