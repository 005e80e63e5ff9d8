//! The ucp context every link's worker is made on, and what it tells of the memory UCX can
//! move ([`MemoryTypes`]: host always, CUDA only where the loaded UCX has it).

use std::io;
use std::sync::Arc;

use ucx_sys as sys;

use super::Library;
use super::rows::Bf16Rows;
use super::status::status_error;

/// A ucp context (active messages, wakeup), shared by every link's worker; cleaned up when the
/// last of them is gone.
pub struct Context {
    pub(super) library: Arc<Library>,
    pub(super) handle: sys::ucp_context_h,
    /// What kinds of memory the context moves (`ucp_context_query`).
    pub memory_types: MemoryTypes,
    /// The datatype bf16 rows move as (see [`super::rows`]); destroyed before the context.
    pub(super) bf16_rows: std::mem::ManuallyDrop<Bf16Rows>,
}

// SAFETY: the context is created with UCP_PARAM_FIELD_MT_WORKERS_SHARED, which makes it safe
// to create and destroy workers on it from several threads; the handle is only passed to UCX.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Creates the context. Fails with the UCX error when it cannot (no usable transport,
    /// a bad `UCX_*` variable).
    pub fn new(library: Arc<Library>) -> io::Result<Arc<Context>> {
        let ucp = &library.ucp;
        let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
        // SAFETY: null prefix and file mean "read UCX_* from the environment"; config is
        // written on success and released below.
        let status =
            unsafe { ucp.ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config) };
        if status != sys::UCS_OK {
            return Err(status_error(
                &library,
                "reading the UCX configuration",
                status,
            ));
        }
        if let Err(error) = allow_shared_memory(&library, config) {
            // SAFETY: config came from ucp_config_read and is not used after this.
            unsafe { ucp.ucp_config_release(config) };
            return Err(error);
        }
        // SAFETY: ucp_params_t is plain data; zero is "no field set" for the fields not
        // named in field_mask.
        let mut params: sys::ucp_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = (sys::UCP_PARAM_FIELD_FEATURES
            | sys::UCP_PARAM_FIELD_NAME
            | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED) as u64;
        params.features = (sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP) as u64;
        params.name = c"moe-node".as_ptr();
        params.mt_workers_shared = 1;
        let mut handle: sys::ucp_context_h = std::ptr::null_mut();
        // SAFETY: params and config are valid for the call; handle is written on success.
        let status = unsafe {
            ucp.ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config,
                &mut handle,
            )
        };
        // SAFETY: config came from ucp_config_read and is not used after this.
        unsafe { ucp.ucp_config_release(config) };
        if status != sys::UCS_OK {
            return Err(status_error(&library, "creating the UCX context", status));
        }
        // SAFETY: zeroed plain data, fields selected by field_mask.
        let mut attributes: sys::ucp_context_attr_t = unsafe { std::mem::zeroed() };
        attributes.field_mask = sys::UCP_ATTR_FIELD_MEMORY_TYPES as u64;
        // SAFETY: the context was just made; attributes is a live struct UCX fills.
        let status = unsafe { ucp.ucp_context_query(handle, &mut attributes) };
        if status != sys::UCS_OK {
            // SAFETY: the context is not used after this.
            unsafe { ucp.ucp_cleanup(handle) };
            return Err(status_error(&library, "querying the UCX context", status));
        }
        let bf16_rows = match Bf16Rows::new(library.clone()) {
            Ok(datatype) => datatype,
            Err(error) => {
                // SAFETY: the context is not used after this.
                unsafe { ucp.ucp_cleanup(handle) };
                return Err(error);
            }
        };
        Ok(Arc::new(Context {
            library,
            handle,
            memory_types: MemoryTypes::from_mask(attributes.memory_types),
            bf16_rows: std::mem::ManuallyDrop::new(bf16_rows),
        }))
    }
}

/// The kinds of memory a ucp context can move (`ucp_context_query`'s `memory_types`, one
/// bit per `ucs_memory_type_t`): host memory always; CUDA or ROCm memory only where the
/// loaded UCX has the modules for them and their driver loads (Debian's libucx0 has none;
/// PyPI's libucx-cu13 has CUDA's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryTypes(u64);

impl MemoryTypes {
    /// Each type's bit and name, as UCX names them (`ucs_memory_type_names`).
    const NAMES: [(sys::ucs_memory_type_t, &'static str); 5] = [
        (sys::UCS_MEMORY_TYPE_HOST, "host"),
        (sys::UCS_MEMORY_TYPE_CUDA, "cuda"),
        (sys::UCS_MEMORY_TYPE_CUDA_MANAGED, "cuda-managed"),
        (sys::UCS_MEMORY_TYPE_ROCM, "rocm"),
        (sys::UCS_MEMORY_TYPE_ROCM_MANAGED, "rocm-managed"),
    ];

    pub fn from_mask(mask: u64) -> MemoryTypes {
        MemoryTypes(mask)
    }

    /// Whether UCX takes pointers to CUDA device memory (`cuda_copy`, `cuda_ipc`, GPUDirect
    /// RDMA where the NIC allows).
    pub fn cuda(self) -> bool {
        self.has(sys::UCS_MEMORY_TYPE_CUDA)
    }

    fn has(self, kind: sys::ucs_memory_type_t) -> bool {
        self.0 & (1u64 << kind) != 0
    }

    /// The types' names, in UCX's order ("host", "cuda", ...).
    pub fn names(self) -> Vec<&'static str> {
        Self::NAMES
            .iter()
            .filter(|(kind, _)| self.has(*kind))
            .map(|(_, name)| *name)
            .collect()
    }
}

/// The `UCX_*` variables that choose whether UCX's shared-memory transports report peer
/// failure; a user who sets any of them decides.
const SHM_ERROR_HANDLING_VARS: [&str; 3] = [
    "UCX_MM_ERROR_HANDLING",
    "UCX_POSIX_ERROR_HANDLING",
    "UCX_SYSV_ERROR_HANDLING",
];

/// Turns on peer-failure reporting of the shared-memory transports (posix, sysv) unless the
/// environment says otherwise. Our endpoints ask for `UCP_ERR_HANDLING_MODE_PEER`, and UCX
/// (1.13 at least) leaves it off for shared memory by default, so without this two nodes on
/// one host are joined over UCX's TCP transport however `UCX_TLS` reads.
fn allow_shared_memory(library: &Library, config: *mut sys::ucp_config_t) -> io::Result<()> {
    if SHM_ERROR_HANDLING_VARS
        .iter()
        .any(|name| std::env::var_os(name).is_some())
    {
        return Ok(());
    }
    // SAFETY: config is a live configuration from ucp_config_read; the strings are
    // NUL-terminated literals. Names that are not ucp's own are kept by UCX and applied to
    // each transport's configuration as it opens.
    let status = unsafe {
        library
            .ucp
            .ucp_config_modify(config, c"MM_ERROR_HANDLING".as_ptr(), c"y".as_ptr())
    };
    if status != sys::UCS_OK {
        return Err(status_error(
            library,
            "turning on shared-memory peer-failure reporting (UCX_MM_ERROR_HANDLING)",
            status,
        ));
    }
    Ok(())
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: dropped once, here, and not used after: no worker is left to use it.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.bf16_rows) };
        // SAFETY: every worker made on the context holds an Arc to it, so none is left.
        unsafe { self.library.ucp.ucp_cleanup(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_types_are_read_from_ucx_bits() {
        let host = MemoryTypes::from_mask(1 << sys::UCS_MEMORY_TYPE_HOST);
        assert_eq!((host.names(), host.cuda()), (vec!["host"], false));
        let cuda = MemoryTypes::from_mask(
            1 << sys::UCS_MEMORY_TYPE_HOST
                | 1 << sys::UCS_MEMORY_TYPE_CUDA
                | 1 << sys::UCS_MEMORY_TYPE_CUDA_MANAGED,
        );
        assert_eq!(cuda.names(), vec!["host", "cuda", "cuda-managed"]);
        assert!(cuda.cuda());
        // Managed memory alone is not device memory UCX takes as such.
        assert!(!MemoryTypes::from_mask(1 << sys::UCS_MEMORY_TYPE_CUDA_MANAGED).cuda());
    }
}
