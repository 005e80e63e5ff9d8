//! Partitions, deterministically: a router node's dispatcher sends a layer's expert groups
//! to two peer nodes over the in-memory transport (real peer clients and servers, real
//! expert weights from a fixture), while the test cuts the network between them.
//!
//! The behaviour chosen for a partition: there is no coordinator and no quorum. Each side
//! keeps serving with the replicas it can reach: work stuck behind the partition is hedged
//! to a reachable replica after `hedge_floor`, a connect that cannot cross fails over at
//! once, and an expert with no reachable replica fails the step at once (`fail`, 503 for
//! the request) or holds it until the partition heals (`wait`, up to `wait_for`). When the
//! partition heals, the far side is used again. With `reroute`, tokens go to the next-best
//! experts by gate score that have a reachable replica instead (degraded, and counted).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use moe_node::cluster::MemberState;
use moe_node::config::OnUnavailable;
use moe_node::engine::moe_layer::moe_routed;
use moe_node::experts::Penalties;
use moe_node::experts::remote::{PeerDirectory, PeerEntry, PeerNodes};
use moe_node::experts::{DispatchTiming, Dispatcher, Target};
use moe_node::experts::{ExpertExecutor, run_expert_groups};
use moe_node::model::weights::{DenseWeights, FeedForward, load_expert};
use moe_node::model::{Checkpoint, ExpertWeights, ModelConfig};
use moe_node::placement::{ExpertLoad, NodeSlots, Placement, PlacementSpec};
use moe_node::transport::peer::{Handler, PeerAuth, PeerSecrets, PeerServer, PeerStats};
use moe_node::transport::{Dtype, ExpertOutput, GroupRows, MemoryNetwork, RemoteError, Rows};

const ROUTER: &str = "10.0.0.1:7000";
const B: &str = "10.0.0.2:7000";
const C: &str = "10.0.0.3:7000";

fn addr(a: &str) -> SocketAddr {
    a.parse().unwrap()
}

/// Node ids to their fixed addresses; gossip says every one is alive (the partition is
/// on the data plane before gossip has decided anything). Rows travel to them as `.1`.
struct Static(HashMap<String, SocketAddr>, Dtype);

impl PeerDirectory for Static {
    fn lookup(&self, node: &str) -> Option<PeerEntry> {
        self.0.get(node).map(|&addr| PeerEntry {
            addr,
            state: MemberState::Alive,
            rows: self.1,
            generation: 1,
        })
    }
}

struct Fixture {
    checkpoint: Checkpoint,
    network: MemoryNetwork,
    runtime: tokio::runtime::Runtime,
    config: ModelConfig,
    experts: Arc<HashMap<(usize, u32), ExpertWeights>>,
    _servers: Vec<PeerServer>,
    auth: Arc<PeerAuth>,
    layer: usize,
}

fn fixture() -> Fixture {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v3");
    let config = ModelConfig::load(&dir).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let layer = config.moe_layers.iter().position(|&m| m).unwrap();
    let experts: HashMap<(usize, u32), ExpertWeights> = (0..config.moe.num_experts as u32)
        .map(|e| {
            (
                (layer, e),
                load_expert(&checkpoint, &config, layer, e as usize).unwrap(),
            )
        })
        .collect();
    let experts = Arc::new(experts);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let network = MemoryNetwork::new();
    let auth = Arc::new(PeerAuth {
        node_id: "test".into(),
        secrets: PeerSecrets::new(vec![b"partition-test-secret".to_vec()]),
        model_fingerprint: 1,
    });
    let width = config.hidden_size;
    let servers = [B, C]
        .iter()
        .map(|&node| {
            let held = experts.clone();
            // A peer node: runs the groups through the fixture's experts, as its devices
            // would.
            let handler: Handler = Arc::new(move |request| {
                let mut groups = Vec::new();
                let mut at = 0;
                for &(expert, rows) in &request.groups {
                    let weights = held.get(&(request.layer as usize, expert)).ok_or(
                        RemoteError::NotHeld {
                            layer: request.layer,
                            expert,
                        },
                    )?;
                    let len = rows as usize * width;
                    groups.push((weights, &request.rows[at..at + len]));
                    at += len;
                }
                Ok(ExpertOutput {
                    groups: request.groups.clone(),
                    rows: Rows::parts(GroupRows::own_each(run_expert_groups(
                        &groups, width, false,
                    ))),
                })
            });
            PeerServer::start(
                Arc::new(network.transport(addr(node))),
                addr(node),
                auth.clone(),
                Arc::new(PeerStats::default()),
                handler,
                runtime.handle().clone(),
            )
            .unwrap()
        })
        .collect();
    Fixture {
        checkpoint,
        network,
        runtime,
        config,
        experts,
        _servers: servers,
        auth,
        layer,
    }
}

impl Fixture {
    /// The router node: no devices of its own, every expert on B and on C.
    fn router(&self, on_unavailable: OnUnavailable) -> Dispatcher {
        self.router_with(on_unavailable, 2)
    }

    /// The router node, its experts on B and C with `replication` copies.
    fn router_with(&self, on_unavailable: OnUnavailable, replication: usize) -> Dispatcher {
        let stats = Arc::new(PeerStats::default());
        self.router_sending(on_unavailable, replication, Dtype::F32, stats)
    }

    /// The router node, sending rows to B and C as `rows` and counting bytes in `stats`.
    fn router_sending(
        &self,
        on_unavailable: OnUnavailable,
        replication: usize,
        rows: Dtype,
        stats: Arc<PeerStats>,
    ) -> Dispatcher {
        let spec = PlacementSpec {
            version: 1,
            replication,
            nodes: ["B", "C"].iter().map(|n| NodeSlots::new(*n, 1)).collect(),
        };
        let placement =
            Placement::balanced(&self.config.moe_layers, self.config.moe.num_experts, spec)
                .unwrap();
        let directory = Static(
            [("B".to_string(), addr(B)), ("C".to_string(), addr(C))]
                .into_iter()
                .collect(),
            rows,
        );
        let peers = PeerNodes::new(
            Arc::new(self.network.transport(addr(ROUTER))),
            self.runtime.handle().clone(),
            self.auth.clone(),
            stats,
            Arc::new(directory),
            vec!["B".into(), "C".into()],
            self.config.hidden_size,
        );
        let timing = DispatchTiming {
            hedge_floor: Duration::from_millis(50),
            give_up: Duration::from_secs(1),
            penalties: Penalties {
                slow_for: Duration::from_millis(200),
                down_for: Duration::from_millis(200),
            },
            on_unavailable,
            wait_for: Duration::from_secs(5),
        };
        Dispatcher::new(
            Vec::new(),
            Arc::new(placement),
            u16::MAX,
            Arc::new(ExpertLoad::new(
                self.config.num_layers,
                self.config.moe.num_experts,
                0,
            )),
            self.config.hidden_size,
            timing,
        )
        .with_remote(Arc::new(peers))
    }

    /// One layer's work: every expert, a few rows each; and the outputs one node computes.
    fn work(&self) -> (Vec<u32>, Vec<usize>, Vec<f32>, Vec<Vec<f32>>) {
        let width = self.config.hidden_size;
        let experts: Vec<u32> = (0..self.config.moe.num_experts as u32).collect();
        let rows: Vec<usize> = experts.iter().map(|&e| 1 + e as usize % 3).collect();
        let total: usize = rows.iter().sum();
        let input: Vec<f32> = (0..total * width)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let mut at = 0;
        let groups: Vec<_> = experts
            .iter()
            .zip(&rows)
            .map(|(&e, &r)| {
                let g = (&self.experts[&(self.layer, e)], &input[at..at + r * width]);
                at += r * width;
                g
            })
            .collect();
        let expected = run_expert_groups(&groups, width, false);
        (experts, rows, input, expected)
    }
}

#[test]
fn a_partition_is_routed_around_fails_cleanly_when_total_and_heals() {
    let f = fixture();
    let router = f.router(OnUnavailable::Fail);
    let (experts, rows, input, expected) = f.work();
    let run = |d: &Dispatcher| d.run_groups(f.layer, &experts, &rows, &input, false);

    // Connected: the remote outputs are bit-equal to computing here.
    assert_eq!(run(&router).unwrap(), expected);

    // B cut off from the router (links held silent, new connects refused): its groups are
    // hedged to C after the floor and the step still gives the same outputs.
    f.network.partition(&[&[addr(ROUTER), addr(C)], &[addr(B)]]);
    let started = Instant::now();
    assert_eq!(run(&router).unwrap(), expected);
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    let rerouted = router.counters.hedges.load(Ordering::Relaxed)
        + router.counters.failovers.load(Ordering::Relaxed);
    assert!(rerouted > 0, "B's groups went to C");
    // B's unanswered sends are not counted as its load once the step is done (they would
    // be for good: their answers come to nobody).
    let load: Vec<_> = router
        .targets()
        .into_iter()
        .map(|(t, h)| (t, h.outstanding_rows))
        .collect();
    assert!(load.iter().all(|&(_, rows)| rows == 0), "{load:?}");
    // While B stays unreachable the next steps avoid it.
    assert_eq!(run(&router).unwrap(), expected);

    // The router alone on its side: no replica reachable, the step fails at once (within
    // the give-up time), naming the experts.
    f.network.partition(&[&[addr(ROUTER)], &[addr(B), addr(C)]]);
    let started = Instant::now();
    let error = run(&router).unwrap_err().to_string();
    assert!(error.contains("no live replica holds expert"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );

    // Healed: served again, the same outputs.
    f.network.heal();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(run(&router).unwrap(), expected);
}

/// The first send to a node waits for its link (connect, handshake; over UCX also the
/// worker's set-up, tens of ms): that answer time is not taken as the node's latency, or a
/// node just (re)joined would look far slower than its peers and get no work.
#[test]
fn a_links_set_up_is_not_measured_as_the_nodes_latency() {
    let f = fixture();
    let router = f.router(OnUnavailable::Fail);
    let (experts, rows, input, expected) = f.work();
    let run = || router.run_groups(f.layer, &experts, &rows, &input, false);
    let measured = || -> Vec<(Target, f64)> {
        router
            .targets()
            .into_iter()
            .map(|(t, h)| (t, h.latency_micros))
            .collect()
    };
    // Every send of the first step waited for its link: nothing measured yet (the latency
    // assumed before the first answer is 500 us).
    assert_eq!(run().unwrap(), expected);
    let first = measured();
    assert_eq!(first.len(), 2, "{first:?}");
    assert!(first.iter().all(|&(_, l)| l == 500.0), "{first:?}");
    // The links are up now: the next step's answers are measured.
    assert_eq!(run().unwrap(), expected);
    let second = measured();
    assert!(second.iter().all(|&(_, l)| l != 500.0), "{second:?}");
}

#[test]
fn with_wait_a_step_holds_until_the_partition_heals() {
    let f = fixture();
    let router = f.router(OnUnavailable::Wait);
    let (experts, rows, input, expected) = f.work();
    assert_eq!(
        router
            .run_groups(f.layer, &experts, &rows, &input, false)
            .unwrap(),
        expected
    );
    f.network.partition(&[&[addr(ROUTER)], &[addr(B), addr(C)]]);
    let started = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(700));
            f.network.heal();
        });
        let outputs = router
            .run_groups(f.layer, &experts, &rows, &input, false)
            .unwrap();
        assert_eq!(outputs, expected);
    });
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(700) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
}

#[test]
fn with_reroute_tokens_go_to_the_next_best_experts_that_have_a_reachable_replica() {
    let f = fixture();
    // One copy of each expert: C's experts have no replica on the router's side.
    let router = f.router_with(OnUnavailable::Reroute, 1);
    let weights = DenseWeights::load(&f.checkpoint, &f.config).unwrap();
    let FeedForward::Moe(moe) = &weights.layers[f.layer].feed_forward else {
        panic!("layer {} is a MoE layer", f.layer)
    };
    let (rows, width) = (8, f.config.hidden_size);
    let normed: Vec<f32> = (0..rows * width)
        .map(|i| ((i * 104_729) % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    let layer = |d: &Dispatcher| moe_routed(&f.config.moe, moe, d, f.layer, &normed, rows, &mut []);
    let whole = layer(&router).unwrap();
    assert_eq!(
        router.avoid(f.layer),
        Some(vec![false; f.config.moe.num_experts])
    );
    assert_eq!(router.counters.rerouted.load(Ordering::Relaxed), 0);

    // C cut off: the first step that needs it finds out (its connect fails); from then on
    // its experts are routed around, and the layer is served, degraded.
    f.network.partition(&[&[addr(ROUTER), addr(B)], &[addr(C)]]);
    let _ = layer(&router);
    let avoid = router.avoid(f.layer).unwrap();
    let on_c = router.placement();
    for (expert, &avoided) in avoid.iter().enumerate() {
        let replicas = on_c.replicas(f.layer, expert as u32);
        assert_eq!(
            avoided,
            replicas[0].node == 1,
            "expert {expert}: {replicas:?}"
        );
    }
    let degraded = layer(&router).expect("served by B's experts");
    assert!(router.counters.rerouted.load(Ordering::Relaxed) > 0);
    assert_ne!(degraded, whole, "the output is degraded, not the model's");

    // Healed: once C's penalty has passed, the layer computes what the model computes.
    f.network.heal();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(layer(&router).unwrap(), whole);
}

/// Rows go to GPU nodes as bf16 (half the bytes; a GPU rounds f32 rows to bf16 anyway), to
/// CPU nodes as f32 (so their results are exact). B and C here compute on the CPU: with
/// bf16 rows they compute on the rounded rows and answer rounded outputs, bit for bit.
#[test]
fn rows_travel_in_the_dtype_the_receiving_devices_consume() {
    let f = fixture();
    let (experts, rows, input, expected) = f.work();
    let sent = |dtype: Dtype| {
        let stats = Arc::new(PeerStats::default());
        let router = f.router_sending(OnUnavailable::Fail, 2, dtype, stats.clone());
        let outputs = router
            .run_groups(f.layer, &experts, &rows, &input, false)
            .unwrap();
        (outputs, stats.bytes_sent.load(Ordering::Relaxed))
    };
    let (exact, f32_bytes) = sent(Dtype::F32);
    assert_eq!(exact, expected);
    let (rounded, bf16_bytes) = sent(Dtype::Bf16);
    let round = |v: &f32| half::bf16::from_f32(*v).to_f32();
    let width = f.config.hidden_size;
    let rounded_input: Vec<f32> = input.iter().map(round).collect();
    let mut at = 0;
    let groups: Vec<_> = experts
        .iter()
        .zip(&rows)
        .map(|(&e, &r)| {
            let g = (
                &f.experts[&(f.layer, e)],
                &rounded_input[at..at + r * width],
            );
            at += r * width;
            g
        })
        .collect();
    let want: Vec<Vec<f32>> = run_expert_groups(&groups, width, false)
        .iter()
        .map(|g| g.iter().map(round).collect())
        .collect();
    assert_eq!(rounded, want);
    let payload = (input.len() * 2) as f64;
    assert!(
        (f32_bytes - bf16_bytes) as f64 >= payload * 0.9,
        "bf16 saves half the row bytes: {f32_bytes} -> {bf16_bytes}"
    );
}
