//! Load benchmark: starts `moe-node serve` on the demo model and streams completions at
//! concurrency 1, 8 and 32, reporting generated tokens/s, time to first token and the
//! throughput ratio against concurrency 1 (goal: 32 concurrent ≥ 8x).
//!
//! `cargo bench --bench load`; `MOE_LOAD_SECONDS` (per level, default 10),
//! `MOE_LOAD_MAX_TOKENS` (per request, default 64), `MOE_LOAD_LEVELS` (default 1,8,32).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::blocking::Client;
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_moe-node");

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_server(model: &Path) -> (Server, String) {
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--model"])
        .arg(model)
        .env("RUST_LOG", "warn,moe_node::server=info")
        .stderr(Stdio::piped())
        .spawn()
        .expect("the server starts");
    let stderr = child.stderr.take().expect("stderr is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(addr) = line.split("listening on http://").nth(1) {
                let _ = tx.send(addr.trim().to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the server listens");
    let base = format!("http://{addr}");
    let client = Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while client
        .get(format!("{base}/ready"))
        .send()
        .map(|r| !r.status().is_success())
        .unwrap_or(true)
    {
        assert!(Instant::now() < deadline, "server not ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    (Server(child), base)
}

/// One streamed request: (time to first token, generated tokens).
fn stream_one(client: &Client, base: &str, seed: u32, max_tokens: usize) -> (Duration, usize) {
    let prompt: Vec<u32> = (0..16).map(|i| (seed * 31 + i * 7) % 250 + 1).collect();
    let started = Instant::now();
    let resp = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": true,
            "stream": true,
            "return_token_ids": true,
        }))
        .send()
        .expect("request sent");
    assert!(resp.status().is_success(), "status {}", resp.status());
    let mut first = None;
    let mut tokens = 0;
    for line in BufReader::new(resp).lines() {
        let line = line.expect("stream read");
        // Token chunks carry one id each; the final chunk carries none.
        if line.starts_with("data: {") && !line.contains("\"token_ids\":[]") {
            first.get_or_insert_with(|| started.elapsed());
            tokens += 1;
        }
    }
    (first.unwrap_or_default(), tokens)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

struct Level {
    concurrency: usize,
    tokens_per_second: f64,
    ttft_median_ms: f64,
    ttft_p90_ms: f64,
    requests: usize,
}

fn run_level(base: &str, concurrency: usize, seconds: f64, max_tokens: usize) -> Level {
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let results: Vec<Vec<(Duration, usize)>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..concurrency)
            .map(|worker| {
                scope.spawn(move || {
                    let client = Client::builder()
                        .timeout(Duration::from_secs(600))
                        .build()
                        .expect("client");
                    let mut done = Vec::new();
                    let mut n = 0;
                    while Instant::now() < deadline {
                        done.push(stream_one(
                            &client,
                            base,
                            (worker * 1000 + n) as u32,
                            max_tokens,
                        ));
                        n += 1;
                    }
                    done
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("worker"))
            .collect()
    });
    let elapsed = started.elapsed().as_secs_f64();
    let all: Vec<(Duration, usize)> = results.into_iter().flatten().collect();
    let tokens: usize = all.iter().map(|(_, t)| t).sum();
    let mut ttft: Vec<f64> = all.iter().map(|(d, _)| d.as_secs_f64() * 1e3).collect();
    let ttft_median_ms = median(&mut ttft);
    let ttft_p90_ms = ttft.get((ttft.len() * 9) / 10).copied().unwrap_or(f64::NAN);
    Level {
        concurrency,
        tokens_per_second: tokens as f64 / elapsed,
        ttft_median_ms,
        ttft_p90_ms,
        requests: all.len(),
    }
}

fn main() {
    // `cargo bench` passes --bench; nothing else is taken from the command line.
    let seconds: f64 = env_or("MOE_LOAD_SECONDS", 10.0);
    let max_tokens: usize = env_or("MOE_LOAD_MAX_TOKENS", 64);
    let levels: Vec<usize> = std::env::var("MOE_LOAD_LEVELS")
        .unwrap_or_else(|_| "1,8,32".into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let model = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-demo-model");
    if !model.join("config.json").exists() {
        let status = Command::new(BIN)
            .args(["demo-model", "--out"])
            .arg(&model)
            .stderr(Stdio::null())
            .status()
            .expect("demo-model runs");
        assert!(status.success(), "demo model written");
    }
    let (_server, base) = start_server(&model);
    println!(
        "load: demo model (kimi_k2 layout, 896 experts, top-16), 16-token prompts, {max_tokens} \
         tokens per request, streamed, {seconds} s per level, {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // A short warm-up so the first level does not pay for cold caches.
    run_level(&base, 1, 1.0, 8);
    let results: Vec<Level> = levels
        .iter()
        .map(|&c| run_level(&base, c, seconds, max_tokens))
        .collect();
    let baseline = results
        .iter()
        .find(|l| l.concurrency == 1)
        .map(|l| l.tokens_per_second);
    println!(
        "{:>11} {:>9} {:>12} {:>15} {:>12} {:>10}",
        "concurrency", "requests", "tokens/s", "ttft median ms", "ttft p90 ms", "vs c=1"
    );
    for l in &results {
        let ratio = baseline.map_or(f64::NAN, |b| l.tokens_per_second / b);
        println!(
            "{:>11} {:>9} {:>12.1} {:>15.1} {:>12.1} {:>9.2}x",
            l.concurrency, l.requests, l.tokens_per_second, l.ttft_median_ms, l.ttft_p90_ms, ratio
        );
    }
    if let (Some(b), Some(top)) = (baseline, results.iter().find(|l| l.concurrency == 32)) {
        let ratio = top.tokens_per_second / b;
        println!(
            "goal: concurrency 32 >= 8x concurrency 1: {ratio:.2}x ({})",
            if ratio >= 8.0 { "met" } else { "not met" }
        );
    }
}
