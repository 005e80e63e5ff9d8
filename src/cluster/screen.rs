//! What an authenticated datagram must pass before foca sees it: members serving another
//! checkpoint (another model fingerprint) are kept out of the view, and log lines about
//! bad traffic are rate-limited.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

use foca::{Codec, Header, Member, Message, PostcardCodec};

use super::identity::{MemberMeta, NodeIdentity};

/// A member that was kept out: who it says it is and what it serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Its node id.
    pub node: String,
    /// Its gossip address.
    pub gossip: std::net::SocketAddr,
    /// Its model fingerprint.
    pub model: u64,
}

/// The verdict on one decrypted datagram.
#[derive(Debug, PartialEq, Eq)]
pub enum Screened {
    /// Hand these bytes to foca (the datagram itself, or a copy without the updates about
    /// refused members); `refused` lists members dropped from the updates.
    Accept {
        /// What foca gets.
        packet: Vec<u8>,
        /// The sender.
        sender: std::net::SocketAddr,
        /// Members removed from the updates the sender gossiped.
        refused: Vec<Refusal>,
    },
    /// The sender serves another model: drop the whole datagram.
    RefuseSender(Refusal),
    /// Not a foca packet we can read.
    Malformed,
}

/// Whether a member announcing `identity` may be in the view of a node serving `our_model`:
/// the same model, or one side is a gateway (which holds none).
fn admitted(identity: &NodeIdentity, our_model: u64) -> bool {
    our_model == MemberMeta::GATEWAY_MODEL
        || identity.meta.model == our_model
        || identity.meta.is_gateway()
}

/// Screens a decrypted datagram against our model fingerprint. Mirrors foca's packet
/// layout: a header, then (except for Announce and Broadcast) a big-endian `u16` count of
/// member updates and the updates; nothing else (we use no custom broadcasts).
pub fn screen(packet: &[u8], our_model: u64) -> Screened {
    let mut codec = PostcardCodec;
    let mut rest = packet;
    let header: Header<NodeIdentity> = match codec.decode_header(&mut rest) {
        Ok(header) => header,
        Err(_) => return Screened::Malformed,
    };
    if !admitted(&header.src, our_model) {
        return Screened::RefuseSender(refusal(&header.src));
    }
    let sender = header.src.gossip;
    let accept_as_is = |refused| Screened::Accept {
        packet: packet.to_vec(),
        sender,
        refused,
    };
    if rest.is_empty() || header.message == Message::Broadcast {
        return accept_as_is(Vec::new());
    }
    if rest.len() < 2 || header.message == Message::Announce {
        return Screened::Malformed;
    }
    let count = u16::from_be_bytes([rest[0], rest[1]]);
    rest = &rest[2..];
    let mut updates: Vec<Member<NodeIdentity>> = Vec::with_capacity(usize::from(count).min(64));
    for _ in 0..count {
        match codec.decode_member(&mut rest) {
            Ok(member) => updates.push(member),
            Err(_) => return Screened::Malformed,
        }
    }
    if updates
        .iter()
        .all(|member| admitted(member.id(), our_model))
    {
        return accept_as_is(Vec::new());
    }
    // Rebuild the packet without the refused members.
    let (kept, dropped): (Vec<_>, Vec<_>) = updates
        .into_iter()
        .partition(|member| admitted(member.id(), our_model));
    let refused = dropped.iter().map(|member| refusal(member.id())).collect();
    let mut rebuilt = Vec::with_capacity(packet.len());
    if codec.encode_header(&header, &mut rebuilt).is_err() {
        return Screened::Malformed;
    }
    // `kept` is shorter than `count`, which fit in a u16.
    let kept_count = u16::try_from(kept.len()).unwrap_or(0);
    rebuilt.extend_from_slice(&kept_count.to_be_bytes());
    for member in &kept {
        if codec.encode_member(member, &mut rebuilt).is_err() {
            return Screened::Malformed;
        }
    }
    rebuilt.extend_from_slice(rest);
    Screened::Accept {
        packet: rebuilt,
        sender,
        refused,
    }
}

fn refusal(identity: &NodeIdentity) -> Refusal {
    Refusal {
        node: identity.meta.node.clone(),
        gossip: identity.gossip,
        model: identity.meta.model,
    }
}

/// Says yes at most once per key per period, so a flood of bad datagrams makes one log line
/// a minute per source. Bounded: past `capacity` keys it forgets the expired ones, and while
/// still full it stays quiet about new keys rather than grow.
#[derive(Debug)]
pub struct WarnLimiter<K> {
    period: Duration,
    capacity: usize,
    last: HashMap<K, Instant>,
}

impl<K: Eq + Hash> WarnLimiter<K> {
    /// At most one warning per key per `period`, tracking at most `capacity` keys.
    pub fn new(period: Duration, capacity: usize) -> WarnLimiter<K> {
        WarnLimiter {
            period,
            capacity,
            last: HashMap::new(),
        }
    }

    /// Whether to log about `key` now.
    pub fn allow(&mut self, key: K, now: Instant) -> bool {
        if let Some(last) = self.last.get_mut(&key) {
            if now.saturating_duration_since(*last) >= self.period {
                *last = now;
                return true;
            }
            return false;
        }
        if self.last.len() >= self.capacity {
            let period = self.period;
            self.last
                .retain(|_, last| now.saturating_duration_since(*last) < period);
            if self.last.len() >= self.capacity {
                return false;
            }
        }
        self.last.insert(key, now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::identity::{FocaRng, MemberMeta};
    use foca::{AccumulatingRuntime, Foca, State};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;
    use std::net::SocketAddr;

    const OURS: u64 = 0xaaaa;
    const THEIRS: u64 = 0xbbbb;

    fn identity(index: u8, model: u64) -> NodeIdentity {
        NodeIdentity {
            meta: MemberMeta {
                node: format!("node-{index}"),
                peer: SocketAddr::from(([10, 0, 0, index], 7000)),
                api: SocketAddr::from(([10, 0, 0, index], 8000)),
                devices: 1,
                rows_bf16: false,
                model,
                placement_version: 0,
                loaded_version: 0,
                placement_hash: 0,
                loaded_hash: 0,
                expert_room: u64::MAX,
                expert_bytes: 0,
                expert_slots: Vec::new(),
            },
            gossip: SocketAddr::from(([10, 0, 0, index], 7946)),
            generation: 1,
        }
    }

    fn packet(src: &NodeIdentity, dst: &NodeIdentity, updates: &[NodeIdentity]) -> Vec<u8> {
        let mut codec = PostcardCodec;
        let mut buf = Vec::new();
        let header = Header {
            src: src.clone(),
            src_incarnation: 0,
            dst: dst.clone(),
            message: Message::Gossip,
        };
        codec.encode_header(&header, &mut buf).expect("header");
        let count = u16::try_from(updates.len()).expect("few");
        buf.extend_from_slice(&count.to_be_bytes());
        for update in updates {
            codec
                .encode_member(&Member::alive(update.clone()), &mut buf)
                .expect("member");
        }
        buf
    }

    #[test]
    fn same_model_packets_pass_untouched() {
        let bytes = packet(&identity(2, OURS), &identity(1, OURS), &[identity(3, OURS)]);
        match screen(&bytes, OURS) {
            Screened::Accept {
                packet,
                sender,
                refused,
            } => {
                assert_eq!(packet, bytes);
                assert_eq!(sender, identity(2, OURS).gossip);
                assert!(refused.is_empty());
            }
            other => panic!("expected Accept, got {other:?}"),
        }
    }

    #[test]
    fn a_sender_with_another_model_is_refused() {
        let bytes = packet(&identity(2, THEIRS), &identity(1, OURS), &[]);
        assert_eq!(
            screen(&bytes, OURS),
            Screened::RefuseSender(Refusal {
                node: "node-2".into(),
                gossip: identity(2, OURS).gossip,
                model: THEIRS,
            })
        );
    }

    #[test]
    fn gossip_about_another_model_is_cut_out_and_foca_never_learns_it() {
        let us = identity(1, OURS);
        let bytes = packet(
            &identity(2, OURS),
            &us,
            &[identity(3, THEIRS), identity(4, OURS)],
        );
        let Screened::Accept {
            packet, refused, ..
        } = screen(&bytes, OURS)
        else {
            panic!("expected Accept");
        };
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].model, THEIRS);
        let config = crate::cluster::foca_config(
            std::time::Duration::from_secs(1),
            std::time::Duration::from_secs(4),
        );
        let mut foca = Foca::new(
            us,
            config,
            FocaRng(ChaCha8Rng::seed_from_u64(1)),
            PostcardCodec,
        );
        let mut runtime = AccumulatingRuntime::new();
        foca.handle_data(&packet, &mut runtime)
            .expect("foca reads it");
        let known: Vec<_> = foca
            .iter_membership_state()
            .map(|member| (member.id().meta.node.clone(), member.state()))
            .collect();
        assert_eq!(known.len(), 2, "{known:?}");
        assert!(
            known
                .iter()
                .all(|(node, state)| node != "node-3" && *state == State::Alive)
        );
    }

    /// A gateway holds no model: nodes of any model admit it (and it them), but a member
    /// with no devices that announces a model is no gateway, and is screened as any other.
    #[test]
    fn gateways_and_nodes_admit_each_other_whatever_the_model() {
        let mut gateway = identity(9, MemberMeta::GATEWAY_MODEL);
        gateway.meta.devices = 0;
        let bytes = packet(&gateway, &identity(1, OURS), &[]);
        assert!(matches!(screen(&bytes, OURS), Screened::Accept { .. }));
        let bytes = packet(&identity(2, THEIRS), &gateway, &[identity(3, OURS)]);
        match screen(&bytes, MemberMeta::GATEWAY_MODEL) {
            Screened::Accept { refused, .. } => assert!(refused.is_empty()),
            other => panic!("{other:?}"),
        }
        let mut empty = identity(4, THEIRS);
        empty.meta.devices = 0;
        let bytes = packet(&empty, &identity(1, OURS), &[]);
        assert!(matches!(screen(&bytes, OURS), Screened::RefuseSender(_)));
    }

    #[test]
    fn garbage_and_truncations_are_malformed() {
        assert_eq!(screen(&[], OURS), Screened::Malformed);
        assert_eq!(screen(&[0xff; 64], OURS), Screened::Malformed);
        let bytes = packet(
            &identity(2, OURS),
            &identity(1, OURS),
            &[identity(3, OURS), identity(4, OURS)],
        );
        for len in 0..bytes.len() {
            let verdict = screen(&bytes[..len], OURS);
            // A cut exactly after the header is a packet without updates: fine.
            if let Screened::Accept { packet, .. } = &verdict {
                assert!(packet.len() < bytes.len());
                continue;
            }
            assert_eq!(verdict, Screened::Malformed, "cut at {len}");
        }
    }

    #[test]
    fn warnings_are_limited_per_source() {
        let mut limiter = WarnLimiter::new(Duration::from_secs(60), 2);
        let start = Instant::now();
        assert!(limiter.allow(1, start));
        assert!(!limiter.allow(1, start + Duration::from_secs(30)));
        assert!(limiter.allow(2, start));
        // Full: a third source stays quiet until the others expire.
        assert!(!limiter.allow(3, start + Duration::from_secs(1)));
        assert!(limiter.allow(3, start + Duration::from_secs(61)));
        assert!(limiter.allow(1, start + Duration::from_secs(62)));
    }
}
