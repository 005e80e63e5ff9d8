//! The trace context a request frame may carry (W3C Trace Context's fields, binary): the
//! span of the call on the sending node, so that the work it asks for is recorded as that
//! span's child in the same trace on the node that does it.

/// Bytes of a trace context on the wire: trace id, span id, trace flags.
pub const TRACE_LEN: usize = 16 + 8 + 1;

/// The sending side's span: the parent of the remote work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// W3C trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceContext {
    pub fn encode_append(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.trace_id);
        out.extend_from_slice(&self.span_id);
        out.push(self.flags);
    }

    /// From exactly [`TRACE_LEN`] bytes; `None` for another length, or an all-zero trace
    /// or span id (invalid in W3C Trace Context).
    pub fn decode(bytes: &[u8]) -> Option<TraceContext> {
        let trace_id: [u8; 16] = bytes.get(..16)?.try_into().ok()?;
        let span_id: [u8; 8] = bytes.get(16..24)?.try_into().ok()?;
        let flags = *bytes.get(24)?;
        (bytes.len() == TRACE_LEN && trace_id != [0; 16] && span_id != [0; 8]).then_some(
            TraceContext {
                trace_id,
                span_id,
                flags,
            },
        )
    }
}
