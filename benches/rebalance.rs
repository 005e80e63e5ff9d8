//! Hot-expert replication on a Kimi K3-sized layout: 896 experts × 61 MoE layers over 64
//! devices (8 nodes × 8), replication 1, with Zipf-skewed activation profiles at several
//! skews and 0, 1 or 2 spare slots per device. Prints the imbalance (most loaded device
//! over the mean, a copied expert's load split over its copies) of:
//! - serve's layout without copies (`Placement::balanced`),
//! - DeepSeek's EPLB (re-places every expert),
//! - moe-node `balance` (EPLB then local search; re-places every expert),
//! - moe-node `add_replicas` (keeps serve's layout, fills only spare slots: what a live
//!   rebalance did before it moved experts),
//! - moe-node `migrate_layer` (from serve's layout: copies in spare slots and experts
//!   moved, within 1% of the mean where it can: where a live rebalance converges), with the
//!   copies it loads over all layers,
//!
//! averaged and worst over the layers, with the planning time of each for all 61 layers.
//!
//! Profiles: per layer, a token picks the expert of rank r with probability ∝ (r+1)^-skew
//! (capped at 0.95, 16 picks per token: `zipf_probabilities`), ranks shuffled per layer, and
//! counts drawn for 65,536 tokens (multinomial noise, as a measured window has).
//!
//! `cargo bench --bench rebalance` (results/rebalance.txt holds a run).

#[path = "common/replication.rs"]
mod replication;

use replication::{EXPERTS, LAYERS, NODES, PER_NODE, TOKENS, TOP_K, Tally};

fn main() {
    let placement = replication::serving_placement();
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
        "{:>5} {:>5} | {:>15} | {:>15} {:>8} | {:>15} {:>8} | {:>15} {:>8} | {:>15} {:>8} {:>7} | {:>9}",
        "skew",
        "spare",
        "no copies",
        "EPLB",
        "time",
        "moe-node",
        "time",
        "fill spare only",
        "time",
        "live rebalance",
        "time",
        "loaded",
        "> EPLB"
    );
    for skew in [0.0, 0.4, 0.6, 0.8, 1.0, 1.2] {
        for spare in [0usize, 1, 2] {
            let row = replication::row(&placement, skew, spare);
            let show = |t: &Tally| format!("{:.3} ({:.3})", t.mean(), t.worst);
            let ms = |t: &Tally| format!("{:.0} ms", t.time.as_secs_f64() * 1e3);
            println!(
                "{skew:>5.1} {spare:>5} | {:>15} | {:>15} {:>8} | {:>15} {:>8} | {:>15} {:>8} | {:>15} {:>8} {:>7} | {:>9}",
                show(&row.none),
                show(&row.eplb),
                ms(&row.eplb),
                show(&row.ours),
                ms(&row.ours),
                show(&row.live),
                ms(&row.live),
                show(&row.moved),
                ms(&row.moved),
                row.moved_copies,
                row.worse
            );
        }
    }
}
