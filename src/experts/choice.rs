//! Which replica runs each group of a step: the pure choice the dispatcher makes once per
//! MoE layer, from the replicas that hold each expert and what it measured of each
//! ([`super::health`]).

use super::health::{self, Reach, ReplicaHealth};
use crate::placement::{Placement, Replica};

/// Chooses, for each active expert of a step, the replica that runs its rows. Replicas that
/// are down, or that `excluded` names for that group (they failed it already), are never
/// chosen; a suspect replica only when no reachable one is left. Among the rest, replicas
/// much slower than the fastest (see [`health::comparable`]) are left out, so tokens flow
/// around a slow node; the others share the work by load (rows outstanding plus rows given
/// out earlier in this step), a local replica winning while its load is comparable
/// ([`health::LOCAL_SLACK_ROWS`]). Returns the replica per expert, `None` where an expert
/// has no usable replica.
pub fn assign_groups(
    placement: &Placement,
    layer: usize,
    experts: &[u32],
    rows_per_expert: impl Fn(usize) -> usize,
    health: impl Fn(Replica) -> ReplicaHealth,
    excluded: impl Fn(usize, Replica) -> bool,
) -> Vec<Option<Replica>> {
    assign_groups_among(
        |expert| placement.replicas(layer, expert),
        experts,
        rows_per_expert,
        health,
        excluded,
    )
}

/// [`assign_groups`] over the replicas `replicas_of` gives per expert (a node serving
/// other nodes' work picks among the devices that hold an expert now, whatever placement
/// version the sender routed by).
pub fn assign_groups_among<'a>(
    replicas_of: impl Fn(u32) -> &'a [Replica],
    experts: &[u32],
    rows_per_expert: impl Fn(usize) -> usize,
    health: impl Fn(Replica) -> ReplicaHealth,
    excluded: impl Fn(usize, Replica) -> bool,
) -> Vec<Option<Replica>> {
    let mut step_rows: rustc_hash::FxHashMap<Replica, usize> = Default::default();
    let mut chosen = Vec::with_capacity(experts.len());
    for (i, &expert) in experts.iter().enumerate() {
        let candidates: Vec<(Replica, ReplicaHealth)> = replicas_of(expert)
            .iter()
            .copied()
            .filter(|&r| !excluded(i, r))
            .map(|r| (r, health(r)))
            .filter(|(_, h)| h.reach != Reach::Down)
            .collect();
        let best_reach = candidates.iter().map(|(_, h)| h.reach).min();
        let fastest = candidates
            .iter()
            .filter(|(_, h)| Some(h.reach) == best_reach)
            .map(|(_, h)| h.latency_micros)
            .fold(f64::INFINITY, f64::min);
        let best = candidates
            .iter()
            .filter(|(_, h)| {
                Some(h.reach) == best_reach && health::comparable(h.latency_micros, fastest)
            })
            .min_by(|(ra, a), (rb, b)| {
                let la = a.load(step_rows.get(ra).copied().unwrap_or(0));
                let lb = b.load(step_rows.get(rb).copied().unwrap_or(0));
                (la, a.latency_micros)
                    .partial_cmp(&(lb, b.latency_micros))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
            .map(|(r, _)| *r);
        if let Some(r) = best {
            *step_rows.entry(r).or_default() += rows_per_expert(i);
        }
        chosen.push(best);
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::numbered_spec as spec;

    fn up(latency_micros: f64) -> ReplicaHealth {
        ReplicaHealth {
            reach: Reach::Up,
            latency_micros,
            outstanding_rows: 0,
            local: false,
        }
    }

    #[test]
    fn groups_go_to_live_replicas_least_loaded_first() {
        let p = Placement::single_node(&[true], 4, 2, 2).unwrap();
        let experts = [0, 1, 2, 3];
        let rows = |i: usize| [5, 1, 1, 1][i];
        let d = |device| Replica { node: 0, device };
        let chosen = assign_groups(&p, 0, &experts, rows, |_| up(100.0), |_, _| false);
        assert_ne!(chosen[0], chosen[1], "{chosen:?}");
        // Device 0 down: everything fails over to device 1.
        let down0 = |r: Replica| ReplicaHealth {
            reach: if r.device == 0 {
                Reach::Down
            } else {
                Reach::Up
            },
            ..up(100.0)
        };
        let chosen = assign_groups(&p, 0, &experts, rows, down0, |_, _| false);
        assert_eq!(chosen, vec![Some(d(1)); 4]);
        // A group may exclude the replica that already failed it.
        let chosen = assign_groups(
            &p,
            0,
            &experts,
            rows,
            |_| up(1.0),
            |g, r| g == 2 && r == d(1),
        );
        assert_eq!(chosen[2], Some(d(0)));
        // No replication and a down device: its experts have no usable copy.
        let single = Placement::single_node(&[true], 4, 2, 1).unwrap();
        let chosen = assign_groups(&single, 0, &experts, rows, down0, |_, _| false);
        for (e, c) in chosen.iter().enumerate() {
            assert_eq!(c.is_none(), single.replicas(0, e as u32) == [d(0)]);
        }
    }

    #[test]
    fn comparable_replicas_share_work_and_a_local_one_wins_while_comparable() {
        let p = Placement::balanced(&[true], 16, spec(&[1, 1], 2)).unwrap();
        let experts: Vec<u32> = (0..16).collect();
        // Two remote replicas of similar speed: the work is shared.
        let similar = |r: Replica| if r.node == 1 { up(400.0) } else { up(300.0) };
        let chosen = assign_groups(&p, 0, &experts, |_| 1, similar, |_, _| false);
        let on0 = chosen.iter().filter(|c| c.unwrap().node == 0).count();
        assert_eq!(on0, 8, "{chosen:?}");
        // Node 0 local: it takes the work until its load exceeds the remote's by the slack.
        let local0 = |r: Replica| ReplicaHealth {
            local: r.node == 0,
            ..similar(r)
        };
        let chosen = assign_groups(&p, 0, &experts, |_| 1, local0, |_, _| false);
        assert!(chosen.iter().all(|c| c.unwrap().node == 0), "{chosen:?}");
        let chosen = assign_groups(&p, 0, &experts, |_| 64, local0, |_, _| false);
        let on0 = chosen.iter().filter(|c| c.unwrap().node == 0).count();
        assert!(
            (9..16).contains(&on0),
            "local first, then shared: {chosen:?}"
        );
    }

    #[test]
    fn slow_and_suspect_replicas_are_avoided_while_others_live() {
        let p = Placement::balanced(&[true], 8, spec(&[1, 1], 2)).unwrap();
        let experts: Vec<u32> = (0..8).collect();
        // Node 1 answers in 50 ms, node 0 in 0.2 ms: all work goes to node 0 (its load
        // stays below the gap).
        let slow1 = |r: Replica| if r.node == 1 { up(50_000.0) } else { up(200.0) };
        let chosen = assign_groups(&p, 0, &experts, |_| 1, slow1, |_, _| false);
        assert!(chosen.iter().all(|c| c.unwrap().node == 0), "{chosen:?}");
        // Node 0 suspect: node 1 takes everything although it is slower.
        let suspect0 = |r: Replica| ReplicaHealth {
            reach: if r.node == 0 {
                Reach::Suspect
            } else {
                Reach::Up
            },
            ..slow1(r)
        };
        let chosen = assign_groups(&p, 0, &experts, |_| 1, suspect0, |_, _| false);
        assert!(chosen.iter().all(|c| c.unwrap().node == 1), "{chosen:?}");
        // Only suspect replicas left: still used.
        let chosen = assign_groups(&p, 0, &experts, |_| 1, suspect0, |_, r| r.node == 1);
        assert!(chosen.iter().all(|c| c.unwrap().node == 0), "{chosen:?}");
    }
}
