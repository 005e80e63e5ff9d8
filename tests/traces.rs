//! OpenTelemetry traces over OTLP: two nodes (one copy of each expert, so that every step
//! calls the other node) export to a receiver in this test, which decodes the OTLP/HTTP
//! protobuf bodies with the exporter's own message types. One request sent to node1 is
//! one trace: its request span, the steps under it, each MoE layer's dispatch under a step,
//! the calls to node2 under a dispatch, and node2's work under the call that asked for it,
//! exported by node2 in the same trace. A request with a W3C `traceparent`, sent through a
//! gateway, continues the caller's trace.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;

mod cluster_harness;
mod common;
mod serve;

use cluster_harness::{ClusterSpec, Gateway, Node, Transport, completion, generate_alone};

/// One span as received: who sent it, and where it sits in its trace.
#[derive(Debug, Clone)]
struct Received {
    node: String,
    name: String,
    trace: Vec<u8>,
    id: Vec<u8>,
    parent: Vec<u8>,
    attributes: HashMap<String, String>,
}

/// An OTLP/HTTP traces receiver: every span posted to it, decoded.
struct Receiver {
    endpoint: String,
    spans: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}/v1/traces", listener.local_addr().unwrap());
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = spans.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let kept = kept.clone();
                std::thread::spawn(move || serve_exports(stream, &kept));
            }
        });
        Receiver { endpoint, spans }
    }

    fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }
}

/// Answers every export on one connection (the exporter keeps it alive).
fn serve_exports(stream: TcpStream, kept: &Mutex<Vec<Received>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut length = 0;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            if header.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        assert!(line.starts_with("POST /v1/traces"), "{line}");
        let export = ExportTraceServiceRequest::decode(&body[..]).expect("an OTLP export");
        let mut spans = kept.lock().unwrap();
        for resource in export.resource_spans {
            let node = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.instance.id")
                .map(|a| text(a.value.as_ref()))
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for span in scope.spans {
                    spans.push(Received {
                        node: node.clone(),
                        name: span.name,
                        trace: span.trace_id,
                        id: span.span_id,
                        parent: span.parent_span_id,
                        attributes: span
                            .attributes
                            .iter()
                            .map(|a| (a.key.clone(), text(a.value.as_ref())))
                            .collect(),
                    });
                }
            }
        }
        let answer = "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n\
                      Content-Length: 0\r\n\r\n";
        if out.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

fn text(value: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

#[test]
fn a_request_that_crosses_two_nodes_is_one_trace_parented_call_by_call() {
    let receiver = Receiver::start();
    let spec = ClusterSpec::new(2, Transport::Tcp);
    let nodes: Vec<Node> = (0..2)
        .map(|i| {
            // Two nodes, one copy of each expert: every step needs the other node.
            let telemetry = format!(
                "[telemetry]\notlp_endpoint = \"{}\"\nsample_ratio = 1.0\n",
                receiver.endpoint
            );
            let (name, config) = spec.one_copy_config(i, &telemetry);
            // Batches go every 100 ms, not every 5 s.
            let env = [("OTEL_BSP_SCHEDULE_DELAY", "100".as_ref())];
            Node::start_with_env(&name, config, cluster_harness::model(), &env)
        })
        .collect();
    for node in &nodes {
        node.wait_ready();
    }
    assert!(
        receiver.spans().is_empty(),
        "no request yet, no trace: {:?}",
        receiver.spans()
    );
    let prompt = [5u32, 17, 42, 9];
    assert_eq!(
        completion(&nodes[0], &prompt, 3),
        generate_alone(&prompt, 3)
    );

    // Every span of the request, from both nodes, once both have sent theirs.
    let deadline = Instant::now() + Duration::from_secs(30);
    let spans = loop {
        let spans = receiver.spans();
        let request_done = spans.iter().any(|s| s.name == "request");
        let remote = spans.iter().any(|s| s.name == "expert_call");
        if request_done && remote {
            // The last batches of both nodes.
            std::thread::sleep(Duration::from_millis(500));
            break receiver.spans();
        }
        assert!(
            Instant::now() < deadline,
            "spans so far: {spans:#?}\nnode1: {:#?}",
            nodes[0].log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let named =
        |name: &str| -> Vec<&Received> { spans.iter().filter(|s| s.name == name).collect() };
    let ids =
        |list: &[&Received]| -> HashSet<Vec<u8>> { list.iter().map(|s| s.id.clone()).collect() };

    let requests = named("request");
    assert_eq!(requests.len(), 1, "{spans:#?}");
    let request = requests[0];
    assert_eq!(request.node, "node1");
    assert!(request.parent.is_empty(), "the request is the trace's root");
    assert_eq!(request.attributes["prompt_tokens"], "4");
    // One trace: every span the two nodes sent is in it.
    assert!(spans.iter().all(|s| s.trace == request.trace), "{spans:#?}");

    let steps = named("step");
    // The prompt's step, then one per generated token after the first.
    assert!(steps.len() >= 3, "{steps:#?}");
    assert!(
        steps
            .iter()
            .all(|s| s.parent == request.id && s.node == "node1")
    );

    let dispatches: Vec<&Received> = named("dispatch")
        .into_iter()
        .filter(|s| s.node == "node1")
        .collect();
    // Two MoE layers a step.
    assert_eq!(dispatches.len(), 2 * steps.len(), "{dispatches:#?}");
    let step_ids = ids(&steps);
    assert!(dispatches.iter().all(|s| step_ids.contains(&s.parent)));

    let calls = named("peer_call");
    assert!(!calls.is_empty());
    let dispatch_ids = ids(&dispatches);
    for call in &calls {
        assert_eq!(call.node, "node1");
        assert!(dispatch_ids.contains(&call.parent), "{call:?}");
        assert_eq!(call.attributes["peer"], "node2", "{call:?}");
    }

    // node2's work, under the calls that asked for it, in node1's trace.
    let remote = named("expert_call");
    let call_ids = ids(&calls);
    assert_eq!(remote.len(), calls.len(), "{remote:#?}");
    for work in &remote {
        assert_eq!(work.node, "node2");
        assert!(call_ids.contains(&work.parent), "{work:?}");
    }
    // node2's dispatch of that work, under it.
    let remote_ids = ids(&remote);
    let remote_dispatches: Vec<&Received> = named("dispatch")
        .into_iter()
        .filter(|s| s.node == "node2")
        .collect();
    assert_eq!(remote_dispatches.len(), remote.len());
    assert!(
        remote_dispatches
            .iter()
            .all(|s| remote_ids.contains(&s.parent))
    );

    // A caller that traces its own work, through a gateway: its traceparent parents the
    // request on whichever node the gateway chose.
    let gateway = Gateway::start(&spec);
    gateway.wait_nodes_ready(2);
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let answer = gateway
        .client
        .post(format!("{}/v1/completions", gateway.process.base))
        .header("traceparent", traceparent)
        .json(&serde_json::json!({"prompt": prompt, "max_tokens": 2}))
        .send()
        .unwrap();
    assert!(answer.status().is_success());
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let deadline = Instant::now() + Duration::from_secs(30);
    let continued = loop {
        let found = receiver
            .spans()
            .into_iter()
            .find(|s| s.name == "request" && hex(&s.trace) == "0af7651916cd43dd8448eb211c80319c");
        if let Some(span) = found {
            break span;
        }
        assert!(
            Instant::now() < deadline,
            "no request span in the caller's trace"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(["node1", "node2"].contains(&continued.node.as_str()));
    assert_eq!(hex(&continued.parent), "b7ad6b7169203331");
    assert!(continued.attributes["request"].starts_with("cmpl-"));
}
