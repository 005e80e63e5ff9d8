//! `moe-node plan` and `moe-node profile` (part of the binary): read the files, call
//! [`moe_node::plan`], print.

use std::path::Path;

use anyhow::Context;
use moe_node::config::{ConfigSources, NodeConfig, mib_to_bytes};
use moe_node::model::ModelConfig;
use moe_node::placement::Profile;
use moe_node::plan::{PlanError, PlanInput, plan};

use super::{PlanArgs, node_env};

/// Prints the report; `Ok(false)` when the verdict is "not ready".
pub fn run(args: &PlanArgs) -> anyhow::Result<bool> {
    let config = NodeConfig::load(ConfigSources {
        file: args.config.as_deref(),
        env: node_env(),
        overrides: Vec::new(),
    })?;
    let model = ModelConfig::load(&args.model).map_err(PlanError::from)?;
    let profile = args
        .profile
        .as_deref()
        .map(Profile::read)
        .transpose()
        .map_err(PlanError::from)?;
    let device_memory_bytes = match args.device_memory_gib {
        None => None,
        Some(g) if g.is_finite() && g > 0.0 && g < 1e6 => Some((g * (1u64 << 30) as f64) as u64),
        Some(g) => {
            return Err(PlanError::BadMemory(g).into());
        }
    };
    let replication = args.replication.unwrap_or(if args.nodes > 1 {
        config.cluster.replication
    } else {
        config.devices.replication
    });
    let report = plan(&PlanInput {
        model: &model,
        nodes: args.nodes,
        devices_per_node: args.devices_per_node,
        replication,
        redundant_slots: args
            .redundant_slots
            .unwrap_or(config.placement.redundant_slots_per_device),
        max_move_bytes: match args.max_move_mib {
            Some(mib) if mib.is_finite() && mib >= 0.0 => mib_to_bytes(mib),
            Some(mib) => return Err(PlanError::BadMoveBudget(mib).into()),
            None => config.placement.max_move_bytes(),
        },
        profile: profile.as_ref(),
        device_memory_bytes,
        memory_fraction: config.devices.gpu_memory_fraction,
        max_rows: config.batching.max_tokens_per_step * model.moe.top_k,
        dense_on_device: config.devices.dense_on_gpu,
        dense_replicas: args.dense_replicas.unwrap_or(config.devices.dense_replicas),
        kv_cache_bytes: (config.batching.kv_cache_mib > 0)
            .then_some((config.batching.kv_cache_mib as u64) << 20),
        max_prompt_tokens: config.batching.max_prompt_tokens,
        on_unavailable: config.cluster.on_expert_unavailable,
        max_imbalance: args.max_imbalance,
        accept_unavailable_on_failure: args.accept_unavailable_on_failure
            || config.cluster.accept_unavailable_on_failure,
    })
    .with_context(|| format!("planning {}", args.model.display()))?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.to_text());
    }
    Ok(report.verdict.ok)
}

/// Fetches a node's profile and writes it to `out`.
pub fn save_profile(
    url: &str,
    out: &Path,
    since_start: bool,
    api_key: Option<&str>,
) -> anyhow::Result<()> {
    let window = if since_start { "all" } else { "recent" };
    let address = format!(
        "{}/admin/experts?format=profile&window={window}",
        url.trim_end_matches('/')
    );
    let client = reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .build()?;
    let mut request = client.get(&address);
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let response = request
        .send()
        .with_context(|| format!("fetching {address}"))?;
    let status = response.status();
    let body = response
        .text()
        .with_context(|| format!("reading {address}"))?;
    if !status.is_success() {
        anyhow::bail!("{address} answered {status}: {body}");
    }
    let profile: Profile = serde_json::from_str(&body)
        .with_context(|| format!("{address} did not answer with a profile"))?;
    let text = serde_json::to_string(&profile)?;
    std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
    println!(
        "{}: {} layers{}",
        out.display(),
        profile.layers.len(),
        profile
            .window_seconds
            .map(|w| format!(" over {w:.0} s"))
            .unwrap_or_default()
    );
    Ok(())
}
