//! The UCX workers: one per link, each owning one ucp worker (on the transport's shared
//! [`Context`]) and the link's one endpoint, behind a mutex (the worker is created
//! `UCS_THREAD_MODE_SERIALIZED`: any thread may call UCX for it, one at a time).
//!
//! One worker per link, not one per node: endpoints made from worker addresses are paired by
//! UCX in the order each side creates them toward the same remote worker, so two links made
//! at once between the same two workers (each node dialling the other) could be crossed.
//! A worker that only ever has one peer endpoint cannot be.
//!
//! The link's tasks call UCX themselves through [`WorkerHandle`], on the runtime's threads:
//! a write hands its bytes to `ucp_am_send_nbx` at once, a read that finds nothing progresses
//! the worker before it waits. What arrives while nobody is reading is picked up by the
//! link's driver task, which waits on the worker's event fd (`ucp_worker_get_efd`, armed with
//! `ucp_worker_arm`) in the runtime's reactor, so an idle link spends no CPU, and wakes the
//! reader and writer through the endpoint's [`EpShared`] (bytes received, sends completed,
//! the endpoint's failure). No thread of our own and no hand-off between threads stand
//! between a task and UCX.
//!
//! Each message carries an AM header: its sequence number on the link (8 bytes), and for a
//! frame's rows sent apart from its header the code of their wire dtype (8 more): those are
//! received into f32 rows, decoded as they arrive ([`Payload::Rows`]).
//!
//! UCX callbacks only record what happened (a thread-local event list); each call into UCX
//! under the mutex handles the events before it lets go, so no callback re-enters the
//! worker's state and no event outlives the lock it was recorded under.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::Waker;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use ucx_sys as sys;

use super::Library;
use super::rows::{Bf16Rows, UnpackTarget};
use crate::transport::wire::{self, Dtype, RowsFrame};

/// The active-message id the link's bytes travel under (one handler per worker).
const AM_BYTES: u32 = 1;
/// The longest message a link sends (a bigger write goes as several): a peer announcing a
/// longer one is broken, and fails the link rather than have us allocate what it says (at
/// most twice this, for bf16 rows decoded to f32).
pub const MESSAGE_MAX: usize = 8 << 20;
/// How many messages past the last one filed a message may arrive (UCX may complete a
/// message split over several lanes after a later one); beyond this the peer is broken.
const OUT_OF_ORDER_MAX: u64 = 1024;
/// Messages up to this size are sent eagerly (UCX may pick rendezvous from a few KiB, whose
/// extra handshake costs a small message more than the copy it saves); larger ones always by
/// rendezvous: zero-copy where the transports allow it (RDMA; shared memory's `cma` only
/// without peer-failure endpoints, in UCX 1.13), and the receiver fetches each only when its
/// reader keeps up (eager ones it takes as they come: the peer protocol bounds how many
/// requests a link has outstanding).
const EAGER_MAX: usize = 64 << 10;
/// Bytes received (in memory: rows as f32) and not yet read by the endpoint's reader before
/// no more rendezvous messages are fetched (UCX then holds them at the sender, which waits).
pub const RECV_BUFFERED_MAX: usize = 32 << 20;
/// Bytes handed to UCX and not yet sent before writers wait.
pub const SEND_PENDING_MAX: usize = 32 << 20;
/// The longest the driver task waits without progressing the worker: a safety net, so UCX's
/// timers (keepalive of `UCP_ERR_HANDLING_MODE_PEER`) run even if no event fd fires.
const IDLE_TICK: Duration = Duration::from_millis(100);
/// How long the driver keeps progressing a worker with a transfer in flight (a send or a
/// rendezvous fetch not complete) after its last work, before it sleeps on the event fd: the
/// next FIFO's worth of a large message usually follows within microseconds, and a wake-up
/// through the reactor costs more. A worker with nothing in flight (waiting for the peer to
/// answer) sleeps at once rather than take a core from the work it waits for.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(50);
/// The most `ucp_worker_progress` calls one progress pass makes before it handles what they
/// recorded and lets go of the worker.
const PROGRESS_CALLS: usize = 64;
/// How long stopping waits for endpoints to close before the worker is destroyed.
const STOP_GRACE: Duration = Duration::from_millis(500);

/// What one endpoint's stream halves and its worker share.
#[derive(Default)]
pub struct EpShared {
    state: Mutex<EpState>,
}

#[derive(Default)]
pub struct EpState {
    /// Received, not yet read.
    pub received: Received,
    /// Send buffers whose sends completed, for the writer's next writes (no fresh
    /// allocation, and no first-touch page faults, per write).
    pub spare_send: Vec<Vec<u8>>,
    /// The worker stopped fetching rendezvous messages (too much unread); the reader asks it
    /// to resume.
    pub recv_paused: bool,
    /// Bytes handed to UCX whose sends have not completed.
    pub send_pending: usize,
    /// Why the endpoint is unusable: the peer failed or closed, or a send or receive failed.
    pub failure: Option<Failure>,
    pub read_waker: Option<Waker>,
    pub write_waker: Option<Waker>,
}

/// Send buffers an endpoint keeps for reuse at most, and the largest kept.
const SPARE_SEND: usize = 4;
const SPARE_SEND_BYTES: usize = 8 << 20;
/// Receive buffers are kept for reuse when their capacity lies in this range (smaller ones
/// cost little to allocate; larger ones would pin memory for a rare message), a few at most.
const KEEP_BUFFER_MIN: usize = 64 << 10;
const KEEP_BUFFER_MAX: usize = 16 << 20;
const SPARE_BUFFERS: usize = 8;

fn worth_keeping(capacity: usize) -> bool {
    (KEEP_BUFFER_MIN..=KEEP_BUFFER_MAX).contains(&capacity)
}

/// The smallest of `buffers` that holds `capacity` bytes, taken out.
fn take_best_fit(buffers: &mut Vec<Vec<u8>>, capacity: usize) -> Option<Vec<u8>> {
    let (i, _) = buffers
        .iter()
        .enumerate()
        .filter(|(_, b)| b.capacity() >= capacity)
        .min_by_key(|(_, b)| b.capacity())?;
    Some(buffers.swap_remove(i))
}

/// One received message as the reader takes it.
#[derive(Debug, PartialEq)]
pub enum Payload {
    /// Bytes of the link's stream, exactly as received.
    Bytes(Vec<u8>),
    /// The rows of the frame whose header and groups came just before as bytes, already
    /// decoded to f32 as they were received (see [`super::rows`]), and their wire dtype.
    Rows(Vec<f32>, Dtype),
}

impl Payload {
    /// Bytes the payload holds in memory.
    fn len(&self) -> usize {
        match self {
            Payload::Bytes(bytes) => bytes.len(),
            Payload::Rows(rows, _) => std::mem::size_of_val(rows.as_slice()),
        }
    }
}

/// The AM header of a message: its sequence number on the link, then, for a rows message,
/// the wire dtype of its rows ([`rows_code`]).
const BYTES_HEADER: usize = 8;
const ROWS_HEADER: usize = 16;

/// A rows message's code for its wire dtype (bf16 rows are converted as UCX moves them;
/// f32 rows move as they are, straight between the two sides' row vectors).
fn rows_code(dtype: Dtype) -> u64 {
    match dtype {
        Dtype::F32 => 1,
        Dtype::Bf16 => 2,
    }
}

fn rows_dtype(code: u64) -> Option<Dtype> {
    [Dtype::F32, Dtype::Bf16]
        .into_iter()
        .find(|&dtype| rows_code(dtype) == code)
}

/// Messages received and not yet taken by the reader, as UCX delivered them, so a large
/// message reaches the reader without another copy.
#[derive(Default)]
pub struct Received {
    /// Each payload holds what one message carried (bytes as received, rows decoded).
    messages: VecDeque<Payload>,
    unread: usize,
    /// Buffers the reader emptied, for the worker's next receives.
    spare: Vec<Vec<u8>>,
}

impl Received {
    /// Unread bytes, in memory (rows count as their f32 bytes).
    pub fn len(&self) -> usize {
        self.unread
    }

    pub fn is_empty(&self) -> bool {
        self.unread == 0
    }

    fn push(&mut self, payload: Payload) {
        self.unread += payload.len();
        self.messages.push_back(payload);
    }

    /// The oldest received message, whole: the reader reads bytes in place, then gives the
    /// buffer back ([`Received::recycle`]).
    pub fn pop_front(&mut self) -> Option<Payload> {
        let payload = self.messages.pop_front()?;
        self.unread -= payload.len();
        Some(payload)
    }

    /// Whether the oldest received message is decoded rows.
    pub fn rows_next(&self) -> bool {
        matches!(self.messages.front(), Some(Payload::Rows(..)))
    }

    /// A buffer the reader is done with, kept for the next receives if worth it.
    pub fn recycle(&mut self, buffer: Vec<u8>) {
        if worth_keeping(buffer.capacity()) && self.spare.len() < SPARE_BUFFERS {
            self.spare.push(buffer);
        }
    }

    /// An emptied buffer of at least `capacity` bytes.
    fn take_spare(&mut self, capacity: usize) -> Option<Vec<u8>> {
        take_best_fit(&mut self.spare, capacity)
    }
}

/// How an endpoint ended.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The peer closed the connection (reads see the end of the stream, not an error).
    pub closed_by_peer: bool,
    pub message: String,
}

impl EpShared {
    pub fn lock(&self) -> MutexGuard<'_, EpState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn fail(&self, failure: Failure) {
        let (read, write) = {
            let mut state = self.lock();
            if state.failure.is_none() {
                state.failure = Some(failure);
            }
            (state.read_waker.take(), state.write_waker.take())
        };
        read.into_iter().chain(write).for_each(Waker::wake);
    }
}

/// A ucp context (active messages, wakeup), shared by every link's worker; cleaned up when the
/// last of them is gone.
pub struct Context {
    library: Arc<Library>,
    handle: sys::ucp_context_h,
    /// What kinds of memory the context moves (`ucp_context_query`).
    pub memory_types: MemoryTypes,
    /// The datatype bf16 rows move as (see [`super::rows`]); destroyed before the context.
    bf16_rows: std::mem::ManuallyDrop<Bf16Rows>,
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

/// A link's worker, shared by the link's stream, its control watcher and (weakly) its driver
/// task. Dropping the last handle closes the endpoint, waits up to [`STOP_GRACE`] for the
/// close and destroys the worker, so a process that exits next never runs libucs's
/// destructors beside a destroy in flight (that race aborts in `vfs_obj.c`): drop it off the
/// runtime's threads (see `off_runtime`).
pub struct WorkerHandle {
    worker: Mutex<Worker>,
    /// Wakes the driver task when something was started that needs progress and may not
    /// signal the event fd by itself (a send UCX did not finish at once, an endpoint being
    /// made or closed).
    kick: Arc<Notify>,
}

impl WorkerHandle {
    /// Puts `worker` behind a handle and starts its driver task. Must be called within a
    /// tokio runtime (the task, and the reactor watching the worker's event fd).
    pub fn start(worker: Worker) -> io::Result<Arc<WorkerHandle>> {
        let events = match Self::watch(&worker) {
            Ok(events) => events,
            Err(error) => {
                super::off_runtime(worker);
                return Err(error);
            }
        };
        let kick = Arc::new(Notify::new());
        let handle = Arc::new(WorkerHandle {
            worker: Mutex::new(worker),
            kick: kick.clone(),
        });
        tokio::spawn(drive(Arc::downgrade(&handle), events, kick));
        Ok(handle)
    }

    /// The driver's watch on the worker's event fd: its own duplicate, which the reactor
    /// deregisters when the task ends, whenever that is, while UCX closes its own descriptor
    /// when the worker is destroyed, never one the reactor still watches.
    fn watch(worker: &Worker) -> io::Result<AsyncFd<OwnedFd>> {
        // SAFETY: fcntl takes no pointers here; efd is open while the worker lives.
        let duplicate = unsafe { libc::fcntl(worker.efd, libc::F_DUPFD_CLOEXEC, 0) };
        if duplicate < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor nothing else owns.
        let duplicate = unsafe { OwnedFd::from_raw_fd(duplicate) };
        // SAFETY: the AsyncFd owns the descriptor, which stays open, the same description,
        // until the AsyncFd is dropped.
        let events =
            unsafe { AsyncFd::register_with_interest(duplicate, tokio::io::Interest::READABLE) }?;
        Ok(events)
    }

    /// The worker, for one call into UCX: the events its callbacks record are handled before
    /// the lock is let go, and the driver task is woken if a transfer is then in flight
    /// (handling events can start one: a fetch, a close).
    fn lock(&self) -> Locked<'_> {
        Locked {
            guard: self.worker.lock().unwrap_or_else(|p| p.into_inner()),
            kick: Some(&self.kick),
        }
    }

    /// As [`WorkerHandle::lock`], for the driver task itself (which needs no waking).
    fn lock_in_driver(&self) -> Locked<'_> {
        Locked {
            guard: self.worker.lock().unwrap_or_else(|p| p.into_inner()),
            kick: None,
        }
    }

    /// Creates the link's endpoint toward the peer worker's `remote` address.
    pub fn connect(&self, remote: &[u8], shared: Arc<EpShared>) -> io::Result<Connected> {
        let connected = self.lock().connect(remote, shared);
        // Wiring the endpoint up takes messages both ways.
        self.kick.notify_one();
        connected
    }

    /// Sends `data` as the link's next message.
    pub fn send(&self, ep: u64, data: Vec<u8>) {
        self.lock().send(ep, Outgoing::Bytes(data));
    }

    /// Sends a frame as two messages, in order: its header and groups as bytes, then its
    /// rows as a rows message, which the peer's worker decodes as it receives it.
    pub fn send_rows(&self, ep: u64, frame: RowsFrame) {
        let RowsFrame {
            prefix,
            rows,
            dtype,
        } = frame;
        let mut worker = self.lock();
        worker.send(ep, Outgoing::Bytes(prefix));
        worker.send(ep, Outgoing::Rows(rows, dtype));
    }

    /// The reader caught up: fetch the rendezvous messages that were held back.
    pub fn resume_recv(&self) {
        self.lock().deliver();
    }

    /// Progresses the worker now (a reader that found nothing does, before it waits).
    pub fn progress(&self) {
        self.lock().progress();
    }

    /// Closes the endpoint (by force: without flushing, for one already failed).
    pub fn close_ep(&self, ep: u64, force: bool) {
        let flags = if force {
            sys::UCP_EP_CLOSE_FLAG_FORCE
        } else {
            0
        };
        self.lock().close_ep(ep, flags);
    }

    /// Progresses the worker; when it had nothing to do, arms its event fd, unless a
    /// transfer it started is in flight and `spinning` (see [`SPIN_BEFORE_SLEEP`]).
    fn progress_and_arm(&self, spinning: bool) -> Drive {
        let mut worker = self.lock_in_driver();
        if worker.progress() {
            return Drive::Worked;
        }
        if spinning && worker.transferring() {
            return Drive::Idle;
        }
        // SAFETY: the worker is live, and the lock serialises every call into it.
        match unsafe { worker.library.ucp.ucp_worker_arm(worker.worker) } {
            sys::UCS_OK => Drive::Armed,
            // Events came in meanwhile, or UCX has work only more progress moves (sends
            // queued for room in a shared-memory FIFO the peer has yet to drain).
            // Spun on, however long: the peer draining the FIFO does not signal us, and a
            // timer's wait here cost a shared-memory layer transfer 7x (tried).
            sys::UCS_ERR_BUSY => Drive::Worked,
            status => {
                // The idle tick keeps the worker moving meanwhile.
                let error = status_error(&worker.library, "arming the UCX worker", status);
                tracing::debug!(%error, "UCX worker not armed");
                Drive::Armed
            }
        }
    }
}

/// What one pass of the driver found.
enum Drive {
    /// Progress did something, or UCX is not ready to sleep.
    Worked,
    /// Nothing to do, not armed (still within the spin after the last work).
    Idle,
    /// Armed: the event fd fires on the next event.
    Armed,
}

/// A locked worker: what its callbacks recorded is handled before the lock goes, so no
/// event is left in the thread's list for the next worker locked on this thread.
struct Locked<'a> {
    guard: MutexGuard<'a, Worker>,
    /// Woken when a transfer is in flight as the lock goes (`None` in the driver itself).
    kick: Option<&'a Notify>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Worker;
    fn deref(&self) -> &Worker {
        &self.guard
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Worker {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.guard.settle();
        if let Some(kick) = self.kick
            && self.guard.transferring()
        {
            // A send or fetch UCX did not finish at once, or a close, moves only with
            // progress, and may never signal the event fd by itself.
            kick.notify_one();
        }
    }
}

/// The link's driver task: progresses the worker whenever its event fd fires (something
/// arrived, a send or fetch completed, the peer failed), when kicked, and at least every
/// [`IDLE_TICK`]; ends once the last handle is gone.
async fn drive(handle: Weak<WorkerHandle>, events: AsyncFd<OwnedFd>, kick: Arc<Notify>) {
    let mut last_work = Instant::now();
    loop {
        let Some(link) = handle.upgrade() else {
            return;
        };
        let pass = link.progress_and_arm(last_work.elapsed() < SPIN_BEFORE_SLEEP);
        if let Some(last) = Arc::into_inner(link) {
            // Everyone else let go while this ran: the worker is destroyed, off the runtime's
            // threads (stopping may wait for its endpoint to close).
            super::off_runtime(last);
            return;
        }
        match pass {
            Drive::Worked | Drive::Idle => {
                if matches!(pass, Drive::Worked) {
                    last_work = Instant::now();
                }
                // Come back after the runtime's other tasks (and its reactor) had their turn,
                // the peer's among them when it runs in this process: a spin that yields.
                tokio::task::yield_now().await;
                continue;
            }
            Drive::Armed => {}
        }
        tokio::select! {
            ready = events.readable() => match ready {
                // Cleared before the next progress: what fires after it sets it again.
                Ok(mut ready) => ready.clear_ready(),
                Err(error) => {
                    tracing::warn!(%error, "UCX worker: waiting on its event fd failed");
                    tokio::time::sleep(IDLE_TICK).await;
                }
            },
            () = kick.notified() => {}
            () = tokio::time::sleep(IDLE_TICK) => {}
        }
        last_work = Instant::now();
    }
}

/// A new endpoint: its id, and the transports its lanes use.
pub struct Connected {
    pub ep: u64,
    pub transports: Vec<String>,
    /// Whether the link sends bf16 rows through the rows datatype ([`super::rows`]).
    pub packs_rows: bool,
}

/// The transports of the `lane[i]:` lines of `ucp_ep_print_info`'s text (`  2:sysv/memory.0
/// md[1] -> ...`: resource index, `tl/device`, then a path index), each once, in lane order.
fn parse_lane_transports(printed: &str) -> Vec<String> {
    let mut transports: Vec<String> = Vec::new();
    for line in printed.lines() {
        let Some((_, rest)) = line
            .split_once("lane[")
            .and_then(|(_, r)| r.split_once("]:"))
        else {
            continue;
        };
        let Some(resource) = rest.split_whitespace().next() else {
            continue;
        };
        let name = resource.split_once(':').map_or(resource, |(_, name)| name);
        let name = match name.rsplit_once('.') {
            Some((base, index)) if index.bytes().all(|b| b.is_ascii_digit()) => base,
            _ => name,
        };
        if !name.is_empty() && !transports.iter().any(|t| t == name) {
            transports.push(name.to_string());
        }
    }
    transports
}

/// What a UCX callback saw, handled by the loop once progress returns.
enum Event {
    EpError {
        ep: u64,
        status: sys::ucs_status_t,
    },
    SendDone {
        op: *mut SendOp,
        request: *mut c_void,
        status: sys::ucs_status_t,
    },
    /// A whole message, copied (or decoded) out in the callback (UCX keeps its bytes only
    /// through it).
    Message {
        seq: u64,
        payload: Payload,
    },
    /// A whole message whose bytes UCX keeps until `ucp_am_data_release`.
    MessageKept {
        seq: u64,
        data: *mut c_void,
        length: usize,
        rows: Option<Dtype>,
    },
    /// A rendezvous message announced: `ucp_am_recv_data_nbx` fetches its bytes.
    Announced {
        seq: u64,
        desc: *mut c_void,
        length: usize,
        rows: Option<Dtype>,
    },
    /// A message that breaks the link's protocol (UCX dropped its bytes): the peer is broken.
    Garbled {
        why: String,
    },
    FetchDone {
        op: *mut FetchOp,
        request: *mut c_void,
        status: sys::ucs_status_t,
        length: usize,
    },
    CloseDone {
        request: *mut c_void,
    },
}

thread_local! {
    static EVENTS: RefCell<Vec<Event>> = const { RefCell::new(Vec::new()) };
}

fn record(event: Event) {
    EVENTS.with(|events| events.borrow_mut().push(event));
}

/// A send in flight: its bytes (or rows) live here until UCX is done with them.
struct SendOp {
    ep: u64,
    data: Outgoing,
    /// The message's header: its sequence number on the link, then for rows their dtype's
    /// code, little-endian.
    header: [u8; ROWS_HEADER],
}

/// What a message sends.
enum Outgoing {
    Bytes(Vec<u8>),
    /// Rows, sent in `Dtype` (bf16: converted by UCX as it packs them).
    Rows(Vec<f32>, Dtype),
}

impl Outgoing {
    /// The message's length on the wire.
    fn wire_len(&self) -> usize {
        match self {
            Outgoing::Bytes(bytes) => bytes.len(),
            Outgoing::Rows(rows, dtype) => rows.len() * dtype.size(),
        }
    }
}

/// A rendezvous fetch in flight: UCX writes into the buffer's capacity (its length is 0
/// until the fetch completes).
struct FetchOp {
    buffer: Payload,
    /// For rows: the values the fetch writes.
    values: usize,
    /// For bf16 rows: what UCX unpacks into (the rows' capacity), counting values written.
    target: Option<Box<UnpackTarget>>,
}

impl FetchOp {
    /// The payload of a fetch that completed successfully, `length` bytes received; `None`
    /// for rows the fetch did not write whole.
    fn fetched(self, length: usize) -> Option<Payload> {
        match self.buffer {
            Payload::Bytes(mut bytes) => {
                // SAFETY: the fetch wrote `length` bytes (at most the capacity it was given)
                // at the start of the allocation.
                unsafe { bytes.set_len(length.min(bytes.capacity())) };
                Some(Payload::Bytes(bytes))
            }
            Payload::Rows(mut rows, dtype) => {
                let whole = match &self.target {
                    Some(target) => target.written == self.values,
                    None => length == self.values * dtype.size(),
                };
                if !whole {
                    return None;
                }
                // SAFETY: every one of the `values` values was written, within the capacity
                // made for them: counted by the rows datatype (which writes a value once both
                // its bytes are in), or received whole as f32 bytes.
                unsafe { rows.set_len(self.values) };
                Some(Payload::Rows(rows, dtype))
            }
        }
    }
}

/// A message the worker received, in arrival order, not yet handed to the endpoint's reader.
enum Incoming {
    Ready(Payload),
    /// A rendezvous message not fetched yet (it waits while the reader is behind).
    Announced {
        desc: *mut c_void,
        length: usize,
        rows: Option<Dtype>,
    },
    /// The front message, being fetched.
    Fetching,
}

struct Endpoint {
    handle: sys::ucp_ep_h,
    shared: Arc<EpShared>,
}

/// One link's ucp worker and what it keeps between calls; always reached through its
/// handle's lock ([`WorkerHandle`]).
pub struct Worker {
    library: Arc<Library>,
    /// Kept alive (not cleaned up) while this worker exists.
    context: Arc<Context>,
    worker: sys::ucp_worker_h,
    /// The worker's event fd (UCX owns it).
    efd: libc::c_int,
    endpoints: HashMap<u64, Endpoint>,
    closing: usize,
    next_id: u64,
    /// Receive buffers to reuse (no fresh allocation and first-touch page faults per large
    /// message); buffers the reader emptied come back through [`Received`].
    spare_buffers: Vec<Vec<u8>>,
    /// Messages received and not yet handed over, by sequence number from `front_seq` (a
    /// `None` is one not arrived yet): a worker has one endpoint (one link), and a message
    /// may arrive before that endpoint is made.
    incoming: VecDeque<Option<Incoming>>,
    front_seq: u64,
    /// The sequence number of the next message sent.
    next_send_seq: u64,
    /// Sends UCX has not completed yet.
    sends_in_flight: usize,
    /// Rendezvous fetches UCX has not completed yet (their messages may have been dropped
    /// meanwhile, when the endpoint ended: the fetch still writes into its buffer).
    fetches_in_flight: usize,
    /// The endpoint was made and has gone: what arrives now is dropped.
    ended: bool,
    /// The peer broke the protocol before the endpoint was made: it fails once made.
    broken: Option<String>,
}

pub(super) fn status_error(library: &Library, what: &str, status: sys::ucs_status_t) -> io::Error {
    let kind = match status {
        sys::UCS_ERR_UNREACHABLE => io::ErrorKind::ConnectionRefused,
        sys::UCS_ERR_CONNECTION_RESET => io::ErrorKind::ConnectionReset,
        sys::UCS_ERR_BUSY => io::ErrorKind::AddrInUse,
        sys::UCS_ERR_TIMED_OUT | sys::UCS_ERR_ENDPOINT_TIMEOUT => io::ErrorKind::TimedOut,
        sys::UCS_ERR_INVALID_PARAM | sys::UCS_ERR_INVALID_ADDR => io::ErrorKind::InvalidInput,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(
        kind,
        format!(
            "{what}: {} (UCX status {status})",
            library.ucp.status_string(status)
        ),
    )
}

extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    record(Event::EpError {
        ep: arg as u64,
        status,
    });
}

extern "C" fn on_send(request: *mut c_void, status: sys::ucs_status_t, user_data: *mut c_void) {
    record(Event::SendDone {
        op: user_data.cast(),
        request,
        status,
    });
}

extern "C" fn on_message(
    _arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    let garbled = |why: String| {
        // UCS_OK drops the bytes (and a rendezvous descriptor) at once.
        record(Event::Garbled { why });
        sys::UCS_OK
    };
    if header_length != BYTES_HEADER && header_length != ROWS_HEADER {
        return garbled(format!(
            "the peer sent a message with a {header_length}-byte header \
             ({BYTES_HEADER} or {ROWS_HEADER} expected)"
        ));
    }
    // SAFETY: header points at header_length (8 or 16) bytes valid through this call.
    let header = unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) };
    let word =
        |i: usize| u64::from_le_bytes(header[8 * i..8 * i + 8].try_into().unwrap_or_default());
    let seq = word(0);
    let rows = if header_length == ROWS_HEADER {
        match rows_dtype(word(1)) {
            // Rows as f32 bytes are only fetched as they are on a little-endian host.
            Some(dtype)
                if length > 0
                    && length.is_multiple_of(dtype.size())
                    && (dtype == Dtype::Bf16 || cfg!(target_endian = "little")) =>
            {
                Some(dtype)
            }
            _ => {
                return garbled(format!(
                    "the peer sent a rows message of {length} bytes with code {}",
                    word(1)
                ));
            }
        }
    } else {
        None
    };
    // SAFETY: UCX passes a live parameter block for the callback's duration.
    let attributes = unsafe { (*param).recv_attr };
    if attributes & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 {
        record(Event::Announced {
            seq,
            desc: data,
            length,
            rows,
        });
        return sys::UCS_INPROGRESS;
    }
    if length > 0 && attributes & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_DATA) != 0 {
        record(Event::MessageKept {
            seq,
            data,
            length,
            rows,
        });
        return sys::UCS_INPROGRESS;
    }
    let bytes: &[u8] = if length == 0 {
        &[]
    } else {
        // SAFETY: without the DATA flag, data points at length bytes valid through this call.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }
    };
    record(Event::Message {
        seq,
        payload: payload_of(bytes, rows, None),
    });
    sys::UCS_OK
}

/// A received message's payload, out of UCX's bytes (into `buffer`, when bytes, if given).
fn payload_of(bytes: &[u8], rows: Option<Dtype>, buffer: Option<Vec<u8>>) -> Payload {
    match rows {
        Some(dtype) => {
            let mut values = Vec::new();
            wire::decode_values_append(bytes, dtype, &mut values);
            Payload::Rows(values, dtype)
        }
        None => {
            let mut buffer = buffer.unwrap_or_default();
            buffer.extend_from_slice(bytes);
            Payload::Bytes(buffer)
        }
    }
}

extern "C" fn on_fetched(
    request: *mut c_void,
    status: sys::ucs_status_t,
    length: usize,
    user_data: *mut c_void,
) {
    record(Event::FetchDone {
        op: user_data.cast(),
        request,
        status,
        length,
    });
}

extern "C" fn on_close(request: *mut c_void, _status: sys::ucs_status_t, _user: *mut c_void) {
    record(Event::CloseDone { request });
}

impl Worker {
    /// Creates a worker on `context`; returns it and its address (what a peer needs to reach
    /// it). Blocks for a while (UCX opens its transports): call it off the runtime's threads.
    pub fn new(context: Arc<Context>) -> io::Result<(Worker, Vec<u8>)> {
        let library = context.library.clone();
        let ucp = &library.ucp;
        // SAFETY: zeroed plain data, fields selected by field_mask.
        let mut worker_params: sys::ucp_worker_params_t = unsafe { std::mem::zeroed() };
        worker_params.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
        // Called from whichever runtime thread holds the handle's lock.
        worker_params.thread_mode = sys::UCS_THREAD_MODE_SERIALIZED;
        let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
        // SAFETY: context is live; worker is written on success.
        let status = unsafe { ucp.ucp_worker_create(context.handle, &worker_params, &mut worker) };
        if status != sys::UCS_OK {
            return Err(status_error(&library, "creating the UCX worker", status));
        }
        let fail = |e: io::Error| {
            // SAFETY: the worker is not used after this.
            unsafe { ucp.ucp_worker_destroy(worker) };
            e
        };
        // SAFETY: zeroed plain data, fields selected by field_mask.
        let mut handler: sys::ucp_am_handler_param_t = unsafe { std::mem::zeroed() };
        handler.field_mask = (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
            | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
            | sys::UCP_AM_HANDLER_PARAM_FIELD_CB) as u64;
        handler.id = AM_BYTES;
        // Whole messages only: a rendezvous one is announced whole, its bytes fetched after.
        handler.flags = sys::UCP_AM_FLAG_WHOLE_MSG;
        handler.cb = Some(on_message);
        // SAFETY: the worker is live; UCX copies the parameters; on_message only records.
        let status = unsafe { ucp.ucp_worker_set_am_recv_handler(worker, &handler) };
        if status != sys::UCS_OK {
            return Err(fail(status_error(
                &library,
                "setting the UCX active-message handler",
                status,
            )));
        }
        let mut raw_address: *mut sys::ucp_address_t = std::ptr::null_mut();
        let mut address_len: usize = 0;
        // SAFETY: the worker is live; both outputs are written on success.
        let status =
            unsafe { ucp.ucp_worker_get_address(worker, &mut raw_address, &mut address_len) };
        if status != sys::UCS_OK {
            return Err(fail(status_error(
                &library,
                "getting the UCX worker's address",
                status,
            )));
        }
        // SAFETY: UCX wrote address_len bytes at raw_address, released right after the copy.
        let address =
            unsafe { std::slice::from_raw_parts(raw_address.cast::<u8>(), address_len) }.to_vec();
        // SAFETY: the address came from ucp_worker_get_address on this worker, released once.
        unsafe { ucp.ucp_worker_release_address(worker, raw_address) };
        let mut efd: libc::c_int = -1;
        // SAFETY: the worker is live; efd is written on success.
        let status = unsafe { ucp.ucp_worker_get_efd(worker, &mut efd) };
        if status != sys::UCS_OK {
            return Err(fail(status_error(
                &library,
                "getting the UCX event fd",
                status,
            )));
        }
        let worker = Worker {
            library,
            context,
            worker,
            efd,
            endpoints: HashMap::new(),
            closing: 0,
            next_id: 1,
            spare_buffers: Vec::new(),
            incoming: VecDeque::new(),
            front_seq: 0,
            next_send_seq: 0,
            sends_in_flight: 0,
            fetches_in_flight: 0,
            ended: false,
            broken: None,
        };
        Ok((worker, address))
    }

    /// Progresses the worker and handles what its callbacks recorded; whether anything
    /// happened.
    fn progress(&mut self) -> bool {
        let mut any = false;
        // Bounded: a peer that keeps sending would otherwise hold this thread (and the
        // worker's lock) here, and grow the event list, until it stopped.
        for _ in 0..PROGRESS_CALLS {
            // SAFETY: the worker is live; its handle's lock (or its Drop) serialises calls.
            if unsafe { self.library.ucp.ucp_worker_progress(self.worker) } == 0 {
                break;
            }
            any = true;
        }
        any | self.settle()
    }

    /// Handles the events this thread's UCX calls for this worker recorded, including those
    /// that handling them records (a close that cancels a fetch); whether there were any.
    fn settle(&mut self) -> bool {
        let mut any = false;
        loop {
            let events = EVENTS.with(|events| std::mem::take(&mut *events.borrow_mut()));
            if events.is_empty() {
                return any;
            }
            any = true;
            for event in events {
                self.event(event);
            }
        }
    }

    /// Whether a transfer this worker started is still moving: a send, a rendezvous fetch
    /// or an endpoint's close.
    fn transferring(&self) -> bool {
        self.sends_in_flight > 0 || self.fetches_in_flight > 0 || self.closing > 0
    }

    fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn ep_params(id: u64) -> sys::ucp_ep_params_t {
        // SAFETY: zeroed plain data, fields selected by field_mask.
        let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = (sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64;
        params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
        params.err_handler.cb = Some(on_ep_error);
        params.err_handler.arg = id as *mut c_void;
        params
    }

    /// Creates the endpoint; returns its id and the transports its lanes use.
    fn connect(&mut self, remote: &[u8], shared: Arc<EpShared>) -> io::Result<Connected> {
        let id = self.next_id();
        let mut params = Self::ep_params(id);
        params.field_mask |= sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64;
        params.address = remote.as_ptr().cast();
        let mut handle: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: the worker is live; params and the address bytes it points at live through
        // the call (UCX unpacks the address); handle is written on success. The address came
        // from a peer that proved it holds the cluster secret.
        let status = unsafe {
            self.library
                .ucp
                .ucp_ep_create(self.worker, &params, &mut handle)
        };
        if status != sys::UCS_OK {
            return Err(status_error(
                &self.library,
                "creating the UCX endpoint toward the peer's worker",
                status,
            ));
        }
        let transports = self.lane_transports(handle);
        self.add_endpoint(id, handle, shared);
        Ok(Connected {
            ep: id,
            packs_rows: super::rows::packs_rows(&transports),
            transports,
        })
    }

    /// The transports (`tl/device`, e.g. `sysv/memory`, `tcp/lo`, `rc_mlx5/mlx5_0:1`) the
    /// lanes of `ep` use, as `ucp_ep_print_info` lists them; empty if it printed none.
    fn lane_transports(&self, ep: sys::ucp_ep_h) -> Vec<String> {
        let mut text: *mut libc::c_char = std::ptr::null_mut();
        let mut len: libc::size_t = 0;
        // SAFETY: both out-pointers are live locals; the stream is closed below.
        let stream = unsafe { libc::open_memstream(&mut text, &mut len) };
        if stream.is_null() {
            return Vec::new();
        }
        // SAFETY: ep is a live endpoint of this worker, stream an open FILE.
        unsafe { self.library.ucp.ucp_ep_print_info(ep, stream.cast()) };
        // SAFETY: stream came from open_memstream; closing it sets text and len.
        unsafe { libc::fclose(stream) };
        if text.is_null() {
            return Vec::new();
        }
        // SAFETY: after fclose, text points at len bytes that open_memstream allocated.
        let printed =
            String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(text.cast::<u8>(), len) })
                .into_owned();
        // SAFETY: text was allocated by open_memstream and is not used after this.
        unsafe { libc::free(text.cast()) };
        parse_lane_transports(&printed)
    }

    fn add_endpoint(&mut self, id: u64, handle: sys::ucp_ep_h, shared: Arc<EpShared>) {
        self.endpoints.insert(id, Endpoint { handle, shared });
        if let Some(why) = self.broken.take() {
            return self.failed(id, why, false);
        }
        self.deliver();
    }

    /// Sends `data` as the link's next message; whether UCX is still sending it (it needs
    /// progress to finish).
    fn send(&mut self, ep: u64, data: Outgoing) -> bool {
        let Some(endpoint) = self.endpoints.get(&ep) else {
            return false;
        };
        let wire_len = data.wire_len();
        let mut header = [0u8; ROWS_HEADER];
        header[..8].copy_from_slice(&self.next_send_seq.to_le_bytes());
        self.next_send_seq += 1;
        // SAFETY: zeroed plain data, fields selected by op_attr_mask (a zero datatype is
        // UCX's contiguous bytes).
        let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK
            | sys::UCP_OP_ATTR_FIELD_USER_DATA
            | sys::UCP_OP_ATTR_FIELD_FLAGS;
        let (header_len, count) = match &data {
            Outgoing::Bytes(bytes) => (BYTES_HEADER, bytes.len()),
            Outgoing::Rows(rows, dtype) => {
                header[8..].copy_from_slice(&rows_code(*dtype).to_le_bytes());
                match dtype {
                    Dtype::F32 => (ROWS_HEADER, wire_len),
                    Dtype::Bf16 => {
                        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE;
                        param.datatype = self.context.bf16_rows.handle();
                        (ROWS_HEADER, rows.len())
                    }
                }
            }
        };
        param.cb.send = Some(on_send);
        param.flags = if wire_len <= EAGER_MAX {
            sys::UCP_AM_SEND_FLAG_EAGER
        } else {
            sys::UCP_AM_SEND_FLAG_RNDV
        };
        let op = Box::into_raw(Box::new(SendOp { ep, data, header }));
        param.user_data = op.cast();
        // SAFETY: the endpoint is live; the bytes (or rows: `count` f32 values, or their
        // bytes for f32 on the wire, which is little-endian as the host is) and the header
        // live in `op`, which is freed only once UCX is done with them (at once when the
        // call completes immediately, else in the completion event).
        let request = unsafe {
            let buffer = match &(*op).data {
                Outgoing::Bytes(bytes) => bytes.as_ptr().cast(),
                Outgoing::Rows(rows, _) => rows.as_ptr().cast(),
            };
            let header = (*op).header.as_ptr().cast();
            self.library.ucp.ucp_am_send_nbx(
                endpoint.handle,
                AM_BYTES,
                header,
                header_len,
                buffer,
                count,
                &param,
            )
        };
        let status = sys::ptr_status(request);
        if status == sys::UCS_INPROGRESS {
            self.sends_in_flight += 1;
            return true;
        }
        // SAFETY: completed (or failed) at once: UCX holds no reference to op or its bytes.
        let op = unsafe { Box::from_raw(op) };
        self.sent(*op, status);
        false
    }

    /// A send completed: its bytes no longer count against the writer, and its buffer goes
    /// back to the writer for reuse.
    fn sent(&mut self, op: SendOp, status: sys::ucs_status_t) {
        let SendOp { ep, data, .. } = op;
        let wire_len = data.wire_len();
        let Some(endpoint) = self.endpoints.get(&ep) else {
            return;
        };
        if status != sys::UCS_OK {
            let error = status_error(&self.library, "UCX active-message send", status);
            return self.failed(ep, error.to_string(), false);
        }
        let waker = {
            let mut state = endpoint.shared.lock();
            state.send_pending = state.send_pending.saturating_sub(wire_len);
            if let Outgoing::Bytes(data) = data
                && data.capacity() <= SPARE_SEND_BYTES
                && state.spare_send.len() < SPARE_SEND
            {
                state.spare_send.push(data);
            }
            state.write_waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Files message `seq` in its place among those not yet handed over; a message out of
    /// the window or filed twice means the peer is broken.
    fn file(&mut self, seq: u64, message: Incoming) {
        let arrived = self.incoming.len() as u64;
        let offset = match seq.checked_sub(self.front_seq) {
            Some(offset) if offset < arrived + OUT_OF_ORDER_MAX => offset as usize,
            _ => {
                self.release(message);
                return self.broken_peer(format!(
                    "the peer sent message {seq} of the link while {} was next",
                    self.front_seq
                ));
            }
        };
        if self.incoming.len() <= offset {
            self.incoming.resize_with(offset + 1, || None);
        }
        if self.incoming[offset].is_some() {
            self.release(message);
            return self.broken_peer(format!("the peer sent message {seq} of the link twice"));
        }
        self.incoming[offset] = Some(message);
        self.deliver();
    }

    /// The peer broke the link's protocol: the link fails (once its endpoint exists).
    fn broken_peer(&mut self, why: String) {
        tracing::warn!(%why, "UCX peer link broken");
        self.fail_link(why);
    }

    /// The link fails (once its endpoint exists, if it does not yet).
    fn fail_link(&mut self, why: String) {
        match self.endpoints.keys().next().copied() {
            Some(ep) => self.failed(ep, why, false),
            None if !self.ended => self.broken = Some(why),
            None => {}
        }
    }

    /// Hands the received messages to the endpoint's reader in order, fetching each
    /// rendezvous message when it reaches the front and the reader is not too far behind.
    fn deliver(&mut self) {
        let Some((&ep, endpoint)) = self.endpoints.iter().next() else {
            if self.ended {
                self.drop_incoming();
            }
            return;
        };
        let shared = endpoint.shared.clone();
        let mut delivered = false;
        loop {
            match self.incoming.front() {
                Some(Some(Incoming::Ready(_))) => {
                    if let Some(Some(Incoming::Ready(payload))) = self.incoming.pop_front() {
                        self.front_seq += 1;
                        if !matches!(&payload, Payload::Bytes(bytes) if bytes.is_empty()) {
                            shared.lock().received.push(payload);
                            delivered = true;
                        }
                    }
                }
                Some(Some(Incoming::Announced { desc, length, rows })) => {
                    let (desc, length, rows) = (*desc, *length, *rows);
                    let behind = {
                        let mut state = shared.lock();
                        state.recv_paused = state.received.len() >= RECV_BUFFERED_MAX;
                        state.recv_paused
                    };
                    if behind {
                        break;
                    }
                    match self.fetch(desc, length, rows) {
                        Ok(Some(payload)) => self.incoming[0] = Some(Incoming::Ready(payload)),
                        Ok(None) => {
                            self.incoming[0] = Some(Incoming::Fetching);
                            break;
                        }
                        Err(error) => {
                            // UCX owns the descriptor once the fetch was tried.
                            self.incoming[0] = None;
                            return self.failed(ep, error.to_string(), false);
                        }
                    }
                }
                // Nothing, a message not arrived yet, or one being fetched.
                _ => break,
            }
        }
        if delivered && let Some(waker) = shared.lock().read_waker.take() {
            waker.wake();
        }
    }

    /// Starts fetching a rendezvous message into a buffer of its size (rows: into their
    /// values, decoded as they arrive): the payload when it completed at once, `None` while
    /// it is in flight (its event follows).
    fn fetch(
        &mut self,
        desc: *mut c_void,
        length: usize,
        rows: Option<Dtype>,
    ) -> io::Result<Option<Payload>> {
        // SAFETY: zeroed plain data, fields selected by op_attr_mask (a zero datatype is
        // UCX's contiguous bytes).
        let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
        let mut op = FetchOp {
            buffer: Payload::Bytes(Vec::new()),
            values: 0,
            target: None,
        };
        let count = match rows {
            None => {
                op.buffer = Payload::Bytes(self.buffer_for(length));
                length
            }
            Some(dtype) => {
                op.values = length / dtype.size();
                let mut rows = Vec::with_capacity(op.values);
                param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
                param.memory_type = sys::UCS_MEMORY_TYPE_HOST;
                let count = match dtype {
                    Dtype::F32 => length,
                    Dtype::Bf16 => {
                        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE;
                        param.datatype = self.context.bf16_rows.handle();
                        op.target = Some(UnpackTarget::new(&mut rows, op.values));
                        op.values
                    }
                };
                op.buffer = Payload::Rows(rows, dtype);
                count
            }
        };
        param.cb.recv_am = Some(on_fetched);
        let op = Box::into_raw(Box::new(op));
        param.user_data = op.cast();
        // SAFETY: desc is a rendezvous descriptor UCX announced on this worker and kept for
        // us (the callback returned UCS_INPROGRESS), used once; UCX writes the message's
        // `length` bytes into op's buffer, whose capacity is at least that (for bf16 rows:
        // `values` values through the rows datatype, into the target over the rows'
        // capacity), and op is freed only once UCX is done with it (as for sends).
        let request = unsafe {
            let buffer = match (&mut (*op).buffer, &mut (*op).target) {
                (_, Some(target)) => (&raw mut **target).cast(),
                (Payload::Bytes(bytes), None) => bytes.as_mut_ptr().cast(),
                (Payload::Rows(rows, _), None) => rows.as_mut_ptr().cast(),
            };
            self.library
                .ucp
                .ucp_am_recv_data_nbx(self.worker, desc, buffer, count, &param)
        };
        let status = sys::ptr_status(request);
        if status == sys::UCS_INPROGRESS {
            self.fetches_in_flight += 1;
            return Ok(None);
        }
        // SAFETY: completed (or failed) at once: UCX holds no reference to op.
        let op = *unsafe { Box::from_raw(op) };
        if status != sys::UCS_OK {
            self.recycle_payload(op.buffer);
            return Err(status_error(
                &self.library,
                "UCX rendezvous receive",
                status,
            ));
        }
        match op.fetched(length) {
            Some(payload) => Ok(Some(payload)),
            None => Err(io::Error::other(
                "UCX rendezvous receive completed without every row",
            )),
        }
    }

    /// An empty buffer of at least `capacity` bytes: a kept one if there is one.
    fn buffer_for(&mut self, capacity: usize) -> Vec<u8> {
        if capacity < KEEP_BUFFER_MIN {
            // Cheap to allocate, and a kept one would sit idle under a few bytes.
            return Vec::with_capacity(capacity);
        }
        let kept = take_best_fit(&mut self.spare_buffers, capacity).or_else(|| {
            self.endpoints
                .values()
                .next()
                .and_then(|endpoint| endpoint.shared.lock().received.take_spare(capacity))
        });
        let mut buffer = kept.unwrap_or_else(|| Vec::with_capacity(capacity));
        buffer.clear();
        buffer
    }

    fn recycle_payload(&mut self, payload: Payload) {
        if let Payload::Bytes(buffer) = payload {
            self.recycle(buffer);
        }
    }

    fn recycle(&mut self, buffer: Vec<u8>) {
        if worth_keeping(buffer.capacity()) && self.spare_buffers.len() < SPARE_BUFFERS {
            self.spare_buffers.push(buffer);
        }
    }

    /// Drops what was received and not handed over, releasing the rendezvous descriptors
    /// UCX kept for it (a fetch in flight completes as cancelled, and its event frees it).
    fn drop_incoming(&mut self) {
        for message in std::mem::take(&mut self.incoming).into_iter().flatten() {
            self.release(message);
        }
    }

    /// Lets go of a message not handed over: a rendezvous descriptor goes back to UCX.
    fn release(&mut self, message: Incoming) {
        match message {
            // SAFETY: a descriptor UCX kept for us and not yet fetched, released once.
            Incoming::Announced { desc, .. } => unsafe {
                self.library.ucp.ucp_am_data_release(self.worker, desc)
            },
            Incoming::Ready(payload) => self.recycle_payload(payload),
            Incoming::Fetching => {}
        }
    }

    fn event(&mut self, event: Event) {
        let library = self.library.clone();
        let ucp = &library.ucp;
        match event {
            Event::EpError { ep, status } => {
                let closed = matches!(
                    status,
                    sys::UCS_ERR_CONNECTION_RESET | sys::UCS_ERR_NOT_CONNECTED
                );
                let error = status_error(&self.library, "UCX endpoint failed", status);
                self.failed(ep, error.to_string(), closed);
            }
            Event::SendDone {
                op,
                request,
                status,
            } => {
                // SAFETY: the request completed: UCX is done with op, handed over in send().
                let op = unsafe { Box::from_raw(op) };
                self.sends_in_flight = self.sends_in_flight.saturating_sub(1);
                // SAFETY: a completed request, released once.
                unsafe { ucp.ucp_request_free(request) };
                self.sent(*op, status);
            }
            Event::Message { seq, payload } => self.file(seq, Incoming::Ready(payload)),
            Event::MessageKept {
                seq,
                data,
                length,
                rows,
            } => {
                let buffer = (length <= MESSAGE_MAX).then(|| {
                    let buffer = rows.is_none().then(|| self.buffer_for(length));
                    // SAFETY: UCX keeps `length` bytes at data until released, just below.
                    let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) };
                    payload_of(bytes, rows, buffer)
                });
                // SAFETY: data was kept for us (the callback returned UCS_INPROGRESS) and is
                // released once, after its last use.
                unsafe { ucp.ucp_am_data_release(self.worker, data) };
                match buffer {
                    Some(buffer) => self.file(seq, Incoming::Ready(buffer)),
                    None => self.broken_peer(format!(
                        "the peer sent a {length}-byte message (at most {MESSAGE_MAX})"
                    )),
                }
            }
            Event::Announced {
                seq,
                desc,
                length,
                rows,
            } => {
                if length > MESSAGE_MAX {
                    self.release(Incoming::Announced { desc, length, rows });
                    return self.broken_peer(format!(
                        "the peer announced a {length}-byte message (at most {MESSAGE_MAX})"
                    ));
                }
                self.file(seq, Incoming::Announced { desc, length, rows });
            }
            Event::Garbled { why } => self.broken_peer(why),
            Event::FetchDone {
                op,
                request,
                status,
                length,
            } => {
                // SAFETY: as for sends: UCX is done with op, handed over in fetch().
                let op = *unsafe { Box::from_raw(op) };
                self.fetches_in_flight = self.fetches_in_flight.saturating_sub(1);
                // SAFETY: a completed request, released once.
                unsafe { ucp.ucp_request_free(request) };
                if !matches!(self.incoming.front(), Some(Some(Incoming::Fetching))) {
                    // Dropped meanwhile (the endpoint ended).
                    return self.recycle_payload(op.buffer);
                }
                if status != sys::UCS_OK {
                    self.incoming[0] = None;
                    self.recycle_payload(op.buffer);
                    let error = status_error(&self.library, "UCX rendezvous receive", status);
                    return self.fail_link(error.to_string());
                }
                match op.fetched(length) {
                    Some(payload) => self.incoming[0] = Some(Incoming::Ready(payload)),
                    None => {
                        self.incoming[0] = None;
                        return self.fail_link(
                            "UCX rendezvous receive completed without every row".into(),
                        );
                    }
                }
                self.deliver();
            }
            Event::CloseDone { request } => {
                // SAFETY: a completed close request, released once.
                unsafe { ucp.ucp_request_free(request) };
                self.closing = self.closing.saturating_sub(1);
            }
        }
    }

    /// The endpoint failed: its reader and writer see why, and UCX's side is closed.
    fn failed(&mut self, ep: u64, message: String, closed_by_peer: bool) {
        let Some(endpoint) = self.endpoints.get(&ep) else {
            return;
        };
        tracing::debug!(ep, %message, "UCX endpoint down");
        endpoint.shared.fail(Failure {
            closed_by_peer,
            message,
        });
        // A failed endpoint can only be closed by force.
        self.close_ep(ep, sys::UCP_EP_CLOSE_FLAG_FORCE);
    }

    fn close_ep(&mut self, ep: u64, flags: u32) {
        let Some(endpoint) = self.endpoints.remove(&ep) else {
            return;
        };
        endpoint.shared.fail(Failure {
            closed_by_peer: false,
            message: "UCX endpoint closed".into(),
        });
        self.ended = true;
        self.drop_incoming();
        // SAFETY: zeroed plain data, fields selected by op_attr_mask.
        let mut param: sys::ucp_request_param_t = unsafe { std::mem::zeroed() };
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_FLAGS;
        param.cb.send = Some(on_close);
        param.flags = flags;
        // SAFETY: the endpoint is live and removed from the table, so never used again;
        // operations still in flight on it complete (cancelled) through their callbacks.
        let request = unsafe { self.library.ucp.ucp_ep_close_nbx(endpoint.handle, &param) };
        if sys::ptr_status(request) == sys::UCS_INPROGRESS {
            self.closing += 1;
        }
    }

    /// Closes everything, waits a little for the closes, and destroys the worker (blocking,
    /// up to [`STOP_GRACE`]).
    fn stop(&mut self) {
        let eps: Vec<u64> = self.endpoints.keys().copied().collect();
        for ep in eps {
            self.close_ep(ep, sys::UCP_EP_CLOSE_FLAG_FORCE);
        }
        // The closes, and the sends and fetch they cancel, complete through their callbacks.
        let deadline = Instant::now() + STOP_GRACE;
        while self.transferring() && Instant::now() < deadline {
            if !self.progress() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // A close that completed at once may leave a fetch cancelled but its callback not
        // yet run: run it, so the request is freed before the worker goes (bounded: a peer
        // still sending would keep progress busy).
        while self.progress() && Instant::now() < deadline {}
        self.drop_incoming();
        if self.transferring() {
            // Requests still open keep pointers into the worker, and UCX (1.13) aborts the
            // process when a worker is destroyed under them: a rendezvous send whose peer
            // went away before answering is not cancelled by the endpoint's forced close.
            // Leave the worker (and the context: this worker's Arc is leaked with it) rather
            // than destroy it under them.
            tracing::warn!(
                closing = self.closing,
                sends = self.sends_in_flight,
                "UCX worker left in place: transfers of a link that ended never completed"
            );
            std::mem::forget(self.context.clone());
            return;
        }
        // SAFETY: nothing refers to the worker any more.
        unsafe { self.library.ucp.ucp_worker_destroy(self.worker) };
        discard_events();
    }
}

// SAFETY: the worker is created UCS_THREAD_MODE_SERIALIZED, so UCX allows calls from any
// thread one at a time, which its handle's mutex ensures; the raw pointers it keeps (the
// endpoints, rendezvous descriptors, requests' ops) are only used under that lock.
unsafe impl Send for Worker {}

/// Lets go of what callbacks recorded while a worker was destroyed (UCX completes what it
/// purges): the ops handed to UCX are freed, and nothing is passed back to the destroyed
/// worker, so no event outlives its worker to be handled under another one's lock.
fn discard_events() {
    let events = EVENTS.with(|events| std::mem::take(&mut *events.borrow_mut()));
    for event in events {
        match event {
            // SAFETY: the request completed (UCX calls a callback once): UCX is done with
            // the op handed over in send() / fetch(). The request itself went with its worker.
            Event::SendDone { op, .. } => drop(unsafe { Box::from_raw(op) }),
            // SAFETY: as above.
            Event::FetchDone { op, .. } => drop(unsafe { Box::from_raw(op) }),
            _ => {}
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What arrives eagerly, handed to the receive callback as UCX does (no library
    /// needed): the event it records.
    fn arrive(header: &[u8], data: &[u8]) -> Event {
        discard_events();
        // SAFETY: zeroed plain data; no attribute bits: an eager message whose bytes are
        // valid through the call.
        let param: sys::ucp_am_recv_param_t = unsafe { std::mem::zeroed() };
        let status = on_message(
            std::ptr::null_mut(),
            header.as_ptr().cast(),
            header.len(),
            data.as_ptr().cast_mut().cast(),
            data.len(),
            &param,
        );
        assert_eq!(status, sys::UCS_OK);
        let mut events = EVENTS.with(|events| std::mem::take(&mut *events.borrow_mut()));
        assert_eq!(events.len(), 1);
        events.remove(0)
    }

    fn header(seq: u64, rows: Option<u64>) -> Vec<u8> {
        let mut header = seq.to_le_bytes().to_vec();
        if let Some(code) = rows {
            header.extend_from_slice(&code.to_le_bytes());
        }
        header
    }

    /// A message is read by its header: 8 bytes for a frame's bytes, 16 for rows (and their
    /// dtype's code). A header of another length, rows of a code no dtype has, or rows whose
    /// bytes are not whole values break the link's protocol: the peer is taken as broken
    /// (the link fails, as after a reset) and nothing of the message is read.
    #[test]
    fn a_message_is_read_by_its_header_and_a_garbled_one_is_reported_broken() {
        let values = [1.5f32, -2.0, 0.25];
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bf16_bytes: Vec<u8> = values
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        match arrive(&header(7, None), b"frame") {
            Event::Message {
                seq: 7,
                payload: Payload::Bytes(bytes),
            } => assert_eq!(bytes, b"frame"),
            _ => panic!("bytes not received as bytes"),
        }
        for (dtype, bytes) in [(Dtype::F32, &f32_bytes), (Dtype::Bf16, &bf16_bytes)] {
            match arrive(&header(8, Some(rows_code(dtype))), bytes) {
                Event::Message {
                    seq: 8,
                    payload: Payload::Rows(rows, sent),
                } => assert_eq!((rows.as_slice(), sent), (&values[..], dtype)),
                _ => panic!("{dtype:?} rows not received as rows"),
            }
        }
        let garbled = |header: &[u8], data: &[u8]| match arrive(header, data) {
            Event::Garbled { why } => why,
            _ => panic!("a garbled message was taken: {header:?}"),
        };
        let why = garbled(&[0; 12], b"frame");
        assert!(why.contains("a 12-byte header (8 or 16 expected)"), "{why}");
        assert!(garbled(&[], b"frame").contains("a 0-byte header"));
        let why = garbled(&header(9, Some(3)), &f32_bytes);
        assert!(
            why.contains("a rows message of 12 bytes with code 3"),
            "{why}"
        );
        let why = garbled(&header(9, Some(rows_code(Dtype::F32))), &f32_bytes[..10]);
        assert!(
            why.contains("a rows message of 10 bytes with code 1"),
            "{why}"
        );
        let why = garbled(&header(9, Some(rows_code(Dtype::Bf16))), &bf16_bytes[..5]);
        assert!(
            why.contains("a rows message of 5 bytes with code 2"),
            "{why}"
        );
        let why = garbled(&header(9, Some(rows_code(Dtype::F32))), &[]);
        assert!(why.contains("a rows message of 0 bytes"), "{why}");
    }

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

    #[test]
    fn lane_transports_are_read_from_the_endpoint_printout() {
        let printed = "#\n# UCP endpoint\n#\n#               peer: <no debug data>\n\
            #                 lane[0]:  2:sysv/memory.0 md[1]           -> md[1]/sysv/sysdev[255] am am_bw#0 keepalive\n\
            #                 lane[1]:  1:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] am_bw#1\n\
            #                 lane[2]:  7:rc_mlx5/mlx5_0:1.0 md[3]      -> md[3]/ib/sysdev[255] rma_bw#0\n\
            #                 lane[3]:  2:sysv/memory.0 md[1]           -> md[1]/sysv/sysdev[255] rma#0\n\
            #\n#                tag_send: 0..<egr/short>..8185..<egr/bcopy>..(inf)\n";
        assert_eq!(
            parse_lane_transports(printed),
            ["sysv/memory", "tcp/lo", "rc_mlx5/mlx5_0:1"]
        );
        assert!(parse_lane_transports("").is_empty());
        assert!(parse_lane_transports("lane[0]:\nlane[x").is_empty());
    }

    /// Received messages come out whole and in order, the unread count follows them (rows
    /// counted as the f32 bytes they hold), and the emptied large buffers come back for the
    /// next receives.
    #[test]
    fn received_messages_come_out_whole_in_order_and_their_buffers_come_back() {
        let mut received = Received::default();
        const BIG: usize = 1 << 20;
        let big: Vec<u8> = (0..BIG).map(|i| (i % 251) as u8).collect();
        let rows: Vec<f32> = (0..100).map(|i| i as f32 * 0.5).collect();
        let small: Vec<u8> = (0..10).map(|i| 200 + i).collect();
        received.push(Payload::Bytes(big.clone()));
        received.push(Payload::Rows(rows.clone(), Dtype::Bf16));
        received.push(Payload::Bytes(small.clone()));
        assert_eq!(received.len(), BIG + 400 + 10);
        assert!(!received.rows_next());
        let Some(Payload::Bytes(first)) = received.pop_front() else {
            panic!("the first message is bytes");
        };
        assert_eq!(first, big);
        assert_eq!(received.len(), 410);
        received.recycle(first);
        assert!(received.rows_next());
        assert_eq!(received.pop_front(), Some(Payload::Rows(rows, Dtype::Bf16)));
        let Some(Payload::Bytes(second)) = received.pop_front() else {
            panic!("the third message is bytes");
        };
        assert_eq!(second, small);
        assert!(received.is_empty() && received.pop_front().is_none());
        received.recycle(second);
        assert!(
            received.take_spare(BIG + 1).is_none(),
            "no kept buffer is that large"
        );
        let spare = received
            .take_spare(BIG / 2)
            .expect("the emptied 1 MiB buffer");
        assert_eq!(spare.capacity(), BIG);
        assert!(
            received.take_spare(1).is_none(),
            "the small buffer is not kept"
        );
    }
}
