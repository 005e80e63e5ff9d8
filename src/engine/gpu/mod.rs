//! An engine whose routed experts (and optionally dense part) run on one GPU of this
//! process: `moe-node generate --backend cuda` and the reference tests on every backend.
//! (A serving node reaches its GPUs through device actors instead.) [`model`] is the dense
//! part of the forward pass on a GPU.

pub mod model;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::Engine;
use super::generate::PREFILL_CHUNK;
use crate::compute::cuda::{self, CudaError};
use crate::experts::gpu::{GpuLocalExperts, GpuOptions, LoadError};
use crate::model::{ModelConfig, ModelSource};

/// Why DeepSeek-V4's dense part goes to no GPU: what the GPU backend lacks of it
/// ([`super::DEEPSEEK_V4_APART`]). Its experts go (their clamp is the SwiGLU kernel's
/// [`SwiGluActivation::Clamped`](crate::compute::quant::SwiGluActivation::Clamped), read off
/// each loaded expert by the expert loader).
pub fn deepseek_v4_refused(config: &ModelConfig) -> Option<CudaError> {
    config.deepseek_v4.as_ref().map(|_| {
        CudaError::Unsupported(format!(
            "{}: the GPU backend has no {}",
            config.model_type,
            super::DEEPSEEK_V4_APART
        ))
    })
}

/// An engine for the model in `dir` with its routed experts on GPU `ordinal`, and its dense
/// part too when `dense` is set (else that runs on the CPU). `lib_dir` as
/// `devices.cuda_lib_dir`.
pub fn engine_on_gpu(
    source: &ModelSource,
    ordinal: usize,
    dense: bool,
    lib_dir: Option<&Path>,
    kernel_cache: Option<PathBuf>,
) -> Result<Engine, LoadError> {
    let runtime = cuda::runtime(lib_dir)?;
    let gpu = runtime.gpus.get(ordinal).ok_or_else(|| {
        CudaError::Unavailable(format!(
            "GPU {ordinal} does not exist (the driver reports {})",
            runtime.gpus.len()
        ))
    })?;
    let memory_fraction = 0.9;
    let mut engine = Engine::load_with::<LoadError>(source, |checkpoint, config| {
        let options = GpuOptions {
            max_rows: PREFILL_CHUNK * config.moe.top_k,
            memory_fraction,
            kernel_cache: kernel_cache.clone(),
        };
        let experts = GpuLocalExperts::load(gpu, &options, checkpoint, config)?;
        Ok(Arc::new(experts))
    })?;
    if dense {
        engine.place_dense_on_gpu(gpu, memory_fraction, kernel_cache.as_deref())?;
    }
    Ok(engine)
}
