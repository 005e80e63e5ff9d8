//! The composition root: [`Node::start`] builds one node's parts from its config, in order
//! (devices, placement, dispatcher, router; in a cluster also the peer server and
//! membership), and hands out typed handles to them.

mod cluster_metrics;
mod joined;
mod lanes;
pub mod router;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::compute::cuda::{CudaError, GpuInfo};
use crate::config::NodeConfig;
use crate::config::live::LiveSettings;
use crate::engine::batch::{BatchLimits, KvBudget};
use crate::engine::kv_cache::KvCache;
use crate::engine::{Engine, generate::PREFILL_CHUNK};
use crate::experts::device::{
    DeviceHandle, DeviceTarget, GpuOptions, Shutdown, device_targets, start_device,
};
use crate::experts::{DispatchTiming, Dispatcher, Target};
use crate::metrics::{DeviceState, NodeMetrics};
use crate::model::{Checkpoint, ModelConfig, ModelError, ModelSource};
use crate::node::cluster_metrics::ClusterCollector;
use crate::node::joined::{ClusterError, Joined, OfferedDevices, ServeParts, join};
pub use crate::node::joined::{ClusterError as JoinError, gossip_config};
use crate::node::router::{Lane, RouterHandle};
use crate::placement::{ExpertLoad, NodeSlots, Placement, PlacementError};
use crate::plan::sizes::ModelSizes;
use crate::rollout::board::PlacementBoard;
use crate::rollout::bootstrap::Start;
use crate::rollout::rebalance::{RebalanceMetrics, RebalanceParts, Rebalancer, SeriesRegistry};

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error("GPU devices")]
    Cuda(#[from] CudaError),
    #[error("device {device} does not exist (the node has {devices})")]
    NoSuchDevice { device: usize, devices: usize },
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error("device {0} is in service; stop it first")]
    DeviceRunning(usize),
}

impl From<crate::experts::gpu::LoadError> for NodeError {
    fn from(e: crate::experts::gpu::LoadError) -> Self {
        match e {
            crate::experts::gpu::LoadError::Model(e) => NodeError::Model(e),
            crate::experts::gpu::LoadError::Cuda(e) => NodeError::Cuda(e),
        }
    }
}

/// How long one step may run before the router counts as stalled: a minute of compute,
/// plus the longest a step may legitimately wait on other nodes (a send given up on and
/// re-sent, then a wait for an expert to come back).
pub fn stall_limit(cluster: &crate::config::ClusterConfig) -> std::time::Duration {
    std::time::Duration::from_millis(
        60_000 + 2 * cluster.request_timeout_ms + cluster.unavailable_wait_ms,
    )
}

/// A running node: its devices, the placement of experts on them, and the router.
pub struct Node {
    pub model: Arc<ModelConfig>,
    pub router: RouterHandle,
    pub devices: Vec<DeviceHandle>,
    pub experts: Arc<Dispatcher>,
    pub load: Arc<ExpertLoad>,
    /// This node's part in a cluster; `None` when it serves alone.
    pub cluster: Option<Joined>,
    /// What a stopped device is started again from.
    checkpoint: Arc<Checkpoint>,
    targets: Vec<DeviceTarget>,
    /// Held while a device is started again, so that two starts do not race.
    restarting: std::sync::Mutex<()>,
    /// Live rebalancing over this node's dispatcher, load window and placement board.
    rebalancer: Rebalancer,
}

impl Node {
    /// Loads the model `source` names: dense weights for the router, each device's experts on
    /// that device's thread. In a cluster, joins it first (gossip, peer server) and loads
    /// only the experts the cluster's placement gives this node. `api` is the HTTP address
    /// other nodes reach this one at; `board` shows the placement as soon as it is known
    /// (nodes starting together take it from there). Must be called inside an actix
    /// system; blocks while loading.
    pub fn start(
        source: &ModelSource,
        config: &NodeConfig,
        metrics: Arc<NodeMetrics>,
        api: SocketAddr,
        board: &Arc<PlacementBoard>,
        live: &Arc<LiveSettings>,
    ) -> Result<Node, NodeError> {
        crate::progress::stage(format!("opening the model in {}", source.dir.display()));
        let model = Arc::new(source.config()?);
        let gpu_options = GpuOptions {
            max_rows: config.batching.max_tokens_per_step * model.moe.top_k,
            memory_fraction: config.devices.gpu_memory_fraction,
            kernel_cache: Some(config.cache_dir().join("kernels")),
        };
        let kernel_cache = gpu_options.kernel_cache.clone();
        let targets = device_targets(&config.devices, gpu_options)?;
        if config.devices.dense_on_gpu
            && targets.iter().any(|t| matches!(t, DeviceTarget::Gpu(..)))
            && let Some(refused) = crate::engine::gpu::deepseek_v4_refused(&model)
        {
            return Err(refused.into());
        }
        let num_devices = targets.len();
        // Opened once: the devices and the router read their tensors from the same map.
        let checkpoint = Arc::new(source.checkpoint(&model)?);
        let (cluster, placement) =
            first_placement(config, &model, &checkpoint, &targets, api, live)?;
        let placement = Arc::new(placement);
        board.set_current(placement.clone());
        // A node the placement does not name (it joined later) holds no experts; it still
        // serves requests, with every expert on other nodes.
        let local_node = match &cluster {
            Some(joined) => placement.node_index(&joined.node_id).unwrap_or(u16::MAX),
            None => 0,
        };
        let devices = targets
            .iter()
            .enumerate()
            .map(|(id, target)| {
                start_device(
                    id,
                    target.clone(),
                    checkpoint.clone(),
                    model.clone(),
                    placement.experts_on(local_node, id as u16),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let load = Arc::new(ExpertLoad::with_bucket(
            model.num_layers,
            model.moe.num_experts,
            num_devices,
            config.placement.window_bucket(),
        ));
        metrics.register_expert_load(load.clone(), config.metrics.per_expert);
        let experts = Arc::new(dispatcher(
            config,
            &model,
            devices.clone(),
            &placement,
            local_node,
            &load,
            cluster.as_ref(),
            &metrics,
        ));
        register_device_states(&metrics, &experts);
        crate::progress::stage("dense weights (attention, norms, shared experts)");
        let engine = Engine::from_checkpoint((*model).clone(), &checkpoint, experts.clone())?;
        let (lanes, model) =
            serving_lanes(config, &model, engine, &targets, kernel_cache.as_deref())?;
        if let Some(joined) = &cluster {
            joined.serve(ServeParts {
                dispatcher: experts.clone(),
                checkpoint: checkpoint.clone(),
                model: model.clone(),
                board: board.clone(),
            });
            metrics.register_collector(Box::new(ClusterCollector::new(
                joined.stats.clone(),
                joined.membership.clone(),
                experts.clone(),
            )));
        }
        let rebalancer = Rebalancer::new(
            RebalanceParts {
                model: model.clone(),
                checkpoint: checkpoint.clone(),
                dispatcher: experts.clone(),
                load: load.clone(),
                board: board.clone(),
                live: live.clone(),
                spare_slots: config.placement.redundant_slots_per_device,
                expert_bytes: ModelSizes::of(&model).expert_bytes,
                max_move_bytes: config.placement.max_move_bytes(),
                cluster: cluster.as_ref().map(Joined::rebalance_part),
            },
            RebalanceMetrics::register(&*metrics),
        );
        Ok(Node {
            model,
            router: RouterHandle::start(lanes, metrics, stall_limit(&config.cluster)),
            devices,
            experts,
            load,
            cluster,
            checkpoint,
            targets,
            restarting: std::sync::Mutex::new(()),
            rebalancer,
        })
    }

    /// This node's live rebalancing (`POST /admin/rebalance`, the periodic rebalancer).
    pub fn rebalancer(&self) -> &Rebalancer {
        &self.rebalancer
    }

    /// The model's fingerprint ([`Checkpoint::fingerprint`]).
    pub fn model_fingerprint(&self) -> u64 {
        self.checkpoint.fingerprint()
    }

    /// Takes device `device` out of service, as if it had failed.
    pub fn stop_device(&self, device: usize) -> Result<(), NodeError> {
        let handle =
            self.experts
                .devices()
                .into_iter()
                .nth(device)
                .ok_or(NodeError::NoSuchDevice {
                    device,
                    devices: self.devices.len(),
                })?;
        handle.addr.do_send(Shutdown);
        Ok(())
    }

    /// Starts a device that is out of service again: the experts it held are loaded anew on its own thread, then it takes work from the next step.
    /// Blocks while loading; must be called inside an actix system.
    pub fn start_device(&self, device: usize) -> Result<(), NodeError> {
        let _one_at_a_time = self.restarting.lock().unwrap_or_else(|e| e.into_inner());
        let target = self.targets.get(device).ok_or(NodeError::NoSuchDevice {
            device,
            devices: self.targets.len(),
        })?;
        if self.experts.devices_alive().get(device).copied() == Some(true) {
            return Err(NodeError::DeviceRunning(device));
        }
        // A device taken out of service by a failure may still have an actor: end it.
        if let Some(old) = self.experts.devices().get(device) {
            old.addr.do_send(Shutdown);
        }
        // What it held when it stopped (in a cluster, its share of the placement in force).
        let mut experts: Vec<(usize, u32)> = self.experts.held_by(device).into_iter().collect();
        experts.sort_unstable();
        let handle = start_device(
            device,
            target.clone(),
            self.checkpoint.clone(),
            self.model.clone(),
            experts,
        )?;
        self.experts.replace_device(handle);
        Ok(())
    }
}

impl SeriesRegistry for NodeMetrics {
    fn add_series(&self, name: &str, help: &str, metric: impl prometheus_client::registry::Metric) {
        self.register(name, help, metric);
    }
}

/// This node's part in a cluster (joined before any expert is loaded, since the cluster's
/// placement decides which) and the placement it starts under; alone, the single-node
/// placement over its devices.
/// The router's lanes: the dense part on each of the first `devices.dense_replicas` GPUs (0:
/// all) when the experts are on GPUs, each lane serving its own sequences, else the one
/// `engine` on the host; and the model as served. Each lane's KV budget is what its own GPU
/// (or the host) has left, and the node serves no longer a context than the smallest of
/// them holds.
fn serving_lanes(
    config: &NodeConfig,
    model: &Arc<ModelConfig>,
    engine: Engine,
    targets: &[DeviceTarget],
    kernel_cache: Option<&std::path::Path>,
) -> Result<(Vec<Lane>, Arc<ModelConfig>), NodeError> {
    let dense_gpus: Vec<&GpuInfo> = targets
        .iter()
        .filter_map(|t| match t {
            DeviceTarget::Gpu(info, _) => Some(info),
            DeviceTarget::Cpu => None,
        })
        .take(dense_carriers(config, model, targets))
        .collect();
    let engines = if dense_gpus.is_empty() {
        vec![engine]
    } else {
        let mut replicas = Vec::with_capacity(dense_gpus.len());
        for gpu in dense_gpus {
            let mut replica = engine.replica();
            replica.place_dense_on_gpu(gpu, config.devices.gpu_memory_fraction, kernel_cache)?;
            replica.set_cuda_graphs(config.devices.cuda_graphs);
            replicas.push(replica);
        }
        replicas
    };
    let mut lanes = Vec::with_capacity(engines.len());
    let mut served = model.clone();
    for engine in engines {
        let dense_on_gpu = engine.dense_gpu().is_some();
        let (limits, lane_model) =
            batch_limits(config, model.clone(), &engine, targets, dense_on_gpu);
        if let Some(kv) = limits.kv {
            engine.reserve_kv_cache(kv.blocks)?;
        }
        if lane_model.max_position_embeddings < served.max_position_embeddings {
            served = lane_model;
        }
        lanes.push((engine, limits));
    }
    Ok((lanes, served))
}

fn first_placement(
    config: &NodeConfig,
    model: &ModelConfig,
    checkpoint: &Checkpoint,
    targets: &[DeviceTarget],
    api: SocketAddr,
    live: &Arc<LiveSettings>,
) -> Result<(Option<Joined>, Placement), NodeError> {
    let slots = expert_slots(config, model, targets);
    if config.cluster.enabled() {
        crate::progress::stage(format!(
            "joining the cluster (expecting {} nodes)",
            config.cluster.expect_nodes
        ));
        let (joined, start) = join(
            &config.cluster,
            &config.peer,
            checkpoint.fingerprint(),
            OfferedDevices {
                count: targets.len(),
                gpus: !targets.is_empty()
                    && targets.iter().all(|t| matches!(t, DeviceTarget::Gpu(..))),
                slots: slots
                    .iter()
                    .map(|&s| s.min(u32::MAX as usize) as u32)
                    .collect(),
            },
            model.hidden_size,
            api,
            live.clone(),
        )?;
        let placement = match start {
            Start::Create(spec) => {
                Placement::balanced(&model.moe_layers, model.moe.num_experts, spec)?
            }
            Start::Take(table) => {
                Placement::from_table(table, &model.moe_layers, model.moe.num_experts)?
            }
        };
        Ok((Some(joined), placement))
    } else {
        let node = NodeSlots {
            node: String::new(),
            devices: targets.len(),
            slots,
        };
        let placement = Placement::on_one_node(
            &model.moe_layers,
            model.moe.num_experts,
            node,
            config.devices.replication,
        )?;
        Ok((None, placement))
    }
}

/// How many of this node's first devices carry a dense replica ([`crate::plan::dense_carriers`]).
fn dense_carriers(config: &NodeConfig, model: &ModelConfig, targets: &[DeviceTarget]) -> usize {
    crate::plan::dense_carriers(
        model,
        config.devices.dense_on_gpu,
        config.devices.dense_replicas,
        targets.len(),
    )
}

/// Experts of one layer each device has memory for, as `plan` counts them
/// ([`crate::plan::expert_slots`]): GPUs by their memory, the first `devices.dense_replicas`
/// keeping room for their dense replica and its KV cache; none for CPU slots (one host
/// memory, checked as the experts load).
fn expert_slots(config: &NodeConfig, model: &ModelConfig, targets: &[DeviceTarget]) -> Vec<usize> {
    let dense_replicas = dense_carriers(config, model, targets);
    let kv_cache_bytes =
        (config.batching.kv_cache_mib > 0).then_some((config.batching.kv_cache_mib as u64) << 20);
    let max_rows = config.batching.max_tokens_per_step * model.moe.top_k;
    targets
        .iter()
        .enumerate()
        .map(|(i, t)| match t {
            DeviceTarget::Gpu(info, _) => Some(crate::plan::expert_slots(
                model,
                max_rows,
                kv_cache_bytes,
                (info.total_bytes as f64 * config.devices.gpu_memory_fraction) as u64,
                i < dense_replicas,
            )),
            DeviceTarget::Cpu => None,
        })
        .collect::<Option<Vec<usize>>>()
        .unwrap_or_default()
}

/// The node's expert executor over its devices, reaching the cluster's other nodes when it
/// is in one (their answer times feed the per-peer latency metrics).
#[allow(clippy::too_many_arguments)]
fn dispatcher(
    config: &NodeConfig,
    model: &ModelConfig,
    devices: Vec<DeviceHandle>,
    placement: &Arc<Placement>,
    local_node: u16,
    load: &Arc<ExpertLoad>,
    cluster: Option<&Joined>,
    metrics: &Arc<NodeMetrics>,
) -> Dispatcher {
    let timing = DispatchTiming::from_config(&config.cluster);
    let mut dispatcher = Dispatcher::new(
        devices,
        placement.clone(),
        local_node,
        load.clone(),
        model.hidden_size,
        timing,
    );
    if let Some(joined) = cluster {
        dispatcher = dispatcher.with_remote(joined.peers.clone());
        let observed = metrics.clone();
        let names = placement.nodes().to_vec();
        dispatcher = dispatcher.observe_latency(move |target, took| {
            if let Target::Node(n) = target
                && let Some(slots) = names.get(n as usize)
            {
                observed.observe_peer_latency(&slots.node, took);
            }
        });
    }
    dispatcher
}

/// Each device's state on `/metrics`, read from the dispatcher at scrape time.
fn register_device_states(metrics: &NodeMetrics, experts: &Arc<Dispatcher>) {
    metrics.register_devices({
        let experts = experts.clone();
        Box::new(move || {
            let alive = experts.devices_alive();
            // The handles as they are now: a device started again has a new one.
            experts
                .devices()
                .iter()
                .map(|d| DeviceState {
                    id: d.id,
                    kind: d.kind(),
                    name: d.name.clone(),
                    up: alive[d.id],
                    experts: d.experts_held(),
                    weight_bytes: d.weight_bytes(),
                })
                .collect()
        })
    });
}

/// The batching limits, with the KV cache budget what the memory left holds, and the model
/// as served: no longer a context than that budget holds for one sequence.
fn batch_limits(
    config: &NodeConfig,
    model: Arc<ModelConfig>,
    engine: &Engine,
    targets: &[DeviceTarget],
    dense_on_gpu: bool,
) -> (BatchLimits, Arc<ModelConfig>) {
    // The spare slots are empty until a rebalance fills them with copies of hot experts:
    // where they share memory with the caches (the dense GPU, or the host with CPU
    // slots), that memory is not the caches' to take. Nor is what a rebalance's version
    // holds twice while it switches (the copies it loads before it releases the ones they
    // replace: at most placement.max_move_mib over all nodes, so at most that here).
    let sharing = if dense_on_gpu {
        1
    } else {
        targets
            .iter()
            .filter(|t| matches!(t, DeviceTarget::Cpu))
            .count()
    };
    let moe_layers = model.moe_layers.iter().filter(|&&moe| moe).count();
    let expert_bytes = ModelSizes::of(&model).expert_bytes;
    let spare_slot_bytes =
        (config.placement.redundant_slots_per_device * moe_layers * sharing) as u64 * expert_bytes;
    // (Never more than every expert once on each device sharing the memory: a small model's
    // whole experts are far below the default budget.)
    let move_reserve_bytes = if config.placement.redundant_slots_per_device > 0 {
        let all_experts = (model.moe.num_experts * moe_layers * sharing) as u64 * expert_bytes;
        config.placement.max_move_bytes().min(all_experts)
    } else {
        0
    };
    let kv = kv_budget(
        config.batching.kv_cache_mib,
        HeldBack {
            spare_slot_bytes: spare_slot_bytes as usize,
            move_reserve_bytes: move_reserve_bytes as usize,
        },
        &model,
        engine,
    );
    let limits = BatchLimits {
        max_sequences: config.batching.max_sequences,
        max_tokens_per_step: config.batching.max_tokens_per_step,
        max_waiting: config.batching.max_waiting,
        prefill_chunk: PREFILL_CHUNK,
        kv,
        prefix_cache_entries: config.batching.prefix_cache_entries,
    };
    // The node serves no longer a context than the KV budget holds for one sequence.
    let model = match kv {
        Some(kv) if kv.max_positions() < model.max_position_embeddings => {
            tracing::warn!(
                model_context = model.max_position_embeddings,
                served_context = kv.max_positions(),
                "the KV cache budget holds less than the model's context: prompts and \
                 max_tokens are limited to what it holds (batching.kv_cache_mib)"
            );
            let mut served = (*model).clone();
            served.max_position_embeddings = kv.max_positions();
            Arc::new(served)
        }
        _ => model,
    };
    (limits, model)
}

/// Memory where the caches live that is not theirs: the spare expert slots, and what a
/// rebalance's version holds twice while it switches.
#[derive(Clone, Copy)]
struct HeldBack {
    spare_slot_bytes: usize,
    move_reserve_bytes: usize,
}

/// The KV cache budget: `mib` when set, else sized from the memory left after loading where
/// the caches live, less what is `held_back` there for the spare expert slots and a
/// rebalance (see `batching.kv_cache_mib`); `None` where that memory cannot be read.
fn kv_budget(
    mib: usize,
    held_back: HeldBack,
    model: &ModelConfig,
    engine: &Engine,
) -> Option<KvBudget> {
    let HeldBack {
        spare_slot_bytes,
        move_reserve_bytes,
    } = held_back;
    let held_back = spare_slot_bytes + move_reserve_bytes;
    let (bytes, from) = if mib > 0 {
        (mib << 20, "batching.kv_cache_mib")
    } else {
        match engine.cache_gpu_free_memory() {
            Some(Ok(free)) => (
                KvBudget::gpu_share(free.saturating_sub(held_back) as u64) as usize,
                "90% of the GPU's free memory, the pool of its cache blocks",
            ),
            Some(Err(error)) => {
                tracing::warn!(%error, "GPU free memory unknown: the KV cache is not bounded");
                return None;
            }
            None => match crate::experts::device::host_memory_available() {
                Some(available) => (
                    available.saturating_sub(held_back) / 2,
                    "half of the host's available memory",
                ),
                None => {
                    tracing::warn!(
                        "/proc/meminfo unreadable: the KV cache is not bounded; set \
                         batching.kv_cache_mib"
                    );
                    return None;
                }
            },
        }
    };
    let per_position = match engine.dense_gpu() {
        Some(_) => KvCache::gpu_bytes_per_position(model),
        None => KvCache::bytes_per_position(model),
    };
    let budget = KvBudget::of_bytes(bytes, per_position)
        .with_state(KvCache::state_bytes(model), per_position);
    tracing::info!(
        mib = bytes >> 20,
        from,
        spare_slot_bytes,
        move_reserve_bytes,
        blocks = budget.blocks,
        block_tokens = budget.block_tokens,
        positions = budget.max_positions(),
        "KV cache budget"
    );
    Some(budget)
}
