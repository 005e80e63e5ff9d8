//! The cluster's Prometheus series, read at scrape time from the counters the peer links,
//! gossip and dispatch keep: traffic and refusals, membership, placement, failovers.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::cluster::{MemberState, Membership, MembershipStats};
use crate::experts::{Dispatcher, Target};
use crate::transport::peer::PeerStats;

pub struct ClusterCollector {
    peers: Arc<PeerStats>,
    gossip: Arc<MembershipStats>,
    membership: Membership,
    dispatcher: Arc<Dispatcher>,
}

impl ClusterCollector {
    pub fn new(peers: Arc<PeerStats>, membership: Membership, dispatcher: Arc<Dispatcher>) -> Self {
        ClusterCollector {
            peers,
            gossip: membership.stats(),
            membership,
            dispatcher,
        }
    }
}

impl std::fmt::Debug for ClusterCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterCollector")
    }
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(&[(&str, &str)], u64)],
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in series {
        ConstCounter::new(*value).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(&[(&str, &str)], i64)],
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in series {
        ConstGauge::new(*value).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

impl Collector for ClusterCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        self.encode_links(&mut encoder)?;
        self.encode_placement(&mut encoder)?;
        self.encode_dispatch(&mut encoder)
    }
}

impl ClusterCollector {
    /// The peer links', gossip's and membership's series.
    fn encode_links(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let p = &self.peers;
        counter(
            encoder,
            "peer_bytes_sent",
            "Bytes of expert work and replies sent to other nodes",
            &[(&[], load(&p.bytes_sent))],
        )?;
        counter(
            encoder,
            "peer_bytes_received",
            "Bytes of expert work and replies received from other nodes",
            &[(&[], load(&p.bytes_received))],
        )?;
        let r = &p.frames_rejected;
        counter(
            encoder,
            "peer_frames_rejected",
            "Frames and handshakes refused on the peer port, by reason",
            &[
                (&[("reason", "bad_magic")], load(&r.bad_magic)),
                (&[("reason", "bad_version")], load(&r.bad_version)),
                (&[("reason", "too_large")], load(&r.too_large)),
                (&[("reason", "malformed")], load(&r.malformed)),
                (&[("reason", "auth_failed")], load(&r.auth_failed)),
                (&[("reason", "wrong_model")], load(&r.wrong_model)),
                (&[("reason", "integrity")], load(&r.integrity)),
                (&[("reason", "stalled")], load(&r.stalled)),
                (&[("reason", "over_limit")], load(&r.over_limit)),
            ],
        )?;
        let g = &self.gossip;
        let rejected = &g.packets_rejected;
        counter(
            encoder,
            "gossip_packets_rejected",
            "Gossip packets dropped before membership read them, by reason",
            &[
                (&[("reason", "oversized")], load(&rejected.oversized)),
                (
                    &[("reason", "unauthenticated")],
                    load(&rejected.unauthenticated),
                ),
                (&[("reason", "malformed")], load(&rejected.malformed)),
                (&[("reason", "replay")], load(&rejected.replay)),
            ],
        )?;
        counter(
            encoder,
            "gossip_members_refused",
            "Gossip from members serving another model, refused",
            &[(&[], load(&g.members_refused))],
        )?;
        let t = &g.transitions;
        counter(
            encoder,
            "membership_transitions",
            "Members entering each state",
            &[
                (&[("state", "alive")], load(&t.alive)),
                (&[("state", "suspect")], load(&t.suspect)),
                (&[("state", "dead")], load(&t.dead)),
            ],
        )?;
        let members = self.membership.members();
        let count = |s: MemberState| members.iter().filter(|m| m.state == s).count() as i64;
        gauge(
            encoder,
            "cluster_members",
            "Members this node knows, by state (itself included)",
            &[
                (&[("state", "alive")], count(MemberState::Alive)),
                (&[("state", "suspect")], count(MemberState::Suspect)),
                (&[("state", "dead")], count(MemberState::Dead)),
            ],
        )?;
        Ok(())
    }

    /// The placement's version, each node's copies, and the rows sent to each node.
    fn encode_placement(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let placement = self.dispatcher.placement();
        gauge(
            encoder,
            "placement_version",
            "Version of the placement this node serves under",
            &[(&[], placement.version() as i64)],
        )?;
        let held: Vec<(String, i64)> = placement
            .nodes()
            .iter()
            .enumerate()
            .map(|(i, n)| (n.node.clone(), placement.experts_held_by(i as u16) as i64))
            .collect();
        let series: Vec<([(&str, &str); 1], i64)> = held
            .iter()
            .map(|(n, v)| ([("node", n.as_str())], *v))
            .collect();
        let series: Vec<(&[(&str, &str)], i64)> =
            series.iter().map(|(l, v)| (&l[..], *v)).collect();
        gauge(
            encoder,
            "node_experts",
            "Expert copies (layer, expert) each node holds in the placement",
            &series,
        )?;
        let sent: Vec<(String, u64)> = self
            .dispatcher
            .rows_sent()
            .into_iter()
            .filter_map(|(target, rows)| match target {
                Target::Node(n) => Some((placement.nodes().get(n as usize)?.node.clone(), rows)),
                Target::Device(_) => None,
            })
            .collect();
        let series: Vec<([(&str, &str); 1], u64)> = sent
            .iter()
            .map(|(n, v)| ([("node", n.as_str())], *v))
            .collect();
        let series: Vec<(&[(&str, &str)], u64)> =
            series.iter().map(|(l, v)| (&l[..], *v)).collect();
        counter(
            encoder,
            "dispatch_rows_sent",
            "Rows of expert work sent to each other node (hedges and failovers included)",
            &series,
        )?;
        Ok(())
    }

    /// The dispatcher's failovers, hedges, late answers, staged bytes and reroutes.
    fn encode_dispatch(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let c = &self.dispatcher.counters;
        counter(
            encoder,
            "dispatch_failovers",
            "Expert groups re-sent to another replica after their target failed",
            &[(&[], load(&c.failovers))],
        )?;
        counter(
            encoder,
            "dispatch_hedges",
            "Expert groups also sent to another replica after their target missed its deadline",
            &[(&[], load(&c.hedges))],
        )?;
        counter(
            encoder,
            "dispatch_late_answers",
            "Answers discarded because another replica answered first",
            &[(&[], load(&c.late_answers))],
        )?;
        counter(
            encoder,
            "dispatch_staged_bytes",
            "Bytes of rows that were on a GPU and went through host memory for groups computed on a CPU slot or another node (both ways)",
            &[(&[], load(&c.staged_bytes))],
        )?;
        counter(
            encoder,
            "dispatch_rerouted",
            "Token-to-expert choices routed to the next-best expert because the chosen one had no live replica (on_expert_unavailable = \"reroute\": degraded output)",
            &[(&[], load(&c.rerouted))],
        )?;
        Ok(())
    }
}
