//! Expert load statistics, kept on the hot path with relaxed atomic adds per active expert
//! per step: activations per (layer, expert) and tokens per (layer, device), since start
//! and over a sliding window (a ring of per-interval buckets; the oldest is cleared when
//! the ring turns), so that rebalancing follows a workload that changes.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub struct ExpertLoad {
    num_experts: usize,
    num_devices: usize,
    /// `[layer * num_experts + expert]`: token rows routed to the expert.
    activations: Vec<AtomicU64>,
    /// `[layer * num_devices + device]`: token rows run on the device.
    device_tokens: Vec<AtomicU64>,
    window: Window,
}

/// Buckets in the sliding window, and how long each covers: the window spans the last 50
/// to 60 seconds.
pub const WINDOW_BUCKETS: usize = 6;
pub const BUCKET: Duration = Duration::from_secs(10);

/// The recent counts: `WINDOW_BUCKETS` buckets laid out like the totals, the current one
/// taking the adds.
struct Window {
    activations: Vec<Vec<AtomicU64>>,
    device_tokens: Vec<Vec<AtomicU64>>,
    current: AtomicUsize,
    /// Nanoseconds after `started` at which the ring turns next (read on the hot path).
    next_turn: AtomicU64,
    /// When each bucket began; locked only to turn the ring and to read the window.
    began: Mutex<Vec<Instant>>,
    started: Instant,
    bucket: Duration,
}

fn zeros(n: usize) -> Vec<AtomicU64> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
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
        Self::with_bucket(num_layers, num_experts, num_devices, BUCKET)
    }

    /// [`ExpertLoad::new`] with window buckets of `bucket` each (tests turn it faster).
    pub fn with_bucket(
        num_layers: usize,
        num_experts: usize,
        num_devices: usize,
        bucket: Duration,
    ) -> Self {
        let now = Instant::now();
        let bucket = bucket.max(Duration::from_millis(1));
        ExpertLoad {
            num_experts,
            num_devices,
            activations: zeros(num_layers * num_experts),
            device_tokens: zeros(num_layers * num_devices),
            window: Window {
                activations: (0..WINDOW_BUCKETS)
                    .map(|_| zeros(num_layers * num_experts))
                    .collect(),
                device_tokens: (0..WINDOW_BUCKETS)
                    .map(|_| zeros(num_layers * num_devices))
                    .collect(),
                current: AtomicUsize::new(0),
                next_turn: AtomicU64::new(bucket.as_nanos() as u64),
                began: Mutex::new(vec![now; WINDOW_BUCKETS]),
                started: now,
                bucket,
            },
        }
    }

    /// Turns the window's ring when the current bucket's interval is over: one clock read
    /// and one atomic load when it is not. Called once per dispatched layer.
    pub fn tick(&self) {
        let w = &self.window;
        let elapsed = w.started.elapsed().as_nanos() as u64;
        if elapsed < w.next_turn.load(Ordering::Relaxed) {
            return;
        }
        let mut began = w.began.lock().unwrap_or_else(|e| e.into_inner());
        let elapsed = w.started.elapsed().as_nanos() as u64;
        let next_turn = w.next_turn.load(Ordering::Relaxed);
        if elapsed < next_turn {
            // Another thread turned it meanwhile.
            return;
        }
        let step = w.bucket.as_nanos() as u64;
        let turns = (elapsed - next_turn) / step + 1;
        let cleared = turns.min(WINDOW_BUCKETS as u64);
        let mut current = w.current.load(Ordering::Relaxed);
        for k in 0..cleared {
            current = (current + 1) % WINDOW_BUCKETS;
            // Adds racing with the clear may be lost: statistics, not accounts.
            for counter in w.activations[current]
                .iter()
                .chain(&w.device_tokens[current])
            {
                counter.store(0, Ordering::Relaxed);
            }
            let start = next_turn + (turns - cleared + k) * step;
            began[current] = w.started + Duration::from_nanos(start);
        }
        w.current.store(current, Ordering::Relaxed);
        w.next_turn
            .store(next_turn + turns * step, Ordering::Relaxed);
    }

    /// One layer's load over the sliding window, and the seconds the window covers.
    pub fn recent(&self, layer: usize) -> (LayerLoad, f64) {
        self.tick();
        let w = &self.window;
        let sum = |buckets: &[Vec<AtomicU64>], from: usize, to: usize| -> Vec<u64> {
            (from..to)
                .map(|i| {
                    buckets
                        .iter()
                        .map(|b| b.get(i).map_or(0, |a| a.load(Ordering::Relaxed)))
                        .sum()
                })
                .collect()
        };
        let load = LayerLoad {
            activations: sum(
                &w.activations,
                layer * self.num_experts,
                (layer + 1) * self.num_experts,
            ),
            device_tokens: sum(
                &w.device_tokens,
                layer * self.num_devices,
                (layer + 1) * self.num_devices,
            ),
        };
        let began = w.began.lock().unwrap_or_else(|e| e.into_inner());
        let oldest = began.iter().min().copied().unwrap_or(w.started);
        (load, oldest.elapsed().as_secs_f64())
    }

    /// Seconds since the counts began.
    pub fn uptime_seconds(&self) -> f64 {
        self.window.started.elapsed().as_secs_f64()
    }

    pub fn num_layers(&self) -> usize {
        self.device_tokens.len() / self.num_devices.max(1)
    }

    pub fn record(&self, layer: usize, expert: u32, device: usize, rows: usize) {
        self.record_activation(layer, expert, rows);
        self.record_run(layer, device, rows);
    }

    /// Rows another node routed that ran on a device here: they load the device, but their
    /// activations are counted where they were routed (so a cluster's profiles add up to
    /// its tokens, each counted once).
    pub fn record_run(&self, layer: usize, device: usize, rows: usize) {
        let slot = layer * self.num_devices + device;
        let current = self.window.current.load(Ordering::Relaxed);
        if let Some(t) = self.device_tokens.get(slot) {
            t.fetch_add(rows as u64, Ordering::Relaxed);
            self.window.device_tokens[current][slot].fetch_add(rows as u64, Ordering::Relaxed);
        }
    }

    /// Rows routed to an expert that ran on another node.
    pub fn record_activation(&self, layer: usize, expert: u32, rows: usize) {
        let slot = layer * self.num_experts + expert as usize;
        let current = self.window.current.load(Ordering::Relaxed);
        if let Some(a) = self.activations.get(slot) {
            a.fetch_add(rows as u64, Ordering::Relaxed);
            self.window.activations[current][slot].fetch_add(rows as u64, Ordering::Relaxed);
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
        let (recent, _) = load.recent(1);
        assert_eq!(recent, layer, "the window holds everything so far");
    }

    #[test]
    fn the_window_forgets_what_is_older_than_its_buckets() {
        let bucket = Duration::from_millis(40);
        let load = ExpertLoad::with_bucket(1, 2, 1, bucket);
        load.record(0, 0, 0, 5);
        std::thread::sleep(bucket * 2);
        load.tick();
        load.record(0, 1, 0, 3);
        let (recent, seconds) = load.recent(0);
        assert_eq!(recent.activations, vec![5, 3], "both still in the window");
        assert!(seconds >= 0.07, "{seconds}");
        // Past the whole ring: the first add is gone, the totals keep it.
        std::thread::sleep(bucket * WINDOW_BUCKETS as u32);
        load.tick();
        load.record(0, 1, 0, 1);
        let (recent, seconds) = load.recent(0);
        assert_eq!(recent.activations, vec![0, 1]);
        assert_eq!(recent.device_tokens, vec![1]);
        assert!(seconds <= (bucket * WINDOW_BUCKETS as u32).as_secs_f64() + 0.05);
        assert_eq!(load.layer(0).activations, vec![5, 4]);
    }
}
