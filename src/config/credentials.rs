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

/// An API key as a control plane hands it to nodes: a random salt and the SHA-256 of the
/// salt's hex followed by the key. The salt keeps two clusters' equal keys apart and makes
/// tables computed in advance useless; the key's own length (at least
/// [`SaltedKey::MIN_KEY_LEN`] characters, checked where keys are set) is what stands
/// against guessing a leaked hash, not the cost of the hash (a slow one would be paid on
/// every request a node checks).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SaltedKey {
    /// 16 random bytes, hex.
    pub salt: String,
    /// SHA-256 (hex) of `salt` (as written here) followed by the key.
    pub sha256: String,
}

impl SaltedKey {
    /// Shortest API key a control plane takes.
    pub const MIN_KEY_LEN: usize = 16;

    /// Salts and hashes `key` with a fresh random salt.
    pub fn new(key: &str) -> SaltedKey {
        let salt = hex(&rand::random::<[u8; 16]>());
        let sha256 = salted_sha256(&salt, key);
        SaltedKey { salt, sha256 }
    }

    /// Whether `offered` is the key, compared without stopping at the first difference.
    pub fn matches(&self, offered: &str) -> bool {
        let hashed = salted_sha256(&self.salt, offered);
        hashed.len() == self.sha256.len()
            && hashed
                .bytes()
                .zip(self.sha256.bytes())
                .fold(0u8, |diff, (x, y)| diff | (x ^ y.to_ascii_lowercase()))
                == 0
    }

    /// Whether the salt is 32 hex digits and the hash 64.
    pub fn is_well_formed(&self) -> bool {
        self.salt.len() == 32
            && self.salt.bytes().all(|b| b.is_ascii_hexdigit())
            && is_sha256_hex(&self.sha256)
    }
}

fn salted_sha256(salt: &str, key: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(salt.as_bytes());
    hasher.update(key.as_bytes());
    hex(&hasher.finalize())
}
