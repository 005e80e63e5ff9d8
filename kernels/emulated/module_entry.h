// Appended to a kernel file compiled for the emulated CUDA device: one entry point per
// kernel, `moe_emu_kernel_NAME`, which the emulated cuLaunchKernel calls with the launch's
// sizes and the kernel parameters as cuLaunchKernel received them (an array of pointers to
// the values). The parameter types come from the kernel's own declaration, so the values
// are read exactly as a GPU would read the same argument buffer.

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

#define MOE_EMU_KERNEL(name)                                                          \
    extern "C" __attribute__((visibility("default"))) void moe_emu_kernel_##name(     \
        const unsigned* grid, unsigned block, std::size_t smem, void** params) {      \
        moe_emu_run(name, grid, block, smem, params);                                 \
    }
