//! What UCX calls back into, and what those callbacks record: each callback only pushes an
//! [`Event`] onto a thread-local list, which the worker handles once its call into UCX
//! returns (see [`super::worker`]), so no callback re-enters the worker's state. Here too are
//! the operations handed to UCX while they are in flight, and the AM header that says what a
//! message carries.

use std::cell::RefCell;
use std::ffi::c_void;

use ucx_sys as sys;

use super::endpoint::Payload;
use super::rows::UnpackTarget;
use crate::transport::wire::{self, Dtype};

/// The active-message id the link's bytes travel under (one handler per worker).
pub(super) const AM_BYTES: u32 = 1;

/// The AM header of a message: its sequence number on the link, then, for a rows message,
/// the wire dtype of its rows ([`rows_code`]).
pub(super) const BYTES_HEADER: usize = 8;
pub(super) const ROWS_HEADER: usize = 16;

/// A rows message's code for its wire dtype (bf16 rows are converted as UCX moves them;
/// f32 rows move as they are, straight between the two sides' row vectors).
pub(super) fn rows_code(dtype: Dtype) -> u64 {
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

/// What a UCX callback saw, handled by the loop once progress returns.
pub(super) enum Event {
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
    pub(super) static EVENTS: RefCell<Vec<Event>> = const { RefCell::new(Vec::new()) };
}

fn record(event: Event) {
    EVENTS.with(|events| events.borrow_mut().push(event));
}

/// A send in flight: its bytes (or rows) live here until UCX is done with them.
pub(super) struct SendOp {
    pub(super) ep: u64,
    pub(super) data: Outgoing,
    /// The message's header: its sequence number on the link, then for rows their dtype's
    /// code, little-endian.
    pub(super) header: [u8; ROWS_HEADER],
}

/// What a message sends.
pub(super) enum Outgoing {
    Bytes(Vec<u8>),
    /// Rows, sent in `Dtype` (bf16: converted by UCX as it packs them).
    Rows(Vec<f32>, Dtype),
}

impl Outgoing {
    /// The message's length on the wire.
    pub(super) fn wire_len(&self) -> usize {
        match self {
            Outgoing::Bytes(bytes) => bytes.len(),
            Outgoing::Rows(rows, dtype) => rows.len() * dtype.size(),
        }
    }
}

/// A rendezvous fetch in flight: UCX writes into the buffer's capacity (its length is 0
/// until the fetch completes).
pub(super) struct FetchOp {
    pub(super) buffer: Payload,
    /// For rows: the values the fetch writes.
    pub(super) values: usize,
    /// For bf16 rows: what UCX unpacks into (the rows' capacity), counting values written.
    pub(super) target: Option<Box<UnpackTarget>>,
}

impl FetchOp {
    /// The payload of a fetch that completed successfully, `length` bytes received; `None`
    /// for rows the fetch did not write whole.
    pub(super) fn fetched(self, length: usize) -> Option<Payload> {
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

pub(super) extern "C" fn on_ep_error(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    record(Event::EpError {
        ep: arg as u64,
        status,
    });
}

pub(super) extern "C" fn on_send(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    record(Event::SendDone {
        op: user_data.cast(),
        request,
        status,
    });
}

pub(super) extern "C" fn on_message(
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
pub(super) fn payload_of(bytes: &[u8], rows: Option<Dtype>, buffer: Option<Vec<u8>>) -> Payload {
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

pub(super) extern "C" fn on_fetched(
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

pub(super) extern "C" fn on_close(
    request: *mut c_void,
    _status: sys::ucs_status_t,
    _user: *mut c_void,
) {
    record(Event::CloseDone { request });
}

/// Lets go of what callbacks recorded while a worker was destroyed (UCX completes what it
/// purges): the ops handed to UCX are freed, and nothing is passed back to the destroyed
/// worker, so no event outlives its worker to be handled under another one's lock.
pub(super) fn discard_events() {
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
}
