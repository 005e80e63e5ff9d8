//! Credentials the configuration names, read and checked before the node starts: PEM
//! certificates, keys and trust anchors (rustls' PEM reader), and API keys kept as their
//! SHA-256. Every problem names the configuration key and the file.

use std::path::Path;

use rustls::RootCertStore;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

fn pem_problem(key: &str, path: &Path, what: &str, e: pem::Error) -> String {
    match e {
        pem::Error::Io(e) => format!("{key}: cannot read {}: {e}", path.display()),
        pem::Error::NoItemsFound => {
            format!("{key}: {} holds no PEM {what}", path.display())
        }
        e => format!("{key}: {} is not valid PEM: {e}", path.display()),
    }
}

/// The certificates (PEM, one or more) in `path`, for config key `key`.
pub fn read_certificates(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let what = "certificate (-----BEGIN CERTIFICATE-----)";
    let certificates = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| pem_problem(key, path, what, e))?;
    if certificates.is_empty() {
        return Err(pem_problem(key, path, what, pem::Error::NoItemsFound));
    }
    Ok(certificates)
}

/// The private key (PEM: PKCS#8, PKCS#1 or SEC1) in `path`, for config key `key`.
pub fn read_private_key(key: &str, path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| pem_problem(key, path, "private key (-----BEGIN PRIVATE KEY-----)", e))
}

/// The trust anchors in the CA file `path`, for config key `key`.
pub fn read_roots(key: &str, path: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(read_certificates(key, path)?);
    if added == 0 {
        return Err(format!(
            "{key}: no certificate in {} can be a trust anchor",
            path.display()
        ));
    }
    Ok(roots)
}

/// SHA-256 of `text`, as lowercase hex.
pub fn sha256_hex(text: &str) -> String {
    hex(&Sha256::digest(text.as_bytes()))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `text` looks like a SHA-256 in hex.
pub fn is_sha256_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit())
}
