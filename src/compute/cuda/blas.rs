//! The one cuBLAS product the backend needs, in its column-major terms: `C[m, n] = op(A) ·
//! B[k, n]`, bf16 inputs, f32 accumulation. A row-major `y[n, m] = x[n, k] · W[m, k]ᵀ` (what
//! `nn.Linear` computes) is this with A = W transposed, lda = ldb = k, ldc = m.

use std::ffi::c_void;

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys as blas;

use super::CudaError;

/// The element type of a product's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Bf16,
    F32,
}

impl Output {
    pub fn data_type(self) -> blas::cudaDataType_t {
        match self {
            Output::Bf16 => blas::cudaDataType_t::CUDA_R_16BF,
            Output::F32 => blas::cudaDataType_t::CUDA_R_32F,
        }
    }
}

/// Sizes and leading dimensions of one product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    pub a_transposed: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

impl Gemm {
    /// `y[n, m] = x[n, k] · W[m, k]ᵀ`, all row-major and packed.
    pub fn linear(m: usize, n: usize, k: usize) -> Gemm {
        Gemm {
            a_transposed: true,
            m,
            n,
            k,
            lda: k,
            ldb: k,
            ldc: m,
        }
    }
}

/// `count` products of one shape whose A, B and C lie `stride_*` elements apart (per-head
/// products such as MLA's query absorption).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    pub count: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
}

impl Batch {
    pub const ONE: Batch = Batch {
        count: 1,
        stride_a: 0,
        stride_b: 0,
        stride_c: 0,
    };
}

/// Queues one product on `blas`'s stream.
///
/// # Safety
/// `a`, `b` and `c` are device addresses of bf16 (bf16 or f32 for `c`) matrices of the
/// stated shapes and leading dimensions.
pub unsafe fn gemm(
    blas: &CudaBlas,
    shape: Gemm,
    a: u64,
    b: u64,
    c: u64,
    output: Output,
) -> Result<(), CudaError> {
    // SAFETY: as the caller vouches.
    unsafe { gemm_batched(blas, shape, Batch::ONE, a, b, c, output) }
}

/// Queues `batch.count` products of `shape` on `blas`'s stream.
///
/// # Safety
/// As [`gemm`], for each of the `batch.count` products at the strided addresses.
pub unsafe fn gemm_batched(
    blas: &CudaBlas,
    shape: Gemm,
    batch: Batch,
    a: u64,
    b: u64,
    c: u64,
    output: Output,
) -> Result<(), CudaError> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    let op_a = if shape.a_transposed {
        blas::cublasOperation_t::CUBLAS_OP_T
    } else {
        blas::cublasOperation_t::CUBLAS_OP_N
    };
    let bf16 = blas::cudaDataType_t::CUDA_R_16BF;
    // SAFETY: as the caller vouches; alpha and beta are host f32 for COMPUTE_32F.
    let status = unsafe {
        if batch.count == 1 {
            blas::cublasGemmEx(
                *blas.handle(),
                op_a,
                blas::cublasOperation_t::CUBLAS_OP_N,
                shape.m as i32,
                shape.n as i32,
                shape.k as i32,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                bf16,
                shape.lda as i32,
                b as *const c_void,
                bf16,
                shape.ldb as i32,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                output.data_type(),
                shape.ldc as i32,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        } else {
            blas::cublasGemmStridedBatchedEx(
                *blas.handle(),
                op_a,
                blas::cublasOperation_t::CUBLAS_OP_N,
                shape.m as i32,
                shape.n as i32,
                shape.k as i32,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                bf16,
                shape.lda as i32,
                batch.stride_a as i64,
                b as *const c_void,
                bf16,
                shape.ldb as i32,
                batch.stride_b as i64,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                output.data_type(),
                shape.ldc as i32,
                batch.stride_c as i64,
                batch.count as i32,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
    };
    status.result()?;
    Ok(())
}

/// What [`gemm_batched`] computes, on host f32 slices in cuBLAS's column-major terms (each
/// slice starting at the first product's matrix): for tests of the shapes and strides the
/// GPU code passes.
#[cfg(test)]
pub fn host_gemm(shape: Gemm, batch: Batch, a: &[f32], b: &[f32], c: &mut [f32]) {
    for p in 0..batch.count {
        let (a, b) = (&a[p * batch.stride_a..], &b[p * batch.stride_b..]);
        let c = &mut c[p * batch.stride_c..];
        for col in 0..shape.n {
            for row in 0..shape.m {
                let mut sum = 0.0;
                for i in 0..shape.k {
                    let a_value = if shape.a_transposed {
                        a[i + row * shape.lda]
                    } else {
                        a[row + i * shape.lda]
                    };
                    sum += a_value * b[i + col * shape.ldb];
                }
                c[row + col * shape.ldc] = sum;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_is_the_row_major_product_with_the_weights_transposed() {
        // y[n, m] = x[n, k] · W[m, k]ᵀ, as nn.Linear.
        let (m, n, k) = (3, 2, 4);
        let w: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 2.0).collect();
        let x: Vec<f32> = (0..n * k).map(|i| 1.0 - i as f32 * 0.25).collect();
        let mut y = vec![0.0; n * m];
        host_gemm(Gemm::linear(m, n, k), Batch::ONE, &w, &x, &mut y);
        for r in 0..n {
            for o in 0..m {
                let want: f32 = (0..k).map(|i| x[r * k + i] * w[o * k + i]).sum();
                assert_eq!(y[r * m + o], want);
            }
        }
    }
}
