//! Checkpoints as published: `config.json`, safetensors weights, `tokenizer.json`.

pub mod chat_template;
mod checkpoint;
pub mod config;
pub mod demo;
pub mod dummy;
pub mod family;
pub mod mxfp4;
pub mod quant;
pub mod template_worker;
mod tokenizer;
pub mod weights;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use checkpoint::{Checkpoint, ShardSource};
pub use config::ModelConfig;
pub use family::Family;
pub use tokenizer::Tokenizer;
pub use weights::{DenseWeights, ExpertWeights};

/// How a model's weights are read (`model.load_format`, `--load-format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LoadFormat {
    /// The safetensors files beside `config.json`.
    #[default]
    Safetensors,
    /// Random bf16 weights made from `config.json` alone ([`dummy`]): a published shape
    /// served or benchmarked without its weights.
    Dummy,
}

/// A model to load: its directory, how its weights are read, and how many of its layers.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSource {
    pub dir: PathBuf,
    pub load_format: LoadFormat,
    /// Only the first this many decoder layers (`--num-layers`), e.g. a few layers of a
    /// published shape on one GPU; `None`: all of them.
    pub num_layers: Option<usize>,
    /// Where shards the index names but `dir` lacks are downloaded from when first read (a
    /// model by hub name on a node of a cluster); `None`: every shard must be in `dir`.
    pub remote: Option<RemoteShards>,
}

/// The [`ShardSource`] of a [`ModelSource`]; two are equal when they are the same one.
#[derive(Clone)]
pub struct RemoteShards(pub std::sync::Arc<dyn ShardSource>);

impl std::fmt::Debug for RemoteShards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RemoteShards")
    }
}

impl PartialEq for RemoteShards {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The seed of every dummy checkpoint: all nodes and runs make the same weights.
const DUMMY_SEED: u64 = 0x6d6f_652d_6e6f_6465;

impl ModelSource {
    /// The checkpoint files in `dir`, every layer.
    pub fn files(dir: &Path) -> Self {
        ModelSource {
            dir: dir.to_path_buf(),
            load_format: LoadFormat::Safetensors,
            num_layers: None,
            remote: None,
        }
    }

    /// The model's config as it will be served: `config.json`, cut to `num_layers`; dummy
    /// weights are bf16, so a `quantization_config` does not apply to them.
    pub fn config(&self) -> Result<ModelConfig, ModelError> {
        let mut config = ModelConfig::load(&self.dir)?;
        if let Some(layers) = self.num_layers {
            config = config
                .with_layers(layers)
                .map_err(|problem| ModelError::Config {
                    path: self.dir.join("config.json"),
                    problems: vec![problem],
                })?;
        }
        if self.load_format == LoadFormat::Dummy && config.quantization != quant::Quantization::None
        {
            tracing::info!(
                quantization = ?config.quantization,
                "dummy weights are bf16: the config's quantization_config is not applied"
            );
            config.quantization = quant::Quantization::None;
        }
        Ok(config)
    }

    /// The checkpoint to read `config`'s tensors from.
    pub fn checkpoint(&self, config: &ModelConfig) -> Result<Checkpoint, ModelError> {
        match self.load_format {
            LoadFormat::Safetensors => {
                Checkpoint::open_with(&self.dir, self.remote.as_ref().map(|r| r.0.clone()))
            }
            LoadFormat::Dummy => {
                tracing::warn!(
                    dir = %self.dir.display(),
                    "--load-format dummy: the weights are random, the answers noise (for \
                     speed and memory measurements)"
                );
                Ok(Checkpoint::dummy(
                    &self.dir,
                    dummy::DummyWeights::new(DUMMY_SEED, config.tie_word_embeddings),
                ))
            }
        }
    }
}

/// Everything that can be wrong with a model directory. Each variant names the file and,
/// where there is one, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid model config {path}:\n  - {}", problems.join("\n  - "))]
    Config {
        path: PathBuf,
        problems: Vec<String>,
    },
    #[error("no weights in {dir}: expected model.safetensors or model.safetensors.index.json")]
    NoWeights { dir: PathBuf },
    #[error("{index} names shard {shard}, which does not exist")]
    MissingShard { index: PathBuf, shard: PathBuf },
    #[error("{path} is not on disk and {what} could not be downloaded: {reason}")]
    Fetch {
        path: PathBuf,
        what: &'static str,
        reason: String,
    },
    #[error("{path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("tensor `{name}` (shape {expected_shape:?}) is missing from the checkpoint")]
    MissingTensor {
        name: String,
        expected_shape: Vec<usize>,
    },
    #[error("tensor `{name}` in {path} has shape {found:?}, the config needs {expected:?}")]
    TensorShape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
}
