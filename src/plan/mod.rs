//! `moe-node plan`: the deployment-readiness report. Lays the experts out exactly as
//! `serve` would for a cluster shape ([`Placement::single_node`] or
//! [`Placement::balanced`]), rebalances that layout for the profile as a live rebalance
//! would ([`Placement::migrate`]: copies in the spare slots, experts moved, in versions
//! within `placement.max_move_mib`), and answers: what each device holds and
//! whether it fits, what each node's failure costs, how imbalanced each layer is under a
//! profile, and whether all that passes the thresholds. Pure: the command reads the files
//! and prints.

mod report;
pub mod sizes;

use std::collections::BTreeMap;

use serde::Serialize;

use crate::config::OnUnavailable;
use crate::engine::batch::KvBudget;
use crate::model::ModelConfig;
use crate::placement::migrate::copies_per_version;
use crate::placement::replicate::{self, LayerReplicas, LayerSlots, ReplicateError};
use crate::placement::{
    NodeSlots, Placement, PlacementError, PlacementSpec, Profile, ProfileError, VersionMoves,
};
pub use sizes::{ModelSizes, dense_carriers, expert_slots};

/// The cluster shape and thresholds a plan is made for.
#[derive(Debug, Clone)]
pub struct PlanInput<'a> {
    pub model: &'a ModelConfig,
    pub nodes: usize,
    pub devices_per_node: usize,
    pub replication: usize,
    pub redundant_slots: usize,
    /// `placement.max_move_mib` in bytes: what one version of a rebalance loads at most.
    pub max_move_bytes: u64,
    pub profile: Option<&'a Profile>,
    pub device_memory_bytes: Option<u64>,
    /// The share of each device's memory a node may use (`devices.gpu_memory_fraction`).
    pub memory_fraction: f64,
    /// Grouped rows of one step at most (tokens per step × top-k): sizes the work area.
    pub max_rows: usize,
    /// The dense part lives on the devices (else in host memory), and with it the KV
    /// caches: a replica on each of every node's first `dense_replicas` devices (0: all).
    pub dense_on_device: bool,
    pub dense_replicas: usize,
    /// `batching.kv_cache_mib` in bytes; `None` (0 in the config): sized at start-up from
    /// the memory left where the caches live.
    pub kv_cache_bytes: Option<u64>,
    /// `batching.max_prompt_tokens`: the KV cache must hold at least one such prompt.
    pub max_prompt_tokens: usize,
    pub on_unavailable: OnUnavailable,
    pub max_imbalance: f64,
    /// The operator accepts that some single node failure leaves experts without a copy
    /// (`--accept-unavailable-on-failure`, `cluster.accept_unavailable_on_failure`): the
    /// verdict then lists it as an accepted risk instead of a problem.
    pub accept_unavailable_on_failure: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("--nodes and --devices-per-node must be at least 1")]
    NoDevices,
    #[error("the model has no MoE layer: nothing to place")]
    NoExperts,
    #[error("--max-imbalance must be a number at least 1")]
    BadThreshold,
    #[error("--max-move-mib {0}: give a number of MiB at least 0 (0: no bound)")]
    BadMoveBudget(f64),
    #[error("--device-memory-gib {0}: give a positive number of GiB")]
    BadMemory(f64),
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("replicas of layer {layer}: {source}")]
    Replicate {
        layer: usize,
        source: ReplicateError,
    },
}

/// The report, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    pub model: ModelSummary,
    pub cluster: ClusterShape,
    pub devices: Vec<DeviceReport>,
    /// `{"<layer>": [[global device index of each copy of expert 0], ...]}`, global index
    /// = node × devices_per_node + device.
    pub placement: BTreeMap<String, Vec<Vec<usize>>>,
    pub layers: BTreeMap<String, LayerReport>,
    pub failures: Vec<FailureReport>,
    /// The live rebalance from serve's starting layout to `placement`.
    pub rebalance: RebalancePlan,
    pub verdict: Verdict,
}

/// What a live rebalance from the layout `serve` starts with to the placement reported
/// makes: its versions, each loading at most `max_move_bytes`, and the copies moved.
#[derive(Debug, Clone, Serialize)]
pub struct RebalancePlan {
    pub max_move_bytes: u64,
    pub versions: Vec<VersionMoves>,
    pub copies_loaded: usize,
    pub copies_released: usize,
    pub bytes_loaded: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelSummary {
    pub model_type: String,
    pub layers: usize,
    pub moe_layers: usize,
    pub experts: usize,
    pub top_k: usize,
    pub sizes: ModelSizes,
    pub profiled: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct ClusterShape {
    pub nodes: usize,
    pub devices_per_node: usize,
    pub replication: usize,
    pub redundant_slots: usize,
    pub max_move_bytes: u64,
    pub device_memory_bytes: Option<u64>,
    /// The share of it a node may use, as `serve` counts it at start-up.
    pub memory_fraction: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct DeviceReport {
    pub node: usize,
    pub device: usize,
    /// Copies held per MoE layer (hot-expert copies included).
    pub experts: BTreeMap<String, usize>,
    /// Of those, hot-expert copies in spare slots, over all layers.
    pub redundant_experts: usize,
    pub expert_bytes: u64,
    pub dense_bytes: u64,
    /// What the device's experts need besides their weights on a GPU (see
    /// [`sizes::gpu_work_bytes`]).
    pub work_bytes: u64,
    /// On a device holding the dense part: its KV cache budget, `batching.kv_cache_mib` or
    /// as `serve` sizes it at start-up (90% of the memory left: the GPU's pool of cache
    /// blocks); `null` elsewhere, or when neither that nor the memory is known.
    pub kv_cache_bytes: Option<u64>,
    /// Positions that budget holds (all sequences together, whole blocks of
    /// [`KvBudget::BLOCK_TOKENS`]): the longest context the node serves.
    pub kv_positions: Option<u64>,
    pub fits: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct LayerReport {
    /// Most loaded device over the mean once a live rebalance has converged (copies in the
    /// spare slots, experts moved: `placement`).
    pub imbalance: f64,
    /// The same as `serve` lays experts out, without copies in spare slots.
    pub imbalance_unreplicated: f64,
    /// DeepSeek's EPLB with the same slots (it re-places every expert), for comparison;
    /// `null` when its greedy packing finds no room for an expert's required copies
    /// (very uneven nodes).
    pub imbalance_eplb: Option<f64>,
    /// moe-node's `balance` with the same slots, re-placing every expert as EPLB does
    /// (never above `imbalance_eplb`): what a rebalance that also moved the base copies
    /// would reach; `null` where EPLB's is.
    pub imbalance_balanced: Option<f64>,
    /// Experts activated more than twice the median expert.
    pub hot_experts: Vec<u32>,
    /// Experts whose load per copy is still more than twice the median, after copies.
    pub hot_experts_after: Vec<u32>,
    /// Copies beyond serve's layout (in spare slots).
    pub copies_added: usize,
    /// Copies the rebalance loads in this layer, and copies it releases.
    pub copies_loaded: usize,
    pub copies_released: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct FailureReport {
    pub node: usize,
    /// (layer, expert) pairs with a copy on the node.
    pub experts_losing_a_replica: usize,
    /// (layer, expert) pairs with every copy on the node.
    pub unavailable_experts: usize,
    /// Those pairs, `[layer, expert]`, in order.
    pub unavailable: Vec<[usize; 2]>,
    pub on_expert_unavailable: OnUnavailable,
    /// Share of routed token rows (over all profiled layers) that need an unavailable
    /// expert; `null` without a profile.
    pub token_share_affected: Option<f64>,
    /// Share of routed token rows the node's copies carried, moved to other copies.
    pub token_share_moved: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub ok: bool,
    pub problems: Vec<String>,
    /// Risks the operator accepted (experts a node failure leaves without a copy, with
    /// `accept_unavailable_on_failure`): not problems, still said.
    pub accepted: Vec<String>,
}

/// One MoE layer's layouts.
struct LayerPlan {
    layer: usize,
    loads: Vec<f64>,
    profiled: bool,
    serving: LayerReplicas,
    replicated: LayerReplicas,
    eplb_imbalance: Option<f64>,
    balanced_imbalance: Option<f64>,
}

impl PlanInput<'_> {
    /// Whether global device `d` holds a replica of the dense part. DeepSeek-V4's runs on
    /// the host only (serve refuses it on a GPU: `devices.dense_on_gpu = false`), its
    /// experts on the devices.
    fn holds_dense(&self, d: usize) -> bool {
        let per_node = self.devices_per_node.max(1);
        d % per_node
            < dense_carriers(
                self.model,
                self.dense_on_device,
                self.dense_replicas,
                per_node,
            )
    }
}

/// Makes the plan.
pub fn plan(input: &PlanInput) -> Result<PlanReport, PlanError> {
    let model = input.model;
    let (nodes, per_node) = (input.nodes, input.devices_per_node);
    if nodes == 0 || per_node == 0 {
        return Err(PlanError::NoDevices);
    }
    if !input.max_imbalance.is_finite() || input.max_imbalance < 1.0 {
        return Err(PlanError::BadThreshold);
    }
    let num_experts = model.moe.num_experts;
    let moe_count = model.moe_layers.iter().filter(|&&m| m).count();
    if moe_count == 0 || num_experts == 0 {
        return Err(PlanError::NoExperts);
    }
    let profile_loads = match input.profile {
        Some(p) => p.loads_for(&model.moe_layers, num_experts)?,
        None => vec![None; model.num_layers],
    };
    let placement = serve_layout(input)?;
    let devices = nodes * per_node;
    let global = |r: &crate::placement::Replica| r.node as usize * per_node + r.device as usize;
    let sizes = ModelSizes::of(model);
    let work = sizes::gpu_work_bytes(model, input.max_rows);
    let node_of: Vec<u16> = (0..devices).map(|d| (d / per_node) as u16).collect();
    let dense_on = |d: usize| input.holds_dense(d);
    // Spare slots per device and layer, as far as memory allows.
    let spare: Vec<usize> = (0..devices)
        .map(|d| {
            let Some(memory) = input.device_memory_bytes else {
                return input.redundant_slots;
            };
            let held: u64 = placement
                .experts_on(node_of[d], (d % per_node) as u16)
                .len() as u64
                * sizes.expert_bytes;
            let dense = if dense_on(d) { sizes.dense_bytes } else { 0 };
            let free = usable(memory, input.memory_fraction).saturating_sub(held + dense + work);
            let per_slot = sizes.expert_bytes * moe_count as u64;
            input.redundant_slots.min((free / per_slot.max(1)) as usize)
        })
        .collect();
    // As a live rebalance goes from serve's layout (its capacities: the base share plus
    // the spare slots memory allows on each device). Without spare slots serve refuses to
    // rebalance: a version loads its copies before it releases the ones they replace.
    let migration = if input.redundant_slots > 0 {
        placement.migrate(
            &profile_loads,
            &spare,
            copies_per_version(input.max_move_bytes, sizes.expert_bytes),
        )?
    } else {
        Default::default()
    };
    let served = migration.target().unwrap_or(&placement);
    let mut layer_plans = Vec::with_capacity(moe_count);
    for layer in (0..model.num_layers).filter(|&l| model.moe_layers[l]) {
        let layout = |p: &Placement| LayerReplicas {
            devices_of: (0..num_experts as u32)
                .map(|e| p.replicas(layer, e).iter().map(global).collect())
                .collect(),
        };
        let serving = layout(&placement);
        let (loads, profiled) = match &profile_loads[layer] {
            Some(loads) => (loads.clone(), true),
            None => (vec![1.0; num_experts], false),
        };
        let mut capacity = vec![0usize; devices];
        for copies in &serving.devices_of {
            for &d in copies {
                capacity[d] += 1;
            }
        }
        for (c, s) in capacity.iter_mut().zip(&spare) {
            *c += s;
        }
        let slots = LayerSlots {
            node_of: node_of.clone(),
            capacity,
        };
        let replicated = layout(served);
        // Re-placing every expert is for comparison: where its greedy packing finds no
        // room, the report says so rather than failing.
        let eplb_imbalance = replicate::eplb(&loads, &slots, input.replication)
            .ok()
            .map(|r| r.imbalance(&loads, devices));
        let balanced_imbalance = replicate::balance(&loads, &slots, input.replication)
            .ok()
            .map(|r| r.imbalance(&loads, devices));
        layer_plans.push(LayerPlan {
            layer,
            loads,
            profiled,
            serving,
            replicated,
            eplb_imbalance,
            balanced_imbalance,
        });
    }
    let rebalance = RebalancePlan {
        max_move_bytes: input.max_move_bytes,
        versions: migration.moves.clone(),
        copies_loaded: migration.copies_loaded(),
        copies_released: migration.copies_released(),
        bytes_loaded: migration.copies_loaded() as u64 * sizes.expert_bytes,
    };
    Ok(assemble(input, &sizes, work, &layer_plans, rebalance))
}

/// The layout `serve` starts with for this shape: one node places on its devices with
/// `devices.replication`; a cluster places over its nodes (sorted by name, as the cluster
/// leader does) with `cluster.replication`. Where the device memory is known each device
/// offers the expert slots [`expert_slots`] gives it, as a serving node gossips them.
fn serve_layout(input: &PlanInput) -> Result<Placement, PlacementError> {
    let model = input.model;
    let slots: Vec<usize> = match input.device_memory_bytes {
        Some(memory) => (0..input.devices_per_node)
            .map(|d| {
                expert_slots(
                    model,
                    input.max_rows,
                    input.kv_cache_bytes,
                    usable(memory, input.memory_fraction),
                    input.holds_dense(d),
                )
            })
            .collect(),
        None => Vec::new(),
    };
    let node = |name: String| NodeSlots {
        node: name,
        devices: input.devices_per_node,
        slots: slots.clone(),
    };
    if input.nodes == 1 {
        return Placement::on_one_node(
            &model.moe_layers,
            model.moe.num_experts,
            node(String::new()),
            input.replication,
        );
    }
    let width = (input.nodes - 1).to_string().len();
    let spec = PlacementSpec {
        version: 1,
        replication: input.replication,
        nodes: (0..input.nodes)
            .map(|n| node(format!("node{n:0width$}")))
            .collect(),
    };
    Placement::balanced(&model.moe_layers, model.moe.num_experts, spec)
}

/// Copies `to` holds that `from` does not.
fn moved(from: &LayerReplicas, to: &LayerReplicas) -> usize {
    from.devices_of
        .iter()
        .zip(&to.devices_of)
        .map(|(a, b)| b.iter().filter(|d| !a.contains(d)).count())
        .sum()
}

/// Experts whose `load` is more than twice the median.
fn hot(loads: &[f64]) -> Vec<u32> {
    let mut sorted = loads.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    (0..loads.len() as u32)
        .filter(|&e| loads[e as usize] > 2.0 * median)
        .collect()
}

/// The bytes of a device of `memory` bytes a node may use.
fn usable(memory: u64, fraction: f64) -> u64 {
    (memory as f64 * fraction) as u64
}

/// The report from the layers' plans; `work` is each device's work area (see
/// [`sizes::gpu_work_bytes`]). Problems are listed in the order the steps find them:
/// layer imbalance, KV caches, memory, node failures.
fn assemble(
    input: &PlanInput,
    sizes: &ModelSizes,
    work: u64,
    layers: &[LayerPlan],
    rebalance: RebalancePlan,
) -> PlanReport {
    let model = input.model;
    let per_node = input.devices_per_node;
    let mut problems = Vec::new();
    let mut device_reports = empty_device_reports(input, sizes, work);
    let (placement, layer_reports) =
        report_layers(input, sizes, layers, &mut device_reports, &mut problems);
    size_kv_caches(input, sizes, &mut device_reports, &mut problems);
    check_memory(input, &mut device_reports, &mut problems);
    let profiled = layers.iter().any(|l| l.profiled);
    let failures = node_failures(input, layers, profiled);
    let mut accepted = Vec::new();
    if input.nodes > 1 {
        for f in failures.iter().filter(|f| f.unavailable_experts > 0) {
            let risk = failure_risk(f);
            if input.accept_unavailable_on_failure {
                accepted.push(risk);
            } else {
                problems.push(format!(
                    "{risk} (accept it with --accept-unavailable-on-failure or \
                     cluster.accept_unavailable_on_failure = true, or add copies: replication)"
                ));
            }
        }
    }
    PlanReport {
        model: ModelSummary {
            model_type: model.model_type.clone(),
            layers: model.num_layers,
            moe_layers: layers.len(),
            experts: model.moe.num_experts,
            top_k: model.moe.top_k,
            sizes: *sizes,
            profiled,
        },
        cluster: ClusterShape {
            nodes: input.nodes,
            devices_per_node: per_node,
            replication: input.replication,
            redundant_slots: input.redundant_slots,
            max_move_bytes: input.max_move_bytes,
            device_memory_bytes: input.device_memory_bytes,
            memory_fraction: input.memory_fraction,
        },
        devices: device_reports,
        placement,
        layers: layer_reports,
        failures,
        rebalance,
        verdict: Verdict {
            ok: problems.is_empty(),
            problems,
            accepted,
        },
    }
}

/// Each device's report before the layers are counted: its dense part and work area.
fn empty_device_reports(input: &PlanInput, sizes: &ModelSizes, work: u64) -> Vec<DeviceReport> {
    let per_node = input.devices_per_node;
    let devices = input.nodes * per_node;
    (0..devices)
        .map(|d| DeviceReport {
            node: d / per_node,
            device: d % per_node,
            experts: BTreeMap::new(),
            redundant_experts: 0,
            expert_bytes: 0,
            dense_bytes: if input.holds_dense(d) {
                sizes.dense_bytes
            } else {
                0
            },
            work_bytes: work,
            kv_cache_bytes: None,
            kv_positions: None,
            fits: true,
        })
        .collect()
}

/// Each layer's copies of each expert by global device index, as [`PlanReport::placement`].
type CopiesByLayer = BTreeMap<String, Vec<Vec<usize>>>;

/// Counts each layer's copies into the device reports and reports the layer: the placement
/// map and the layer reports, by layer index.
fn report_layers(
    input: &PlanInput,
    sizes: &ModelSizes,
    layers: &[LayerPlan],
    device_reports: &mut [DeviceReport],
    problems: &mut Vec<String>,
) -> (CopiesByLayer, BTreeMap<String, LayerReport>) {
    let devices = input.nodes * input.devices_per_node;
    let mut placement = BTreeMap::new();
    let mut layer_reports = BTreeMap::new();
    for plan in layers {
        let mut held = vec![0usize; devices];
        for (expert, copies) in plan.replicated.devices_of.iter().enumerate() {
            for &d in copies {
                held[d] += 1;
                if !plan.serving.devices_of[expert].contains(&d) {
                    device_reports[d].redundant_experts += 1;
                }
            }
        }
        for (report, count) in device_reports.iter_mut().zip(held) {
            report.experts.insert(plan.layer.to_string(), count);
            report.expert_bytes += count as u64 * sizes.expert_bytes;
        }
        let per_copy: Vec<f64> = plan
            .loads
            .iter()
            .zip(&plan.replicated.devices_of)
            .map(|(load, copies)| load / copies.len().max(1) as f64)
            .collect();
        let imbalance = plan.replicated.imbalance(&plan.loads, devices);
        if plan.profiled && imbalance > input.max_imbalance {
            problems.push(format!(
                "layer {}: imbalance {imbalance:.2} is above {:.2}",
                plan.layer, input.max_imbalance
            ));
        }
        layer_reports.insert(
            plan.layer.to_string(),
            LayerReport {
                imbalance,
                imbalance_unreplicated: plan.serving.imbalance(&plan.loads, devices),
                imbalance_eplb: plan.eplb_imbalance,
                imbalance_balanced: plan.balanced_imbalance,
                hot_experts: hot(&plan.loads),
                hot_experts_after: {
                    let mut sorted = plan.loads.clone();
                    sorted.sort_by(f64::total_cmp);
                    let median = sorted[sorted.len() / 2];
                    (0..per_copy.len() as u32)
                        .filter(|&e| per_copy[e as usize] > 2.0 * median)
                        .collect()
                },
                copies_added: plan
                    .replicated
                    .copies()
                    .saturating_sub(plan.serving.copies()),
                copies_loaded: moved(&plan.serving, &plan.replicated),
                copies_released: moved(&plan.replicated, &plan.serving),
            },
        );
        placement.insert(plan.layer.to_string(), plan.replicated.devices_of.clone());
    }
    (placement, layer_reports)
}

/// The KV cache budget and positions of each device holding the dense part, and a problem
/// where it holds less than one prompt.
fn size_kv_caches(
    input: &PlanInput,
    sizes: &ModelSizes,
    device_reports: &mut [DeviceReport],
    problems: &mut Vec<String>,
) {
    for d in device_reports.iter_mut().filter(|d| d.dense_bytes > 0) {
        let held = d.expert_bytes + d.dense_bytes + d.work_bytes;
        d.kv_cache_bytes = input.kv_cache_bytes.or_else(|| {
            // As serve sizes it from the GPU's free memory after loading.
            let free = input.device_memory_bytes?.saturating_sub(held);
            Some(KvBudget::gpu_share(free))
        });
        d.kv_positions = d.kv_cache_bytes.map(|bytes| {
            // The dense part and its caches are on this device: a GPU's (bf16) caches.
            let per_position = sizes.gpu_kv_bytes_per_position as usize;
            KvBudget::of_bytes(bytes as usize, per_position)
                .with_state(sizes.state_bytes_per_sequence as usize, per_position)
                .max_positions() as u64
        });
        if let Some(positions) = d.kv_positions
            && positions < input.max_prompt_tokens as u64
        {
            problems.push(format!(
                "node {} device {}: the KV cache ({:.2} GiB) holds {positions} positions, \
                 fewer than one prompt of batching.max_prompt_tokens ({})",
                d.node,
                d.device,
                gib(d.kv_cache_bytes.unwrap_or(0)),
                input.max_prompt_tokens
            ));
        }
    }
}

/// Whether each device's weights, work area and configured KV cache fit in the memory a
/// node may use, where the device memory is known; a problem for each that does not.
fn check_memory(
    input: &PlanInput,
    device_reports: &mut [DeviceReport],
    problems: &mut Vec<String>,
) {
    if let Some(memory) = input.device_memory_bytes {
        let usable = usable(memory, input.memory_fraction);
        for d in device_reports.iter_mut() {
            // A KV budget set in the config is memory the node takes besides the rest.
            let kv = input.kv_cache_bytes.and(d.kv_cache_bytes).unwrap_or(0);
            d.fits = d.expert_bytes + d.dense_bytes + d.work_bytes + kv <= usable;
            if !d.fits {
                let kv = match kv {
                    0 => String::new(),
                    kv => format!(", {:.1} GiB of KV cache (batching.kv_cache_mib)", gib(kv)),
                };
                problems.push(format!(
                    "node {} device {}: {:.1} GiB of weights and {:.1} GiB of work area{kv} do \
                     not fit in {:.1} GiB ({:.0}% of {:.1} GiB, devices.gpu_memory_fraction)",
                    d.node,
                    d.device,
                    gib(d.expert_bytes + d.dense_bytes),
                    gib(d.work_bytes),
                    gib(usable),
                    100.0 * input.memory_fraction,
                    gib(memory)
                ));
            }
        }
    }
}

/// What each node's failure costs; the token shares only when some layer is `profiled`.
fn node_failures(input: &PlanInput, layers: &[LayerPlan], profiled: bool) -> Vec<FailureReport> {
    let per_node = input.devices_per_node;
    let total_load: f64 = layers
        .iter()
        .filter(|l| l.profiled)
        .flat_map(|l| &l.loads)
        .sum();
    (0..input.nodes)
        .map(|node| {
            let on_node = |d: &usize| d / per_node == node;
            let (mut losing, mut affected, mut moved) = (0, 0.0, 0.0);
            let mut unavailable = Vec::new();
            for plan in layers {
                for (expert, copies) in plan.replicated.devices_of.iter().enumerate() {
                    let here = copies.iter().filter(|d| on_node(d)).count();
                    if here == 0 {
                        continue;
                    }
                    losing += 1;
                    let load = if plan.profiled {
                        plan.loads[expert]
                    } else {
                        0.0
                    };
                    moved += load * here as f64 / copies.len() as f64;
                    if here == copies.len() {
                        unavailable.push([plan.layer, expert]);
                        affected += load;
                    }
                }
            }
            let share = |x: f64| {
                profiled.then(|| {
                    if total_load > 0.0 {
                        x / total_load
                    } else {
                        0.0
                    }
                })
            };
            FailureReport {
                node,
                experts_losing_a_replica: losing,
                unavailable_experts: unavailable.len(),
                unavailable,
                on_expert_unavailable: input.on_unavailable,
                token_share_affected: share(affected),
                token_share_moved: share(moved),
            }
        })
        .collect()
}

/// What `f`'s node failing does to the experts it alone holds: how many, which (the first
/// few), what share of routed tokens under the profile, and what requests then get.
fn failure_risk(f: &FailureReport) -> String {
    let shown: Vec<String> = f
        .unavailable
        .iter()
        .take(4)
        .map(|[layer, expert]| format!("layer {layer} expert {expert}"))
        .collect();
    let more = f.unavailable.len().saturating_sub(shown.len());
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    let share = f.token_share_affected.map_or_else(
        || "no profile: share of tokens unknown".to_string(),
        |s| format!("{:.2}% of routed tokens under the profile", 100.0 * s),
    );
    let then = match f.on_expert_unavailable {
        OnUnavailable::Fail => "requests needing them fail (503)",
        OnUnavailable::Wait => "requests needing them wait for new copies, then fail",
        OnUnavailable::Reroute => "their tokens go to the next-best experts (degraded output)",
    };
    format!(
        "node {} failing leaves {} (layer, expert) pairs without a copy ({}{more}; {share}): \
         {then}",
        f.node,
        f.unavailable_experts,
        shown.join(", ")
    )
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}
