//! UCX status codes as I/O errors: the one place every part of the UCX transport (the
//! context, the workers, the rows datatype) turns a `ucs_status_t` into what its callers
//! see, so that none of them needs another for it.

use std::io;

use ucx_sys as sys;

use super::Library;

/// `status` as an I/O error saying `what` failed, in UCX's words, of the kind the peer
/// protocol acts on (refused, reset, timed out).
pub fn status_error(library: &Library, what: &str, status: sys::ucs_status_t) -> io::Error {
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
