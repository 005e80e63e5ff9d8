//! The weights of DeepSeek Sparse Attention's lightning indexer (`self_attn.indexer`, on the
//! layers of DeepSeek-V3.2 and GLM-5 that run one): a query projection from the MLA's
//! low-rank query (`wq_b`), one key projection (`wk`) with a LayerNorm (`k_norm`, weight and
//! bias), and the per-head weights of the scores (`weights_proj`, kept in f32 as transformers
//! keeps it).

use super::{StoredLinear, linear, linear_f32};
use crate::compute::cpu::Linear;
use crate::model::config::{LightningIndexer, ModelConfig};
use crate::model::{Checkpoint, ModelError};

/// The epsilon of the indexer's key norm (transformers' `nn.LayerNorm(head_dim, eps=1e-6)`).
pub const KEY_NORM_EPS: f32 = 1e-6;

#[derive(Debug, Clone)]
pub struct IndexerWeights {
    /// `[heads * head_dim, q_lora_rank]`.
    pub wq_b: StoredLinear,
    /// `[head_dim, hidden]`.
    pub wk: StoredLinear,
    /// `[head_dim]`: the key norm's scale and shift.
    pub k_norm_weight: Vec<f32>,
    pub k_norm_bias: Vec<f32>,
    /// `[heads, hidden]`.
    pub weights_proj: Linear,
}

/// Layer `l`'s indexer; the MLA's low-rank query is `q_lora_rank` wide.
pub(super) fn load(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    indexer: &LightningIndexer,
    q_lora_rank: usize,
    l: usize,
) -> Result<IndexerWeights, ModelError> {
    let h = cfg.hidden_size;
    let quant = &cfg.quantization;
    let p = format!("model.layers.{l}.self_attn.indexer");
    let (heads, dim) = (indexer.num_heads, indexer.head_dim);
    Ok(IndexerWeights {
        wq_b: linear(ckpt, quant, &format!("{p}.wq_b"), heads * dim, q_lora_rank)?,
        wk: linear(ckpt, quant, &format!("{p}.wk"), dim, h)?,
        k_norm_weight: ckpt.read_f32(&format!("{p}.k_norm.weight"), &[dim])?,
        k_norm_bias: ckpt.read_f32(&format!("{p}.k_norm.bias"), &[dim])?,
        weights_proj: linear_f32(ckpt, quant, &format!("{p}.weights_proj"), heads, h)?,
    })
}
