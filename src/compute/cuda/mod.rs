//! The CUDA backend, through cudarc with every library loaded at run time: one binary runs
//! on machines with and without a GPU. [`runtime`] finds the driver, NVRTC and cuBLAS and
//! lists the GPUs; [`kernels`] compiles `kernels/*.cu` with NVRTC (cached by source hash and
//! architecture); [`experts`] holds experts in GPU memory as stored ([`storage`]) and runs token groups
//! through them with grouped GEMMs. What runs a model on a GPU is above this folder: the
//! dense part in `crate::engine::gpu`, the experts in `crate::experts::gpu`.

pub mod blas;
pub mod dense;
pub mod emulated;
pub mod experts;
pub mod kernels;
pub mod layer;
mod libs;
pub mod linear;
pub mod moe;
pub mod storage;

use std::path::Path;
use std::sync::OnceLock;

use cudarc::driver::{DriverError, result, sys};

pub use emulated::EmulatedGpus;
pub use experts::GpuExperts;
pub use libs::Loaded;

/// One GPU the driver reports.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability, e.g. (9, 0) for an H100 or H200.
    pub arch: (i32, i32),
    pub total_bytes: usize,
}

impl GpuInfo {
    /// The NVRTC architecture name: `sm_90`.
    pub fn sm(&self) -> String {
        format!("sm_{}{}", self.arch.0, self.arch.1)
    }
}

/// What was found: the GPUs and the libraries loaded to use them.
#[derive(Debug, Clone)]
pub struct CudaRuntime {
    pub gpus: Vec<GpuInfo>,
    pub libraries: Vec<Loaded>,
    pub driver_version: i32,
    pub nvrtc_version: (i32, i32),
    /// Set when the GPUs are emulated on the CPU ([`emulated`]).
    pub emulated: Option<EmulatedGpus>,
}

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No GPU can be used here; the text says why.
    #[error("{0}")]
    Unavailable(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    #[error("cuBLAS: {0:?}")]
    Blas(cudarc::cublas::result::CublasError),
    #[error("compiling kernels/{file} for {arch}: {log}")]
    Compile {
        file: &'static str,
        arch: String,
        log: String,
    },
    #[error("kernel cache {path}: {reason}")]
    Cache { path: String, reason: String },
    #[error(
        "GPU {gpu}: the {experts} experts placed on it need {need_mib} MiB with their \
         work buffers, but {usable_mib} MiB may be used ({free_mib} MiB free × \
         devices.gpu_memory_fraction); add GPUs or nodes, or lower devices.replication"
    )]
    DoesNotFit {
        gpu: usize,
        experts: usize,
        need_mib: usize,
        usable_mib: usize,
        free_mib: usize,
    },
    #[error(
        "GPU {gpu}: the dense part of the model needs {need_mib} MiB of weights but {usable_mib} \
         MiB may be used (devices.gpu_memory_fraction of what is free); set \
         devices.dense_on_gpu = false to keep it on the CPU"
    )]
    DenseDoesNotFit {
        gpu: usize,
        need_mib: usize,
        usable_mib: usize,
    },
    /// A shape the kernels do not take.
    #[error("not supported on the GPU: {0}")]
    Unsupported(String),
    #[error(
        "the GPU's KV cache is full: {needed} more blocks needed, {free} of {blocks} free \
         (batching.kv_cache_mib, or what the GPU had left)"
    )]
    KvCacheFull {
        needed: usize,
        free: usize,
        blocks: usize,
    },
    #[error("{rows} rows for one expert, but the GPU work area takes {max_rows}")]
    TooManyRows { rows: usize, max_rows: usize },
    #[error("GPU {gpu} self-check: {reason}")]
    SelfCheck { gpu: usize, reason: String },
}

impl CudaError {
    /// A GPU missing while required, or too small for its experts: a deployment problem
    /// that a restart does not fix (exit 78 under systemd's RestartPreventExitStatus).
    pub fn is_deployment_problem(&self) -> bool {
        matches!(
            self,
            CudaError::Unavailable(_)
                | CudaError::DoesNotFit { .. }
                | CudaError::DenseDoesNotFit { .. }
        )
    }
}

impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        CudaError::Blas(e)
    }
}

static RUNTIME: OnceLock<Result<CudaRuntime, String>> = OnceLock::new();

/// The process's CUDA runtime, found on first use; `lib_dir` (the config's
/// `devices.cuda_lib_dir`) is searched for the toolkit's libraries then. Where emulated GPUs
/// were loaded first ([`emulated_runtime`]), those.
pub fn runtime(lib_dir: Option<&Path>) -> Result<&'static CudaRuntime, CudaError> {
    RUNTIME
        .get_or_init(|| detect(lib_dir))
        .as_ref()
        .map_err(|reason| CudaError::Unavailable(reason.clone()))
}

/// The process's CUDA runtime on `gpus` emulated GPUs, built and loaded on first use. A
/// process that found the real driver first cannot emulate GPUs, nor one that emulates
/// others: one CUDA driver per process.
pub fn emulated_runtime(gpus: EmulatedGpus) -> Result<&'static CudaRuntime, CudaError> {
    let runtime = RUNTIME
        .get_or_init(|| detect_emulated(gpus))
        .as_ref()
        .map_err(|reason| CudaError::Unavailable(reason.clone()))?;
    match runtime.emulated {
        Some(loaded) if loaded == gpus => Ok(runtime),
        Some(loaded) => Err(CudaError::Unavailable(format!(
            "this process already emulates {} GPUs of {} MiB",
            loaded.count,
            loaded.bytes >> 20
        ))),
        None => Err(CudaError::Unavailable(
            "this process already uses the real CUDA driver; GPUs cannot also be emulated".into(),
        )),
    }
}

fn detect(lib_dir: Option<&Path>) -> Result<CudaRuntime, String> {
    // The driver ships with the GPU driver, never with the toolkit (whose lib64/stubs holds a
    // stub that only links): only the loader's path is searched for it.
    let driver = libs::open(libs::DRIVER, &[])?;
    result::init().map_err(|e| format!("the CUDA driver did not start: {e}"))?;
    let dirs = libs::search_dirs(lib_dir);
    let mut libraries = vec![driver];
    for lib in [libs::NVRTC, libs::CUBLAS_LT, libs::CUBLAS] {
        libraries.push(libs::open(lib, &dirs)?);
    }
    describe(libraries, None)
}

fn detect_emulated(gpus: EmulatedGpus) -> Result<CudaRuntime, String> {
    let libraries = emulated::install(gpus)?;
    result::init().map_err(|e| format!("the emulated CUDA driver did not start: {e}"))?;
    describe(libraries, Some(gpus))
}

/// The GPUs and versions the loaded driver reports.
fn describe(libraries: Vec<Loaded>, emulated: Option<EmulatedGpus>) -> Result<CudaRuntime, String> {
    let count = result::device::get_count().map_err(|e| format!("counting GPUs: {e}"))?;
    if count == 0 {
        return Err("the CUDA driver reports no GPU".into());
    }
    let mut driver_version = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(|e| format!("driver version: {e}"))?;
    let nvrtc_version = kernels::nvrtc_version().map_err(|e| format!("NVRTC: {e:?}"))?;
    let gpus = (0..count as usize)
        .map(gpu_info)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("reading GPU properties: {e}"))?;
    Ok(CudaRuntime {
        gpus,
        libraries,
        driver_version,
        nvrtc_version,
        emulated,
    })
}

fn gpu_info(ordinal: usize) -> Result<GpuInfo, DriverError> {
    let dev = result::device::get(ordinal as i32)?;
    use sys::CUdevice_attribute::*;
    // SAFETY: `dev` is a valid device handle from the driver.
    let (major, minor, total_bytes) = unsafe {
        (
            result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            result::device::total_mem(dev)?,
        )
    };
    Ok(GpuInfo {
        ordinal,
        name: result::device::get_name(dev)?,
        arch: (major, minor),
        total_bytes,
    })
}

/// Logs what was found, once per start.
pub fn log_runtime(rt: &CudaRuntime) {
    for lib in &rt.libraries {
        tracing::info!(library = lib.what, path = %lib.path.display(), "CUDA library loaded");
    }
    for gpu in &rt.gpus {
        tracing::info!(
            gpu = gpu.ordinal,
            name = %gpu.name,
            arch = %gpu.sm(),
            gib = gpu.total_bytes >> 30,
            driver = rt.driver_version,
            nvrtc = %format!("{}.{}", rt.nvrtc_version.0, rt.nvrtc_version.1),
            "GPU found"
        );
    }
}
