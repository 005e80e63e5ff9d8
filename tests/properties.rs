//! Properties of the pure decision code, over generated inputs (proptest): gating, the
//! dispatch plan, placement and replica choice, and continuous batching. Each property is
//! an invariant the serving path relies on; a failing case is shrunk to a small example.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use moe_node::engine::SamplingParams;
use moe_node::engine::batch::{BatchLimits, Batcher, Sequence, SequenceEvent};
use moe_node::engine::kv_cache::KvCache;
use moe_node::experts::{Reach, ReplicaHealth, assign_groups};
use moe_node::model::ModelConfig;
use moe_node::model::config::GatingConfig;
use moe_node::moe::dispatch::DispatchPlan;
use moe_node::moe::gating::{Routing, route};
use moe_node::placement::{NodeSlots, Placement, PlacementSpec, Replica};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 128,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------
// Gating

/// Rows of logits for `experts` experts.
fn logits(experts: usize) -> impl Strategy<Value = Vec<f32>> {
    (1usize..4).prop_flat_map(move |rows| prop::collection::vec(-20.0f32..20.0, rows * experts))
}

/// Each row's experts are distinct, in range, and `top_k` of them.
fn check_routing_shape(routing: &Routing, rows: usize, experts: usize, top_k: usize) {
    assert_eq!(routing.experts.len(), rows * top_k);
    assert_eq!(routing.weights.len(), rows * top_k);
    for row in routing.experts.chunks(top_k) {
        let distinct: BTreeSet<u32> = row.iter().copied().collect();
        assert_eq!(distinct.len(), top_k, "experts repeated in a row: {row:?}");
        assert!(row.iter().all(|&e| (e as usize) < experts), "{row:?}");
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn softmax_gating_picks_the_top_k_and_weights_them_as_probabilities(
        (experts, top_k, logits, renormalize) in (1usize..48)
            .prop_flat_map(|experts| (Just(experts), 1..=experts, logits(experts), any::<bool>()))
    ) {
        let gating = GatingConfig::Softmax { renormalize };
        let routing = route(&gating, &logits, experts, top_k, None);
        let rows = logits.len() / experts;
        check_routing_shape(&routing, rows, experts, top_k);
        for (r, row) in logits.chunks(experts).enumerate() {
            let chosen = &routing.experts[r * top_k..(r + 1) * top_k];
            let weights = &routing.weights[r * top_k..(r + 1) * top_k];
            // No expert left out has a larger logit than one chosen.
            let weakest = chosen.iter().map(|&e| row[e as usize]).fold(f32::INFINITY, f32::min);
            for (e, &value) in row.iter().enumerate() {
                if !chosen.contains(&(e as u32)) {
                    prop_assert!(value <= weakest, "expert {e} ({value}) left out for {weakest}");
                }
            }
            prop_assert!(weights.iter().all(|w| w.is_finite() && *w >= 0.0), "{weights:?}");
            let sum: f32 = weights.iter().sum();
            if renormalize {
                prop_assert!((sum - 1.0).abs() < 1e-4, "renormalised weights sum to {sum}");
            } else {
                prop_assert!(sum <= 1.0 + 1e-4, "probabilities sum to {sum}");
            }
        }
    }

    #[test]
    fn grouped_sigmoid_gating_stays_within_topk_group_groups(
        (n_group, group_size, topk_group, top_k, logits, bias, normalize, scale) in
            (1usize..6, 2usize..8)
                .prop_flat_map(|(n_group, group_size)| {
                    let experts = n_group * group_size;
                    (1..=n_group).prop_flat_map(move |topk_group| (
                        Just(n_group),
                        Just(group_size),
                        Just(topk_group),
                        1..=topk_group * group_size,
                        logits(experts),
                        prop::option::of(prop::collection::vec(-1.0f32..1.0, experts)),
                        any::<bool>(),
                        0.5f32..4.0,
                    ))
                })
    ) {
        let experts = n_group * group_size;
        let gating = GatingConfig::SigmoidGrouped {
            n_group,
            topk_group,
            normalize,
            routed_scaling_factor: scale,
        };
        let routing = route(&gating, &logits, experts, top_k, bias.as_deref());
        let rows = logits.len() / experts;
        check_routing_shape(&routing, rows, experts, top_k);
        for r in 0..rows {
            let chosen = &routing.experts[r * top_k..(r + 1) * top_k];
            let weights = &routing.weights[r * top_k..(r + 1) * top_k];
            let groups: BTreeSet<usize> =
                chosen.iter().map(|&e| e as usize / group_size).collect();
            prop_assert!(groups.len() <= topk_group, "{chosen:?} spans groups {groups:?}");
            prop_assert!(weights.iter().all(|w| w.is_finite() && *w >= 0.0), "{weights:?}");
            if normalize {
                let sum: f32 = weights.iter().sum();
                prop_assert!((sum - scale).abs() < 1e-3 * scale, "weights sum to {sum}, not {scale}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Dispatch plan

/// A routing of `rows` tokens to `top_k` distinct experts each, with positive weights.
fn routing() -> impl Strategy<Value = (Routing, usize)> {
    (1usize..12, 1usize..24).prop_flat_map(|(experts, rows)| {
        (1..=experts.min(4)).prop_flat_map(move |top_k| {
            let row = Just((0..experts as u32).collect::<Vec<_>>())
                .prop_shuffle()
                .prop_map(move |order| order[..top_k].to_vec());
            (
                prop::collection::vec(row, rows),
                prop::collection::vec(0.0f32..1.0, rows * top_k),
            )
                .prop_map(move |(chosen, weights)| {
                    let routing = Routing {
                        top_k,
                        experts: chosen.concat(),
                        weights,
                    };
                    (routing, experts)
                })
        })
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn dispatch_plan_groups_every_pair_once_and_combine_undoes_gather(
        (routing, experts) in routing(),
        width in 1usize..5,
    ) {
        let plan = DispatchPlan::new(&routing, experts);
        let rows = routing.rows();
        prop_assert_eq!(plan.len(), rows * routing.top_k);
        // Groups: ascending experts, contiguous, covering every grouped row once.
        prop_assert!(plan.experts.windows(2).all(|w| w[0] < w[1]));
        prop_assert_eq!(plan.offsets.first(), Some(&0));
        prop_assert_eq!(plan.offsets.last(), Some(&plan.len()));
        prop_assert!(plan.offsets.windows(2).all(|w| w[0] < w[1]));
        // The (row, expert, weight) triples are exactly the routing's pairs.
        let mut planned = Vec::new();
        for (i, &expert) in plan.experts.iter().enumerate() {
            for slot in plan.group(i) {
                planned.push((plan.source_rows[slot], expert, plan.weights[slot].to_bits()));
            }
        }
        let mut routed: Vec<(u32, u32, u32)> = routing
            .experts
            .iter()
            .zip(&routing.weights)
            .enumerate()
            .map(|(pair, (&e, w))| ((pair / routing.top_k) as u32, e, w.to_bits()))
            .collect();
        planned.sort_unstable();
        routed.sort_unstable();
        prop_assert_eq!(planned, routed);

        // Gather then combine is the identity, scaled by each row's weight sum: with an
        // identity expert every token gets back its own row (integer values: exact sums).
        let hidden: Vec<f32> = (0..rows * width).map(|i| (i % 13) as f32).collect();
        let grouped = plan.gather(&hidden, width);
        for (slot, &row) in plan.source_rows.iter().enumerate() {
            let row = row as usize;
            prop_assert_eq!(
                &grouped[slot * width..(slot + 1) * width],
                &hidden[row * width..(row + 1) * width]
            );
        }
        let unit = DispatchPlan { weights: vec![1.0; plan.len()], ..plan.clone() };
        let mut out = vec![0.0; rows * width];
        unit.combine(&grouped, width, &mut out);
        for (o, h) in out.iter().zip(&hidden) {
            prop_assert_eq!(*o, h * routing.top_k as f32);
        }
        let mut weighted = vec![0.0; rows * width];
        plan.combine(&grouped, width, &mut weighted);
        for row in 0..rows {
            let sum: f32 = routing.weights[row * routing.top_k..(row + 1) * routing.top_k].iter().sum();
            for c in 0..width {
                let expected = hidden[row * width + c] * sum;
                prop_assert!((weighted[row * width + c] - expected).abs() <= 1e-4 * (1.0 + expected.abs()));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Placement and replica choice

fn spec(devices: &[usize], replication: usize) -> PlacementSpec {
    PlacementSpec {
        version: 1,
        replication,
        nodes: devices
            .iter()
            .enumerate()
            .map(|(i, &devices)| NodeSlots::new(format!("node-{i}"), devices))
            .collect(),
    }
}

/// Nodes (device counts, some nodes without devices), a replication the devices allow, a
/// layer pattern and an expert count.
fn cluster() -> impl Strategy<Value = (Vec<usize>, usize, Vec<bool>, usize)> {
    prop::collection::vec(0usize..4, 1..6)
        .prop_filter("some device", |nodes| nodes.iter().sum::<usize>() > 0)
        .prop_flat_map(|nodes| {
            let devices = nodes.iter().sum::<usize>();
            (
                Just(nodes),
                1..=devices,
                prop::collection::vec(any::<bool>(), 1..4),
                1usize..40,
            )
        })
}

proptest! {
    #![proptest_config(config())]

    /// Devices with room for few experts (a GPU carrying a dense replica) take no more than
    /// that while any device has room; past everyone's room, each is as far past as the
    /// others, give or take one. Copies stay on distinct nodes.
    #[test]
    fn a_placement_stops_at_each_devices_slots_while_another_has_room(
        (nodes, replication, layers, experts) in cluster(),
        room in prop::collection::vec(0usize..12, 16),
    ) {
        let mut spec = spec(&nodes, replication);
        let mut next = room.iter().cycle();
        for n in &mut spec.nodes {
            n.slots = (0..n.devices).map(|_| *next.next().unwrap()).collect();
        }
        let slots: HashMap<Replica, usize> = spec
            .nodes
            .iter()
            .enumerate()
            .flat_map(|(i, n)| {
                n.slots.iter().enumerate().map(move |(d, &s)| {
                    (Replica { node: i as u16, device: d as u16 }, s)
                })
            })
            .collect();
        let placement = Placement::balanced(&layers, experts, spec.clone())
            .expect("replication within the devices");
        let nodes_with_devices = nodes.iter().filter(|&&d| d > 0).count();
        for (layer, _) in layers.iter().enumerate().filter(|(_, m)| **m) {
            let mut held: HashMap<Replica, usize> = slots.keys().map(|&r| (r, 0)).collect();
            for e in 0..experts as u32 {
                let copies = placement.replicas(layer, e);
                prop_assert_eq!(copies.len(), replication);
                if replication <= nodes_with_devices {
                    let distinct: BTreeSet<u16> = copies.iter().map(|r| r.node).collect();
                    prop_assert_eq!(distinct.len(), replication, "{:?}", copies);
                }
                for r in copies {
                    *held.get_mut(r).unwrap() += 1;
                }
            }
            let past: Vec<usize> = held.iter().map(|(r, &h)| h.saturating_sub(slots[r])).collect();
            let full = held.iter().all(|(r, &h)| h >= slots[r]);
            if replication == 1 {
                // One copy an expert: nothing stops a copy from the device with room.
                prop_assert!(
                    full || past.iter().all(|&p| p == 0),
                    "layer {}: past its room while another had some: {:?} of {:?}", layer, held, slots
                );
                if full {
                    let (min, max) = (past.iter().min().unwrap(), past.iter().max().unwrap());
                    prop_assert!(max - min <= 1, "layer {}: {:?} of {:?}", layer, held, slots);
                }
            }
        }
    }

    #[test]
    fn balanced_placement_copies_every_expert_on_distinct_nodes_and_balances(
        (nodes, replication, layers, experts) in cluster()
    ) {
        let placement = Placement::balanced(&layers, experts, spec(&nodes, replication))
            .expect("replication within the devices");
        let nodes_with_devices = nodes.iter().filter(|&&d| d > 0).count();
        let all_devices: Vec<Replica> = nodes
            .iter()
            .enumerate()
            .flat_map(|(n, &d)| (0..d).map(move |d| Replica { node: n as u16, device: d as u16 }))
            .collect();
        let equal_devices = nodes.iter().filter(|&&d| d > 0).collect::<BTreeSet<_>>().len() == 1
            && nodes.iter().all(|&d| d > 0);
        for (layer, &is_moe) in layers.iter().enumerate() {
            if !is_moe {
                for e in 0..experts as u32 {
                    prop_assert!(placement.replicas(layer, e).is_empty());
                }
                continue;
            }
            let mut held: HashMap<Replica, usize> =
                all_devices.iter().map(|&r| (r, 0)).collect();
            for e in 0..experts as u32 {
                let copies = placement.replicas(layer, e);
                prop_assert_eq!(copies.len(), replication);
                let devices: BTreeSet<Replica> = copies.iter().copied().collect();
                prop_assert_eq!(devices.len(), replication, "copies share a device: {:?}", copies);
                if replication <= nodes_with_devices {
                    let distinct: BTreeSet<u16> = copies.iter().map(|r| r.node).collect();
                    prop_assert_eq!(distinct.len(), replication, "copies share a node: {:?}", copies);
                }
                for r in copies {
                    let count = held.get_mut(r);
                    prop_assert!(count.is_some(), "{:?} is not a device of the spec", r);
                    if let Some(count) = count {
                        *count += 1;
                    }
                }
            }
            if equal_devices {
                let min = held.values().min().copied().unwrap_or(0);
                let max = held.values().max().copied().unwrap_or(0);
                prop_assert!(max - min <= 1, "layer {}: {:?}", layer, held);
            }
        }
    }

    #[test]
    fn replica_choice_never_picks_a_down_or_excluded_replica(
        (nodes, replication, _layers, experts) in cluster(),
        reach in prop::collection::vec(0u8..3, 16),
        latency in prop::collection::vec(10.0f64..5000.0, 16),
        outstanding in prop::collection::vec(0usize..600, 16),
        excluded_bits in prop::collection::vec(any::<u8>(), 40),
        active in prop::collection::btree_set(0u32..40, 1..12),
    ) {
        let placement = Placement::balanced(&[true], experts, spec(&nodes, replication))
            .expect("replication within the devices");
        let active: Vec<u32> = active.into_iter().filter(|&e| (e as usize) < experts).collect();
        let index = |r: Replica| (r.node as usize * 4 + r.device as usize) % 16;
        let health = |r: Replica| ReplicaHealth {
            reach: [Reach::Up, Reach::Suspect, Reach::Down][reach[index(r)] as usize],
            latency_micros: latency[index(r)],
            outstanding_rows: outstanding[index(r)],
            local: r.node == 0,
        };
        let excluded = |group: usize, r: Replica| excluded_bits[group] >> (index(r) % 8) & 1 == 1;
        let chosen = assign_groups(&placement, 0, &active, |_| 8, health, excluded);
        prop_assert_eq!(chosen.len(), active.len());
        for (group, (&expert, choice)) in active.iter().zip(&chosen).enumerate() {
            let usable: Vec<Replica> = placement
                .replicas(0, expert)
                .iter()
                .copied()
                .filter(|&r| !excluded(group, r) && health(r).reach != Reach::Down)
                .collect();
            match choice {
                None => prop_assert!(usable.is_empty(), "expert {expert} left out with {usable:?}"),
                Some(r) => {
                    prop_assert!(usable.contains(r), "expert {expert}: chose {r:?} outside {usable:?}");
                    if health(*r).reach == Reach::Suspect {
                        prop_assert!(
                            usable.iter().all(|&u| health(u).reach != Reach::Up),
                            "a suspect replica chosen while an up one was usable"
                        );
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Batching

#[derive(Debug, Clone)]
enum Op {
    /// A request with a prompt of this many tokens and this many tokens to generate.
    Submit { prompt: usize, max_tokens: usize },
    /// The client of the n-th submitted request (if still there) goes away.
    Cancel(usize),
    /// A step; `eos` decides per planned sequence whether it samples the end token, `gone`
    /// whether its client has gone when the token is delivered.
    Step { eos: Vec<bool>, gone: Vec<bool> },
    /// A step that fails (no replica held an expert).
    FailStep,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..9, 1usize..5).prop_map(|(prompt, max_tokens)| Op::Submit { prompt, max_tokens }),
        1 => (0usize..32).prop_map(Op::Cancel),
        4 => (prop::collection::vec(prop::bool::weighted(0.2), 8), prop::collection::vec(prop::bool::weighted(0.1), 8))
            .prop_map(|(eos, gone)| Op::Step { eos, gone }),
        1 => Just(Op::FailStep),
    ]
}

const EOS: u32 = 15;

/// Logits whose argmax (greedy sampling) is `token`.
fn logits_for(token: u32) -> Vec<f32> {
    let mut logits = vec![0.0; 16];
    logits[token as usize] = 100.0;
    logits
}

/// What the test knows of each request.
#[derive(Debug, Default)]
struct Ledger {
    /// Requests in the batcher (waiting or running).
    live: BTreeSet<usize>,
    /// How each request ended: finished, failed, cancelled or its client gone.
    ended: BTreeMap<usize, &'static str>,
    /// Tokens each request received.
    tokens: BTreeMap<usize, usize>,
}

impl Ledger {
    fn end(&mut self, id: usize, how: &'static str) {
        assert!(
            self.live.remove(&id),
            "request {id} ended ({how}) but was not live"
        );
        let before = self.ended.insert(id, how);
        assert!(
            before.is_none(),
            "request {id} ended twice: {before:?} then {how}"
        );
    }

    /// A request's event: it must be live.
    fn event(&mut self, id: usize, event: &SequenceEvent) {
        assert!(
            self.live.contains(&id),
            "event {event:?} for request {id}, which has left"
        );
        match event {
            SequenceEvent::Token { .. } => *self.tokens.entry(id).or_default() += 1,
            SequenceEvent::Finished {
                completion_tokens, ..
            } => {
                assert_eq!(
                    self.tokens.get(&id).copied().unwrap_or(0),
                    *completion_tokens
                );
            }
            SequenceEvent::Failed(_)
            | SequenceEvent::PromptLogprobs(_)
            | SequenceEvent::Degraded { .. } => {}
        }
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn batching_loses_and_duplicates_no_sequence(ops in prop::collection::vec(op(), 1..60)) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe");
        let model = ModelConfig::load(&dir).expect("fixture config");
        let limits = BatchLimits {
            max_sequences: 3,
            max_tokens_per_step: 6,
            max_waiting: 4,
            prefill_chunk: 4,
            kv: None,
            prefix_cache_entries: 0,
        };
        let mut batcher: Batcher<usize> = Batcher::new(limits, vec![EOS]);
        let mut ledger = Ledger::default();
        let mut submitted = 0usize;
        let mut max_tokens = HashMap::new();
        let run_step = |batcher: &mut Batcher<usize>, ledger: &mut Ledger, eos: &[bool], gone: &[bool]| {
            let planned = batcher.plan_step(|c: &KvCache| c.host_copy().ok_or(moe_node::engine::EngineError::ForeignCache)).len();
            let logits = (0..planned)
                .map(|i| logits_for(if eos.get(i).copied().unwrap_or(false) { EOS } else { 3 }))
                .collect();
            let mut position = 0usize;
            let mut leaving: Vec<(usize, &'static str)> = Vec::new();
            let fork = |cache: &KvCache| cache.host_copy().ok_or(moe_node::engine::EngineError::ForeignCache);
            batcher.complete_step(logits, fork, |&mut id, event| {
                ledger.event(id, &event);
                match event {
                    SequenceEvent::Finished { .. } => {
                        leaving.retain(|(l, _)| *l != id);
                        leaving.push((id, "finished"));
                        true
                    }
                    _ => {
                        let open = !gone.get(position % gone.len().max(1)).copied().unwrap_or(false);
                        position += 1;
                        if !open {
                            leaving.push((id, "client gone"));
                        }
                        open
                    }
                }
            });
            for (id, how) in leaving {
                ledger.end(id, how);
            }
        };
        for op in ops {
            match op {
                Op::Submit { prompt, max_tokens: max } => {
                    let id = submitted;
                    submitted += 1;
                    let sequence = Sequence::new(
                        (0..prompt as u32).collect(),
                        max,
                        SamplingParams::default(),
                        true,
                        KvCache::new(&model),
                        id,
                    );
                    match batcher.submit(sequence) {
                        Ok(()) => {
                            ledger.live.insert(id);
                            max_tokens.insert(id, max);
                        }
                        Err(full) => prop_assert_eq!(full.waiting, limits.max_waiting),
                    }
                }
                Op::Cancel(n) => {
                    let dropped = batcher.retain(|&id| id != n);
                    prop_assert_eq!(dropped, usize::from(ledger.live.contains(&n)));
                    if dropped == 1 {
                        ledger.end(n, "cancelled");
                    }
                }
                Op::Step { eos, gone } => run_step(&mut batcher, &mut ledger, &eos, &gone),
                Op::FailStep => {
                    batcher.plan_step(|c: &KvCache| c.host_copy().ok_or(moe_node::engine::EngineError::ForeignCache));
                    let error = moe_node::engine::EngineError::EmptyPrompt;
                    let mut failed = Vec::new();
                    batcher.fail_step(std::sync::Arc::new(error), |&mut id, event| {
                        ledger.event(id, &event);
                        failed.push(id);
                    });
                    for id in failed {
                        ledger.end(id, "failed");
                    }
                }
            }
            prop_assert_eq!(batcher.waiting() + batcher.running(), ledger.live.len());
            prop_assert!(batcher.running() <= limits.max_sequences);
        }
        // Every request still in the batcher ends once steps run on: none is stranded.
        for _ in 0..200 {
            if !batcher.has_work() {
                break;
            }
            run_step(&mut batcher, &mut ledger, &[], &[]);
        }
        prop_assert!(!batcher.has_work(), "requests stranded: {:?}", ledger.live);
        prop_assert!(ledger.live.is_empty());
        for (id, how) in &ledger.ended {
            if *how == "finished" {
                let tokens = ledger.tokens.get(id).copied().unwrap_or(0);
                prop_assert!(tokens >= 1 && tokens <= max_tokens[id], "request {id}: {tokens} tokens");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Hot-expert replication and rebalancing

proptest! {
    #![proptest_config(config())]

    /// Whatever the profile, the spare slots and the budget per version, every placement
    /// version a rebalance goes through leaves every expert with at least its copies, on
    /// distinct devices (on distinct nodes while there are enough), within the devices'
    /// slots, loading no more than the budget (a step of the search loads at most two);
    /// no version balances worse than the placement serving; moe-node is never worse than
    /// EPLB.
    #[test]
    fn a_rebalance_never_leaves_an_expert_without_a_copy(
        (nodes, replication, _layers, experts) in cluster(),
        spare in 0usize..3,
        budget in 0usize..4,
        loads in prop::collection::vec(prop_oneof![Just(0u64), 0u64..10, 0u64..100_000], 40),
    ) {
        use moe_node::placement::replicate::{LayerReplicas, LayerSlots, add_replicas, balance, eplb, imbalance};
        let base = Placement::balanced(&[false, true], experts, spec(&nodes, replication))
            .expect("replication within the devices");
        let loads: Vec<f64> = loads[..experts].iter().map(|&l| l as f64).collect();
        let total_devices: usize = nodes.iter().sum();
        let migration = base
            .migrate(&[None, Some(loads.clone())], &vec![spare; total_devices], budget)
            .expect("a rebalance over valid slots");
        let share = (experts * replication).div_ceil(total_devices);
        // Copies on distinct nodes while there are nodes enough, as serve lays them out.
        let spread = if replication <= nodes.iter().filter(|&&d| d > 0).count() { replication } else { 1 };
        for (version, moves) in migration.versions.iter().zip(&migration.moves) {
            prop_assert_eq!(version.version(), moves.version);
            if budget > 0 {
                prop_assert!(moves.copies_loaded <= budget.max(2), "{:?}", moves);
            }
            for e in 0..experts as u32 {
                let copies = version.replicas(1, e);
                prop_assert!(copies.len() >= replication, "expert {}: {:?}", e, copies);
                let distinct: BTreeSet<Replica> = copies.iter().copied().collect();
                prop_assert_eq!(distinct.len(), copies.len());
                let on_nodes: BTreeSet<u16> = copies.iter().map(|r| r.node).collect();
                prop_assert!(on_nodes.len() >= spread, "expert {}: {:?}", e, copies);
            }
            for (n, &devices) in nodes.iter().enumerate() {
                for d in 0..devices as u16 {
                    let held = version.experts_on(n as u16, d).len();
                    let before = base.experts_on(n as u16, d).len();
                    prop_assert!(held <= before.max(share + spare), "node {} device {}: {}", n, d, held);
                }
            }
            prop_assert!(Placement::from_table(version.to_table(), &[false, true], experts).is_ok());
            let w = imbalance(&version.device_loads(1, &loads));
            let w0 = imbalance(&base.device_loads(1, &loads));
            prop_assert!(w <= w0 + 1e-9, "version {} at {} above the start's {}", version.version(), w, w0);
        }
        if let Some(last) = migration.target() {
            let worst = |p: &Placement| imbalance(&p.device_loads(1, &loads));
            prop_assert!(worst(last) <= worst(&base) + 1e-9, "{} > {}", worst(last), worst(&base));
            prop_assert_eq!(last.version(), base.version() + migration.versions.len() as u64);
        }

        // The same slots, laid out from scratch.
        let devices: Vec<Replica> = nodes
            .iter()
            .enumerate()
            .flat_map(|(n, &d)| (0..d).map(move |d| Replica { node: n as u16, device: d as u16 }))
            .collect();
        let serving = LayerReplicas {
            devices_of: (0..experts as u32)
                .map(|e| {
                    base.replicas(1, e)
                        .iter()
                        .map(|r| devices.iter().position(|d| d == r).unwrap())
                        .collect()
                })
                .collect(),
        };
        let mut capacity = vec![spare; devices.len()];
        for &d in serving.devices_of.iter().flatten() {
            capacity[d] += 1;
        }
        let slots = LayerSlots { node_of: devices.iter().map(|d| d.node).collect(), capacity };
        // Laying out from scratch may find no room for a required copy on very uneven
        // nodes (an error: the caller keeps what it has); filling spare slots never fails.
        let live = add_replicas(&loads, &slots, &serving).expect("add_replicas");
        let mut layouts = vec![live.clone()];
        let from_scratch = eplb(&loads, &slots, replication).ok().map(|baseline| {
            let ours = balance(&loads, &slots, replication).expect("balance where eplb works");
            (baseline, ours)
        });
        if let Some((baseline, ours)) = &from_scratch {
            layouts.push(baseline.clone());
            layouts.push(ours.clone());
        }
        for layout in &layouts {
            let mut held = vec![0usize; devices.len()];
            for copies in &layout.devices_of {
                prop_assert!(copies.len() >= replication);
                let distinct: BTreeSet<usize> = copies.iter().copied().collect();
                prop_assert_eq!(distinct.len(), copies.len());
                for &d in copies {
                    held[d] += 1;
                }
            }
            for (d, &h) in held.iter().enumerate() {
                prop_assert!(h <= slots.capacity[d]);
            }
        }
        let n = devices.len();
        if let Some((baseline, ours)) = &from_scratch {
            prop_assert!(ours.imbalance(&loads, n) <= baseline.imbalance(&loads, n) + 1e-9);
        }
        prop_assert!(live.imbalance(&loads, n) <= serving.imbalance(&loads, n) + 1e-9);
    }
}
