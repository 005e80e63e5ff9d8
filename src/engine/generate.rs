//! The generation loop of one sequence: chunked prefill, then one token per step.

use super::sampling::{Sampler, SamplingParams};
use super::{Engine, EngineError, SequenceStep};

/// Prompts longer than this are prefilled in several steps, bounding the step's memory.
pub const PREFILL_CHUNK: usize = 512;

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop at an end-of-sequence token named by the model config.
    pub stop_at_eos: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// An end-of-sequence token was generated.
    Stop,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub token_ids: Vec<u32>,
    /// Logits after the last prompt token, one per vocabulary entry.
    pub last_logits: Vec<f32>,
    pub finish_reason: FinishReason,
}

pub fn generate(engine: &Engine, request: &GenerateRequest) -> Result<Generation, EngineError> {
    if request.prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    request
        .sampling
        .validate(engine.config().vocab_size)
        .map_err(|e| EngineError::InvalidSampling(e.to_string()))?;
    let needed = (request.prompt.len()).saturating_add(request.max_tokens.saturating_sub(1));
    let max = engine.config().max_position_embeddings;
    if needed > max {
        return Err(EngineError::ContextTooLong { needed, max });
    }
    let mut cache = engine.new_cache();
    let mut logits = Vec::new();
    for chunk in request.prompt.chunks(PREFILL_CHUNK) {
        let mut step = [SequenceStep::new(&mut cache, chunk)];
        logits = engine.forward(&mut step)?.swap_remove(0);
    }
    let last_logits = logits.clone();
    let mut sampler = Sampler::new(request.sampling.clone()).with_prompt(&request.prompt);
    if request.stop_at_eos {
        sampler.end_also_at(&engine.config().eos_token_ids);
    }
    let mut token_ids = Vec::with_capacity(request.max_tokens);
    let mut finish_reason = FinishReason::Length;
    while token_ids.len() < request.max_tokens {
        let token = sampler.sample(&mut logits);
        token_ids.push(token);
        if sampler.ends_at(token) {
            finish_reason = FinishReason::Stop;
            break;
        }
        if token_ids.len() == request.max_tokens {
            break;
        }
        let tokens = [token];
        let mut step = [SequenceStep::new(&mut cache, &tokens)];
        logits = engine.forward(&mut step)?.swap_remove(0);
    }
    Ok(Generation {
        token_ids,
        last_logits,
        finish_reason,
    })
}
