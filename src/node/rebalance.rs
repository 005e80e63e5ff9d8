//! Live rebalancing within one node: copies of the experts the recent activation window
//! shows hot, in the devices' spare slots (`placement.redundant_slots_per_device`).
//!
//! Copy, then switch, then release, while the node serves:
//! 1. the next placement is the layout the node started with plus the hot copies
//!    ([`Placement::with_hot_copies`], version + 1): base copies never move;
//! 2. each device loads the copies it newly holds (read from the checkpoint off the device
//!    threads; the device keeps computing and takes them in one message);
//! 3. the dispatcher switches to the new placement at its next layer call (a call reads
//!    one placement);
//! 4. once every call that may have routed by the old placement has finished, the copies
//!    the new one no longer wants are dropped.
//!
//! No step waits on weights: the only pause is the dispatcher swapping one pointer.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use serde::Serialize;

use super::{Node, NodeError};
use crate::actors::device::{ReleaseExperts, TakeExperts, load_experts};
use crate::metrics::NodeMetrics;
use crate::model::ExpertWeights;
use crate::placement::Placement;
use crate::placement::replicate::imbalance;

/// What one rebalance did.
#[derive(Debug, Clone, Serialize)]
pub struct RebalanceReport {
    /// The placement version served now.
    pub version: u64,
    pub copies_loaded: usize,
    pub copies_released: usize,
    pub bytes_loaded: u64,
    /// Worst layer's imbalance over the recent window, under the placement before.
    pub imbalance_before: f64,
    /// The same window's load laid over the new placement (each expert's load split over
    /// its copies): what the devices will see if the workload stays as it was.
    pub imbalance_after: f64,
    pub seconds: f64,
}

/// Series a rebalance updates.
#[derive(Debug, Clone)]
pub struct RebalanceMetrics {
    rebalances: Counter,
    bytes_loaded: Counter,
    duration: Histogram,
    imbalance_before: Gauge<f64, AtomicU64>,
    imbalance_after: Gauge<f64, AtomicU64>,
}

impl RebalanceMetrics {
    pub fn register(metrics: &NodeMetrics) -> Self {
        let m = RebalanceMetrics {
            rebalances: Counter::default(),
            bytes_loaded: Counter::default(),
            // 1 ms .. ~65 s.
            duration: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            imbalance_before: Gauge::default(),
            imbalance_after: Gauge::default(),
        };
        metrics.register(
            "rebalances",
            "Live rebalances done (hot-expert copies recomputed and switched to)",
            m.rebalances.clone(),
        );
        metrics.register(
            "rebalance_loaded_bytes",
            "Bytes of expert weights loaded for hot-expert copies",
            m.bytes_loaded.clone(),
        );
        metrics.register(
            "rebalance_duration_seconds",
            "From the start of a rebalance to the release of the copies dropped",
            m.duration.clone(),
        );
        metrics.register(
            "rebalance_imbalance_before",
            "Worst layer's recent imbalance under the placement before the last rebalance",
            m.imbalance_before.clone(),
        );
        metrics.register(
            "rebalance_imbalance_after",
            "The same load laid over the placement the last rebalance switched to",
            m.imbalance_after.clone(),
        );
        m
    }
}

/// How long the release waits for layer calls that routed by the old placement.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

impl Node {
    /// Recomputes the hot-expert copies from the recent window and switches to them (see
    /// the module doc). One at a time; blocks while loading. Only a node serving alone:
    /// across a cluster the placement is the cluster's (`cluster/follow.rs`).
    pub fn rebalance(&self) -> Result<RebalanceReport, NodeError> {
        let _one_at_a_time = self.rebalancing.lock().unwrap_or_else(|e| e.into_inner());
        if self.cluster.is_some() {
            return Err(NodeError::Rebalance(
                "this node serves in a cluster, whose placement changes through the cluster; \
                 live rebalancing works on a node serving alone for now"
                    .into(),
            ));
        }
        if self.spare_slots == 0 {
            return Err(NodeError::Rebalance(
                "no spare slots: set placement.redundant_slots_per_device".into(),
            ));
        }
        let started = Instant::now();
        let current = self.experts.placement();
        let model = &self.model;
        let mut loads = vec![None; model.num_layers];
        let mut before = 0.0f64;
        for layer in (0..model.num_layers).filter(|&l| model.moe_layers[l]) {
            let (recent, _) = self.load.recent(layer);
            before = before.max(recent.imbalance());
            loads[layer] = Some(recent.activations.iter().map(|&a| a as f64).collect());
        }
        let next = self
            .base
            .with_hot_copies(&loads, self.spare_slots, current.version() + 1)?;
        let after = predicted_imbalance(&next, &loads, self.devices.len());

        // Copy.
        let mut copies_loaded = 0;
        let mut bytes_loaded = 0u64;
        for device in self.experts.devices() {
            let mut held = self.experts.held_by(device.id);
            let missing: Vec<(usize, u32)> = next
                .experts_on(0, device.id as u16)
                .into_iter()
                .filter(|e| !held.contains(e))
                .collect();
            if missing.is_empty() {
                continue;
            }
            let weights = load_experts(&self.checkpoint, model, &missing)?;
            let bytes: usize = weights.values().map(ExpertWeights::weight_bytes).sum();
            futures::executor::block_on(device.addr.send(TakeExperts(weights)))
                .map_err(|_| {
                    NodeError::Rebalance(format!("device {} stopped while loading", device.id))
                })?
                .map_err(|e| NodeError::Rebalance(e.to_string()))?;
            held.extend(missing.iter().copied());
            self.experts.set_held_by(device.id, held);
            copies_loaded += missing.len();
            bytes_loaded += bytes as u64;
        }

        // Switch.
        let next = Arc::new(next);
        self.experts.set_placement(next.clone(), 0);
        // Every call that read the old placement began before this read (it reads the
        // placement after counting itself); the router makes one call at a time.
        let calls_before = self.experts.calls_started();
        let drained = Instant::now();
        while self.experts.calls_finished() < calls_before && drained.elapsed() < DRAIN_LIMIT {
            std::thread::sleep(Duration::from_millis(1));
        }

        // Release.
        let mut copies_released = 0;
        for device in self.experts.devices() {
            let keep: HashSet<(usize, u32)> =
                next.experts_on(0, device.id as u16).into_iter().collect();
            let held = self.experts.held_by(device.id);
            if held.is_subset(&keep) {
                continue;
            }
            copies_released += held.difference(&keep).count();
            self.experts
                .set_held_by(device.id, held.intersection(&keep).copied().collect());
            let _ = futures::executor::block_on(device.addr.send(ReleaseExperts(keep)));
        }

        let seconds = started.elapsed().as_secs_f64();
        let m = &self.rebalance_metrics;
        m.rebalances.inc();
        m.bytes_loaded.inc_by(bytes_loaded);
        m.duration.observe(seconds);
        m.imbalance_before.set(before);
        m.imbalance_after.set(after);
        tracing::info!(
            version = next.version(),
            copies_loaded,
            copies_released,
            bytes_loaded,
            imbalance_before = before,
            imbalance_after = after,
            seconds,
            "rebalanced: hot-expert copies switched to"
        );
        Ok(RebalanceReport {
            version: next.version(),
            copies_loaded,
            copies_released,
            bytes_loaded,
            imbalance_before: before,
            imbalance_after: after,
            seconds,
        })
    }
}

/// Worst layer's imbalance with `loads` split over `placement`'s copies (node 0's devices).
fn predicted_imbalance(placement: &Placement, loads: &[Option<Vec<f64>>], devices: usize) -> f64 {
    let mut worst = 0.0f64;
    for (layer, layer_loads) in loads.iter().enumerate() {
        let Some(layer_loads) = layer_loads else {
            continue;
        };
        let mut per_device = vec![0.0; devices];
        for (expert, &load) in layer_loads.iter().enumerate() {
            let copies = placement.replicas(layer, expert as u32);
            for r in copies {
                if let Some(d) = per_device.get_mut(r.device as usize) {
                    *d += load / copies.len() as f64;
                }
            }
        }
        worst = worst.max(imbalance(&per_device));
    }
    worst
}
