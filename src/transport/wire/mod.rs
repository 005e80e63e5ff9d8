//! The framed wire format of the data plane: expert-work requests, their replies, and typed
//! errors. Pure (no I/O), so it can be unit tested and fuzzed over `&[u8]`.
//!
//! Every frame is a fixed 44-byte header followed by `payload_len` bytes of payload. All
//! integers are little-endian.
//!
//! ```text
//! offset size field
//!      0    4 magic              b"MOEW"
//!      4    1 version            WIRE_VERSION
//!      5    1 kind               1 request, 2 reply, 3 error
//!      6    2 flags              bit 0: a request carries a trace context; others 0
//!      8    8 request_id         chosen by the client, echoed in the reply or error
//!     16    4 layer              MoE layer of the work (echoed in the reply)
//!     20    8 placement_version  placement the client routed under (echoed in the reply)
//!     28    4 group_count        number of (expert, rows) groups
//!     32    4 width              values per row
//!     36    1 dtype              1 f32, 2 bf16: the precision of the row values
//!     37    3 reserved           must be 0
//!     40    4 payload_len        bytes after the header
//! ```
//!
//! Request and reply payload: `group_count` × (expert u32, rows u32), then for a request
//! with flag bit 0 its trace context ([`TraceContext`]: trace id 16 bytes, span id 8, trace
//! flags 1), then `sum(rows) × width` values in `dtype` (f32: raw IEEE bits; bf16: rounded to nearest even
//! from f32 by the `half` crate). Error payload: a code byte and its fields (see
//! [`RemoteError`]); the header then has zero groups and zero width.
//!
//! Decoding checks the header (magic, version, kind, dtype, reserved bits, group count, payload
//! length against a configurable maximum) before anything is allocated, then checks the
//! payload length against the groups with overflow-checked arithmetic before the rows are
//! allocated.

use thiserror::Error;

mod rows;
mod trace;
mod values;

pub use rows::{GroupRows, Rows};
pub use trace::{TRACE_LEN, TraceContext};
pub(crate) use values::{bf16_bits_to_f32, decode_into, encode_into, f32_to_bf16_bits};
pub use values::{decode_values, decode_values_append, encode_values, encode_values_append};

/// The version this build speaks; a frame with any other version is refused.
pub const WIRE_VERSION: u8 = 1;
/// The first four bytes of every data-plane frame.
pub const MAGIC: [u8; 4] = *b"MOEW";
/// Size of the fixed frame header.
pub const HEADER_LEN: usize = 44;
/// Default largest payload accepted: 256 MiB.
pub const DEFAULT_MAX_PAYLOAD: u32 = 256 << 20;
/// Default largest number of groups in one frame (far above any published expert count).
pub const DEFAULT_MAX_GROUPS: u32 = 1 << 16;
/// Longest message carried by a remote error; longer messages are cut at a char boundary.
pub const MAX_ERROR_MESSAGE: usize = 4096;

const KIND_REQUEST: u8 = 1;
const KIND_REPLY: u8 = 2;
const KIND_ERROR: u8 = 3;
const GROUP_BYTES: u64 = 8;
/// Header flag: a trace context follows a request's groups.
const FLAG_TRACED: u16 = 1;

/// The precision rows travel in: the one the receiving device consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    /// Bytes per value on the wire.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }

    fn code(self) -> u8 {
        match self {
            Dtype::F32 => 1,
            Dtype::Bf16 => 2,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Dtype::F32),
            2 => Some(Dtype::Bf16),
            _ => None,
        }
    }
}

/// One expert-work request: groups of rows, each group for one expert of `layer`.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertRequest {
    pub layer: u32,
    pub placement_version: u64,
    pub width: u32,
    pub dtype: Dtype,
    /// (expert, rows) per group, in plan order.
    pub groups: Vec<(u32, u32)>,
    /// All groups' rows concatenated: `sum(rows) × width` values.
    pub rows: Vec<f32>,
    /// The sending node's span of this call, when it is traced.
    pub trace: Option<TraceContext>,
}

/// A request's header fields and groups without its rows, for a sender that encodes the
/// rows from where they are ([`request_head_prefix`], then [`encode_values_append`] per part).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestHead {
    pub layer: u32,
    pub placement_version: u64,
    pub width: u32,
    pub dtype: Dtype,
    /// (expert, rows) per group, in plan order.
    pub groups: Vec<(u32, u32)>,
    /// The sending node's span of this call, when it is traced.
    pub trace: Option<TraceContext>,
}

/// The reply: output rows in the same group order (always `width` values per row).
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertReply {
    pub groups: Vec<(u32, u32)>,
    pub rows: Vec<f32>,
}

/// A reply as the serving side has it: the groups' outputs where its devices left them, so
/// that the reply frame is encoded from them with no gathering copy.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertOutput {
    pub groups: Vec<(u32, u32)>,
    pub rows: Rows,
}

impl From<ExpertReply> for ExpertOutput {
    fn from(reply: ExpertReply) -> Self {
        ExpertOutput {
            groups: reply.groups,
            rows: Rows::one(reply.rows),
        }
    }
}

/// Why the remote side could not do the work (typed, travels in an error frame).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RemoteError {
    #[error("expert {expert} of layer {layer} is not held by the remote node")]
    NotHeld { layer: u32, expert: u32 },
    /// `theirs` is the requester's placement version, `ours` the serving node's.
    #[error("placement version mismatch: request routed under {theirs}, remote node is on {ours}")]
    WrongPlacement { theirs: u64, ours: u64 },
    #[error("remote device failed: {0}")]
    DeviceFailed(String),
    #[error("remote node is overloaded")]
    Overloaded,
    #[error("remote node could not use the request: {0}")]
    Malformed(String),
}

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    Request,
    Reply,
    Error,
}

impl FrameKind {
    fn code(self) -> u8 {
        match self {
            FrameKind::Request => KIND_REQUEST,
            FrameKind::Reply => KIND_REPLY,
            FrameKind::Error => KIND_ERROR,
        }
    }
}

/// The validated fixed header of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub request_id: u64,
    pub layer: u32,
    pub placement_version: u64,
    pub group_count: u32,
    pub width: u32,
    pub dtype: Dtype,
    pub payload_len: u32,
    /// A request whose trace context follows its groups.
    pub traced: bool,
}

/// A decoded frame body.
#[derive(Debug, Clone, PartialEq)]
pub enum FrameBody {
    Request(ExpertRequest),
    Reply(ExpertReply),
    Error(RemoteError),
}

/// Bounds a decoder enforces before allocating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireLimits {
    pub max_payload: u32,
    pub max_groups: u32,
}

impl Default for WireLimits {
    fn default() -> Self {
        WireLimits {
            max_payload: DEFAULT_MAX_PAYLOAD,
            max_groups: DEFAULT_MAX_GROUPS,
        }
    }
}

/// Why bytes could not be encoded or decoded as a frame.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("not a moe-node data-plane frame (magic {0:02x?})")]
    BadMagic([u8; 4]),
    #[error(
        "wire version {theirs} is not supported (this node speaks {ours}): upgrade the older node"
    )]
    BadVersion { theirs: u8, ours: u8 },
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    #[error("unknown dtype code {0}")]
    BadDtype(u8),
    #[error("payload of {len} bytes is over the limit of {max} bytes")]
    TooLarge { len: u64, max: u32 },
    #[error("{count} groups is over the limit of {max}")]
    TooManyGroups { count: u64, max: u32 },
    #[error("frame truncated: {needed} bytes needed, {got} present")]
    Truncated { needed: u64, got: u64 },
    #[error("malformed frame: {0}")]
    Malformed(String),
}

impl WireError {
    fn malformed(message: impl Into<String>) -> Self {
        WireError::Malformed(message.into())
    }
}

/// A request or reply frame ready to be written: the header and groups already encoded, the
/// rows still as values, so a writer converts them into the wire dtype a cache-sized chunk at
/// a time (`peer::frames::write_rows_frame`) instead of building the whole frame in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct RowsFrame {
    /// The fixed header and the (expert, rows) groups.
    pub prefix: Vec<u8>,
    pub rows: Rows,
    pub dtype: Dtype,
}

impl RowsFrame {
    /// Bytes of the whole frame.
    pub fn len(&self) -> usize {
        self.prefix.len() + self.rows_len()
    }

    /// Bytes of the rows on the wire.
    pub fn rows_len(&self) -> usize {
        self.rows.len() * self.dtype.size()
    }

    /// Whether the frame is empty (never, for a built frame: the header is always there).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole frame in one buffer.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        out.extend_from_slice(&self.prefix);
        self.rows.encode_append(self.dtype, &mut out);
        out
    }
}

/// Encodes a request frame: header, groups and rows in one buffer (the rows are copied once).
pub fn encode_request(request_id: u64, request: &ExpertRequest) -> Result<Vec<u8>, WireError> {
    let prefix = request_prefix(request_id, request)?;
    let mut out = prefix;
    encode_values_append(&request.rows, request.dtype, &mut out);
    Ok(out)
}

/// The request frame of `request` without copying its rows (see [`RowsFrame`]).
pub fn request_frame(request_id: u64, request: ExpertRequest) -> Result<RowsFrame, WireError> {
    let prefix = request_prefix(request_id, &request)?;
    Ok(RowsFrame {
        prefix,
        rows: Rows::one(request.rows),
        dtype: request.dtype,
    })
}

fn request_prefix(request_id: u64, request: &ExpertRequest) -> Result<Vec<u8>, WireError> {
    let header = FrameHeader {
        kind: FrameKind::Request,
        request_id,
        layer: request.layer,
        placement_version: request.placement_version,
        group_count: 0,
        width: request.width,
        dtype: request.dtype,
        payload_len: 0,
        traced: false,
    };
    rows_frame_prefix(header, &request.groups, request.rows.len(), request.trace)
}

/// The header and groups of the request frame of `head` whose rows are `value_count`
/// values (checked against the groups): the bytes [`request_frame`] puts before the rows.
pub fn request_head_prefix(
    request_id: u64,
    head: &RequestHead,
    value_count: usize,
) -> Result<Vec<u8>, WireError> {
    let header = FrameHeader {
        kind: FrameKind::Request,
        request_id,
        layer: head.layer,
        placement_version: head.placement_version,
        group_count: 0,
        width: head.width,
        dtype: head.dtype,
        payload_len: 0,
        traced: false,
    };
    rows_frame_prefix(header, &head.groups, value_count, head.trace)
}

/// Encodes a reply frame for the request it answers (`layer`, `placement_version`, `width`
/// and `dtype` are the request's; the rows travel in the request's dtype).
pub fn encode_reply(
    request_id: u64,
    layer: u32,
    placement_version: u64,
    width: u32,
    dtype: Dtype,
    reply: &ExpertReply,
) -> Result<Vec<u8>, WireError> {
    let frame = reply_frame(
        request_id,
        layer,
        placement_version,
        width,
        dtype,
        reply.clone().into(),
    )?;
    Ok(frame.to_bytes())
}

/// [`encode_reply`] without copying the reply's rows, from the parts the serving side holds
/// them in (see [`RowsFrame`]).
pub fn reply_frame(
    request_id: u64,
    layer: u32,
    placement_version: u64,
    width: u32,
    dtype: Dtype,
    reply: ExpertOutput,
) -> Result<RowsFrame, WireError> {
    let header = FrameHeader {
        kind: FrameKind::Reply,
        request_id,
        layer,
        placement_version,
        group_count: 0,
        width,
        dtype,
        payload_len: 0,
        traced: false,
    };
    let prefix = rows_frame_prefix(header, &reply.groups, reply.rows.len(), None)?;
    Ok(RowsFrame {
        prefix,
        rows: reply.rows,
        dtype,
    })
}

/// Encodes an error frame answering `request_id`.
pub fn encode_error(request_id: u64, error: &RemoteError) -> Vec<u8> {
    let mut payload = Vec::new();
    match error {
        RemoteError::NotHeld { layer, expert } => {
            payload.push(1);
            payload.extend_from_slice(&layer.to_le_bytes());
            payload.extend_from_slice(&expert.to_le_bytes());
        }
        RemoteError::WrongPlacement { theirs, ours } => {
            payload.push(2);
            payload.extend_from_slice(&theirs.to_le_bytes());
            payload.extend_from_slice(&ours.to_le_bytes());
        }
        RemoteError::DeviceFailed(message) => {
            payload.push(3);
            push_message(&mut payload, message);
        }
        RemoteError::Overloaded => payload.push(4),
        RemoteError::Malformed(message) => {
            payload.push(5);
            push_message(&mut payload, message);
        }
    }
    let header = FrameHeader {
        kind: FrameKind::Error,
        request_id,
        layer: 0,
        placement_version: 0,
        group_count: 0,
        width: 0,
        dtype: Dtype::F32,
        // The payload is at most 1 + 4 + MAX_ERROR_MESSAGE bytes.
        payload_len: payload.len() as u32,
        traced: false,
    };
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    write_header(&mut out, &header);
    out.extend_from_slice(&payload);
    out
}

fn push_message(payload: &mut Vec<u8>, message: &str) {
    let mut end = message.len().min(MAX_ERROR_MESSAGE);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let bytes = &message.as_bytes()[..end];
    payload.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    payload.extend_from_slice(bytes);
}

/// Checks the rows against the groups and encodes the header and groups.
fn rows_frame_prefix(
    mut header: FrameHeader,
    groups: &[(u32, u32)],
    value_count: usize,
    trace: Option<TraceContext>,
) -> Result<Vec<u8>, WireError> {
    if header.width == 0 {
        return Err(WireError::malformed("row width 0"));
    }
    let group_count = u32::try_from(groups.len())
        .map_err(|_| WireError::malformed(format!("{} groups do not fit a frame", groups.len())))?;
    let total_rows = groups
        .iter()
        .try_fold(0u64, |sum, &(_, rows)| sum.checked_add(u64::from(rows)))
        .ok_or_else(|| WireError::malformed("row count overflows"))?;
    let values = total_rows
        .checked_mul(u64::from(header.width))
        .ok_or_else(|| WireError::malformed("row values overflow"))?;
    if values != value_count as u64 {
        return Err(WireError::malformed(format!(
            "groups describe {total_rows} rows of width {} ({values} values) but {value_count} values were given",
            header.width,
        )));
    }
    header.traced = trace.is_some();
    let payload_len = payload_len_for(group_count, values, header.dtype, header.traced)
        .and_then(|len| u32::try_from(len).ok())
        .ok_or_else(|| WireError::malformed("payload does not fit a frame (over 4 GiB)"))?;
    header.group_count = group_count;
    header.payload_len = payload_len;

    let mut out = Vec::with_capacity(HEADER_LEN + groups_len(&header));
    write_header(&mut out, &header);
    for &(expert, count) in groups {
        out.extend_from_slice(&expert.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
    }
    if let Some(trace) = trace {
        trace.encode_append(&mut out);
    }
    Ok(out)
}

fn payload_len_for(group_count: u32, values: u64, dtype: Dtype, traced: bool) -> Option<u64> {
    let groups = u64::from(group_count).checked_mul(GROUP_BYTES)?;
    let rows = values.checked_mul(dtype.size() as u64)?;
    let trace = if traced { TRACE_LEN as u64 } else { 0 };
    groups.checked_add(rows)?.checked_add(trace)
}

/// The bytes before a request's or reply's rows in its payload: its groups, and a
/// request's trace context when it carries one.
pub fn groups_len(header: &FrameHeader) -> usize {
    header.group_count as usize * GROUP_BYTES as usize + if header.traced { TRACE_LEN } else { 0 }
}

fn write_header(out: &mut Vec<u8>, header: &FrameHeader) {
    out.extend_from_slice(&MAGIC);
    out.push(WIRE_VERSION);
    out.push(header.kind.code());
    let flags = if header.traced { FLAG_TRACED } else { 0 };
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&header.request_id.to_le_bytes());
    out.extend_from_slice(&header.layer.to_le_bytes());
    out.extend_from_slice(&header.placement_version.to_le_bytes());
    out.extend_from_slice(&header.group_count.to_le_bytes());
    out.extend_from_slice(&header.width.to_le_bytes());
    out.push(header.dtype.code());
    out.extend_from_slice(&[0; 3]);
    out.extend_from_slice(&header.payload_len.to_le_bytes());
}

/// A little-endian cursor that never panics: every read is bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, at: 0 }
    }

    fn take(&mut self, len: usize) -> Result<&'a [u8], WireError> {
        let end = self
            .at
            .checked_add(len)
            .filter(|&end| end <= self.bytes.len());
        match end {
            Some(end) => {
                let slice = &self.bytes[self.at..end];
                self.at = end;
                Ok(slice)
            }
            None => Err(WireError::Truncated {
                needed: self.at as u64 + len as u64,
                got: self.bytes.len() as u64,
            }),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn rest(&self) -> &'a [u8] {
        &self.bytes[self.at..]
    }
}

/// Validates a frame header (the first [`HEADER_LEN`] bytes of `bytes`): magic, version,
/// kind, reserved bits, dtype, group count and payload length against `limits`.
pub fn decode_header(bytes: &[u8], limits: &WireLimits) -> Result<FrameHeader, WireError> {
    let mut reader = Reader::new(bytes);
    let magic: [u8; 4] = reader.array()?;
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = reader.u8()?;
    if version != WIRE_VERSION {
        return Err(WireError::BadVersion {
            theirs: version,
            ours: WIRE_VERSION,
        });
    }
    let kind = match reader.u8()? {
        KIND_REQUEST => FrameKind::Request,
        KIND_REPLY => FrameKind::Reply,
        KIND_ERROR => FrameKind::Error,
        other => return Err(WireError::BadKind(other)),
    };
    let flags = u16::from_le_bytes(reader.array()?);
    let allowed = if kind == FrameKind::Request {
        FLAG_TRACED
    } else {
        0
    };
    if flags & !allowed != 0 {
        return Err(WireError::malformed(format!(
            "reserved flags {flags:#06x} set"
        )));
    }
    let traced = flags & FLAG_TRACED != 0;
    let request_id = reader.u64()?;
    let layer = reader.u32()?;
    let placement_version = reader.u64()?;
    let group_count = reader.u32()?;
    let width = reader.u32()?;
    let dtype_code = reader.u8()?;
    let dtype = Dtype::from_code(dtype_code).ok_or(WireError::BadDtype(dtype_code))?;
    let reserved: [u8; 3] = reader.array()?;
    if reserved != [0; 3] {
        return Err(WireError::malformed("reserved header bytes set"));
    }
    let payload_len = reader.u32()?;
    if payload_len > limits.max_payload {
        return Err(WireError::TooLarge {
            len: u64::from(payload_len),
            max: limits.max_payload,
        });
    }
    if group_count > limits.max_groups {
        return Err(WireError::TooManyGroups {
            count: u64::from(group_count),
            max: limits.max_groups,
        });
    }
    match kind {
        FrameKind::Error => {
            if group_count != 0 || width != 0 {
                return Err(WireError::malformed("error frame with groups or width"));
            }
            if payload_len as usize > 1 + 4 + MAX_ERROR_MESSAGE {
                return Err(WireError::malformed("error frame payload too long"));
            }
        }
        FrameKind::Request | FrameKind::Reply => {
            if width == 0 {
                return Err(WireError::malformed("row width 0"));
            }
            let trace = if traced { TRACE_LEN as u64 } else { 0 };
            let group_bytes = u64::from(group_count) * GROUP_BYTES + trace;
            if group_bytes > u64::from(payload_len) {
                return Err(WireError::malformed(format!(
                    "{group_count} groups need {group_bytes} bytes but the payload has {payload_len}"
                )));
            }
        }
    }
    Ok(FrameHeader {
        kind,
        request_id,
        layer,
        placement_version,
        group_count,
        width,
        dtype,
        payload_len,
        traced,
    })
}

/// Decodes a payload of exactly `header.payload_len` bytes for an already validated header.
pub fn decode_payload(header: &FrameHeader, payload: &[u8]) -> Result<FrameBody, WireError> {
    if payload.len() as u64 != u64::from(header.payload_len) {
        return Err(WireError::Truncated {
            needed: u64::from(header.payload_len),
            got: payload.len() as u64,
        });
    }
    if header.kind == FrameKind::Error {
        return decode_error(payload).map(FrameBody::Error);
    }
    let (group_bytes, row_bytes) = payload.split_at(groups_len(header).min(payload.len()));
    let groups = decode_groups(header, group_bytes)?;
    let mut rows = Vec::with_capacity(groups.values);
    decode_values_append(row_bytes, header.dtype, &mut rows);
    Ok(rows_body(header, groups, rows))
}

/// What precedes the rows of a request or reply, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Groups {
    /// (expert, rows) per group.
    pub groups: Vec<(u32, u32)>,
    /// How many row values the rest of the payload holds.
    pub values: usize,
    pub trace: Option<TraceContext>,
}

/// Decodes the groups of a request or reply (the first [`groups_len`] payload bytes: the
/// groups, and a traced request's trace context) and checks them against the payload
/// length.
pub fn decode_groups(header: &FrameHeader, group_bytes: &[u8]) -> Result<Groups, WireError> {
    let mut reader = Reader::new(group_bytes);
    let mut total_rows = 0u64;
    // The header check bounds group_count by the payload length, so this allocation is
    // bounded by what was already read.
    let mut groups = Vec::with_capacity(header.group_count as usize);
    for _ in 0..header.group_count {
        let expert = reader.u32()?;
        let rows = reader.u32()?;
        total_rows += u64::from(rows);
        groups.push((expert, rows));
    }
    let values = total_rows
        .checked_mul(u64::from(header.width))
        .ok_or_else(|| WireError::malformed("row values overflow"))?;
    let trace = if header.traced {
        let bytes = reader.take(TRACE_LEN)?;
        Some(
            TraceContext::decode(bytes)
                .ok_or_else(|| WireError::malformed("a trace context with a zero id"))?,
        )
    } else {
        None
    };
    let expected = payload_len_for(header.group_count, values, header.dtype, header.traced)
        .ok_or_else(|| WireError::malformed("payload length overflows"))?;
    if expected != u64::from(header.payload_len) {
        return Err(WireError::malformed(format!(
            "groups describe {total_rows} rows of width {} ({expected} payload bytes) but the payload has {}",
            header.width, header.payload_len
        )));
    }
    Ok(Groups {
        groups,
        // Bounded by payload_len, which the header check bounded by the limits.
        values: values as usize,
        trace,
    })
}

/// The body of a request or reply frame from its decoded groups and rows.
pub fn rows_body(header: &FrameHeader, groups: Groups, rows: Vec<f32>) -> FrameBody {
    match header.kind {
        FrameKind::Request => FrameBody::Request(ExpertRequest {
            layer: header.layer,
            placement_version: header.placement_version,
            width: header.width,
            dtype: header.dtype,
            groups: groups.groups,
            rows,
            trace: groups.trace,
        }),
        _ => FrameBody::Reply(ExpertReply {
            groups: groups.groups,
            rows,
        }),
    }
}

/// Decodes the payload of an error frame.
pub fn decode_error(payload: &[u8]) -> Result<RemoteError, WireError> {
    let mut reader = Reader::new(payload);
    let error = match reader.u8()? {
        1 => RemoteError::NotHeld {
            layer: reader.u32()?,
            expert: reader.u32()?,
        },
        2 => RemoteError::WrongPlacement {
            theirs: reader.u64()?,
            ours: reader.u64()?,
        },
        3 => RemoteError::DeviceFailed(read_message(&mut reader)?),
        4 => RemoteError::Overloaded,
        5 => RemoteError::Malformed(read_message(&mut reader)?),
        other => return Err(WireError::malformed(format!("unknown error code {other}"))),
    };
    if !reader.rest().is_empty() {
        return Err(WireError::malformed("trailing bytes after the error"));
    }
    Ok(error)
}

fn read_message(reader: &mut Reader<'_>) -> Result<String, WireError> {
    let len = reader.u32()? as usize;
    if len > MAX_ERROR_MESSAGE {
        return Err(WireError::malformed("error message too long"));
    }
    let bytes = reader.take(len)?;
    String::from_utf8(bytes.to_vec())
        .map_err(|_| WireError::malformed("error message is not UTF-8"))
}

/// Decodes one whole frame (header and payload, nothing after it). The entry point for
/// fuzzing: never panics, allocates only after the lengths are checked.
pub fn decode(bytes: &[u8], limits: &WireLimits) -> Result<(FrameHeader, FrameBody), WireError> {
    let header = decode_header(bytes, limits)?;
    let payload = &bytes[HEADER_LEN.min(bytes.len())..];
    if payload.len() as u64 > u64::from(header.payload_len) {
        return Err(WireError::malformed("trailing bytes after the payload"));
    }
    let body = decode_payload(&header, payload)?;
    Ok((header, body))
}

#[cfg(test)]
mod tests;
