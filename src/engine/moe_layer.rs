//! One MoE block of the forward pass: gate, route, group rows per expert, hand the groups to
//! the expert data plane, combine with the gate weights, add the shared expert.

use crate::compute::cpu::add_in_place;
use crate::experts::{ExpertError, ExpertExecutor};
use crate::model::config::MoeConfig;
use crate::model::weights::MoeWeights;
use crate::moe::{DispatchPlan, route, route_avoiding};

/// One MoE block over `rows` normalised hidden rows: gate, route, group rows per expert, run
/// them through `experts`, combine with the gate weights and add the shared expert.
pub fn moe_forward(
    cfg: &MoeConfig,
    weights: &MoeWeights,
    experts: &dyn ExpertExecutor,
    layer: usize,
    normed: &[f32],
    rows: usize,
    rerouted: &mut [bool],
) -> Result<Vec<f32>, ExpertError> {
    let mut out = moe_routed(cfg, weights, experts, layer, normed, rows, rerouted)?;
    if let Some(shared) = &weights.shared_expert {
        let mut shared_out = shared.forward_with(normed, rows, true);
        if let Some(gate) = &weights.shared_expert_gate {
            // Qwen3-Next: each row's shared output times the sigmoid of its one-value gate.
            let width = gate.len().max(1);
            for (row, x) in shared_out
                .chunks_exact_mut(width)
                .zip(normed.chunks_exact(width))
            {
                let logit: f32 = x.iter().zip(gate).map(|(x, g)| x * g).sum();
                let scale = 1.0 / (1.0 + (-logit).exp());
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        add_in_place(&mut out, &shared_out);
    }
    Ok(out)
}

/// The routed part of [`moe_forward`]: the gate's weighted sum of the chosen experts'
/// outputs, without the shared expert (which a GPU engine computes on its GPU). Rows
/// routed around an expert with no live replica are marked in `rerouted` (as far as it
/// reaches): their output is not what the model computes.
pub fn moe_routed(
    cfg: &MoeConfig,
    weights: &MoeWeights,
    experts: &dyn ExpertExecutor,
    layer: usize,
    normed: &[f32],
    rows: usize,
    rerouted: &mut [bool],
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
            let choices = routing
                .experts
                .iter()
                .filter(|&&e| avoid[e as usize])
                .count();
            experts.rerouted(layer, choices);
            let k = cfg.top_k.max(1);
            for (row, chosen) in routing.experts.chunks(k).enumerate() {
                if chosen.iter().any(|&e| avoid[e as usize])
                    && let Some(mark) = rerouted.get_mut(row)
                {
                    *mark = true;
                }
            }
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
    let mut plan = DispatchPlan::new(&routing, cfg.num_experts);
    let mut grouped = plan.gather(normed, width);
    if cfg.weight_input {
        // Llama 4 scales each expert's input by the gate weight and sums the outputs as
        // they come (the expert is not linear: the two differ).
        for (row, w) in grouped
            .chunks_exact_mut(width.max(1))
            .zip(&mut plan.weights)
        {
            row.iter_mut().for_each(|x| *x *= *w);
            *w = 1.0;
        }
    }
    let expert_out = experts.run(layer, &plan, &grouped)?;
    let mut out = vec![0.0; rows * width];
    plan.combine(&expert_out, width, &mut out);
    Ok(out)
}
