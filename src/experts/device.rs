//! The device actor: owns the expert weights placed on one device (a GPU, or a CPU slot)
//! and runs groups of token rows through them. Each device actor has its own thread (a
//! dedicated arbiter), so expert compute never runs on the HTTP runtime. A CPU slot's
//! handle can also run small work on the caller's thread ([`DeviceHandle::run_here`]):
//! below a few hundred microseconds of work, handing it to the slot's thread and back
//! costs more than the work.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock, mpsc};

use actix::prelude::*;

use super::target::{Answer, FailCause, GoneCause, GroupOutputs, GroupRows, TargetError};
use crate::compute::cuda::experts::RunOutcome;
use crate::compute::cuda::{self, CudaError, CudaRuntime};
use crate::compute::cuda::{GpuExperts, GpuInfo};
use crate::config::{Backend, DevicesConfig};
pub use crate::experts::gpu::GpuOptions;

use super::gpu::{LoadError, load_experts as load_gpu};
use crate::experts::run_expert_groups;
use crate::model::weights::load_expert;
use crate::model::{Checkpoint, ExpertWeights, ModelConfig, ModelError};

/// What a device actor computes on.
#[derive(Debug, Clone)]
pub enum DeviceTarget {
    /// A CPU slot: one thread.
    Cpu,
    /// A GPU, with what it needs besides its experts.
    Gpu(GpuInfo, GpuOptions),
}

pub struct DeviceActor {
    id: usize,
    experts: Held,
    holding: Arc<Holding>,
    /// Of a GPU's free memory, what new experts may take (`devices.gpu_memory_fraction`).
    memory_fraction: f64,
}

/// What a device holds, as its handle reads it (the admin API, metrics).
#[derive(Debug, Default)]
pub struct Holding {
    experts: AtomicUsize,
    weight_bytes: AtomicUsize,
    /// Bytes of experts a GPU could still take (0 where unknown); a CPU slot's room is the
    /// host's ([`host_memory_available`]).
    room_bytes: AtomicUsize,
}

enum Held {
    Cpu(Arc<CpuExperts>),
    Gpu(Box<GpuExperts>),
}

/// A CPU slot's experts. The actor decides what they are (load, take, release); its handle
/// reads them too, to run small work on the caller's thread.
#[derive(Debug, Default)]
pub struct CpuExperts {
    /// Shared handles: work run from another thread copies the ones it needs and computes
    /// without the lock, so no product waits for a rebalance's write nor a write for a product.
    experts: RwLock<FxHashMap<(usize, u32), Arc<ExpertWeights>>>,
    hidden_size: usize,
}

/// The weights of a share of expert work, one handle per group.
pub type SharedWeights = Vec<Arc<ExpertWeights>>;

impl CpuExperts {
    fn new(experts: HashMap<(usize, u32), ExpertWeights>, hidden_size: usize) -> Self {
        CpuExperts {
            experts: RwLock::new(
                experts
                    .into_iter()
                    .map(|(key, weights)| (key, Arc::new(weights)))
                    .collect(),
            ),
            hidden_size,
        }
    }

    /// The weights of each `(expert, rows)` group of `layer`. The lock is held only while
    /// the handles are copied.
    fn weights_for(
        &self,
        layer: usize,
        groups: &[(u32, &[f32])],
    ) -> Result<SharedWeights, TargetError> {
        let experts = self.experts.read().unwrap_or_else(PoisonError::into_inner);
        groups
            .iter()
            .map(|&(expert, _)| {
                experts
                    .get(&(layer, expert))
                    .cloned()
                    .ok_or(TargetError::NotHeld { layer, expert })
            })
            .collect()
    }

    /// Runs each `(expert, rows)` group of `layer` on the calling thread alone (a slot
    /// computes on its own thread: slots run side by side without contending for one pool).
    fn run(&self, layer: usize, groups: &[(u32, &[f32])]) -> GroupOutputs {
        let weights = self.weights_for(layer, groups)?;
        let held: Vec<(&ExpertWeights, &[f32])> = weights
            .iter()
            .zip(groups)
            .map(|(weights, &(_, input))| (&**weights, input))
            .collect();
        Ok(GroupRows::own_each(run_expert_groups(
            &held,
            self.hidden_size,
            false,
        )))
    }

    fn write(
        &self,
    ) -> std::sync::RwLockWriteGuard<'_, FxHashMap<(usize, u32), Arc<ExpertWeights>>> {
        self.experts.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Experts held, and their weight bytes.
    fn count(&self) -> (usize, usize) {
        let experts = self.experts.read().unwrap_or_else(PoisonError::into_inner);
        (
            experts.len(),
            experts.values().map(|weights| weights.weight_bytes()).sum(),
        )
    }
}

/// Runs token rows through experts this device holds; answers with one output per group.
pub struct RunExperts {
    pub layer: usize,
    /// The groups' input rows, in one buffer that the sender may share with other sends
    /// (the rows of a request from another node, as they were decoded).
    pub rows: Arc<Vec<f32>>,
    /// `(expert, its rows' values in `rows`)` per group.
    pub groups: Vec<(u32, Range<usize>)>,
    /// Where the outputs go; dropped unanswered (the actor stopped first), it answers that
    /// the device is gone.
    pub answer: Answer,
}

impl Message for RunExperts {
    type Result = ();
}

/// Adds experts loaded for a new placement (copy-then-switch: the device serves what it
/// held meanwhile); answers how many it holds now. The weights are read from the
/// checkpoint by the caller, so the device computes while they load.
pub struct TakeExperts(pub HashMap<(usize, u32), ExpertWeights>);

impl Message for TakeExperts {
    type Result = Result<usize, TargetError>;
}

/// Runs rows that are in GPU memory (the dense part's GPU, this device's or a peer) through
/// experts this GPU holds, writing the outputs there too ([`GpuExperts::run_resident`]):
/// group `(expert, first_row, rows)` reads and writes rows `first_row..first_row + rows`
/// of `input` and `output` (bf16 rows of the model's width). Answers empty outputs.
pub struct RunResident {
    pub layer: usize,
    pub groups: Vec<(u32, usize, usize)>,
    /// The GPU the rows are on.
    pub gpu: usize,
    pub input: u64,
    pub output: u64,
    pub answer: Answer,
    /// Dropped once the device no longer touches the rows.
    pub ticket: ResidentTicket,
}

impl Message for RunResident {
    type Result = ();
}

/// Resident sends whose device may still touch their rows: the dispatcher waits for none
/// to be left before the rows' memory goes back (a send's answer may come before that,
/// or after another replica's).
#[derive(Debug, Default)]
pub struct ResidentSends {
    in_flight: std::sync::Mutex<usize>,
    done: std::sync::Condvar,
}

/// One resident send in flight; dropped when its device is done with the rows, or never
/// got them.
pub struct ResidentTicket(Arc<ResidentSends>);

impl ResidentSends {
    pub fn ticket(self: &Arc<Self>) -> ResidentTicket {
        *self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner) += 1;
        ResidentTicket(self.clone())
    }

    /// Waits until every ticket is dropped.
    pub fn wait(&self) {
        let mut n = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while *n > 0 {
            n = self.done.wait(n).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Drop for ResidentTicket {
    fn drop(&mut self) {
        *self
            .0
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner) -= 1;
        self.0.done.notify_all();
    }
}

/// Lets go of every expert not in the set (after the cluster switched to a placement that
/// puts them elsewhere); answers how many it holds now.
pub struct ReleaseExperts(pub HashSet<(usize, u32)>);

impl Message for ReleaseExperts {
    type Result = usize;
}

/// Takes the device out of service: the actor stops and its thread ends, as when a device
/// fails. Later messages to it fail with a closed mailbox.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Shutdown;

impl Actor for DeviceActor {
    type Context = Context<Self>;

    fn stopped(&mut self, _: &mut Self::Context) {
        // A failure in service is reported where it is noticed (dispatch); this also runs at
        // shutdown.
        tracing::info!(device = self.id, "device actor stopped");
        Arbiter::current().stop();
    }
}

impl Handler<RunExperts> for DeviceActor {
    type Result = ();

    fn handle(&mut self, msg: RunExperts, ctx: &mut Self::Context) {
        let outputs = self.run(&msg, ctx);
        msg.answer.send(outputs);
    }
}

impl DeviceActor {
    fn run(&mut self, msg: &RunExperts, ctx: &mut Context<Self>) -> GroupOutputs {
        let not_held = |expert| TargetError::NotHeld {
            layer: msg.layer,
            expert,
        };
        let groups: Vec<(u32, &[f32])> = msg
            .groups
            .iter()
            .map(|(e, range)| (*e, &msg.rows[range.clone()]))
            .collect();
        match &mut self.experts {
            Held::Cpu(experts) => experts.run(msg.layer, &groups),
            Held::Gpu(gpu) => {
                match gpu.run(msg.layer, &groups) {
                    Ok(RunOutcome::Done(outputs)) => Ok(GroupRows::own_each(outputs)),
                    Ok(RunOutcome::NotHeld(expert)) => Err(not_held(expert)),
                    Err(e) => {
                        // A CUDA error leaves the context unusable: out of service, so the
                        // router fails over to replicas, as when the device disappears.
                        tracing::error!(device = self.id, error = %e, "GPU failed: device taken out of service");
                        ctx.stop();
                        Err(TargetError::Gone(GoneCause::DeviceFailed {
                            device: self.id,
                            error: Arc::new(e),
                        }))
                    }
                }
            }
        }
    }
}

impl Handler<RunResident> for DeviceActor {
    type Result = ();

    fn handle(&mut self, msg: RunResident, ctx: &mut Self::Context) {
        let RunResident {
            layer,
            mut groups,
            gpu: source,
            input,
            output,
            answer,
            ticket,
        } = msg;
        let outputs = self.run_resident(layer, &mut groups, source, input, output, ctx);
        drop(ticket);
        answer.send(outputs);
    }
}

impl DeviceActor {
    fn run_resident(
        &mut self,
        layer: usize,
        groups: &mut [(u32, usize, usize)],
        source: usize,
        input: u64,
        output: u64,
        ctx: &mut Context<Self>,
    ) -> GroupOutputs {
        let Held::Gpu(gpu) = &mut self.experts else {
            return Err(TargetError::Failed(FailCause::NotAGpu { device: self.id }));
        };
        let row_bytes = (gpu.shape.hidden * 2) as u64;
        let answered = vec![GroupRows::default(); groups.len()];
        groups.sort_by_key(|&(_, first, _)| first);
        // Runs of consecutive rows, one call each.
        let mut start = 0;
        while start < groups.len() {
            let mut end = start + 1;
            while end < groups.len() && groups[end].1 == groups[end - 1].1 + groups[end - 1].2 {
                end += 1;
            }
            let run = &groups[start..end];
            let experts: Vec<u32> = run.iter().map(|g| g.0).collect();
            let sizes: Vec<usize> = run.iter().map(|g| g.2).collect();
            let at = run[0].1 as u64 * row_bytes;
            match gpu.run_resident(layer, &experts, &sizes, source, input + at, output + at) {
                Ok(RunOutcome::Done(_)) => {}
                Ok(RunOutcome::NotHeld(expert)) => {
                    return Err(TargetError::NotHeld { layer, expert });
                }
                Err(e) => {
                    tracing::error!(device = self.id, error = %e, "GPU failed: device taken out of service");
                    ctx.stop();
                    return Err(TargetError::Gone(GoneCause::DeviceFailed {
                        device: self.id,
                        error: Arc::new(e),
                    }));
                }
            }
            start = end;
        }
        Ok(answered)
    }

    fn count(&self) -> usize {
        let (experts, bytes) = match &self.experts {
            Held::Cpu(held) => held.count(),
            Held::Gpu(gpu) => {
                let room = gpu.room_bytes(self.memory_fraction).unwrap_or(0);
                self.holding.room_bytes.store(room, Ordering::Relaxed);
                (gpu.experts_held(), gpu.weight_bytes())
            }
        };
        self.holding.experts.store(experts, Ordering::Relaxed);
        self.holding.weight_bytes.store(bytes, Ordering::Relaxed);
        experts
    }
}

impl Handler<TakeExperts> for DeviceActor {
    type Result = Result<usize, TargetError>;

    fn handle(&mut self, msg: TakeExperts, _: &mut Self::Context) -> Self::Result {
        match &mut self.experts {
            Held::Cpu(held) => held.write().extend(
                msg.0
                    .into_iter()
                    .map(|(key, weights)| (key, Arc::new(weights))),
            ),
            // Written between two runs (this actor's thread does both): the copy, before
            // the cluster switches to the placement that routes to it.
            Held::Gpu(gpu) => {
                let share: Vec<((usize, u32), &ExpertWeights)> =
                    msg.0.iter().map(|(key, weights)| (*key, weights)).collect();
                let taken = gpu.take(&share, self.memory_fraction);
                if let Err(e) = taken {
                    self.count();
                    return Err(TargetError::Failed(FailCause::Device {
                        device: self.id,
                        error: Arc::new(e),
                    }));
                }
            }
        }
        Ok(self.count())
    }
}

impl Handler<ReleaseExperts> for DeviceActor {
    type Result = usize;

    fn handle(&mut self, msg: ReleaseExperts, _: &mut Self::Context) -> usize {
        match &mut self.experts {
            Held::Cpu(held) => held.write().retain(|key, _| msg.0.contains(key)),
            Held::Gpu(gpu) => {
                gpu.release(|key| msg.0.contains(key));
            }
        }
        self.count()
    }
}

impl Handler<Shutdown> for DeviceActor {
    type Result = ();

    fn handle(&mut self, _: Shutdown, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

/// How callers reach a device actor.
#[derive(Clone)]
pub struct DeviceHandle {
    pub id: usize,
    pub addr: Addr<DeviceActor>,
    holding: Arc<Holding>,
    /// The GPU's ordinal, for a device on a GPU.
    pub gpu: Option<usize>,
    /// What it computes on: `cpu`, or the GPU's name.
    pub name: String,
    /// A CPU slot's experts, for work run on the caller's thread.
    cpu: Option<Arc<CpuExperts>>,
}

impl DeviceHandle {
    /// `gpu` or `cpu`.
    pub fn kind(&self) -> &'static str {
        if self.gpu.is_some() { "gpu" } else { "cpu" }
    }

    /// Experts the device holds.
    pub fn experts_held(&self) -> usize {
        self.holding.experts.load(Ordering::Relaxed)
    }

    /// Bytes of expert weights the device holds.
    pub fn weight_bytes(&self) -> usize {
        self.holding.weight_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of experts a GPU could still take, as last counted (when it last took or let
    /// go of experts); `None` for a CPU slot, whose room is the host's.
    pub fn room_bytes(&self) -> Option<usize> {
        self.gpu
            .map(|_| self.holding.room_bytes.load(Ordering::Relaxed))
    }

    /// The weights of `(expert, rows)` groups of `layer`, for the calling thread to run
    /// them (on the global pool, as the rest of a step), when this is a CPU slot in service;
    /// `None` otherwise (send it to the actor). An error is what the actor would answer.
    pub fn weights_here(
        &self,
        layer: usize,
        groups: &[(u32, &[f32])],
    ) -> Option<Result<SharedWeights, TargetError>> {
        let experts = self.cpu.as_ref()?;
        if !self.addr.connected() {
            return Some(Err(TargetError::Gone(GoneCause::DeviceStopped {
                device: self.id as u16,
            })));
        }
        Some(experts.weights_for(layer, groups))
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes: the room of CPU slots, which share the host.
pub fn host_memory_available() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes of experts this node's `devices` could still take (GPUs' room, plus the host's
/// available memory where it has CPU slots), and the bytes an expert takes on them (their
/// average; 0 while they hold none).
pub fn expert_room(devices: &[DeviceHandle]) -> (u64, u64) {
    let gpus: usize = devices.iter().filter_map(DeviceHandle::room_bytes).sum();
    let host = if devices.iter().any(|d| d.gpu.is_none()) {
        host_memory_available().unwrap_or(0)
    } else {
        0
    };
    let held: usize = devices.iter().map(DeviceHandle::experts_held).sum();
    let bytes: usize = devices.iter().map(DeviceHandle::weight_bytes).sum();
    (
        (gpus + host) as u64,
        bytes.checked_div(held).unwrap_or(0) as u64,
    )
}

/// Starts device `id` on its own thread, loading `experts` from the checkpoint there, and
/// waits until it has loaded them or failed to. Must be called inside an actix system.
pub fn start_device(
    id: usize,
    target: DeviceTarget,
    checkpoint: Arc<Checkpoint>,
    config: Arc<ModelConfig>,
    experts: Vec<(usize, u32)>,
) -> Result<DeviceHandle, LoadError> {
    let (ready_tx, ready_rx) = mpsc::channel();
    let arbiter = Arbiter::new();
    let hidden_size = config.hidden_size;
    let experts_held = experts.len();
    let holding = Arc::new(Holding::default());
    let actor_holding = holding.clone();
    let (cpu_tx, cpu_rx) = mpsc::channel();
    let dir = checkpoint.dir().to_path_buf();
    let (gpu, name) = match &target {
        DeviceTarget::Cpu => (None, "cpu".to_string()),
        DeviceTarget::Gpu(info, _) => (Some(info.ordinal), info.name.clone()),
    };
    crate::progress::stage(format!(
        "device {id} ({name}): loading {experts_held} experts"
    ));
    let addr = DeviceActor::start_in_arbiter(&arbiter.handle(), move |ctx| {
        let loaded = match &target {
            DeviceTarget::Cpu => load_experts(&checkpoint, &config, &experts)
                .map(|map| {
                    let held = Arc::new(CpuExperts::new(map, hidden_size));
                    // The receiver waits below for what the handle shares.
                    let _ = cpu_tx.send(held.clone());
                    Held::Cpu(held)
                })
                .map_err(LoadError::from),
            DeviceTarget::Gpu(gpu, options) => {
                load_gpu(gpu, options, &checkpoint, &config, &experts)
                    .map(|g| Held::Gpu(Box::new(g)))
            }
        };
        let (experts, ready) = match loaded {
            Ok(held) => {
                let bytes = match &held {
                    Held::Cpu(cpu) => cpu.count().1,
                    Held::Gpu(gpu) => gpu.weight_bytes(),
                };
                (held, Ok(bytes))
            }
            Err(e) => {
                ctx.stop();
                (Held::Cpu(Arc::default()), Err(e))
            }
        };
        // The receiver waits below; it is gone only if the caller gave up.
        let _ = ready_tx.send(ready);
        let memory_fraction = match &target {
            DeviceTarget::Gpu(_, options) => options.memory_fraction,
            DeviceTarget::Cpu => 1.0,
        };
        let actor = DeviceActor {
            id,
            experts,
            holding: actor_holding,
            memory_fraction,
        };
        actor.count();
        actor
    });
    let weight_bytes = ready_rx.recv().map_err(|_| ModelError::Corrupt {
        path: dir,
        reason: format!("device {id} stopped while loading its experts"),
    })??;
    tracing::info!(
        device = id,
        gpu,
        on = %name,
        experts = experts_held,
        mib = weight_bytes / (1 << 20),
        "device ready"
    );
    Ok(DeviceHandle {
        id,
        addr,
        holding,
        gpu,
        name,
        cpu: cpu_rx.try_recv().ok(),
    })
}

/// Reads `experts` from the checkpoint, as a CPU slot holds them.
pub fn load_experts(
    checkpoint: &Checkpoint,
    config: &ModelConfig,
    experts: &[(usize, u32)],
) -> Result<HashMap<(usize, u32), ExpertWeights>, ModelError> {
    experts
        .iter()
        .map(|&(layer, expert)| {
            crate::progress::layer(layer, config.num_layers);
            Ok((
                (layer, expert),
                load_expert(checkpoint, config, layer, expert as usize)?,
            ))
        })
        .collect()
}

/// Where experts go: on every GPU when CUDA is usable and allowed, else on CPU slots.
pub enum DeviceChoice {
    /// CPU slots; `no_gpu` says why no GPU is used when `devices.backend = "auto"`.
    Cpu {
        slots: usize,
        no_gpu: Option<CudaError>,
    },
    Gpus(&'static CudaRuntime),
}

/// Decides from the config and what this machine has. With `backend = "cuda"`, no usable
/// GPU is an error.
pub fn choose_devices(devices: &DevicesConfig) -> Result<DeviceChoice, LoadError> {
    let slots = devices.cpu_slots;
    if devices.backend == Backend::Cpu {
        return Ok(DeviceChoice::Cpu {
            slots,
            no_gpu: None,
        });
    }
    let found = match devices.backend {
        Backend::CudaEmulated => cuda::emulated_runtime(devices.emulated()),
        _ => cuda::runtime(devices.cuda_lib_path()),
    };
    match found {
        Ok(runtime) => Ok(DeviceChoice::Gpus(runtime)),
        Err(e) if matches!(devices.backend, Backend::Cuda | Backend::CudaEmulated) => {
            Err(LoadError::Cuda(e))
        }
        Err(e) => Ok(DeviceChoice::Cpu {
            slots,
            no_gpu: Some(e),
        }),
    }
}

/// The device actors to start, as [`choose_devices`] decides; the log says which and why.
pub fn device_targets(
    devices: &DevicesConfig,
    gpu: GpuOptions,
) -> Result<Vec<DeviceTarget>, LoadError> {
    match choose_devices(devices)? {
        DeviceChoice::Gpus(runtime) => {
            cuda::log_runtime(runtime);
            Ok(runtime
                .gpus
                .iter()
                .map(|info| DeviceTarget::Gpu(info.clone(), gpu.clone()))
                .collect())
        }
        DeviceChoice::Cpu { slots, no_gpu } => {
            match no_gpu {
                None => tracing::info!(
                    slots,
                    "experts run on CPU slots (devices.backend = \"cpu\")"
                ),
                Some(reason) => {
                    tracing::info!(slots, reason = %reason, "no usable GPU: experts run on CPU slots")
                }
            }
            Ok(vec![DeviceTarget::Cpu; slots])
        }
    }
}
