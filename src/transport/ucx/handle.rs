//! [`WorkerHandle`]: a link's worker behind its lock, as the link's stream calls it, and the
//! driver task that progresses the worker while nobody calls it, waiting on its event fd.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use ucx_sys as sys;

use super::endpoint::EpShared;
use super::events::Outgoing;
use super::status::status_error;
use super::worker::{Connected, Worker};
use crate::transport::wire::RowsFrame;

/// The longest the driver task waits without progressing the worker: a safety net, so UCX's
/// timers (keepalive of `UCP_ERR_HANDLING_MODE_PEER`) run even if no event fd fires.
const IDLE_TICK: Duration = Duration::from_millis(100);
/// How long the driver keeps progressing a worker with a transfer in flight (a send or a
/// rendezvous fetch not complete) after its last work, before it sleeps on the event fd: the
/// next FIFO's worth of a large message usually follows within microseconds, and a wake-up
/// through the reactor costs more. A worker with nothing in flight (waiting for the peer to
/// answer) sleeps at once rather than take a core from the work it waits for.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(50);

/// A link's worker, shared by the link's stream, its control watcher and (weakly) its driver
/// task. Dropping the last handle closes the endpoint, waits a moment (`STOP_GRACE` in
/// [`super::worker`]) for the close and destroys the worker, so a process that exits next
/// never runs libucs's destructors beside a destroy in flight (that race aborts in
/// `vfs_obj.c`): drop it off the runtime's threads (see `off_runtime`).
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
        worker.send(ep, Outgoing::Rows(rows.into_vec(), dtype));
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
