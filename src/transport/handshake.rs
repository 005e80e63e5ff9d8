//! The peer handshake messages, proofs and link keys: pure, no I/O (peer/link.rs drives them
//! over a stream).
//!
//! ```text
//! client -> server  ClientHello  "MOEH" version 1 fingerprint u64 nonce[16] id_len u16 id
//! server -> client  ServerHello  "MOEH" version 2 status u8 fingerprint u64 nonce[16]
//!                                id_len u16 id
//! client -> server  ClientProof  "MOEH" version 3 status u8 count u8 mac[32] × count
//! server -> client  Verdict      "MOEH" version 4 status u8 mac[32]
//! both, once Ok      LinkOffer    "MOEH" version 5 kind u8 len u32 address[len]
//!                                (kind 0: stay, len 0; else a LinkKind's code, 1 UCX)
//! both, after a path LinkReady    "MOEH" version 6 ready u8 (1: made, 0: failed)
//! both, last        LinkConfirm  "MOEH" version 7 mac[32]
//! ```
//!
//! The client proves itself first: its MAC is HMAC-SHA256(secret, "moe-node peer client" ||
//! transcript), the transcript being both nonces, both fingerprints and both node ids (each
//! id length-prefixed), one MAC per secret it holds (its own first, at most [`MAX_PROOFS`]),
//! so that nodes part-way through a rotation of secrets still meet. Only when one verifies
//! with a secret the server holds does the server prove itself, with HMAC-SHA256(that secret,
//! "moe-node peer server" || transcript || that client MAC) in its verdict. So
//! a client without the secret gets nothing computed from the secret and its own nonce (the
//! server hello is the server's fresh nonce and who it is): it cannot test a guessed secret
//! offline, only by connecting again. Neither proof can be replayed on another connection
//! (fresh nonces on both sides).
//!
//! Both sides then derive the link's two keys ([`link_keys`]) with HKDF-SHA256 from the
//! secret the proofs used, salted with both nonces, over the transcript: one key per
//! direction. Every byte of the link after the handshake travels in records sealed with them
//! (AES-256-GCM, a per-direction counter as the nonce: see `peer/seal.rs`), so an on-path
//! relay that alters, replays, reorders, drops or cuts records is found at the next record
//! and the link is closed. The link offers and ready bytes below travel before the link has
//! a path, so they are not sealed; instead each side ends the handshake with a MAC over all
//! of them as both sent them ([`negotiation_mac`], keyed from the same secret and transcript),
//! and the link is refused when the peer's MAC does not match what this side saw. An on-path
//! relay that strips, adds or changes an offer (to keep a link off UCX, or to learn whether a
//! changed address is used) is found before any frame travels, and counted as `integrity`.
//!
//! A status byte lets each side refuse with a reason the other can report: the server answers
//! a foreign model fingerprint with `WrongModel`, the client answers a server hello it cannot
//! use with `AuthFailed` (no MAC), the server's verdict says whether the client proof
//! verified, and the client refuses a server proof that does not verify (`WrongSecret`).
//!
//! Once authenticated, each side says what else could carry the link ([`LinkOffer`]): nothing
//! (the frames stay on this stream) or a path of some [`LinkKind`] (today UCX, at a worker
//! address) and its address, which the handshake carries without reading. Only when both
//! offer the same kind does each create its end toward the other's address and say whether
//! that worked (`LinkReady`); when both did, the frames travel over that path and this
//! stream stays open only to tell each side when the other is gone. No UCX listener is ever
//! exposed: nothing reaches UCX before the peer has proved it holds the cluster secret.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use thiserror::Error;

pub use super::LinkKind;

/// First bytes of every handshake message.
pub const HANDSHAKE_MAGIC: [u8; 4] = *b"MOEH";
/// The handshake version this build speaks. 3: a UCX link carries its bytes as active
/// messages (2 used UCX's stream API, which a 3 cannot read), so the two refuse each other
/// here, with a clear error, instead of linking and never hearing each other. 4: a UCX link
/// may carry a frame's rows as a message of their own (a 16-byte header), which a 3 takes
/// for a broken peer. 5: the client proves itself first and every byte after the handshake
/// travels in sealed records, which a 4 would take for bad frames. 6: both sides confirm the
/// link negotiation with a MAC (`LinkConfirm`), which a 5 does not send.
pub const HANDSHAKE_VERSION: u8 = 6;
/// Longest node id accepted.
pub const MAX_NODE_ID: usize = 255;
/// Size of a MAC.
pub const MAC_LEN: usize = 32;
/// Size of a nonce.
pub const NONCE_LEN: usize = 16;
/// Most client proofs one handshake carries (one per secret the client holds).
pub const MAX_PROOFS: usize = 8;
/// Size of each direction's link key (AES-256).
pub const KEY_LEN: usize = 32;

const TYPE_CLIENT_HELLO: u8 = 1;
const TYPE_SERVER_HELLO: u8 = 2;
const TYPE_CLIENT_PROOF: u8 = 3;
const TYPE_VERDICT: u8 = 4;
const TYPE_LINK_OFFER: u8 = 5;
const TYPE_LINK_READY: u8 = 6;
const TYPE_LINK_CONFIRM: u8 = 7;

/// Longest address a link offer may carry (a UCX worker address is a few hundred bytes).
pub const MAX_LINK_ADDRESS: usize = 64 * 1024;
/// Fixed part of a link offer after its preamble: kind, address length.
pub const LINK_OFFER_FIXED_LEN: usize = 5;
/// The kind byte of an offer of nothing more (every other kind is a [`LinkKind`]'s code).
const OFFER_STAY: u8 = 0;

/// Fixed part of a hello: magic, version, type.
pub const PREAMBLE_LEN: usize = 6;

/// Why a handshake failed (both sides report one of these).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HandshakeError {
    #[error(
        "the peer does not hold our cluster secret (its proof did not verify): check peer_secret on both nodes"
    )]
    WrongSecret,
    #[error(
        "the peer refused our proof: the cluster secrets differ, check peer_secret on both nodes"
    )]
    RefusedByPeer,
    #[error(
        "the peer serves a different model (fingerprint {theirs:#018x}, ours {ours:#018x}): load the same checkpoint on every node"
    )]
    WrongModel { ours: u64, theirs: u64 },
    #[error("not a moe-node peer (bad handshake magic {0:02x?})")]
    BadMagic([u8; 4]),
    #[error("handshake version {theirs} is not supported (this node speaks {ours})")]
    BadVersion { theirs: u8, ours: u8 },
    #[error("handshake did not finish within {0:?}")]
    Timeout(std::time::Duration),
    #[error("handshake protocol error: {0}")]
    Protocol(String),
    #[error("the peer closed the connection during the handshake")]
    Truncated,
    #[error("handshake I/O error: {0}")]
    Io(String),
    #[error("this node holds no cluster secret (cluster.secrets is empty or was removed)")]
    NoSecret,
    #[error(
        "the link offers were altered on the way (the peer's confirmation does not match what this node saw)"
    )]
    NegotiationAltered,
}

/// Status byte of the server hello, client proof and verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    WrongModel,
    AuthFailed,
}

impl Status {
    fn code(self) -> u8 {
        match self {
            Status::Ok => 0,
            Status::WrongModel => 1,
            Status::AuthFailed => 2,
        }
    }

    fn from_code(code: u8) -> Result<Self, HandshakeError> {
        match code {
            0 => Ok(Status::Ok),
            1 => Ok(Status::WrongModel),
            2 => Ok(Status::AuthFailed),
            other => Err(HandshakeError::Protocol(format!("unknown status {other}"))),
        }
    }
}

/// What each side says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub node_id: String,
    pub model_fingerprint: u64,
    pub nonce: [u8; NONCE_LEN],
}

/// The server's answer to a client hello: nothing in it depends on the secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerHello {
    pub status: Status,
    pub hello: Hello,
}

fn preamble(out: &mut Vec<u8>, kind: u8) {
    out.extend_from_slice(&HANDSHAKE_MAGIC);
    out.push(HANDSHAKE_VERSION);
    out.push(kind);
}

fn push_hello(out: &mut Vec<u8>, hello: &Hello) {
    out.extend_from_slice(&hello.model_fingerprint.to_le_bytes());
    out.extend_from_slice(&hello.nonce);
    let id = truncate_id(&hello.node_id);
    out.extend_from_slice(&(id.len() as u16).to_le_bytes());
    out.extend_from_slice(id);
}

fn truncate_id(id: &str) -> &[u8] {
    let bytes = id.as_bytes();
    &bytes[..bytes.len().min(MAX_NODE_ID)]
}

/// Encodes the client hello.
pub fn encode_client_hello(hello: &Hello) -> Vec<u8> {
    let mut out = Vec::new();
    preamble(&mut out, TYPE_CLIENT_HELLO);
    push_hello(&mut out, hello);
    out
}

/// Encodes the server hello.
pub fn encode_server_hello(reply: &ServerHello) -> Vec<u8> {
    let mut out = Vec::new();
    preamble(&mut out, TYPE_SERVER_HELLO);
    out.push(reply.status.code());
    push_hello(&mut out, &reply.hello);
    out
}

/// Encodes the client's proofs, one per secret it holds, its own first (at most
/// [`MAX_PROOFS`]; more are left out).
pub fn encode_client_proof(status: Status, macs: &[[u8; MAC_LEN]]) -> Vec<u8> {
    let macs = &macs[..macs.len().min(MAX_PROOFS)];
    let mut out = Vec::new();
    preamble(&mut out, TYPE_CLIENT_PROOF);
    out.push(status.code());
    // At most MAX_PROOFS, which fits a byte.
    out.push(macs.len() as u8);
    for mac in macs {
        out.extend_from_slice(mac);
    }
    out
}

/// Checks the count of proofs a client proof says follow.
pub fn parse_proof_count(count: u8) -> Result<usize, HandshakeError> {
    match usize::from(count) {
        count @ 1..=MAX_PROOFS => Ok(count),
        count => Err(HandshakeError::Protocol(format!(
            "{count} client proofs (1 to {MAX_PROOFS} are read)"
        ))),
    }
}

/// Encodes the server's verdict on the client proof and, when it verified, the server's
/// own proof (zeros otherwise).
pub fn encode_verdict(status: Status, mac: &[u8; MAC_LEN]) -> Vec<u8> {
    let mut out = Vec::new();
    preamble(&mut out, TYPE_VERDICT);
    out.push(status.code());
    out.extend_from_slice(mac);
    out
}

/// What a side offers to carry the link's frames once the handshake succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkOffer {
    /// Nothing but the handshake's own stream.
    Stay,
    /// A path of this kind, reaching this side at this address (what the path's transport
    /// gives, e.g. `ucp_worker_get_address`).
    Path { kind: LinkKind, address: Vec<u8> },
}

/// Encodes a link offer.
pub fn encode_link_offer(offer: &LinkOffer) -> Vec<u8> {
    let mut out = Vec::new();
    preamble(&mut out, TYPE_LINK_OFFER);
    let (kind, address): (u8, &[u8]) = match offer {
        LinkOffer::Stay => (OFFER_STAY, &[]),
        LinkOffer::Path { kind, address } => (kind.code(), address),
    };
    out.push(kind);
    out.extend_from_slice(&(address.len() as u32).to_le_bytes());
    out.extend_from_slice(address);
    out
}

/// Parses a link offer's kind and address length: the path's kind (`None`: stay), and how
/// many address bytes follow. A kind this build does not know is refused.
pub fn parse_link_offer_fixed(
    bytes: &[u8; LINK_OFFER_FIXED_LEN],
) -> Result<(Option<LinkKind>, usize), HandshakeError> {
    let len = u32::from_le_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
    match (bytes[0], LinkKind::from_code(bytes[0])) {
        (OFFER_STAY, _) if len == 0 => Ok((None, 0)),
        (_, Some(kind)) if (1..=MAX_LINK_ADDRESS).contains(&len) => Ok((Some(kind), len)),
        (kind, _) => Err(HandshakeError::Protocol(format!(
            "link offer of kind {kind} with a {len}-byte address"
        ))),
    }
}

/// The offer from a kind [`parse_link_offer_fixed`] accepted and its address bytes.
pub fn link_offer(kind: Option<LinkKind>, address: Vec<u8>) -> LinkOffer {
    match kind {
        Some(kind) => LinkOffer::Path { kind, address },
        None => LinkOffer::Stay,
    }
}

/// Encodes whether this side made its end of the offered link.
pub fn encode_link_ready(ready: bool) -> Vec<u8> {
    let mut out = Vec::new();
    preamble(&mut out, TYPE_LINK_READY);
    out.push(u8::from(ready));
    out
}

/// Parses a link-ready byte.
pub fn parse_link_ready(byte: u8) -> Result<bool, HandshakeError> {
    match byte {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(HandshakeError::Protocol(format!("link ready byte {other}"))),
    }
}

/// Checks the fixed preamble of a message of the expected type.
pub fn check_preamble(bytes: &[u8; PREAMBLE_LEN], expected_type: u8) -> Result<(), HandshakeError> {
    if bytes[..4] != HANDSHAKE_MAGIC {
        return Err(HandshakeError::BadMagic([
            bytes[0], bytes[1], bytes[2], bytes[3],
        ]));
    }
    if bytes[4] != HANDSHAKE_VERSION {
        return Err(HandshakeError::BadVersion {
            theirs: bytes[4],
            ours: HANDSHAKE_VERSION,
        });
    }
    if bytes[5] != expected_type {
        return Err(HandshakeError::Protocol(format!(
            "expected handshake message {expected_type}, got {}",
            bytes[5]
        )));
    }
    Ok(())
}

/// The message types, for [`check_preamble`].
pub mod message {
    pub const CLIENT_HELLO: u8 = super::TYPE_CLIENT_HELLO;
    pub const SERVER_HELLO: u8 = super::TYPE_SERVER_HELLO;
    pub const CLIENT_PROOF: u8 = super::TYPE_CLIENT_PROOF;
    pub const VERDICT: u8 = super::TYPE_VERDICT;
    pub const LINK_OFFER: u8 = super::TYPE_LINK_OFFER;
    pub const LINK_READY: u8 = super::TYPE_LINK_READY;
    pub const LINK_CONFIRM: u8 = super::TYPE_LINK_CONFIRM;
}

/// Size of the fixed hello fields after the preamble (fingerprint, nonce, id length).
pub const HELLO_FIXED_LEN: usize = 8 + NONCE_LEN + 2;

/// Parses the fixed hello fields; returns the fingerprint, nonce and the id length to read.
pub fn parse_hello_fixed(
    bytes: &[u8; HELLO_FIXED_LEN],
) -> Result<(u64, [u8; NONCE_LEN], usize), HandshakeError> {
    let mut fingerprint = [0u8; 8];
    fingerprint.copy_from_slice(&bytes[..8]);
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&bytes[8..8 + NONCE_LEN]);
    let id_len = usize::from(u16::from_le_bytes([bytes[24], bytes[25]]));
    if id_len > MAX_NODE_ID {
        return Err(HandshakeError::Protocol(format!(
            "node id of {id_len} bytes is over the limit of {MAX_NODE_ID}"
        )));
    }
    Ok((u64::from_le_bytes(fingerprint), nonce, id_len))
}

/// Parses a node id.
pub fn parse_id(bytes: Vec<u8>) -> Result<String, HandshakeError> {
    String::from_utf8(bytes).map_err(|_| HandshakeError::Protocol("node id is not UTF-8".into()))
}

/// Parses a status byte.
pub fn parse_status(code: u8) -> Result<Status, HandshakeError> {
    Status::from_code(code)
}

const SERVER_LABEL: &[u8] = b"moe-node peer server";
const CLIENT_LABEL: &[u8] = b"moe-node peer client";
const KEYS_LABEL: &[u8] = b"moe-node peer link keys v5";

/// What both proofs and the link keys cover besides the nonces' roles: both nonces, both
/// fingerprints, both node ids (length-prefixed).
fn transcript(client: &Hello, server: &Hello) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 * NONCE_LEN + 16 + 4 + 2 * MAX_NODE_ID);
    out.extend_from_slice(&client.nonce);
    out.extend_from_slice(&server.nonce);
    out.extend_from_slice(&client.model_fingerprint.to_le_bytes());
    out.extend_from_slice(&server.model_fingerprint.to_le_bytes());
    for id in [truncate_id(&client.node_id), truncate_id(&server.node_id)] {
        out.extend_from_slice(&(id.len() as u16).to_le_bytes());
        out.extend_from_slice(id);
    }
    out
}

fn keyed(secret: &[u8], label: &[u8], client: &Hello, server: &Hello) -> Hmac<Sha256> {
    // HMAC takes keys of any length, so this never fails; an empty key still gives a MAC.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| <Hmac<Sha256> as Mac>::new_from_slice(&[0]).expect("1-byte key"));
    mac.update(label);
    mac.update(&transcript(client, server));
    mac
}

/// The client's proof over the transcript (sent first).
pub fn client_mac(secret: &[u8], client: &Hello, server: &Hello) -> [u8; MAC_LEN] {
    keyed(secret, CLIENT_LABEL, client, server)
        .finalize()
        .into_bytes()
        .into()
}

/// Verifies the client's proof in constant time.
pub fn verify_client_mac(secret: &[u8], client: &Hello, server: &Hello, mac: &[u8]) -> bool {
    keyed(secret, CLIENT_LABEL, client, server)
        .verify_slice(mac)
        .is_ok()
}

fn server_keyed(
    secret: &[u8],
    client: &Hello,
    server: &Hello,
    client_proof: &[u8],
) -> Hmac<Sha256> {
    let mut mac = keyed(secret, SERVER_LABEL, client, server);
    mac.update(client_proof);
    mac
}

/// The server's proof, over the transcript and the client's proof it answers.
pub fn server_mac(
    secret: &[u8],
    client: &Hello,
    server: &Hello,
    client_proof: &[u8; MAC_LEN],
) -> [u8; MAC_LEN] {
    server_keyed(secret, client, server, client_proof)
        .finalize()
        .into_bytes()
        .into()
}

/// Verifies the server's proof in constant time.
pub fn verify_server_mac(
    secret: &[u8],
    client: &Hello,
    server: &Hello,
    client_proof: &[u8; MAC_LEN],
    mac: &[u8],
) -> bool {
    server_keyed(secret, client, server, client_proof)
        .verify_slice(mac)
        .is_ok()
}

/// The two keys of one link, one per direction (never the same: each seals its own
/// counter's records).
#[derive(Clone, PartialEq, Eq)]
pub struct LinkKeys {
    pub client_to_server: [u8; KEY_LEN],
    pub server_to_client: [u8; KEY_LEN],
    /// Keys the MACs that confirm the link negotiation ([`negotiation_mac`]).
    pub confirm: [u8; KEY_LEN],
    /// Which secret the link was made with ([`secret_digest`]): it closes once a reload
    /// removes that secret.
    pub secret: [u8; 32],
}

/// A digest that names a secret without holding it (SHA-256 of a label and the secret).
pub fn secret_digest(secret: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    let mut hash = Sha256::new();
    hash.update(b"moe-node secret id ");
    hash.update(secret);
    hash.finalize().into()
}

impl std::fmt::Debug for LinkKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LinkKeys(<redacted>)")
    }
}

/// The link keys both sides derive once the proofs verified: HKDF-SHA256 with both nonces as
/// the salt and the secret the proofs used as the key, over the transcript and a label per
/// direction.
pub fn link_keys(secret: &[u8], client: &Hello, server: &Hello) -> LinkKeys {
    let mut salt = [0u8; 2 * NONCE_LEN];
    salt[..NONCE_LEN].copy_from_slice(&client.nonce);
    salt[NONCE_LEN..].copy_from_slice(&server.nonce);
    let hkdf = hkdf::Hkdf::<Sha256>::new(Some(&salt), secret);
    let transcript = transcript(client, server);
    let derive = |direction: &[u8]| {
        let mut key = [0u8; KEY_LEN];
        // 32 bytes is far below HKDF-SHA256's limit of 255 × 32, so this never fails.
        hkdf.expand_multi_info(&[KEYS_LABEL, direction, &transcript], &mut key)
            .expect("32 bytes of HKDF-SHA256 output");
        key
    };
    LinkKeys {
        client_to_server: derive(b" client to server "),
        server_to_client: derive(b" server to client "),
        confirm: derive(b" negotiation confirm "),
        secret: secret_digest(secret),
    }
}

/// Which end of a link a side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// The link negotiation as one side saw it: each side's offer and, when both offered a path,
/// each side's ready byte. Both sides record the same bytes unless something on the way
/// changed them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Negotiation {
    pub client_offer: Vec<u8>,
    pub server_offer: Vec<u8>,
    /// `(client, server)` ready bytes, when the sides went that far.
    pub ready: Option<(bool, bool)>,
}

impl Negotiation {
    /// Records the two offers, ours and theirs, by side.
    pub fn offers(side: Side, ours: &LinkOffer, theirs: &LinkOffer) -> Self {
        let (ours, theirs) = (encode_link_offer(ours), encode_link_offer(theirs));
        let (client_offer, server_offer) = match side {
            Side::Client => (ours, theirs),
            Side::Server => (theirs, ours),
        };
        Negotiation {
            client_offer,
            server_offer,
            ready: None,
        }
    }

    /// Records the two ready bytes, ours and theirs, by side.
    pub fn readies(&mut self, side: Side, ours: bool, theirs: bool) {
        self.ready = Some(match side {
            Side::Client => (ours, theirs),
            Side::Server => (theirs, ours),
        });
    }
}

fn negotiation_keyed(keys: &LinkKeys, sender: Side, negotiation: &Negotiation) -> Hmac<Sha256> {
    // A 32-byte key: HMAC takes it as it is.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&keys.confirm).expect("32-byte key");
    mac.update(match sender {
        Side::Client => b"moe-node link confirm client",
        Side::Server => b"moe-node link confirm server",
    });
    for offer in [&negotiation.client_offer, &negotiation.server_offer] {
        mac.update(&(offer.len() as u32).to_le_bytes());
        mac.update(offer);
    }
    mac.update(&match negotiation.ready {
        None => [0, 0, 0],
        Some((client, server)) => [1, u8::from(client), u8::from(server)],
    });
    mac
}

/// The MAC `sender` sends to confirm the negotiation it saw (a label per side, so neither
/// side's MAC can be reflected back as the other's).
pub fn negotiation_mac(keys: &LinkKeys, sender: Side, negotiation: &Negotiation) -> [u8; MAC_LEN] {
    negotiation_keyed(keys, sender, negotiation)
        .finalize()
        .into_bytes()
        .into()
}

/// Verifies, in constant time, the peer's confirmation of the negotiation this side saw.
pub fn verify_negotiation_mac(
    keys: &LinkKeys,
    sender: Side,
    negotiation: &Negotiation,
    mac: &[u8],
) -> bool {
    negotiation_keyed(keys, sender, negotiation)
        .verify_slice(mac)
        .is_ok()
}

/// Encodes a link confirmation.
pub fn encode_link_confirm(mac: &[u8; MAC_LEN]) -> Vec<u8> {
    let mut out = Vec::new();
    preamble(&mut out, TYPE_LINK_CONFIRM);
    out.extend_from_slice(mac);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(id: &str, nonce: u8) -> Hello {
        Hello {
            node_id: id.into(),
            model_fingerprint: 0xabcd,
            nonce: [nonce; NONCE_LEN],
        }
    }

    #[test]
    fn proofs_verify_only_with_the_same_secret_and_transcript() {
        let (client, server) = (hello("a", 1), hello("b", 2));
        let proof = client_mac(b"secret", &client, &server);
        let mac = server_mac(b"secret", &client, &server, &proof);
        assert!(verify_server_mac(b"secret", &client, &server, &proof, &mac));
        assert!(!verify_server_mac(b"other", &client, &server, &proof, &mac));
        assert!(!verify_client_mac(b"secret", &client, &server, &mac));
        assert!(!verify_server_mac(
            b"secret",
            &hello("a", 3),
            &server,
            &proof,
            &mac
        ));
        assert!(!verify_server_mac(
            b"secret",
            &client,
            &server,
            &proof,
            &mac[..31]
        ));
        // The server's proof answers one client proof only.
        assert!(!verify_server_mac(
            b"secret",
            &client,
            &server,
            &[0; MAC_LEN],
            &mac
        ));
        assert!(verify_client_mac(b"secret", &client, &server, &proof));
        let empty = client_mac(b"", &client, &server);
        assert!(verify_client_mac(b"", &client, &server, &empty));
    }

    #[test]
    fn link_keys_differ_by_direction_secret_and_nonce() {
        let (client, server) = (hello("a", 1), hello("b", 2));
        let keys = link_keys(b"secret", &client, &server);
        assert_eq!(keys, link_keys(b"secret", &client, &server));
        assert_ne!(keys.client_to_server, keys.server_to_client);
        assert_ne!(keys, link_keys(b"other", &client, &server));
        assert_ne!(keys, link_keys(b"secret", &hello("a", 3), &server));
        assert_ne!(keys, link_keys(b"secret", &client, &hello("c", 2)));
        assert_eq!(format!("{keys:?}"), "LinkKeys(<redacted>)");
    }

    #[test]
    fn a_negotiation_confirms_only_as_both_sides_saw_it() {
        let keys = link_keys(b"secret", &hello("a", 1), &hello("b", 2));
        let ucx = LinkOffer::Path {
            kind: LinkKind::Ucx,
            address: vec![7; 40],
        };
        let mut client = Negotiation::offers(Side::Client, &ucx, &LinkOffer::Stay);
        let server = Negotiation::offers(Side::Server, &LinkOffer::Stay, &ucx);
        assert_eq!(client, server);
        let mac = negotiation_mac(&keys, Side::Client, &client);
        assert!(verify_negotiation_mac(&keys, Side::Client, &server, &mac));
        // Reflected back as the other side's, it does not verify.
        assert!(!verify_negotiation_mac(&keys, Side::Server, &server, &mac));
        // Another link's keys, a changed address byte, a stripped offer, a ready byte.
        let other = link_keys(b"secret", &hello("a", 3), &hello("b", 2));
        assert!(!verify_negotiation_mac(&other, Side::Client, &server, &mac));
        let mut changed = server.clone();
        changed.client_offer[PREAMBLE_LEN + LINK_OFFER_FIXED_LEN] ^= 1;
        assert!(!verify_negotiation_mac(&keys, Side::Client, &changed, &mac));
        let stripped = Negotiation::offers(Side::Server, &LinkOffer::Stay, &LinkOffer::Stay);
        assert!(!verify_negotiation_mac(
            &keys,
            Side::Client,
            &stripped,
            &mac
        ));
        client.readies(Side::Client, true, false);
        let mut server = server;
        server.readies(Side::Server, true, true);
        let mac = negotiation_mac(&keys, Side::Client, &client);
        assert!(!verify_negotiation_mac(&keys, Side::Client, &server, &mac));
        server.ready = Some((true, false));
        assert!(verify_negotiation_mac(&keys, Side::Client, &server, &mac));
        assert_eq!(
            encode_link_confirm(&mac)[..PREAMBLE_LEN],
            [b'M', b'O', b'E', b'H', HANDSHAKE_VERSION, 7]
        );
    }

    #[test]
    fn messages_parse_back() {
        let bytes = encode_client_hello(&hello("node-1", 9));
        let mut preamble = [0u8; PREAMBLE_LEN];
        preamble.copy_from_slice(&bytes[..PREAMBLE_LEN]);
        check_preamble(&preamble, message::CLIENT_HELLO).expect("preamble");
        assert!(check_preamble(&preamble, message::VERDICT).is_err());
        let mut fixed = [0u8; HELLO_FIXED_LEN];
        fixed.copy_from_slice(&bytes[PREAMBLE_LEN..PREAMBLE_LEN + HELLO_FIXED_LEN]);
        let (fingerprint, nonce, id_len) = parse_hello_fixed(&fixed).expect("fixed");
        assert_eq!((fingerprint, nonce, id_len), (0xabcd, [9; NONCE_LEN], 6));
        let id = parse_id(bytes[PREAMBLE_LEN + HELLO_FIXED_LEN..].to_vec()).expect("id");
        assert_eq!(id, "node-1");
        let mut wrong = preamble;
        wrong[4] = 3;
        assert_eq!(
            check_preamble(&wrong, message::CLIENT_HELLO),
            Err(HandshakeError::BadVersion {
                theirs: 3,
                ours: HANDSHAKE_VERSION
            })
        );
        fixed[24..26].copy_from_slice(&1000u16.to_le_bytes());
        assert!(parse_hello_fixed(&fixed).is_err());
    }

    #[test]
    fn link_offers_parse_back_and_bad_ones_are_refused() {
        let ucx = LinkOffer::Path {
            kind: LinkKind::Ucx,
            address: vec![7; 300],
        };
        for offer in [LinkOffer::Stay, ucx] {
            let bytes = encode_link_offer(&offer);
            let mut preamble = [0u8; PREAMBLE_LEN];
            preamble.copy_from_slice(&bytes[..PREAMBLE_LEN]);
            check_preamble(&preamble, message::LINK_OFFER).expect("preamble");
            let mut fixed = [0u8; LINK_OFFER_FIXED_LEN];
            fixed.copy_from_slice(&bytes[PREAMBLE_LEN..PREAMBLE_LEN + LINK_OFFER_FIXED_LEN]);
            let (kind, len) = parse_link_offer_fixed(&fixed).expect("fixed");
            let address = bytes[PREAMBLE_LEN + LINK_OFFER_FIXED_LEN..].to_vec();
            assert_eq!(len, address.len());
            assert_eq!(link_offer(kind, address), offer);
        }
        // The bytes the fuzz corpora and every deployed node speak: kind 1 is UCX.
        let ucx = LinkOffer::Path {
            kind: LinkKind::Ucx,
            address: vec![7, 8],
        };
        assert_eq!(
            encode_link_offer(&ucx),
            [
                b"MOEH".as_slice(),
                &[HANDSHAKE_VERSION, 5, 1, 2, 0, 0, 0, 7, 8]
            ]
            .concat()
        );
        assert_eq!(
            encode_link_offer(&LinkOffer::Stay),
            [b"MOEH".as_slice(), &[HANDSHAKE_VERSION, 5, 0, 0, 0, 0, 0]].concat()
        );
        let too_long = (MAX_LINK_ADDRESS as u32 + 1).to_le_bytes();
        for fixed in [
            [1, 0, 0, 0, 0],
            [2, 1, 0, 0, 0],
            [1, too_long[0], too_long[1], too_long[2], too_long[3]],
            [0, 1, 0, 0, 0],
            [9, 0, 0, 0, 0],
        ] {
            assert!(parse_link_offer_fixed(&fixed).is_err(), "{fixed:?}");
        }
    }
}
