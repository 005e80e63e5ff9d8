//! The nodes a gateway forwards to: the cluster's serving members, learned from gossip;
//! whether each is ready (its `/ready`, read every `gateway.ready_poll_ms`), and the load it
//! reported there; how many of the gateway's requests each runs; and which one a request
//! goes to.

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

/// The load a node reported in its `/ready` answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reported {
    /// Its sequences running and waiting, from every client and gateway.
    pub sequences: usize,
    /// Its KV cache is nine tenths full or more: a request sent there may wait or
    /// preempt another.
    pub kv_full: bool,
}

impl Reported {
    /// From a `/ready` body's `load` (absent fields: nothing reported).
    pub fn from_ready(body: &serde_json::Value) -> Reported {
        let load = &body["load"];
        let number = |key: &str| load[key].as_u64().unwrap_or(0) as usize;
        let (used, blocks) = (number("kv_cache_blocks_used"), number("kv_cache_blocks"));
        Reported {
            sequences: number("running") + number("waiting"),
            kv_full: blocks > 0 && used * 10 >= blocks * 9,
        }
    }
}

#[derive(Default)]
struct Table {
    /// Node → whether its `/ready` said 200 the last time it was read.
    ready: HashMap<String, bool>,
    /// Node → the load its last `/ready` reported.
    reported: HashMap<String, Reported>,
    /// Node → the gateway's requests it runs.
    running: HashMap<String, usize>,
    affinity: Affinity,
    /// Breaks ties between equally loaded nodes in turn.
    turn: usize,
}

impl Table {
    /// The node for a request whose prompt starts with `prefix`, among `ready`: other than
    /// those in `avoid` while there are others, and other than those whose KV cache is full
    /// while there are others; the node that got the longest part of that prefix before,
    /// unless it is loaded more than `slack` requests above the least loaded; else the
    /// least loaded (in turn among equals). A node's load is the larger of the gateway's
    /// requests it runs now and the sequences it reported at its last `/ready` (those of
    /// every client, but up to `ready_poll_ms` old). The node chosen counts one more
    /// request; the reason is `prefix` or `load`.
    fn pick(
        &mut self,
        ready: &[(String, SocketAddr)],
        prefix: &[u8],
        avoid: &[String],
        slack: usize,
    ) -> Option<(String, SocketAddr, &'static str)> {
        let reported =
            |table: &Table, node: &str| table.reported.get(node).copied().unwrap_or_default();
        let others: Vec<&(String, SocketAddr)> =
            ready.iter().filter(|(n, _)| !avoid.contains(n)).collect();
        let others = if others.is_empty() {
            ready.iter().collect()
        } else {
            others
        };
        let roomy: Vec<&(String, SocketAddr)> = others
            .iter()
            .copied()
            .filter(|(n, _)| !reported(self, n).kv_full)
            .collect();
        let candidates = if roomy.is_empty() { others } else { roomy };
        let load = |table: &Table, node: &str| {
            let own = table.running.get(node).copied().unwrap_or(0);
            own.max(reported(table, node).sequences)
        };
        let least = candidates.iter().map(|(n, _)| load(self, n)).min()?;
        let prefixed = self
            .affinity
            .best(prefix, |node| candidates.iter().any(|(n, _)| n == node))
            .filter(|(node, _)| load(self, node) <= least + slack);
        let (node, api, why) = match prefixed {
            Some((node, _)) => {
                let api = candidates.iter().find(|(n, _)| *n == node)?.1;
                (node, api, "prefix")
            }
            None => {
                let equal: Vec<_> = candidates
                    .iter()
                    .filter(|(n, _)| load(self, n) == least)
                    .collect();
                self.turn = self.turn.wrapping_add(1);
                let (node, api) = equal[self.turn % equal.len()];
                (node.clone(), *api, "load")
            }
        };
        self.affinity.sent(prefix, &node);
        *self.running.entry(node.clone()).or_default() += 1;
        Some((node, api, why))
    }
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

    /// Reads every alive node's `/ready` (all at once), for ever, every `period`.
    pub async fn poll_ready(self, client: reqwest::Client, period: Duration) {
        loop {
            let asked = self.alive().into_iter().map(|(node, api)| {
                let client = &client;
                async move {
                    let answer = client
                        .get(format!("http://{api}/ready"))
                        .timeout(Duration::from_secs(1))
                        .send()
                        .await;
                    let ready = match answer {
                        // Ready whatever the body says; a body without a load reports none.
                        Ok(r) if r.status().is_success() => Some(
                            r.json()
                                .await
                                .map(|body| Reported::from_ready(&body))
                                .unwrap_or_default(),
                        ),
                        _ => None,
                    };
                    (node, ready)
                }
            });
            let answers = futures::future::join_all(asked).await;
            self.record(answers);
            tokio::time::sleep(period).await;
        }
    }

    /// What one poll of the nodes' `/ready` found: per node, its load when it was ready.
    fn record(&self, answers: Vec<(String, Option<Reported>)>) {
        let mut table = self.lock();
        table.ready = answers
            .iter()
            .map(|(node, r)| (node.clone(), r.is_some()))
            .collect();
        table.reported = answers
            .into_iter()
            .filter_map(|(node, r)| Some((node, r?)))
            .collect();
    }

    /// The node for a request whose prompt starts with `prefix` ([`Table::pick`] among the
    /// ready nodes). `None`: no node is ready.
    pub fn choose(&self, prefix: &[u8], avoid: &[String]) -> Option<Lease> {
        let ready = self.ready();
        let (node, api, why) = self.lock().pick(&ready, prefix, avoid, self.slack)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(names: &[&str]) -> Vec<(String, SocketAddr)> {
        names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                (
                    n.to_string(),
                    SocketAddr::from(([127, 0, 0, 1], 8000 + i as u16)),
                )
            })
            .collect()
    }

    fn reported(sequences: usize, used: u64, blocks: u64) -> Reported {
        Reported::from_ready(&serde_json::json!({
            "status": "ready",
            "load": {"running": sequences, "waiting": 0,
                     "kv_cache_blocks_used": used, "kv_cache_blocks": blocks},
        }))
    }

    #[test]
    fn a_node_busy_with_other_clients_is_not_the_least_loaded() {
        let ready = nodes(&["a", "b", "c"]);
        let mut table = Table::default();
        // The gateway runs nothing anywhere, but `a` and `c` report work of other clients.
        table.reported.insert("a".into(), reported(6, 10, 100));
        table.reported.insert("c".into(), reported(3, 10, 100));
        let (first, _, why) = table.pick(&ready, b"p1", &[], 4).unwrap();
        assert_eq!((first.as_str(), why), ("b", "load"));
        // b now runs one of the gateway's: the next go to b until it is as loaded as c
        // (3), then to both, never to a (6).
        let mut chosen = Vec::new();
        for prompt in [b"p2", b"p3", b"p4", b"p5"] {
            chosen.push(table.pick(&ready, prompt, &[], 4).unwrap().0);
        }
        assert_eq!(chosen[..2], ["b", "b"]);
        assert!(chosen.iter().any(|n| n == "c"), "{chosen:?}");
        assert!(!chosen.iter().any(|n| n == "a"), "{chosen:?}");
    }

    #[test]
    fn a_node_whose_kv_cache_is_full_gets_requests_only_when_all_are_full() {
        let ready = nodes(&["a", "b"]);
        let mut table = Table::default();
        table.reported.insert("a".into(), reported(0, 95, 100));
        table.reported.insert("b".into(), reported(9, 10, 100));
        for prompt in [b"p1", b"p2", b"p3"] {
            assert_eq!(table.pick(&ready, prompt, &[], 4).unwrap().0, "b");
        }
        table.reported.insert("b".into(), reported(9, 99, 100));
        assert_eq!(table.pick(&ready, b"p4", &[], 4).unwrap().0, "a");
        // Nothing reported (an older node): no budget, never full.
        assert_eq!(
            Reported::from_ready(&serde_json::json!({"status": "ready"})),
            Reported::default()
        );
    }

    #[test]
    fn a_prefix_stays_on_its_node_within_the_slack_of_reported_load() {
        let ready = nodes(&["a", "b"]);
        let mut table = Table::default();
        // Longer than one of the affinity's 64-byte blocks.
        let prompt = [b'x'; 200];
        let (home, _, _) = table.pick(&ready, &prompt, &[], 2).unwrap();
        table.reported.insert(home.clone(), reported(2, 0, 0));
        let (again, _, why) = table.pick(&ready, &prompt, &[], 2).unwrap();
        assert_eq!((again.as_str(), why), (home.as_str(), "prefix"));
        table.reported.insert(home.clone(), reported(9, 0, 0));
        let (moved, _, why) = table.pick(&ready, &prompt, &[], 2).unwrap();
        assert_ne!(moved, home);
        assert_eq!(why, "load");
    }
}
