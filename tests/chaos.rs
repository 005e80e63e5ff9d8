//! Load and chaos against a real `moe-node serve` (issue 13): 64 clients for a bounded time,
//! each doing at random a whole request, a stream it abandons after the first event, a
//! request it gives up on mid-generation, a body at or over the size limit, or a slowloris
//! connection (headers a byte at a time, then silence). Meanwhile `/health` is polled. After
//! the storm: the running-requests gauge is back to 0, the server's memory is near what it
//! was after warm-up, `/health` never failed, and no panic is in the log.

mod serve;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde_json::json;
use serve::{Server, rss_kib};

const CLIENTS: usize = 64;
const STORM: Duration = Duration::from_secs(20);
const MAX_BODY: usize = 16 << 10;

#[test]
fn a_storm_of_clients_leaves_no_trace() {
    let server = Arc::new(Server::start(&format!(
        "[devices]\nbackend = \"cpu\"\n[server]\nmax_request_bytes = {MAX_BODY}\n\
         body_read_timeout_seconds = 2\n[batching]\nmax_waiting = 1024\n"
    )));
    server.wait_ready();
    let pid = server.process.child.id();
    let addr = server.base.trim_start_matches("http://").to_string();
    // Warm up, then take the baseline.
    for _ in 0..4 {
        server.post_ok(
            "/v1/completions",
            &json!({"prompt": [1, 2, 3], "max_tokens": 4}),
        );
    }
    let baseline = rss_kib(pid);

    let stop = Arc::new(AtomicBool::new(false));
    let statuses = Arc::new(Mutex::new(BTreeMap::<String, usize>::new()));
    let requests = Arc::new(AtomicUsize::new(0));
    let health_failures = Arc::new(AtomicUsize::new(0));
    let health = {
        let (server, stop, failures) = (server.clone(), stop.clone(), health_failures.clone());
        std::thread::spawn(move || {
            let client = reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap();
            let mut polls = 0;
            while !stop.load(Ordering::Relaxed) {
                let ok = client
                    .get(format!("{}/health", server.base))
                    .send()
                    .is_ok_and(|r| r.status().is_success());
                if !ok {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                polls += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            polls
        })
    };
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let (base, addr, stop) = (server.base.clone(), addr.clone(), stop.clone());
            let (statuses, requests) = (statuses.clone(), requests.clone());
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(i as u64);
                let client = reqwest::blocking::Client::builder()
                    .timeout(Duration::from_secs(30))
                    .build()
                    .unwrap();
                let record = |what: &str| {
                    *statuses
                        .lock()
                        .unwrap()
                        .entry(what.to_string())
                        .or_default() += 1;
                };
                while started.elapsed() < STORM && !stop.load(Ordering::Relaxed) {
                    requests.fetch_add(1, Ordering::Relaxed);
                    let url = format!("{base}/v1/completions");
                    let body =
                        json!({"prompt": [1, 2, 3, 4], "max_tokens": rng.random_range(1..12)});
                    match rng.random_range(0..6) {
                        0 | 1 => match client.post(&url).json(&body).send() {
                            Ok(r) => record(&format!("whole {}", r.status().as_u16())),
                            Err(_) => record("whole error"),
                        },
                        2 => {
                            let mut stream = body.clone();
                            stream["stream"] = json!(true);
                            stream["max_tokens"] = json!(64);
                            match client.post(&url).json(&stream).send() {
                                Ok(mut r) => {
                                    let mut first = [0u8; 64];
                                    let _ = r.read(&mut first);
                                    record(&format!("abandoned stream {}", r.status().as_u16()));
                                }
                                Err(_) => record("abandoned stream error"),
                            }
                        }
                        3 => {
                            let impatient = reqwest::blocking::Client::builder()
                                .timeout(Duration::from_millis(rng.random_range(5..200)))
                                .build()
                                .unwrap();
                            let mut long = body.clone();
                            long["max_tokens"] = json!(64);
                            match impatient.post(&url).json(&long).send() {
                                Ok(r) => record(&format!("impatient {}", r.status().as_u16())),
                                Err(_) => record("impatient gave up"),
                            }
                        }
                        4 => {
                            let size = if rng.random_bool(0.5) {
                                MAX_BODY
                            } else {
                                MAX_BODY + 1
                            };
                            let text = "x".repeat(size - 14);
                            let raw = format!("{{\"prompt\": \"{text}\"}}");
                            let raw = &raw[..size.min(raw.len())];
                            match client
                                .post(&url)
                                .header("content-type", "application/json")
                                .body(raw.to_string())
                                .send()
                            {
                                Ok(r) => record(&format!("body {} {}", size, r.status().as_u16())),
                                Err(_) => record("big body error"),
                            }
                        }
                        _ => {
                            // Slowloris: a few header bytes slowly, then nothing.
                            if let Ok(mut s) = TcpStream::connect(&addr) {
                                for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" {
                                    if s.write_all(&[*b]).is_err() {
                                        break;
                                    }
                                    std::thread::sleep(Duration::from_millis(20));
                                }
                                record("slowloris");
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for client in clients {
        client.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let polls = health.join().unwrap();

    // The gauge returns to 0 once the abandoned work has been noticed and dropped.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut running = server.metric("moe_node_requests_running");
    while running != 0.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        running = server.metric("moe_node_requests_running");
    }
    let after = rss_kib(pid);
    let statuses = statuses.lock().unwrap().clone();
    eprintln!(
        "chaos: {} requests in {:?}: {statuses:?}; /health polled {polls} times, {} failures; \
         requests_running {running}; RSS {baseline} KiB after warm-up, {after} KiB after",
        requests.load(Ordering::Relaxed),
        STORM,
        health_failures.load(Ordering::Relaxed),
    );
    assert_eq!(running, 0.0, "requests still running after the storm");
    assert_eq!(health_failures.load(Ordering::Relaxed), 0, "/health failed");
    assert!(
        after < baseline + baseline / 2 + 64 * 1024,
        "memory grew from {baseline} KiB to {after} KiB"
    );
    let panics: Vec<String> = server
        .process
        .log_lines()
        .into_iter()
        .filter(|l| l.contains("panicked"))
        .collect();
    assert!(panics.is_empty(), "{panics:?}");
    assert!(
        statuses.keys().any(|k| k.starts_with("whole 200")),
        "{statuses:?}"
    );
}
