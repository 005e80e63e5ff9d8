//! [`UcxTransport`]: peers over UCX (shared memory, RDMA, TCP: whatever `UCX_TLS` allows and
//! the machine has), behind the same [`Transport`] seam as TCP, so the peer protocol, its
//! handshake and its failure handling are the same code whichever carries the bytes.
//!
//! - libucp is opened at run time ([`Library::load`], through the `ucx-sys` crate): a
//!   machine without UCX runs the same binary over TCP.
//! - Connections are made the way TCP's are: a `ucp_listener` on the peer address, clients
//!   connect to it by address (`UCP_EP_PARAM_FIELD_SOCK_ADDR`), so no worker addresses need
//!   exchanging. Each connection carries UCX's stream API: ordered bytes, like a socket.
//! - Endpoints use `UCP_ERR_HANDLING_MODE_PEER`: a peer that dies or resets fails its
//!   stream's reads and writes, which the peer protocol treats as a lost link (fail over).
//! - One worker thread per transport does all UCX calls and sleeps on the worker's event fd
//!   when idle (see [`worker`]).

mod sockaddr;
mod stream;
mod worker;

use std::io;
use std::mem::ManuallyDrop;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};

pub use stream::{UcxListener, UcxStream};
use worker::{ACCEPT_BACKLOG, Command, EpShared, WorkerHandle};

use super::{PeerListener, PeerStream, Transport};

/// UCX options moe-node wants unless the environment sets them: a restarted node binds its
/// peer address again while the old connections' sockets sit in TIME_WAIT, as a TCP
/// listener may (UCX reads these only from the environment, not `ucp_config_modify`).
pub const DEFAULT_ENV: [(&str, &str); 2] = [
    ("UCX_TCP_CM_REUSEADDR", "y"),
    ("UCX_RDMA_CM_REUSEADDR", "y"),
];

/// Sets [`DEFAULT_ENV`]'s variables the environment does not set.
///
/// # Safety
/// Changes the process environment: call it before any other thread runs (at the top of
/// `main`), as for [`std::env::set_var`].
pub unsafe fn set_default_env() {
    for (key, value) in DEFAULT_ENV {
        if std::env::var_os(key).is_none() {
            // SAFETY: the caller guarantees no other thread reads or writes the environment.
            unsafe { std::env::set_var(key, value) };
        }
    }
}

/// A loaded libucp (1.13 or newer).
pub struct Library {
    /// Never closed: UCX starts threads of its own (libucs's async thread) that may outlive
    /// every context, and unloading the library under them would crash the process.
    pub ucp: ManuallyDrop<ucx_sys::UcpLib>,
    /// The file the dynamic loader opened (resolved through symbolic links).
    pub file: PathBuf,
    /// `ucp_get_version`: (major, minor, release).
    pub version: (u32, u32, u32),
}

impl Library {
    /// Opens libucp from `dir` (when given), then, when `search_system`, from the dynamic
    /// loader's paths. The error lists every place tried and why each failed.
    pub fn load(dir: Option<&Path>, search_system: bool) -> Result<Arc<Library>, String> {
        let loaded = ucx_sys::UcpLib::open(dir, search_system).map_err(|e| e.to_string())?;
        let file = loaded_file(&loaded.lib).unwrap_or(loaded.opened);
        Ok(Arc::new(Library {
            ucp: ManuallyDrop::new(loaded.lib),
            file,
            version: loaded.version,
        }))
    }

    /// "1.13.1".
    pub fn version_string(&self) -> String {
        let (major, minor, release) = self.version;
        format!("{major}.{minor}.{release}")
    }
}

/// The file a function of `lib` lives in (dladdr), made canonical.
fn loaded_file(lib: &ucx_sys::UcpLib) -> Option<PathBuf> {
    let address = lib.ucp_get_version as *const libc::c_void;
    // SAFETY: Dl_info is plain data; dladdr fills it for an address inside a loaded object.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: address points into libucp, which stays loaded; info is a live struct.
    if unsafe { libc::dladdr(address, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader, valid while the
    // object is loaded (for good: see Library::ucp).
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(name.to_string_lossy().into_owned());
    Some(std::fs::canonicalize(&path).unwrap_or(path))
}

/// Peers over UCX. Cloning shares the worker thread.
#[derive(Clone)]
pub struct UcxTransport {
    worker: Arc<WorkerHandle>,
    library: Arc<Library>,
}

impl UcxTransport {
    /// Creates the UCX context and worker (on their own thread). Fails when UCX cannot make
    /// them, e.g. `UCX_TLS` names no transport this machine has.
    pub fn start(library: Arc<Library>) -> io::Result<UcxTransport> {
        Ok(UcxTransport {
            worker: WorkerHandle::start(library.clone())?,
            library,
        })
    }

    pub fn library(&self) -> &Library {
        &self.library
    }
}

fn stopped() -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        "the UCX worker thread has stopped",
    )
}

impl Transport for UcxTransport {
    /// Creates the endpoint; the connection is made in the background, and a peer that is
    /// not there fails the stream's first read (the peer handshake's timeout bounds it).
    fn connect(&self, addr: SocketAddr) -> BoxFuture<'static, io::Result<Box<dyn PeerStream>>> {
        let worker = self.worker.clone();
        async move {
            let shared = Arc::new(EpShared::default());
            let (reply, answer) = oneshot::channel();
            worker.send(Command::Connect {
                addr,
                shared: shared.clone(),
                reply,
            })?;
            let ep = answer.await.map_err(|_| stopped())??;
            Ok(Box::new(UcxStream::new(worker, ep, shared)) as Box<dyn PeerStream>)
        }
        .boxed()
    }

    fn bind(&self, addr: SocketAddr) -> BoxFuture<'static, io::Result<Box<dyn PeerListener>>> {
        let worker = self.worker.clone();
        async move {
            let (accepted_tx, accepted) = mpsc::channel(ACCEPT_BACKLOG);
            let (reply, answer) = oneshot::channel();
            worker.send(Command::Listen {
                addr,
                accepted: accepted_tx,
                reply,
            })?;
            let (id, local_addr) = answer.await.map_err(|_| stopped())??;
            Ok(Box::new(UcxListener {
                worker,
                id,
                local_addr,
                accepted,
            }) as Box<dyn PeerListener>)
        }
        .boxed()
    }
}
