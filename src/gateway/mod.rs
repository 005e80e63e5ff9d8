//! `moe-node gateway`: the OpenAI API in front of a cluster, holding no model. It joins the
//! cluster's gossip as a member that serves nothing ([`MemberMeta::is_gateway`]: nodes
//! never give it experts, work or a vote), learns the nodes and their API addresses from
//! membership, reads their `/ready`, and forwards each request to one of them ([`nodes`]):
//! the node that has the request's prompt prefix cached unless it is much busier, else the
//! least loaded ([`affinity`]). A stream whose node dies, stalls or drains goes on on
//! another node from the tokens already sent ([`relay`]). It keeps nothing but the streams
//! it relays: run two behind a TCP load balancer for redundancy.

pub mod affinity;
mod choices;
pub mod nodes;
pub mod relay;

use std::net::{SocketAddr, TcpListener};
use std::sync::Mutex;
use std::time::Duration;

use actix_web::http::header;
use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::api::{ApiError, read_body};
use crate::cluster::{MemberMeta, Membership, MembershipError};
use crate::config::NodeConfig;
use crate::config::live::LiveSettings;
use crate::node::{JoinError, gossip_config};
use nodes::Nodes;
use relay::Asked;

/// Why the gateway cannot start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(
        "the gateway learns the nodes from the cluster's gossip: set cluster.node_id (its own, \
         unique), cluster.secrets and cluster.seeds"
    )]
    NoCluster,
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Join(#[from] JoinError),
    #[error("cluster membership: {0}")]
    Membership(#[from] MembershipError),
    #[error("the HTTP client: {0}")]
    Client(reqwest::Error),
    #[error("the HTTP server failed: {0}")]
    Http(std::io::Error),
}

/// What the gateway's handlers share.
pub struct Gateway {
    pub config: NodeConfig,
    live: LiveSettings,
    pub nodes: Nodes,
    pub client: reqwest::Client,
    pub metrics: GatewayMetrics,
}

/// Runs the gateway until SIGTERM or SIGINT; then it leaves the cluster.
pub fn run(config: NodeConfig) -> Result<(), GatewayError> {
    let cluster = &config.cluster;
    if !cluster.enabled() || cluster.secrets.is_empty() || cluster.seeds.is_empty() {
        return Err(GatewayError::NoCluster);
    }
    actix_web::rt::System::new().block_on(serve(config))
}

async fn serve(config: NodeConfig) -> Result<(), GatewayError> {
    let listen = config.server.listen.clone();
    let listener = TcpListener::bind(&listen).map_err(|source| GatewayError::Bind {
        addr: listen.clone(),
        source,
    })?;
    let local = listener.local_addr().map_err(GatewayError::Http)?;
    let live = LiveSettings::new(&config);
    let advertised = match config.cluster.advertise_host.parse() {
        Ok(host) => SocketAddr::new(host, local.port()),
        Err(_) => local,
    };
    let meta = MemberMeta::gateway(config.cluster.node_id.clone(), advertised);
    let secrets = live.cluster_secrets().to_vec();
    let membership = Membership::start(gossip_config(&config.cluster, secrets, meta)?)?;
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .build()
        .map_err(GatewayError::Client)?;
    let nodes = Nodes::new(membership.clone(), config.gateway.balance_slack);
    let poll = Duration::from_millis(config.gateway.ready_poll_ms);
    actix_web::rt::spawn(nodes.clone().poll_ready(client.clone(), poll));
    let drain = Duration::from_secs(config.server.drain_seconds);
    let gateway = web::Data::new(Gateway {
        config,
        live,
        nodes,
        client,
        metrics: GatewayMetrics::new(),
    });
    let server = HttpServer::new(move || App::new().configure(routes(gateway.clone())))
        .listen(listener)
        .map_err(GatewayError::Http)?
        .shutdown_timeout(drain.as_secs())
        .run();
    tracing::info!(gossip = %membership.local_addr(), "gateway listening on http://{local}");
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    let served = server.await;
    membership.leave();
    served.map_err(GatewayError::Http)
}

fn routes(gateway: web::Data<Gateway>) -> impl FnOnce(&mut web::ServiceConfig) {
    move |app| {
        app.app_data(gateway)
            .route(
                "/health",
                web::get().to(|| async { HttpResponse::Ok().body("ok") }),
            )
            .route("/ready", web::get().to(ready))
            .route("/metrics", web::get().to(metrics))
            .route("/v1/models", web::get().to(models))
            .route(
                "/v1/chat/completions",
                web::post().to(|g, r, p| generate(g, r, p, "/v1/chat/completions")),
            )
            .route(
                "/v1/completions",
                web::post().to(|g, r, p| generate(g, r, p, "/v1/completions")),
            )
            .default_service(web::to(|req: HttpRequest| async move {
                actix_web::ResponseError::error_response(&ApiError::not_found(req.path()))
            }));
    }
}

/// The client's `Authorization`, once its key is one of `server.api_keys` (when any).
fn authorized(gateway: &Gateway, request: &HttpRequest) -> Result<Option<String>, ApiError> {
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let offered = crate::api::bearer_key(authorization);
    if !gateway.live.authorize(offered) {
        return Err(ApiError::unauthorized());
    }
    Ok(authorization.map(str::to_string))
}

async fn generate(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
    path: &'static str,
) -> Result<HttpResponse, ApiError> {
    let authorization = authorized(&gateway, &request)?;
    let body = read_body(payload, &gateway.config.server).await?;
    let mut asked = Asked::parse(path, &body, authorization)?;
    asked.traceparent = request
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    relay::forward(gateway, asked).await
}

/// Ready while some node is.
async fn ready(gateway: web::Data<Gateway>) -> HttpResponse {
    let ready = gateway.nodes.ready().len();
    if ready > 0 {
        HttpResponse::Ok().json(serde_json::json!({"status": "ready", "nodes_ready": ready}))
    } else {
        HttpResponse::ServiceUnavailable()
            .json(serde_json::json!({"status": "no node ready", "nodes_ready": 0}))
    }
}

/// A ready node's model list.
async fn models(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let authorization = authorized(&gateway, &request)?;
    for (node, api) in gateway.nodes.ready() {
        let mut ask = gateway.client.get(format!("http://{api}/v1/models"));
        if let Some(authorization) = &authorization {
            ask = ask.header("authorization", authorization);
        }
        match ask.timeout(Duration::from_secs(5)).send().await {
            Ok(answer) => {
                let status = answer.status().as_u16();
                let body = answer.bytes().await.unwrap_or_default();
                let status = actix_web::http::StatusCode::from_u16(status)
                    .unwrap_or(actix_web::http::StatusCode::BAD_GATEWAY);
                return Ok(HttpResponse::build(status)
                    .content_type("application/json")
                    .body(body));
            }
            Err(error) => tracing::warn!(%node, %error, "node unreachable"),
        }
    }
    Err(ApiError::unavailable("no node of the cluster is ready"))
}

async fn metrics(gateway: web::Data<Gateway>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(crate::metrics::NodeMetrics::CONTENT_TYPE)
        .body(gateway.metrics.render(&gateway.nodes))
}

type Labelled<M> = Family<Vec<(String, String)>, M>;

fn label(name: &str, value: &str) -> Vec<(String, String)> {
    vec![(name.to_string(), value.to_string())]
}

/// The gateway's own metrics (`/metrics`).
pub struct GatewayMetrics {
    registry: Mutex<Registry>,
    requests: Labelled<Counter>,
    moves: Labelled<Counter>,
    nodes_ready: Gauge,
    running: Labelled<Gauge>,
}

impl GatewayMetrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("moe_node_gateway");
        let requests = Labelled::<Counter>::default();
        let moves = Labelled::<Counter>::default();
        let nodes_ready = Gauge::default();
        let running = Labelled::<Gauge>::default();
        registry.register(
            "requests",
            "Generation requests relayed to their end, by outcome: ok, moved (went on on \
             another node), failed",
            requests.clone(),
        );
        registry.register(
            "moves",
            "Requests sent to another node because theirs failed, by why: unreachable, \
             closed, cut, stalled, down, error, garbled",
            moves.clone(),
        );
        registry.register(
            "nodes_ready",
            "Nodes alive in gossip whose /ready answers 200",
            nodes_ready.clone(),
        );
        registry.register(
            "running",
            "The gateway's requests each node runs",
            running.clone(),
        );
        GatewayMetrics {
            registry: Mutex::new(registry),
            requests,
            moves,
            nodes_ready,
            running,
        }
    }

    pub fn request(&self, outcome: &str) {
        self.requests
            .get_or_create(&label("outcome", outcome))
            .inc();
    }

    pub fn moved(&self, why: &str) {
        self.moves.get_or_create(&label("why", why)).inc();
    }

    fn render(&self, nodes: &Nodes) -> String {
        self.nodes_ready.set(nodes.ready().len() as i64);
        for (node, running) in nodes.running() {
            self.running
                .get_or_create(&label("node", &node))
                .set(running as i64);
        }
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        let mut text = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
        text
    }
}
