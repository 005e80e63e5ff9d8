//! Experts computed in this process on the CPU: the executor of `moe-node generate`, the
//! reference tests and the benchmarks, and the grouped run every CPU device slot uses.

use rayon::prelude::*;

use super::{ExpertError, ExpertExecutor};
use crate::model::ExpertWeights;
use crate::moe::DispatchPlan;

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
