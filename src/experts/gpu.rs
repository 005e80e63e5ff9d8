//! Loading a model's experts onto a GPU, and the GPU as the expert executor of an engine in
//! this process (`moe-node generate --backend cuda`, the reference tests on every backend;
//! the engine itself is built in `engine::gpu`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::compute::cuda::experts::{ExpertShape, RunOutcome};
use crate::compute::cuda::storage::ExpertStorage;
use crate::compute::cuda::{CudaError, GpuExperts, GpuInfo};
use crate::experts::{DeviceRows, ExpertError, ExpertExecutor};
use crate::model::weights::{dummy_expert, load_expert};
use crate::model::{Checkpoint, ExpertWeights, ModelConfig, ModelError};
use crate::moe::DispatchPlan;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

/// What a GPU needs besides its experts.
#[derive(Debug, Clone)]
pub struct GpuOptions {
    /// Grouped rows one call may bring: tokens per step × top-k.
    pub max_rows: usize,
    pub memory_fraction: f64,
    /// Where compiled kernels are kept between starts.
    pub kernel_cache: Option<PathBuf>,
}

/// Loads `experts` onto a GPU: checks they fit, uploads them in their stored form (bf16, or
/// FP8 or INT4 as the checkpoint quantizes them; [`ExpertStorage::of`] says when a form is
/// widened to bf16 instead), or makes a dummy checkpoint's on the device, then checks that
/// the GPU computes the first of them as the CPU does before the device takes work. The
/// first expert's activation and biases are the device's ([`ExpertShape`]).
pub fn load_experts(
    gpu: &GpuInfo,
    options: &GpuOptions,
    checkpoint: &Checkpoint,
    config: &ModelConfig,
    experts: &[(usize, u32)],
) -> Result<GpuExperts, LoadError> {
    let (h, i) = (config.hidden_size, config.moe.expert_intermediate_size);
    // The first expert's form is the device's: a checkpoint stores its experts alike. One
    // that does not (other blocks, scales of another width) sets a form holding both, and
    // the load starts again.
    let first = match experts.first() {
        Some(&(layer, expert)) => Some((
            layer,
            expert,
            load_expert(checkpoint, config, layer, expert as usize)?,
        )),
        None => None,
    };
    let mut storage = match &first {
        Some((_, _, weights)) => {
            let (storage, widened) = ExpertStorage::of(weights, h, i);
            if let Some(reason) = widened {
                tracing::warn!(gpu = gpu.ordinal, %reason, "quantized experts widened to bf16 on the GPU");
            }
            storage
        }
        None => ExpertStorage::Bf16,
    };
    // The first expert's activation is the device's too (a model's experts share theirs).
    let activation = match &first {
        Some((layer, expert, weights)) => {
            ExpertStorage::activation_of(weights).map_err(|reason| {
                CudaError::Unsupported(format!(
                    "{} experts (expert {expert} of layer {layer}): {reason}; run them on CPU \
                 slots (devices.backend = \"cpu\")",
                    config.model_type
                ))
            })?
        }
        None => Default::default(),
    };
    let mut held = loop {
        let shape = ExpertShape {
            hidden: h,
            intermediate: i,
            num_experts: config.moe.num_experts,
            max_rows: options.max_rows,
            host_io: true,
            storage,
            activation,
            biases: first
                .as_ref()
                .is_some_and(|(_, _, w)| ExpertStorage::biases_of(w).is_some()),
        };
        let mut held = GpuExperts::new(
            gpu,
            shape,
            experts,
            options.memory_fraction,
            options.kernel_cache.as_deref(),
        )?;
        match upload_all(&mut held, checkpoint, config, experts, first.as_ref())? {
            None => break held,
            Some(unheld) => {
                tracing::warn!(
                    gpu = gpu.ordinal,
                    layer = unheld.layer,
                    expert = unheld.expert,
                    was = %storage.describe(),
                    now = %unheld.form.describe(),
                    "an expert is stored unlike the first: loading the GPU's experts again"
                );
                storage = unheld.form;
            }
        }
    };
    tracing::info!(
        gpu = gpu.ordinal,
        experts = experts.len(),
        form = %storage.describe(),
        mib = held.weight_bytes() >> 20,
        "experts held on the GPU as stored"
    );
    // For dummy weights this also checks that the device made values whose products agree
    // with the host's (within the bf16 tolerance; tests/gpu_kernels.rs checks the bits).
    if let Some((layer, expert, weights)) = first {
        self_check(&mut held, layer, expert, &weights)?;
    }
    Ok(held)
}

/// An expert the device's form cannot hold, and a form that holds it and the others.
struct Unheld {
    layer: usize,
    expert: u32,
    form: ExpertStorage,
}

/// Writes `experts` into `held` (the first already loaded as `first`); stops at the first
/// expert the device's form cannot hold.
fn upload_all(
    held: &mut GpuExperts,
    checkpoint: &Checkpoint,
    config: &ModelConfig,
    experts: &[(usize, u32)],
    first: Option<&(usize, u32, ExpertWeights)>,
) -> Result<Option<Unheld>, LoadError> {
    let (h, i, storage) = (
        held.shape.hidden,
        held.shape.intermediate,
        held.shape.storage,
    );
    for &(layer, expert) in experts {
        crate::progress::layer(layer, config.num_layers);
        // Dummy weights are made on the device (the values the host would make and upload):
        // a published shape's layer loads in milliseconds instead of a minute.
        if let Some(fills) = dummy_expert(checkpoint, config, layer, expert as usize) {
            held.fill_dummy(layer, expert, &fills)?;
            continue;
        }
        let loaded;
        let weights = match first {
            Some((l, e, weights)) if (*l, *e) == (layer, expert) => weights,
            _ => {
                loaded = load_expert(checkpoint, config, layer, expert as usize)?;
                &loaded
            }
        };
        let needed = storage.with(ExpertStorage::of(weights, h, i).0);
        if needed != storage {
            return Ok(Some(Unheld {
                layer,
                expert,
                form: needed,
            }));
        }
        held.upload(layer, expert, weights)?;
    }
    Ok(None)
}

/// Largest difference allowed between the GPU's expert output and the CPU's, relative to the
/// largest CPU output: the GPU rounds inputs, gate|up and the activation to bf16.
pub const BF16_TOLERANCE: f32 = 0.03;

/// Runs a few fixed rows through one expert on the GPU and on the CPU and compares.
fn self_check(
    held: &mut GpuExperts,
    layer: usize,
    expert: u32,
    weights: &ExpertWeights,
) -> Result<(), CudaError> {
    let h = held.shape.hidden;
    let rows = 4;
    let input: Vec<f32> = (0..rows * h)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.5)
        .collect();
    let expected = weights.forward_with(&input, rows, false);
    let got = match held.run(layer, &[(expert, &input)])? {
        RunOutcome::Done(mut outputs) => outputs.remove(0),
        RunOutcome::NotHeld(e) => {
            return Err(CudaError::SelfCheck {
                gpu: held.gpu.ordinal,
                reason: format!("expert {e} was uploaded but is not found"),
            });
        }
    };
    let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let worst = expected
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        // NaN sticks: f32::max would drop it.
        .fold(0f32, |m, d| if d.is_nan() || d > m { d } else { m });
    if worst.is_nan() || worst > BF16_TOLERANCE * scale {
        return Err(CudaError::SelfCheck {
            gpu: held.gpu.ordinal,
            reason: format!(
                "expert {expert} of layer {layer} differs from the CPU by {worst:.3e} \
                 (largest output {scale:.3e}, tolerance {BF16_TOLERANCE})"
            ),
        });
    }
    tracing::info!(
        gpu = held.gpu.ordinal,
        relative_difference = worst / scale,
        "GPU self-check passed"
    );
    Ok(())
}

/// Every routed expert of a model on one GPU, behind a lock (one stream, one caller at a
/// time).
pub struct GpuLocalExperts {
    gpu: Mutex<GpuExperts>,
    hidden_size: usize,
}

impl GpuLocalExperts {
    pub fn load(
        gpu: &GpuInfo,
        options: &GpuOptions,
        checkpoint: &Checkpoint,
        config: &ModelConfig,
    ) -> Result<Self, LoadError> {
        let experts: Vec<(usize, u32)> = (0..config.num_layers)
            .filter(|&l| config.moe_layers[l])
            .flat_map(|l| (0..config.moe.num_experts as u32).map(move |e| (l, e)))
            .collect();
        Ok(GpuLocalExperts {
            gpu: Mutex::new(load_experts(gpu, options, checkpoint, config, &experts)?),
            hidden_size: config.hidden_size,
        })
    }
}

impl ExpertExecutor for GpuLocalExperts {
    fn run(
        &self,
        layer: usize,
        plan: &DispatchPlan,
        grouped_input: &[f32],
    ) -> Result<Vec<f32>, ExpertError> {
        let groups: Vec<(u32, &[f32])> = plan.groups(grouped_input, self.hidden_size).collect();
        let mut gpu = self.gpu.lock().unwrap_or_else(|e| e.into_inner());
        match gpu.run(layer, &groups) {
            Ok(RunOutcome::Done(outputs)) => Ok(outputs.concat()),
            Ok(RunOutcome::NotHeld(expert)) => Err(ExpertError::NotHeld { layer, expert }),
            Err(e) => Err(ExpertError::DeviceFailed {
                gpu: gpu.gpu.ordinal,
                error: Arc::new(e),
            }),
        }
    }

    fn run_on_device(
        &self,
        layer: usize,
        experts: &[u32],
        group_rows: &[usize],
        rows: &DeviceRows<'_>,
    ) -> Option<Result<(), ExpertError>> {
        let mut gpu = self.gpu.lock().unwrap_or_else(|e| e.into_inner());
        let outcome = gpu.run_resident(
            layer,
            experts,
            group_rows,
            rows.gpu,
            rows.input,
            rows.output,
        );
        Some(match outcome {
            Ok(RunOutcome::Done(_)) => Ok(()),
            Ok(RunOutcome::NotHeld(expert)) => Err(ExpertError::NotHeld { layer, expert }),
            Err(e) => Err(ExpertError::DeviceFailed {
                gpu: gpu.gpu.ordinal,
                error: Arc::new(e),
            }),
        })
    }
}
