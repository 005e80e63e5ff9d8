//! Expert load statistics, kept on the hot path with one relaxed atomic add per active
//! expert per step: activations per (layer, expert) and tokens per (layer, device).

use std::sync::atomic::{AtomicU64, Ordering};

pub struct ExpertLoad {
    num_experts: usize,
    num_devices: usize,
    /// `[layer * num_experts + expert]`: token rows routed to the expert.
    activations: Vec<AtomicU64>,
    /// `[layer * num_devices + device]`: token rows run on the device.
    device_tokens: Vec<AtomicU64>,
}

/// One layer's load as read at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerLoad {
    pub activations: Vec<u64>,
    pub device_tokens: Vec<u64>,
}

impl LayerLoad {
    /// Most loaded device over the mean device load; 1 is perfect balance, 0 when idle.
    pub fn imbalance(&self) -> f64 {
        let total: u64 = self.device_tokens.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let mean = total as f64 / self.device_tokens.len() as f64;
        *self.device_tokens.iter().max().unwrap_or(&0) as f64 / mean
    }

    /// Experts routed more than twice the median expert's activations: candidates for more
    /// replicas.
    pub fn hot_experts(&self) -> usize {
        if self.activations.is_empty() {
            return 0;
        }
        let mut sorted = self.activations.clone();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2];
        self.activations.iter().filter(|&&a| a > 2 * median).count()
    }
}

impl std::fmt::Debug for ExpertLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertLoad")
            .field("num_layers", &self.num_layers())
            .field("num_experts", &self.num_experts)
            .field("num_devices", &self.num_devices)
            .finish_non_exhaustive()
    }
}

impl ExpertLoad {
    pub fn new(num_layers: usize, num_experts: usize, num_devices: usize) -> Self {
        ExpertLoad {
            num_experts,
            num_devices,
            activations: (0..num_layers * num_experts)
                .map(|_| AtomicU64::new(0))
                .collect(),
            device_tokens: (0..num_layers * num_devices)
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    pub fn num_layers(&self) -> usize {
        self.device_tokens.len() / self.num_devices.max(1)
    }

    pub fn record(&self, layer: usize, expert: u32, device: usize, rows: usize) {
        if let Some(a) = self
            .activations
            .get(layer * self.num_experts + expert as usize)
        {
            a.fetch_add(rows as u64, Ordering::Relaxed);
        }
        if let Some(t) = self.device_tokens.get(layer * self.num_devices + device) {
            t.fetch_add(rows as u64, Ordering::Relaxed);
        }
    }

    /// Rows routed to an expert that ran on another node.
    pub fn record_activation(&self, layer: usize, expert: u32, rows: usize) {
        if let Some(a) = self
            .activations
            .get(layer * self.num_experts + expert as usize)
        {
            a.fetch_add(rows as u64, Ordering::Relaxed);
        }
    }

    pub fn layer(&self, layer: usize) -> LayerLoad {
        let read = |v: &[AtomicU64]| v.iter().map(|a| a.load(Ordering::Relaxed)).collect();
        LayerLoad {
            activations: read(
                &self.activations[layer * self.num_experts..(layer + 1) * self.num_experts],
            ),
            device_tokens: read(
                &self.device_tokens[layer * self.num_devices..(layer + 1) * self.num_devices],
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imbalance_and_hot_experts() {
        let load = ExpertLoad::new(2, 4, 2);
        for (expert, device, rows) in [(0, 0, 10), (1, 1, 1), (2, 0, 1), (3, 1, 2)] {
            load.record(1, expert, device, rows);
        }
        let layer = load.layer(1);
        assert_eq!(layer.activations, vec![10, 1, 1, 2]);
        assert_eq!(layer.device_tokens, vec![11, 3]);
        assert!((layer.imbalance() - 11.0 / 7.0).abs() < 1e-9);
        // Median of [1, 1, 2, 10] (upper) is 2: only expert 0 is above 4.
        assert_eq!(layer.hot_experts(), 1);
        assert_eq!(load.layer(0).imbalance(), 0.0);
    }
}
