//! The mixture-of-experts layer: gating, the dispatch plan, and the seam where grouped
//! tokens are handed to whoever holds the experts.

pub mod dispatch;
pub mod gating;

use rayon::prelude::*;

use crate::compute::cpu::add_in_place;
use crate::model::config::MoeConfig;
use crate::model::weights::{ExpertWeights, MoeWeights};
pub use dispatch::DispatchPlan;
pub use gating::{Routing, route, route_avoiding};

/// Why expert work could not be done.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ExpertError {
    #[error("expert {expert} of layer {layer} is not held by this executor")]
    NotHeld { layer: usize, expert: u32 },
    #[error("expert executor unavailable: {0}")]
    Unavailable(String),
    /// The device failed while computing and took itself out of service; its groups can go
    /// to replicas.
    #[error("device failed: {0}")]
    DeviceFailed(String),
}

/// Runs grouped token rows through the experts of one layer. The engine calls this once per
/// MoE layer per step; an implementation may compute locally, hand groups to device actors,
/// or send them to other nodes.
pub trait ExpertExecutor: Send + Sync {
    /// `grouped_input` holds `plan.len()` rows of `hidden_size`, grouped as `plan` says.
    /// Returns the expert outputs in the same order (not yet weighted).
    fn run(
        &self,
        layer: usize,
        plan: &DispatchPlan,
        grouped_input: &[f32],
    ) -> Result<Vec<f32>, ExpertError>;

    /// Experts of `layer` that tokens should be routed around (no live replica), when the
    /// executor reroutes instead of failing; `None` when it does not.
    fn avoid(&self, _layer: usize) -> Option<Vec<bool>> {
        None
    }

    /// Told how many token-to-expert choices of `layer` went to another expert because of
    /// [`ExpertExecutor::avoid`].
    fn rerouted(&self, _layer: usize, _choices: usize) {}
}

/// One MoE block over `rows` normalised hidden rows: gate, route, group rows per expert, run
/// them through `experts`, combine with the gate weights and add the shared expert.
pub fn moe_forward(
    cfg: &MoeConfig,
    weights: &MoeWeights,
    experts: &dyn ExpertExecutor,
    layer: usize,
    normed: &[f32],
    rows: usize,
) -> Result<Vec<f32>, ExpertError> {
    let mut out = moe_routed(cfg, weights, experts, layer, normed, rows)?;
    if let Some(shared) = &weights.shared_expert {
        add_in_place(&mut out, &shared.forward_with(normed, rows, true));
    }
    Ok(out)
}

/// The routed part of [`moe_forward`]: the gate's weighted sum of the chosen experts'
/// outputs, without the shared expert (which a GPU engine computes on its GPU).
pub fn moe_routed(
    cfg: &MoeConfig,
    weights: &MoeWeights,
    experts: &dyn ExpertExecutor,
    layer: usize,
    normed: &[f32],
    rows: usize,
) -> Result<Vec<f32>, ExpertError> {
    let width = normed.len() / rows.max(1);
    let logits = weights.router.forward(normed, rows);
    let bias = weights.correction_bias.as_deref();
    let routing = route(&cfg.gating, &logits, cfg.num_experts, cfg.top_k, bias);
    let avoid = experts.avoid(layer);
    let routing = match avoid.as_deref() {
        Some(avoid)
            if avoid.len() == cfg.num_experts
                && routing.experts.iter().any(|&e| avoid[e as usize]) =>
        {
            let rerouted = routing
                .experts
                .iter()
                .filter(|&&e| avoid[e as usize])
                .count();
            experts.rerouted(layer, rerouted);
            route_avoiding(
                &cfg.gating,
                &logits,
                cfg.num_experts,
                cfg.top_k,
                bias,
                Some(avoid),
            )
        }
        _ => routing,
    };
    let plan = DispatchPlan::new(&routing, cfg.num_experts);
    let expert_out = experts.run(layer, &plan, &plan.gather(normed, width))?;
    let mut out = vec![0.0; rows * width];
    plan.combine(&expert_out, width, &mut out);
    Ok(out)
}

/// Runs each `(expert, rows)` group through its expert and returns the outputs in group
/// order: spread over the rayon pool, or all on the calling thread when `on_pool` is false
/// (a CPU device slot is one thread of its own).
pub fn run_expert_groups(
    groups: &[(&ExpertWeights, &[f32])],
    width: usize,
    on_pool: bool,
) -> Vec<Vec<f32>> {
    let run = |(expert, input): &(&ExpertWeights, &[f32]), parallel: bool| {
        expert.forward_with(input, input.len() / width, parallel)
    };
    if !on_pool {
        return groups.iter().map(|g| run(g, false)).collect();
    }
    // Spread experts over the pool; when there are fewer experts than threads, let each
    // product spread over the pool instead.
    let nested_parallel = groups.len() < rayon::current_num_threads();
    groups.par_iter().map(|g| run(g, nested_parallel)).collect()
}

/// Every expert of every layer in this process's memory, computed on the CPU.
pub struct LocalExperts {
    /// `layers[l][e]`; empty for dense layers.
    layers: Vec<Vec<ExpertWeights>>,
    hidden_size: usize,
}

impl LocalExperts {
    pub fn new(layers: Vec<Vec<ExpertWeights>>, hidden_size: usize) -> Self {
        LocalExperts {
            layers,
            hidden_size,
        }
    }

    pub fn expert(&self, layer: usize, expert: u32) -> Option<&ExpertWeights> {
        self.layers.get(layer)?.get(expert as usize)
    }
}

impl ExpertExecutor for LocalExperts {
    fn run(
        &self,
        layer: usize,
        plan: &DispatchPlan,
        grouped_input: &[f32],
    ) -> Result<Vec<f32>, ExpertError> {
        let width = self.hidden_size;
        let groups = plan
            .groups(grouped_input, width)
            .map(|(e, input)| {
                let weights = self
                    .expert(layer, e)
                    .ok_or(ExpertError::NotHeld { layer, expert: e })?;
                Ok((weights, input))
            })
            .collect::<Result<Vec<_>, ExpertError>>()?;
        let outputs = run_expert_groups(&groups, width, true);
        Ok(outputs.concat())
    }
}
