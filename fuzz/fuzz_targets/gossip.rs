//! Gossip datagrams: the keyring, the model screen and foca's decoder, as the membership
//! thread runs them on every datagram it receives. Half the inputs are taken as ciphertext
//! (what an attacker without the secret can send); the other half are sealed with the
//! cluster secret first (what a member holding the secret could send), so the fuzzer reaches
//! the screen and foca.
#![no_main]

use std::net::SocketAddr;
use std::time::Duration;

use foca::{AccumulatingRuntime, Foca, NoCustomBroadcast, PostcardCodec};
use libfuzzer_sys::fuzz_target;
use moe_node::cluster::identity::FocaRng;
use moe_node::cluster::keyring::Keyring;
use moe_node::cluster::membership::open_datagram;
use moe_node::cluster::screen::Screened;
use moe_node::cluster::{NodeIdentity, foca_config};
use rand::SeedableRng;
use rand::rngs::StdRng;

const MODEL: u64 = 0x5eed;

type NodeFoca = Foca<NodeIdentity, PostcardCodec, FocaRng<StdRng>, NoCustomBroadcast>;

struct Receiver {
    keyring: Keyring,
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
// receives them in order (a conversation reaches states one packet does not).
fuzz_target!(|data: &[u8]| {
    let mut receiver = receiver();
    let mut rest = data;
    while let [mode, low, high, tail @ ..] = rest {
        let len = usize::from(u16::from_le_bytes([*low, *high])).min(tail.len());
        let (payload, next) = tail.split_at(len);
        rest = next;
        let datagram = if mode & 1 == 0 {
            payload.to_vec()
        } else {
            match receiver.keyring.seal(payload, &mut receiver.rng) {
                Some(sealed) => sealed,
                None => continue,
            }
        };
        if let Ok(Screened::Accept { packet, .. }) =
            open_datagram(&receiver.keyring, MODEL, &datagram)
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
