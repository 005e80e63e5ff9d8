//! The plan as a person reads it: the text `moe-node plan` prints without `--json`.

use std::fmt::Write;

use super::{PlanReport, gib};
use crate::config::OnUnavailable;

impl PlanReport {
    /// A readable report for a deployment review.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = self.write_text(&mut out);
        out
    }

    fn write_text(&self, out: &mut String) -> std::fmt::Result {
        self.write_summary(out)?;
        self.write_devices(out)?;
        self.write_failures(out)?;
        self.write_layers(out)?;
        self.write_verdict(out)
    }

    /// The model, its sizes, the cluster shape and whether a profile was given.
    fn write_summary(&self, out: &mut String) -> std::fmt::Result {
        let m = &self.model;
        let c = &self.cluster;
        writeln!(
            out,
            "model: {}, {} layers ({} MoE), {} experts per layer, {} active per token",
            m.model_type, m.layers, m.moe_layers, m.experts, m.top_k
        )?;
        writeln!(
            out,
            "sizes: one expert {:.2} MiB, all experts of a layer {:.2} GiB, dense part {:.2} GiB ({} bytes per parameter), KV cache {:.1} KiB per position ({:.1} KiB on a GPU)",
            m.sizes.expert_bytes as f64 / (1u64 << 20) as f64,
            gib(m.sizes.expert_bytes * m.experts as u64),
            gib(m.sizes.dense_bytes),
            m.sizes.dtype_bytes,
            m.sizes.kv_bytes_per_position as f64 / 1024.0,
            m.sizes.gpu_kv_bytes_per_position as f64 / 1024.0
        )?;
        if m.sizes.indexer_bytes_per_position > 0 {
            writeln!(
                out,
                "lightning indexer keys (DeepSeek Sparse Attention): {:.1} KiB of each position's KV cache",
                m.sizes.indexer_bytes_per_position as f64 / 1024.0
            )?;
        }
        if m.sizes.state_bytes_per_sequence > 0 {
            // A hybrid model's linear-attention states, or DeepSeek-V4's sliding windows and
            // unfinished compressed blocks.
            writeln!(
                out,
                "per-sequence cache: {:.1} MiB per sequence, whatever its length",
                m.sizes.state_bytes_per_sequence as f64 / (1u64 << 20) as f64
            )?;
        }
        writeln!(
            out,
            "cluster: {} node(s) x {} device(s), replication {}, {} spare slot(s) per device{}",
            c.nodes,
            c.devices_per_node,
            c.replication,
            c.redundant_slots,
            match c.device_memory_bytes {
                Some(b) => format!(
                    ", {:.1} GiB per device ({:.0}% usable: devices.gpu_memory_fraction)",
                    gib(b),
                    100.0 * c.memory_fraction
                ),
                None => String::new(),
            }
        )?;
        writeln!(
            out,
            "profile: {}",
            if m.profiled {
                "loads from the profile given"
            } else {
                "none (every expert counted as equally loaded; give --profile for imbalance and hot experts)"
            }
        )?;
        Ok(())
    }

    /// A row per device: what it holds and whether it fits.
    fn write_devices(&self, out: &mut String) -> std::fmt::Result {
        writeln!(
            out,
            "\nDevices (experts held per MoE layer, min-max over layers)"
        )?;
        writeln!(
            out,
            "  {:>4} {:>6} {:>9} {:>10} {:>11} {:>10} {:>9} {:>7} {:>12} {:>5}",
            "node",
            "device",
            "experts",
            "hot copies",
            "expert GiB",
            "dense GiB",
            "work GiB",
            "KV GiB",
            "KV positions",
            "fits"
        )?;
        for d in &self.devices {
            let min = d.experts.values().min().copied().unwrap_or(0);
            let max = d.experts.values().max().copied().unwrap_or(0);
            let held = if min == max {
                min.to_string()
            } else {
                format!("{min}-{max}")
            };
            let or_dash = |x: Option<String>| x.unwrap_or_else(|| "-".into());
            writeln!(
                out,
                "  {:>4} {:>6} {:>9} {:>10} {:>11.2} {:>10.2} {:>9.2} {:>7} {:>12} {:>5}",
                d.node,
                d.device,
                held,
                d.redundant_experts,
                gib(d.expert_bytes),
                gib(d.dense_bytes),
                gib(d.work_bytes),
                or_dash(d.kv_cache_bytes.map(|b| format!("{:.2}", gib(b)))),
                or_dash(d.kv_positions.map(|p| p.to_string())),
                if d.fits { "yes" } else { "NO" }
            )?;
        }
        Ok(())
    }

    /// A row per node: what its failure costs and what happens then.
    fn write_failures(&self, out: &mut String) -> std::fmt::Result {
        writeln!(out, "\nNode failures ((layer, expert) pairs)")?;
        writeln!(
            out,
            "  {:>4} {:>17} {:>12} {:>15} {:>12}  then",
            "node", "losing a replica", "left with none", "tokens affected", "tokens moved"
        )?;
        for f in &self.failures {
            let share = |s: Option<f64>| match s {
                Some(s) => format!("{:.2}%", 100.0 * s),
                None => "-".into(),
            };
            let then = if f.unavailable_experts == 0 {
                "served by the other copies".to_string()
            } else {
                match f.on_expert_unavailable {
                    OnUnavailable::Fail => "requests needing them fail (503)".into(),
                    OnUnavailable::Wait => "requests needing them wait, then fail".into(),
                    OnUnavailable::Reroute => {
                        "tokens go to the next-best experts (degraded output)".into()
                    }
                }
            };
            writeln!(
                out,
                "  {:>4} {:>17} {:>12} {:>15} {:>12}  {then}",
                f.node,
                f.experts_losing_a_replica,
                f.unavailable_experts,
                share(f.token_share_affected),
                share(f.token_share_moved),
            )?;
        }
        Ok(())
    }

    /// A row per MoE layer: its imbalance under each layout and its hot experts.
    fn write_layers(&self, out: &mut String) -> std::fmt::Result {
        writeln!(
            out,
            "\nLayers (imbalance = most loaded device / mean; a copied expert's load split over its copies;\n\
             EPLB and moe-node re-place every expert in the same slots; served is where a live\n\
             rebalance from serve's layout converges: copies in the spare slots, experts moved)"
        )?;
        writeln!(
            out,
            "  {:>5} {:>12} {:>8} {:>9} {:>8} {:>11} {:>12} {:>13}  hottest",
            "layer",
            "unreplicated",
            "EPLB",
            "moe-node",
            "served",
            "hot experts",
            "copies added",
            "copies loaded"
        )?;
        let mut layers: Vec<(usize, &super::LayerReport)> = self
            .layers
            .iter()
            .filter_map(|(k, v)| k.parse().ok().map(|l| (l, v)))
            .collect();
        layers.sort_by_key(|(l, _)| *l);
        for (layer, l) in layers {
            let shown: Vec<String> = l.hot_experts.iter().take(5).map(u32::to_string).collect();
            let more = l.hot_experts.len().saturating_sub(5);
            writeln!(
                out,
                "  {:>5} {:>12.3} {:>8} {:>9} {:>8.3} {:>11} {:>12} {:>13}  {}{}",
                layer,
                l.imbalance_unreplicated,
                ratio(l.imbalance_eplb),
                ratio(l.imbalance_balanced),
                l.imbalance,
                l.hot_experts.len(),
                l.copies_added,
                l.copies_loaded,
                shown.join(" "),
                if more > 0 {
                    format!(" (+{more})")
                } else {
                    String::new()
                }
            )?;
        }

        fn ratio(r: Option<f64>) -> String {
            r.map_or("-".into(), |r| format!("{r:.3}"))
        }
        self.write_rebalance(out)
    }

    /// The versions a live rebalance goes through to the served placement.
    fn write_rebalance(&self, out: &mut String) -> std::fmt::Result {
        let r = &self.rebalance;
        let budget = match r.max_move_bytes {
            0 => "no bound per version".to_string(),
            b => format!(
                "at most {:.0} MiB per version: placement.max_move_mib",
                b as f64 / (1u64 << 20) as f64
            ),
        };
        if r.versions.is_empty() {
            return writeln!(
                out,
                "
Rebalance: nothing to move (serve's layout is within 1% of balanced, or no profile)"
            );
        }
        writeln!(
            out,
            "
Rebalance from serve's layout: {} version(s) ({budget}), {} copies loaded ({:.2} GiB), \
             {} released",
            r.versions.len(),
            r.copies_loaded,
            gib(r.bytes_loaded),
            r.copies_released
        )?;
        for v in r.versions.iter().take(3) {
            writeln!(
                out,
                "  version {:>4}: {:>6} copies loaded, {:>6} released",
                v.version, v.copies_loaded, v.copies_released
            )?;
        }
        if r.versions.len() > 3 {
            writeln!(out, "  ... {} more", r.versions.len() - 3)?;
        }
        Ok(())
    }

    /// Ready, or the problems found.
    fn write_verdict(&self, out: &mut String) -> std::fmt::Result {
        if !self.verdict.accepted.is_empty() {
            writeln!(
                out,
                "\naccepted risks (accept_unavailable_on_failure = true):"
            )?;
            for risk in &self.verdict.accepted {
                writeln!(out, "  - {risk}")?;
            }
        }
        if self.verdict.ok {
            writeln!(out, "\nverdict: ready")?;
        } else {
            writeln!(
                out,
                "\nverdict: NOT ready ({} problems)",
                self.verdict.problems.len()
            )?;
            for p in &self.verdict.problems {
                writeln!(out, "  - {p}")?;
            }
        }
        Ok(())
    }
}
