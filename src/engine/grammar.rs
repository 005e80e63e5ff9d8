//! Constrained decoding with llguidance: a grammar (a JSON schema, or a Lark grammar with
//! JSON schemas inlined) decides which tokens may come next, and the sampler only draws
//! from those. The mask for a sequence's next token is computed on the rayon pool while
//! the model runs the step that produces its logits, so a batch waits for a mask only
//! when computing it takes longer than the step.

use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{Receiver, sync_channel};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use prometheus_client::metrics::counter::Counter;
use serde_json::Value;

/// Whitespace a JSON schema allows at each place JSON allows it, unless the schema says
/// otherwise (`x-guidance`): llguidance's default allows any amount, and a model that
/// keeps drawing spaces or newlines never ends its object.
const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,12}";

/// Compiles grammars for one model's vocabulary.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
    end: u32,
    metrics: GrammarMetrics,
}

/// What constrained decoding costs: masks computed, the time computing them (in the
/// background), and the time a step waited for one (the part the batch felt).
#[derive(Clone, Default)]
pub struct GrammarMetrics {
    pub masks: Counter,
    pub compute_seconds: Counter<f64, AtomicU64>,
    pub wait_seconds: Counter<f64, AtomicU64>,
}

/// Threads that compute masks, apart from the engine's, so that a mask is computed while
/// the engine runs a step instead of queueing behind it.
fn mask_pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().div_ceil(4));
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads.clamp(1, 8))
            .thread_name(|i| format!("grammar-{i}"))
            .build()
            .or_else(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build())
            .expect("a thread for grammar masks")
    })
}

/// A grammar that cannot be used, with llguidance's reason.
#[derive(Debug)]
pub struct GrammarError(pub String);

impl std::fmt::Display for GrammarError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Grammars {
    /// `tokens[id]` is the bytes of token `id` (empty for ids the tokenizer does not
    /// use), `special` whether it is a special token (a grammar names it `<|...|>`; it
    /// never matches text), and `end` the token that ends a generation when the grammar is
    /// complete.
    pub fn new(
        tokens: Vec<(Vec<u8>, bool)>,
        end: u32,
        metrics: GrammarMetrics,
    ) -> Result<Self, GrammarError> {
        let words: Vec<Vec<u8>> = tokens
            .into_iter()
            .map(|(bytes, special)| {
                if special && !bytes.is_empty() {
                    let mut marked = Vec::with_capacity(bytes.len() + 1);
                    marked.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    marked.extend(bytes);
                    marked
                } else {
                    bytes
                }
            })
            .collect();
        let info = TokRxInfo::new(words.len() as u32, end);
        // Token boundaries come from the trie (greedy), not the model's tokenizer: they are
        // only used for text the grammar forces, and the sampler never forces tokens.
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError(e.to_string()))?;
        factory.set_stderr_log_level(0);
        Ok(Grammars {
            factory: Arc::new(factory),
            end,
            metrics,
        })
    }

    /// Grammars for `model` with `tokenizer`'s vocabulary, ending at the model's first
    /// end-of-sequence token.
    pub fn for_model(
        tokenizer: &crate::model::Tokenizer,
        model: &crate::model::ModelConfig,
        metrics: GrammarMetrics,
    ) -> Result<Self, GrammarError> {
        let end = model
            .eos_token_ids
            .first()
            .copied()
            .ok_or_else(|| GrammarError("the model names no end-of-sequence token".into()))?;
        Grammars::new(tokenizer.vocabulary(model.vocab_size), end, metrics)
    }

    /// A constraint for output matching JSON schema `schema`.
    pub fn json_schema(&self, mut schema: Value) -> Result<Constraint, GrammarError> {
        bound_whitespace(&mut schema);
        self.constraint(TopLevelGrammar::from_json_schema(schema))
    }

    /// A constraint for output matching a Lark grammar (llguidance's dialect: `%json {...}`
    /// inlines a schema, `<|name|>` is a special token).
    pub fn lark(&self, grammar: String) -> Result<Constraint, GrammarError> {
        self.constraint(TopLevelGrammar::from_lark(grammar))
    }

    /// The token a constraint's grammar ends with: the sampler ends the generation there.
    pub fn end(&self) -> u32 {
        self.end
    }

    fn constraint(&self, grammar: TopLevelGrammar) -> Result<Constraint, GrammarError> {
        let matcher = Matcher::new(self.factory.create_parser(grammar));
        if let Some(error) = matcher.get_error() {
            return Err(GrammarError(error));
        }
        Ok(Constraint::start(matcher, self.end, self.metrics.clone()))
    }
}

/// Sets the logits of the tokens `mask` does not allow (and of any past its end) to -inf,
/// a 32-token word at a time: most words of a mask are all allowed or all not.
fn mask_logits(mask: &SimpleVob, logits: &mut [f32]) {
    let words = mask.as_slice();
    for (chunk, w) in logits.chunks_mut(32).enumerate() {
        match words.get(chunk).copied().unwrap_or(0) {
            u32::MAX => {}
            0 => w.fill(f32::NEG_INFINITY),
            bits => {
                for (bit, logit) in w.iter_mut().enumerate() {
                    if bits & (1 << bit) == 0 {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// Bounds a schema's whitespace unless it sets its own (see [`JSON_WHITESPACE`]).
pub fn bound_whitespace(schema: &mut Value) {
    if let Some(object) = schema.as_object_mut() {
        let options = object
            .entry("x-guidance")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Some(options) = options.as_object_mut()
            && !options.contains_key("whitespace_flexible")
            && !options.contains_key("whitespace_pattern")
        {
            options.insert("whitespace_pattern".into(), JSON_WHITESPACE.into());
        }
    }
}

/// The matcher and the mask for its next token, computed in the background.
type MaskJob = Receiver<(Matcher, Result<SimpleVob, String>, Duration)>;

/// One sequence's grammar state.
pub struct Constraint {
    /// The matcher, when no mask is being computed.
    matcher: Option<Matcher>,
    /// The next token's mask being computed, with the matcher.
    pending: Option<MaskJob>,
    /// The next token's mask, once computed.
    mask: Option<Result<SimpleVob, String>>,
    /// The token the grammar ends with.
    end: u32,
    metrics: GrammarMetrics,
}

impl Constraint {
    fn start(matcher: Matcher, end: u32, metrics: GrammarMetrics) -> Self {
        let mut constraint = Constraint {
            matcher: Some(matcher),
            pending: None,
            mask: None,
            end,
            metrics,
        };
        constraint.compute_next(None);
        constraint
    }

    /// Starts computing the next mask, after `token` if one was drawn.
    fn compute_next(&mut self, token: Option<u32>) {
        let Some(mut matcher) = self.matcher.take() else {
            return;
        };
        let (done, job) = sync_channel(1);
        mask_pool().spawn(move || {
            let started = Instant::now();
            let consumed = match token {
                Some(token) => matcher.consume_token(token).map_err(|e| e.to_string()),
                None => Ok(()),
            };
            let mask =
                consumed.and_then(|()| matcher.compute_mask_or_eos().map_err(|e| e.to_string()));
            // The sequence may have left the batch meanwhile; then no one receives.
            let _ = done.send((matcher, mask, started.elapsed()));
        });
        self.pending = Some(job);
    }

    /// Waits for the mask being computed, if one is.
    fn settle(&mut self) {
        if let Some(job) = self.pending.take() {
            let waited = Instant::now();
            match job.recv() {
                Ok((matcher, mask, took)) => {
                    self.matcher = Some(matcher);
                    self.mask = Some(mask);
                    self.metrics.compute_seconds.inc_by(took.as_secs_f64());
                }
                // The job panicked (llguidance turns its own panics into errors).
                Err(_) => self.mask = Some(Err("the grammar's mask computation failed".into())),
            }
            self.metrics.masks.inc();
            self.metrics
                .wait_seconds
                .inc_by(waited.elapsed().as_secs_f64());
        }
    }

    /// Sets every logit the grammar does not allow next to -inf. `end` are the tokens
    /// that end the generation: they are allowed exactly when the grammar's end token is
    /// (the grammar is complete). If the grammar failed, only `end` is allowed.
    pub fn apply(&mut self, logits: &mut [f32], end: &[u32]) {
        self.settle();
        let kept: Vec<(usize, f32)> = end
            .iter()
            .filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l)))
            .collect();
        let may_end = match &self.mask {
            Some(Ok(mask)) => {
                mask_logits(mask, logits);
                mask.is_allowed(self.end)
            }
            _ => {
                if let Some(Err(e)) = &self.mask {
                    tracing::warn!(error = %e, "the grammar failed; the sequence ends");
                }
                logits.fill(f32::NEG_INFINITY);
                true
            }
        };
        for (token, logit) in kept {
            logits[token] = if may_end { logit } else { f32::NEG_INFINITY };
        }
    }

    /// `token` was drawn: the next mask starts computing while the model runs.
    pub fn advance(&mut self, token: u32) {
        self.settle();
        self.mask = None;
        self.compute_next(Some(token));
    }

    /// A copy in the same state (choice `i` of a request with `n` choices).
    pub fn fork(&mut self) -> Self {
        self.settle();
        let matcher = self.matcher.as_ref().map(Matcher::deep_clone);
        Constraint {
            matcher,
            pending: None,
            mask: self.mask.clone(),
            end: self.end,
            metrics: self.metrics.clone(),
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("end", &self.end)
            .finish_non_exhaustive()
    }
}
