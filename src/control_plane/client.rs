//! The node's side of a control plane (`[control_plane]`): outbound only. On its own
//! thread it registers, then heartbeats with the node's report; each answer carries the
//! cluster's desired state, whose live parts (accepted API keys, rebalancing interval) are
//! applied at once. An answer that does not prove the control plane knows this node's
//! token is ignored. When the control plane cannot be reached the node keeps serving on
//! what it last knew and tries again with exponential backoff and jitter.

use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use reqwest::StatusCode;

use crate::config::ControlPlaneSection;
use crate::config::live::LiveSettings;
use crate::control_plane::identity;
use crate::control_plane::wire::{self, Answer, DesiredState, Report};

/// The longest wait between tries while the control plane does not answer.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Why an exchange with the control plane did not give a desired state.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("unreachable: {0}")]
    Unreachable(String),
    #[error(
        "it refused this node's token ({0}): check control_plane.token against the control plane's node_token_sha256"
    )]
    Refused(StatusCode),
    #[error(
        "its answer does not prove it knows this node's token: ignored (another service, or a control plane set up with other tokens)"
    )]
    NoProof,
    #[error("it refused this node ({0}): {1}")]
    Forbidden(StatusCode, String),
    #[error("{0}")]
    Tls(String),
    #[error("it answered {0}: {1}")]
    Failed(StatusCode, String),
}

/// The HTTP client for the control plane: over https://, the CA of `control_plane.ca`
/// alone is trusted (else the system's), and `client_certificate` is presented when set.
pub fn http_client(config: &ControlPlaneSection) -> Result<reqwest::blocking::Client, String> {
    let mut builder = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(10))
        .tls_backend_rustls();
    if !config.ca.is_empty() {
        let pem = std::fs::read(&config.ca)
            .map_err(|e| format!("control_plane.ca: cannot read {}: {e}", config.ca))?;
        let roots = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| format!("control_plane.ca: {}: {e}", config.ca))?;
        builder = builder.tls_certs_only(roots);
    }
    if let Some(pem) = config.tls_identity()? {
        let identity = reqwest::Identity::from_pem(&pem).map_err(|e| {
            format!("control_plane.client_certificate, client_key: not a usable pair: {e}")
        })?;
        builder = builder.identity(identity);
    }
    builder
        .build()
        .map_err(|e| format!("cannot make an HTTP client: {}", error_chain(&e)))
}

/// An error and its causes, on one line.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// The TLS error under a failed request, if TLS is what failed. An `io::Error` hands on
/// its inner error's source, not the inner error itself, and hyper-rustls wraps the
/// rustls error in two of them: each is opened here.
fn tls_cause<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    if let Some(tls) = e.downcast_ref::<rustls::Error>() {
        return Some(tls);
    }
    e.downcast_ref::<std::io::Error>()
        .and_then(|io| io.get_ref())
        .and_then(|inner| tls_cause(inner))
        .or_else(|| e.source().and_then(tls_cause))
}

/// What a failed send means: a TLS failure says which side refused what.
fn send_error(e: reqwest::Error) -> ExchangeError {
    let chain = error_chain(&e);
    match tls_cause(&e) {
        Some(rustls::Error::InvalidCertificate(why)) => ExchangeError::Tls(format!(
            "this node does not trust the control plane's certificate ({why:?}): set \
             control_plane.ca to the CA that signed it ({chain})"
        )),
        Some(rustls::Error::AlertReceived(alert)) => ExchangeError::Tls(format!(
            "the control plane ended the TLS handshake ({alert:?}): it refused this node's \
             client certificate (control_plane.client_certificate must be signed by its \
             tls_client_ca) ({chain})"
        )),
        Some(other) => ExchangeError::Tls(format!(
            "TLS with the control plane failed: {other} ({chain})"
        )),
        None => ExchangeError::Unreachable(chain),
    }
}

/// The wait before try number `failures` (1 after the first failure): doubling from one
/// second up to [`MAX_BACKOFF`], then scaled by a random factor in [0.5, 1.5) so that
/// nodes cut off together do not all come back at the same instant.
pub fn backoff(failures: u32, jitter: f64) -> Duration {
    let base = Duration::from_secs(1)
        .saturating_mul(1u32 << failures.saturating_sub(1).min(6))
        .min(MAX_BACKOFF);
    base.mul_f64(0.5 + jitter.clamp(0.0, 1.0))
}

/// Starts the client on its own thread. `report` says how the node is now.
pub fn start(
    config: ControlPlaneSection,
    node_name: String,
    live: Arc<LiveSettings>,
    report: Box<dyn Fn() -> Report + Send>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("moe-node-control-plane".into())
        .spawn(move || run(config, node_name, live, report))
        .map(|_| ())
}

fn run(
    config: ControlPlaneSection,
    node_name: String,
    live: Arc<LiveSettings>,
    report: Box<dyn Fn() -> Report + Send>,
) {
    let url = config.url.trim_end_matches('/').to_string();
    let client = match http_client(&config) {
        Ok(client) => client,
        Err(e) => {
            tracing::error!(error = %e, "no control plane");
            return;
        }
    };
    warn_unless_certificate_names(&config, &node_name);
    let token_sha256 = wire::sha256_hex(&config.token);
    let mut registered = false;
    let mut failures = 0u32;
    let mut applied = DesiredState::default();
    loop {
        let mut now = report();
        now.cluster = config.cluster.clone();
        now.node = node_name.clone();
        now.desired_version = applied.version;
        let path = if registered { "heartbeat" } else { "register" };
        match exchange(&client, &url, path, &config.token, &token_sha256, &now) {
            Ok(answer) => {
                if !registered {
                    tracing::info!(%url, cluster = %config.cluster, node = %node_name, "registered with the control plane");
                } else if failures > 0 {
                    tracing::info!(%url, "the control plane answers again");
                }
                registered = true;
                failures = 0;
                if answer.desired != applied {
                    apply(&live, &answer.desired, &now);
                    applied = answer.desired;
                }
                std::thread::sleep(Duration::from_secs(config.heartbeat_seconds));
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                let wait = backoff(failures, rand::rng().random::<f64>());
                match &e {
                    ExchangeError::Unreachable(_) | ExchangeError::Failed(..) => {
                        tracing::warn!(%url, error = %e, retry_seconds = wait.as_secs_f32(), "control plane: serving on the last known state")
                    }
                    ExchangeError::Refused(_)
                    | ExchangeError::Forbidden(..)
                    | ExchangeError::Tls(_)
                    | ExchangeError::NoProof => {
                        tracing::error!(%url, retry_seconds = wait.as_secs_f32(), "control plane: {e}")
                    }
                }
                std::thread::sleep(wait);
            }
        }
    }
}

/// Says at start when this node's client certificate does not carry the name it reports
/// under: the control plane would refuse every report.
fn warn_unless_certificate_names(config: &ControlPlaneSection, node: &str) {
    if config.client_certificate.is_empty() {
        return;
    }
    let path = std::path::Path::new(&config.client_certificate);
    let names =
        crate::config::credentials::read_certificates("control_plane.client_certificate", path)
            .ok()
            .and_then(|chain| chain.first().map(|c| identity::certificate_names(c)))
            .unwrap_or_default();
    if !names.iter().any(|(c, n)| *c == config.cluster && n == node) {
        tracing::error!(
            certificate = %config.client_certificate,
            "control_plane.client_certificate does not name this node: it needs the subject \
             alternative name URI {}{}/{node} (a control plane with tls_client_ca refuses reports \
             under any other name)",
            identity::URI_PREFIX,
            config.cluster
        );
    }
}

fn exchange(
    client: &reqwest::blocking::Client,
    url: &str,
    path: &str,
    token: &str,
    token_sha256: &str,
    report: &Report,
) -> Result<Answer, ExchangeError> {
    let nonce = wire::hex(&rand::rng().random::<[u8; 16]>());
    let response = client
        .post(format!("{url}/api/v1/{path}"))
        .bearer_auth(token)
        .header(wire::NONCE_HEADER, &nonce)
        .json(report)
        .send()
        .map_err(send_error)?;
    let status = response.status();
    if status == StatusCode::UNAUTHORIZED {
        return Err(ExchangeError::Refused(status));
    }
    if status == StatusCode::FORBIDDEN {
        let why = response
            .json::<serde_json::Value>()
            .ok()
            .and_then(|body| body["error"].as_str().map(str::to_string))
            .unwrap_or_default();
        return Err(ExchangeError::Forbidden(status, why));
    }
    let proof = response
        .headers()
        .get(wire::PROOF_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = response
        .bytes()
        .map_err(|e| ExchangeError::Unreachable(e.to_string()))?;
    if !status.is_success() {
        let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
        return Err(ExchangeError::Failed(status, text));
    }
    if proof.as_deref() != Some(wire::proof(token_sha256, &nonce, &body).as_str()) {
        return Err(ExchangeError::NoProof);
    }
    serde_json::from_slice(&body).map_err(|e| {
        ExchangeError::Failed(status, format!("the answer is not a desired state: {e}"))
    })
}

/// Applies the live parts of a new desired state and says what it does not apply.
fn apply(live: &LiveSettings, desired: &DesiredState, report: &Report) {
    live.set_control_plane_api_keys(desired.api_keys.clone());
    if let Some(seconds) = desired.rebalance_interval_seconds {
        live.set_rebalance_interval_seconds(seconds);
    }
    tracing::info!(
        version = desired.version,
        api_keys = desired.api_keys.len(),
        rebalance_interval_seconds = ?desired.rebalance_interval_seconds,
        "desired state from the control plane applied"
    );
    let other_model = (!desired.model_name.is_empty() && desired.model_name != report.model)
        || (!desired.model_fingerprint.is_empty()
            && !report.model_fingerprint.is_empty()
            && desired.model_fingerprint != report.model_fingerprint);
    if other_model {
        tracing::warn!(
            desired = %format!("{} {}", desired.model_name, desired.model_fingerprint),
            serving = %format!("{} {}", report.model, report.model_fingerprint),
            "the control plane wants another model: that needs model.path changed and a restart"
        );
    }
    if desired.replication.is_some() || !desired.placement_overrides.is_null() {
        tracing::info!(
            "the desired replication and placement overrides are recorded at the control plane; this node keeps its own (cluster.replication)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_minute_with_jitter_around_it() {
        assert_eq!(backoff(1, 0.5), Duration::from_secs(1));
        assert_eq!(backoff(3, 0.5), Duration::from_secs(4));
        assert_eq!(backoff(30, 0.5), MAX_BACKOFF);
        assert_eq!(backoff(3, 0.0), Duration::from_secs(2));
        assert!(backoff(30, 1.0) <= Duration::from_secs(90));
    }
}
