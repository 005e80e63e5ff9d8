//! The UCX workers: one per link, each owning one ucp worker (on the transport's shared
//! [`Context`]) and the link's one endpoint, behind a mutex (the worker is created
//! `UCS_THREAD_MODE_SERIALIZED`: any thread may call UCX for it, one at a time).
//!
//! One worker per link, not one per node: endpoints made from worker addresses are paired by
//! UCX in the order each side creates them toward the same remote worker, so two links made
//! at once between the same two workers (each node dialling the other) could be crossed.
//! A worker that only ever has one peer endpoint cannot be.
//!
//! The link's tasks call UCX themselves through [`super::handle::WorkerHandle`], on the
//! runtime's threads: a write hands its bytes to `ucp_am_send_nbx` at once, a read that finds
//! nothing progresses the worker before it waits. What arrives while nobody is reading is
//! picked up by the link's driver task, which waits on the worker's event fd
//! (`ucp_worker_get_efd`, armed with `ucp_worker_arm`) in the runtime's reactor, so an idle
//! link spends no CPU, and wakes the reader and writer through the endpoint's [`EpShared`]
//! (bytes received, sends completed, the endpoint's failure). No thread of our own and no
//! hand-off between threads stand between a task and UCX.
//!
//! Each message carries an AM header: its sequence number on the link (8 bytes), and for a
//! frame's rows sent apart from its header the code of their wire dtype (8 more): those are
//! received into f32 rows, decoded as they arrive ([`Payload::Rows`]).
//!
//! UCX callbacks only record what happened (a thread-local event list, [`super::events`]);
//! each call into UCX under the mutex handles the events before it lets go, so no callback
//! re-enters the worker's state and no event outlives the lock it was recorded under.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ucx_sys as sys;

use super::Library;
use super::context::Context;
use super::endpoint::{
    EpShared, Failure, KEEP_BUFFER_MIN, Payload, SPARE_BUFFERS, SPARE_SEND, SPARE_SEND_BYTES,
    take_best_fit, worth_keeping,
};
use super::events::{
    AM_BYTES, BYTES_HEADER, EVENTS, Event, FetchOp, Outgoing, ROWS_HEADER, SendOp, discard_events,
    on_close, on_ep_error, on_fetched, on_message, on_send, payload_of, rows_code,
};
use super::rows::UnpackTarget;
use super::status::status_error;
use crate::transport::wire::Dtype;

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
/// The most `ucp_worker_progress` calls one progress pass makes before it handles what they
/// recorded and lets go of the worker.
const PROGRESS_CALLS: usize = 64;
/// How long stopping waits for endpoints to close before the worker is destroyed.
const STOP_GRACE: Duration = Duration::from_millis(500);

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
/// handle's lock ([`super::handle::WorkerHandle`]).
pub struct Worker {
    pub(super) library: Arc<Library>,
    /// Kept alive (not cleaned up) while this worker exists.
    context: Arc<Context>,
    pub(super) worker: sys::ucp_worker_h,
    /// The worker's event fd (UCX owns it).
    pub(super) efd: libc::c_int,
    endpoints: HashMap<u64, Endpoint>,
    closing: usize,
    next_id: u64,
    /// Receive buffers to reuse (no fresh allocation and first-touch page faults per large
    /// message); buffers the reader emptied come back through [`super::endpoint::Received`].
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
    pub(super) fn progress(&mut self) -> bool {
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
    pub(super) fn settle(&mut self) -> bool {
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
    pub(super) fn transferring(&self) -> bool {
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
    pub(super) fn connect(
        &mut self,
        remote: &[u8],
        shared: Arc<EpShared>,
    ) -> io::Result<Connected> {
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
    pub(super) fn send(&mut self, ep: u64, data: Outgoing) -> bool {
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
    pub(super) fn deliver(&mut self) {
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

    pub(super) fn close_ep(&mut self, ep: u64, flags: u32) {
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

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
