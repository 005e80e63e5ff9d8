// The emulated CUDA device: the part of the CUDA driver API that moe-node uses (through
// cudarc), done on the CPU, built as a library with the soname libcuda.so so that cudarc's
// own loading finds it (src/compute/cuda/emulated.rs builds and loads it).
//
// "Device memory" is host memory with an inaccessible page on each side, so a kernel that
// reads or writes past its buffer stops the process with a message naming the kernel, as
// a real GPU would stop it with an illegal address; fresh allocations hold NaN bytes (0xff),
// so a kernel reading what nobody wrote shows it; every copy must lie inside one allocation;
// each emulated GPU has a memory size and allocations beyond it fail as on a GPU. Streams run
// in order: each operation is done when it is queued, so events and stream waits have
// nothing to wait for. While a stream captures a graph (cuStreamBeginCapture) its
// operations are recorded instead, kernel parameters copied as a GPU driver copies them,
// and cuGraphLaunch replays the list in order. A capture here is stricter than CUDA's: it
// takes no allocation or free and no copy to or from host memory (a graph whose buffers
// come and go, or that reads host memory at replay, is what moe-node's graphs must not
// be), and synchronous calls from the capturing thread invalidate it, as in CUDA's
// thread-local capture mode. Kernels are the very kernels/*.cu sources, compiled with g++ against
// cuda_on_cpu.h into one library per source (cached by a hash of the source); a launch calls
// the kernel's entry point (module_entry.h) with cuLaunchKernel's own parameter array.
//
// What this does not check: races between streams or between a copy and the host code that
// fills its source (everything here is done at once, in order), warp-level behaviour beyond
// what cuda_on_cpu.h models, timing and occupancy.

#include <dlfcn.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum : int {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_STATE = 401,
    ILLEGAL_ADDRESS = 700,
    LAUNCH_OUT_OF_RESOURCES = 701,
    LAUNCH_FAILED = 719,
    NOT_SUPPORTED = 801,
    STREAM_CAPTURE_UNSUPPORTED = 900,
    STREAM_CAPTURE_INVALIDATED = 901,
};

namespace {

struct Context {
    int device;
};

// One recorded stream operation, run when its graph is launched.
typedef std::function<CUresult()> Op;

struct Graph {
    int device;
    std::vector<Op> ops;
};

struct Stream {
    int device;
    // The graph being captured, while the stream captures.
    Graph* capture = nullptr;
    // Why the capture was invalidated; empty while it holds.
    std::string invalidated;
};

struct Event {
    int unused;
};

struct Module {
    int device;
    void* library;
};

typedef void (*Entry)(const unsigned* grid, unsigned block, size_t smem, void** params);
typedef int (*Sizes)(size_t* sizes, int max);

struct Function {
    int device;
    std::string name;
    Entry entry;
    Sizes sizes;
    int max_dynamic_smem = 48 * 1024;
};

struct Allocation {
    size_t size;       // as asked
    size_t reserved;   // the mapping, guard pages included
    void* base;        // the mapping
    int device;        // -1: pinned host memory
};

constexpr int MAX_GPUS = 16;
constexpr size_t PAGE = 4096;

std::mutex state_mutex;  // allocations, used bytes, modules, the error details
std::map<uintptr_t, Allocation> allocations;
size_t used[MAX_GPUS];
int gpu_count = 1;
size_t gpu_bytes = size_t(16) << 30;
std::string workdir = "/tmp";
bool initialized = false;
Context contexts[MAX_GPUS];
thread_local Context* current = nullptr;

std::mutex launch_mutex;  // one kernel at a time: the kernels' block state is global
std::atomic<const char*> running_kernel{nullptr};

std::atomic<unsigned long long> counters[8];
enum Counter { HTOD, DTOH, DTOD, PEER, LAUNCHES, ALLOCATED, GEMMS, GRAPH_LAUNCHES };

// Messages for cuGetErrorString: the last failure's detail, kept for the life of the process.
std::set<std::string> details;
std::map<CUresult, const char*> last_detail;

CUresult fail(CUresult code, const std::string& what) {
    std::lock_guard<std::mutex> lock(state_mutex);
    const std::string& kept = *details.insert("emulated GPU: " + what).first;
    last_detail[code] = kept.c_str();
    return code;
}

// The allocation holding [address, address + bytes), or null.
const Allocation* find_locked(uintptr_t address, size_t bytes, uintptr_t* start) {
    auto it = allocations.upper_bound(address);
    if (it == allocations.begin()) return nullptr;
    --it;
    if (address + bytes > it->first + it->second.size) return nullptr;
    *start = it->first;
    return &it->second;
}

std::string describe_locked(uintptr_t address, size_t bytes) {
    auto it = allocations.upper_bound(address);
    char text[256];
    if (it == allocations.begin()) {
        snprintf(text, sizeof text, "0x%lx (%zu bytes) is below every allocation",
                 (unsigned long)address, bytes);
        return text;
    }
    --it;
    long past = (long)(address + bytes) - (long)(it->first + it->second.size);
    snprintf(text, sizeof text,
             "0x%lx (%zu bytes) ends %ld bytes past the allocation of %zu bytes at 0x%lx",
             (unsigned long)address, bytes, past, it->second.size, (unsigned long)it->first);
    return text;
}

// Checks that [address, address + bytes) lies in one allocation; the device it is on.
CUresult check_range(const char* what, uintptr_t address, size_t bytes, int* device) {
    if (bytes == 0) return SUCCESS;
    std::string problem;
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        uintptr_t start;
        if (const Allocation* a = find_locked(address, bytes, &start)) {
            if (device) *device = a->device;
            return SUCCESS;
        }
        problem = describe_locked(address, bytes);
    }
    return fail(INVALID_VALUE, std::string(what) + ": " + problem);
}

struct sigaction previous_segv, previous_bus;

void on_fault(int sig, siginfo_t* info, void*) {
    const char* kernel = running_kernel.load();
    if (!kernel) {
        // Not ours (a Rust stack overflow, say): the handler that was there decides.
        sigaction(sig, sig == SIGSEGV ? &previous_segv : &previous_bus, nullptr);
        return;
    }
    char text[512];
    int n = snprintf(text, sizeof text,
                     "\nemulated GPU: illegal address 0x%lx in kernel %s: a read or write "
                     "outside every buffer (CUDA_ERROR_ILLEGAL_ADDRESS on a GPU)\n",
                     (unsigned long)info->si_addr, kernel);
    if (n > 0) {
        ssize_t ignored = write(2, text, (size_t)n < sizeof text ? n : sizeof text - 1);
        (void)ignored;
    }
    signal(sig, SIG_DFL);
}

void install_fault_handler() {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &action, &previous_segv);
    sigaction(SIGBUS, &action, &previous_bus);
}

CUresult need_context() {
    if (!initialized) return NOT_INITIALIZED;
    if (!current) return fail(INVALID_CONTEXT, "no current context on this thread");
    return SUCCESS;
}

// Streams capturing a graph whose capture began on this thread.
thread_local std::vector<Stream*> captures_here;

bool capturing(void* stream) { return stream && static_cast<Stream*>(stream)->capture; }

// Runs `op` now, or records it where `stream` captures a graph.
CUresult on_stream(void* stream, Op op) {
    if (!capturing(stream)) return op();
    Stream* s = static_cast<Stream*>(stream);
    if (!s->invalidated.empty()) return fail(STREAM_CAPTURE_INVALIDATED, s->invalidated);
    s->capture->ops.push_back(std::move(op));
    return SUCCESS;
}

CUresult invalidate(Stream* s, const std::string& what) {
    if (s->invalidated.empty()) s->invalidated = "the capture was invalidated by " + what;
    return fail(STREAM_CAPTURE_UNSUPPORTED, what + " while a graph is captured");
}

// Refuses, on a capturing stream, what a capture here does not take.
CUresult not_captured(void* stream, const char* what) {
    if (!capturing(stream)) return SUCCESS;
    return invalidate(static_cast<Stream*>(stream), what);
}

// Refuses a synchronous call from a thread that is capturing (CUDA's thread-local mode).
CUresult not_on_capturing_thread(const char* what) {
    CUresult r = SUCCESS;
    for (Stream* s : captures_here) r = invalidate(s, what);
    return r;
}

CUresult allocate(size_t bytes, int device, CUdeviceptr* out) {
    size_t rounded = (bytes == 0 ? 1 : bytes + 255) / 256 * 256;
    size_t data = (rounded + PAGE - 1) / PAGE * PAGE;
    size_t reserved = data + 2 * PAGE;
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        if (device >= 0 && used[device] + rounded > gpu_bytes) {
            char text[160];
            snprintf(text, sizeof text,
                     "GPU %d: %zu bytes asked, %zu of %zu in use", device, bytes,
                     used[device], gpu_bytes);
            const std::string& kept = *details.insert(std::string("emulated GPU: ") + text).first;
            last_detail[OUT_OF_MEMORY] = kept.c_str();
            return OUT_OF_MEMORY;
        }
        if (device >= 0) used[device] += rounded;
    }
    void* base = mmap(nullptr, reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
    if (base == MAP_FAILED) return fail(OUT_OF_MEMORY, "mmap failed");
    char* data_start = static_cast<char*>(base) + PAGE;
    mprotect(data_start, data, PROT_READ | PROT_WRITE);
    // Right against the guard page after it: running past the end faults.
    char* ptr = data_start + data - rounded;
    // What a GPU hands out is whatever was there: NaN bytes make reading it visible. Large
    // buffers (expert storage, KV caches) are left as mapped, so untouched pages cost nothing.
    if (rounded <= (size_t(16) << 20)) memset(ptr, 0xff, rounded);
    std::lock_guard<std::mutex> lock(state_mutex);
    allocations[(uintptr_t)ptr] = Allocation{rounded, reserved, base, device};
    if (device >= 0) counters[ALLOCATED] += rounded;
    *out = (CUdeviceptr)ptr;
    return SUCCESS;
}

CUresult release(uintptr_t ptr) {
    Allocation a;
    {
        std::lock_guard<std::mutex> lock(state_mutex);
        auto it = allocations.find(ptr);
        if (it == allocations.end()) {
            const std::string& kept =
                *details.insert("emulated GPU: freeing an address that is not an allocation").first;
            last_detail[INVALID_VALUE] = kept.c_str();
            return INVALID_VALUE;
        }
        a = it->second;
        allocations.erase(it);
        if (a.device >= 0) {
            used[a.device] -= a.size;
            counters[ALLOCATED] -= a.size;
        }
    }
    munmap(a.base, a.reserved);
    return SUCCESS;
}

CUresult copy(const char* what, uintptr_t dst, bool dst_device, uintptr_t src, bool src_device,
              size_t bytes) {
    int dst_gpu = -1, src_gpu = -1;
    if (dst_device) {
        if (CUresult r = check_range(what, dst, bytes, &dst_gpu)) return r;
    }
    if (src_device) {
        if (CUresult r = check_range(what, src, bytes, &src_gpu)) return r;
    }
    if (bytes) memmove((void*)dst, (const void*)src, bytes);
    if (dst_device && src_device) {
        counters[dst_gpu == src_gpu ? DTOD : PEER] += bytes;
    } else if (dst_device) {
        counters[HTOD] += bytes;
    } else {
        counters[DTOH] += bytes;
    }
    return SUCCESS;
}

uint64_t fnv1a(const std::string& text) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
    return h;
}

// The names of the kernels a source defines (`extern "C" __global__ void NAME(`).
std::vector<std::string> kernel_names(const std::string& source) {
    std::vector<std::string> names;
    const std::string marker = "__global__ void ";
    for (size_t at = source.find(marker); at != std::string::npos;
         at = source.find(marker, at + 1)) {
        size_t start = at + marker.size(), end = start;
        while (end < source.size() && (isalnum((unsigned char)source[end]) || source[end] == '_'))
            ++end;
        if (end > start) names.push_back(source.substr(start, end - start));
    }
    return names;
}

std::string library_path(const std::string& source) {
    char name[64];
    snprintf(name, sizeof name, "/module-%016llx.so", (unsigned long long)fnv1a(source));
    return workdir + name;
}

// Compiles `source` into the module library, unless it is there already.
bool build(const std::string& source, std::string* log) {
    std::string library = library_path(source);
    if (access(library.c_str(), R_OK) == 0) return true;
    // Dynamic shared memory is the one construct plain C++ has no spelling for.
    std::string body = source;
    const std::string dynamic = "extern __shared__ float smem[];";
    for (size_t at = body.find(dynamic); at != std::string::npos; at = body.find(dynamic, at)) {
        body.replace(at, dynamic.size(),
                     "float* smem = reinterpret_cast<float*>(smem_.data());");
    }
    std::string unit = "#include \"cuda_on_cpu.h\"\n" + body + "\n#include \"module_entry.h\"\n";
    for (const std::string& name : kernel_names(source)) unit += "MOE_EMU_KERNEL(" + name + ")\n";
    // Names of this build alone: another process, or another thread of this one (tests run
    // as threads), may be building the same source at the same time.
    static std::atomic<unsigned> builds{0};
    std::string stem = library.substr(0, library.size() - 3) + "-" + std::to_string(getpid()) +
                       "-" + std::to_string(builds++);
    std::string cpp = stem + ".cpp";
    std::string tmp = stem + ".tmp";
    FILE* f = fopen(cpp.c_str(), "w");
    if (!f) {
        *log = "cannot write " + cpp;
        return false;
    }
    fwrite(unit.data(), 1, unit.size(), f);
    fclose(f);
    // Each module keeps its own copy of the header's state (its block pool, its fibers):
    // nothing is exported but the entry points, and nothing is shared as a unique symbol.
    std::string command =
        "g++ -std=c++20 -O2 -fPIC -shared -pthread -w -fvisibility=hidden "
        "-fvisibility-inlines-hidden -fno-gnu-unique -Wl,-Bsymbolic -I '" + workdir +
                          "' '" + cpp + "' -o '" + tmp + "' 2>&1";
    FILE* out = popen(command.c_str(), "r");
    if (!out) {
        *log = "cannot run g++";
        return false;
    }
    char buffer[4096];
    size_t n;
    while ((n = fread(buffer, 1, sizeof buffer, out)) > 0) log->append(buffer, n);
    int status = pclose(out);
    unlink(cpp.c_str());
    if (status != 0) {
        unlink(tmp.c_str());
        if (log->empty()) *log = "g++ failed";
        return false;
    }
    return rename(tmp.c_str(), library.c_str()) == 0;
}

const char* const IMAGE_MAGIC = "MOE-EMULATED-CUDA-MODULE\n";

}  // namespace

extern "C" {

// Set by moe-node before cuInit: how many GPUs, how much memory each, where modules go.
int moe_emu_configure(int gpus, unsigned long long bytes, const char* dir) {
    if (gpus < 1 || gpus > MAX_GPUS || bytes == 0 || !dir) return INVALID_VALUE;
    std::lock_guard<std::mutex> lock(state_mutex);
    gpu_count = gpus;
    gpu_bytes = bytes;
    workdir = dir;
    return SUCCESS;
}

// Host↔device, device↔device and peer bytes copied, launches, bytes allocated now, GEMMs.
void moe_emu_counters(unsigned long long* out, int n) {
    for (int i = 0; i < n && i < 8; ++i) out[i] = counters[i].load();
}

void moe_emu_count_gemm() { counters[GEMMS] += 1; }

// For the emulated cuBLAS: runs `run(data)` now (its status returned), or records it where
// `stream` captures a graph (0 returned; a failure at the replay fails the launch); `drop`
// frees `data` once it is no longer needed. -1: the capture was invalidated.
int moe_emu_stream_op(void* stream, int (*run)(void*), void* data, void (*drop)(void*)) {
    if (!capturing(stream)) {
        int status = run(data);
        drop(data);
        return status;
    }
    std::shared_ptr<void> owned(data, drop);
    CUresult r = on_stream(stream, [run, owned] {
        return run(owned.get()) == 0
                   ? SUCCESS
                   : fail(LAUNCH_FAILED, "a cuBLAS product replayed from a graph failed");
    });
    return r == SUCCESS ? 0 : -1;
}

// For the emulated cuBLAS: 0 when [address, address + bytes) lies in one allocation.
int moe_emu_check_range(const char* what, unsigned long long address, size_t bytes) {
    return check_range(what, (uintptr_t)address, bytes, nullptr);
}

// For the emulated NVRTC: compiles a kernel source; the image cuModuleLoadData takes.
int moe_emu_build(const char* source, char** log) {
    std::string text;
    bool ok = build(source, &text);
    *log = strdup(text.c_str());
    return ok ? 0 : 1;
}

const char* moe_emu_image_magic() { return IMAGE_MAGIC; }

CUresult cuInit(unsigned) {
    std::lock_guard<std::mutex> lock(state_mutex);
    if (!initialized) {
        for (int i = 0; i < MAX_GPUS; ++i) contexts[i].device = i;
        install_fault_handler();
        initialized = true;
    }
    return SUCCESS;
}

CUresult cuDriverGetVersion(int* version) {
    *version = 13000;
    return SUCCESS;
}

CUresult cuDeviceGetCount(int* count) {
    if (!initialized) return NOT_INITIALIZED;
    *count = gpu_count;
    return SUCCESS;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
    if (!initialized) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= gpu_count) return INVALID_DEVICE;
    *device = ordinal;
    return SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice device) {
    if (device < 0 || device >= gpu_count) return INVALID_DEVICE;
    snprintf(name, len, "emulated GPU %d (on the CPU)", device);
    return SUCCESS;
}

CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice device) {
    if (device < 0 || device >= gpu_count) return INVALID_DEVICE;
    switch (attribute) {
        case 1: *value = 1024; break;          // max threads per block
        case 8: *value = 48 * 1024; break;     // shared memory per block
        case 10: *value = 32; break;           // warp size
        case 16: *value = 132; break;          // multiprocessors (an H100's)
        case 41: *value = 1; break;            // unified addressing
        case 75: *value = 9; break;            // compute capability 9.0
        case 76: *value = 0; break;
        case 97: *value = 227 * 1024; break;   // opt-in shared memory per block
        case 115: *value = 0; break;           // memory pools: no (cudarc allocates plainly)
        default: *value = 0;
    }
    return SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice device) {
    if (device < 0 || device >= gpu_count) return INVALID_DEVICE;
    *bytes = gpu_bytes;
    return SUCCESS;
}

CUresult cuDeviceCanAccessPeer(int* can, CUdevice, CUdevice) {
    *can = 1;
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice device) {
    if (!initialized) return NOT_INITIALIZED;
    if (device < 0 || device >= gpu_count) return INVALID_DEVICE;
    *ctx = &contexts[device];
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return SUCCESS; }

CUresult cuCtxSetCurrent(void* ctx) {
    current = static_cast<Context*>(ctx);
    return SUCCESS;
}

CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = current;
    return SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice* device) {
    if (CUresult r = need_context()) return r;
    *device = current->device;
    return SUCCESS;
}

CUresult cuCtxSynchronize() {
    if (CUresult r = need_context()) return r;
    return not_on_capturing_thread("cuCtxSynchronize");
}

CUresult cuCtxEnablePeerAccess(void*, unsigned) { return SUCCESS; }

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    if (CUresult r = need_context()) return r;
    std::lock_guard<std::mutex> lock(state_mutex);
    *total = gpu_bytes;
    *free_bytes = gpu_bytes - used[current->device];
    return SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr* ptr, size_t bytes) {
    if (CUresult r = need_context()) return r;
    if (CUresult r = not_on_capturing_thread("an allocation (cuMemAlloc)")) return r;
    return allocate(bytes, current->device, ptr);
}

CUresult cuMemAllocAsync(CUdeviceptr* ptr, size_t bytes, void* stream) {
    if (CUresult r = need_context()) return r;
    if (CUresult r = not_captured(stream, "an allocation (cuMemAllocAsync)")) return r;
    return allocate(bytes, current->device, ptr);
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    if (CUresult r = not_on_capturing_thread("a free (cuMemFree)")) return r;
    return release((uintptr_t)ptr);
}

CUresult cuMemFreeAsync(CUdeviceptr ptr, void* stream) {
    if (CUresult r = not_captured(stream, "a free (cuMemFreeAsync)")) return r;
    return release((uintptr_t)ptr);
}

CUresult cuMemHostAlloc(void** ptr, size_t bytes, unsigned) {
    if (CUresult r = need_context()) return r;
    CUdeviceptr p;
    if (CUresult r = allocate(bytes, -1, &p)) return r;
    *ptr = (void*)p;
    return SUCCESS;
}

CUresult cuMemAllocHost_v2(void** ptr, size_t bytes) { return cuMemHostAlloc(ptr, bytes, 0); }

CUresult cuMemFreeHost(void* ptr) { return release((uintptr_t)ptr); }

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t bytes) {
    if (CUresult r = not_on_capturing_thread("a synchronous copy")) return r;
    return copy("copy to the GPU", dst, true, (uintptr_t)src, false, bytes);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, void* stream) {
    if (CUresult r = not_captured(stream, "a copy from host memory")) return r;
    return copy("copy to the GPU", dst, true, (uintptr_t)src, false, bytes);
}

CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t bytes) {
    if (CUresult r = not_on_capturing_thread("a synchronous copy")) return r;
    return copy("copy from the GPU", (uintptr_t)dst, false, src, true, bytes);
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, void* stream) {
    if (CUresult r = not_captured(stream, "a copy to host memory")) return r;
    return copy("copy from the GPU", (uintptr_t)dst, false, src, true, bytes);
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
    if (CUresult r = not_on_capturing_thread("a synchronous copy")) return r;
    return copy("copy on the GPU", dst, true, src, true, bytes);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, void* stream) {
    return on_stream(stream, [=] { return copy("copy on the GPU", dst, true, src, true, bytes); });
}

CUresult cuMemcpyPeer(CUdeviceptr dst, void*, CUdeviceptr src, void*, size_t bytes) {
    if (CUresult r = not_on_capturing_thread("a synchronous copy")) return r;
    return copy("copy between GPUs", dst, true, src, true, bytes);
}

CUresult cuMemcpyPeerAsync(CUdeviceptr dst, void*, CUdeviceptr src, void*, size_t bytes,
                           void* stream) {
    return on_stream(stream,
                     [=] { return copy("copy between GPUs", dst, true, src, true, bytes); });
}

static CUresult memset8(CUdeviceptr dst, unsigned char value, size_t n) {
    if (CUresult r = check_range("memset", dst, n, nullptr)) return r;
    memset((void*)dst, value, n);
    return SUCCESS;
}

static CUresult memset32(CUdeviceptr dst, unsigned value, size_t n) {
    if (CUresult r = check_range("memset", dst, n * 4, nullptr)) return r;
    for (size_t i = 0; i < n; ++i) memcpy((char*)dst + 4 * i, &value, 4);
    return SUCCESS;
}

CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n) {
    if (CUresult r = not_on_capturing_thread("a synchronous memset")) return r;
    return memset8(dst, value, n);
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, void* stream) {
    return on_stream(stream, [=] { return memset8(dst, value, n); });
}

CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned value, size_t n) {
    if (CUresult r = not_on_capturing_thread("a synchronous memset")) return r;
    return memset32(dst, value, n);
}

CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned value, size_t n, void* stream) {
    return on_stream(stream, [=] { return memset32(dst, value, n); });
}

CUresult cuDeviceGetDefaultMemPool(void** pool, CUdevice device) {
    if (device < 0 || device >= gpu_count) return INVALID_DEVICE;
    *pool = &contexts[device];
    return SUCCESS;
}

CUresult cuMemPoolSetAttribute(void*, int, void*) { return SUCCESS; }

CUresult cuMemPoolGetAttribute(void*, int, void* value) {
    memset(value, 0, 8);
    return SUCCESS;
}

CUresult cuStreamCreate(void** stream, unsigned) {
    if (CUresult r = need_context()) return r;
    *stream = new Stream{current->device};
    return SUCCESS;
}

CUresult cuStreamCreateWithPriority(void** stream, unsigned flags, int) {
    return cuStreamCreate(stream, flags);
}

CUresult cuStreamDestroy_v2(void* stream) {
    Stream* s = static_cast<Stream*>(stream);
    if (s->capture) {
        std::erase(captures_here, s);
        delete s->capture;
    }
    delete s;
    return SUCCESS;
}

CUresult cuStreamSynchronize(void* stream) { return not_captured(stream, "cuStreamSynchronize"); }

CUresult cuStreamQuery(void* stream) { return not_captured(stream, "cuStreamQuery"); }

CUresult cuStreamWaitEvent(void*, void*, unsigned) { return SUCCESS; }

CUresult cuLaunchHostFunc(void* stream, void (*fn)(void*), void* data) {
    return on_stream(stream, [=] {
        fn(data);
        return SUCCESS;
    });
}

CUresult cuStreamBeginCapture_v2(void* stream, int) {
    if (CUresult r = need_context()) return r;
    if (!stream) return fail(STREAM_CAPTURE_UNSUPPORTED, "capturing the default stream");
    Stream* s = static_cast<Stream*>(stream);
    if (s->capture) return fail(ILLEGAL_STATE, "the stream already captures a graph");
    s->capture = new Graph{s->device, {}};
    s->invalidated.clear();
    captures_here.push_back(s);
    return SUCCESS;
}

CUresult cuStreamEndCapture(void* stream, void** graph) {
    Stream* s = static_cast<Stream*>(stream);
    *graph = nullptr;
    if (!s || !s->capture) return fail(ILLEGAL_STATE, "ending a capture that was not begun");
    if (std::find(captures_here.begin(), captures_here.end(), s) == captures_here.end()) {
        return fail(ILLEGAL_STATE, "ending a capture on another thread than the one that began it");
    }
    std::erase(captures_here, s);
    Graph* g = s->capture;
    s->capture = nullptr;
    if (!s->invalidated.empty()) {
        delete g;
        return fail(STREAM_CAPTURE_INVALIDATED, s->invalidated);
    }
    *graph = g;
    return SUCCESS;
}

CUresult cuStreamIsCapturing(void* stream, int* status) {
    Stream* s = static_cast<Stream*>(stream);
    *status = !capturing(stream) ? 0 : s->invalidated.empty() ? 1 : 2;
    return SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    if (!graph) return fail(INVALID_VALUE, "instantiating no graph");
    *exec = new Graph(*static_cast<Graph*>(graph));
    return SUCCESS;
}

CUresult cuGraphUpload(void*, void*) { return SUCCESS; }

// Replays the recorded operations in order; the first that fails ends the launch.
CUresult cuGraphLaunch(void* exec, void* stream) {
    if (CUresult r = need_context()) return r;
    Graph* g = static_cast<Graph*>(exec);
    if (stream && static_cast<Stream*>(stream)->device != g->device) {
        return fail(INVALID_HANDLE, "a graph launched on a stream of another GPU");
    }
    if (CUresult r = not_captured(stream, "a graph launch")) return r;
    for (const Op& op : g->ops) {
        if (CUresult r = op()) return r;
    }
    counters[GRAPH_LAUNCHES] += 1;
    return SUCCESS;
}

CUresult cuGraphExecDestroy(void* exec) {
    delete static_cast<Graph*>(exec);
    return SUCCESS;
}

CUresult cuGraphDestroy(void* graph) {
    delete static_cast<Graph*>(graph);
    return SUCCESS;
}

CUresult cuEventCreate(void** event, unsigned) {
    *event = new Event{0};
    return SUCCESS;
}

CUresult cuEventDestroy_v2(void* event) {
    delete static_cast<Event*>(event);
    return SUCCESS;
}

CUresult cuEventRecord(void*, void*) { return SUCCESS; }

CUresult cuEventSynchronize(void*) { return SUCCESS; }

CUresult cuEventQuery(void*) { return SUCCESS; }

CUresult cuEventElapsedTime(float* ms, void*, void*) {
    *ms = 0;
    return SUCCESS;
}

CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }

CUresult cuModuleLoadData(void** module, const void* image) {
    if (CUresult r = need_context()) return r;
    const char* text = static_cast<const char*>(image);
    size_t magic = strlen(IMAGE_MAGIC);
    if (strncmp(text, IMAGE_MAGIC, magic) != 0) {
        return fail(INVALID_IMAGE, "the image was not made by the emulated NVRTC");
    }
    std::string source(text + magic);
    std::string log;
    std::lock_guard<std::mutex> lock(launch_mutex);
    if (!build(source, &log)) return fail(INVALID_IMAGE, "compiling the module: " + log);
    void* library = dlopen(library_path(source).c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!library) return fail(INVALID_IMAGE, std::string("loading the module: ") + dlerror());
    *module = new Module{current->device, library};
    return SUCCESS;
}

CUresult cuModuleUnload(void* module) {
    // The library stays loaded: another module of the same source may share it.
    delete static_cast<Module*>(module);
    return SUCCESS;
}

CUresult cuModuleGetFunction(void** function, void* module, const char* name) {
    Module* m = static_cast<Module*>(module);
    std::string symbol = std::string("moe_emu_kernel_") + name;
    void* entry = dlsym(m->library, symbol.c_str());
    void* sizes = dlsym(m->library, (std::string("moe_emu_sizes_") + name).c_str());
    if (!entry || !sizes) return fail(NOT_FOUND, std::string("no kernel named ") + name);
    Function* f = new Function;
    f->device = m->device;
    f->name = name;
    f->entry = reinterpret_cast<Entry>(entry);
    f->sizes = reinterpret_cast<Sizes>(sizes);
    *function = f;
    return SUCCESS;
}

CUresult cuFuncSetAttribute(void* function, int attribute, int value) {
    Function* f = static_cast<Function*>(function);
    if (attribute == 8) {  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        if (value < 0 || value > 227 * 1024) return INVALID_VALUE;
        f->max_dynamic_smem = value;
    }
    return SUCCESS;
}

CUresult cuFuncGetAttribute(int* value, int attribute, void* function) {
    Function* f = static_cast<Function*>(function);
    *value = attribute == 0 ? 1024 : attribute == 8 ? f->max_dynamic_smem : 0;
    return SUCCESS;
}

static CUresult run_kernel(Function* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                    unsigned smem, void** params) {
    unsigned grid[3] = {gx, gy, gz};
    std::lock_guard<std::mutex> lock(launch_mutex);
    running_kernel.store(f->name.c_str());
    f->entry(grid, bx, smem, params);
    running_kernel.store(nullptr);
    counters[LAUNCHES] += 1;
    return SUCCESS;
}

CUresult cuLaunchKernel(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned smem, void* stream, void** params,
                        void** extra) {
    if (CUresult r = need_context()) return r;
    Function* f = static_cast<Function*>(function);
    if (stream && static_cast<Stream*>(stream)->device != f->device) {
        return fail(INVALID_HANDLE, f->name + ": launched on a stream of another GPU");
    }
    if (extra) return fail(NOT_SUPPORTED, f->name + ": launch with `extra` parameters");
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 ||
        gy > 65535 || gz > 65535 || bx * by * bz > 1024) {
        char text[200];
        snprintf(text, sizeof text, "%s: invalid launch grid (%u, %u, %u) block (%u, %u, %u)",
                 f->name.c_str(), gx, gy, gz, bx, by, bz);
        return fail(INVALID_VALUE, text);
    }
    if (by != 1 || bz != 1) return fail(NOT_SUPPORTED, f->name + ": blocks of more than one dimension");
    if ((int)smem > f->max_dynamic_smem) {
        char text[200];
        snprintf(text, sizeof text,
                 "%s: %u bytes of dynamic shared memory, over the %d the function allows",
                 f->name.c_str(), smem, f->max_dynamic_smem);
        return fail(LAUNCH_OUT_OF_RESOURCES, text);
    }
    if (!capturing(stream)) return run_kernel(f, gx, gy, gz, bx, smem, params);
    // Captured: the parameter values as they are now, since `params` is gone by the replay.
    size_t sizes[64];
    int n = f->sizes(sizes, 64);
    if (n > 64) return fail(NOT_SUPPORTED, f->name + ": more than 64 parameters");
    auto values = std::make_shared<std::vector<std::vector<char>>>();
    for (int i = 0; i < n; ++i) {
        const char* at = static_cast<const char*>(params[i]);
        values->emplace_back(at, at + sizes[i]);
    }
    return on_stream(stream, [=] {
        std::vector<void*> pointers;
        for (auto& value : *values) pointers.push_back(value.data());
        return run_kernel(f, gx, gy, gz, bx, smem, pointers.data());
    });
}

CUresult cuGetErrorName(CUresult code, const char** name) {
    static char text[32];
    snprintf(text, sizeof text, "CUDA_ERROR_%d", code);
    *name = code == SUCCESS ? "CUDA_SUCCESS" : text;
    return SUCCESS;
}

CUresult cuGetErrorString(CUresult code, const char** text) {
    std::lock_guard<std::mutex> lock(state_mutex);
    auto it = last_detail.find(code);
    *text = it != last_detail.end() ? it->second : "emulated GPU: error";
    return SUCCESS;
}

}  // extern "C"
