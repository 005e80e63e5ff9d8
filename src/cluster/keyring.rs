//! The gossip keyring: every membership datagram is sealed with AES-256-GCM.
//!
//! Key derivation: the 256-bit key of a cluster secret is
//! `SHA-256("moe-node gossip v1\0" || secret)`. The prefix keeps this key distinct from
//! anything else derived from the same secret (the peer handshake's HMAC uses it raw).
//!
//! Datagram layout: `nonce (12 random bytes) || ciphertext || tag (16 bytes)`. The first
//! secret seals; every secret is tried on open, so a secret is rotated by adding the new
//! one second, reloading every node, moving it first, reloading again, then dropping the
//! old (a reload hands the membership thread a new keyring: a dropped secret is refused
//! from its next datagram). The plaintext starts with the sender's stamp
//! ([`super::replay`]).

use aes_gcm::aead::{Aead, KeyInit};
use aes_gcm::{Aes256Gcm, Key, Nonce};
use rand::RngCore;
use sha2::{Digest, Sha256};

/// Bytes of the random nonce prepended to every datagram.
pub const NONCE_LEN: usize = 12;
/// Bytes of the authentication tag appended by AES-GCM.
pub const TAG_LEN: usize = 16;
/// What sealing adds to a plaintext.
pub const OVERHEAD: usize = NONCE_LEN + TAG_LEN;

const DERIVATION_PREFIX: &[u8] = b"moe-node gossip v1\0";

/// The cluster secrets, as ciphers. Never empty.
pub struct Keyring {
    ciphers: Vec<Aes256Gcm>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        formatter
            .debug_struct("Keyring")
            .field("keys", &self.ciphers.len())
            .finish()
    }
}

impl Keyring {
    /// Derives one cipher per secret; `None` when there is no secret or one is empty.
    pub fn new<S: AsRef<str>>(secrets: &[S]) -> Option<Keyring> {
        if secrets.is_empty() || secrets.iter().any(|secret| secret.as_ref().is_empty()) {
            return None;
        }
        let ciphers = secrets
            .iter()
            .map(|secret| {
                let mut hasher = Sha256::new();
                hasher.update(DERIVATION_PREFIX);
                hasher.update(secret.as_ref().as_bytes());
                let digest = hasher.finalize();
                Aes256Gcm::new(Key::<Aes256Gcm>::from_slice(digest.as_slice()))
            })
            .collect();
        Some(Keyring { ciphers })
    }

    /// Seals `plaintext` with the first secret and a fresh random nonce.
    pub fn seal(&self, plaintext: &[u8], rng: &mut impl RngCore) -> Option<Vec<u8>> {
        let cipher = self.ciphers.first()?;
        let mut nonce = [0u8; NONCE_LEN];
        rng.fill_bytes(&mut nonce);
        let sealed = cipher.encrypt(Nonce::from_slice(&nonce), plaintext).ok()?;
        let mut datagram = Vec::with_capacity(NONCE_LEN + sealed.len());
        datagram.extend_from_slice(&nonce);
        datagram.extend_from_slice(&sealed);
        Some(datagram)
    }

    /// Opens a datagram with whichever secret sealed it; `None` for anything that no secret
    /// authenticates (wrong secret, tampered, truncated, garbage).
    pub fn open(&self, datagram: &[u8]) -> Option<Vec<u8>> {
        if datagram.len() < OVERHEAD {
            return None;
        }
        let (nonce, sealed) = datagram.split_at(NONCE_LEN);
        let nonce = Nonce::from_slice(nonce);
        self.ciphers
            .iter()
            .find_map(|cipher| cipher.decrypt(nonce, sealed).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn rng() -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(7)
    }

    #[test]
    fn first_key_seals_and_any_key_opens() {
        let old = Keyring::new(&["key1"]).expect("keyring");
        let rotated = Keyring::new(&["key2", "key1"]).expect("keyring");
        let datagram = old.seal(b"hello", &mut rng()).expect("sealed");
        assert_eq!(rotated.open(&datagram).as_deref(), Some(&b"hello"[..]));
        // The rotated ring seals with key2, which the old ring cannot read.
        let newer = rotated.seal(b"hi", &mut rng()).expect("sealed");
        assert_eq!(old.open(&newer), None);
        assert_eq!(rotated.open(&newer).as_deref(), Some(&b"hi"[..]));
    }

    #[test]
    fn nonces_differ_between_datagrams() {
        let ring = Keyring::new(&["k"]).expect("keyring");
        let mut rng = rng();
        let first = ring.seal(b"same", &mut rng).expect("sealed");
        let second = ring.seal(b"same", &mut rng).expect("sealed");
        assert_ne!(first, second);
        assert_eq!(first.len(), 4 + OVERHEAD);
    }

    #[test]
    fn tampered_short_and_garbage_are_rejected() {
        let ring = Keyring::new(&["k"]).expect("keyring");
        let datagram = ring.seal(b"payload", &mut rng()).expect("sealed");
        for index in 0..datagram.len() {
            let mut tampered = datagram.clone();
            tampered[index] ^= 0x01;
            assert_eq!(ring.open(&tampered), None, "flipped byte {index}");
        }
        for len in 0..datagram.len() {
            assert_eq!(ring.open(&datagram[..len]), None, "truncated to {len}");
        }
        assert_eq!(ring.open(&[0u8; 200]), None);
        assert_eq!(ring.open(&[]), None);
        let wrong = Keyring::new(&["other"]).expect("keyring");
        assert_eq!(wrong.open(&datagram), None);
    }

    #[test]
    fn no_secret_or_an_empty_secret_is_refused() {
        assert!(Keyring::new::<&str>(&[]).is_none());
        assert!(Keyring::new(&["ok", ""]).is_none());
    }
}
