// The emulated cuBLAS (soname libcublas.so): the two products moe-node asks of cuBLAS
// (cublasGemmEx and cublasGemmStridedBatchedEx, src/compute/cuda/blas.rs) on the CPU, in
// cuBLAS's column-major terms, with its precision rules for CUBLAS_COMPUTE_32F: bf16 (or f32)
// inputs read exactly, f32 accumulation, a bf16 output rounded to nearest even. cuBLAS's own
// argument checks are made (leading dimensions, types), and every matrix must lie inside one
// allocation of the emulated device (driver.cpp), where a GPU would fault. The checks are
// made at the call; the product runs in its stream's order (recorded, on a stream that
// captures a graph, and run at each replay, the matrices checked again then).

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

extern "C" int moe_emu_check_range(const char* what, unsigned long long address, size_t bytes);
extern "C" void moe_emu_count_gemm();
extern "C" int moe_emu_stream_op(void* stream, int (*run)(void*), void* data,
                                 void (*drop)(void*));

namespace {

enum : int {
    SUCCESS = 0,
    NOT_INITIALIZED = 1,
    INVALID_VALUE = 7,
    EXECUTION_FAILED = 13,
    NOT_SUPPORTED = 15,
};
enum : int { R_32F = 0, R_16BF = 14 };
enum : int { OP_N = 0, OP_T = 1 };
enum : int { COMPUTE_32F = 68 };

struct Handle {
    void* stream;
};

size_t element_size(int type) { return type == R_32F ? 4 : 2; }

float read(const void* base, int type, size_t i) {
    if (type == R_32F) return static_cast<const float*>(base)[i];
    uint32_t bits = (uint32_t) static_cast<const uint16_t*>(base)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

void write(void* base, int type, size_t i, float v) {
    if (type == R_32F) {
        static_cast<float*>(base)[i] = v;
        return;
    }
    uint32_t u;
    memcpy(&u, &v, 4);
    uint16_t out;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        out = (uint16_t)((u >> 16) | 0x40u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        out = (uint16_t)(u >> 16);
    }
    static_cast<uint16_t*>(base)[i] = out;
}

// Elements from a matrix's first to its last, for the range check.
size_t extent(int rows, int cols, int ld) {
    return rows == 0 || cols == 0 ? 0 : (size_t)(rows - 1) + (size_t)(cols - 1) * ld + 1;
}

// One strided batch of products, as cublasGemmStridedBatchedEx takes it (the scalars
// read from the host at the call, as cuBLAS's host pointer mode does).
struct Gemm {
    int transa, transb, m, n, k;
    float alpha;
    const void* a;
    int a_type, lda;
    long long stride_a;
    const void* b;
    int b_type, ldb;
    long long stride_b;
    float beta;
    void* c;
    int c_type, ldc;
    long long stride_c;
    int count, compute;
};

// Checks `g` and, with `run`, computes it.
int gemm(const Gemm& g, bool run) {
    auto [transa, transb, m, n, k, alpha, a, a_type, lda, stride_a, b, b_type, ldb, stride_b,
          beta, c, c_type, ldc, stride_c, count, compute] = g;
    if (compute != COMPUTE_32F) return NOT_SUPPORTED;
    for (int t : {a_type, b_type, c_type}) {
        if (t != R_32F && t != R_16BF) return NOT_SUPPORTED;
    }
    if ((transa != OP_N && transa != OP_T) || (transb != OP_N && transb != OP_T)) {
        return INVALID_VALUE;
    }
    int a_rows = transa == OP_N ? m : k, a_cols = transa == OP_N ? k : m;
    int b_rows = transb == OP_N ? k : n, b_cols = transb == OP_N ? n : k;
    if (m < 0 || n < 0 || k < 0 || count < 0 || lda < (a_rows > 1 ? a_rows : 1) ||
        ldb < (b_rows > 1 ? b_rows : 1) || ldc < (m > 1 ? m : 1)) {
        return INVALID_VALUE;
    }
    if (count == 0 || m == 0 || n == 0) return SUCCESS;
    const struct {
        const char* what;
        const void* base;
        int type;
        long long stride;
        size_t elements;
    } matrices[] = {
        {"cuBLAS matrix A", a, a_type, stride_a, extent(a_rows, a_cols, lda)},
        {"cuBLAS matrix B", b, b_type, stride_b, extent(b_rows, b_cols, ldb)},
        {"cuBLAS matrix C", c, c_type, stride_c, extent(m, n, ldc)},
    };
    for (const auto& mat : matrices) {
        size_t bytes = mat.elements * element_size(mat.type);
        for (int p : {0, count - 1}) {
            unsigned long long at =
                (unsigned long long)mat.base + (long long)p * mat.stride * element_size(mat.type);
            if (moe_emu_check_range(mat.what, at, bytes) != 0) return EXECUTION_FAILED;
        }
    }
    if (!run) return SUCCESS;
    for (int p = 0; p < count; ++p) {
        const char* ap = static_cast<const char*>(a) + p * stride_a * element_size(a_type);
        const char* bp = static_cast<const char*>(b) + p * stride_b * element_size(b_type);
        char* cp = static_cast<char*>(c) + p * stride_c * element_size(c_type);
        for (int col = 0; col < n; ++col) {
            for (int row = 0; row < m; ++row) {
                float sum = 0;
                for (int i = 0; i < k; ++i) {
                    size_t ai = transa == OP_N ? row + (size_t)i * lda : i + (size_t)row * lda;
                    size_t bi = transb == OP_N ? i + (size_t)col * ldb : col + (size_t)i * ldb;
                    sum += read(ap, a_type, ai) * read(bp, b_type, bi);
                }
                size_t ci = row + (size_t)col * ldc;
                float v = alpha * sum;
                if (beta != 0) v += beta * read(cp, c_type, ci);
                write(cp, c_type, ci, v);
            }
        }
    }
    moe_emu_count_gemm();
    return SUCCESS;
}

// Runs `work` in `stream`'s order (see moe_emu_stream_op).
int on_stream(void* stream, std::function<int()> work) {
    auto* held = new std::function<int()>(std::move(work));
    int status = moe_emu_stream_op(
        stream, [](void* w) { return (*static_cast<std::function<int()>*>(w))(); }, held,
        [](void* w) { delete static_cast<std::function<int()>*>(w); });
    return status < 0 ? EXECUTION_FAILED : status;
}

int gemm_on(void* handle, const Gemm& g) {
    if (!handle) return NOT_INITIALIZED;
    if (int status = gemm(g, false)) return status;
    return on_stream(static_cast<Handle*>(handle)->stream, [g] { return gemm(g, true); });
}

}  // namespace

extern "C" {

int cublasCreate_v2(void** handle) {
    *handle = new Handle{nullptr};
    return SUCCESS;
}

int cublasDestroy_v2(void* handle) {
    delete static_cast<Handle*>(handle);
    return SUCCESS;
}

int cublasSetStream_v2(void* handle, void* stream) {
    if (!handle) return NOT_INITIALIZED;
    static_cast<Handle*>(handle)->stream = stream;
    return SUCCESS;
}

int cublasSetMathMode(void*, int) { return SUCCESS; }

int cublasSetWorkspace_v2(void*, void*, size_t) { return SUCCESS; }

const char* cublasGetStatusString(int status) {
    switch (status) {
        case SUCCESS: return "CUBLAS_STATUS_SUCCESS";
        case INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
        case NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
        default: return "CUBLAS_STATUS_UNKNOWN";
    }
}

int cublasGemmEx(void* handle, int transa, int transb, int m, int n, int k, const void* alpha,
                 const void* a, int a_type, int lda, const void* b, int b_type, int ldb,
                 const void* beta, void* c, int c_type, int ldc, int compute, int) {
    return gemm_on(handle, Gemm{transa, transb, m, n, k, *static_cast<const float*>(alpha), a,
                                a_type, lda, 0, b, b_type, ldb, 0,
                                *static_cast<const float*>(beta), c, c_type, ldc, 0, 1,
                                compute});
}

int cublasGemmStridedBatchedEx(void* handle, int transa, int transb, int m, int n, int k,
                               const void* alpha, const void* a, int a_type, int lda,
                               long long stride_a, const void* b, int b_type, int ldb,
                               long long stride_b, const void* beta, void* c, int c_type,
                               int ldc, long long stride_c, int count, int compute, int) {
    return gemm_on(handle, Gemm{transa, transb, m, n, k, *static_cast<const float*>(alpha), a,
                                a_type, lda, stride_a, b, b_type, ldb, stride_b,
                                *static_cast<const float*>(beta), c, c_type, ldc, stride_c,
                                count, compute});
}

// Groups of products whose matrices are given by arrays of device pointers (one per
// product, in device memory); sizes, leading dimensions and scalars per group, on the host.
int cublasGemmGroupedBatchedEx(void* handle, const int* transa, const int* transb,
                               const int* m, const int* n, const int* k, const void* alpha,
                               const void* const* a, int a_type, const int* lda,
                               const void* const* b, int b_type, const int* ldb,
                               const void* beta, void* const* c, int c_type, const int* ldc,
                               int group_count, const int* group_size, int compute) {
    if (!handle) return NOT_INITIALIZED;
    if (group_count < 0) return INVALID_VALUE;
    size_t problems = 0;
    for (int g = 0; g < group_count; ++g) {
        if (group_size[g] < 0) return INVALID_VALUE;
        problems += group_size[g];
    }
    for (const void* array : {(const void*)a, (const void*)b, (const void*)c}) {
        if (problems && moe_emu_check_range("cuBLAS pointer array", (unsigned long long)array,
                                            problems * sizeof(void*)) != 0) {
            return EXECUTION_FAILED;
        }
    }
    // The per-group values are the host's, read now; the pointer arrays are device memory,
    // read when the products run.
    struct Group {
        int transa, transb, m, n, k, lda, ldb, ldc, size;
        float alpha, beta;
    };
    std::vector<Group> groups;
    for (int g = 0; g < group_count; ++g) {
        groups.push_back(Group{transa[g], transb[g], m[g], n[g], k[g], lda[g], ldb[g], ldc[g],
                               group_size[g], static_cast<const float*>(alpha)[g],
                               static_cast<const float*>(beta)[g]});
    }
    auto products = [=](bool run) {
        size_t p = 0;
        for (const Group& g : groups) {
            for (int i = 0; i < g.size; ++i, ++p) {
                int status = gemm(Gemm{g.transa, g.transb, g.m, g.n, g.k, g.alpha, a[p], a_type,
                                       g.lda, 0, b[p], b_type, g.ldb, 0, g.beta, c[p], c_type,
                                       g.ldc, 0, 1, compute},
                                  run);
                if (status != SUCCESS) return status;
            }
        }
        return (int)SUCCESS;
    };
    return on_stream(static_cast<Handle*>(handle)->stream, [products] { return products(true); });
}

}  // extern "C"
