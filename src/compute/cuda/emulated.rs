//! The emulated CUDA device: GPUs that run on the CPU, so that the whole GPU path (every
//! cudarc call, the launch wrappers with their grids, shared memory and argument order, the
//! copies and their sizes, cuBLAS's shapes, the host orchestration) runs where there is no
//! GPU, with the same `kernels/*.cu` sources.
//!
//! The seam is the CUDA driver API itself. `kernels/emulated/` implements the part of the
//! driver, NVRTC and cuBLAS that moe-node uses, in C++; it is built here with g++ into three
//! libraries whose sonames are the ones cudarc asks the loader for (`libcuda.so`,
//! `libnvrtc.so`, `libcublas.so`), and loaded by path before cudarc's first call, so cudarc's
//! own lookups find them. Nothing above this file knows whether a GPU is emulated: the code
//! that runs is the code that runs on an H200. A seam of our own in front of cudarc would
//! have left cudarc's calls, and the code on the far side of it, unchecked.
//!
//! A process holds one CUDA driver: once emulated GPUs are loaded, every GPU of the process
//! is emulated (and the other way round). Slow (every CUDA thread is an OS thread); for
//! correctness, not speed. docs/gpus.md says what it checks and what it does not.

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use super::libs::{self, CudaLibrary, Loaded};

/// How many GPUs to emulate, and the memory of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmulatedGpus {
    pub count: usize,
    pub bytes: usize,
}

/// The emulation's sources, written into its build directory.
const SOURCES: &[(&str, &str)] = &[
    (
        "cuda_on_cpu.h",
        include_str!("../../../kernels/emulated/cuda_on_cpu.h"),
    ),
    (
        "module_entry.h",
        include_str!("../../../kernels/emulated/module_entry.h"),
    ),
    (
        "driver.cpp",
        include_str!("../../../kernels/emulated/driver.cpp"),
    ),
    (
        "nvrtc.cpp",
        include_str!("../../../kernels/emulated/nvrtc.cpp"),
    ),
    (
        "blas.cpp",
        include_str!("../../../kernels/emulated/blas.cpp"),
    ),
];

/// The libraries built, in the order they are loaded (the driver first: the others link
/// against it), each with the name cudarc asks for and a symbol it exports.
const LIBRARIES: &[(&str, &str, CudaLibrary)] = &[
    (
        "driver.cpp",
        "libcuda.so",
        CudaLibrary {
            what: "CUDA driver (emulated)",
            names: &[],
            symbol: "cuInit",
        },
    ),
    (
        "nvrtc.cpp",
        "libnvrtc.so",
        CudaLibrary {
            what: "NVRTC (emulated)",
            names: &[],
            symbol: "nvrtcVersion",
        },
    ),
    (
        "blas.cpp",
        "libcublas.so",
        CudaLibrary {
            what: "cuBLAS (emulated)",
            names: &[],
            symbol: "cublasCreate_v2",
        },
    ),
];

/// Where the emulation is built: `$MOE_NODE_EMULATED_CUDA_DIR`, else the user's cache
/// (`$XDG_CACHE_HOME` or `~/.cache`, `moe-node/emulated-cuda`), in a folder named after a
/// hash of the sources so that an upgrade builds afresh. Kernel modules are built there too.
fn build_dir() -> PathBuf {
    let base = std::env::var_os("MOE_NODE_EMULATED_CUDA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .unwrap_or_else(std::env::temp_dir)
                .join("moe-node/emulated-cuda")
        });
    let mut hash = Sha256::new();
    for (name, text) in SOURCES {
        hash.update(name.as_bytes());
        hash.update([0]);
        hash.update(text.as_bytes());
    }
    let digest = hash.finalize();
    base.join(
        digest[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>(),
    )
}

/// Builds the emulation (once per build directory), loads it and sets its GPUs. The
/// libraries loaded, for the log. Fails where g++ is missing or the build fails.
pub fn install(gpus: EmulatedGpus) -> Result<Vec<Loaded>, String> {
    let dir = build_dir();
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for (name, text) in SOURCES {
        write_if_changed(&dir.join(name), text)?;
    }
    let mut loaded = Vec::new();
    for (source, file, library) in LIBRARIES {
        let path = dir.join(file);
        if !path.exists() {
            build_library(&dir, source, file)?;
        }
        loaded.push(libs::open_path(*library, &path)?);
    }
    configure(gpus, &dir)?;
    Ok(loaded)
}

fn write_if_changed(path: &Path, text: &str) -> Result<(), String> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// g++ builds `source` into `file` (atomically: another process may be building it too).
fn build_library(dir: &Path, source: &str, file: &str) -> Result<(), String> {
    let tmp = format!("{file}.tmp{}", std::process::id());
    let mut command = Command::new("g++");
    command
        .current_dir(dir)
        .args(["-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-w"])
        .arg(source)
        .arg("-o")
        .arg(&tmp)
        .arg(format!("-Wl,-soname,{file}"));
    if file != "libcuda.so" {
        // The others call into the driver (allocations, module builds).
        command.args(["-L.", "-l:libcuda.so", "-Wl,-rpath,$ORIGIN"]);
    } else {
        command.arg("-ldl");
    }
    let out = command
        .output()
        .map_err(|e| format!("g++ is needed to emulate a GPU and could not run: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "building the emulated {file} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    std::fs::rename(dir.join(&tmp), dir.join(file)).map_err(|e| format!("{}: {e}", dir.display()))
}

/// The driver's `moe_emu_configure`: the GPUs and where kernel modules are built.
fn configure(gpus: EmulatedGpus, dir: &Path) -> Result<(), String> {
    let dir_c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| "NUL in the emulation's directory".to_string())?;
    type Configure = unsafe extern "C" fn(i32, u64, *const std::ffi::c_char) -> i32;
    let configure: Configure = libs::symbol("libcuda.so", "moe_emu_configure")?;
    // SAFETY: the driver copies the string; the numbers are checked there.
    let status = unsafe { configure(gpus.count as i32, gpus.bytes as u64, dir_c.as_ptr()) };
    if status != 0 {
        return Err(format!(
            "the emulated driver refused {} GPUs of {} bytes",
            gpus.count, gpus.bytes
        ));
    }
    Ok(())
}

/// What the emulated device did since the process started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Bytes copied host to device, device to host, within a GPU, between GPUs.
    pub host_to_device: u64,
    pub device_to_host: u64,
    pub device_to_device: u64,
    pub peer: u64,
    pub launches: u64,
    /// Bytes of device memory allocated now, over all GPUs.
    pub allocated: u64,
    pub gemms: u64,
    /// CUDA graphs launched (their kernels count in `launches` too).
    pub graph_launches: u64,
}

/// The emulated device's counters, or `None` where no emulated GPU is loaded.
pub fn counters() -> Option<Counters> {
    type Read = unsafe extern "C" fn(*mut u64, i32);
    let read: Read = libs::symbol("libcuda.so", "moe_emu_counters").ok()?;
    let mut out = [0u64; 8];
    // SAFETY: writes at most 8 values.
    unsafe { read(out.as_mut_ptr(), out.len() as i32) };
    Some(Counters {
        host_to_device: out[0],
        device_to_host: out[1],
        device_to_device: out[2],
        peer: out[3],
        launches: out[4],
        allocated: out[5],
        gemms: out[6],
        graph_launches: out[7],
    })
}
