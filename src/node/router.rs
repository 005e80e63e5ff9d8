//! The router actors: each admits requests into its running batch and steps the model. Each
//! owns an engine (embeddings, attention and KV caches, norms, gates, shared experts, lm head,
//! sampling): one per dense replica of the node, a lane ([`super::lanes`]); routed experts run
//! on the device actors and other nodes, shared by every lane. Each lives on its own thread: a
//! step blocks that thread, and requests that arrive meanwhile join at the next step boundary.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::mpsc;

use super::lanes::{LaneState, Lanes, LanesCollector};
use crate::engine::batch::{BatchLimits, Batcher, QueueFull, Sequence, SequenceEvent};
use crate::engine::grammar::Constraint;
use crate::engine::{Engine, SamplingParams};
use crate::metrics::NodeMetrics;

/// Where a sequence's events go, and the times its latency metrics need (the choices of a
/// request with `n` > 1 each hold a copy).
#[derive(Clone)]
pub struct EventSink {
    events: mpsc::Sender<SequenceEvent>,
    admitted: Instant,
    last_token: Option<Instant>,
    /// The request's span (closed when the sequence leaves the batch); the steps it takes
    /// part in are recorded under it ([`crate::telemetry`]).
    span: tracing::Span,
}

pub struct RouterActor {
    engine: Engine,
    batcher: Batcher<EventSink>,
    metrics: Arc<NodeMetrics>,
    /// Every lane's load; this router is lane `lane`.
    lanes: Arc<Lanes>,
    lane: usize,
    step_scheduled: bool,
    clock: Arc<StepClock>,
    /// Preemptions, prefix hits and the tokens they saved, already added to the metrics.
    preemptions_reported: u64,
    prefix_hits_reported: (u64, u64),
}

/// When the step in progress began, so that a router that no longer steps (a device that
/// never answers, a deadlock) is seen from outside its thread.
#[derive(Debug)]
pub struct StepClock {
    base: Instant,
    /// Milliseconds after `base` the running step began, plus one; 0 between steps.
    started: AtomicU64,
}

impl StepClock {
    fn new() -> Self {
        StepClock {
            base: Instant::now(),
            started: AtomicU64::new(0),
        }
    }

    fn begin(&self, now: Instant) {
        let ms = now.saturating_duration_since(self.base).as_millis() as u64;
        self.started.store(ms + 1, Ordering::Release);
    }

    fn end(&self) {
        self.started.store(0, Ordering::Release);
    }

    /// How long the running step has run at `now`; `None` between steps.
    pub fn running_for(&self, now: Instant) -> Option<Duration> {
        match self.started.load(Ordering::Acquire) {
            0 => None,
            at => Some(now.saturating_duration_since(self.base + Duration::from_millis(at - 1))),
        }
    }
}

/// Queues a generation; its events arrive on the returned receiver. Dropping the receiver
/// cancels the generation at the next step.
pub struct Submit {
    pub prompt: Vec<u32>,
    /// 0 only with `prompt_logprobs`: the prompt is scored, nothing generated.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_at_eos: bool,
    /// Choices generated from the prompt (`n`), each with its own events.
    pub choices: usize,
    /// Alternatives per generated token's log probabilities, if wanted.
    pub logprobs: Option<usize>,
    /// Alternatives per prompt token's log probabilities, if wanted.
    pub prompt_logprobs: Option<usize>,
    /// The grammar the output must match, and the token it ends with.
    pub constraint: Option<(Constraint, u32)>,
    /// Tokens generated before, elsewhere: the generation goes on after them
    /// ([`Sequence::resuming`]).
    pub resumed: Vec<u32>,
    /// The request's span ([`crate::telemetry`]); `Span::none()` when it is not traced.
    pub span: tracing::Span,
}

impl Submit {
    /// `max_tokens` tokens from `prompt`, one choice, no log probabilities.
    pub fn new(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Self {
        Submit {
            prompt,
            max_tokens,
            sampling,
            stop_at_eos: true,
            choices: 1,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
            span: tracing::Span::none(),
            resumed: Vec::new(),
        }
    }
}

impl Message for Submit {
    type Result = Result<mpsc::Receiver<SequenceEvent>, QueueFull>;
}

/// How the HTTP layer and start-up reach the routers, one per lane.
#[derive(Clone)]
pub struct RouterHandle {
    lanes: Vec<LaneHandle>,
    loads: Arc<Lanes>,
    /// A step running longer than this means the router is stuck.
    stall_limit: Duration,
}

/// A lane as the router starts it: an engine (the dense part on one GPU, or the host) and
/// its batch limits.
pub type Lane = (Engine, BatchLimits);

#[derive(Clone)]
struct LaneHandle {
    addr: Addr<RouterActor>,
    clock: Arc<StepClock>,
}

/// Whether the router can serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterState {
    Running,
    /// One step has run for this long, past the stall limit.
    Stalled(Duration),
    /// Its thread has ended (a step panicked).
    Stopped,
}

/// Why a generation was not queued.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error(transparent)]
    QueueFull(#[from] QueueFull),
    /// The router's thread has ended (a step panicked): the node cannot serve.
    #[error("the router is not running")]
    Stopped,
}

impl RouterHandle {
    /// Starts one router per lane, each on its own thread: `lanes` gives each lane's engine
    /// (its dense part on a GPU of its own, or the host) and batching limits (its KV
    /// budget). A step that runs longer than `stall_limit` counts as a stalled router (see
    /// [`RouterHandle::state`]). The lanes' series go to `metrics`.
    pub fn start(
        lanes: Vec<Lane>,
        metrics: Arc<NodeMetrics>,
        stall_limit: Duration,
    ) -> RouterHandle {
        let loads = Arc::new(Lanes::new(
            lanes.iter().map(|(engine, _)| engine.dense_gpu()).collect(),
        ));
        metrics.register_collector(Box::new(LanesCollector(loads.clone())));
        let lanes = lanes
            .into_iter()
            .enumerate()
            .map(|(lane, (engine, limits))| {
                let router = RouterActor::new(engine, limits, metrics.clone(), loads.clone(), lane);
                let clock = router.clock.clone();
                let arbiter = Arbiter::new();
                LaneHandle {
                    addr: RouterActor::start_in_arbiter(&arbiter.handle(), move |_| router),
                    clock,
                }
            })
            .collect();
        RouterHandle {
            lanes,
            loads,
            stall_limit,
        }
    }

    /// Queues a generation on the lane with the most room; its events arrive on the
    /// returned receiver.
    pub async fn submit(
        &self,
        submit: Submit,
    ) -> Result<mpsc::Receiver<SequenceEvent>, SubmitError> {
        let arriving = self.loads.choose(&submit.prompt);
        let lane = self.lanes.get(arriving.lane).ok_or(SubmitError::Stopped)?;
        let queued = lane.addr.send(submit).await;
        drop(arriving);
        Ok(queued.map_err(|_| SubmitError::Stopped)??)
    }

    /// Whether every lane's router still runs and steps.
    pub fn is_running(&self) -> bool {
        self.state() == RouterState::Running
    }

    /// The worst lane's state: a node with a stopped or stalled lane would fail or hold the
    /// requests sent there.
    pub fn state(&self) -> RouterState {
        let now = Instant::now();
        let mut state = RouterState::Running;
        for lane in &self.lanes {
            if !lane.addr.connected() {
                return RouterState::Stopped;
            }
            if let Some(running) = lane.clock.running_for(now)
                && running > self.stall_limit
                && !matches!(state, RouterState::Stalled(worst) if worst >= running)
            {
                state = RouterState::Stalled(running);
            }
        }
        state
    }
}

/// Runs one step of the batch (sent by the router to itself while there is work).
#[derive(Message)]
#[rtype(result = "()")]
struct Step;

impl RouterActor {
    fn new(
        engine: Engine,
        limits: BatchLimits,
        metrics: Arc<NodeMetrics>,
        lanes: Arc<Lanes>,
        lane: usize,
    ) -> Self {
        let eos = engine.config().eos_token_ids.clone();
        RouterActor {
            engine,
            batcher: Batcher::new(limits, eos),
            metrics,
            lanes,
            lane,
            step_scheduled: false,
            clock: Arc::new(StepClock::new()),
            preemptions_reported: 0,
            prefix_hits_reported: (0, 0),
        }
    }

    fn schedule_step(&mut self, ctx: &mut Context<Self>) {
        if !self.step_scheduled && self.batcher.has_work() {
            self.step_scheduled = true;
            ctx.notify(Step);
        }
    }

    fn update_gauges(&mut self) {
        let metrics = &self.metrics;
        let (kv_blocks_used, kv_blocks) = self.batcher.kv_blocks().unwrap_or((0, 0));
        let state = LaneState {
            running: self.batcher.running(),
            waiting: self.batcher.waiting(),
            kv_blocks_used,
            kv_blocks,
            prefix_blocks: self.batcher.prefix_blocks(),
        };
        self.lanes.publish(self.lane, state, metrics);
        self.lanes
            .publish_prefixes(self.lane, self.batcher.prefix_keys());
        let preemptions = self.batcher.preemptions();
        metrics
            .preemptions
            .inc_by(preemptions - self.preemptions_reported);
        self.preemptions_reported = preemptions;
        let (hits, tokens) = self.batcher.prefix_hits();
        let (reported_hits, reported_tokens) = self.prefix_hits_reported;
        metrics.prefix_cache_hits.inc_by(hits - reported_hits);
        metrics
            .prefix_cache_hit_tokens
            .inc_by(tokens - reported_tokens);
        self.prefix_hits_reported = (hits, tokens);
    }
}

impl Actor for RouterActor {
    type Context = Context<Self>;
}

impl Handler<Submit> for RouterActor {
    type Result = Result<mpsc::Receiver<SequenceEvent>, QueueFull>;

    fn handle(&mut self, msg: Submit, ctx: &mut Self::Context) -> Self::Result {
        // Room for every token and the final event: the router never waits on a client.
        // `max_tokens` is bounded by the model's context; the cap only keeps a caller that
        // skipped that check from asking tokio for an impossible channel.
        let choices = msg.choices.max(1);
        let capacity = msg
            .max_tokens
            .saturating_add(2)
            .min(crate::model::config::MAX_CONTEXT + 2)
            .saturating_mul(choices)
            .saturating_add(1);
        let (events, receiver) = mpsc::channel(capacity);
        let sink = EventSink {
            events,
            admitted: Instant::now(),
            last_token: None,
            span: msg.span,
        };
        let sequence = Sequence::new(
            msg.prompt,
            msg.max_tokens,
            msg.sampling,
            msg.stop_at_eos,
            self.engine.new_cache(),
            sink,
        )
        .with_choices(choices)
        .with_logprobs(msg.logprobs)
        .with_prompt_logprobs(msg.prompt_logprobs)
        .with_constraint(msg.constraint)
        .resuming(msg.resumed);
        self.batcher.submit(sequence)?;
        self.update_gauges();
        self.schedule_step(ctx);
        Ok(receiver)
    }
}

impl Handler<Step> for RouterActor {
    type Result = ();

    fn handle(&mut self, _: Step, ctx: &mut Self::Context) {
        self.step_scheduled = false;
        let cancelled = self.batcher.retain(|sink| !sink.events.is_closed());
        if cancelled > 0 {
            tracing::debug!(cancelled, "clients went away; their sequences were dropped");
        }
        let engine = &self.engine;
        self.batcher.prepare_step(|cache| engine.fork_cache(cache));
        let span = step_span(self.batcher.planned_sinks().map(|sink| &sink.span));
        let mut steps = self.batcher.planned_steps();
        if !steps.is_empty() {
            let tokens = steps.iter().map(|s| s.tokens.len()).sum();
            self.lanes.count_tokens(self.lane, tokens);
            self.clock.begin(Instant::now());
            let result = span.in_scope(|| self.engine.forward(&mut steps));
            self.clock.end();
            self.lanes
                .count_graph_steps(self.lane, self.engine.cuda_graph_steps());
            let rerouted: Vec<bool> = steps.iter().map(|s| s.rerouted).collect();
            drop(steps);
            self.batcher.mark_rerouted(&rerouted);
            let metrics = &self.metrics;
            match result {
                Ok(logits) => {
                    let prompt_tokens = self.batcher.planned_prompt_tokens();
                    metrics.prompt_tokens.inc_by(prompt_tokens as u64);
                    let engine = &self.engine;
                    self.batcher.complete_step(
                        logits,
                        |cache| engine.fork_cache(cache),
                        |sink, event| {
                            record(metrics, sink, &event);
                            // A full or closed channel means the client is gone.
                            sink.events.try_send(event).is_ok()
                        },
                    );
                }
                Err(e) => {
                    tracing::error!(error = %e, "step failed; its sequences were ended");
                    self.batcher.fail_step(Arc::new(e), |sink, event| {
                        record(metrics, sink, &event);
                        let _ = sink.events.try_send(event);
                    });
                }
            }
        }
        self.update_gauges();
        self.schedule_step(ctx);
    }
}

/// The span of a step that runs the sequences of `requests`: the child of the first
/// traced one, linked to the others; none when no request is traced.
fn step_span<'a>(requests: impl Iterator<Item = &'a tracing::Span>) -> tracing::Span {
    if !crate::telemetry::enabled() {
        return tracing::Span::none();
    }
    let mut traced = requests.filter(|span| crate::telemetry::sampled(span));
    let Some(parent) = traced.next() else {
        return tracing::Span::none();
    };
    let span = tracing::info_span!(parent: parent, "step");
    for other in traced {
        crate::telemetry::link(&span, other);
    }
    span
}

/// Latency and token metrics for one event.
fn record(metrics: &NodeMetrics, sink: &mut EventSink, event: &SequenceEvent) {
    let now = Instant::now();
    match event {
        SequenceEvent::Token { .. } => {
            metrics.generation_tokens.inc();
            match sink.last_token {
                None => metrics
                    .time_to_first_token
                    .observe((now - sink.admitted).as_secs_f64()),
                Some(last) => metrics
                    .inter_token_latency
                    .observe((now - last).as_secs_f64()),
            }
            sink.last_token = Some(now);
        }
        SequenceEvent::Finished { .. } => metrics
            .request_latency
            .observe((now - sink.admitted).as_secs_f64()),
        SequenceEvent::Failed(failure) => metrics.generation_failed(failure.reason()),
        SequenceEvent::PromptLogprobs(_) | SequenceEvent::Degraded { .. } => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_clock_tells_how_long_the_running_step_has_run() {
        let clock = StepClock::new();
        let now = clock.base + Duration::from_secs(5);
        assert_eq!(clock.running_for(now), None, "no step yet");
        clock.begin(clock.base + Duration::from_secs(2));
        assert_eq!(clock.running_for(now), Some(Duration::from_secs(3)));
        clock.end();
        assert_eq!(clock.running_for(now), None, "between steps");
        // A step that began at the clock's start is still seen as running.
        clock.begin(clock.base);
        assert_eq!(clock.running_for(now), Some(Duration::from_secs(5)));
    }
}
