//! The router's side of the expert seam: an [`ExpertExecutor`] that hands each step's token
//! groups to the device actors holding the experts, fails over to another replica when a
//! device is gone, and counts the load.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::future::join_all;

use super::device::{DeviceHandle, RunExperts};
use crate::moe::{DispatchPlan, ExpertError, ExpertExecutor};
use crate::placement::{ExpertLoad, Placement, assign_groups};

pub struct DeviceExperts {
    devices: Vec<DeviceHandle>,
    /// Cleared the first time a device is found gone; it is never used again.
    alive: Vec<AtomicBool>,
    placement: Arc<Placement>,
    load: Arc<ExpertLoad>,
    hidden_size: usize,
}

impl DeviceExperts {
    pub fn new(
        devices: Vec<DeviceHandle>,
        placement: Arc<Placement>,
        load: Arc<ExpertLoad>,
        hidden_size: usize,
    ) -> Self {
        DeviceExperts {
            alive: devices.iter().map(|_| AtomicBool::new(true)).collect(),
            devices,
            placement,
            load,
            hidden_size,
        }
    }

    /// Whether each device can still take work. A device whose actor has stopped is marked
    /// dead here, the first time it is seen.
    pub fn alive(&self) -> Vec<bool> {
        self.devices
            .iter()
            .enumerate()
            .map(|(i, device)| {
                if self.alive[i].load(Ordering::Relaxed) && !device.addr.connected() {
                    self.mark_dead(i);
                }
                self.alive[i].load(Ordering::Relaxed)
            })
            .collect()
    }

    fn mark_dead(&self, device: usize) {
        if self.alive[device].swap(false, Ordering::Relaxed) {
            tracing::warn!(device, "device gone: its experts are served by replicas");
        }
    }
}

impl ExpertExecutor for DeviceExperts {
    fn run(
        &self,
        layer: usize,
        plan: &DispatchPlan,
        grouped_input: &[f32],
    ) -> Result<Vec<f32>, ExpertError> {
        let width = self.hidden_size;
        let mut outputs: Vec<Option<Vec<f32>>> = vec![None; plan.experts.len()];
        // Groups (indices into plan.experts) still to run; after a device fails, its groups
        // go round again to the surviving replicas.
        let mut pending: Vec<usize> = (0..plan.experts.len()).collect();
        while !pending.is_empty() {
            let experts: Vec<u32> = pending.iter().map(|&g| plan.experts[g]).collect();
            let chosen = assign_groups(
                &self.placement,
                layer,
                &experts,
                |i| plan.group(pending[i]).len(),
                &self.alive(),
            )
            .map_err(|expert| {
                ExpertError::Unavailable(format!(
                    "no live device holds expert {expert} of layer {layer}"
                ))
            })?;
            let mut per_device: Vec<Vec<usize>> = vec![Vec::new(); self.devices.len()];
            for (&group, &device) in pending.iter().zip(&chosen) {
                per_device[device].push(group);
            }
            let sends = per_device
                .iter()
                .enumerate()
                .filter(|(_, groups)| !groups.is_empty())
                .map(|(device, groups)| {
                    let groups = groups
                        .iter()
                        .map(|&g| {
                            let rows = plan.group(g);
                            let input =
                                grouped_input[rows.start * width..rows.end * width].to_vec();
                            (plan.experts[g], input)
                        })
                        .collect();
                    let reply = self.devices[device].addr.send(RunExperts { layer, groups });
                    async move { (device, reply.await) }
                });
            // The router's own thread waits here: the step cannot go on without the experts.
            // The router runs inside a tokio task, whose cooperative budget would run out
            // after ~128 replies and defer the wake-up to a scheduler this thread is blocking:
            // waiting outside the budget avoids that deadlock.
            let replies =
                futures::executor::block_on(tokio::task::coop::unconstrained(join_all(sends)));
            pending.clear();
            for (device, reply) in replies {
                let groups = &per_device[device];
                match reply {
                    Ok(Ok(outs)) => {
                        for (&g, out) in groups.iter().zip(outs) {
                            self.load
                                .record(layer, plan.experts[g], device, plan.group(g).len());
                            outputs[g] = Some(out);
                        }
                    }
                    Ok(Err(ExpertError::DeviceFailed(_))) | Err(_) => {
                        self.mark_dead(device);
                        pending.extend(groups);
                    }
                    Ok(Err(e)) => return Err(e),
                }
            }
        }
        let mut out = Vec::with_capacity(plan.len() * width);
        for o in outputs.into_iter().flatten() {
            out.extend_from_slice(&o);
        }
        Ok(out)
    }
}
