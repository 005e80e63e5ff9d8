//! Finding the CUDA libraries at run time. cudarc opens them by name the first time it needs
//! them and panics when it cannot; the node opens them first, here, so that a missing library
//! is a reason to log rather than a crash, so that CUDA 13's libraries are found in the usual
//! install directories even when the loader's path does not list them, and so that the log
//! can say which files were loaded.
//!
//! A library opened here stays loaded for the life of the process; when cudarc later asks the
//! loader for it by name, the loader hands back the copy already in memory.

use std::ffi::{CStr, c_void};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use libloading::Library;

/// One CUDA library: the names the loader is asked for (newest first) and a symbol it must
/// export, used to find which file was loaded.
#[derive(Debug, Clone, Copy)]
pub struct CudaLibrary {
    pub what: &'static str,
    pub names: &'static [&'static str],
    pub symbol: &'static str,
}

/// The driver comes with the GPU driver package, not the toolkit: found through the loader.
pub const DRIVER: CudaLibrary = CudaLibrary {
    what: "CUDA driver",
    names: &["libcuda.so.1", "libcuda.so"],
    symbol: "cuInit",
};

pub const NVRTC: CudaLibrary = CudaLibrary {
    what: "NVRTC",
    names: &["libnvrtc.so.13", "libnvrtc.so"],
    symbol: "nvrtcVersion",
};

/// cuBLAS needs cuBLASLt: loaded first from the same place so the dependency is met even
/// when the loader's path does not list the toolkit.
pub const CUBLAS_LT: CudaLibrary = CudaLibrary {
    what: "cuBLASLt",
    names: &["libcublasLt.so.13", "libcublasLt.so"],
    symbol: "cublasLtCreate",
};

pub const CUBLAS: CudaLibrary = CudaLibrary {
    what: "cuBLAS",
    names: &["libcublas.so.13", "libcublas.so"],
    symbol: "cublasCreate_v2",
};

/// A library that was loaded, and the file it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    pub what: &'static str,
    pub path: PathBuf,
}

/// Directories searched after the loader's own path: `extra` (the config's
/// `devices.cuda_lib_dir`), `$CUDA_HOME`, `$CUDA_PATH`, then the toolkit's usual homes.
pub fn search_dirs(extra: Option<&Path>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = extra.map(Path::to_path_buf).into_iter().collect();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            dirs.push(Path::new(&root).join("lib64"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    // Versioned installs (/usr/local/cuda-13.0), newest first.
    if let Ok(entries) = std::fs::read_dir("/usr/local") {
        let mut versioned: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("cuda-"))
            .map(|e| e.path().join("lib64"))
            .collect();
        versioned.sort();
        dirs.extend(versioned.into_iter().rev());
    }
    dirs
}

/// Libraries opened so far, with the file each came from. Never dropped: cudarc's handles
/// refer to the same objects.
static OPENED: Mutex<Vec<(PathBuf, Library)>> = Mutex::new(Vec::new());

fn keep(path: PathBuf, library: Library) {
    OPENED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((path, library));
}

/// Opens `lib` from the file `path` and keeps it loaded: the emulated device's libraries,
/// whose sonames are the names cudarc asks the loader for.
pub fn open_path(lib: CudaLibrary, path: &Path) -> Result<Loaded, String> {
    // SAFETY: loading the library runs its initialisers, which have no preconditions.
    let library = unsafe { Library::new(path) }
        .map_err(|e| format!("{}: {}: {e}", lib.what, path.display()))?;
    keep(path.to_path_buf(), library);
    Ok(Loaded {
        what: lib.what,
        path: path.to_path_buf(),
    })
}

/// The function `symbol` of the opened library whose file is named `file`.
///
/// `F` must be the function's true type (an `unsafe extern "C" fn`).
pub fn symbol<F: Copy>(file: &str, symbol: &str) -> Result<F, String> {
    let opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
    let (_, library) = opened
        .iter()
        .find(|(path, _)| path.file_name().is_some_and(|n| n == file))
        .ok_or_else(|| format!("{file} is not loaded"))?;
    // SAFETY: the caller names the symbol's true type; the library stays loaded for the
    // life of the process, so the pointer stays valid.
    unsafe { library.get::<F>(symbol.as_bytes()) }
        .map(|f| *f)
        .map_err(|e| format!("{file}: {symbol}: {e}"))
}

/// Opens `lib` by name through the loader, else from each of `dirs`, and keeps it loaded.
pub fn open(lib: CudaLibrary, dirs: &[PathBuf]) -> Result<Loaded, String> {
    let mut tried = Vec::new();
    let candidates = lib.names.iter().map(PathBuf::from).chain(
        dirs.iter()
            .flat_map(|d| lib.names.iter().map(|n| d.join(n))),
    );
    for candidate in candidates {
        // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions.
        match unsafe { Library::new(&candidate) } {
            Ok(library) => {
                let path = loaded_from(&library, lib.symbol).unwrap_or(candidate);
                keep(path.clone(), library);
                return Ok(Loaded {
                    what: lib.what,
                    path,
                });
            }
            Err(_) => tried.push(candidate.display().to_string()),
        }
    }
    Err(format!(
        "{} not found (tried {})",
        lib.what,
        summarise(&tried, lib.names.len())
    ))
}

/// The tried names, then the directories searched, without repeating every file name.
fn summarise(tried: &[String], per_dir: usize) -> String {
    let mut parts: Vec<String> = tried.iter().take(per_dir).cloned().collect();
    let dirs: Vec<String> = tried[per_dir.min(tried.len())..]
        .chunks(per_dir)
        .filter_map(|c| {
            Path::new(&c[0])
                .parent()
                .map(|p| p.display().to_string() + "/")
        })
        .collect();
    if !dirs.is_empty() {
        parts.push(format!("and in {}", dirs.join(", ")));
    }
    parts.join(", ")
}

/// The file `library` was loaded from, found through one of its symbols.
fn loaded_from(library: &Library, symbol: &str) -> Option<PathBuf> {
    let name = format!("{symbol}\0");
    // SAFETY: the symbol's address is only passed to dladdr, never called or read.
    let address: *const c_void = unsafe {
        let sym = library.get::<*const c_void>(name.as_bytes()).ok()?;
        *sym
    };
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr writes into `info` and reads nothing through `address`.
    if unsafe { libc::dladdr(address, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated path owned by the loader.
    let path = unsafe { CStr::from_ptr(info.dli_fname) };
    std::fs::canonicalize(path.to_string_lossy().as_ref()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_naming_what_was_tried() {
        let missing = CudaLibrary {
            what: "no such library",
            names: &["libmoe-node-absent.so.13"],
            symbol: "absent",
        };
        let dir = tempfile::tempdir().unwrap();
        let err = open(missing, &[dir.path().to_path_buf()]).unwrap_err();
        assert!(err.starts_with("no such library not found"), "{err}");
        assert!(err.contains("libmoe-node-absent.so.13"), "{err}");
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
    }

    #[test]
    fn a_loaded_library_reports_its_file() {
        // The C library is on every machine that runs these tests.
        let libc = CudaLibrary {
            what: "C library",
            names: &["libc.so.6"],
            symbol: "malloc",
        };
        let loaded = open(libc, &[]).unwrap();
        assert!(loaded.path.is_absolute(), "{:?}", loaded.path);
        assert!(
            loaded.path.to_string_lossy().contains("libc"),
            "{:?}",
            loaded.path
        );
    }
}
