//! The rows of one dispatch as the sends read them: a slice of host memory, or rows in
//! GPU memory that stay there for this node's GPUs and are brought to the host group by
//! group for the other targets.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::super::device::ResidentSends;
use super::super::target::{FailCause, TargetError};
use super::super::{DeviceRows, ExpertError};

/// The rows of each group of one dispatch: in host memory, or in GPU memory
/// ([`DeviceRows`]), brought to the host group by group where a group is computed
/// elsewhere than on a GPU of this node.
pub(super) struct GroupInput<'a> {
    host: &'a [f32],
    /// The buffer `host` is, where the caller shares it: device actors then take ranges of
    /// it instead of copies of their groups.
    pub(super) shared: Option<Arc<Vec<f32>>>,
    pub(super) resident: Option<Resident<'a>>,
    /// Each group's first row.
    pub(super) starts: Vec<usize>,
    pub(super) rows: &'a [usize],
    pub(super) width: usize,
}

/// Rows in GPU memory, what of them has been brought to the host, and the resident sends
/// still in flight.
pub(super) struct Resident<'a> {
    pub(super) rows: &'a DeviceRows<'a>,
    staged: Vec<std::sync::OnceLock<Vec<f32>>>,
    pub(super) sends: Arc<ResidentSends>,
    staged_bytes: &'a AtomicU64,
}

impl<'a> GroupInput<'a> {
    /// `input` as `rows[g]` rows of `width` per group, or an error when it does not hold
    /// that many values or `experts` names another number of groups.
    pub(super) fn new(
        input: &'a [f32],
        experts: &[u32],
        rows: &'a [usize],
        width: usize,
    ) -> Result<Self, ExpertError> {
        let starts = starts_of(rows);
        let total: usize = rows.iter().sum();
        if total * width != input.len() || experts.len() != rows.len() {
            return Err(ExpertError::Malformed {
                groups: experts.len(),
                rows: total,
                values: input.len(),
            });
        }
        Ok(GroupInput {
            host: input,
            shared: None,
            resident: None,
            starts,
            rows,
            width,
        })
    }

    pub(super) fn resident(
        rows_on_gpu: &'a DeviceRows<'a>,
        rows: &'a [usize],
        width: usize,
        staged_bytes: &'a AtomicU64,
    ) -> Self {
        GroupInput {
            host: &[],
            shared: None,
            resident: Some(Resident {
                rows: rows_on_gpu,
                staged: rows.iter().map(|_| std::sync::OnceLock::new()).collect(),
                sends: Arc::default(),
                staged_bytes,
            }),
            starts: starts_of(rows),
            rows,
            width,
        }
    }

    /// [`GroupInput::new`] over a buffer the device actors may share.
    pub(super) fn shared(
        input: &'a Arc<Vec<f32>>,
        experts: &[u32],
        rows: &'a [usize],
        width: usize,
    ) -> Result<Self, ExpertError> {
        let mut group_input = GroupInput::new(input, experts, rows, width)?;
        group_input.shared = Some(input.clone());
        Ok(group_input)
    }

    /// Where group `g`'s values are in the host rows (and so in `shared`).
    pub(super) fn range(&self, g: usize) -> std::ops::Range<usize> {
        let at = self.starts[g] * self.width;
        at..at + self.rows[g] * self.width
    }

    /// Group `g`'s rows in host memory (copied from the GPU the first time).
    pub(super) fn get(&self, g: usize) -> Result<&[f32], TargetError> {
        let Some(resident) = &self.resident else {
            return Ok(&self.host[self.range(g)]);
        };
        if let Some(rows) = resident.staged[g].get() {
            return Ok(rows);
        }
        let rows = resident
            .rows
            .staging
            .download(self.starts[g], self.rows[g])
            .map_err(|e| TargetError::Failed(FailCause::Staging(e)))?;
        resident
            .staged_bytes
            .fetch_add((rows.len() * 2) as u64, Ordering::Relaxed);
        Ok(resident.staged[g].get_or_init(|| rows))
    }

    /// Waits until no device touches the GPU rows any more.
    pub(super) fn wait_for_devices(&self) {
        if let Some(resident) = &self.resident {
            resident.sends.wait();
        }
    }
}

fn starts_of(rows: &[usize]) -> Vec<usize> {
    rows.iter()
        .scan(0, |at, &r| {
            let start = *at;
            *at += r;
            Some(start)
        })
        .collect()
}
