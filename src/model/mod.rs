//! Checkpoints as published: `config.json`, safetensors weights, `tokenizer.json`.

pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod demo;
pub mod quant;
pub mod template_worker;
pub mod tokenizer;
pub mod weights;

use std::path::PathBuf;

pub use checkpoint::Checkpoint;
pub use config::{Family, ModelConfig};
pub use tokenizer::Tokenizer;
pub use weights::{DenseWeights, ExpertWeights};

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
