//! The actors of one node: a device actor per device holding experts, and the router actor
//! that batches requests and steps the model. [`Node::start`] builds them from the config.

pub mod device;
pub mod dispatch;
pub mod router;

use std::path::Path;
use std::sync::Arc;

use actix::Addr;

use crate::config::NodeConfig;
use crate::engine::batch::BatchLimits;
use crate::engine::{Engine, generate::PREFILL_CHUNK};
use crate::metrics::NodeMetrics;
use crate::model::{Checkpoint, DenseWeights, ModelConfig, ModelError};
use crate::placement::{ExpertLoad, Placement, PlacementError};
use device::{DeviceHandle, Shutdown, start_device};
use dispatch::DeviceExperts;
use router::RouterActor;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error("device {device} does not exist (the node has {devices})")]
    NoSuchDevice { device: usize, devices: usize },
}

/// A running node: its devices, the placement of experts on them, and the router.
pub struct Node {
    pub model: Arc<ModelConfig>,
    pub router: Addr<RouterActor>,
    pub devices: Vec<DeviceHandle>,
    pub experts: Arc<DeviceExperts>,
    pub placement: Arc<Placement>,
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
        let num_devices = config.devices.cpu_slots;
        let placement = Arc::new(Placement::balanced(
            &model.moe_layers,
            model.moe.num_experts,
            num_devices,
            config.devices.replication,
        )?);
        // Opened once: the devices and the router read their tensors from the same map.
        let checkpoint = Arc::new(Checkpoint::open(model_dir)?);
        let devices = (0..num_devices)
            .map(|id| {
                start_device(
                    id,
                    checkpoint.clone(),
                    model.clone(),
                    placement.experts_on(id),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let load = Arc::new(ExpertLoad::new(
            model.num_layers,
            model.moe.num_experts,
            num_devices,
        ));
        metrics.register_expert_load(load.clone(), config.metrics.per_expert);
        let experts = Arc::new(DeviceExperts::new(
            devices.clone(),
            placement.clone(),
            load.clone(),
            model.hidden_size,
        ));
        let weights = DenseWeights::load(&checkpoint, &model)?;
        let engine = Engine::new((*model).clone(), weights, experts.clone());
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
            placement,
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
