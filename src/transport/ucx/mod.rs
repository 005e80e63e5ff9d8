//! [`UcxTransport`]: peers over UCX (shared memory, RDMA, TCP: whatever `UCX_TLS` allows and
//! the machine has), behind the same [`Transport`] seam as TCP, so the peer protocol, its
//! handshake and its failure handling are the same code whichever carries the bytes.
//!
//! - libucp is opened at run time ([`Library::load`], through the `ucx-sys` crate): a
//!   machine without UCX runs the same binary over TCP.
//! - Every link starts as TCP on the peer port, where the peer handshake authenticates both
//!   sides. Only then does each side offer UCX: it makes a worker for the link and sends the
//!   worker's address over that TCP connection; when both offered, each creates its endpoint
//!   from the other's address (`UCP_EP_PARAM_FIELD_REMOTE_ADDRESS`), and the link's bytes
//!   travel as UCX active messages, one per write (a frame, or a part of a large one): UCX
//!   sends small ones eagerly and large ones by rendezvous, where the receiver fetches the
//!   message into a buffer of its size (zero-copy where the transports allow it, e.g. RDMA).
//!   No `ucp_listener` exists: UCX 1.13's connection manager
//!   aborts the whole process on junk bytes at its port, and nothing but an authenticated
//!   peer ever reaches UCX this way. A peer without UCX (or whose UCX cannot reach ours)
//!   keeps the link on TCP.
//! - The TCP connection stays open as the link's control connection: nothing travels on it
//!   after the handshake, but its end (the peer exited, or dropped the link) ends the link at
//!   once, as a TCP link's would (see [`stream`]).
//! - Endpoints use `UCP_ERR_HANDLING_MODE_PEER`: a peer that dies or resets fails its
//!   stream's reads and writes, which the peer protocol treats as a lost link (fail over).
//! - One UCX worker per link (see [`worker`] for why), called by the link's tasks on the
//!   runtime's threads; a driver task per link waits on the worker's event fd when idle.

mod context;
mod endpoint;
mod events;
mod handle;
mod rows;
mod status;
mod stream;
mod worker;

use std::io;
use std::mem::ManuallyDrop;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures::FutureExt;
use futures::future::BoxFuture;

use context::Context;
pub use context::MemoryTypes;
use endpoint::EpShared;
use handle::WorkerHandle;
pub use rows::packs_rows;
pub use stream::UcxStream;
use worker::Worker;

use super::{LinkKind, LinkUpgrade, PeerListener, PeerStream, TcpTransport, Transport};

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
    ///
    /// Loading libucs (UCX 1.13) installs its own SIGHUP handler (`UCX_DEBUG_SIGNO`,
    /// default SIGHUP: "enter debug mode"), which would take `systemctl reload` away from the
    /// node: the handler in place before loading is put back.
    pub fn load(dir: Option<&Path>, search_system: bool) -> Result<Arc<Library>, String> {
        let hangup = SavedHandler::save(libc::SIGHUP);
        let loaded = ucx_sys::UcpLib::open(dir, search_system);
        if let Some(hangup) = hangup {
            hangup.restore();
        }
        let loaded = loaded.map_err(|e| e.to_string())?;
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

/// A signal's disposition, to put back after a library changed it.
struct SavedHandler {
    signal: libc::c_int,
    action: libc::sigaction,
}

impl SavedHandler {
    fn save(signal: libc::c_int) -> Option<SavedHandler> {
        // SAFETY: sigaction is plain data; zero is a valid starting value.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a null new action only reads the current one into a live struct.
        let read = unsafe { libc::sigaction(signal, std::ptr::null(), &mut action) };
        (read == 0).then_some(SavedHandler { signal, action })
    }

    fn restore(&self) {
        // SAFETY: puts back a disposition read from the kernel for the same signal.
        unsafe { libc::sigaction(self.signal, &self.action, std::ptr::null_mut()) };
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

/// Peers over UCX: TCP for the handshake, then UCX for the frames. Cloning shares the UCX
/// context.
#[derive(Clone)]
pub struct UcxTransport {
    tcp: TcpTransport,
    context: Arc<Context>,
    library: Arc<Library>,
    /// Links moved to UCX so far.
    links: Arc<AtomicU64>,
    /// The UCX transports the links' endpoints have used, each once.
    transports: Arc<Mutex<Vec<String>>>,
}

impl UcxTransport {
    /// Creates the UCX context. Fails when UCX cannot make it, e.g. `UCX_TLS` names no
    /// transport this machine has.
    pub fn start(library: Arc<Library>) -> io::Result<UcxTransport> {
        Ok(UcxTransport {
            tcp: TcpTransport::default(),
            context: Context::new(library.clone())?,
            library,
            links: Arc::new(AtomicU64::new(0)),
            transports: Arc::default(),
        })
    }

    pub fn library(&self) -> &Library {
        &self.library
    }

    /// The kinds of memory this UCX moves (host always; CUDA where it has the module and
    /// the driver).
    pub fn memory_types(&self) -> MemoryTypes {
        self.context.memory_types
    }

    /// Whether GPU rows may be handed to UCX as device pointers. They never are yet: the
    /// experts' rows reach a link through host memory (the GPU's pinned staging buffers),
    /// which every UCX takes. A UCX without CUDA memory must never get a device pointer (it
    /// would read it as host memory), so this is what that path will ask first.
    pub fn takes_cuda_memory(&self) -> bool {
        self.memory_types().cuda()
    }

    /// How many links this transport has moved to UCX (each side counts its own).
    pub fn links_moved(&self) -> u64 {
        self.links.load(Ordering::Relaxed)
    }

    /// The UCX transports (`tl/device`: `sysv/memory`, `tcp/lo`, ...) that the endpoints of
    /// this transport's links have used so far, each once.
    pub fn transports_used(&self) -> Vec<String> {
        self.transports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

fn stopped() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "the link's UCX worker is gone")
}

/// Drops `value` on the runtime's blocking threads when called on a runtime, else here. A
/// runtime shutting down refuses new blocking work and drops it on the calling thread. For
/// a link's worker handle: the last one destroys the worker, which may wait (up to half a
/// second) for its endpoint to close.
fn off_runtime<T: Send + 'static>(value: T) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn_blocking(move || drop(value));
        }
        Err(_) => drop(value),
    }
}

impl Transport for UcxTransport {
    /// A TCP connection: the handshake runs on it, then the link moves to UCX.
    fn connect(&self, addr: SocketAddr) -> BoxFuture<'static, io::Result<Box<dyn PeerStream>>> {
        self.tcp.connect(addr)
    }

    /// A TCP listener: UCX itself listens on nothing a stranger can reach before the
    /// handshake.
    fn bind(&self, addr: SocketAddr) -> BoxFuture<'static, io::Result<Box<dyn PeerListener>>> {
        self.tcp.bind(addr)
    }

    /// A new worker for the link, offered by its address.
    fn upgrade(&self) -> BoxFuture<'static, io::Result<Option<Box<dyn LinkUpgrade>>>> {
        let context = self.context.clone();
        let links = self.links.clone();
        let transports = self.transports.clone();
        async move {
            let (worker, address) = tokio::task::spawn_blocking(move || Worker::new(context))
                .await
                .map_err(|_| io::Error::other("the UCX worker start was cancelled"))??;
            let worker = WorkerHandle::start(worker)?;
            Ok(Some(Box::new(UcxLink {
                worker: Some(worker),
                address,
                ep: None,
                links,
                transports,
            }) as Box<dyn LinkUpgrade>))
        }
        .boxed()
    }
}

/// One side's UCX offer for one link: its worker, and the endpoint once made.
struct UcxLink {
    worker: Option<Arc<WorkerHandle>>,
    address: Vec<u8>,
    /// The endpoint, its shared state, and whether it packs rows.
    ep: Option<(u64, Arc<EpShared>, bool)>,
    links: Arc<AtomicU64>,
    transports: Arc<Mutex<Vec<String>>>,
}

impl Drop for UcxLink {
    /// Not taken (the peer offered no UCX, or a side failed): the worker and its endpoint go.
    fn drop(&mut self) {
        if let Some(worker) = self.worker.take() {
            off_runtime(worker);
        }
    }
}

impl LinkUpgrade for UcxLink {
    fn address(&self) -> &[u8] {
        &self.address
    }

    fn kind(&self) -> LinkKind {
        LinkKind::Ucx
    }

    fn connect(&mut self, address: &[u8]) -> BoxFuture<'_, io::Result<()>> {
        let remote = address.to_vec();
        async move {
            let worker = self.worker.as_ref().ok_or_else(stopped)?;
            let shared = Arc::new(EpShared::default());
            let connected = worker.connect(&remote, shared.clone())?;
            tracing::info!(
                transports = %connected.transports.join(", "),
                "UCX endpoint made for a peer link"
            );
            let mut used = self
                .transports
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for transport in connected.transports {
                if !used.contains(&transport) {
                    used.push(transport);
                }
            }
            drop(used);
            self.ep = Some((connected.ep, shared, connected.packs_rows));
            Ok(())
        }
        .boxed()
    }

    fn into_stream(mut self: Box<Self>, control: Box<dyn PeerStream>) -> Box<dyn PeerStream> {
        let worker = self.worker.take();
        let ep = self.ep.take();
        match (worker, ep) {
            (Some(worker), Some((ep, shared, packs_rows))) => {
                self.links.fetch_add(1, Ordering::Relaxed);
                Box::new(UcxStream::new(worker, ep, shared, packs_rows, control))
            }
            // connect() was not called or failed: the caller keeps the link on `control`
            // in that case, so this is not reached; stay on TCP regardless.
            (worker, _) => {
                if let Some(worker) = worker {
                    off_runtime(worker);
                }
                control
            }
        }
    }
}
