//! The dispatcher's remote path alone: a router node's [`Dispatcher`] sends one layer's
//! groups to another node over TCP loopback (real `PeerNodes`, peer client and server),
//! whose handler hands the rows back, so this times what the data plane does to the rows
//! (gather, encode, decode, split into groups, put in plan order) and the transport, not
//! the experts.
//!
//! `cargo bench --bench remote_dispatch` prints, per case (rows × width, in f32 and in
//! bf16), the median time of `ExpertExecutor::run` over `MOE_REMOTE_ITERS` calls (default
//! 200; a tenth of that for the large case) and the rows' bytes per second (one way).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use moe_node::cluster::MemberState;
use moe_node::experts::remote::{PeerDirectory, PeerEntry, PeerNodes};
use moe_node::experts::{DispatchTiming, Dispatcher, ExpertExecutor};
use moe_node::moe::DispatchPlan;
use moe_node::placement::{ExpertLoad, NodeSlots, Placement, PlacementSpec};
use moe_node::transport::{
    Dtype, ExpertOutput, ExpertRequest, Handler, PeerAuth, PeerSecrets, PeerServer, PeerStats,
    Rows, TcpTransport, Transport,
};

const WIDTH: usize = 7168;
const EXPERTS: usize = 16;

/// The one other node, alive, taking rows as `.1`.
struct OneNode(SocketAddr, Dtype);

impl PeerDirectory for OneNode {
    fn lookup(&self, node: &str) -> Option<PeerEntry> {
        (node == "B").then_some(PeerEntry {
            addr: self.0,
            state: MemberState::Alive,
            rows: self.1,
            generation: 1,
        })
    }
}

/// `rows` grouped rows spread evenly over every expert.
fn plan(rows: usize) -> DispatchPlan {
    let per = rows / EXPERTS;
    DispatchPlan {
        experts: (0..EXPERTS as u32).collect(),
        offsets: (0..=EXPERTS).map(|g| g * per).collect(),
        source_rows: (0..rows as u32).collect(),
        weights: vec![1.0; rows],
    }
}

fn router(addr: SocketAddr, dtype: Dtype, runtime: &tokio::runtime::Runtime) -> Dispatcher {
    let spec = PlacementSpec {
        version: 1,
        replication: 1,
        nodes: vec![NodeSlots::new("B", 1)],
    };
    let placement = Placement::balanced(&[true], EXPERTS, spec).expect("placement");
    let auth = Arc::new(PeerAuth {
        node_id: "router".into(),
        secrets: PeerSecrets::new(vec![b"bench secret".to_vec()]),
        model_fingerprint: 1,
    });
    let transport: Arc<dyn Transport> = Arc::new(TcpTransport::default());
    let peers = PeerNodes::new(
        transport,
        runtime.handle().clone(),
        auth,
        Arc::new(PeerStats::default()),
        Arc::new(OneNode(addr, dtype)),
        vec!["B".into()],
        WIDTH,
    );
    Dispatcher::new(
        Vec::new(),
        Arc::new(placement),
        u16::MAX,
        Arc::new(ExpertLoad::new(1, EXPERTS, 0)),
        WIDTH,
        DispatchTiming::default(),
    )
    .with_remote(Arc::new(peers))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let iters: usize = std::env::var("MOE_REMOTE_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let auth = Arc::new(PeerAuth {
        node_id: "B".into(),
        secrets: PeerSecrets::new(vec![b"bench secret".to_vec()]),
        model_fingerprint: 1,
    });
    let echo: Handler = Arc::new(|request: ExpertRequest| {
        Ok(ExpertOutput {
            groups: request.groups,
            rows: Rows::one(request.rows),
        })
    });
    let server = PeerServer::start(
        Arc::new(TcpTransport::default()),
        "127.0.0.1:0".parse().expect("addr"),
        auth,
        Arc::new(PeerStats::default()),
        echo,
        runtime.handle().clone(),
    )
    .expect("server");
    println!(
        "dispatcher remote path over TCP loopback, {EXPERTS} groups, width {WIDTH}, median of the calls"
    );
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let dispatcher = router(server.local_addr(), dtype, &runtime);
        for rows in [16, 64, 512] {
            let plan = plan(rows);
            let input: Vec<f32> = (0..rows * WIDTH).map(|i| (i % 977) as f32 * 0.01).collect();
            let calls = if rows > 64 {
                (iters / 10).max(5)
            } else {
                iters
            };
            // The first calls set up the link.
            for _ in 0..3 {
                dispatcher.run(0, &plan, &input).expect("warm-up");
            }
            let mut times = Vec::with_capacity(calls);
            for _ in 0..calls {
                let start = Instant::now();
                let out = dispatcher.run(0, &plan, &input).expect("run");
                times.push(start.elapsed().as_secs_f64() * 1e6);
                assert_eq!(out.len(), input.len());
            }
            let us = median(&mut times);
            let bytes = (rows * WIDTH * dtype.size()) as f64;
            println!(
                "{rows:>4} rows {dtype:?}: {us:>9.1} us a call, {:.2} GB/s of rows one way",
                bytes / us / 1e3
            );
        }
    }
}
