//! How the dispatcher hands a share of groups to its target: a device actor of this node
//! (host rows, or rows left in GPU memory for a GPU), the calling thread for small work on
//! CPU slots, or another node through the peer links.

use std::sync::Arc;

use super::super::device::{RunExperts, RunResident};
use super::super::run_expert_groups;
use super::super::target::{Answer, GoneCause, GroupRows, RemoteWork, TargetError};
use super::{Dispatcher, GroupInput};
use crate::model::ExpertWeights;

impl Dispatcher {
    pub(super) fn send_local(
        &self,
        device: u16,
        layer: usize,
        groups: &[usize],
        experts: &[u32],
        group_input: &GroupInput<'_>,
        answer: Answer,
    ) -> Result<(), TargetError> {
        let handle = self
            .device(device)
            .ok_or(TargetError::Gone(GoneCause::NoDevice { device }))?;
        let stopped = || TargetError::Gone(GoneCause::DeviceStopped { device });
        if let (Some(resident), Some(_)) = (&group_input.resident, handle.gpu) {
            let message = RunResident {
                layer,
                groups: groups
                    .iter()
                    .map(|&g| (experts[g], group_input.starts[g], group_input.rows[g]))
                    .collect(),
                gpu: resident.rows.gpu,
                input: resident.rows.input,
                output: resident.rows.output,
                answer,
                ticket: resident.sends.ticket(),
            };
            // A stopped actor refuses the message; dropping it answers Gone.
            return handle.addr.try_send(message).map_err(|_| stopped());
        }
        let (rows, ranges) = match &group_input.shared {
            // Rows from another node: the actor reads its groups where they were decoded.
            Some(shared) => (
                shared.clone(),
                groups.iter().map(|&g| group_input.range(g)).collect(),
            ),
            // The engine's rows are borrowed for this call only: the send's groups are
            // copied into one buffer.
            None => {
                let total: usize = groups.iter().map(|&g| group_input.rows[g]).sum();
                let mut rows = Vec::with_capacity(total * group_input.width);
                let mut ranges = Vec::with_capacity(groups.len());
                for &g in groups {
                    let at = rows.len();
                    rows.extend_from_slice(group_input.get(g)?);
                    ranges.push(at..rows.len());
                }
                (Arc::new(rows), ranges)
            }
        };
        let message = RunExperts {
            layer,
            rows,
            groups: groups.iter().map(|&g| experts[g]).zip(ranges).collect(),
            answer,
        };
        handle.addr.try_send(message).map_err(|_| stopped())
    }

    /// Runs the `(device, groups, answer)` shares from this thread, all of them in one
    /// parallel region (one fork and join for the layer, however many CPU slots its
    /// experts are spread over), where they are CPU slots'; the others go to their
    /// device's actor. Answers each.
    pub(super) fn run_inline(
        &self,
        layer: usize,
        shares: &mut Vec<(u16, Vec<usize>, Answer)>,
        experts: &[u32],
        group_input: &GroupInput<'_>,
    ) {
        let mut runs: Vec<(Vec<Arc<ExpertWeights>>, Vec<usize>, Answer)> = Vec::new();
        for (device, groups, answer) in shares.drain(..) {
            let handle = self.device(device);
            // Rows on a GPU stay there when this device is a GPU.
            let on_gpu = handle.as_ref().is_some_and(|h| h.gpu.is_some());
            if on_gpu && group_input.resident.is_some() {
                let _ = self.send_local(device, layer, &groups, experts, group_input, answer);
                continue;
            }
            let work: Result<Vec<(u32, &[f32])>, TargetError> = groups
                .iter()
                .map(|&g| Ok((experts[g], group_input.get(g)?)))
                .collect();
            let work = match work {
                Ok(work) => work,
                Err(e) => {
                    answer.send(Err(e));
                    continue;
                }
            };
            match handle.and_then(|h| h.weights_here(layer, &work)) {
                Some(Ok(weights)) => runs.push((weights, groups, answer)),
                Some(Err(e)) => answer.send(Err(e)),
                None => {
                    // A refused send answers through `answer`'s drop.
                    let _ = self.send_local(device, layer, &groups, experts, group_input, answer);
                }
            }
        }
        let all: Vec<(&ExpertWeights, &[f32])> = runs
            .iter()
            .flat_map(|(weights, groups, _)| {
                weights
                    .iter()
                    .zip(groups)
                    // Staged already, when the work list above was made.
                    .map(|(weights, &g)| (&**weights, group_input.get(g).unwrap_or(&[])))
            })
            .collect();
        let mut outputs = run_expert_groups(&all, group_input.width, true).into_iter();
        for (_, groups, answer) in runs {
            answer.send(Ok(GroupRows::own_each(
                outputs.by_ref().take(groups.len()).collect(),
            )));
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn send_remote(
        &self,
        node: u16,
        layer: usize,
        placement_version: u64,
        groups: &[usize],
        experts: &[u32],
        group_input: &GroupInput<'_>,
        answer: Answer,
    ) -> Result<(), TargetError> {
        let remote = self
            .remote
            .as_ref()
            .ok_or(TargetError::Gone(GoneCause::NoPeers))?;
        let group_rows = group_input.rows;
        // Borrowed: the peer client encodes the frame from the groups where they are.
        let rows = groups
            .iter()
            .map(|&g| group_input.get(g))
            .collect::<Result<Vec<&[f32]>, TargetError>>()?;
        let work = RemoteWork {
            layer,
            placement_version,
            groups: groups
                .iter()
                .map(|&g| (experts[g], group_rows[g] as u32))
                .collect(),
            rows,
        };
        remote.send(node, work, answer)
    }
}
