//! Activation profiles: how many token rows each expert of each MoE layer was routed, as a
//! serving node exports them (`GET /admin/experts?format=profile`) and as `moe-node plan`
//! and the rebalancer read them.
//!
//! ```json
//! {"layers": {"1": [12, 0, 7, ...], "2": [...]}, "fingerprint": "0x1234...", "window_seconds": 60}
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Token rows routed to each expert, per MoE layer (keys are layer indices).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub layers: BTreeMap<String, Vec<u64>>,
    /// The model it was measured on ([`crate::model::Checkpoint::fingerprint`], in hex).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// The span of time the counts cover, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_seconds: Option<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("reading the profile {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "the profile {path} is not a profile: {reason} (expected {{\"layers\": {{\"<layer>\": [count per expert]}}}})"
    )]
    Parse { path: String, reason: String },
    #[error("the profile does not fit this model: {}", .0.join("; "))]
    Mismatch(Vec<String>),
}

/// Formats a model fingerprint as profiles carry it.
pub fn fingerprint_hex(fingerprint: u64) -> String {
    format!("{fingerprint:#018x}")
}

impl Profile {
    /// Reads a profile file (never more than `MAX_BYTES`: a profile of 61 layers of 896
    /// experts is well under a megabyte).
    pub fn read(path: &Path) -> Result<Profile, ProfileError> {
        const MAX_BYTES: u64 = 256 << 20;
        let shown = path.display().to_string();
        let size = std::fs::metadata(path)
            .map_err(|source| ProfileError::Io {
                path: shown.clone(),
                source,
            })?
            .len();
        if size > MAX_BYTES {
            return Err(ProfileError::Parse {
                path: shown,
                reason: format!("{size} bytes is more than a profile can be"),
            });
        }
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Io {
            path: shown.clone(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|e| ProfileError::Parse {
            path: shown,
            reason: e.to_string(),
        })
    }

    /// The counts as loads per MoE layer (`[layer]`, `None` where the profile has none),
    /// checked against the model: every key a MoE layer of it, every list one count per
    /// expert. Every problem is reported at once.
    pub fn loads_for(
        &self,
        moe_layers: &[bool],
        num_experts: usize,
    ) -> Result<Vec<Option<Vec<f64>>>, ProfileError> {
        let mut problems = Vec::new();
        let mut loads = vec![None; moe_layers.len()];
        for (key, counts) in &self.layers {
            let Ok(layer) = key.parse::<usize>() else {
                problems.push(format!("layer `{key}` is not a layer index"));
                continue;
            };
            match moe_layers.get(layer) {
                None => problems.push(format!(
                    "layer {layer}: the model has {} layers",
                    moe_layers.len()
                )),
                Some(false) => problems.push(format!("layer {layer} is a dense layer")),
                Some(true) if counts.len() != num_experts => problems.push(format!(
                    "layer {layer} has {} counts, the model has {num_experts} experts",
                    counts.len()
                )),
                Some(true) => {
                    loads[layer] = Some(counts.iter().map(|&c| c as f64).collect());
                }
            }
        }
        if self
            .window_seconds
            .is_some_and(|w| !w.is_finite() || w < 0.0)
        {
            problems.push("window_seconds must be a number of seconds, at least 0".into());
        }
        if problems.is_empty() {
            Ok(loads)
        } else {
            Err(ProfileError::Mismatch(problems))
        }
    }
}

/// Zipf-like activation probabilities by rank: a token picks the expert of rank r (0 the
/// hottest) with probability ∝ (r + 1)^-skew, capped at 0.95 (top-k picks distinct experts,
/// so none can take more than every token), `top_k` in all. The skewed demo model and the
/// rebalancing benchmark draw their workloads from it.
pub fn zipf_probabilities(num_experts: usize, top_k: usize, skew: f64) -> Vec<f64> {
    let weight = |rank: usize| ((rank + 1) as f64).powf(-skew);
    let picks = |scale: f64| -> f64 {
        (0..num_experts)
            .map(|r| (scale * weight(r)).min(0.95))
            .sum()
    };
    let target = (top_k as f64).min(0.95 * num_experts as f64);
    // The scale at which the probabilities add up to top_k (bisection: picks() grows).
    let (mut low, mut high) = (0.0f64, 1.0f64);
    while picks(high) < target && high < 1e12 {
        high *= 2.0;
    }
    for _ in 0..100 {
        let mid = (low + high) / 2.0;
        if picks(mid) < target {
            low = mid;
        } else {
            high = mid;
        }
    }
    (0..num_experts)
        .map(|r| (high * weight(r)).min(0.95))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_round_trips_and_is_checked_against_the_model() {
        let profile = Profile {
            layers: BTreeMap::from([("1".into(), vec![3, 0, 1]), ("2".into(), vec![1, 1, 1])]),
            fingerprint: Some(fingerprint_hex(0xabc)),
            window_seconds: Some(60.0),
        };
        let text = serde_json::to_string(&profile).unwrap();
        assert!(text.contains("\"0x0000000000000abc\""), "{text}");
        let back: Profile = serde_json::from_str(&text).unwrap();
        assert_eq!(back, profile);
        let loads = back.loads_for(&[false, true, true], 3).unwrap();
        assert_eq!(loads[0], None);
        assert_eq!(loads[1], Some(vec![3.0, 0.0, 1.0]));
    }

    #[test]
    fn every_mismatch_is_named() {
        let profile: Profile = serde_json::from_str(
            r#"{"layers": {"0": [1, 2], "x": [], "1": [1], "9": [1, 1]}, "window_seconds": -1}"#,
        )
        .unwrap();
        let Err(ProfileError::Mismatch(problems)) = profile.loads_for(&[false, true], 2) else {
            panic!("accepted");
        };
        let all = problems.join("\n");
        for needle in [
            "layer 0 is a dense layer",
            "`x` is not a layer index",
            "layer 1 has 1 counts",
            "layer 9: the model has 2 layers",
            "window_seconds",
        ] {
            assert!(all.contains(needle), "{needle} missing from {all}");
        }
    }

    #[test]
    fn zipf_probabilities_add_up_to_the_picks_and_fall_with_rank() {
        for skew in [0.0, 0.5, 1.0, 2.0] {
            let p = zipf_probabilities(896, 16, skew);
            let total: f64 = p.iter().sum();
            assert!((total - 16.0).abs() < 1e-6, "skew {skew}: {total}");
            assert!(p.windows(2).all(|w| w[0] >= w[1]));
            assert!(p.iter().all(|&x| x <= 0.95));
        }
        let flat = zipf_probabilities(896, 16, 0.0);
        assert!((flat[0] - flat[895]).abs() < 1e-12);
    }

    #[test]
    fn bad_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.json");
        assert!(matches!(Profile::read(&path), Err(ProfileError::Io { .. })));
        for text in [
            "not json",
            r#"{"layers": {"1": [-1]}}"#,
            r#"{"layers": {}, "extra": 1}"#,
            "{}",
        ] {
            std::fs::write(&path, text).unwrap();
            let err = Profile::read(&path).unwrap_err();
            assert!(matches!(err, ProfileError::Parse { .. }), "{text}: {err}");
            assert!(err.to_string().contains("expected {\"layers\""), "{err}");
        }
    }
}
