//! Load benchmark: starts `moe-node serve` on the demo model and streams completions at
//! concurrency 1, 8 and 32, reporting generated tokens/s, time to first token, the time
//! between tokens and the throughput ratio against concurrency 1 (goal: 32 concurrent ≥
//! 8x). In the same run it times the engine's own decode step at batch 1 (no actors, no
//! HTTP: what `benches/engine_step.rs` measures) right before each round, and quotes the
//! server's time per token at concurrency 1 against the engine step of the same round
//! (goal: at most 1.2x): the median of the rounds' ratios, as the machine's speed drifts
//! between rounds. The server's time per token is each request's time from its first token
//! to its last over the tokens in between (median over requests), not the median gap
//! between tokens, which reads low when the client takes two tokens in one read. Beside it, the engine step with the experts on CPU device actors
//! reached through the dispatcher (as the server runs them, still without router and HTTP),
//! which splits the server's overhead into the node's dispatch and the serving path.
//!
//! With `MOE_LOAD_BASELINE=/path/to/other/moe-node`, that build serves the same levels
//! too, its rounds alternating with this build's, so that a change is measured before and
//! after side by side on a shared machine.
//!
//! `cargo bench --bench load`; `MOE_LOAD_SECONDS` (per level and round, default 10),
//! `MOE_LOAD_ROUNDS` (default 1; medians over rounds), `MOE_LOAD_MAX_TOKENS` (per request,
//! default 64), `MOE_LOAD_LEVELS` (default 1,8,32), `MOE_LOAD_PROMPT_TOKENS` (default 16).
//!
//! Another model: `MOE_LOAD_MODEL=DIR` serves it instead of the demo model, with
//! `MOE_LOAD_SERVE_ARGS` added to `moe-node serve` (e.g. `--load-format dummy --num-layers 3`
//! for a published shape from its config.json alone; `MOE_NODE_*` variables pass through).
//! The in-process engine steps are then left out, and each level also prints the bytes a
//! decode step reads (dense weights but the embedding table, and the distinct experts the
//! batch is expected to touch under uniform routing) over the step's time; with
//! `MOE_LOAD_COPY_GBPS` (the device's measured copy bandwidth) that rate's share of it.
//! `MOE_LOAD_READY_SECONDS` (default 120) bounds the wait for the server to load;
//! `MOE_LOAD_SERVER_LOG` echoes the server's log. `MOE_LOAD_PREFILL_TOKENS=N` ends the run
//! with three requests of N prompt tokens each, one at a time, and prints the time to their
//! first token: prefill tokens/s through the whole server.

mod common;

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

fn start_server(bin: &str, model: &Path, extra: &[String]) -> (Server, String) {
    let ready_seconds: u64 = env_or("MOE_LOAD_READY_SECONDS", 120);
    let mut child = Command::new(bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--model"])
        .arg(model)
        .args(extra)
        .env("RUST_LOG", "warn,moe_node::server=info")
        .stderr(Stdio::piped())
        .spawn()
        .expect("the server starts");
    let stderr = child.stderr.take().expect("stderr is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let echo = std::env::var_os("MOE_LOAD_SERVER_LOG").is_some();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if echo {
                eprintln!("server: {line}");
            }
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
    let deadline = Instant::now() + Duration::from_secs(ready_seconds);
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

/// One streamed request: time to first token, generated tokens, the gaps between
/// successive tokens, and the time from its first token to its last.
struct Streamed {
    ttft: Duration,
    tokens: usize,
    gaps: Vec<Duration>,
    decoding: Duration,
}

impl Streamed {
    /// Milliseconds per token after the first: the request's decode time over the tokens it
    /// decoded. Unlike the median gap, it cannot read low when the client receives two
    /// tokens in one read (a gap of nearly zero, then a long one).
    fn decode_ms_per_token(&self) -> Option<f64> {
        (self.tokens > 1).then(|| self.decoding.as_secs_f64() * 1e3 / (self.tokens - 1) as f64)
    }
}

/// The prompts a level sends: `tokens` ids each, drawn from 1..=`ids`.
#[derive(Clone, Copy)]
struct Prompts {
    tokens: u32,
    ids: u32,
}

fn stream_one(
    client: &Client,
    base: &str,
    seed: u32,
    prompts: Prompts,
    max_tokens: usize,
) -> Streamed {
    let prompt: Vec<u32> = (0..prompts.tokens)
        .map(|i| (seed * 31 + i * 7) % prompts.ids + 1)
        .collect();
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
    let status = resp.status();
    assert!(
        status.is_success(),
        "status {status}: {}",
        resp.text().unwrap_or_default()
    );
    let mut first = None;
    let mut last: Option<Instant> = None;
    let mut gaps = Vec::with_capacity(max_tokens);
    let mut tokens = 0;
    for line in BufReader::new(resp).lines() {
        let line = line.expect("stream read");
        // Token chunks carry one id each; the final chunk carries none.
        if line.starts_with("data: {") && !line.contains("\"token_ids\":[]") {
            let now = Instant::now();
            first.get_or_insert_with(|| now - started);
            if let Some(last) = last {
                gaps.push(now - last);
            }
            last = Some(now);
            tokens += 1;
        }
    }
    let ttft = first.unwrap_or_default();
    Streamed {
        ttft,
        tokens,
        gaps,
        decoding: last.map_or(Duration::ZERO, |last| last - started - ttft),
    }
}

use common::median;

struct Level {
    concurrency: usize,
    tokens_per_second: f64,
    ttft_median_ms: f64,
    ttft_p90_ms: f64,
    /// Median time between two tokens of one stream.
    token_gap_median_ms: f64,
    /// Median over requests of each request's decode time per token.
    decode_ms_per_token: f64,
    requests: usize,
}

fn run_level(
    base: &str,
    concurrency: usize,
    seconds: f64,
    prompts: Prompts,
    max_tokens: usize,
) -> Level {
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let results: Vec<Vec<Streamed>> = std::thread::scope(|scope| {
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
                            prompts,
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
    let all: Vec<Streamed> = results.into_iter().flatten().collect();
    let tokens: usize = all.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = all.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
    let ttft_median_ms = median(&mut ttft);
    let ttft_p90_ms = ttft.get((ttft.len() * 9) / 10).copied().unwrap_or(f64::NAN);
    let mut gaps: Vec<f64> = all
        .iter()
        .flat_map(|s| s.gaps.iter().map(|g| g.as_secs_f64() * 1e3))
        .collect();
    Level {
        concurrency,
        tokens_per_second: tokens as f64 / elapsed,
        ttft_median_ms,
        ttft_p90_ms,
        token_gap_median_ms: median(&mut gaps),
        decode_ms_per_token: median(
            &mut all
                .iter()
                .filter_map(Streamed::decode_ms_per_token)
                .collect::<Vec<_>>(),
        ),
        requests: all.len(),
    }
}

/// What a decode step of a served model reads, from its config alone.
struct StepBytes {
    /// Dense weights but the embedding table (a step reads only its rows of that).
    dense: f64,
    expert: f64,
    experts: usize,
    top_k: usize,
    moe_layers: usize,
    vocab: usize,
}

impl StepBytes {
    /// The model in `dir` as `moe-node serve` loads it with `args`.
    fn of(dir: &Path, args: &[String]) -> StepBytes {
        use moe_node::model::{LoadFormat, ModelSource};
        let after = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1))
        };
        let source = ModelSource {
            dir: dir.to_path_buf(),
            load_format: match after("--load-format").map(String::as_str) {
                Some("dummy") => LoadFormat::Dummy,
                _ => LoadFormat::Safetensors,
            },
            num_layers: after("--num-layers").and_then(|n| n.parse().ok()),
            remote: None,
        };
        let config = source.config().expect("the model's config.json reads");
        let sizes = moe_node::plan::sizes::ModelSizes::of(&config);
        let embedding = (config.vocab_size * config.hidden_size) as u64 * sizes.dtype_bytes;
        // Dummy weights are bf16 whatever the config's quantization; a checkpoint's experts
        // are held as stored.
        let expert = match source.load_format {
            LoadFormat::Dummy => 3 * config.hidden_size * config.moe.expert_intermediate_size * 2,
            LoadFormat::Safetensors => sizes.expert_bytes as usize,
        };
        StepBytes {
            dense: (sizes.dense_bytes - embedding) as f64,
            expert: expert as f64,
            experts: config.moe.num_experts,
            top_k: config.moe.top_k,
            moe_layers: config.moe_layers.iter().filter(|&&m| m).count(),
            vocab: config.vocab_size,
        }
    }

    /// Bytes read by a decode step of `batch` sequences: the distinct experts of each MoE
    /// layer expected under uniform routing, E (1 - (1 - k/E)^batch). The KV cache is left
    /// out (short contexts here).
    fn at(&self, batch: usize) -> f64 {
        let e = self.experts as f64;
        let distinct = e * (1.0 - (1.0 - self.top_k as f64 / e).powi(batch as i32));
        self.dense + distinct * self.expert * self.moe_layers as f64
    }

    fn report(&self, levels: &[Level]) {
        let copy: Option<f64> = std::env::var("MOE_LOAD_COPY_GBPS")
            .ok()
            .and_then(|v| v.parse().ok());
        for l in levels {
            let bytes = self.at(l.concurrency);
            let rate = bytes / (l.decode_ms_per_token * 1e-3) / 1e9;
            println!(
                "  concurrency {}: a decode step reads ~{:.2} GB (dense {:.2} GB, experts {:.2} \
                 GB) in {:.3} ms: {rate:.0} GB/s{}",
                l.concurrency,
                bytes / 1e9,
                self.dense / 1e9,
                (bytes - self.dense) / 1e9,
                l.decode_ms_per_token,
                copy.map_or(String::new(), |c| format!(
                    ", {:.0}% of the {c:.0} GB/s copy bandwidth",
                    100.0 * rate / c
                ))
            );
        }
    }
}

/// The median milliseconds of the engine's decode step at batch 1 in this process.
fn engine_step_ms(engine: &moe_node::engine::Engine) -> f64 {
    median(&mut common::decode_steps_ms(engine, 1, 200))
}

/// A build under test: its name, and its server.
struct Build {
    name: &'static str,
    base: String,
    _server: Server,
}

/// The median of each figure over a level's rounds.
fn median_level(rounds: &[Level]) -> Level {
    let figure = |f: fn(&Level) -> f64| median(&mut rounds.iter().map(f).collect::<Vec<_>>());
    Level {
        concurrency: rounds[0].concurrency,
        tokens_per_second: figure(|l| l.tokens_per_second),
        ttft_median_ms: figure(|l| l.ttft_median_ms),
        ttft_p90_ms: figure(|l| l.ttft_p90_ms),
        token_gap_median_ms: figure(|l| l.token_gap_median_ms),
        decode_ms_per_token: figure(|l| l.decode_ms_per_token),
        requests: rounds.iter().map(|l| l.requests).sum(),
    }
}

fn main() {
    // `cargo bench` passes --bench; nothing else is taken from the command line.
    let seconds: f64 = env_or("MOE_LOAD_SECONDS", 10.0);
    let rounds: usize = env_or("MOE_LOAD_ROUNDS", 1usize).max(1);
    let max_tokens: usize = env_or("MOE_LOAD_MAX_TOKENS", 64);
    let levels: Vec<usize> = std::env::var("MOE_LOAD_LEVELS")
        .unwrap_or_else(|_| "1,8,32".into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let prompt_tokens: u32 = env_or("MOE_LOAD_PROMPT_TOKENS", 16);
    let custom = std::env::var_os("MOE_LOAD_MODEL").map(std::path::PathBuf::from);
    let extra: Vec<String> = std::env::var("MOE_LOAD_SERVE_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(String::from)
        .collect();
    // The demo model is also run in this process (the engine step the server is held to).
    let (model, in_process) = match &custom {
        Some(dir) => (dir.clone(), None),
        None => {
            let model = common::demo_model(BIN);
            let engine = moe_node::engine::Engine::load(&model).expect("demo model loads");
            let dispatched = common::dispatched_engine(&model);
            (model, Some((engine, dispatched)))
        }
    };
    let step_bytes = custom.as_ref().map(|dir| StepBytes::of(dir, &extra));
    let prompts = Prompts {
        tokens: prompt_tokens,
        // Ids every model here has (the demo's vocabulary is larger than 251).
        ids: step_bytes
            .as_ref()
            .map_or(250, |b| b.vocab.min(251) as u32 - 1),
    };

    let mut bins = vec![("this build", BIN.to_string())];
    if let Ok(other) = std::env::var("MOE_LOAD_BASELINE") {
        bins.push(("baseline", other));
    }
    let builds: Vec<Build> = bins
        .into_iter()
        .map(|(name, bin)| {
            let (server, base) = start_server(&bin, &model, &extra);
            Build {
                name,
                base,
                _server: server,
            }
        })
        .collect();
    let described = match &custom {
        Some(dir) => format!("{} {}", dir.display(), extra.join(" ")),
        None => "demo model (kimi_k2 layout, 896 experts, top-16)".into(),
    };
    println!(
        "load: {described}, {prompt_tokens}-token prompts, {max_tokens} tokens per request, \
         streamed, {seconds} s per level and round, {rounds} round(s), {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // A short warm-up so the first level does not pay for cold caches.
    for build in &builds {
        run_level(&build.base, 1, 1.0, prompts, 8);
    }
    // results[build][level]: each round runs every build in turn.
    let mut samples: Vec<Vec<Vec<Level>>> = builds
        .iter()
        .map(|_| levels.iter().map(|_| Vec::new()).collect())
        .collect();
    // The engine's step (alone, and through the dispatcher) timed right before each round
    // at concurrency 1, while the servers wait idle.
    let mut engine_rounds: Vec<(f64, f64)> = Vec::new();
    for (l, &concurrency) in levels.iter().enumerate() {
        for _ in 0..rounds {
            if concurrency == 1
                && let Some((engine, (_system, dispatched))) = &in_process
            {
                engine_rounds.push((engine_step_ms(engine), engine_step_ms(dispatched)));
            }
            for (b, build) in builds.iter().enumerate() {
                samples[b][l].push(run_level(
                    &build.base,
                    concurrency,
                    seconds,
                    prompts,
                    max_tokens,
                ));
            }
        }
    }
    if let Some(tokens) = std::env::var("MOE_LOAD_PREFILL_TOKENS")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    {
        let client = Client::builder()
            .timeout(Duration::from_secs(600))
            .build()
            .expect("client");
        for build in &builds {
            let long = Prompts { tokens, ..prompts };
            let mut ttft: Vec<f64> = (0..3)
                .map(|i| {
                    stream_one(&client, &build.base, 7 + i, long, 1)
                        .ttft
                        .as_secs_f64()
                })
                .collect();
            let seconds = median(&mut ttft);
            println!(
                "{}: prefill of {tokens} prompt tokens, one request at a time: time to first \
                 token {:.1} ms (median of 3), {:.0} prompt tokens/s",
                build.name,
                seconds * 1e3,
                tokens as f64 / seconds
            );
        }
    }
    let names: Vec<&str> = builds.iter().map(|b| b.name).collect();
    drop(builds);

    let results: Vec<Vec<Level>> = samples
        .iter()
        .map(|per_level| per_level.iter().map(|r| median_level(r)).collect())
        .collect();
    if !engine_rounds.is_empty() {
        let mut alone: Vec<f64> = engine_rounds.iter().map(|r| r.0).collect();
        let mut through: Vec<f64> = engine_rounds.iter().map(|r| r.1).collect();
        println!(
            "engine decode step, batch 1, in process, median over rounds (200 steps each): \
             {:.3} ms alone, {:.3} ms with the experts on CPU device actors",
            median(&mut alone),
            median(&mut through)
        );
    }
    // Concurrency 1 rounds of build `b`, each against the engine step timed before it.
    let c1_ratios = |b: usize| -> Vec<(f64, f64)> {
        levels
            .iter()
            .position(|&c| c == 1)
            .map(|l| {
                samples[b][l]
                    .iter()
                    .zip(&engine_rounds)
                    .map(|(level, (alone, through))| {
                        (
                            level.decode_ms_per_token / alone,
                            level.decode_ms_per_token / through,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    for (b, (name, levels)) in names.iter().zip(&results).enumerate() {
        let c1 = levels.iter().find(|l| l.concurrency == 1);
        println!("{name}:");
        println!(
            "{:>11} {:>9} {:>12} {:>15} {:>12} {:>14} {:>14} {:>10}",
            "concurrency",
            "requests",
            "tokens/s",
            "ttft median ms",
            "ttft p90 ms",
            "token gap ms",
            "ms per token",
            "vs c=1"
        );
        for l in levels {
            let ratio = c1.map_or(f64::NAN, |b| l.tokens_per_second / b.tokens_per_second);
            println!(
                "{:>11} {:>9} {:>12.1} {:>15.1} {:>12.1} {:>14.3} {:>14.3} {:>9.2}x",
                l.concurrency,
                l.requests,
                l.tokens_per_second,
                l.ttft_median_ms,
                l.ttft_p90_ms,
                l.token_gap_median_ms,
                l.decode_ms_per_token,
                ratio
            );
        }
        if let Some(bytes) = &step_bytes {
            bytes.report(levels);
        }
        if let Some(c1) = c1
            && in_process.is_some()
        {
            let ratios = c1_ratios(b);
            let mut alone: Vec<f64> = ratios.iter().map(|r| r.0).collect();
            let mut through: Vec<f64> = ratios.iter().map(|r| r.1).collect();
            let rounds: Vec<String> = alone.iter().map(|r| format!("{r:.2}")).collect();
            let overhead = median(&mut alone);
            println!(
                "goal: time per token at concurrency 1 <= 1.2x the engine step: {overhead:.2}x ({}); \
                 rounds {}; against the step through the device actors {:.2}x",
                if overhead <= 1.2 { "met" } else { "not met" },
                rounds.join(" "),
                median(&mut through)
            );
            if let Some(top) = levels.iter().find(|l| l.concurrency == 32) {
                let ratio = top.tokens_per_second / c1.tokens_per_second;
                println!(
                    "goal: concurrency 32 >= 8x concurrency 1: {ratio:.2}x ({})",
                    if ratio >= 8.0 { "met" } else { "not met" }
                );
            }
        }
    }
    if let [this, base] = results.as_slice() {
        for (a, b) in this.iter().zip(base) {
            println!(
                "concurrency {}: this build / baseline tokens/s {:.2}x",
                a.concurrency,
                a.tokens_per_second / b.tokens_per_second
            );
        }
    }
}
