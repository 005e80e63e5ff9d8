//! Rows that are f32 in memory and bf16 on the wire, converted by UCX itself as it moves
//! them: a UCX generic datatype whose `pack` encodes each fragment straight into the
//! transport's buffer (a shared-memory FIFO element) and whose
//! `unpack` decodes each fragment straight into the receiver's f32 rows.
//!
//! Without it a bf16 frame is encoded whole into a buffer, which UCX copies into its
//! transport's buffers, and received whole into a buffer, which is then decoded: two more
//! passes over the rows in each direction, and no overlap between the two sides' work. With
//! it the sender's encoding and the receiver's decoding run fragment by fragment, each side
//! in its own progress, while the other works on the next fragment.
//!
//! Only for links whose lanes copy anyway (shared memory's FIFO): on a lane with zero-copy
//! rendezvous (RDMA, `cma`, `cuda_ipc`, and UCX's `tcp`, which sends a contiguous message
//! from its own buffer) a generic datatype would turn it into a copied one, so those links
//! send bf16 frames encoded, as one message ([`packs_rows`]); f32 rows go apart on every
//! link, as the bytes they are. Measured over UCX's tcp on one host: a
//! layer's round trip took 11.5 ms packed against 5.6 ms encoded.
//!
//! Fragments may end inside a value (UCX cuts them by bytes): such a value's two bytes are
//! kept aside until both have arrived, in whatever order, and only then written, so every
//! value is converted exactly as [`wire::decode_values`] converts it. The receiver counts
//! the values written ([`UnpackTarget`]): rows are only taken once every one of them is.

use std::collections::HashMap;
use std::ffi::c_void;
use std::io;
use std::mem::MaybeUninit;
use std::sync::Arc;

use ucx_sys as sys;

use super::Library;
use super::status::status_error;
use crate::transport::wire::{self, Dtype};

/// The lane transports (`ucp_ep_print_info`'s names) that move a rendezvous message by
/// copying it through their own buffers: a link whose lanes are all of these loses nothing
/// when its rows are converted as UCX packs them.
const COPYING_TRANSPORTS: [&str; 3] = ["sysv", "posix", "self"];

/// Whether a link whose endpoint's lanes use `transports` has its bf16 rows converted by UCX
/// as it packs them (see the module documentation).
pub fn packs_rows(transports: &[String]) -> bool {
    !transports.is_empty()
        && transports.iter().all(|transport| {
            let name = transport.split('/').next().unwrap_or_default();
            COPYING_TRANSPORTS.contains(&name)
        })
}

/// The generic datatype "f32 rows, bf16 on the wire"; destroyed when dropped.
pub struct Bf16Rows {
    library: Arc<Library>,
    handle: sys::ucp_datatype_t,
}

// SAFETY: a datatype handle is an immutable description UCX reads from any thread.
unsafe impl Send for Bf16Rows {}
// SAFETY: as above.
unsafe impl Sync for Bf16Rows {}

static OPS: sys::ucp_generic_dt_ops_t = sys::ucp_generic_dt_ops_t {
    start_pack: Some(start_pack),
    start_unpack: Some(start_unpack),
    packed_size: Some(packed_size),
    pack: Some(pack),
    unpack: Some(unpack),
    finish: Some(finish),
};

impl Bf16Rows {
    pub fn new(library: Arc<Library>) -> io::Result<Bf16Rows> {
        let mut handle: sys::ucp_datatype_t = 0;
        // SAFETY: OPS lives for the whole program; UCX keeps a copy of the table and calls
        // it with the buffers and counts each operation passes (see the callbacks).
        let status = unsafe {
            library
                .ucp
                .ucp_dt_create_generic(&OPS, std::ptr::null_mut(), &mut handle)
        };
        if status != sys::UCS_OK {
            return Err(status_error(
                &library,
                "creating the bf16 rows datatype",
                status,
            ));
        }
        Ok(Bf16Rows { library, handle })
    }

    /// The handle to put in a request's `datatype`, with the rows' value count as `count`.
    pub fn handle(&self) -> sys::ucp_datatype_t {
        self.handle
    }
}

impl Drop for Bf16Rows {
    fn drop(&mut self) {
        // SAFETY: created by ucp_dt_create_generic; every request using it is over (the
        // context, which owns this and drops it before its own cleanup, outlives every
        // worker).
        unsafe { self.library.ucp.ucp_dt_destroy(self.handle) };
    }
}

/// Where a fetch of bf16 rows unpacks: what the receiver passes UCX as the buffer (with the
/// value count), owned by the fetch until it completes.
pub struct UnpackTarget {
    values: *mut f32,
    count: usize,
    /// Values written so far: all `count` once every byte of the message was unpacked.
    pub written: usize,
}

impl UnpackTarget {
    /// A target for `count` values in `rows`' spare capacity (room for at least `count`).
    pub fn new(rows: &mut Vec<f32>, count: usize) -> Box<UnpackTarget> {
        assert!(rows.capacity() - rows.len() >= count, "room for the rows");
        Box::new(UnpackTarget {
            values: rows.spare_capacity_mut().as_mut_ptr().cast(),
            count,
            written: 0,
        })
    }
}

/// One operation's rows: `count` f32 values at `values` (read when packing, written when
/// unpacking), and, when unpacking, the bytes of values cut between fragments and the
/// target that counts the values written (null when packing).
struct State {
    values: *mut f32,
    count: usize,
    /// Value index -> its (low, high) wire bytes seen so far.
    cut: HashMap<usize, [Option<u8>; 2]>,
    target: *mut UnpackTarget,
}

unsafe extern "C" fn start_pack(
    _context: *mut c_void,
    buffer: *const c_void,
    count: usize,
) -> *mut c_void {
    Box::into_raw(Box::new(State {
        values: buffer.cast_mut().cast(),
        count,
        cut: HashMap::new(),
        target: std::ptr::null_mut(),
    }))
    .cast()
}

unsafe extern "C" fn start_unpack(
    _context: *mut c_void,
    buffer: *mut c_void,
    count: usize,
) -> *mut c_void {
    let target = buffer.cast::<UnpackTarget>();
    // SAFETY: the receiver passes a live UnpackTarget as the buffer (see UnpackTarget).
    let (values, room) = unsafe { ((*target).values, (*target).count) };
    Box::into_raw(Box::new(State {
        values,
        // Never more than the target has room for, whatever count says.
        count: count.min(room),
        cut: HashMap::new(),
        target,
    }))
    .cast()
}

unsafe extern "C" fn packed_size(state: *mut c_void) -> usize {
    // SAFETY: a state start_pack or start_unpack made, not yet finished.
    let state = unsafe { &*state.cast::<State>() };
    state.count * Dtype::Bf16.size()
}

/// Writes the wire bytes `offset..` of the rows into `dest`, at most `max_length`.
unsafe extern "C" fn pack(
    state: *mut c_void,
    offset: usize,
    dest: *mut c_void,
    max_length: usize,
) -> usize {
    // SAFETY: a state start_pack made over the sender's rows, which live until the send
    // completes (its SendOp owns them).
    let state = unsafe { &*state.cast::<State>() };
    let total = state.count * 2;
    let length = max_length.min(total.saturating_sub(offset));
    if length == 0 {
        return 0;
    }
    // SAFETY: as above: `count` initialised values.
    let values = unsafe { std::slice::from_raw_parts(state.values, state.count) };
    // SAFETY: UCX hands `max_length` (>= length) writable bytes at dest.
    let out = unsafe { std::slice::from_raw_parts_mut(dest.cast::<MaybeUninit<u8>>(), length) };
    let (mut at, mut written) = (offset, 0);
    if at % 2 == 1 {
        // The second byte of a value the last fragment began.
        out[0].write(wire::f32_to_bf16_bits(values[at / 2]).to_le_bytes()[1]);
        at += 1;
        written += 1;
    }
    let whole = (length - written) / 2;
    wire::encode_into(
        &values[at / 2..at / 2 + whole],
        Dtype::Bf16,
        &mut out[written..written + 2 * whole],
    );
    at += 2 * whole;
    written += 2 * whole;
    if written < length {
        // The first byte of a value the next fragment ends.
        out[written].write(wire::f32_to_bf16_bits(values[at / 2]).to_le_bytes()[0]);
    }
    length
}

/// Decodes the wire bytes `offset..offset + length` from `src` into the rows.
unsafe extern "C" fn unpack(
    state: *mut c_void,
    offset: usize,
    src: *const c_void,
    length: usize,
) -> sys::ucs_status_t {
    // SAFETY: a state start_unpack made over the receiver's rows (capacity for `count`
    // values, owned by the fetch until it completes), used by one thread at a time.
    let state = unsafe { &mut *state.cast::<State>() };
    if offset
        .checked_add(length)
        .is_none_or(|end| end > state.count * 2)
    {
        return sys::UCS_ERR_MESSAGE_TRUNCATED;
    }
    if length == 0 {
        return sys::UCS_OK;
    }
    // SAFETY: UCX hands `length` readable bytes at src.
    let bytes = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), length) };
    // SAFETY: capacity for `count` values; only written through this view.
    let values = unsafe {
        std::slice::from_raw_parts_mut(state.values.cast::<MaybeUninit<f32>>(), state.count)
    };
    let (mut at, mut read) = (offset, 0);
    if at % 2 == 1 {
        state.cut_byte(values, at / 2, 1, bytes[0]);
        at += 1;
        read += 1;
    }
    let whole = (length - read) / 2;
    wire::decode_into(
        &bytes[read..read + 2 * whole],
        Dtype::Bf16,
        &mut values[at / 2..at / 2 + whole],
    );
    state.wrote(whole);
    at += 2 * whole;
    read += 2 * whole;
    if read < length {
        state.cut_byte(values, at / 2, 0, bytes[read]);
    }
    sys::UCS_OK
}

impl State {
    /// Byte `which` (0 low, 1 high) of value `index` arrived alone: the value is written once
    /// its other byte is here too.
    fn cut_byte(&mut self, values: &mut [MaybeUninit<f32>], index: usize, which: usize, byte: u8) {
        let seen = self.cut.entry(index).or_default();
        if seen[which].replace(byte).is_some() {
            // The same byte twice (UCX never unpacks one twice): never count a value twice.
            return;
        }
        if let [Some(low), Some(high)] = *seen {
            self.cut.remove(&index);
            values[index].write(wire::bf16_bits_to_f32(u16::from_le_bytes([low, high])));
            self.wrote(1);
        }
    }

    /// Counts `values` more values written.
    fn wrote(&mut self, values: usize) {
        if !self.target.is_null() {
            // SAFETY: the unpack target outlives the fetch (see start_unpack).
            unsafe { (*self.target).written += values };
        }
    }
}

unsafe extern "C" fn finish(state: *mut c_void) {
    // SAFETY: made by start_pack or start_unpack, finished once.
    drop(unsafe { Box::from_raw(state.cast::<State>()) });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packs `values` in fragments of `sizes` (cycled) and unpacks the fragments in `order`.
    fn round_trip(values: &[f32], sizes: &[usize], reverse: bool) -> Vec<f32> {
        // SAFETY (here and below): the callbacks are called as UCX calls them, over live
        // buffers of the counts given.
        let packer =
            unsafe { start_pack(std::ptr::null_mut(), values.as_ptr().cast(), values.len()) };
        assert_eq!(unsafe { packed_size(packer) }, values.len() * 2);
        let mut fragments = Vec::new();
        let mut offset = 0;
        for &size in sizes.iter().cycle() {
            if offset >= values.len() * 2 {
                break;
            }
            let mut dest = vec![0u8; size];
            let n = unsafe { pack(packer, offset, dest.as_mut_ptr().cast(), size) };
            dest.truncate(n);
            fragments.push((offset, dest));
            offset += n;
        }
        unsafe { finish(packer) };
        let packed: Vec<u8> = fragments.iter().flat_map(|(_, f)| f.clone()).collect();
        let mut whole = vec![0u8; values.len() * 2];
        wire::encode_values(values, Dtype::Bf16, &mut whole);
        assert_eq!(packed, whole, "packed fragments are the frame's bytes");
        if reverse {
            fragments.reverse();
        }
        let mut out: Vec<f32> = Vec::with_capacity(values.len());
        let mut target = UnpackTarget::new(&mut out, values.len());
        let target_ptr: *mut UnpackTarget = &mut *target;
        let unpacker =
            unsafe { start_unpack(std::ptr::null_mut(), target_ptr.cast(), values.len()) };
        for (offset, fragment) in &fragments {
            let status =
                unsafe { unpack(unpacker, *offset, fragment.as_ptr().cast(), fragment.len()) };
            assert_eq!(status, sys::UCS_OK);
        }
        let past_end = unsafe { unpack(unpacker, values.len() * 2, [0u8].as_ptr().cast(), 1) };
        assert_eq!(past_end, sys::UCS_ERR_MESSAGE_TRUNCATED);
        unsafe { finish(unpacker) };
        assert_eq!(target.written, values.len(), "every value counted once");
        // SAFETY: every value was written (counted above).
        unsafe { out.set_len(values.len()) };
        out
    }

    #[test]
    fn rows_cut_anywhere_arrive_as_the_wire_decodes_them() {
        let mut values: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) * 0.37).collect();
        values.extend([
            f32::NAN,
            f32::from_bits(0x7f80_0001), // a signalling NaN: made quiet, as the wire does
            f32::INFINITY,
            -0.0,
            f32::MIN_POSITIVE,
        ]);
        let mut expected = vec![0.0f32; values.len()];
        let mut bytes = vec![0u8; values.len() * 2];
        wire::encode_values(&values, Dtype::Bf16, &mut bytes);
        wire::decode_values(&bytes, Dtype::Bf16, &mut expected);
        for sizes in [&[2usize][..], &[1], &[3], &[7, 8, 1], &[8191], &[4096, 333]] {
            for reverse in [false, true] {
                let got = round_trip(&values, sizes, reverse);
                let same = got
                    .iter()
                    .zip(&expected)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "fragments {sizes:?}, reversed {reverse}");
            }
        }
    }

    #[test]
    fn only_links_that_copy_anyway_pack_rows() {
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(packs_rows(&names(&["sysv/memory"])));
        assert!(packs_rows(&names(&["posix/memory", "self/memory"])));
        // UCX's tcp sends a contiguous rendezvous message from its buffer (zero-copy).
        assert!(!packs_rows(&names(&["tcp/lo"])));
        assert!(!packs_rows(&names(&["sysv/memory", "cma/memory"])));
        assert!(!packs_rows(&names(&["rc_mlx5/mlx5_0:1"])));
        assert!(!packs_rows(&[]));
    }
}
