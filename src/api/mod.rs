//! The HTTP API (actix-web): OpenAI-compatible generation endpoints, health and readiness,
//! Prometheus metrics and admin endpoints. Handlers validate and translate; generation
//! happens in the router actor.

mod admin;
mod cluster;
mod detokenize;
mod error;
mod generation;
pub mod openai;
pub mod reasoning;
mod response;
mod stop;
mod structured;
pub mod tool_calls;

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header;
use actix_web::middleware::{Next, from_fn};
use actix_web::{HttpRequest, HttpResponse, web};
use futures::StreamExt;
use serde_json::json;

use crate::config::NodeConfig;
use crate::config::live::LiveSettings;
use crate::metrics::NodeMetrics;
use crate::model::Tokenizer;
use crate::model::chat_template::ChatTemplate;
use crate::node::Node;
pub use error::ApiError;
pub use openai::DEGRADED_HEADER;

/// Sent by `moe-node gateway` with a stream it can move: when this node drains (SIGTERM),
/// such a stream ends at once with an error event (code `shutting_down`) instead of running
/// on until `server.drain_seconds`, and the gateway goes on with it on another node.
pub const HANDOFF_HEADER: &str = "x-moe-node-handoff";

/// Whether a gateway can move this request's stream elsewhere ([`HANDOFF_HEADER`]).
fn handed_off(request: &actix_web::HttpRequest) -> bool {
    request.headers().contains_key(HANDOFF_HEADER)
}

/// The caller's span, from a W3C `traceparent` header: the request's trace continues it.
fn trace_parent(request: &actix_web::HttpRequest) -> Option<crate::transport::wire::TraceContext> {
    let header = request.headers().get("traceparent")?.to_str().ok()?;
    crate::telemetry::parse_traceparent(header)
}

/// Where the node is in its life; `/ready` is 200 only in `Ready`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Loading = 0,
    Ready = 1,
    Draining = 2,
}

/// The model being served, once loaded.
pub struct ServedModel {
    pub name: String,
    pub node: Node,
    pub tokenizer: Option<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    /// Structured output (`response_format`, forced tool calls); `None` without a
    /// tokenizer.
    pub grammars: Option<crate::engine::grammar::Grammars>,
    /// How the model writes tool calls, from its chat template.
    pub tool_format: Option<tool_calls::ToolCallFormat>,
    /// How the model writes its reasoning, from its chat template.
    pub reasoning: Option<reasoning::ReasoningFormat>,
    pub created: u64,
}

pub struct AppState {
    /// The configuration the node started with.
    pub config: NodeConfig,
    /// What changes while it runs (API keys, log filter, rebalancing interval).
    pub live: Arc<LiveSettings>,
    pub metrics: Arc<NodeMetrics>,
    phase: AtomicU8,
    served: OnceLock<ServedModel>,
    /// Generation responses admitted and not yet fully sent.
    in_flight: Arc<AtomicUsize>,
    /// Set when the drain time is up: responses still running end with an error.
    cut: tokio::sync::watch::Sender<bool>,
    /// Set when draining starts: streams a gateway can move end with an error at once
    /// ([`HANDOFF_HEADER`]).
    hand_off: tokio::sync::watch::Sender<bool>,
    /// The placement this node serves under and the next one while the cluster changes
    /// placement, known before the node is ready (other nodes that start with it read it
    /// from `/cluster/placement/{version}` to load their share).
    pub placements: Arc<crate::rollout::board::PlacementBoard>,
}

/// Counts one generation response as in flight until it is dropped (sent, failed, or its
/// client went away); draining waits for the count to reach zero.
pub struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl AppState {
    pub fn new(config: NodeConfig, metrics: Arc<NodeMetrics>) -> Self {
        AppState {
            live: Arc::new(LiveSettings::new(&config)),
            config,
            metrics,
            phase: AtomicU8::new(Phase::Loading as u8),
            served: OnceLock::new(),
            in_flight: Arc::new(AtomicUsize::new(0)),
            cut: tokio::sync::watch::Sender::new(false),
            hand_off: tokio::sync::watch::Sender::new(false),
            placements: Arc::default(),
        }
    }

    /// Marks a response in flight for as long as the guard lives.
    pub fn track(&self) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(self.in_flight.clone())
    }

    /// Generation responses not yet fully sent.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Acquire) {
            0 => Phase::Loading,
            1 => Phase::Ready,
            _ => Phase::Draining,
        }
    }

    /// Puts the model in service.
    pub fn set_ready(&self, served: ServedModel) {
        if self.served.set(served).is_ok() {
            self.phase.store(Phase::Ready as u8, Ordering::Release);
        }
    }

    /// Stops admitting requests; in-flight ones go on.
    pub fn start_draining(&self) {
        self.phase.store(Phase::Draining as u8, Ordering::Release);
        self.hand_off.send_replace(true);
    }

    /// Ends every response still running (the drain time is up): each gets an error, a
    /// stream also `data: [DONE]`.
    pub fn cut_in_flight(&self) {
        self.cut.send_replace(true);
    }

    /// Turns true when [`AppState::cut_in_flight`] is called.
    pub fn cut_watch(&self) -> tokio::sync::watch::Receiver<bool> {
        self.cut.subscribe()
    }

    /// What ends a response: the end of the drain time, or its start for a stream that a
    /// gateway moves elsewhere ([`HANDOFF_HEADER`]).
    fn end_watch(&self, handed_off: bool) -> tokio::sync::watch::Receiver<bool> {
        if handed_off {
            self.hand_off.subscribe()
        } else {
            self.cut.subscribe()
        }
    }

    pub fn served(&self) -> Option<&ServedModel> {
        self.served.get()
    }

    /// The served model, if requests may be admitted now.
    pub fn admitting(&self) -> Result<&ServedModel, ApiError> {
        match (self.phase(), self.served.get()) {
            (Phase::Ready, Some(served)) => Ok(served),
            (Phase::Draining, _) => Err(ApiError::unavailable(
                "the node is shutting down and admits no new requests",
            )),
            _ => Err(ApiError::unavailable(
                "the model is still loading; retry when /ready answers 200",
            )),
        }
    }
}

/// A resource answering GET (and HEAD, with the same headers and no body) with `handler`,
/// and 405 to other methods.
fn get<F, Args>(path: &str, handler: F) -> actix_web::Resource
where
    F: actix_web::Handler<Args> + Clone,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    web::resource(path)
        .route(web::get().to(handler.clone()))
        .route(web::head().to(handler))
        .default_service(web::to(|| method_not_allowed("GET, HEAD")))
}

/// A resource answering POST with `handler`, and 405 to other methods.
fn post<F, Args>(path: &str, handler: F) -> actix_web::Resource
where
    F: actix_web::Handler<Args>,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    web::resource(path)
        .route(web::post().to(handler))
        .default_service(web::to(|| method_not_allowed("POST")))
}

async fn method_not_allowed(allow: &'static str) -> HttpResponse {
    let mut response =
        actix_web::ResponseError::error_response(&ApiError::method_not_allowed(allow));
    response
        .headers_mut()
        .insert(header::ALLOW, header::HeaderValue::from_static(allow));
    response
}

/// Registers every route on an app.
pub fn configure(state: web::Data<AppState>) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg: &mut web::ServiceConfig| {
        cfg.app_data(state)
            .service(get("/health", health))
            .service(get("/ready", ready))
            .service(get("/version", version))
            .service(get("/metrics", metrics))
            .service(post("/tokenize", openai::tokenize).wrap(from_fn(require_api_key)))
            .service(
                web::scope("/v1")
                    .wrap(from_fn(require_api_key))
                    .service(get("/models", openai::models))
                    .service(post("/completions", openai::completions))
                    .service(post("/chat/completions", openai::chat_completions)),
            )
            .service(
                web::scope("/admin")
                    .wrap(from_fn(require_api_key))
                    .service(get("/experts", admin::experts))
                    .service(get("/devices", admin::devices))
                    .service(get("/cluster", admin::cluster))
                    .service(get("/placement", admin::placement))
                    .service(post("/devices/{id}/stop", admin::stop_device))
                    .service(post("/devices/{id}/start", admin::start_device))
                    .service(post("/rebalance", admin::rebalance)),
            )
            .service(
                web::scope("/cluster")
                    .wrap(from_fn(require_api_key))
                    .service(get("/placement/{version}", cluster::placement)),
            )
            .default_service(web::to(not_found));
    }
}

async fn health() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "alive"}))
}

/// What a ready node runs now, for a gateway or load balancer choosing among nodes: its
/// sequences running and waiting, and its KV cache blocks used of the budget (0: none).
fn load(state: &AppState) -> serde_json::Value {
    let metrics = &state.metrics;
    json!({
        "running": metrics.requests_running.get(),
        "waiting": metrics.requests_waiting.get(),
        "kv_cache_blocks_used": metrics.kv_cache_blocks_used.get(),
        "kv_cache_blocks": metrics.kv_cache_blocks.get(),
    })
}

async fn ready(state: web::Data<AppState>) -> HttpResponse {
    match state.admitting() {
        Ok(served) if !served.node.router.is_running() => {
            HttpResponse::ServiceUnavailable().json(json!({"status": "router stopped"}))
        }
        Ok(served) if let Some(newest) = served.node.cluster.as_ref().and_then(|c| c.behind()) => {
            HttpResponse::ServiceUnavailable().json(json!({
                "status": "catching up",
                "placement_version": served.node.experts.placement().version(),
                "cluster_placement_version": newest,
            }))
        }
        Ok(served) => match unavailable_experts(&served.node) {
            None => HttpResponse::Ok().json(json!({"status": "ready", "load": load(&state)})),
            // Tokens are routed around the missing experts: served, degraded.
            Some((count, _))
                if state.config.cluster.on_expert_unavailable
                    == crate::config::OnUnavailable::Reroute =>
            {
                HttpResponse::Ok().json(json!({
                    "status": "degraded",
                    "experts_unavailable": count,
                    "load": load(&state),
                }))
            }
            Some((count, (layer, expert))) => HttpResponse::ServiceUnavailable().json(json!({
                "status": "experts unavailable",
                "error": ApiError::unavailable(format!(
                    "{count} experts have no live replica (the first: expert {expert} of \
                     layer {layer}); requests that need them fail"
                ))
                .body()["error"],
            })),
        },
        Err(e) => {
            let status = match state.phase() {
                Phase::Draining => "draining",
                _ => "loading",
            };
            let mut body = e.body();
            body["status"] = status.into();
            HttpResponse::ServiceUnavailable().json(body)
        }
    }
}

/// How many experts have no replica that can take work (on a live local device, or on a
/// node not known to be down), and the first of them; `None` when every expert has one.
fn unavailable_experts(node: &Node) -> Option<(usize, (usize, u32))> {
    let placement = node.experts.placement();
    let local = node.experts.local_node_index();
    let alive = node.experts.devices_alive();
    let down_nodes: Vec<u16> = node
        .experts
        .targets()
        .into_iter()
        .filter_map(|(target, health)| match target {
            crate::experts::Target::Node(n) if health.reach == crate::experts::Reach::Down => {
                Some(n)
            }
            _ => None,
        })
        .collect();
    let usable = |r: &crate::placement::Replica| {
        if r.node == local {
            alive.get(r.device as usize).copied().unwrap_or(false)
        } else {
            node.cluster.is_some() && !down_nodes.contains(&r.node)
        }
    };
    let mut first = None;
    let mut count = 0;
    for layer in (0..placement.num_layers()).filter(|&l| node.model.moe_layers[l]) {
        for expert in 0..node.model.moe.num_experts as u32 {
            if !placement.replicas(layer, expert).iter().any(usable) {
                count += 1;
                first.get_or_insert((layer, expert));
            }
        }
    }
    first.map(|f| (count, f))
}

async fn version() -> HttpResponse {
    HttpResponse::Ok().json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

async fn metrics(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let text = state
        .metrics
        .encode()
        .map_err(|_| ApiError::internal("metrics could not be encoded"))?;
    Ok(HttpResponse::Ok()
        .content_type(NodeMetrics::CONTENT_TYPE)
        .body(text))
}

async fn not_found(req: HttpRequest) -> HttpResponse {
    actix_web::ResponseError::error_response(&ApiError::not_found(req.path()))
}

/// The key of an `Authorization: Bearer KEY` header (the scheme is case-insensitive, RFC
/// 9110 11.1).
pub fn bearer_key(authorization: Option<&str>) -> Option<&str> {
    authorization
        .and_then(|v| v.trim_start().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, key)| key.trim())
}

/// Checks the bearer key on `/v1`, `/admin` and `/tokenize` when keys are configured.
async fn require_api_key(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let offered = bearer_key(
        req.headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
    );
    let accepted = req
        .app_data::<web::Data<AppState>>()
        .is_none_or(|s| s.live.authorize(offered));
    if !accepted {
        return Err(ApiError::unauthorized().into());
    }
    next.call(req).await
}

/// Reads a request body of at most `server.max_request_bytes`; larger bodies are refused
/// with 413 without being read to the end, and a body that has not all arrived within
/// `server.body_read_timeout_seconds` gets 408 (a client that announces more than it sends
/// must not hold a connection forever).
pub async fn read_body(
    mut payload: web::Payload,
    server: &crate::config::ServerConfig,
) -> Result<Vec<u8>, ApiError> {
    let limit = server.max_request_bytes;
    let timeout = std::time::Duration::from_secs(server.body_read_timeout_seconds);
    let read = async move {
        let mut body = Vec::new();
        while let Some(chunk) = payload.next().await {
            let chunk =
                chunk.map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?;
            if body.len() + chunk.len() > limit {
                return Err(ApiError::too_large(format!(
                    "the request body is over {limit} bytes"
                )));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    };
    actix_web::rt::time::timeout(timeout, read)
        .await
        .unwrap_or_else(|_| {
            Err(ApiError::timeout(format!(
                "the request body did not arrive within {} s",
                timeout.as_secs()
            )))
        })
}

/// Parses a JSON body into `T`, naming what is wrong.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid: {e}")))
}
