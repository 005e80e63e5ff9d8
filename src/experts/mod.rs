//! The expert data plane: everything between "these rows need these experts" and "here are
//! their outputs", on this node's devices or on other nodes.
//!
//! - The seam: [`ExpertExecutor`], which the engine calls once per MoE layer per step, and
//!   [`ExpertError`], why it could not.
//! - [`local`]: every expert in this process's memory ([`LocalExperts`], `moe-node generate`
//!   and the reference tests), and [`gpu`]: the same on one GPU.
//! - [`dispatch`]: the serving node's executor ([`Dispatcher`]): it chooses a replica per
//!   group ([`choice`]), fed with what it measured of each target ([`health`]), sends the
//!   groups, and re-sends those whose target fails or is late ([`attempts`], the pure state
//!   machine, driven by a thin loop).
//! - [`Target`], [`Answer`] and [`RemoteNodes`]: where a group is sent, how its answer comes
//!   back (exactly once), and the seam to other nodes.
//! - [`device`]: the device actors that own the experts placed on one GPU or CPU slot.
//! - [`remote`]: the other nodes as the dispatcher reaches them, and the handler that runs
//!   their work here.

mod attempts;
mod choice;
pub mod device;
mod dispatch;
pub mod gpu;
mod health;
mod holdings;
mod local;
pub mod remote;
mod target;

pub use choice::{assign_groups, assign_groups_among};
pub use dispatch::{DispatchTiming, Dispatcher, PlacementSwitch};
pub use health::{Penalties, Reach, ReplicaHealth};
pub use local::{LocalExperts, run_expert_groups};
pub use target::{
    Answer, FailCause, GoneCause, GroupOutputs, GroupRows, RemoteNodes, RemoteWork, Target,
    TargetError,
};

use std::sync::Arc;

use crate::compute::cuda::CudaError;
use crate::moe::DispatchPlan;

/// Why expert work could not be done. Carried as it is up to where a request's outcome is
/// decided (the engine's error, then the HTTP status).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ExpertError {
    #[error("expert {expert} of layer {layer} is not held by this executor")]
    NotHeld { layer: usize, expert: u32 },
    /// Every replica of these experts (sorted, each once) is down or failed the work.
    #[error(
        "expert executor unavailable: no live replica holds expert{} {} of layer {layer}",
        if experts.len() > 1 { "s" } else { "" },
        experts.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
    )]
    NoLiveReplica { layer: usize, experts: Vec<u32> },
    /// The rows handed over do not match their groups.
    #[error(
        "expert executor unavailable: malformed expert work: {groups} groups, {rows} rows, {values} values"
    )]
    Malformed {
        groups: usize,
        rows: usize,
        values: usize,
    },
    /// Asked for the experts of a layer that has none.
    #[error("expert executor unavailable: layer {layer} has no experts")]
    DenseLayer { layer: usize },
    /// Every send's answer was lost (the dispatch's channel closed): a bug, not a failure
    /// of a target.
    #[error("expert executor unavailable: dispatch lost its answers")]
    AnswersLost,
    /// The GPU failed while computing and took itself out of service; its groups can go
    /// to replicas.
    #[error("device failed: GPU {gpu}: {error}")]
    DeviceFailed { gpu: usize, error: Arc<CudaError> },
    /// Rows computed off the GPU could not be brought back into its memory.
    #[error("device failed: {0}")]
    Staging(StagingError),
}

/// Why rows could not move between a GPU's memory and the host ([`RowStaging`]).
#[derive(Debug, Clone, thiserror::Error)]
pub enum StagingError {
    #[error("rows from the GPU: {0}")]
    Download(Arc<CudaError>),
    #[error("rows to the GPU: {0}")]
    Upload(Arc<CudaError>),
}

/// One MoE layer's grouped rows in the memory of GPU `gpu` of this process: `input` holds
/// them as bf16 `[rows, width]`, and `output` takes the experts' bf16 outputs in the same
/// layout. Groups held on that GPU or a peer of it never leave device memory; those that
/// must (a CPU slot, another node) go through `staging`.
pub struct DeviceRows<'a> {
    pub gpu: usize,
    pub input: u64,
    pub output: u64,
    pub staging: &'a dyn RowStaging,
}

/// Moves rows of a [`DeviceRows`] through the host, for groups computed off the GPU: one
/// copy each way, counted by whoever implements it.
pub trait RowStaging {
    /// Input rows `first..first + rows`, widened to f32.
    fn download(&self, first: usize, rows: usize) -> Result<Vec<f32>, StagingError>;
    /// Writes `values` (whole rows) as output rows from `first` on, rounded to bf16.
    fn upload(&self, first: usize, values: &[f32]) -> Result<(), StagingError>;
}

/// Runs grouped token rows through the experts of one layer. The engine calls this once per
/// MoE layer per step; an implementation may compute locally, hand groups to device actors,
/// or send them to other nodes.
pub trait ExpertExecutor: Send + Sync {
    /// `grouped_input` holds `plan.len()` rows of `hidden_size`, grouped as `plan` says.
    /// Returns the expert outputs in the same order (not yet weighted).
    fn run(
        &self,
        layer: usize,
        plan: &DispatchPlan,
        grouped_input: &[f32],
    ) -> Result<Vec<f32>, ExpertError>;

    /// The same over rows already in a GPU's memory, grouped (`group_rows[g]` rows for
    /// `experts[g]`, consecutive), the outputs written in place. `None`: this executor takes
    /// rows from the host only; the engine then brings them there and calls
    /// [`ExpertExecutor::run`].
    fn run_on_device(
        &self,
        _layer: usize,
        _experts: &[u32],
        _group_rows: &[usize],
        _rows: &DeviceRows<'_>,
    ) -> Option<Result<(), ExpertError>> {
        None
    }

    /// Experts of `layer` that tokens should be routed around (no live replica), when the
    /// executor reroutes instead of failing; `None` when it does not.
    fn avoid(&self, _layer: usize) -> Option<Vec<bool>> {
        None
    }

    /// Told how many token-to-expert choices of `layer` went to another expert because of
    /// [`ExpertExecutor::avoid`].
    fn rerouted(&self, _layer: usize, _choices: usize) {}
}
