//! Hot-expert replication on a Kimi K3-sized layout: 896 experts × 61 MoE layers over 64
//! devices (8 nodes × 8), replication 1, with Zipf-skewed activation profiles at several
//! skews and 0, 1 or 2 spare slots per device. Prints the imbalance (most loaded device
//! over the mean, a copied expert's load split over its copies) of:
//! - serve's layout without copies (`Placement::balanced`),
//! - DeepSeek's EPLB (re-places every expert),
//! - moe-node `balance` (EPLB then local search; re-places every expert),
//! - moe-node `add_replicas` (keeps serve's layout, fills only spare slots: what a live
//!   rebalance loads),
//!
//! averaged and worst over the layers, with the planning time of each for all 61 layers.
//!
//! Profiles: per layer, a token picks the expert of rank r with probability ∝ (r+1)^-skew
//! (capped at 0.95, 16 picks per token: `zipf_probabilities`), ranks shuffled per layer, and
//! counts drawn for 65,536 tokens (multinomial noise, as a measured window has).
//!
//! `cargo bench --bench rebalance` (results/rebalance.txt holds a run).

use std::time::{Duration, Instant};

use moe_node::placement::profile::zipf_probabilities;
use moe_node::placement::replicate::{
    LayerReplicas, LayerSlots, add_replicas, balance, eplb, imbalance,
};
use moe_node::placement::{NodeSlots, Placement, PlacementSpec};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};

const EXPERTS: usize = 896;
const LAYERS: usize = 61;
const NODES: usize = 8;
const PER_NODE: usize = 8;
const TOP_K: usize = 16;
const TOKENS: u64 = 65_536;

/// Measured counts for one layer: each token's 16 picks spread as the probabilities say
/// (a Poisson draw per expert, close to the multinomial for many tokens).
fn profile(skew: f64, layer: usize) -> Vec<f64> {
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

#[derive(Default)]
struct Tally {
    sum: f64,
    worst: f64,
    time: Duration,
}

impl Tally {
    fn add(&mut self, imbalance: f64, time: Duration) {
        self.sum += imbalance;
        self.worst = self.worst.max(imbalance);
        self.time += time;
    }
}

fn main() {
    let spec = PlacementSpec {
        version: 1,
        replication: 1,
        nodes: (0..NODES)
            .map(|n| NodeSlots {
                node: format!("node{n}"),
                devices: PER_NODE,
            })
            .collect(),
    };
    let placement = Placement::balanced(&[true; LAYERS], EXPERTS, spec).expect("placement");
    let devices = NODES * PER_NODE;
    println!(
        "{EXPERTS} experts x {LAYERS} layers over {devices} devices ({NODES} nodes x {PER_NODE}), \
         replication 1, {TOP_K} picks per token, {TOKENS} tokens per profile"
    );
    println!(
        "imbalance = most loaded device / mean device load; mean (worst) over the {LAYERS} layers; \
         time = planning all {LAYERS} layers"
    );
    println!(
        "{:>5} {:>5} | {:>15} | {:>15} {:>8} | {:>15} {:>8} | {:>15} {:>8} | {:>9}",
        "skew",
        "spare",
        "no copies",
        "EPLB",
        "time",
        "moe-node",
        "time",
        "moe-node live",
        "time",
        "> EPLB"
    );
    for skew in [0.0, 0.4, 0.6, 0.8, 1.0, 1.2] {
        for spare in [0usize, 1, 2] {
            let (mut none, mut base, mut ours, mut live) = Default::default();
            let mut worse = 0;
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
                Tally::add(
                    &mut none,
                    imbalance(&serving.device_loads(&loads, devices)),
                    Duration::ZERO,
                );
                let started = Instant::now();
                let e = eplb(&loads, &slots, 1)
                    .expect("eplb")
                    .imbalance(&loads, devices);
                Tally::add(&mut base, e, started.elapsed());
                let started = Instant::now();
                let o = balance(&loads, &slots, 1)
                    .expect("balance")
                    .imbalance(&loads, devices);
                Tally::add(&mut ours, o, started.elapsed());
                let started = Instant::now();
                let l = add_replicas(&loads, &slots, &serving)
                    .expect("add_replicas")
                    .imbalance(&loads, devices);
                Tally::add(&mut live, l, started.elapsed());
                if o > e + 1e-9 {
                    worse += 1;
                }
            }
            let show = |t: &Tally| format!("{:.3} ({:.3})", t.sum / LAYERS as f64, t.worst);
            let ms = |t: &Tally| format!("{:.0} ms", t.time.as_secs_f64() * 1e3);
            println!(
                "{skew:>5.1} {spare:>5} | {:>15} | {:>15} {:>8} | {:>15} {:>8} | {:>15} {:>8} | {:>9}",
                show(&none),
                show(&base),
                ms(&base),
                show(&ours),
                ms(&ours),
                show(&live),
                ms(&live),
                worse
            );
        }
    }
}
