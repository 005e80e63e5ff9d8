//! The control plane's HTTP service (actix-web, as the node's API).

use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use actix_web::http::header;
use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use serde_json::json;

use super::ControlPlaneConfig;
use super::guesses::GuessLimiter;
use super::identity::{self, NodeToken};
use super::store::{NodeRecord, Store, StoreError};
use super::wire::{self, Answer, DesiredState, DesiredUpdate, Report};

/// Source addresses whose token failures are tracked at most.
const TRACKED_SOURCES: usize = 4096;
/// Largest request body: a report is well under 4 KiB, a desired state at most the
/// overrides' 64 KiB and the keys.
const MAX_BODY: usize = 128 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("the HTTP server failed: {0}")]
    Http(std::io::Error),
    #[error("{0}")]
    Tls(String),
}

/// The client certificate the connection a request came on presented (one that
/// `tls_client_ca` verified: any other ends the handshake), and the `moe-node://` names it
/// carries.
#[derive(Clone)]
struct ClientCertificate {
    presented: bool,
    names: Vec<(String, String)>,
}

struct State {
    config: ControlPlaneConfig,
    store: Arc<Mutex<Store>>,
    guesses: Mutex<GuessLimiter>,
}

/// Runs the control plane until SIGINT or SIGTERM. Blocks the calling thread.
pub fn run(config: ControlPlaneConfig) -> Result<(), ControlPlaneError> {
    let store = Store::open(&config.database_path(), config.history_per_node)?;
    let listener = TcpListener::bind(&config.listen).map_err(|source| ControlPlaneError::Bind {
        addr: config.listen.clone(),
        source,
    })?;
    let local = listener.local_addr().map_err(ControlPlaneError::Http)?;
    let tls = config.tls().map_err(ControlPlaneError::Tls)?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let client_certificates = !config.tls_client_ca.is_empty();
    let guesses = GuessLimiter::new(config.token_failures_per_minute, TRACKED_SOURCES);
    let state = web::Data::new(State {
        config,
        store: Arc::new(Mutex::new(store)),
        guesses: Mutex::new(guesses),
    });
    actix_web::rt::System::new().block_on(async move {
        let server = HttpServer::new(move || {
            App::new()
                .app_data(state.clone())
                .app_data(
                    web::JsonConfig::default()
                        .limit(MAX_BODY)
                        .error_handler(|e, _| {
                            actix_web::error::InternalError::from_response(
                                "",
                                HttpResponse::BadRequest().json(
                                    json!({"error": format!("the request body is not valid: {e}")}),
                                ),
                            )
                            .into()
                        }),
                )
                .route("/", web::get().to(status_page))
                .route(
                    "/health",
                    web::get().to(|| async { HttpResponse::Ok().body("ok") }),
                )
                .route("/api/v1/register", web::post().to(register))
                .route("/api/v1/heartbeat", web::post().to(heartbeat))
                .route("/api/v1/clusters", web::get().to(clusters))
                .route(
                    "/api/v1/clusters/{cluster}/desired",
                    web::get().to(get_desired),
                )
                .route(
                    "/api/v1/clusters/{cluster}/desired",
                    web::put().to(put_desired),
                )
                .route(
                    "/api/v1/clusters/{cluster}/nodes/{node}/history",
                    web::get().to(history),
                )
        })
        .on_connect(|connection, data| {
            if let Some(tls) = connection.downcast_ref::<actix_tls::accept::rustls_0_23::TlsStream<
                actix_web::rt::net::TcpStream,
            >>() {
                let first = tls.get_ref().1.peer_certificates().and_then(|c| c.first());
                data.insert(ClientCertificate {
                    presented: first.is_some(),
                    names: first.map(|c| identity::certificate_names(c)).unwrap_or_default(),
                });
            }
        })
        .shutdown_timeout(1);
        let server = match tls {
            Some(tls) => server.listen_rustls_0_23(listener, tls),
            None => server.listen(listener),
        }
        .map_err(ControlPlaneError::Http)?
        .run();
        tracing::info!(
            client_certificates,
            "control plane listening on {scheme}://{local}"
        );
        server.await.map_err(ControlPlaneError::Http)
    })
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// The bearer token of a request, hashed.
fn offered_token_hash(req: &HttpRequest) -> Option<String> {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim_start().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| wire::sha256_hex(token.trim()))
}

/// The address a request came from, for the log.
fn peer(req: &HttpRequest) -> String {
    req.peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|| "an unknown address".into())
}

fn refused(req: &HttpRequest, who: &str) -> HttpResponse {
    let peer = peer(req);
    tracing::warn!(
        %peer,
        path = req.path(),
        "refused a request: the bearer token is not a known {who} token"
    );
    HttpResponse::Unauthorized()
        .insert_header((header::WWW_AUTHENTICATE, "Bearer"))
        .json(json!({"error": format!("unknown {who} token")}))
}

fn bad_request(why: impl std::fmt::Display) -> HttpResponse {
    HttpResponse::BadRequest().json(json!({ "error": why.to_string() }))
}

fn forbidden(req: &HttpRequest, why: String) -> HttpResponse {
    let peer = peer(req);
    tracing::warn!(%peer, path = req.path(), "refused a node: {why}");
    HttpResponse::Forbidden().json(json!({ "error": why }))
}

impl State {
    fn source(req: &HttpRequest) -> Option<std::net::IpAddr> {
        req.peer_addr().map(|a| a.ip())
    }

    /// 429 when the request's source has no token tries left.
    fn out_of_tries(&self, req: &HttpRequest) -> Option<HttpResponse> {
        let wait = self
            .guesses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .check(Self::source(req), Instant::now())
            .err()?;
        // Whole seconds, rounded up: a client that waits this long may try again.
        let seconds = (wait.as_secs_f64().ceil() as u64).max(1);
        tracing::debug!(peer = %peer(req), "too many wrong tokens from this address");
        Some(
            HttpResponse::TooManyRequests()
                .insert_header((header::RETRY_AFTER, seconds.to_string()))
                .json(json!({"error": format!(
                    "too many wrong tokens from this address: try again in {seconds} s"
                )})),
        )
    }

    /// A wrong token from the request's source: counted, and answered 401.
    fn wrong_token(&self, req: &HttpRequest, who: &str) -> HttpResponse {
        self.guesses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .failed(Self::source(req), Instant::now());
        refused(req, who)
    }

    /// The node token a request offers, if one is known: its hash, and its scope when it
    /// is a `[[node_tokens]]` one.
    fn node_token(&self, req: &HttpRequest) -> Option<(String, Option<NodeToken>)> {
        let hash = offered_token_hash(req)?;
        if let Some(token) = self
            .config
            .node_tokens
            .iter()
            .find(|t| t.sha256.eq_ignore_ascii_case(&hash))
        {
            return Some((hash, Some(token.clone())));
        }
        self.config
            .node_token_sha256
            .iter()
            .any(|h| h.eq_ignore_ascii_case(&hash))
            .then_some((hash, None))
    }
}

fn internal(e: impl std::fmt::Display) -> HttpResponse {
    tracing::error!(error = %e, "the control plane's database failed");
    HttpResponse::InternalServerError().json(json!({"error": e.to_string()}))
}

/// Runs `f` on the store off the async threads.
async fn with_store<T: Send + 'static>(
    state: &State,
    f: impl FnOnce(&mut Store) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, HttpResponse> {
    let store = state.store.clone();
    match web::block(move || f(&mut store.lock().unwrap_or_else(|e| e.into_inner()))).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(internal(e)),
        Err(e) => Err(internal(e)),
    }
}

/// A node's registration or heartbeat: records the report, answers with the desired state
/// and the proof that this service knows the node's token.
async fn report(
    req: HttpRequest,
    state: web::Data<State>,
    report: Report,
    first: bool,
) -> HttpResponse {
    let certificate = req.conn_data::<ClientCertificate>().cloned();
    let mtls = !state.config.tls_client_ca.is_empty();
    if mtls && !certificate.as_ref().is_some_and(|c| c.presented) {
        let peer = peer(&req);
        tracing::warn!(
            %peer,
            path = req.path(),
            "refused a node: it presented no client certificate (tls_client_ca requires one)"
        );
        return HttpResponse::Forbidden().json(json!({
            "error": "a client certificate signed by the control plane's tls_client_ca is required: \
                      set control_plane.client_certificate and control_plane.client_key"
        }));
    }
    if let Some(response) = state.out_of_tries(&req) {
        return response;
    }
    let Some((token, scope)) = state.node_token(&req) else {
        return state.wrong_token(&req, "node");
    };
    if let Some(problem) = identity::report_problem(&report) {
        tracing::warn!(peer = %peer(&req), "refused a report: {problem}");
        return bad_request(format!("the report is not valid: {problem}"));
    }
    let (cluster, node) = (report.cluster.clone(), report.node.clone());
    if let Some(scope) = scope.filter(|scope| !scope.allows(&cluster, &node)) {
        let allowed = if scope.node.is_empty() {
            format!("any node of cluster {}", scope.cluster)
        } else {
            format!("{}/{}", scope.cluster, scope.node)
        };
        return forbidden(
            &req,
            format!("its token is for {allowed}, not for {cluster}/{node}"),
        );
    }
    if mtls {
        let names = certificate.map(|c| c.names).unwrap_or_default();
        if !names.iter().any(|(c, n)| *c == cluster && *n == node) {
            let carried: Vec<String> = names
                .iter()
                .map(|(c, n)| format!("{}{c}/{n}", identity::URI_PREFIX))
                .collect();
            return forbidden(
                &req,
                format!(
                    "its client certificate names [{}], not {}{cluster}/{node} (a subject \
                     alternative name URI)",
                    carried.join(", "),
                    identity::URI_PREFIX
                ),
            );
        }
    }
    let (max_clusters, max_nodes) = (
        state.config.max_clusters,
        state.config.max_nodes_per_cluster,
    );
    let recorded = with_store(&state, move |store| {
        if let Some(why) =
            store.growth_refused(&report.cluster, &report.node, max_clusters, max_nodes)?
        {
            return Ok(Err(why));
        }
        let new = store.record(&report, now_ms())?;
        Ok(Ok((new, store.desired(&report.cluster)?)))
    })
    .await;
    let (new, desired) = match recorded {
        Ok(Ok(done)) => done,
        Ok(Err(why)) => return forbidden(&req, format!("{cluster}/{node} is not kept: {why}")),
        Err(response) => return response,
    };
    if new || first {
        tracing::info!(%cluster, %node, new, "node registered");
    }
    let body = match serde_json::to_vec(&Answer { desired }) {
        Ok(body) => body,
        Err(e) => return internal(e),
    };
    let nonce = req
        .headers()
        .get(wire::NONCE_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    HttpResponse::Ok()
        .insert_header((wire::PROOF_HEADER, wire::proof(&token, nonce, &body)))
        .content_type("application/json")
        .body(body)
}

async fn register(
    req: HttpRequest,
    state: web::Data<State>,
    body: web::Json<Report>,
) -> HttpResponse {
    report(req, state, body.into_inner(), true).await
}

async fn heartbeat(
    req: HttpRequest,
    state: web::Data<State>,
    body: web::Json<Report>,
) -> HttpResponse {
    report(req, state, body.into_inner(), false).await
}

/// `None` for a request with an admin token; else its answer (429 when its source has no
/// tries left, 401 for a wrong token).
fn not_admin(req: &HttpRequest, state: &State) -> Option<HttpResponse> {
    if let Some(response) = state.out_of_tries(req) {
        return Some(response);
    }
    let known = offered_token_hash(req).is_some_and(|hash| {
        state
            .config
            .admin_token_sha256
            .iter()
            .any(|h| h.eq_ignore_ascii_case(&hash))
    });
    (!known).then(|| state.wrong_token(req, "admin"))
}

/// The 400 that refuses a cluster (or node) name from a path, if it is not a valid one.
fn bad_name(name: &str) -> Option<HttpResponse> {
    identity::name_problem(name)
        .map(|problem| bad_request(format!("`{}`: {problem}", name.escape_debug())))
}

async fn get_desired(
    req: HttpRequest,
    state: web::Data<State>,
    path: web::Path<String>,
) -> HttpResponse {
    if let Some(response) = not_admin(&req, &state) {
        return response;
    }
    let cluster = path.into_inner();
    if let Some(response) = bad_name(&cluster) {
        return response;
    }
    match with_store(&state, move |store| store.desired(&cluster)).await {
        Ok(desired) => HttpResponse::Ok().json(desired),
        Err(response) => response,
    }
}

async fn put_desired(
    req: HttpRequest,
    state: web::Data<State>,
    path: web::Path<String>,
    body: web::Json<DesiredUpdate>,
) -> HttpResponse {
    if let Some(response) = not_admin(&req, &state) {
        return response;
    }
    let cluster = path.into_inner();
    if let Some(response) = bad_name(&cluster) {
        return response;
    }
    // Only salted hashes are kept: the plain keys are not needed to check a node's clients.
    let desired = match body.into_inner().into_desired() {
        Ok(desired) => desired,
        Err(why) => return bad_request(why),
    };
    let (name, max_clusters) = (cluster.clone(), state.config.max_clusters);
    match with_store(&state, move |store| {
        if let Some(why) = store.cluster_growth_refused(&name, max_clusters)? {
            return Ok(Err(why));
        }
        Ok(Ok(store.set_desired(&name, desired, now_ms())?))
    })
    .await
    {
        Ok(Ok(stored)) => {
            tracing::info!(%cluster, version = stored.version, api_keys = stored.api_keys.len(), "desired state changed");
            HttpResponse::Ok().json(stored)
        }
        Ok(Err(why)) => HttpResponse::Forbidden()
            .json(json!({"error": format!("cluster {cluster} is not kept: {why}")})),
        Err(response) => response,
    }
}

/// One cluster as shown: its desired state and its nodes, each fresh or stale.
fn cluster_view(
    store: &Store,
    cluster: &str,
    stale_after_ms: i64,
    now: i64,
) -> Result<(DesiredState, Vec<(NodeRecord, bool)>), StoreError> {
    let desired = store.desired(cluster)?;
    let nodes = store
        .nodes(cluster)?
        .into_iter()
        .map(|n| {
            let stale = now - n.last_seen_ms > stale_after_ms;
            (n, stale)
        })
        .collect();
    Ok((desired, nodes))
}

type Views = Vec<(String, DesiredState, Vec<(NodeRecord, bool)>)>;

async fn all_views(state: &State) -> Result<Views, HttpResponse> {
    let stale_after_ms = state.config.stale_after_seconds as i64 * 1000;
    with_store(state, move |store| {
        let now = now_ms();
        store
            .clusters()?
            .into_iter()
            .map(|c| {
                let (desired, nodes) = cluster_view(store, &c, stale_after_ms, now)?;
                Ok((c, desired, nodes))
            })
            .collect()
    })
    .await
}

async fn clusters(req: HttpRequest, state: web::Data<State>) -> HttpResponse {
    if let Some(response) = not_admin(&req, &state) {
        return response;
    }
    let views = match all_views(&state).await {
        Ok(views) => views,
        Err(response) => return response,
    };
    let now = now_ms();
    let out: Vec<_> = views
        .into_iter()
        .map(|(name, desired, nodes)| {
            json!({
                "name": name,
                "desired": desired,
                "nodes": nodes.into_iter().map(|(n, stale)| json!({
                    "node": n.node,
                    "status": if stale { "stale" } else { "reporting" },
                    "last_seen_seconds_ago": (now - n.last_seen_ms) as f64 / 1000.0,
                    "registered_ms": n.registered_ms,
                    "report": n.report,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    HttpResponse::Ok().json(json!({ "clusters": out }))
}

async fn history(
    req: HttpRequest,
    state: web::Data<State>,
    path: web::Path<(String, String)>,
) -> HttpResponse {
    if let Some(response) = not_admin(&req, &state) {
        return response;
    }
    let (cluster, node) = path.into_inner();
    if let Some(response) = bad_name(&cluster).or_else(|| bad_name(&node)) {
        return response;
    }
    match with_store(&state, move |store| store.history(&cluster, &node)).await {
        Ok(reports) => HttpResponse::Ok().json(
            reports
                .into_iter()
                .map(|(at_ms, report)| json!({"at_ms": at_ms, "report": report}))
                .collect::<Vec<_>>(),
        ),
        Err(response) => response,
    }
}

fn escape(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '<' => "&lt;".into(),
            '>' => "&gt;".into(),
            '&' => "&amp;".into(),
            '"' => "&quot;".into(),
            '\'' => "&#39;".into(),
            c => c.to_string(),
        })
        .collect()
}

/// The status page: every cluster, its desired state (keys counted, never shown) and its
/// nodes. It shows no secret, so it needs no token.
async fn status_page(state: web::Data<State>) -> HttpResponse {
    let views = match all_views(&state).await {
        Ok(views) => views,
        Err(response) => return response,
    };
    let now = now_ms();
    let mut html = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>moe-node control plane</title>\
         <meta http-equiv=\"refresh\" content=\"10\"><style>body{font-family:sans-serif;margin:2em}\
         table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}\
         .stale{background:#fde2a8}.reporting{background:#d4f5d4}</style></head><body>\
         <h1>moe-node control plane</h1>",
    );
    if views.is_empty() {
        html.push_str("<p>No cluster yet: no node has registered and no desired state is set.</p>");
    }
    for (name, desired, nodes) in views {
        html.push_str(&format!(
            "<h2>Cluster {}</h2><p>Desired state v{}: model {} {}, replication {}, rebalance every {}, {} API keys accepted.</p>",
            escape(&name),
            desired.version,
            escape(if desired.model_name.is_empty() { "(any)" } else { &desired.model_name }),
            escape(&desired.model_fingerprint),
            desired.replication.map(|r| r.to_string()).unwrap_or_else(|| "(node's own)".into()),
            desired.rebalance_interval_seconds.map(|s| format!("{s} s")).unwrap_or_else(|| "(node's own)".into()),
            desired.api_keys.len(),
        ));
        html.push_str(
            "<table><tr><th>node</th><th>status</th><th>last report</th><th>phase</th><th>model</th>\
             <th>in flight</th><th>devices up</th><th>placement</th><th>imbalance</th><th>desired applied</th></tr>",
        );
        for (n, stale) in nodes {
            let r = &n.report;
            html.push_str(&format!(
                "<tr class=\"{class}\"><td>{}</td><td>{class}</td><td>{:.0} s ago</td><td>{}</td><td>{} {}</td>\
                 <td>{}</td><td>{}/{}</td><td>{}</td><td>{:.2}</td><td>v{}</td></tr>",
                escape(&n.node),
                (now - n.last_seen_ms) as f64 / 1000.0,
                escape(&r.phase),
                escape(&r.model),
                escape(&r.model_fingerprint),
                r.in_flight,
                r.devices_up,
                r.devices,
                r.placement_version.map(|v| format!("v{v}")).unwrap_or_else(|| "-".into()),
                r.imbalance,
                r.desired_version,
                class = if stale { "stale" } else { "reporting" },
            ));
        }
        html.push_str("</table>");
    }
    html.push_str("<p>Stale: not heard from lately. Gossip, not this page, decides whether a node is dead; nodes serve without the control plane.</p></body></html>");
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .body(html)
}
