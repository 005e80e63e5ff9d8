//! Admin endpoints: the expert table (activations, replicas, devices) and the devices, with
//! a way to take one out of service.

use actix_web::{HttpRequest, HttpResponse, web};
use serde_json::json;

use super::{ApiError, AppState, ServedModel, read_body};
use crate::placement::Profile;
use crate::placement::profile::fingerprint_hex;
use crate::rollout::rebalance::RebalanceError;

/// `GET /admin/experts`: per MoE layer and expert, activations so far and the devices
/// holding its replicas. With `?format=profile`, the activation profile instead (what
/// `moe-node plan --profile` reads): over the sliding window, or since start with
/// `&window=all`.
pub async fn experts(
    state: web::Data<AppState>,
    query: web::Query<std::collections::HashMap<String, String>>,
) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    let node = &served.node;
    match query.get("format").map(String::as_str) {
        None | Some("table") => {}
        Some("profile") => {
            let recent = match query.get("window").map(String::as_str) {
                None | Some("recent") => true,
                Some("all") => false,
                Some(other) => {
                    return Err(ApiError::bad_request(format!(
                        "window `{other}`: give `recent` (the last minute) or `all` (since start)"
                    )));
                }
            };
            return Ok(HttpResponse::Ok().json(profile(node, recent)));
        }
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "format `{other}`: give `profile`, or none for the expert table"
            )));
        }
    }
    let placement = node.experts.placement();
    let alive = node.experts.devices_alive();
    let layers: Vec<_> = (0..placement.num_layers())
        .filter(|&l| node.model.moe_layers[l])
        .map(|layer| {
            let load = node.load.layer(layer);
            let experts: Vec<_> = load
                .activations
                .iter()
                .enumerate()
                .map(|(expert, activations)| {
                    let replicas = placement.replicas(layer, expert as u32);
                    let devices: Vec<u16> = replicas.iter().map(|r| r.device).collect();
                    json!({
                        "expert": expert,
                        "activations": activations,
                        "replicas": replicas.len(),
                        "devices": devices,
                        "live_replicas": devices.iter().filter(|&&d| alive.get(d as usize).copied().unwrap_or(false)).count(),
                    })
                })
                .collect();
            json!({
                "layer": layer,
                "imbalance": load.imbalance(),
                "hot_experts": load.hot_experts(),
                "device_tokens": load.device_tokens,
                "experts": experts,
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({"layers": layers})))
}

/// The node's activation profile: per MoE layer, rows routed to each expert.
fn profile(node: &crate::node::Node, recent: bool) -> Profile {
    let mut window_seconds = node.load.uptime_seconds();
    let layers = (0..node.model.num_layers)
        .filter(|&l| node.model.moe_layers[l])
        .map(|layer| {
            let counts = if recent {
                let (load, seconds) = node.load.recent(layer);
                window_seconds = seconds;
                load.activations
            } else {
                node.load.layer(layer).activations
            };
            (layer.to_string(), counts)
        })
        .collect();
    Profile {
        layers,
        fingerprint: Some(fingerprint_hex(node.model_fingerprint())),
        window_seconds: Some(window_seconds),
    }
}

/// `GET /admin/devices`: every device, whether it is alive, what it holds.
pub async fn devices(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    let node = &served.node;
    let alive = node.experts.devices_alive();
    let devices: Vec<_> = node
        .experts
        .devices()
        .iter()
        .map(|d| {
            json!({
                "id": d.id,
                "kind": d.kind(),
                "gpu": d.gpu,
                "name": d.name,
                "alive": alive[d.id],
                "experts": d.experts_held(),
                "weight_bytes": d.weight_bytes(),
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({"devices": devices})))
}

/// What every admin action checks first: actions are enabled (`server.admin_actions`), the
/// request says it carries JSON (a browser cannot send that cross-site without asking
/// first), and its body, if any, is a JSON object.
async fn admin_action<'a>(
    state: &'a AppState,
    req: &HttpRequest,
    payload: web::Payload,
) -> Result<&'a ServedModel, ApiError> {
    admin_action_body(state, req, payload)
        .await
        .map(|(served, _)| served)
}

/// [`admin_action`], and the body (a JSON object, or empty).
async fn admin_action_body<'a>(
    state: &'a AppState,
    req: &HttpRequest,
    payload: web::Payload,
) -> Result<(&'a ServedModel, Vec<u8>), ApiError> {
    if !state.config.server.admin_actions {
        return Err(ApiError::forbidden(
            "admin actions are off on this node: set server.admin_actions = true (with \
             server.api_keys) to allow them",
        )
        .with_code("admin_actions_disabled"));
    }
    let content_type = req
        .headers()
        .get(actix_web::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let media = content_type.split(';').next().unwrap_or_default().trim();
    if !media.eq_ignore_ascii_case("application/json") {
        return Err(ApiError::unsupported_media_type(format!(
            "admin actions take `Content-Type: application/json`, not `{content_type}`"
        )));
    }
    let served = state.admitting()?;
    let body = read_body(payload, &state.config.server).await?;
    if !body.iter().all(u8::is_ascii_whitespace) {
        let _: serde_json::Map<String, serde_json::Value> = super::parse_json(&body)?;
    }
    Ok((served, body))
}

/// What `POST /admin/rebalance` takes: nothing (`{}`: the recent window), or the profile to
/// balance for (as `GET /admin/experts?format=profile` and `moe-node profile` give it).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RebalanceRequest {
    #[serde(default)]
    profile: Option<Profile>,
}

fn device_id(path: &str) -> Result<usize, ApiError> {
    path.parse()
        .map_err(|_| ApiError::bad_request(format!("`{path}` is not a device id")))
}

/// `POST /admin/devices/{id}/stop`: takes a device out of service, as if it had failed.
/// Its experts are served by their other replicas; experts without one become unavailable.
pub async fn stop_device(
    state: web::Data<AppState>,
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let served = admin_action(&state, &req, payload).await?;
    let id = device_id(&path)?;
    served
        .node
        .stop_device(id)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    tracing::warn!(device = id, "device stopped by an operator");
    Ok(HttpResponse::Ok().json(json!({"device": id, "stopped": true})))
}

/// `POST /admin/devices/{id}/start`: starts a stopped (or failed) device again: its experts
/// are loaded anew, and it takes work from the next step on.
pub async fn start_device(
    state: web::Data<AppState>,
    req: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    admin_action(&state, &req, payload).await?;
    let id = device_id(&path)?;
    let system = actix_web::rt::System::current();
    let app = state.clone();
    // Loading experts blocks: not on the HTTP runtime's threads.
    let started = web::block(move || {
        // The device actor starts an arbiter, which needs the system.
        actix_web::rt::System::set_current(system);
        match app.served() {
            Some(served) => served.node.start_device(id),
            None => Ok(()),
        }
    })
    .await
    .map_err(|_| ApiError::internal("starting the device was interrupted"))?;
    match started {
        Ok(()) => {
            tracing::warn!(device = id, "device started by an operator");
            Ok(HttpResponse::Ok().json(json!({"device": id, "started": true})))
        }
        Err(e @ crate::node::NodeError::DeviceRunning(_)) => Err(ApiError::conflict(e.to_string())),
        Err(e @ crate::node::NodeError::NoSuchDevice { .. }) => {
            Err(ApiError::bad_request(e.to_string()))
        }
        Err(e) => {
            tracing::error!(device = id, error = %e, "device could not be started");
            Err(ApiError::internal(format!(
                "device {id} could not be started: {e}"
            )))
        }
    }
}

/// `POST /admin/rebalance`: rebalances for the recent window, or for the `profile` given
/// (copies and moves), through placement versions while serving (copy, then switch, then
/// release); answers what it did.
pub async fn rebalance(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (_, body) = admin_action_body(&state, &req, payload).await?;
    let request: RebalanceRequest = if body.iter().all(u8::is_ascii_whitespace) {
        RebalanceRequest::default()
    } else {
        super::parse_json(&body)?
    };
    let system = actix_web::rt::System::current();
    let app = state.clone();
    // Loading experts blocks: not on the HTTP runtime's threads.
    let done = web::block(move || {
        actix_web::rt::System::set_current(system);
        app.served()
            .map(|served| served.node.rebalancer().rebalance(request.profile.as_ref()))
    })
    .await
    .map_err(|_| ApiError::internal("the rebalance was interrupted"))?;
    match done {
        Some(Ok(report)) => Ok(HttpResponse::Ok().json(report)),
        Some(Err(e @ (RebalanceError::Refused(_) | RebalanceError::NotLeader(_)))) => {
            Err(ApiError::conflict(e.to_string()))
        }
        Some(Err(e @ RebalanceError::BadProfile(_))) => Err(ApiError::bad_request(e.to_string())),
        Some(Err(e)) => {
            tracing::error!(error = %e, "rebalance failed");
            Err(ApiError::internal(format!("the rebalance failed: {e}")))
        }
        None => Err(ApiError::internal("the model is not served")),
    }
}

/// `GET /admin/cluster`: every member this node knows (itself included) with its state,
/// incarnation, addresses, when it was last heard from and the placement it serves; and
/// how dispatch rates each place it sends expert work to (reach, latency, rows in flight,
/// rows sent so far).
pub async fn cluster(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    let Some(joined) = &served.node.cluster else {
        return Ok(HttpResponse::Ok().json(json!({"members": [], "cluster": false})));
    };
    let now = std::time::Instant::now();
    let mut members: Vec<_> = joined
        .membership
        .members()
        .into_iter()
        .map(|m| {
            json!({
                "node": m.meta.node,
                "state": m.state,
                "incarnation": m.incarnation,
                "generation": m.generation,
                "api": m.meta.api.to_string(),
                "peer": m.meta.peer.to_string(),
                "gossip": m.gossip.to_string(),
                "devices": m.meta.devices,
                "last_heard_ms": now.saturating_duration_since(m.last_heard).as_millis() as u64,
                "placement_version": m.meta.placement_version,
                "loaded_version": m.meta.loaded_version,
                "placement_hash": format!("{:016x}", m.meta.placement_hash),
                "loaded_hash": format!("{:016x}", m.meta.loaded_hash),
                "expert_room_mib": (m.meta.expert_room != u64::MAX).then_some(m.meta.expert_room >> 20),
                "expert_mib": m.meta.expert_bytes as f64 / (1u64 << 20) as f64,
                "self": m.is_self,
            })
        })
        .collect();
    members.sort_by(|a, b| a["node"].as_str().cmp(&b["node"].as_str()));
    let experts = &served.node.experts;
    let placement = experts.placement();
    let sent: std::collections::HashMap<_, _> = experts.rows_sent().into_iter().collect();
    let targets: Vec<_> = experts
        .targets()
        .into_iter()
        .map(|(target, health)| {
            let node = match target {
                crate::experts::Target::Node(n) => {
                    placement.nodes().get(n as usize).map(|n| n.node.clone())
                }
                crate::experts::Target::Device(_) => None,
            };
            json!({
                "target": format!("{target:?}"),
                "node": node,
                "reach": health.reach,
                "latency_ms": health.latency_micros / 1000.0,
                "outstanding_rows": health.outstanding_rows,
                "rows_sent": sent.get(&target).copied().unwrap_or(0),
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "node": joined.node_id,
        "members": members,
        "dispatch": targets,
    })))
}

/// `GET /admin/placement`: the placement this node serves under: its spec (version,
/// replication, nodes; what a joining node takes) and, per MoE layer and expert, the
/// replicas as `{"node", "device"}`.
pub async fn placement(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let served = match state.admitting() {
        Ok(served) => served,
        // Still loading its share: the spec alone is what nodes starting with it need.
        Err(e) => match state.placements.current() {
            Some(placement) => {
                return Ok(HttpResponse::Ok().json(json!({
                    "version": placement.version(),
                    "spec": placement.spec(),
                    "layers": [],
                    "loading": true,
                })));
            }
            None => return Err(e),
        },
    };
    let placement = served.node.experts.placement();
    let nodes = placement.nodes();
    let layers: Vec<_> = (0..placement.num_layers())
        .filter(|&l| served.node.model.moe_layers[l])
        .map(|layer| {
            let experts: Vec<_> = (0..served.node.model.moe.num_experts as u32)
                .map(|expert| {
                    placement
                        .replicas(layer, expert)
                        .iter()
                        .map(|r| {
                            json!({
                                "node": nodes.get(r.node as usize).map(|n| n.node.as_str()),
                                "device": r.device,
                            })
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            json!({"layer": layer, "experts": experts})
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "version": placement.version(),
        "table_hash": format!("{:016x}", placement.table_hash()),
        "spec": placement.spec(),
        "layers": layers,
    })))
}
