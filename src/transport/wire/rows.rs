//! Rows as a frame carries them before they are encoded: one buffer, or the parts they were
//! computed in (each group's output where its device left it), so that a serving node
//! encodes its reply from the outputs without first gathering them into one buffer.

use std::ops::Range;
use std::sync::Arc;

use super::Dtype;
use super::values::encode_values_append;

/// One group's rows: a buffer of its own (what a device computed), or its range of a buffer
/// that holds the rows of several groups (a reply or request as it was decoded), so that a
/// frame is not split into copies.
#[derive(Debug, Clone)]
pub enum GroupRows {
    Own(Vec<f32>),
    Shared(Arc<Vec<f32>>, Range<usize>),
}

impl Default for GroupRows {
    fn default() -> Self {
        GroupRows::Own(Vec::new())
    }
}

impl std::ops::Deref for GroupRows {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            GroupRows::Own(rows) => rows,
            GroupRows::Shared(rows, range) => &rows[range.clone()],
        }
    }
}

impl PartialEq for GroupRows {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl GroupRows {
    /// The rows as a vector of their own (a copy only for a shared range).
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            GroupRows::Own(rows) => rows,
            GroupRows::Shared(rows, range) => rows[range].to_vec(),
        }
    }

    /// One group per output a device computed.
    pub fn own_each(outputs: Vec<Vec<f32>>) -> Vec<GroupRows> {
        outputs.into_iter().map(GroupRows::Own).collect()
    }
}

/// A frame's rows in order, as parts: the values of the frame are the parts' values one
/// after the other.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rows {
    parts: Vec<GroupRows>,
    len: usize,
}

impl Rows {
    /// Rows in one buffer.
    pub fn one(rows: Vec<f32>) -> Self {
        Rows::parts(vec![GroupRows::Own(rows)])
    }

    /// Rows in parts, in order.
    pub fn parts(parts: Vec<GroupRows>) -> Self {
        let len = parts.iter().map(|part| part.len()).sum();
        Rows { parts, len }
    }

    /// The parts, in order.
    pub fn as_parts(&self) -> &[GroupRows] {
        &self.parts
    }

    /// Values in all parts.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The values in one buffer: the buffer itself when there is one part of its own, else
    /// a copy.
    pub fn into_vec(self) -> Vec<f32> {
        let mut parts = self.parts;
        if parts.len() == 1 {
            return parts.pop().unwrap_or_default().into_vec();
        }
        let mut all = Vec::with_capacity(self.len);
        for part in &parts {
            all.extend_from_slice(part);
        }
        all
    }

    /// Appends the `dtype` bytes of every value to `out`.
    pub fn encode_append(&self, dtype: Dtype, out: &mut Vec<u8>) {
        out.reserve(self.len * dtype.size());
        for part in &self.parts {
            encode_values_append(part, dtype, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::wire::encode_values;

    #[test]
    fn parts_encode_as_the_one_buffer_they_make() {
        let all: Vec<f32> = (0..23).map(|v| v as f32 * 0.25 - 2.0).collect();
        let shared = Arc::new(all.clone());
        let rows = Rows::parts(vec![
            GroupRows::Own(all[..5].to_vec()),
            GroupRows::Own(Vec::new()),
            GroupRows::Shared(shared.clone(), 5..17),
            GroupRows::Shared(shared, 17..23),
        ]);
        assert_eq!(rows.len(), all.len());
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let mut whole = vec![0u8; all.len() * dtype.size()];
            encode_values(&all, dtype, &mut whole);
            let mut appended = Vec::new();
            rows.encode_append(dtype, &mut appended);
            assert_eq!(appended, whole, "{dtype:?}");
        }
        assert_eq!(rows.clone().into_vec(), all);
        // One part of its own is handed back, not copied.
        let one = Rows::one(all.clone());
        let pointer = match &one.parts[0] {
            GroupRows::Own(rows) => rows.as_ptr(),
            GroupRows::Shared(..) => unreachable!(),
        };
        let back = one.into_vec();
        assert_eq!(back.as_ptr(), pointer);
    }
}
