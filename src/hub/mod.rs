//! Models by Hugging Face name: `model.path = "org/name"` (or `org/name@revision`) is
//! looked up in the Hugging Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`), laid out as `huggingface_hub` lays it out, so that a
//! checkpoint fetched with `hf download` or by vLLM is used where it lies; what is missing
//! is downloaded from `HF_ENDPOINT` (the hub, or the mirror an on-prem install runs) into
//! that same layout. Only the files a node reads are fetched: the config, the tokenizer and
//! chat template files, and the safetensors shards the index names; on a node of a cluster,
//! only the shards holding the tensors it reads (its dense weights and its experts): every
//! shard's header is fetched first (two `Range` requests), and a shard's data when one of
//! its tensors is first read ([`Weights::AsRead`]).
//!
//! Written over reqwest and RustCrypto's hashes (both in the build already) rather than
//! with the `hf-hub` crate: that crate checks no checksum, has no offline mode, and brings
//! a second HTTP client and TLS stack; the hub's file protocol it would save us is two
//! requests (a HEAD for the commit, checksum and size, and a GET, resumed with `Range`).
//!
//! A directory that exists wins over a name, so `model.path = "models/qwen"` keeps meaning
//! the directory when it is there.

mod cache;
mod download;
mod shards;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::model::RemoteShards;

pub use cache::RepoCache;

/// What of a model's weights is made present before it loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weights {
    /// None: the config and tokenizer only (dummy weights, `plan`).
    None,
    /// Every shard: a node that serves the whole model.
    All,
    /// Every shard's header, and a shard's data when a tensor in it is first read: a node
    /// of a cluster, which holds some of the experts.
    AsRead,
}

/// The default endpoint, when `HF_ENDPOINT` is not set.
const HUB: &str = "https://huggingface.co";

/// Files a node reads beside the weights, when the model has them.
const OPTIONAL_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];
const CONFIG_FILE: &str = "config.json";
const SINGLE_WEIGHTS: &str = "model.safetensors";
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// Where models by name come from, as the Hugging Face variables say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubEnv {
    /// The cache's root: one `models--org--name` folder per model.
    pub cache: PathBuf,
    /// Where files are downloaded from: the hub, or a mirror of it.
    pub endpoint: String,
    /// Sent as `Authorization: Bearer` (gated and private models).
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE`: the cache only, never the network.
    pub offline: bool,
}

impl HubEnv {
    /// From environment variables (the process's, or a test's map): `HF_HUB_CACHE`,
    /// `HF_HOME`, `XDG_CACHE_HOME`, `HOME`, `HF_ENDPOINT`, `HF_TOKEN` (else the token file
    /// `hf auth login` writes, `HF_TOKEN_PATH` or `HF_HOME/token`), `HF_HUB_OFFLINE`.
    pub fn from_vars(vars: &HashMap<String, String>) -> HubEnv {
        let var = |name: &str| vars.get(name).filter(|v| !v.is_empty()).cloned();
        let home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            let cache = var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(var("HOME").unwrap_or_default()).join(".cache"));
            cache.join("huggingface")
        });
        let cache = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .map(PathBuf::from)
            .unwrap_or_else(|| home.join("hub"));
        let token = var("HF_TOKEN")
            .or_else(|| var("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| {
                let path = var("HF_TOKEN_PATH")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| home.join("token"));
                std::fs::read_to_string(path).ok()
            })
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        });
        HubEnv {
            cache,
            endpoint: var("HF_ENDPOINT")
                .unwrap_or_else(|| HUB.to_string())
                .trim_end_matches('/')
                .to_string(),
            token,
            offline,
        }
    }

    /// From this process's environment.
    pub fn from_process() -> HubEnv {
        HubEnv::from_vars(&std::env::vars().collect())
    }
}

/// A model's name on the hub, `org/name`, and the revision asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelName {
    pub repo: String,
    /// A branch, tag or commit; `main` when none was given.
    pub revision: String,
}

impl ModelName {
    /// `org/name` or `org/name@revision`, as the hub allows them; `None` for anything else
    /// (a path, most likely).
    pub fn parse(text: &str) -> Option<ModelName> {
        let (repo, revision) = match text.split_once('@') {
            Some((repo, revision)) => (repo, Some(revision)),
            None => (text, None),
        };
        let (org, name) = repo.split_once('/')?;
        if !hub_part(org) || !hub_part(name) {
            return None;
        }
        let revision = match revision {
            None => "main".to_string(),
            Some(r) if valid_revision(r) => r.to_string(),
            Some(_) => return None,
        };
        Some(ModelName {
            repo: repo.to_string(),
            revision,
        })
    }
}

impl std::fmt::Display for ModelName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.repo, self.revision)
    }
}

/// One half of `org/name`: letters, digits, `-`, `_`, `.`, not starting or ending with `-`
/// or `.`, without `--` or `..` (the hub's rules, which also keep it a safe folder name).
fn hub_part(part: &str) -> bool {
    !part.is_empty()
        && part.len() <= 96
        && part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !part.starts_with(['-', '.'])
        && !part.ends_with(['-', '.'])
        && !part.contains("--")
        && !part.contains("..")
}

/// A branch, tag or commit: it names a file under `refs/`, so no `..`, no leading `/`.
fn valid_revision(revision: &str) -> bool {
    !revision.is_empty()
        && revision.len() <= 200
        && revision
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && !revision.starts_with(['/', '.'])
        && !revision.ends_with('/')
        && !revision
            .split('/')
            .any(|part| part.is_empty() || part == "..")
}

/// A 40-hex-digit commit id.
fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit())
}

/// What resolving a model by name can fail on.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "HF_HUB_OFFLINE is set and the Hugging Face cache {cache} has no snapshot of {name}: \
         download it first (unset HF_HUB_OFFLINE, or `hf download {repo}`)"
    )]
    NotCached {
        name: ModelName,
        repo: String,
        cache: PathBuf,
    },
    #[error("the cached snapshot {snapshot} of {name} lacks {}: {why}", missing.join(", "))]
    Incomplete {
        name: ModelName,
        snapshot: PathBuf,
        missing: Vec<String>,
        why: &'static str,
    },
    #[error("cannot reach {url} for {name}: {source} (HF_HUB_OFFLINE=1 serves from the cache)")]
    Unreachable {
        name: ModelName,
        url: String,
        source: reqwest::Error,
    },
    #[error(
        "{url} answered {status} for {name}: the model does not exist under that name, or it \
         is gated or private (set HF_TOKEN to a token with access)"
    )]
    Refused {
        name: ModelName,
        url: String,
        status: u16,
    },
    #[error("{name} has no {file} at {url} (404): is it a Hugging Face format checkpoint?")]
    NotFound {
        name: ModelName,
        file: String,
        url: String,
    },
    #[error("{url} answered {status}")]
    Http { url: String, status: u16 },
    #[error("{url} gave no X-Repo-Commit header: name a commit (`{repo}@<40 hex digits>`)")]
    NoCommit { url: String, repo: String },
    #[error(
        "{file} of {name} does not match the hub's checksum (expected {expected}, got \
         {actual}): the partial download was removed; start again to download it anew"
    )]
    Checksum {
        name: ModelName,
        file: String,
        expected: String,
        actual: String,
    },
    #[error("{file} of {name} is {actual} bytes, the hub says {expected}")]
    Size {
        name: ModelName,
        file: String,
        expected: u64,
        actual: u64,
    },
    #[error("{file} of {name}: {why}")]
    BadIndex {
        name: ModelName,
        file: String,
        why: String,
    },
    #[error("downloading {file} of {name} failed after {tries} tries: {source}")]
    Download {
        name: ModelName,
        file: String,
        tries: u32,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl HubError {
    /// Whether starting again as configured cannot help (a name, a cache or a token to
    /// fix), as against the network or the files (which a restart may get past).
    pub fn is_configuration(&self) -> bool {
        matches!(
            self,
            HubError::NotCached { .. }
                | HubError::Incomplete { .. }
                | HubError::Refused { .. }
                | HubError::NotFound { .. }
                | HubError::NoCommit { .. }
        )
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> HubError + '_ {
    move |source| HubError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A model directory, and the hub name it was found by.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub dir: PathBuf,
    /// `None` when `model.path` was a directory.
    pub name: Option<ModelName>,
    /// Where the shards `dir` lacks come from, as they are read ([`Weights::AsRead`] of a
    /// sharded model).
    pub remote: Option<RemoteShards>,
}

/// The model directory `path_or_name` stands for: itself when it is a directory here or
/// not a model name, else the cached snapshot of the model it names, completed from
/// `env.endpoint` unless `env.offline`, with as much of the weights as `weights` says.
pub fn resolve_model(
    path_or_name: &str,
    env: &HubEnv,
    weights: Weights,
) -> Result<Resolved, HubError> {
    let path = Resolved {
        dir: PathBuf::from(path_or_name),
        name: None,
        remote: None,
    };
    if Path::new(path_or_name).exists() {
        return Ok(path);
    }
    let Some(name) = ModelName::parse(path_or_name) else {
        return Ok(path);
    };
    let dir = resolve_name(&name, env, weights)?;
    let remote = (weights == Weights::AsRead && dir.join(WEIGHTS_INDEX).is_file())
        .then(|| shards::HubShards::source(&name, env, &dir));
    Ok(Resolved {
        dir,
        name: Some(name),
        remote,
    })
}

/// The cached snapshot of `name`, completed from `env.endpoint` unless `env.offline`.
pub fn resolve_name(name: &ModelName, env: &HubEnv, weights: Weights) -> Result<PathBuf, HubError> {
    let cache = RepoCache::new(&env.cache, &name.repo);
    let cached = cache.commit_of(&name.revision);
    // A commit named (nothing the hub says can change it), or offline: the cache decides.
    if let Some(commit) = cached.as_deref()
        && (is_commit(&name.revision) || env.offline)
    {
        let snapshot = cache.snapshot(commit);
        return match missing_files(&cache, commit, weights, name)? {
            missing if missing.is_empty() => Ok(snapshot),
            _ if !env.offline => download::complete(name, env, &cache, weights),
            missing => Err(HubError::Incomplete {
                name: name.clone(),
                snapshot,
                missing,
                why: "HF_HUB_OFFLINE is set, so it cannot be downloaded",
            }),
        };
    }
    if env.offline {
        return Err(HubError::NotCached {
            name: name.clone(),
            repo: name.repo.clone(),
            cache: env.cache.clone(),
        });
    }
    match download::complete(name, env, &cache, weights) {
        // The hub out of reach, the cache complete: serve what is cached, as
        // `huggingface_hub` does.
        Err(HubError::Unreachable { url, source, .. }) if cached.is_some() => {
            let commit = cached.as_deref().unwrap_or_default();
            if missing_files(&cache, commit, weights, name)?.is_empty() {
                let snapshot = cache.snapshot(commit);
                tracing::warn!(
                    model = %name, %url, error = %source,
                    "the hub is out of reach: serving the cached snapshot"
                );
                Ok(snapshot)
            } else {
                Err(HubError::Unreachable {
                    name: name.clone(),
                    url,
                    source,
                })
            }
        }
        other => other,
    }
}

/// The files a node needs that `commit`'s snapshot lacks: the config, and the weights (one
/// file, or the index and every shard it names: the shard, or for [`Weights::AsRead`] its
/// header) as `weights` says.
fn missing_files(
    cache: &RepoCache,
    commit: &str,
    weights: Weights,
    name: &ModelName,
) -> Result<Vec<String>, HubError> {
    let snapshot = cache.snapshot(commit);
    let has = |file: &str| snapshot.join(file).is_file();
    let mut missing = Vec::new();
    if !has(CONFIG_FILE) {
        missing.push(CONFIG_FILE.to_string());
    }
    if weights != Weights::None {
        if has(WEIGHTS_INDEX) {
            let shards = shards_of(&snapshot.join(WEIGHTS_INDEX), name)?;
            let header = |s: &str| cache.header(commit, s).is_file();
            missing.extend(
                shards
                    .into_iter()
                    .filter(|s| !has(s) && (weights == Weights::All || !header(s))),
            );
        } else if !has(SINGLE_WEIGHTS) {
            missing.push(format!("{SINGLE_WEIGHTS} (or {WEIGHTS_INDEX})"));
        }
    }
    Ok(missing)
}

/// The shard files a safetensors index names, each once, in order; a name that would leave
/// the snapshot folder is refused (the index comes from the network).
fn shards_of(index: &Path, name: &ModelName) -> Result<Vec<String>, HubError> {
    let bad = |why: String| HubError::BadIndex {
        name: name.clone(),
        file: WEIGHTS_INDEX.to_string(),
        why,
    };
    let text = std::fs::read(index).map_err(io(index))?;
    let value: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut shards: Vec<String> = Vec::new();
    for file in map.values() {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("a shard name is not a string: {file}")))?;
        if !safe_relative(file) {
            return Err(bad(format!(
                "shard name {file:?} is not a file in the model"
            )));
        }
        if !shards.iter().any(|s| s == file) {
            shards.push(file.to_string());
        }
    }
    if shards.is_empty() {
        return Err(bad("the weight map names no shard".into()));
    }
    shards.sort();
    Ok(shards)
}

/// A relative path of plain parts (no `..`, no root, no backslash).
fn safe_relative(file: &str) -> bool {
    !file.is_empty()
        && file.len() <= 512
        && !file.starts_with('/')
        && !file.contains('\\')
        && file
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
}
