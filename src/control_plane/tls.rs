//! TLS for control-plane peering (rustls with its aws-lc-rs provider): the control plane's
//! server config (from the PEM files `crate::config::credentials` reads), and the verifier that logs the client
//! certificates it refuses. Every problem names the configuration key and the file.

use std::path::Path;
use std::sync::Arc;

use crate::config::credentials::{read_certificates, read_private_key, read_roots};
use rustls::DistinguishedName;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use rustls::{DigitallySignedStruct, SignatureScheme};

pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The control plane's TLS configuration: its certificate chain and key, and when
/// `client_ca` is given, client certificates asked for and checked against it. A
/// connection without one is let through the handshake so that the request can be refused
/// with a message that says why (see `server.rs`); a certificate that does not verify
/// ends the handshake, and is logged.
pub fn server_config(
    certificate: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<ServerConfig, String> {
    let chain = read_certificates("tls_certificate", certificate)?;
    let private_key = read_private_key("tls_key", key)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let builder = match client_ca {
        Some(ca) => {
            let roots = read_roots("tls_client_ca", ca)?;
            let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .allow_unauthenticated()
                .build()
                .map_err(|e| format!("tls_client_ca: {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(Arc::new(LoggingClientVerifier { inner }))
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, private_key).map_err(|e| {
        format!(
            "tls_certificate, tls_key: {} and {} do not make a usable pair: {e}",
            certificate.display(),
            key.display()
        )
    })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// Checks client certificates against `tls_client_ca` (webpki) and logs each one it
/// refuses: rustls itself would only send the client an alert.
#[derive(Debug)]
struct LoggingClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
}

impl ClientCertVerifier for LoggingClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner
            .verify_client_cert(end_entity, intermediates, now)
            .inspect_err(|e| {
                tracing::warn!(
                    error = %e,
                    "refused a TLS connection: the client certificate is not signed by tls_client_ca (or has expired)"
                )
            })
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_and_empty_files_are_named_with_their_key() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let e = read_certificates("control_plane.ca", &missing).unwrap_err();
        assert!(
            e.starts_with("control_plane.ca: cannot read ") && e.contains("missing.pem"),
            "{e}"
        );
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n").unwrap();
        let e = read_certificates("tls_certificate", &garbage).unwrap_err();
        assert!(e.contains("holds no PEM certificate"), "{e}");
        let e = read_private_key("tls_key", &garbage).unwrap_err();
        assert!(
            e.contains("tls_key:") && e.contains("no PEM private key"),
            "{e}"
        );
        let e = server_config(&garbage, &garbage, None).unwrap_err();
        assert!(e.starts_with("tls_certificate:"), "{e}");
    }
}
