//! The composition root: [`Node::start`] builds one node's parts from its config, in order
//! (devices, placement, dispatcher, router; in a cluster also the peer server and
//! membership), and hands out typed handles to them.

use std::path::Path;
use std::sync::Arc;

use actix::Addr;

use crate::actors::device::{
    DeviceHandle, DeviceTarget, GpuOptions, Shutdown, device_targets, start_device,
};
use crate::actors::dispatch::{DispatchTiming, Dispatcher};
use crate::actors::router::RouterActor;
use crate::compute::cuda::{self, CudaError};
use crate::config::NodeConfig;
use crate::engine::batch::BatchLimits;
use crate::engine::{Engine, generate::PREFILL_CHUNK};
use crate::metrics::{DeviceState, NodeMetrics};
use crate::model::{Checkpoint, DenseWeights, ModelConfig, ModelError};
use crate::placement::{ExpertLoad, Placement, PlacementError};

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
}

impl From<cuda::load::LoadError> for NodeError {
    fn from(e: cuda::load::LoadError) -> Self {
        match e {
            cuda::load::LoadError::Model(e) => NodeError::Model(e),
            cuda::load::LoadError::Cuda(e) => NodeError::Cuda(e),
        }
    }
}

/// A running node: its devices, the placement of experts on them, and the router.
pub struct Node {
    pub model: Arc<ModelConfig>,
    pub router: Addr<RouterActor>,
    pub devices: Vec<DeviceHandle>,
    pub experts: Arc<Dispatcher>,
    pub load: Arc<ExpertLoad>,
}

impl Node {
    /// Loads the model in `model_dir`: dense weights for the router, each device's experts on
    /// that device's thread. Must be called inside an actix system; blocks while loading.
    pub fn start(
        model_dir: &Path,
        config: &NodeConfig,
        metrics: Arc<NodeMetrics>,
    ) -> Result<Node, NodeError> {
        let model = Arc::new(ModelConfig::load(model_dir)?);
        let gpu_options = GpuOptions {
            max_rows: config.batching.max_tokens_per_step * model.moe.top_k,
            memory_fraction: config.devices.gpu_memory_fraction,
            kernel_cache: Some(config.cache_dir().join("kernels")),
        };
        let kernel_cache = gpu_options.kernel_cache.clone();
        let targets = device_targets(&config.devices, gpu_options)?;
        let num_devices = targets.len();
        // The dense part goes to the first GPU when the experts are on GPUs.
        let dense_gpu = match targets.first() {
            Some(DeviceTarget::Gpu(info, _)) if config.devices.dense_on_gpu => Some(info.clone()),
            _ => None,
        };
        let placement = Arc::new(Placement::single_node(
            &model.moe_layers,
            model.moe.num_experts,
            num_devices,
            config.devices.replication,
        )?);
        // Opened once: the devices and the router read their tensors from the same map.
        let checkpoint = Arc::new(Checkpoint::open(model_dir)?);
        let devices = targets
            .into_iter()
            .enumerate()
            .map(|(id, target)| {
                start_device(
                    id,
                    target,
                    checkpoint.clone(),
                    model.clone(),
                    placement.experts_on(0, id as u16),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let load = Arc::new(ExpertLoad::new(
            model.num_layers,
            model.moe.num_experts,
            num_devices,
        ));
        metrics.register_expert_load(load.clone(), config.metrics.per_expert);
        let experts = Arc::new(Dispatcher::new(
            devices.clone(),
            placement.clone(),
            0,
            load.clone(),
            model.hidden_size,
            DispatchTiming::default(),
        ));
        metrics.register_devices({
            let (experts, devices) = (experts.clone(), devices.clone());
            Box::new(move || {
                let alive = experts.devices_alive();
                devices
                    .iter()
                    .map(|d| DeviceState {
                        id: d.id,
                        kind: d.kind(),
                        name: d.name.clone(),
                        up: alive[d.id],
                        experts: d.experts_held,
                        weight_bytes: d.weight_bytes,
                    })
                    .collect()
            })
        });
        let weights = DenseWeights::load(&checkpoint, &model)?;
        let mut engine = Engine::new((*model).clone(), weights, experts.clone());
        if let Some(gpu) = dense_gpu {
            engine.place_dense_on_gpu(
                &gpu,
                config.devices.gpu_memory_fraction,
                kernel_cache.as_deref(),
            )?;
        }
        let limits = BatchLimits {
            max_sequences: config.batching.max_sequences,
            max_tokens_per_step: config.batching.max_tokens_per_step,
            max_waiting: config.batching.max_waiting,
            prefill_chunk: PREFILL_CHUNK,
        };
        Ok(Node {
            model,
            router: RouterActor::new(engine, limits, metrics).start_on_own_thread(),
            devices,
            experts,
            load,
        })
    }

    /// Takes device `device` out of service, as if it had failed.
    pub fn stop_device(&self, device: usize) -> Result<(), NodeError> {
        let handle = self.devices.get(device).ok_or(NodeError::NoSuchDevice {
            device,
            devices: self.devices.len(),
        })?;
        handle.addr.do_send(Shutdown);
        Ok(())
    }
}
