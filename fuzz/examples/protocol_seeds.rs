//! Writes the seed corpora of `peer_wire`, `peer_records`, `peer_handshake` and `gossip`
//! with the library's own encoders: frames of each kind and dtype (`peer_records` seals the
//! same frames, whole, flipped and cut), each handshake message as a peer sends it, and foca
//! packets of a two-member conversation with the fuzz target's receiver.
//!
//! `cargo run --example protocol_seeds` from `fuzz/` (rewrites those corpus directories).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use foca::{AccumulatingRuntime, Foca, PostcardCodec};
use moe_node::cluster::identity::FocaRng;
use moe_node::cluster::{NodeIdentity, foca_config};
use moe_node::transport::handshake::{self, Hello, MAC_LEN, NONCE_LEN, ServerHello, Status};
use moe_node::transport::wire::{self, Dtype, ExpertReply, ExpertRequest, RemoteError};
use rand::SeedableRng;
use rand::rngs::StdRng;

fn main() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    write(&corpus.join("peer_wire"), &wire_seeds());
    write(&corpus.join("peer_records"), &record_seeds());
    write(&corpus.join("peer_handshake"), &handshake_seeds());
    write(&corpus.join("gossip"), &gossip_seeds());
}

fn write(dir: &Path, seeds: &[(String, Vec<u8>)]) {
    std::fs::create_dir_all(dir).expect("corpus directory");
    for (name, bytes) in seeds {
        std::fs::write(dir.join(format!("seed-{name}")), bytes).expect("write seed");
    }
    println!("{}: {} seeds", dir.display(), seeds.len());
}

/// One setup byte (see the target), then frames.
fn wire_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds = Vec::new();
    for (dtype, name) in [(Dtype::F32, "f32"), (Dtype::Bf16, "bf16")] {
        let request = ExpertRequest {
            layer: 1,
            placement_version: 3,
            width: 2,
            dtype,
            groups: vec![(0, 1), (5, 2)],
            rows: vec![0.5, -1.0, 2.0, 3.5, -0.25, 8.0],
            trace: None,
        };
        let frame = wire::encode_request(7, &request).expect("request");
        seeds.push((format!("request-{name}"), [&[0x30], &frame[..]].concat()));
        let reply = ExpertReply {
            groups: request.groups.clone(),
            rows: request.rows.clone(),
        };
        let answer = wire::encode_reply(7, 1, 3, 2, dtype, &reply).expect("reply");
        // Two frames on one connection, read with 8-byte chunks and small limits.
        seeds.push((
            format!("two-frames-{name}"),
            [&[0x11], &frame[..], &answer[..]].concat(),
        ));
    }
    for (error, name) in [
        (
            RemoteError::NotHeld {
                layer: 2,
                expert: 9,
            },
            "not-held",
        ),
        (
            RemoteError::WrongPlacement { theirs: 1, ours: 2 },
            "wrong-placement",
        ),
        (
            RemoteError::DeviceFailed("out of memory".into()),
            "device-failed",
        ),
        (RemoteError::Overloaded, "overloaded"),
    ] {
        seeds.push((
            format!("error-{name}"),
            [&[0x00], &wire::encode_error(9, &error)[..]].concat(),
        ));
    }
    seeds
}

/// The frames of `wire_seeds` behind `peer_records`' setup byte (writes of 1 + bits 0-5
/// bytes; bit 6: one byte touched; bit 7 with it: the last byte cut, else one flipped).
fn record_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds = Vec::new();
    for (name, seed) in wire_seeds() {
        let frames = &seed[1..];
        for (setup, how) in [
            (0x0f, "whole"),
            (0x3f, "whole-64"),
            (0x47, "flipped"),
            (0xc7, "cut"),
        ] {
            seeds.push((format!("{name}-{how}"), [&[setup][..], frames].concat()));
        }
    }
    seeds
}

/// One side byte (even: we are the server), then what the other side sends.
fn handshake_seeds() -> Vec<(String, Vec<u8>)> {
    let hello = Hello {
        node_id: "node-b".into(),
        model_fingerprint: 0x5eed,
        nonce: [7; NONCE_LEN],
    };
    let proof = handshake::encode_client_proof(Status::Ok, &[[3; MAC_LEN]]);
    let server_hello = handshake::encode_server_hello(&ServerHello {
        status: Status::Ok,
        hello: hello.clone(),
    });
    vec![
        (
            "client-hello-and-proof".into(),
            [&[0][..], &handshake::encode_client_hello(&hello), &proof].concat(),
        ),
        (
            "server-hello-and-verdict".into(),
            [
                &[1][..],
                &server_hello,
                &handshake::encode_verdict(Status::Ok, &[4; MAC_LEN]),
            ]
            .concat(),
        ),
    ]
}

fn identity(port: u16, node: &str) -> NodeIdentity {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    // The fuzz target builds its receiver the same way.
    let mut identity = NodeIdentity::seed(addr, 0x5eed);
    identity.meta.node = node.into();
    identity.meta.devices = 1;
    identity.generation = 1;
    identity
}

/// Datagrams `mode, len (u16 LE), bytes` (mode 1: the target stamps and seals them): what
/// another member sends the target's receiver (127.0.0.1:7946) while they meet.
fn gossip_seeds() -> Vec<(String, Vec<u8>)> {
    let config = foca_config(Duration::from_secs(1), Duration::from_secs(2));
    let mut receiver = Foca::new(
        identity(7946, "fuzz"),
        config.clone(),
        FocaRng(StdRng::seed_from_u64(1)),
        PostcardCodec,
    );
    let mut other = Foca::new(
        identity(7947, "other"),
        config,
        FocaRng(StdRng::seed_from_u64(3)),
        PostcardCodec,
    );
    let (mut to_receiver, mut to_other) = (AccumulatingRuntime::new(), AccumulatingRuntime::new());
    other
        .announce(identity(7946, "fuzz"), &mut to_other)
        .expect("announce");
    let mut packets = Vec::new();
    for _ in 0..3 {
        while let Some((_, data)) = to_other.to_send() {
            packets.push(data.to_vec());
            let _ = receiver.handle_data(&data, &mut to_receiver);
        }
        while let Some((_, data)) = to_receiver.to_send() {
            let _ = other.handle_data(&data, &mut to_other);
        }
        if let Err(error) = other.gossip(&mut to_other) {
            eprintln!("gossip: {error}");
        }
    }
    let mut conversation = Vec::new();
    let mut seeds = Vec::new();
    for (i, packet) in packets.iter().enumerate() {
        let datagram = [&[1u8][..], &(packet.len() as u16).to_le_bytes(), packet].concat();
        seeds.push((format!("packet-{i}"), datagram.clone()));
        conversation.extend_from_slice(&datagram);
    }
    seeds.push(("conversation".into(), conversation));
    seeds
}
