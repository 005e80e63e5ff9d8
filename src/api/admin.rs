//! Admin endpoints: the expert table (activations, replicas, devices) and the devices, with
//! a way to take one out of service.

use actix_web::{HttpResponse, web};
use serde_json::json;

use super::{ApiError, AppState};

/// `GET /admin/experts`: per MoE layer and expert, activations so far and the devices
/// holding its replicas.
pub async fn experts(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    let node = &served.node;
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

/// `GET /admin/devices`: every device, whether it is alive, what it holds.
pub async fn devices(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    let node = &served.node;
    let alive = node.experts.devices_alive();
    let devices: Vec<_> = node
        .devices
        .iter()
        .map(|d| {
            json!({
                "id": d.id,
                "kind": d.kind(),
                "gpu": d.gpu,
                "name": d.name,
                "alive": alive[d.id],
                "experts": d.experts_held,
                "weight_bytes": d.weight_bytes,
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({"devices": devices})))
}

/// `POST /admin/devices/{id}/stop`: takes a device out of service, as if it had failed.
/// Its experts are served by their other replicas; experts without one become unavailable.
pub async fn stop_device(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let served = state.admitting()?;
    let id: usize = path
        .parse()
        .map_err(|_| ApiError::bad_request(format!("`{path}` is not a device id")))?;
    served
        .node
        .stop_device(id)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    tracing::warn!(device = id, "device stopped by an operator");
    Ok(HttpResponse::Ok().json(json!({"device": id, "stopped": true})))
}
