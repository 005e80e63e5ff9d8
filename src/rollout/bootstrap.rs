//! How a starting node gets the placement it serves under. A node that joins a running
//! cluster (or restarts into one) takes the placement the cluster serves, fetched from a
//! member that announces one; at the first start of a cluster, the node with the lowest id
//! places the experts over the live nodes once `expect_nodes` of them are there, and the
//! others take it from that node. No hand-run coordinator.

use std::time::{Duration, Instant};

use crate::cluster::{MemberState, MemberView, Membership};
use crate::placement::{NodeSlots, PlacementSpec, PlacementTable};

/// What a starting node does next, decided from what gossip shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A member serves a placement: take it from that member (index into the members).
    Fetch(usize),
    /// This node is the lowest id among enough live nodes: it places the experts.
    Create(PlacementSpec),
    /// Not enough nodes yet.
    Wait { alive: usize },
}

/// Decides for node `me` from `members` (itself included).
pub fn decide(
    members: &[MemberView],
    me: &str,
    expect_nodes: usize,
    replication: usize,
) -> Decision {
    let alive: Vec<(usize, &MemberView)> = members
        .iter()
        .enumerate()
        .filter(|(_, m)| m.state == MemberState::Alive)
        .collect();
    if let Some((i, _)) = alive
        .iter()
        .filter(|(_, m)| !m.is_self && m.meta.placement_version > 0)
        .max_by_key(|(_, m)| m.meta.placement_version)
    {
        return Decision::Fetch(*i);
    }
    let mut nodes: Vec<NodeSlots> = alive.iter().map(|(_, m)| super::offered(&m.meta)).collect();
    nodes.sort_by(|a, b| a.node.cmp(&b.node));
    nodes.dedup_by(|a, b| a.node == b.node);
    if nodes.len() < expect_nodes {
        return Decision::Wait { alive: nodes.len() };
    }
    if nodes.first().is_some_and(|n| n.node == me) {
        Decision::Create(PlacementSpec {
            version: 1,
            replication,
            nodes,
        })
    } else {
        // The leader places; its placement shows up in its metadata.
        Decision::Wait { alive: nodes.len() }
    }
}

/// How a starting node gets its placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// It places the experts (the first start of a cluster).
    Create(PlacementSpec),
    /// It takes the placement the cluster serves.
    Take(PlacementTable),
}

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error(
        "no placement after {seconds} s: {alive} of cluster.expect_nodes = {expect} nodes \
         alive and none serving; check cluster.seeds, the secrets and that every node serves the same model"
    )]
    Timeout {
        seconds: u64,
        alive: usize,
        expect: usize,
    },
}

/// Waits until this node has a placement: fetched from a member that serves one, or made
/// here when this node leads the first start.
pub fn await_placement(
    membership: &Membership,
    me: &str,
    expect_nodes: usize,
    replication: usize,
    timeout: Duration,
    fetch: impl Fn(&MemberView) -> Result<PlacementTable, String>,
) -> Result<Start, BootstrapError> {
    let start = Instant::now();
    let mut last_alive = usize::MAX;
    loop {
        let members = membership.members();
        match decide(&members, me, expect_nodes, replication) {
            Decision::Fetch(i) => match fetch(&members[i]) {
                Ok(table) => {
                    tracing::info!(from = %members[i].meta.node, version = table.spec.version, "took the cluster's placement");
                    return Ok(Start::Take(table));
                }
                Err(e) => {
                    tracing::warn!(from = %members[i].meta.node, error = %e, "could not fetch the placement; trying again")
                }
            },
            Decision::Create(spec) => {
                tracing::info!(
                    nodes = spec.nodes.len(),
                    "placing experts over the cluster (this node has the lowest id)"
                );
                return Ok(Start::Create(spec));
            }
            Decision::Wait { alive } => {
                if alive != last_alive {
                    tracing::info!(alive, expect = expect_nodes, "waiting for cluster members");
                    last_alive = alive;
                }
                if start.elapsed() >= timeout {
                    return Err(BootstrapError::Timeout {
                        seconds: timeout.as_secs(),
                        alive,
                        expect: expect_nodes,
                    });
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// GETs `url` from a member's API with this node's API keys as they are now (a reload
/// changes them), trying each in turn while the member refuses one: during a rotation a
/// member may not hold the newest key yet. No keys: no Authorization header.
fn get_with_keys(url: &str, api_keys: &[String]) -> Result<reqwest::blocking::Response, String> {
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| e.to_string())?;
    let mut keys = api_keys.iter().map(Some).collect::<Vec<_>>();
    if keys.is_empty() {
        keys.push(None);
    }
    let last = keys.len() - 1;
    for (i, key) in keys.into_iter().enumerate() {
        let mut request = client.get(url);
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let response = request.send().map_err(|e| format!("{url}: {e}"))?;
        if response.status() != reqwest::StatusCode::UNAUTHORIZED || i == last {
            return Ok(response);
        }
    }
    unreachable!("the last key's answer is returned")
}

/// Reads placement `version` from a member's API (the one it serves, or the one it
/// loads ahead of a switch).
pub fn fetch_table(
    api: std::net::SocketAddr,
    version: u64,
    api_keys: &[String],
) -> Result<PlacementTable, String> {
    let url = format!("http://{api}/cluster/placement/{version}");
    let response = get_with_keys(&url, api_keys)?;
    if !response.status().is_success() {
        return Err(format!("{url}: {}", response.status()));
    }
    let table = response
        .json::<PlacementTable>()
        .map_err(|e| format!("{url}: {e}"))?;
    if table.spec.version != version {
        return Err(format!(
            "{url}: version {} instead of {version}",
            table.spec.version
        ));
    }
    Ok(table)
}

/// Reads a member's activation counts over its recent window
/// (`GET /admin/experts?format=profile`): a rebalance across the cluster adds them up.
pub fn fetch_profile(
    api: std::net::SocketAddr,
    api_keys: &[String],
) -> Result<crate::placement::Profile, String> {
    let url = format!("http://{api}/admin/experts?format=profile");
    let response = get_with_keys(&url, api_keys)?;
    if !response.status().is_success() {
        return Err(format!("{url}: {}", response.status()));
    }
    response.json().map_err(|e| format!("{url}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(node: &str, state: MemberState, version: u64, is_self: bool) -> MemberView {
        MemberView {
            is_self,
            ..MemberView::for_test(node, state, version, version)
        }
    }

    #[test]
    fn the_lowest_id_places_once_enough_nodes_live() {
        use MemberState::*;
        let two = [member("b", Alive, 0, true), member("a", Alive, 0, false)];
        assert_eq!(decide(&two, "b", 3, 2), Decision::Wait { alive: 2 });
        let three = [
            member("b", Alive, 0, true),
            member("a", Alive, 0, false),
            member("c", Alive, 0, false),
            member("d", Dead, 0, false),
        ];
        assert_eq!(decide(&three, "b", 3, 2), Decision::Wait { alive: 3 });
        let mut as_a = three.clone();
        as_a[0].is_self = false;
        as_a[1].is_self = true;
        // c's first device carries a dense replica and has room for fewer experts.
        as_a[2].meta.expert_slots = vec![3, 9];
        match decide(&as_a, "a", 3, 2) {
            Decision::Create(spec) => {
                let ids: Vec<&str> = spec.nodes.iter().map(|n| n.node.as_str()).collect();
                assert_eq!(ids, ["a", "b", "c"], "sorted, dead members left out");
                assert_eq!((spec.version, spec.replication), (1, 2));
                assert_eq!(spec.nodes[2].slots, [3, 9], "the slots each gossips");
                assert!(spec.nodes[0].slots.is_empty());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_node_joining_a_serving_cluster_takes_its_placement() {
        use MemberState::*;
        let members = [
            member("a", Alive, 0, true),
            member("b", Alive, 1, false),
            member("c", Alive, 2, false),
            member("d", Dead, 9, false),
        ];
        assert_eq!(decide(&members, "a", 3, 2), Decision::Fetch(2));
    }
}
