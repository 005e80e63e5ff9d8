//! The HTTP API (actix-web): OpenAI-compatible generation endpoints, health and readiness,
//! Prometheus metrics and admin endpoints. Handlers validate and translate; generation
//! happens in the router actor.

pub mod admin;
pub mod cluster;
pub mod error;
pub mod openai;
pub mod stop;

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
use crate::metrics::NodeMetrics;
use crate::model::Tokenizer;
use crate::model::chat_template::ChatTemplate;
use crate::node::Node;
pub use error::ApiError;

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
    pub created: u64,
}

pub struct AppState {
    pub config: NodeConfig,
    pub metrics: Arc<NodeMetrics>,
    phase: AtomicU8,
    served: OnceLock<ServedModel>,
    /// Generation responses admitted and not yet fully sent.
    in_flight: Arc<AtomicUsize>,
    /// The placement this node serves under and the next one while the cluster changes
    /// placement, known before the node is ready (other nodes that start with it read it
    /// from `/cluster/placement/{version}` to load their share).
    pub placements: Arc<crate::cluster::board::PlacementBoard>,
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
            config,
            metrics,
            phase: AtomicU8::new(Phase::Loading as u8),
            served: OnceLock::new(),
            in_flight: Arc::new(AtomicUsize::new(0)),
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

/// Registers every route on an app.
pub fn configure(state: web::Data<AppState>) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg: &mut web::ServiceConfig| {
        cfg.app_data(state)
            .route("/health", web::get().to(health))
            .route("/ready", web::get().to(ready))
            .route("/version", web::get().to(version))
            .route("/metrics", web::get().to(metrics))
            .service(
                web::resource("/tokenize")
                    .wrap(from_fn(require_api_key))
                    .route(web::post().to(openai::tokenize)),
            )
            .service(
                web::scope("/v1")
                    .wrap(from_fn(require_api_key))
                    .route("/models", web::get().to(openai::models))
                    .route("/completions", web::post().to(openai::completions))
                    .route(
                        "/chat/completions",
                        web::post().to(openai::chat_completions),
                    ),
            )
            .service(
                web::scope("/admin")
                    .wrap(from_fn(require_api_key))
                    .route("/experts", web::get().to(admin::experts))
                    .route("/devices", web::get().to(admin::devices))
                    .route("/cluster", web::get().to(admin::cluster))
                    .route("/placement", web::get().to(admin::placement))
                    .route("/devices/{id}/stop", web::post().to(admin::stop_device)),
            )
            .service(
                web::scope("/cluster")
                    .wrap(from_fn(require_api_key))
                    .route("/placement/{version}", web::get().to(cluster::placement)),
            )
            .default_service(web::to(not_found));
    }
}

async fn health() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "alive"}))
}

async fn ready(state: web::Data<AppState>) -> HttpResponse {
    match state.admitting() {
        Ok(served) if !served.node.router.is_running() => {
            HttpResponse::ServiceUnavailable().json(json!({"status": "router stopped"}))
        }
        Ok(_) => HttpResponse::Ok().json(json!({"status": "ready"})),
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

/// Checks the bearer key on `/v1`, `/admin` and `/tokenize` when keys are configured.
async fn require_api_key(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let keys = req
        .app_data::<web::Data<AppState>>()
        .map(|s| s.config.server.api_keys.clone())
        .unwrap_or_default();
    if !keys.is_empty() {
        let offered = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let accepted = offered.is_some_and(|o| keys.iter().any(|k| constant_time_eq(k, o)));
        if !accepted {
            return Err(ApiError::unauthorized().into());
        }
    }
    next.call(req).await
}

/// Compares without stopping at the first difference, so timing does not leak the key.
fn constant_time_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |diff, (x, y)| diff | (x ^ y))
            == 0
}

/// Reads a request body of at most `limit` bytes; larger bodies are refused with 413
/// without being read to the end.
pub async fn read_body(mut payload: web::Payload, limit: usize) -> Result<Vec<u8>, ApiError> {
    let too_large = || ApiError::too_large(format!("the request body is over {limit} bytes"));
    let mut body = Vec::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?;
        if body.len() + chunk.len() > limit {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Parses a JSON body into `T`, naming what is wrong.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid: {e}")))
}
