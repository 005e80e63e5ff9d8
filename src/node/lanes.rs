//! A node's dense replicas as the router sees them: one lane per replica (each GPU holding the
//! dense part, or the host), each with its own router actor, batch, KV budget and caches.
//! Attention is data-parallel across the lanes; every lane's MoE layers reach the same
//! experts. A new request goes to the lane with the most room, or to one that keeps a prefix
//! it starts with if that one is not much busier ([`Lanes::choose`]); it stays there (its KV
//! cache lives on that lane's GPU) until it finishes. Each lane publishes its
//! load here after every step, for that choice and for `/metrics` (per lane, and the node's
//! totals).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::engine::batch::KvBudget;
use crate::engine::prefix::leading_block_key;
use crate::metrics::NodeMetrics;

/// One lane's load, as its router last published it.
#[derive(Debug, Default)]
pub struct LaneLoad {
    running: AtomicUsize,
    waiting: AtomicUsize,
    kv_blocks_used: AtomicUsize,
    /// 0: the lane's KV cache has no budget.
    kv_blocks: AtomicUsize,
    prefix_blocks: AtomicUsize,
    /// Requests sent to the lane that it has not queued yet (in its mailbox).
    arriving: AtomicUsize,
    /// Tokens the lane's steps computed (prompt and generated).
    tokens: AtomicU64,
    /// Decode steps the lane replayed from CUDA graphs.
    graph_steps: AtomicU64,
    /// The keys of the first blocks of the prompt prefixes the lane keeps
    /// ([`leading_block_key`]).
    prefixes: RwLock<Vec<u64>>,
}

/// What a lane publishes after a step or an arrival.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaneState {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks: usize,
    pub prefix_blocks: usize,
}

/// Sequences more than the least busy lane's that a lane keeping a request's prefix may have
/// and still get it: reusing the prefix saves its prefill, and in a continuous batch a few
/// more sequences beside it cost less than that.
pub const PREFIX_AFFINITY: usize = 4;

/// The node's lanes: their loads and where each one's dense part is.
#[derive(Debug)]
pub struct Lanes {
    loads: Vec<LaneLoad>,
    /// The GPU of each lane's dense part; `None`: the host.
    gpus: Vec<Option<usize>>,
    /// Held while a lane is chosen and the request marked on its way: two requests arriving
    /// together see each other.
    choosing: std::sync::Mutex<()>,
}

impl Lanes {
    /// Lanes whose dense parts are on `gpus` (`None`: the host), at least one.
    pub fn new(gpus: Vec<Option<usize>>) -> Self {
        let gpus = if gpus.is_empty() { vec![None] } else { gpus };
        Lanes {
            loads: gpus.iter().map(|_| LaneLoad::default()).collect(),
            gpus,
            choosing: std::sync::Mutex::new(()),
        }
    }

    fn len(&self) -> usize {
        self.loads.len()
    }

    /// Lane `lane`'s state after a step or an arrival; the node's gauges become the sums
    /// over every lane.
    pub fn publish(&self, lane: usize, state: LaneState, metrics: &NodeMetrics) {
        let Some(load) = self.loads.get(lane) else {
            return;
        };
        load.running.store(state.running, Ordering::Relaxed);
        load.waiting.store(state.waiting, Ordering::Relaxed);
        load.kv_blocks_used
            .store(state.kv_blocks_used, Ordering::Relaxed);
        load.kv_blocks.store(state.kv_blocks, Ordering::Relaxed);
        load.prefix_blocks
            .store(state.prefix_blocks, Ordering::Relaxed);
        let total = self.total();
        metrics.requests_running.set(total.running as i64);
        metrics.requests_waiting.set(total.waiting as i64);
        metrics
            .kv_cache_blocks_used
            .set(total.kv_blocks_used as i64);
        metrics.kv_cache_blocks.set(total.kv_blocks as i64);
        metrics.prefix_cache_blocks.set(total.prefix_blocks as i64);
    }

    /// The keys of the prefixes lane `lane` keeps now.
    pub fn publish_prefixes(&self, lane: usize, keys: Vec<u64>) {
        if let Some(load) = self.loads.get(lane) {
            *load.prefixes.write().unwrap_or_else(|e| e.into_inner()) = keys;
        }
    }

    /// Lane `lane`'s engine has replayed `steps` decode steps from CUDA graphs so far.
    pub fn count_graph_steps(&self, lane: usize, steps: u64) {
        if let Some(load) = self.loads.get(lane) {
            load.graph_steps.store(steps, Ordering::Relaxed);
        }
    }

    /// Counts `tokens` computed by lane `lane`'s step.
    pub fn count_tokens(&self, lane: usize, tokens: usize) {
        if let Some(load) = self.loads.get(lane) {
            load.tokens.fetch_add(tokens as u64, Ordering::Relaxed);
        }
    }

    fn state(&self, lane: usize) -> LaneState {
        let load = &self.loads[lane];
        LaneState {
            running: load.running.load(Ordering::Relaxed),
            waiting: load.waiting.load(Ordering::Relaxed),
            kv_blocks_used: load.kv_blocks_used.load(Ordering::Relaxed),
            kv_blocks: load.kv_blocks.load(Ordering::Relaxed),
            prefix_blocks: load.prefix_blocks.load(Ordering::Relaxed),
        }
    }

    fn total(&self) -> LaneState {
        (0..self.len())
            .map(|l| self.state(l))
            .fold(LaneState::default(), |sum, s| LaneState {
                running: sum.running + s.running,
                waiting: sum.waiting + s.waiting,
                kv_blocks_used: sum.kv_blocks_used + s.kv_blocks_used,
                kv_blocks: sum.kv_blocks + s.kv_blocks,
                prefix_blocks: sum.prefix_blocks + s.prefix_blocks,
            })
    }

    /// The lane a request for `prompt` goes to: the one with the fewest sequences (running,
    /// waiting and on their way), then the most free KV blocks, then the lowest index;
    /// unless a lane keeps a prefix `prompt` starts with (by its first block) and has at most
    /// [`PREFIX_AFFINITY`] sequences more, which then gets it. Marks the request on its way
    /// there until [`Arriving`] is dropped (once the lane has queued it).
    pub fn choose(&self, prompt: &[u32]) -> Arriving<'_> {
        let key = leading_block_key(prompt, KvBudget::BLOCK_TOKENS);
        let _one_at_a_time = self.choosing.lock().unwrap_or_else(|e| e.into_inner());
        let lane = choose_lane((0..self.len()).map(|l| {
            let load = &self.loads[l];
            let arriving = load.arriving.load(Ordering::Relaxed);
            let keeps = key.is_some_and(|key| {
                let kept = load.prefixes.read().unwrap_or_else(|e| e.into_inner());
                kept.contains(&key)
            });
            (self.state(l), arriving, keeps)
        }));
        self.loads[lane].arriving.fetch_add(1, Ordering::Relaxed);
        Arriving { lanes: self, lane }
    }
}

/// A request on its way to lane `lane` (see [`Lanes::choose`]).
pub struct Arriving<'a> {
    lanes: &'a Lanes,
    pub lane: usize,
}

impl Drop for Arriving<'_> {
    fn drop(&mut self) {
        self.lanes.loads[self.lane]
            .arriving
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// [`Lanes::choose`]'s rule over each lane's state, requests on their way to it, and whether
/// it keeps the request's prefix.
fn choose_lane(lanes: impl Iterator<Item = (LaneState, usize, bool)>) -> usize {
    let lanes: Vec<_> = lanes.collect();
    let sequences = |lane: usize| {
        let (s, arriving, _) = lanes[lane];
        s.running + s.waiting + arriving
    };
    let order = |lane: usize| {
        let (s, ..) = lanes[lane];
        let free = s
            .kv_blocks
            .saturating_sub(s.kv_blocks_used + s.prefix_blocks);
        (sequences(lane), std::cmp::Reverse(free), lane)
    };
    let Some(least_busy) = (0..lanes.len()).min_by_key(|&l| order(l)) else {
        return 0;
    };
    let keeping = (0..lanes.len())
        .filter(|&l| lanes[l].2)
        .min_by_key(|&l| order(l));
    match keeping {
        Some(lane) if sequences(lane) <= sequences(least_busy) + PREFIX_AFFINITY => lane,
        _ => least_busy,
    }
}

/// The lanes' series in `/metrics`, read at each scrape.
#[derive(Debug)]
pub struct LanesCollector(pub Arc<Lanes>);

impl Collector for LanesCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode_series(&mut encoder)
    }
}

impl Lanes {
    fn encode_series(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let labels = |lane: usize| {
            let gpu = self.gpus[lane].map_or_else(|| "host".to_string(), |g| g.to_string());
            [("replica", lane.to_string()), ("gpu", gpu)]
        };
        type Read = fn(&LaneState) -> usize;
        let gauges: [(&str, &str, Read); 4] = [
            (
                "dense_replica_running_sequences",
                "Sequences in a dense replica's running batch (their attention on its GPU, or the host)",
                |s| s.running,
            ),
            (
                "dense_replica_waiting_sequences",
                "Sequences waiting for a place in a dense replica's batch",
                |s| s.waiting,
            ),
            (
                "dense_replica_kv_cache_blocks_used",
                "KV cache blocks a dense replica's running sequences hold",
                |s| s.kv_blocks_used,
            ),
            (
                "dense_replica_kv_cache_blocks",
                "A dense replica's KV cache budget in blocks (0: no budget)",
                |s| s.kv_blocks,
            ),
        ];
        for (name, help, read) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for lane in 0..self.len() {
                let labels = labels(lane);
                let series = family.encode_family(&labels)?;
                ConstGauge::new(read(&self.state(lane)) as i64).encode(series)?;
            }
        }
        type Count = fn(&LaneLoad) -> &AtomicU64;
        let counters: [(&str, &str, Count); 2] = [
            (
                "dense_replica_tokens",
                "Tokens (prompt and generated) a dense replica's steps computed",
                |l| &l.tokens,
            ),
            (
                "dense_replica_graph_steps",
                "Decode steps a dense replica replayed from CUDA graphs (devices.cuda_graphs)",
                |l| &l.graph_steps,
            ),
        ];
        for (name, help, read) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for lane in 0..self.len() {
                let labels = labels(lane);
                let count = read(&self.loads[lane]).load(Ordering::Relaxed);
                ConstCounter::new(count).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(running: usize, used: usize, blocks: usize) -> LaneState {
        LaneState {
            running,
            kv_blocks_used: used,
            kv_blocks: blocks,
            ..LaneState::default()
        }
    }

    #[test]
    fn a_request_goes_to_the_lane_with_the_fewest_sequences_then_the_most_free_kv() {
        let lanes = [lane(3, 10, 100), lane(2, 90, 100), lane(2, 20, 100)];
        assert_eq!(choose_lane(lanes.iter().map(|&s| (s, 0, false))), 2);
        // Requests on their way count as sequences.
        let arriving = [0, 0, 2];
        assert_eq!(
            choose_lane(lanes.iter().zip(arriving).map(|(&s, a)| (s, a, false))),
            1
        );
        // All equal: the lowest index.
        assert_eq!(
            choose_lane([lane(1, 5, 10); 3].into_iter().map(|s| (s, 0, false))),
            0
        );
    }

    #[test]
    fn a_lane_keeping_the_prompts_prefix_gets_it_unless_much_busier() {
        let keeps = |busy: usize| [(lane(0, 0, 100), 0, false), (lane(busy, 0, 100), 0, true)];
        assert_eq!(choose_lane(keeps(PREFIX_AFFINITY).into_iter()), 1);
        assert_eq!(choose_lane(keeps(PREFIX_AFFINITY + 1).into_iter()), 0);
    }

    #[test]
    fn choosing_spreads_simultaneous_requests_over_the_lanes() {
        let lanes = Lanes::new(vec![Some(0), Some(1), Some(2), Some(3)]);
        let on_their_way: Vec<Arriving> = (0..8).map(|_| lanes.choose(&[1, 2, 3])).collect();
        let mut per_lane = [0; 4];
        for a in &on_their_way {
            per_lane[a.lane] += 1;
        }
        assert_eq!(per_lane, [2, 2, 2, 2]);
        drop(on_their_way);
        assert_eq!(
            lanes.choose(&[]).lane,
            0,
            "arrivals are forgotten once queued"
        );
        // Lane 2 keeps a prefix this prompt starts with (a whole first block).
        let prompt: Vec<u32> = (0..40).collect();
        lanes.publish_prefixes(2, vec![leading_block_key(&prompt[..16], 16).unwrap()]);
        assert_eq!(lanes.choose(&prompt).lane, 2);
        assert_eq!(lanes.choose(&prompt[..15]).lane, 0, "shorter than a block");
    }

    #[test]
    fn the_node_gauges_are_the_sums_over_the_lanes() {
        let lanes = Lanes::new(vec![Some(0), Some(1)]);
        let metrics = NodeMetrics::new();
        lanes.publish(0, lane(3, 10, 100), &metrics);
        lanes.publish(1, lane(2, 20, 100), &metrics);
        assert_eq!(metrics.requests_running.get(), 5);
        assert_eq!(metrics.kv_cache_blocks_used.get(), 30);
        assert_eq!(metrics.kv_cache_blocks.get(), 200);
        lanes.count_tokens(1, 7);
        let mut text = String::new();
        let mut registry = prometheus_client::registry::Registry::with_prefix("moe_node");
        registry.register_collector(Box::new(LanesCollector(Arc::new(lanes))));
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("moe_node_dense_replica_running_sequences{replica=\"1\",gpu=\"1\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("moe_node_dense_replica_tokens_total{replica=\"1\",gpu=\"1\"} 7"),
            "{text}"
        );
    }
}
