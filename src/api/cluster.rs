//! Endpoints other nodes of the cluster use.

use actix_web::{HttpResponse, web};

use super::{ApiError, AppState};

/// `GET /cluster/placement/{version}`: the whole placement table of that version, when this
/// node serves it or has it as the next one. A node joining the cluster, or following a
/// change of placement, takes it from here. Answered while the node still loads.
pub async fn placement(
    state: web::Data<AppState>,
    version: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let wanted: u64 = version
        .parse()
        .map_err(|_| ApiError::bad_request(format!("`{version}` is not a placement version")))?;
    let placement = state.placements.get(wanted).ok_or_else(|| ApiError {
        status: actix_web::http::StatusCode::NOT_FOUND,
        kind: "not_found_error",
        message: format!(
            "this node neither serves nor loads placement version {wanted}; ask a member \
             whose gossip metadata announces it"
        ),
        param: None,
        code: None,
    })?;
    Ok(HttpResponse::Ok().json(placement.to_table()))
}
