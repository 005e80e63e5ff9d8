//! Gossip datagrams: the keyring, the replay guard, the model screen and foca's decoder, as
//! the membership thread runs them on every datagram it receives. Some inputs are taken as
//! ciphertext (what an attacker without the secret can send); the others are sealed with the
//! cluster secret first (what a member holding the secret could send), either stamped by the
//! target (so the fuzzer reaches the screen and foca) or carrying their own stamp (so it
//! reaches the replay guard with any stamp).
#![no_main]

use std::net::SocketAddr;
use std::time::Duration;

use foca::{AccumulatingRuntime, Foca, NoCustomBroadcast, PostcardCodec};
use libfuzzer_sys::fuzz_target;
use moe_node::cluster::identity::FocaRng;
use moe_node::cluster::keyring::Keyring;
use moe_node::cluster::membership::open_datagram;
use moe_node::cluster::replay::{ReplayGuard, Stamper};
use moe_node::cluster::screen::Screened;
use moe_node::cluster::{NodeIdentity, foca_config};
use rand::SeedableRng;
use rand::rngs::StdRng;

const MODEL: u64 = 0x5eed;

type NodeFoca = Foca<NodeIdentity, PostcardCodec, FocaRng<StdRng>, NoCustomBroadcast>;

struct Receiver {
    keyring: Keyring,
    guard: ReplayGuard,
    stamper: Stamper,
    foca: NodeFoca,
    runtime: AccumulatingRuntime<NodeIdentity>,
    rng: StdRng,
}

fn receiver() -> Receiver {
    let addr: SocketAddr = "127.0.0.1:7946".parse().expect("address");
    // From `seed`, which fills every field: new metadata fields do not break the target.
    let mut identity = NodeIdentity::seed(addr, MODEL);
    identity.meta.node = "fuzz".into();
    identity.meta.devices = 1;
    identity.generation = 1;
    Receiver {
        keyring: Keyring::new(&["fuzz-secret"]).expect("keyring"),
        guard: ReplayGuard::new(16),
        stamper: Stamper::with_epoch(1),
        foca: Foca::new(
            identity,
            foca_config(Duration::from_secs(1), Duration::from_secs(2)),
            FocaRng(StdRng::seed_from_u64(1)),
            PostcardCodec,
        ),
        runtime: AccumulatingRuntime::new(),
        rng: StdRng::seed_from_u64(2),
    }
}

// The input is a sequence of datagrams, each `mode, len (u16 LE), bytes`: a fresh node
// receives them in order (a conversation reaches states one packet does not). Mode (low two
// bits) 0: the bytes as they are; 1: stamped and sealed; 2: sealed (the bytes carry a stamp);
// 3: sealed with one fixed stamp (from its second time on, a replay).
fuzz_target!(|data: &[u8]| {
    let mut receiver = receiver();
    let mut rest = data;
    while let [mode, low, high, tail @ ..] = rest {
        let len = usize::from(u16::from_le_bytes([*low, *high])).min(tail.len());
        let (payload, next) = tail.split_at(len);
        rest = next;
        let plain = match mode & 3 {
            0 => None,
            1 => Some(receiver.stamper.stamp(payload)),
            2 => Some(payload.to_vec()),
            _ => Some([&[0u8; 8][..], &1u64.to_be_bytes(), payload].concat()),
        };
        let datagram = match plain {
            None => payload.to_vec(),
            Some(plain) => match receiver.keyring.seal(&plain, &mut receiver.rng) {
                Some(sealed) => sealed,
                None => continue,
            },
        };
        if let Ok(Screened::Accept { packet, .. }) =
            open_datagram(&receiver.keyring, &mut receiver.guard, MODEL, &datagram)
        {
            // Errors are expected (bad packets are refused); panics are not.
            let _ = receiver.foca.handle_data(&packet, &mut receiver.runtime);
            // What the membership thread does next: drain foca's output.
            while receiver.runtime.to_send().is_some() {}
            while receiver.runtime.to_schedule().is_some() {}
            while receiver.runtime.to_notify().is_some() {}
        }
    }
});
