//! The replication benchmark's workload and rows: a Kimi K3-sized layout (896 experts × 61
//! MoE layers over 64 devices, 8 nodes × 8, replication 1) under seeded Zipf profiles.
//! `benches/rebalance.rs` prints every row; `tests/rebalance.rs` holds the rows
//! docs/load-balance-and-plan.md quotes to their figures (the profiles are seeded and the
//! algorithms deterministic).

use std::time::{Duration, Instant};

use moe_node::placement::migrate::{GOOD_ENOUGH, REBALANCE_ABOVE, migrate_layer};
use moe_node::placement::profile::zipf_probabilities;
use moe_node::placement::replicate::{
    LayerReplicas, LayerSlots, add_replicas, balance, eplb, imbalance,
};
use moe_node::placement::{NodeSlots, Placement, PlacementSpec};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};

pub const EXPERTS: usize = 896;
pub const LAYERS: usize = 61;
pub const NODES: usize = 8;
pub const PER_NODE: usize = 8;
pub const TOP_K: usize = 16;
pub const TOKENS: u64 = 65_536;

/// Measured counts for one layer: each token's 16 picks spread as the probabilities say
/// (a Poisson draw per expert, close to the multinomial for many tokens).
pub fn profile(skew: f64, layer: usize) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(0x11 + layer as u64);
    let by_rank = zipf_probabilities(EXPERTS, TOP_K, skew);
    let mut ids: Vec<usize> = (0..EXPERTS).collect();
    for i in (1..EXPERTS).rev() {
        ids.swap(i, rng.next_u64() as usize % (i + 1));
    }
    let mut loads = vec![0.0; EXPERTS];
    for (rank, &expert) in ids.iter().enumerate() {
        let mean = by_rank[rank] * TOKENS as f64;
        // Normal approximation of the count's noise (mean is hundreds or more).
        let u1 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let z = (-2.0 * (u1 + 1e-300).ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        loads[expert] = (mean + z * mean.sqrt()).max(0.0).round();
    }
    loads
}

/// One algorithm's imbalance over the layers, and its planning time.
#[derive(Default)]
pub struct Tally {
    sum: f64,
    pub worst: f64,
    pub time: Duration,
}

impl Tally {
    fn add(&mut self, imbalance: f64, time: Duration) {
        self.sum += imbalance;
        self.worst = self.worst.max(imbalance);
        self.time += time;
    }

    /// The mean over the layers.
    pub fn mean(&self) -> f64 {
        self.sum / LAYERS as f64
    }
}

/// One (skew, spare slots) row of the table.
#[derive(Default)]
pub struct Row {
    /// Serve's layout without copies (`Placement::balanced`).
    pub none: Tally,
    /// DeepSeek's EPLB (re-places every expert).
    pub eplb: Tally,
    /// moe-node `balance` (EPLB then local search; re-places every expert).
    pub ours: Tally,
    /// moe-node `add_replicas` (keeps serve's layout, fills only spare slots).
    pub live: Tally,
    /// moe-node `migrate_layer` from serve's layout (what a live rebalance converges to:
    /// copies in spare slots and experts moved; serve's layout without spare slots, where
    /// serve refuses to rebalance).
    pub moved: Tally,
    /// Copies that rebalance loads over all layers.
    pub moved_copies: usize,
    /// Layers where `balance` is worse than EPLB.
    pub worse: usize,
}

/// Serve's layout of the 64 devices, what every row starts from.
pub fn serving_placement() -> Placement {
    let spec = PlacementSpec {
        version: 1,
        replication: 1,
        nodes: (0..NODES)
            .map(|n| NodeSlots::new(format!("node{n}"), PER_NODE))
            .collect(),
    };
    Placement::balanced(&[true; LAYERS], EXPERTS, spec).expect("placement")
}

/// Every layer's profile at `skew` laid by each algorithm with `spare` slots per device.
pub fn row(placement: &Placement, skew: f64, spare: usize) -> Row {
    let devices = NODES * PER_NODE;
    let mut row = Row::default();
    for layer in 0..LAYERS {
        let loads = profile(skew, layer);
        let serving = LayerReplicas {
            devices_of: (0..EXPERTS as u32)
                .map(|e| {
                    placement
                        .replicas(layer, e)
                        .iter()
                        .map(|r| r.node as usize * PER_NODE + r.device as usize)
                        .collect()
                })
                .collect(),
        };
        let mut capacity = vec![0; devices];
        for copies in &serving.devices_of {
            for &d in copies {
                capacity[d] += 1;
            }
        }
        let slots = LayerSlots {
            node_of: (0..devices).map(|d| (d / PER_NODE) as u16).collect(),
            capacity: capacity.iter().map(|c| c + spare).collect(),
        };
        row.none.add(
            imbalance(&serving.device_loads(&loads, devices)),
            Duration::ZERO,
        );
        let started = Instant::now();
        let e = eplb(&loads, &slots, 1)
            .expect("eplb")
            .imbalance(&loads, devices);
        row.eplb.add(e, started.elapsed());
        let started = Instant::now();
        let o = balance(&loads, &slots, 1)
            .expect("balance")
            .imbalance(&loads, devices);
        row.ours.add(o, started.elapsed());
        let started = Instant::now();
        let l = add_replicas(&loads, &slots, &serving)
            .expect("add_replicas")
            .imbalance(&loads, devices);
        row.live.add(l, started.elapsed());
        if o > e + 1e-9 {
            row.worse += 1;
        }
        let started = Instant::now();
        let target = if spare > 0 {
            migrate_layer(&loads, &slots, &serving, REBALANCE_ABOVE, GOOD_ENOUGH)
                .expect("migrate_layer")
                .target
        } else {
            serving.clone()
        };
        row.moved
            .add(target.imbalance(&loads, devices), started.elapsed());
        row.moved_copies += serving
            .devices_of
            .iter()
            .zip(&target.devices_of)
            .map(|(was, now)| now.iter().filter(|d| !was.contains(d)).count())
            .sum::<usize>();
    }
    row
}
