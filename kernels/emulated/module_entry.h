// Appended to a kernel file compiled for the emulated CUDA device: one entry point per
// kernel, `moe_emu_kernel_NAME`, which the emulated cuLaunchKernel calls with the launch's
// sizes and the kernel parameters as cuLaunchKernel received them (an array of pointers to
// the values). The parameter types come from the kernel's own declaration, so the values
// are read exactly as a GPU would read the same argument buffer. A second entry point per
// kernel, `moe_emu_sizes_NAME`, gives the parameters' sizes.

#include <cstddef>
#include <type_traits>
#include <utility>

template <class... A, std::size_t... I>
inline void moe_emu_call(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(params[I])...);
}

template <class... A>
inline void moe_emu_run(void (*kernel)(A...), const unsigned* grid, unsigned block,
                        std::size_t smem, void** params) {
    launch(grid[0], block, smem,
           [=] { moe_emu_call(kernel, params, std::index_sequence_for<A...>{}); }, grid[1],
           grid[2]);
}

// The byte size of each parameter, for a launch captured into a graph: the driver copies
// the values then, as a GPU driver does, since the caller's array is gone by the replay.
template <class... A>
inline int moe_emu_sizes(void (*)(A...), std::size_t* sizes, int max) {
    const std::size_t each[] = {sizeof(std::remove_cv_t<std::remove_reference_t<A>>)..., 0};
    int n = (int)sizeof...(A);
    for (int i = 0; i < n && i < max; ++i) sizes[i] = each[i];
    return n;
}

#define MOE_EMU_KERNEL(name)                                                          \
    extern "C" __attribute__((visibility("default"))) void moe_emu_kernel_##name(     \
        const unsigned* grid, unsigned block, std::size_t smem, void** params) {      \
        moe_emu_run(name, grid, block, smem, params);                                 \
    }                                                                                 \
    extern "C" __attribute__((visibility("default"))) int moe_emu_sizes_##name(       \
        std::size_t* sizes, int max) {                                                \
        return moe_emu_sizes(name, sizes, max);                                       \
    }
