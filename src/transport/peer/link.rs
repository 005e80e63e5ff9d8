//! How a connection becomes a link: both sides prove they hold the cluster secret (the
//! messages of [`crate::transport::handshake`], driven here over the stream), then agree on
//! what carries the link's frames: the stream itself, or the faster path a transport offers
//! ([`crate::transport::LinkUpgrade`]) when both sides offer it and both reach it.

use std::net::SocketAddr;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::PeerAuth;
use crate::transport::handshake::{
    self, HandshakeError, Hello, LinkKeys, LinkOffer, MAC_LEN, Negotiation, Side, Status,
};
use crate::transport::{PeerStream, Transport};

fn io_error(error: std::io::Error) -> HandshakeError {
    if error.kind() == std::io::ErrorKind::UnexpectedEof {
        HandshakeError::Truncated
    } else {
        HandshakeError::Io(error.to_string())
    }
}

async fn read_array<const N: usize, S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<[u8; N], HandshakeError> {
    let mut bytes = [0u8; N];
    stream.read_exact(&mut bytes).await.map_err(io_error)?;
    Ok(bytes)
}

async fn read_hello<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Hello, HandshakeError> {
    let fixed = read_array::<{ handshake::HELLO_FIXED_LEN }, _>(stream).await?;
    let (model_fingerprint, nonce, id_len) = handshake::parse_hello_fixed(&fixed)?;
    let mut id = vec![0u8; id_len];
    stream.read_exact(&mut id).await.map_err(io_error)?;
    Ok(Hello {
        node_id: handshake::parse_id(id)?,
        model_fingerprint,
        nonce,
    })
}

async fn write<S: AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8]) -> Result<(), HandshakeError> {
    stream.write_all(bytes).await.map_err(io_error)?;
    stream.flush().await.map_err(io_error)
}

fn our_hello(auth: &PeerAuth) -> Hello {
    Hello {
        node_id: auth.node_id.clone(),
        model_fingerprint: auth.model_fingerprint,
        nonce: rand::random(),
    }
}

/// The client half of the handshake, offering no other path (the frames stay on `stream`,
/// sealed with the keys returned); returns the server's node id and the link's keys. Public
/// so that tests and tools can speak frames of their own to a server (see
/// [`super::seal::sealed_halves`]).
pub async fn client_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    auth: &PeerAuth,
) -> Result<(String, LinkKeys), HandshakeError> {
    let (server_id, keys) = client_authenticate(stream, auth).await?;
    stay(stream, &keys, Side::Client).await?;
    Ok((server_id, keys))
}

/// The server half of the handshake, offering no other path; returns the client's node id
/// and the link's keys. Public for the handshake fuzz target.
pub async fn server_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    auth: &PeerAuth,
) -> Result<(String, LinkKeys), HandshakeError> {
    let (client_id, keys) = server_authenticate(stream, auth).await?;
    stay(stream, &keys, Side::Server).await?;
    Ok((client_id, keys))
}

/// Offers no other path, reads the peer's offer and confirms the two.
async fn stay<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    keys: &LinkKeys,
    side: Side,
) -> Result<(), HandshakeError> {
    let theirs = exchange_offers(stream, &LinkOffer::Stay).await?;
    let negotiation = Negotiation::offers(side, &LinkOffer::Stay, &theirs);
    confirm(stream, keys, side, &negotiation).await
}

/// Sends our link offer and reads the peer's.
async fn exchange_offers<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    ours: &LinkOffer,
) -> Result<LinkOffer, HandshakeError> {
    write(stream, &handshake::encode_link_offer(ours)).await?;
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(stream).await?;
    handshake::check_preamble(&preamble, handshake::message::LINK_OFFER)?;
    let fixed = read_array::<{ handshake::LINK_OFFER_FIXED_LEN }, _>(stream).await?;
    let (kind, len) = handshake::parse_link_offer_fixed(&fixed)?;
    let mut address = vec![0u8; len];
    stream.read_exact(&mut address).await.map_err(io_error)?;
    Ok(handshake::link_offer(kind, address))
}

/// Sends our MAC over the negotiation as we saw it and checks the peer's: the last message
/// of the handshake, on the stream it began on, before any frame travels.
async fn confirm<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    keys: &LinkKeys,
    side: Side,
    negotiation: &Negotiation,
) -> Result<(), HandshakeError> {
    let ours = handshake::negotiation_mac(keys, side, negotiation);
    write(stream, &handshake::encode_link_confirm(&ours)).await?;
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(stream).await?;
    handshake::check_preamble(&preamble, handshake::message::LINK_CONFIRM)?;
    let theirs = read_array::<MAC_LEN, _>(stream).await?;
    let peer = match side {
        Side::Client => Side::Server,
        Side::Server => Side::Client,
    };
    if handshake::verify_negotiation_mac(keys, peer, negotiation, &theirs) {
        Ok(())
    } else {
        Err(HandshakeError::NegotiationAltered)
    }
}

/// After both sides authenticated: each offers what else could carry the link, and the link
/// moves there when both offer it and both make their end; otherwise it stays on `stream`.
/// Both sides then confirm what they saw ([`confirm`]). Returns the link's stream and the
/// name of its path ("tcp" when it stays).
pub(super) async fn negotiate_link(
    mut stream: Box<dyn PeerStream>,
    transport: &dyn Transport,
    peer: SocketAddr,
    keys: &LinkKeys,
    side: Side,
) -> Result<(Box<dyn PeerStream>, &'static str), HandshakeError> {
    let upgrade = transport.upgrade().await.unwrap_or_else(|error| {
        tracing::warn!(%peer, %error, "cannot offer this peer link UCX: it stays on TCP");
        None
    });
    let ours = match &upgrade {
        Some(upgrade) => LinkOffer::Path {
            kind: upgrade.kind(),
            address: upgrade.address().to_vec(),
        },
        None => LinkOffer::Stay,
    };
    let theirs = exchange_offers(&mut stream, &ours).await?;
    let mut negotiation = Negotiation::offers(side, &ours, &theirs);
    let (mut upgrade, address) = match (upgrade, theirs) {
        (Some(upgrade), LinkOffer::Path { kind, address }) if kind == upgrade.kind() => {
            (upgrade, address)
        }
        // The peer offers nothing, or a path of another kind.
        (Some(upgrade), _) => {
            tracing::info!(
                %peer,
                "peer link stays on TCP: the peer offers no {} (its peer.transport is \"tcp\", or UCX does not load there)",
                upgrade.kind().name()
            );
            confirm(&mut stream, keys, side, &negotiation).await?;
            return Ok((stream, "tcp"));
        }
        (None, _) => {
            confirm(&mut stream, keys, side, &negotiation).await?;
            return Ok((stream, "tcp"));
        }
    };
    let made = upgrade.connect(&address).await;
    write(&mut stream, &handshake::encode_link_ready(made.is_ok())).await?;
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(&mut stream).await?;
    handshake::check_preamble(&preamble, handshake::message::LINK_READY)?;
    let [ready] = read_array::<1, _>(&mut stream).await?;
    let theirs_ready = handshake::parse_link_ready(ready)?;
    negotiation.readies(side, made.is_ok(), theirs_ready);
    confirm(&mut stream, keys, side, &negotiation).await?;
    match made {
        Ok(()) if theirs_ready => {
            let name = upgrade.kind().name();
            Ok((upgrade.into_stream(stream), name))
        }
        Ok(()) => {
            tracing::warn!(
                %peer,
                "peer link stays on TCP: the peer could not reach this node's {} address (see its log)",
                upgrade.kind().name()
            );
            Ok((stream, "tcp"))
        }
        Err(error) => {
            tracing::warn!(
                %peer,
                %error,
                "peer link stays on TCP: cannot reach the peer's {} address",
                upgrade.kind().name()
            );
            Ok((stream, "tcp"))
        }
    }
}

/// The client half of the authentication: proves this node first (one proof per secret it
/// holds, its own first), then checks the server's proof; returns the server's node id and
/// the link's keys.
pub(super) async fn client_authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    auth: &PeerAuth,
) -> Result<(String, LinkKeys), HandshakeError> {
    let secrets = auth.secrets.current();
    if secrets.is_empty() {
        return Err(HandshakeError::NoSecret);
    }
    let secrets = &secrets[..secrets.len().min(handshake::MAX_PROOFS)];
    let ours = our_hello(auth);
    write(stream, &handshake::encode_client_hello(&ours)).await?;
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(stream).await?;
    handshake::check_preamble(&preamble, handshake::message::SERVER_HELLO)?;
    let [status] = read_array::<1, _>(stream).await?;
    let status = handshake::parse_status(status)?;
    let theirs = read_hello(stream).await?;
    if status == Status::WrongModel || theirs.model_fingerprint != auth.model_fingerprint {
        return Err(HandshakeError::WrongModel {
            ours: auth.model_fingerprint,
            theirs: theirs.model_fingerprint,
        });
    }
    if status != Status::Ok {
        return Err(HandshakeError::Protocol(
            "server hello with an unexpected status".into(),
        ));
    }
    let proofs: Vec<[u8; MAC_LEN]> = secrets
        .iter()
        .map(|secret| handshake::client_mac(secret, &ours, &theirs))
        .collect();
    write(stream, &handshake::encode_client_proof(Status::Ok, &proofs)).await?;
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(stream).await?;
    handshake::check_preamble(&preamble, handshake::message::VERDICT)?;
    let [verdict] = read_array::<1, _>(stream).await?;
    let mac = read_array::<MAC_LEN, _>(stream).await?;
    match handshake::parse_status(verdict)? {
        Status::Ok => {}
        Status::AuthFailed => return Err(HandshakeError::RefusedByPeer),
        Status::WrongModel => {
            return Err(HandshakeError::Protocol(
                "verdict with an unexpected status".into(),
            ));
        }
    }
    // The server proves itself with the secret of the proof it accepted.
    let Some(secret) = secrets.iter().zip(&proofs).find_map(|(secret, proof)| {
        handshake::verify_server_mac(secret, &ours, &theirs, proof, &mac).then_some(secret)
    }) else {
        // A server that accepted our proof without holding the secret: nothing more is sent.
        return Err(HandshakeError::WrongSecret);
    };
    Ok((
        theirs.node_id.clone(),
        handshake::link_keys(secret, &ours, &theirs),
    ))
}

/// The server half of the authentication: reads the client's proofs before anything of its
/// own depends on the secret, then proves itself with the secret of the first proof that
/// verifies; returns the client's node id and the link's keys. The secrets are read now, so
/// a secret removed by a reload is refused from the next handshake on.
pub(super) async fn server_authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    auth: &PeerAuth,
) -> Result<(String, LinkKeys), HandshakeError> {
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(stream).await?;
    handshake::check_preamble(&preamble, handshake::message::CLIENT_HELLO)?;
    let theirs = read_hello(stream).await?;
    let ours = our_hello(auth);
    let status = if theirs.model_fingerprint == auth.model_fingerprint {
        Status::Ok
    } else {
        Status::WrongModel
    };
    let hello = handshake::ServerHello {
        status,
        hello: ours.clone(),
    };
    write(stream, &handshake::encode_server_hello(&hello)).await?;
    if status == Status::WrongModel {
        return Err(HandshakeError::WrongModel {
            ours: auth.model_fingerprint,
            theirs: theirs.model_fingerprint,
        });
    }
    let preamble = read_array::<{ handshake::PREAMBLE_LEN }, _>(stream).await?;
    handshake::check_preamble(&preamble, handshake::message::CLIENT_PROOF)?;
    let [status, count] = read_array::<2, _>(stream).await?;
    match handshake::parse_status(status)? {
        Status::Ok => {}
        Status::AuthFailed => return Err(HandshakeError::RefusedByPeer),
        Status::WrongModel => {
            return Err(HandshakeError::Protocol(
                "client proof with an unexpected status".into(),
            ));
        }
    }
    let count = handshake::parse_proof_count(count)?;
    let mut proofs = Vec::with_capacity(count);
    for _ in 0..count {
        proofs.push(read_array::<MAC_LEN, _>(stream).await?);
    }
    let secrets = auth.secrets.current();
    let accepted = proofs.iter().find_map(|proof| {
        let secret = secrets
            .iter()
            .find(|secret| handshake::verify_client_mac(secret, &theirs, &ours, proof))?;
        Some((secret, proof))
    });
    let Some((secret, proof)) = accepted else {
        let refusal = handshake::encode_verdict(Status::AuthFailed, &[0; MAC_LEN]);
        let _ = write(stream, &refusal).await;
        return Err(HandshakeError::WrongSecret);
    };
    let mac = handshake::server_mac(secret, &theirs, &ours, proof);
    write(stream, &handshake::encode_verdict(Status::Ok, &mac)).await?;
    let keys = handshake::link_keys(secret, &theirs, &ours);
    Ok((theirs.node_id, keys))
}
