//! Who a member is on the wire: its metadata, its gossip address and a generation.

use std::net::SocketAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::RngCore;

/// Longest node id a member may carry (it travels in every packet).
pub const MAX_NODE_ID_BYTES: usize = 64;

/// What a member says about itself (carried in its foca identity; small: it is in every
/// packet).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemberMeta {
    /// Node id, at most [`MAX_NODE_ID_BYTES`] bytes.
    pub node: String,
    /// Data-plane (peer transport) TCP address.
    pub peer: SocketAddr,
    /// HTTP API address.
    pub api: SocketAddr,
    /// Device slots this node serves.
    pub devices: u32,
    /// Its devices are GPUs, which compute on bf16: rows sent to it travel as bf16 (half
    /// the bytes, and the same result, the GPU rounding f32 rows to bf16 itself).
    pub rows_bf16: bool,
    /// Fingerprint of the checkpoint: members with another fingerprint are refused, except
    /// a gateway's ([`MemberMeta::GATEWAY_MODEL`]).
    pub model: u64,
    /// The placement version this node serves (routes its own work by).
    pub placement_version: u64,
    /// The newest placement version whose experts this node has loaded: at least
    /// `placement_version`; above it while the cluster changes placement (copy, then
    /// switch once every live member has loaded).
    pub loaded_version: u64,
    /// Hashes of those two versions' tables (0: none): two leaders on either side of a
    /// partition may each propose a table under one version, and only these tell the two
    /// apart.
    pub placement_hash: u64,
    pub loaded_hash: u64,
    /// Bytes of experts its devices could still take (its GPUs' room, and the host's
    /// available memory for CPU slots), and the bytes one expert takes there (0: unknown),
    /// as last counted: a placement change that would not fit is refused before it starts.
    pub expert_room: u64,
    pub expert_bytes: u64,
    /// Experts of one MoE layer each of its devices has memory for (a GPU carrying a dense
    /// replica keeps room for its KV cache), which the placement it is given respects
    /// while others have room; empty: no bound (CPU slots).
    pub expert_slots: Vec<u32>,
}

/// A placement version and the hash of its table, as a member gossips them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TableId {
    pub version: u64,
    pub hash: u64,
}

impl TableId {
    /// The same placement as far as both say: the same version, and the same table unless
    /// one of them does not say which (hash 0).
    pub fn agrees(self, other: TableId) -> bool {
        self.version == other.version
            && (self.hash == 0 || other.hash == 0 || self.hash == other.hash)
    }

    /// This as the newest placement loaded beside `serving`, as members gossip it: never
    /// below the one served (a load of an older version counts as `serving`).
    pub fn loaded_beside(self, serving: TableId) -> TableId {
        if self.version < serving.version {
            serving
        } else {
            self
        }
    }
}

impl MemberMeta {
    /// The placement this member serves.
    pub fn serving(&self) -> TableId {
        TableId {
            version: self.placement_version,
            hash: self.placement_hash,
        }
    }

    /// The newest placement whose experts it has loaded.
    pub fn loaded(&self) -> TableId {
        TableId {
            version: self.loaded_version,
            hash: self.loaded_hash,
        }
    }
}

impl MemberMeta {
    /// The fingerprint a gateway (`moe-node gateway`) announces: it holds no model.
    pub const GATEWAY_MODEL: u64 = 0;

    /// What a gateway named `node` says of itself: its API at `api` (also given as its peer
    /// address, which no node dials), no devices, no model, no placement.
    pub fn gateway(node: String, api: SocketAddr) -> MemberMeta {
        MemberMeta {
            node,
            peer: api,
            api,
            devices: 0,
            rows_bf16: false,
            model: Self::GATEWAY_MODEL,
            placement_version: 0,
            loaded_version: 0,
            placement_hash: 0,
            loaded_hash: 0,
            expert_room: 0,
            expert_bytes: 0,
            expert_slots: Vec::new(),
        }
    }

    /// A gateway: a member with no device slots and no model, which serves nothing. Nodes
    /// admit it whatever model they serve and leave it out of their member views, so that
    /// it is never given experts, work or a vote; it learns the nodes from gossip.
    pub fn is_gateway(&self) -> bool {
        self.devices == 0 && self.model == Self::GATEWAY_MODEL
    }
}

/// A member's foca identity. Two identities with the same gossip address are the same
/// member; the higher `generation` wins (a restart, a renewal after being declared down,
/// or a metadata change), so a node that comes back replaces its old self everywhere.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeIdentity {
    /// What the member says about itself.
    pub meta: MemberMeta,
    /// The UDP address it gossips on (foca's `Identity::Addr`).
    pub gossip: SocketAddr,
    /// Grows on every restart (microseconds since the epoch at start) and every renewal.
    pub generation: u64,
}

impl NodeIdentity {
    /// A fresh identity for a process starting now: its generation is the wall clock in
    /// microseconds, so a restart after a crash outranks the identity it had before.
    pub fn starting_now(meta: MemberMeta, gossip: SocketAddr) -> NodeIdentity {
        let micros = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|since| u64::try_from(since.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(1);
        NodeIdentity {
            meta,
            gossip,
            generation: micros,
        }
    }

    /// The same member with new metadata; the generation grows so the new identity wins.
    pub fn with_meta(&self, meta: MemberMeta) -> NodeIdentity {
        NodeIdentity {
            meta,
            gossip: self.gossip,
            generation: self.generation.saturating_add(1),
        }
    }

    /// The identity used to announce to a seed we only know by address. Foca accepts an
    /// announce addressed to any identity with the receiver's address.
    pub fn seed(gossip: SocketAddr, model: u64) -> NodeIdentity {
        NodeIdentity {
            meta: MemberMeta {
                node: String::new(),
                peer: gossip,
                api: gossip,
                devices: 0,
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
            gossip,
            generation: 0,
        }
    }
}

impl foca::Identity for NodeIdentity {
    type Addr = SocketAddr;

    /// Declared down while still running: come back as the next generation.
    fn renew(&self) -> Option<Self> {
        let renewed = NodeIdentity {
            generation: self.generation.checked_add(1)?,
            ..self.clone()
        };
        Some(renewed)
    }

    fn addr(&self) -> SocketAddr {
        self.gossip
    }

    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        self.generation > adversary.generation
    }
}

/// Adapts a rand 0.9 generator to the rand 0.10 traits foca 2 draws from.
pub struct FocaRng<R>(pub R);

impl<R: RngCore> rand_core_010::TryRng for FocaRng<R> {
    type Error = std::convert::Infallible;

    fn try_next_u32(&mut self) -> Result<u32, Self::Error> {
        Ok(self.0.next_u32())
    }

    fn try_next_u64(&mut self) -> Result<u64, Self::Error> {
        Ok(self.0.next_u64())
    }

    fn try_fill_bytes(&mut self, dst: &mut [u8]) -> Result<(), Self::Error> {
        self.0.fill_bytes(dst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use foca::Identity;

    fn meta() -> MemberMeta {
        MemberMeta {
            node: "a".into(),
            peer: "127.0.0.1:1".parse().expect("addr"),
            api: "127.0.0.1:2".parse().expect("addr"),
            devices: 1,
            rows_bf16: false,
            model: 9,
            placement_version: 0,
            loaded_version: 0,
            placement_hash: 0,
            loaded_hash: 0,
            expert_room: u64::MAX,
            expert_bytes: 0,
            expert_slots: Vec::new(),
        }
    }

    #[test]
    fn newer_generations_win_conflicts() {
        let gossip = "127.0.0.1:3".parse().expect("addr");
        let old = NodeIdentity::starting_now(meta(), gossip);
        let renewed = old.renew().expect("renews");
        let changed = old.with_meta(MemberMeta {
            placement_version: 4,
            loaded_version: 4,
            placement_hash: 0,
            loaded_hash: 0,
            expert_room: u64::MAX,
            expert_bytes: 0,
            expert_slots: Vec::new(),
            ..meta()
        });
        assert!(renewed.win_addr_conflict(&old));
        assert!(!old.win_addr_conflict(&renewed));
        assert!(changed.win_addr_conflict(&old));
        assert_eq!(renewed.addr(), old.addr());
        let restarted = NodeIdentity::starting_now(meta(), gossip);
        assert!(restarted.generation >= old.generation);
    }
}
