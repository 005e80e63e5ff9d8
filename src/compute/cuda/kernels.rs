//! The CUDA kernels: `kernels/*.cu`, embedded in the binary, compiled with NVRTC for the GPU
//! found at start-up and cached on disk by a hash of the source, the options, the NVRTC
//! version and the architecture, so a restart does not compile again.

use std::ffi::{CStr, c_char, c_int};
use std::path::{Path, PathBuf};

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule, LaunchConfig};
use cudarc::nvrtc::{Ptx, result, sys};
use sha2::{Digest, Sha256};

use super::{CudaError, GpuInfo};

/// Prepended to every kernel file: bf16 helpers and block reductions.
const PRELUDE: &str = include_str!("../../../kernels/prelude.cuh");

/// One kernel file.
#[derive(Debug, Clone, Copy)]
pub struct KernelFile {
    pub file: &'static str,
    pub source: &'static str,
    /// The functions it defines (`extern "C"`), loaded by name.
    pub functions: &'static [&'static str],
}

pub const MOE: KernelFile = KernelFile {
    file: "moe.cu",
    source: include_str!("../../../kernels/moe.cu"),
    functions: &[
        "gate_topk",
        "count_experts",
        "expert_offsets",
        "scatter_pairs",
        "gather_rows",
        "combine_rows",
        "swiglu",
        "add_group_bias",
        "to_bf16",
        "to_f32",
        "grouped_gemv",
        "grouped_gemv_fp8",
        "grouped_gemv_int4",
        "widen_fp8",
        "widen_int4",
        "fill_dummy",
    ],
};

pub const DENSE: KernelFile = KernelFile {
    file: "dense.cu",
    source: include_str!("../../../kernels/dense.cu"),
    functions: &[
        "rms_norm",
        "rope",
        "attend",
        "add_rows",
        "add_bias",
        "copy_rows",
        "store_rows",
        "sigmoid_gate",
        "scale_rows_by_sigmoid",
        "scale_by_temperature",
        "attend_tiles",
    ],
};

pub const LINEAR: KernelFile = KernelFile {
    file: "linear.cu",
    source: include_str!("../../../kernels/linear.cu"),
    functions: &[
        "gather_state",
        "scatter_state",
        "causal_conv",
        "conv_window",
        "gated_delta",
        "gated_rms_norm",
    ],
};

pub const ALL: &[KernelFile] = &[MOE, DENSE, LINEAR];

/// Options every file is compiled with. Precise division, square root and exp: the
/// kernels are checked against the CPU backend.
const OPTIONS: &[&str] = &["--std=c++17", "--fmad=true"];

/// Where a compiled image came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Compiled,
    Cached,
}

/// A compiled kernel file: a cubin for one architecture.
#[derive(Debug)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub origin: Origin,
}

/// NVRTC's version, e.g. (13, 0). Needs NVRTC loaded (see `libs`).
pub fn nvrtc_version() -> Result<(i32, i32), sys::nvrtcResult> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    match status {
        sys::nvrtcResult::NVRTC_SUCCESS => Ok((major, minor)),
        e => Err(e),
    }
}

/// The cache file name of `kernel` compiled for `arch` by NVRTC `version`.
pub fn cache_name(kernel: &KernelFile, arch: &str, version: (i32, i32)) -> String {
    let mut hash = Sha256::new();
    for part in [PRELUDE, kernel.source, &OPTIONS.join(" "), arch] {
        hash.update(part.as_bytes());
        hash.update([0]);
    }
    hash.update(format!("nvrtc {}.{}", version.0, version.1).as_bytes());
    let digest = hash.finalize();
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let stem = kernel.file.trim_end_matches(".cu");
    format!("{stem}-{arch}-{hex}.cubin")
}

/// `kernel` as a cubin for `arch` (`sm_90`): from `cache_dir` when it was compiled before,
/// else compiled now and written there (atomically: a rename).
pub fn load(
    kernel: &KernelFile,
    arch: &str,
    cache_dir: Option<&Path>,
) -> Result<Compiled, CudaError> {
    let version = nvrtc_version().map_err(|e| CudaError::Compile {
        file: kernel.file,
        arch: arch.into(),
        log: format!("NVRTC is not usable: {e:?}"),
    })?;
    let path: Option<PathBuf> = cache_dir.map(|d| d.join(cache_name(kernel, arch, version)));
    if let Some(path) = &path
        && let Ok(cubin) = std::fs::read(path)
    {
        return Ok(Compiled {
            cubin,
            origin: Origin::Cached,
        });
    }
    let started = std::time::Instant::now();
    let cubin = compile(kernel, arch)?;
    tracing::info!(
        file = kernel.file,
        arch,
        ms = started.elapsed().as_millis() as u64,
        "kernels compiled"
    );
    if let Some(path) = &path {
        let cache_error = |e: std::io::Error| CudaError::Cache {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(cache_error)?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, &cubin).map_err(cache_error)?;
        std::fs::rename(&tmp, path).map_err(cache_error)?;
    }
    Ok(Compiled {
        cubin,
        origin: Origin::Compiled,
    })
}

/// What NVRTC compiles for `kernel`: the prelude, then the file (line numbers in messages
/// are the file's own).
pub fn full_source(kernel: &KernelFile) -> String {
    format!("{PRELUDE}\n#line 1 \"{}\"\n{}", kernel.file, kernel.source)
}

/// `kernel` compiled for `gpu` (or read from `cache_dir`) and loaded into `ctx`. A cached
/// image the driver refuses (after a driver update, or damaged) is compiled again.
pub fn load_module(
    ctx: &Arc<CudaContext>,
    kernel: &KernelFile,
    gpu: &GpuInfo,
    cache_dir: Option<&Path>,
) -> Result<Arc<CudaModule>, CudaError> {
    let compiled = load(kernel, &gpu.sm(), cache_dir)?;
    match ctx.load_module(Ptx::from_binary(compiled.cubin)) {
        Ok(module) => Ok(module),
        Err(e) if compiled.origin == Origin::Cached => {
            tracing::warn!(gpu = gpu.ordinal, file = kernel.file, error = %e, "cached kernels refused: compiling again");
            let cubin = compile(kernel, &gpu.sm())?;
            Ok(ctx.load_module(Ptx::from_binary(cubin))?)
        }
        Err(e) => Err(e.into()),
    }
}

/// A launch over `n` elements for a grid-stride loop: enough blocks to fill the GPU, no more.
pub fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 4096) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Compiles `kernel` to a cubin for `arch` with NVRTC.
pub fn compile(kernel: &KernelFile, arch: &str) -> Result<Vec<u8>, CudaError> {
    let fail = |log: String| CudaError::Compile {
        file: kernel.file,
        arch: arch.into(),
        log,
    };
    let source =
        std::ffi::CString::new(full_source(kernel)).map_err(|_| fail("NUL in source".into()))?;
    let name = std::ffi::CString::new(kernel.file).map_err(|_| fail("NUL in name".into()))?;
    let program =
        result::create_program(&source, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    let mut options: Vec<String> = OPTIONS.iter().map(|o| o.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    // SAFETY: `program` is a valid program until destroyed below.
    let compiled = unsafe { result::compile_program(program, &options) };
    let outcome = match compiled {
        Ok(()) => cubin(program).map_err(|e| fail(format!("reading the cubin: {e:?}"))),
        Err(e) => Err(fail(format!("{e:?}\n{}", program_log(program)))),
    };
    // SAFETY: destroyed once, after its last use.
    let _ = unsafe { result::destroy_program(program) };
    outcome
}

fn cubin(program: sys::nvrtcProgram) -> Result<Vec<u8>, sys::nvrtcResult> {
    let mut size = 0usize;
    // SAFETY: `program` compiled successfully; NVRTC writes `size` bytes into the buffer.
    unsafe {
        check(sys::nvrtcGetCUBINSize(program, &mut size))?;
        let mut out = vec![0u8; size];
        check(sys::nvrtcGetCUBIN(program, out.as_mut_ptr() as *mut c_char))?;
        Ok(out)
    }
}

fn check(status: sys::nvrtcResult) -> Result<(), sys::nvrtcResult> {
    match status {
        sys::nvrtcResult::NVRTC_SUCCESS => Ok(()),
        e => Err(e),
    }
}

fn program_log(program: sys::nvrtcProgram) -> String {
    // SAFETY: the log is a NUL-terminated string NVRTC copies into our buffer.
    match unsafe { result::get_program_log(program) } {
        Ok(log) => unsafe { CStr::from_ptr(log.as_ptr()) }
            .to_string_lossy()
            .trim()
            .to_string(),
        Err(e) => format!("(no log: {e:?})"),
    }
}

/// NVRTC's list of the architectures it can compile for, as `sm_NN`.
pub fn supported_archs() -> Result<Vec<String>, sys::nvrtcResult> {
    let mut count: c_int = 0;
    // SAFETY: NVRTC writes `count` ints into the buffer.
    unsafe {
        check(sys::nvrtcGetNumSupportedArchs(&mut count))?;
        let mut archs = vec![0 as c_int; count.max(0) as usize];
        check(sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()))?;
        Ok(archs.into_iter().map(|a| format!("sm_{a}")).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::cuda::libs;

    /// NVRTC needs no GPU: where it is installed (CI installs it from PyPI) the kernels are
    /// compiled for the H100/H200 architecture here. Set `MOE_TEST_REQUIRE_NVRTC=1` to make
    /// its absence a failure rather than a skip.
    fn nvrtc_or_skip() -> bool {
        match libs::open(libs::NVRTC, &libs::search_dirs(None)) {
            Ok(_) => true,
            Err(e) if std::env::var_os("MOE_TEST_REQUIRE_NVRTC").is_some() => {
                panic!("MOE_TEST_REQUIRE_NVRTC is set: {e}")
            }
            Err(e) => {
                // Past the harness's capture, so that the skip shows in the log.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "SKIPPED: kernels not compiled: {e}");
                false
            }
        }
    }

    #[test]
    fn every_kernel_file_compiles_for_sm90_and_is_cached() {
        if !nvrtc_or_skip() {
            return;
        }
        assert!(supported_archs().unwrap().contains(&"sm_90".to_string()));
        let cache = tempfile::tempdir().unwrap();
        for kernel in ALL {
            let first = load(kernel, "sm_90", Some(cache.path())).unwrap();
            assert_eq!(first.origin, Origin::Compiled);
            // An ELF image with every function the host code loads by name.
            assert_eq!(&first.cubin[..4], b"\x7fELF", "{}", kernel.file);
            for function in kernel.functions {
                let found = first
                    .cubin
                    .windows(function.len() + 1)
                    .any(|w| &w[..function.len()] == function.as_bytes() && w[function.len()] == 0);
                assert!(found, "{} lacks {function}", kernel.file);
            }
            let second = load(kernel, "sm_90", Some(cache.path())).unwrap();
            assert_eq!(second.origin, Origin::Cached);
            assert_eq!(second.cubin, first.cubin);
        }
    }

    #[test]
    fn a_kernel_that_does_not_compile_reports_nvrtcs_log() {
        if !nvrtc_or_skip() {
            return;
        }
        let broken = KernelFile {
            file: "broken.cu",
            source: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
            functions: &["k"],
        };
        let err = compile(&broken, "sm_90").unwrap_err().to_string();
        assert!(err.contains("broken.cu"), "{err}");
        assert!(err.contains("undefined_name"), "{err}");
    }

    #[test]
    fn the_cache_name_changes_with_source_arch_and_version() {
        let a = cache_name(&MOE, "sm_90", (13, 0));
        assert!(a.starts_with("moe-sm_90-") && a.ends_with(".cubin"), "{a}");
        assert_ne!(a, cache_name(&MOE, "sm_80", (13, 0)));
        assert_ne!(a, cache_name(&MOE, "sm_90", (13, 1)));
        let edited = KernelFile {
            source: "// edited\n",
            ..MOE
        };
        assert_ne!(a, cache_name(&edited, "sm_90", (13, 0)));
    }
}
