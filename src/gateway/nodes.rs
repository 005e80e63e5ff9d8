//! The nodes a gateway forwards to: the cluster's serving members, learned from gossip;
//! whether each is ready (its `/ready`, read every `gateway.ready_poll_ms`); how many of the
//! gateway's requests each runs; and which one a request goes to.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::affinity::Affinity;
use crate::cluster::{MemberState, Membership};

/// A node chosen for one request: its id and API address. It counts as running the
/// request until dropped.
pub struct Lease {
    pub node: String,
    pub api: SocketAddr,
    /// Why it was chosen: `prefix` (it holds the prompt's prefix) or `load`.
    pub why: &'static str,
    nodes: Nodes,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(n) = self.nodes.lock().running.get_mut(&self.node) {
            *n = n.saturating_sub(1);
        }
    }
}

#[derive(Default)]
struct Table {
    /// Node → whether its `/ready` said 200 the last time it was read.
    ready: HashMap<String, bool>,
    /// Node → the gateway's requests it runs.
    running: HashMap<String, usize>,
    affinity: Affinity,
    /// Breaks ties between equally loaded nodes in turn.
    turn: usize,
}

/// Cheap to clone.
#[derive(Clone)]
pub struct Nodes {
    membership: Membership,
    table: Arc<Mutex<Table>>,
    slack: usize,
}

impl Nodes {
    pub fn new(membership: Membership, balance_slack: usize) -> Self {
        Nodes {
            membership,
            table: Arc::default(),
            slack: balance_slack,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The serving members gossip says are alive: id and API address.
    pub fn alive(&self) -> Vec<(String, SocketAddr)> {
        self.membership
            .members()
            .into_iter()
            .filter(|m| !m.is_self && m.state == MemberState::Alive && m.meta.placement_version > 0)
            .map(|m| (m.meta.node, m.meta.api))
            .collect()
    }

    /// Whether `node` is still a member that is not down.
    pub fn is_up(&self, node: &str) -> bool {
        self.membership
            .members()
            .iter()
            .any(|m| m.meta.node == node && m.state != MemberState::Dead)
    }

    /// The alive nodes whose `/ready` said yes.
    pub fn ready(&self) -> Vec<(String, SocketAddr)> {
        let table = self.lock();
        self.alive()
            .into_iter()
            .filter(|(node, _)| table.ready.get(node).copied().unwrap_or(false))
            .collect()
    }

    /// `node` could not be reached: no request goes to it until its `/ready` answers again.
    pub fn unreachable(&self, node: &str) {
        self.lock().ready.insert(node.to_string(), false);
    }

    /// Reads every alive node's `/ready`, for ever, every `period`.
    pub async fn poll_ready(self, client: reqwest::Client, period: Duration) {
        loop {
            let alive = self.alive();
            let mut ready = HashMap::with_capacity(alive.len());
            for (node, api) in alive {
                let answer = client
                    .get(format!("http://{api}/ready"))
                    .timeout(Duration::from_secs(1))
                    .send()
                    .await;
                let is_ready = answer.is_ok_and(|r| r.status().is_success());
                ready.insert(node, is_ready);
            }
            self.lock().ready = ready;
            tokio::time::sleep(period).await;
        }
    }

    /// The node for a request whose prompt starts with `prefix`, other than those in
    /// `avoid` while there are others: the ready node that got the longest part of that
    /// prefix before, unless it runs more than `balance_slack` requests above the least
    /// loaded; else the least loaded (in turn among equals). `None`: no node is ready.
    pub fn choose(&self, prefix: &[u8], avoid: &[String]) -> Option<Lease> {
        let ready = self.ready();
        let mut table = self.lock();
        let others: Vec<&(String, SocketAddr)> =
            ready.iter().filter(|(n, _)| !avoid.contains(n)).collect();
        let candidates: Vec<&(String, SocketAddr)> = if others.is_empty() {
            ready.iter().collect()
        } else {
            others
        };
        let load = |table: &Table, node: &str| table.running.get(node).copied().unwrap_or(0);
        let least = candidates.iter().map(|(n, _)| load(&table, n)).min()?;
        let prefixed = table
            .affinity
            .best(prefix, |node| candidates.iter().any(|(n, _)| n == node))
            .filter(|(node, _)| load(&table, node) <= least + self.slack);
        let (node, api, why) = match prefixed {
            Some((node, _)) => {
                let api = candidates.iter().find(|(n, _)| *n == node)?.1;
                (node, api, "prefix")
            }
            None => {
                let equal: Vec<_> = candidates
                    .iter()
                    .filter(|(n, _)| load(&table, n) == least)
                    .collect();
                table.turn = table.turn.wrapping_add(1);
                let (node, api) = equal[table.turn % equal.len()];
                (node.clone(), *api, "load")
            }
        };
        table.affinity.sent(prefix, &node);
        *table.running.entry(node.clone()).or_default() += 1;
        drop(table);
        Some(Lease {
            node,
            api,
            why,
            nodes: self.clone(),
        })
    }

    /// The gateway's requests each node runs.
    pub fn running(&self) -> Vec<(String, usize)> {
        let mut running: Vec<_> = self.lock().running.clone().into_iter().collect();
        running.sort();
        running
    }
}
