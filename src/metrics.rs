//! The node's Prometheus metrics. Request and token metrics are updated where the events
//! happen; expert and device load is read from [`ExpertLoad`] at scrape time, so the hot
//! path only does relaxed atomic adds.

use std::sync::{Arc, Mutex};

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::placement::ExpertLoad;

pub struct NodeMetrics {
    /// Locked only to register and to scrape.
    registry: Mutex<Registry>,
    pub requests_running: Gauge,
    pub requests_waiting: Gauge,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub request_latency: Histogram,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    /// KV cache blocks the running sequences hold, and the budget's total (0: no budget).
    pub kv_cache_blocks_used: Gauge,
    pub kv_cache_blocks: Gauge,
    /// Sequences preempted for KV cache room (recomputed later).
    pub preemptions: Counter,
    /// Prompts that started from a kept prefix, and the prompt tokens that saved.
    pub prefix_cache_hits: Counter,
    pub prefix_cache_hit_tokens: Counter,
    /// KV cache blocks the kept prefixes hold.
    pub prefix_cache_blocks: Gauge,
    /// Constrained decoding's cost (structured output, forced tool calls).
    pub grammar: crate::engine::grammar::GrammarMetrics,
    peer_latency: PeerLatency,
    /// Generations that failed after admission, by what failed.
    generations_failed: Family<Vec<(String, String)>, Counter>,
}

/// Round-trip histograms labelled by peer.
type PeerLatency = Family<Vec<(String, String)>, Histogram, fn() -> Histogram>;

fn reason_label(reason: &str) -> Vec<(String, String)> {
    vec![("reason".to_string(), reason.to_string())]
}

impl NodeMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("moe_node");
        let requests_running = Gauge::default();
        let requests_waiting = Gauge::default();
        // 1 ms .. ~65 s.
        let latency = || Histogram::new(exponential_buckets(0.001, 2.0, 17));
        let time_to_first_token = latency();
        let inter_token_latency = latency();
        let request_latency = latency();
        let prompt_tokens = Counter::default();
        let generation_tokens = Counter::default();
        registry.register(
            "requests_running",
            "Sequences in the running batch",
            requests_running.clone(),
        );
        registry.register(
            "requests_waiting",
            "Requests queued for a place in the batch",
            requests_waiting.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "From admission to the first generated token",
            time_to_first_token.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Between consecutive generated tokens of one request",
            inter_token_latency.clone(),
        );
        registry.register(
            "request_latency_seconds",
            "From admission to the last generated token",
            request_latency.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens prefilled",
            prompt_tokens.clone(),
        );
        registry.register(
            "generation_tokens",
            "Tokens generated",
            generation_tokens.clone(),
        );
        let kv_cache_blocks_used = Gauge::default();
        let kv_cache_blocks = Gauge::default();
        let preemptions = Counter::default();
        registry.register(
            "kv_cache_blocks_used",
            "KV cache blocks (16 positions of one sequence) the running sequences hold",
            kv_cache_blocks_used.clone(),
        );
        registry.register(
            "kv_cache_blocks",
            "KV cache blocks the budget holds (batching.kv_cache_mib); 0: no budget",
            kv_cache_blocks.clone(),
        );
        registry.register(
            "preemptions",
            "Running sequences whose KV caches were released for room, to be recomputed",
            preemptions.clone(),
        );
        let prefix_cache_hits = Counter::default();
        let prefix_cache_hit_tokens = Counter::default();
        let prefix_cache_blocks = Gauge::default();
        registry.register(
            "prefix_cache_blocks",
            "KV cache blocks the kept prompt prefixes hold (within the budget)",
            prefix_cache_blocks.clone(),
        );
        registry.register(
            "prefix_cache_hits",
            "Prompts that started from a kept prefix's KV cache",
            prefix_cache_hits.clone(),
        );
        registry.register(
            "prefix_cache_hit_tokens",
            "Prompt tokens not prefilled because a kept prefix stood for them",
            prefix_cache_hit_tokens.clone(),
        );
        let grammar = crate::engine::grammar::GrammarMetrics::default();
        registry.register(
            "grammar_masks",
            "Token masks computed for constrained decoding",
            grammar.masks.clone(),
        );
        registry.register(
            "grammar_mask_compute_seconds",
            "Time computing token masks, beside the engine's steps",
            grammar.compute_seconds.clone(),
        );
        registry.register(
            "grammar_mask_wait_seconds",
            "Time steps waited for a token mask (the part of constrained decoding the batch feels)",
            grammar.wait_seconds.clone(),
        );
        // 50 µs .. ~3 s.
        let peer_latency: PeerLatency =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.00005, 2.0, 17)));
        registry.register(
            "peer_dispatch_latency_seconds",
            "Round trip of expert work sent to another node, per peer",
            peer_latency.clone(),
        );
        let generations_failed = Family::<Vec<(String, String)>, Counter>::default();
        // Each reason from the start, so that alerts and dashboards see zeros, not absence.
        for reason in crate::engine::EngineError::REASONS {
            let _ = generations_failed.get_or_create(&reason_label(reason));
        }
        registry.register(
            "generations_failed",
            "Generations that failed after admission, by what failed (expert_unavailable: no \
             live replica of an expert a token chose; expert; gpu; request; internal)",
            generations_failed.clone(),
        );
        NodeMetrics {
            peer_latency,
            generations_failed,
            registry: Mutex::new(registry),
            requests_running,
            requests_waiting,
            time_to_first_token,
            inter_token_latency,
            request_latency,
            prompt_tokens,
            generation_tokens,
            kv_cache_blocks_used,
            kv_cache_blocks,
            preemptions,
            prefix_cache_hits,
            prefix_cache_hit_tokens,
            prefix_cache_blocks,
            grammar,
        }
    }

    /// Adds the expert load series, read from `load` at each scrape.
    pub fn register_expert_load(&self, load: Arc<ExpertLoad>, per_expert: bool) {
        self.registry()
            .register_collector(Box::new(ExpertLoadCollector { load, per_expert }));
    }

    /// Adds one series per device (up, experts held, bytes of weights), read from `devices`
    /// at each scrape.
    pub fn register_devices(&self, devices: DeviceStates) {
        self.registry()
            .register_collector(Box::new(DeviceCollector { devices }));
    }

    /// Adds one metric (a counter, gauge or histogram another part of the node updates).
    pub fn register(
        &self,
        name: &str,
        help: &str,
        metric: impl prometheus_client::registry::Metric,
    ) {
        self.registry().register(name, help, metric);
    }

    /// Adds series read at each scrape by `collector` (the cluster's).
    pub fn register_collector(&self, collector: Box<dyn prometheus_client::collector::Collector>) {
        self.registry().register_collector(collector);
    }

    /// One expert-work round trip to `peer` (a node id).
    pub fn observe_peer_latency(&self, peer: &str, took: std::time::Duration) {
        self.peer_latency
            .get_or_create(&vec![("peer".to_string(), peer.to_string())])
            .observe(took.as_secs_f64());
    }

    /// One generation that failed after admission, for `reason`
    /// ([`crate::engine::EngineError::reason`]).
    pub fn generation_failed(&self, reason: &str) {
        self.generations_failed
            .get_or_create(&reason_label(reason))
            .inc();
    }

    /// Content type of [`NodeMetrics::encode`]'s output.
    pub const CONTENT_TYPE: &'static str =
        prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

    /// The Prometheus text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry())?;
        Ok(out)
    }
}

impl NodeMetrics {
    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        // Registering and encoding cannot leave the registry half-changed.
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

#[derive(Debug)]
struct ExpertLoadCollector {
    load: Arc<ExpertLoad>,
    per_expert: bool,
}

impl prometheus_client::collector::Collector for ExpertLoadCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let layers: Vec<_> = (0..self.load.num_layers())
            .map(|l| (l.to_string(), self.load.layer(l)))
            .filter(|(_, load)| !load.activations.is_empty())
            .collect();
        {
            let mut family = encoder.encode_descriptor(
                "device_tokens",
                "Token rows run through experts, per device and layer",
                None,
                MetricType::Counter,
            )?;
            for (layer, load) in &layers {
                for (device, &tokens) in load.device_tokens.iter().enumerate() {
                    let labels = [("layer", layer.clone()), ("device", device.to_string())];
                    ConstCounter::new(tokens).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "layer_imbalance",
                "Most loaded device's tokens over the mean, per layer (1 = even)",
                None,
                MetricType::Gauge,
            )?;
            for (layer, load) in &layers {
                let labels = [("layer", layer.clone())];
                ConstGauge::new(load.imbalance()).encode(family.encode_family(&labels)?)?;
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "layer_imbalance_recent",
                "Most loaded device's tokens over the mean over the recent window \
                 (placement.window_seconds), per layer",
                None,
                MetricType::Gauge,
            )?;
            for (layer, _) in &layers {
                let index: usize = layer.parse().unwrap_or_default();
                let (recent, _) = self.load.recent(index);
                let labels = [("layer", layer.clone())];
                ConstGauge::new(recent.imbalance()).encode(family.encode_family(&labels)?)?;
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "hot_experts",
                "Experts with more than twice the median expert's activations, per layer",
                None,
                MetricType::Gauge,
            )?;
            for (layer, load) in &layers {
                let labels = [("layer", layer.clone())];
                ConstGauge::new(load.hot_experts() as i64)
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        if self.per_expert {
            let mut family = encoder.encode_descriptor(
                "expert_activations",
                "Token rows routed to each expert",
                None,
                MetricType::Counter,
            )?;
            for (layer, load) in &layers {
                for (expert, &count) in load.activations.iter().enumerate() {
                    let labels = [("layer", layer.clone()), ("expert", expert.to_string())];
                    ConstCounter::new(count).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
}

/// One device as the metrics show it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceState {
    pub id: usize,
    /// `cpu` or `gpu`.
    pub kind: &'static str,
    /// `cpu`, or the GPU's name.
    pub name: String,
    pub up: bool,
    pub experts: usize,
    pub weight_bytes: usize,
}

/// Reads the devices' current state (whether each is still up) at scrape time.
pub type DeviceStates = Box<dyn Fn() -> Vec<DeviceState> + Send + Sync>;

struct DeviceCollector {
    devices: DeviceStates,
}

/// A per-device gauge: name, help, and its value for one device.
type DeviceSeries = (&'static str, &'static str, fn(&DeviceState) -> i64);

impl std::fmt::Debug for DeviceCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceCollector")
    }
}

impl prometheus_client::collector::Collector for DeviceCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let devices = (self.devices)();
        let series: [DeviceSeries; 3] = [
            (
                "device_up",
                "1 while the device takes work, 0 once it has failed or been stopped",
                |d| d.up as i64,
            ),
            ("device_experts", "Experts the device holds", |d| {
                d.experts as i64
            }),
            (
                "device_weight_bytes",
                "Bytes of expert weights the device holds",
                |d| d.weight_bytes as i64,
            ),
        ];
        for (name, help, value) in series {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for d in &devices {
                let labels = [
                    ("device", d.id.to_string()),
                    ("kind", d.kind.to_string()),
                    ("name", d.name.clone()),
                ];
                ConstGauge::new(value(d)).encode(family.encode_family(&labels)?)?;
            }
        }
        // GPUs emulated on the CPU count every copy their driver makes (a real driver
        // does not): what crossed between host and GPUs is then visible from outside.
        if let Some(c) = crate::compute::cuda::emulated::counters() {
            let mut family = encoder.encode_descriptor(
                "emulated_gpu_copied_bytes",
                "Bytes the emulated GPUs' driver copied (devices.backend = \"cuda-emulated\"), by direction",
                None,
                MetricType::Counter,
            )?;
            for (direction, bytes) in [
                ("host_to_device", c.host_to_device),
                ("device_to_host", c.device_to_host),
                ("within_gpu", c.device_to_device),
                ("between_gpus", c.peer),
            ] {
                ConstCounter::new(bytes)
                    .encode(family.encode_family(&[("direction", direction)])?)?;
            }
        }
        Ok(())
    }
}
