//! The `moe-node` binary as a user runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn moe_node(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("the binary runs")
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

#[test]
fn generate_json_prints_reference_tokens_and_logits() {
    let dir = fixture("deepseek_v3");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let prompt: Vec<String> = reference["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let out = moe_node(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        &prompt.join(","),
        "--max-tokens",
        "12",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed["token_ids"], reference["token_ids"]);
    assert_eq!(printed["last_logits"].as_array().unwrap().len(), 128);
    assert!(printed.get("text").is_none(), "no tokenizer, so no text");
}

#[test]
fn text_prompt_without_tokenizer_is_a_clear_error() {
    let out = moe_node(&[
        "generate",
        "--model",
        fixture("mixtral").to_str().unwrap(),
        "--prompt",
        "hello",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no tokenizer.json") && stderr.contains("--prompt-ids"),
        "{stderr}"
    );
}

#[test]
fn bad_model_directories_exit_with_config_and_data_codes() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), r#"{"model_type": "gpt2"}"#).unwrap();
    let out = moe_node(&[
        "generate",
        "--model",
        dir.path().to_str().unwrap(),
        "--prompt-ids",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported model_type `gpt2`"));

    let copy = tempfile::tempdir().unwrap();
    for name in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("qwen3_moe").join(name), copy.path().join(name)).unwrap();
    }
    std::fs::write(copy.path().join("model.safetensors"), b"garbage").unwrap();
    let out = moe_node(&[
        "generate",
        "--model",
        copy.path().to_str().unwrap(),
        "--prompt-ids",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(65));
    assert!(String::from_utf8_lossy(&out.stderr).contains("corrupt"));
}

#[test]
fn demo_model_is_kimi_shaped_and_generates_text() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("demo");
    let out = moe_node(&["demo-model", "--out", model.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "kimi_k2");
    assert_eq!(config["n_routed_experts"], 896);
    assert_eq!(config["num_experts_per_tok"], 16);
    assert_eq!(config["n_shared_experts"], 1);

    let generate = |seed: &str| {
        let out = moe_node(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "Hello, moe-node",
            "--max-tokens",
            "8",
            "--temperature",
            "0.8",
            "--seed",
            seed,
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let first = generate("3");
    assert_eq!(first["token_ids"].as_array().unwrap().len(), 8);
    assert!(first["text"].is_string());
    assert_eq!(first, generate("3"), "the same seed gives the same output");
}

#[test]
fn check_accepts_the_shipped_config_and_lists_every_problem_of_a_bad_one() {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("etc/moe-node.toml");
    let out = moe_node(&["check", "--config", shipped.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[server]\nlisten = \"here\"\nport = 80\n[devices]\nbackend = \"cpu\"\nreplication = 5\n",
    )
    .unwrap();
    let out = moe_node(&["check", "--config", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for problem in [
        "server.port: unknown key",
        "server.listen",
        "devices.replication",
    ] {
        assert!(
            stderr.contains(problem),
            "{problem:?} missing from:\n{stderr}"
        );
    }

    // The environment layer is checked too, and a model path that is not a model is caught.
    let out = Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .args(["check", "--config", shipped.to_str().unwrap()])
        .env("MOE_NODE_DEVICES__CPU_SLOTS", "0")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("devices.cpu_slots"));
    let out = Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .args(["check", "--config", shipped.to_str().unwrap()])
        .env("MOE_NODE_MODEL__PATH", dir.path())
        .output()
        .unwrap();
    // Fails cleanly: the data error's status, not a panic's 101.
    assert_eq!(out.status.code(), Some(65));
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));

    // A listen address other machines reach, with no API keys: valid, and warned about.
    let open = dir.path().join("open.toml");
    std::fs::write(&open, "[server]\nlisten = \"0.0.0.0:8080\"\n").unwrap();
    let out = moe_node(&["check", "--config", open.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: server.listen: `0.0.0.0:8080` is reachable"),
        "{stderr}"
    );
}

#[test]
fn crafted_sizes_fail_cleanly_naming_what_is_wrong() {
    // A max_tokens no context holds: an error, not an overflow or an allocation panic.
    let out = moe_node(&[
        "generate",
        "--model",
        fixture("qwen3_moe").to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-tokens",
        "18446744073709551615",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("positions needed but the model supports"),
        "{stderr}"
    );

    // config.json values that would divide by zero or overflow are refused by key.
    for (key, value) in [
        ("num_experts", serde_json::json!(0)),
        ("max_position_embeddings", serde_json::json!(1u64 << 62)),
        ("hidden_size", serde_json::json!(u64::MAX)),
    ] {
        let dir = tempfile::tempdir().unwrap();
        for name in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture("qwen3_moe").join(name), dir.path().join(name)).unwrap();
        }
        let path = dir.path().join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config[key] = value;
        std::fs::write(&path, config.to_string()).unwrap();
        let out = moe_node(&[
            "generate",
            "--model",
            dir.path().to_str().unwrap(),
            "--prompt-ids",
            "1",
            "--max-tokens",
            "2",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{key}: {stderr}");
        assert!(stderr.contains(&format!("`{key}`")), "{key}: {stderr}");
    }
}

#[test]
fn serve_refuses_a_bad_config_before_starting() {
    let out = Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .args(["serve", "--listen", "not-an-address"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("server.listen"));
}

#[test]
fn serve_exits_when_the_model_cannot_be_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("qwen3_moe").join(file), model.join(file)).unwrap();
    }
    let weights = std::fs::OpenOptions::new()
        .write(true)
        .open(model.join("model.safetensors"))
        .unwrap();
    weights.set_len(1000).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .args(["serve", "--listen", "127.0.0.1:0", "--model"])
        .arg(&model)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("serve kept running with a corrupt checkpoint");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(65), "{stderr}");
    assert!(stderr.contains("model.safetensors"), "{stderr}");
}

/// Whether this machine has a CUDA driver the loader can find (then the tests of the
/// no-GPU behaviour do not apply; `tests/gpu/run.sh` covers that machine).
fn has_cuda_driver() -> bool {
    ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
        std::process::Command::new("sh")
            .args(["-c", &format!("ldconfig -p | grep -q '{name} '")])
            .status()
            .is_ok_and(|s| s.success())
    })
}

#[test]
fn without_a_gpu_auto_serves_on_the_cpu_and_says_why_while_cuda_refuses_to_start() {
    if has_cuda_driver() {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: the no-GPU behaviour is not checked: this machine has a CUDA driver"
        );
        return;
    }
    let model = fixture("qwen3_moe");
    let out = Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .args(["serve", "--listen", "127.0.0.1:0", "--model"])
        .arg(&model)
        .env("MOE_NODE_DEVICES__BACKEND", "cuda")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(
        stderr.contains("CUDA driver not found (tried libcuda.so.1"),
        "{stderr}"
    );

    // `devices` says the same before anything starts.
    let out = moe_node(&["devices"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("no usable GPU: CUDA driver not found"),
        "{stdout}"
    );
    assert!(stdout.contains("experts run on 2 CPU slots"), "{stdout}");
    // Which instructions the CPU kernels use here.
    let kernels = stdout
        .lines()
        .find_map(|l| l.strip_prefix("CPU kernels: "))
        .unwrap_or_else(|| panic!("no CPU kernels line: {stdout}"));
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        assert!(kernels.starts_with("AVX"), "{kernels}");
        assert!(kernels.contains("INT4 decode rows AVX"), "{kernels}");
    }
    // Which arithmetic products with bf16 weights take, as `devices.cpu_precision` asks.
    assert!(
        stdout.contains("CPU products with bf16 weights: exact"),
        "{stdout}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .arg("devices")
        .env("MOE_NODE_DEVICES__CPU_PRECISION", "bf16")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("CPU products with bf16 weights: bf16: inputs rounded to bf16"),
        "{stdout}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .arg("devices")
        .env("MOE_NODE_DEVICES__CPU_PRECISION", "fp4")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an unknown precision is refused");
    assert!(stderr.contains("cpu_precision"), "{stderr}");
    let out = Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .arg("devices")
        .env("MOE_NODE_DEVICES__BACKEND", "cuda")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("CUDA driver not found"), "{stderr}");

    let mut child = Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .args(["serve", "--listen", "127.0.0.1:0", "--model"])
        .arg(&model)
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut seen = Vec::new();
    let found = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let done = line.contains("no usable GPU: experts run on CPU slots")
                    && line.contains("CUDA driver not found");
                seen.push(line);
                if done {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(found, "log lacks the reason:\n{}", seen.join("\n"));
}

/// Under systemd (`Type=notify`, `WatchdogSec=`): while loading, the node says what it loads
/// (`STATUS=` lines naming the device and layer) and pushes out the start timeout
/// (`EXTEND_TIMEOUT_USEC`); it says READY=1 once it serves, then pings WATCHDOG=1 at a
/// quarter of the interval while its router runs, says RELOADING=1 then READY=1 on SIGHUP,
/// and STOPPING=1 on SIGTERM. systemd's socket is stood in for by a datagram socket this test binds.
#[test]
fn serve_tells_systemd_what_it_loads_that_it_is_ready_pings_reloads_and_stops() {
    use std::os::unix::net::UnixDatagram;
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let socket_path = dir.path().join("notify");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let model = dir.path().join("model");
    assert!(
        moe_node(&["demo-model", "--out", model.to_str().unwrap()])
            .status
            .success()
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_moe-node"))
        .args(["serve", "--listen", "127.0.0.1:0", "--model"])
        .arg(&model)
        .env("NOTIFY_SOCKET", &socket_path)
        .env("WATCHDOG_USEC", "800000")
        .env("MOE_NODE_DEVICES__BACKEND", "cpu")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut said = Vec::new();
    let mut buffer = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(120);
    let pings = |said: &[String]| said.iter().filter(|m| m.contains("WATCHDOG=1")).count();
    while Instant::now() < deadline && pings(&said) < 4 {
        if let Ok(n) = socket.recv(&mut buffer) {
            said.push(String::from_utf8_lossy(&buffer[..n]).into_owned());
        }
    }
    // `systemctl reload`: RELOADING=1 with the monotonic clock, then READY=1 again.
    let pid = child.id().to_string();
    let before_reload = said.len();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let reloaded = |said: &[String]| {
        let after = &said[before_reload..];
        after
            .iter()
            .position(|m| m.contains("RELOADING=1") && m.contains("MONOTONIC_USEC="))
            .is_some_and(|at| after[at..].iter().any(|m| m.contains("READY=1")))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && !reloaded(&said) {
        if let Ok(n) = socket.recv(&mut buffer) {
            said.push(String::from_utf8_lossy(&buffer[..n]).into_owned());
        }
    }
    assert!(reloaded(&said), "{said:?}");
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = child.wait().unwrap();
    while let Ok(n) = socket.recv(&mut buffer) {
        said.push(String::from_utf8_lossy(&buffer[..n]).into_owned());
    }
    let ready = said.iter().position(|m| m.contains("READY=1"));
    let first_ping = said.iter().position(|m| m.contains("WATCHDOG=1"));
    assert!(ready.is_some() && ready < first_ping, "{said:?}");
    let before_ready = &said[..ready.unwrap()];
    let loading = |needle: &str| {
        before_ready
            .iter()
            .any(|m| m.starts_with("STATUS=loading: ") && m.contains(needle))
    };
    assert!(loading("device 0 (cpu): loading"), "{said:?}");
    assert!(loading("device 1 (cpu): loading"), "{said:?}");
    assert!(loading(", layer 1/"), "{said:?}");
    assert!(loading("dense weights"), "{said:?}");
    assert!(loading("warming up"), "{said:?}");
    assert!(
        before_ready
            .iter()
            .any(|m| m.trim() == format!("EXTEND_TIMEOUT_USEC={}", 60_000_000)),
        "{said:?}"
    );
    assert!(said[ready.unwrap()].contains("STATUS=serving "), "{said:?}");
    assert!(pings(&said) >= 4, "{said:?}");
    assert!(said.iter().any(|m| m.contains("STOPPING=1")), "{said:?}");
    assert!(status.success(), "{status:?}");
}
