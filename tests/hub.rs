//! Models by Hugging Face name, against a mirror in the test (`hub_mirror`: the hub's
//! resolve endpoint over a folder, as `HF_ENDPOINT` would point at): only the files a node
//! reads are downloaded, into the cache layout `huggingface_hub` uses; a cut download
//! resumes where it stopped; a file that does not match its checksum is refused; offline,
//! the network is never asked; a cache laid out before (by hand, or by `huggingface_hub`
//! itself) is used without a download; `moe-node serve --model org/name` serves from
//! an empty cache, then again offline; and the nodes of a cluster download only the shards
//! they read (their dense weights and their experts), and the rest when a death places it
//! on them.

use std::path::{Path, PathBuf};
use std::process::Command;

use moe_node::hub::{HubEnv, HubError, ModelName, RepoCache, Weights, resolve_model};
use serde_json::Value;

mod cluster_harness;
mod common;
mod hub_mirror;
mod serve;

use hub_mirror::{COMMIT, Mirror};

const SHARD: usize = 3 << 20;

/// A model folder as published: config, tokenizer, an index over two shards, and files a
/// node never reads.
fn published() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, bytes: &[u8]| std::fs::write(dir.path().join(name), bytes).unwrap();
    write("config.json", br#"{"model_type": "test"}"#);
    write("tokenizer.json", br#"{"model": {}}"#);
    write(
        "model.safetensors.index.json",
        br#"{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}}"#,
    );
    for shard in 1..=2u8 {
        let bytes: Vec<u8> = (0..SHARD)
            .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[shard as usize])
            .collect();
        write(&format!("model-0000{shard}-of-00002.safetensors"), &bytes);
    }
    write("pytorch_model.bin", b"not read by a node");
    write("README.md", b"# a model");
    dir
}

fn online(cache: &Path, mirror: &Mirror) -> HubEnv {
    HubEnv {
        cache: cache.to_path_buf(),
        endpoint: mirror.base.clone(),
        token: None,
        offline: false,
    }
}

fn offline(cache: &Path) -> HubEnv {
    HubEnv {
        cache: cache.to_path_buf(),
        // Nothing listens there: any request would fail.
        endpoint: "http://127.0.0.1:9".into(),
        token: None,
        offline: true,
    }
}

/// Every file of the snapshot equals the published one.
fn assert_same(snapshot: &Path, published: &Path, files: &[&str]) {
    for file in files {
        let got = std::fs::read(snapshot.join(file)).unwrap();
        let want = std::fs::read(published.join(file)).unwrap();
        assert!(got == want, "{file} differs");
    }
}

const NEEDED: &[&str] = &[
    "config.json",
    "tokenizer.json",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
];

#[test]
fn a_model_by_name_is_downloaded_into_the_hugging_face_cache_layout() {
    let model = published();
    let mirror = Mirror::start(&[("org/model", model.path())]);
    mirror.faults.lock().unwrap().slow = Some(std::time::Duration::from_millis(300));
    let cache = tempfile::tempdir().unwrap();
    let found = resolve_model("org/model", &online(cache.path(), &mirror), Weights::All).unwrap();
    // The two shards came at once.
    assert_eq!(mirror.most_at_once(), 2);
    let repo = RepoCache::new(cache.path(), "org/model");
    assert_eq!(found.dir, repo.snapshot(COMMIT));
    assert_eq!(found.name, ModelName::parse("org/model"));
    assert_same(&found.dir, model.path(), NEEDED);
    // huggingface_hub's layout: the ref, blobs by checksum, links in the snapshot.
    let main = std::fs::read_to_string(repo.root().join("refs/main")).unwrap();
    assert_eq!(main, COMMIT);
    let link = std::fs::read_link(found.dir.join("model-00001-of-00002.safetensors")).unwrap();
    assert!(link.starts_with("../../blobs"), "{}", link.display());
    assert!(
        repo.root()
            .join(".no_exist")
            .join(COMMIT)
            .join("generation_config.json")
            .exists()
    );
    // Only what a node reads was asked for, and each file downloaded once.
    let downloads = mirror.downloads();
    assert!(
        !mirror
            .requests()
            .iter()
            .any(|r| r.contains("pytorch_model.bin") || r.contains("README")),
        "{:?}",
        mirror.requests()
    );
    assert_eq!(
        downloads.iter().filter(|r| r.contains("/storage/")).count(),
        2,
        "{downloads:?}"
    );

    // Again: the hub is asked which commit `main` is, and nothing is downloaded.
    mirror.clear();
    let again = resolve_model("org/model", &online(cache.path(), &mirror), Weights::All).unwrap();
    assert_eq!(again.dir, found.dir);
    assert_eq!(
        mirror.requests(),
        ["HEAD /org/model/resolve/main/config.json"],
        "a complete snapshot is not downloaded again"
    );
    // By commit, complete: not even that.
    mirror.clear();
    let pinned = format!("org/model@{COMMIT}");
    resolve_model(&pinned, &online(cache.path(), &mirror), Weights::All).unwrap();
    assert!(mirror.requests().is_empty(), "{:?}", mirror.requests());
}

#[test]
fn a_cut_download_resumes_where_it_stopped() {
    let model = published();
    let mirror = Mirror::start(&[("org/model", model.path())]);
    let shard = "model-00002-of-00002.safetensors";
    // Within a run: cut once at 1 MiB, the next request asks for the rest.
    mirror.faults.lock().unwrap().cut = Some((shard.into(), 1 << 20, 1));
    let cache = tempfile::tempdir().unwrap();
    let found = resolve_model("org/model", &online(cache.path(), &mirror), Weights::All).unwrap();
    assert_same(&found.dir, model.path(), NEEDED);
    let gets: Vec<String> = mirror
        .downloads()
        .into_iter()
        .filter(|r| r.contains(shard))
        .collect();
    assert!(
        gets.iter().any(|r| r.ends_with("range=bytes=1048576-")),
        "{gets:?}"
    );

    // Across runs: every try cut short; the next start goes on from the partial blob.
    let cache = tempfile::tempdir().unwrap();
    mirror.faults.lock().unwrap().cut = Some((shard.into(), 512 << 10, 5));
    mirror.clear();
    let error =
        resolve_model("org/model", &online(cache.path(), &mirror), Weights::All).unwrap_err();
    assert!(
        matches!(error, HubError::Download { tries: 5, .. }),
        "{error}"
    );
    let partial: Vec<PathBuf> = std::fs::read_dir(
        RepoCache::new(cache.path(), "org/model")
            .blob("x")
            .parent()
            .unwrap(),
    )
    .unwrap()
    .map(|e| e.unwrap().path())
    .filter(|p| p.extension().is_some_and(|e| e == "incomplete"))
    .collect();
    assert_eq!(partial.len(), 1, "{partial:?}");
    assert_eq!(
        std::fs::metadata(&partial[0]).unwrap().len(),
        5 * (512 << 10)
    );
    mirror.clear();
    let found = resolve_model("org/model", &online(cache.path(), &mirror), Weights::All).unwrap();
    assert_same(&found.dir, model.path(), NEEDED);
    let resumed = format!("range=bytes={}-", 5 * (512 << 10));
    assert!(
        mirror.downloads().iter().any(|r| r.ends_with(&resumed)),
        "{:?}",
        mirror.downloads()
    );
}

/// Two starts fetching one model into one cache at once (two nodes on a host, or a node
/// beside vLLM) each get it whole, and each file is downloaded once: a blob is fetched
/// under `huggingface_hub`'s lock for it.
#[test]
fn two_fetches_of_one_model_at_once_download_each_file_once() {
    let model = published();
    let mirror = Mirror::start(&[("org/model", model.path())]);
    let cache = tempfile::tempdir().unwrap();
    let env = online(cache.path(), &mirror);
    let found: Vec<PathBuf> = std::thread::scope(|scope| {
        let starts: Vec<_> = (0..2)
            .map(|_| scope.spawn(|| resolve_model("org/model", &env, Weights::All).unwrap().dir))
            .collect();
        starts.into_iter().map(|s| s.join().unwrap()).collect()
    });
    for dir in &found {
        assert_same(dir, model.path(), NEEDED);
    }
    let storage: Vec<String> = mirror
        .downloads()
        .into_iter()
        .filter(|r| r.contains("/storage/"))
        .collect();
    assert_eq!(storage.len(), 2, "{storage:?}");
    let locks = cache.path().join(".locks/models--org--model");
    assert!(
        locks.is_dir(),
        "no lock files where huggingface_hub keeps them"
    );
}

#[test]
fn a_file_that_does_not_match_its_checksum_is_refused_and_not_kept() {
    let model = published();
    let mirror = Mirror::start(&[("org/model", model.path())]);
    for corrupt in ["model-00001-of-00002.safetensors", "tokenizer.json"] {
        mirror.faults.lock().unwrap().corrupt = Some(corrupt.into());
        let cache = tempfile::tempdir().unwrap();
        let error =
            resolve_model("org/model", &online(cache.path(), &mirror), Weights::All).unwrap_err();
        match &error {
            HubError::Checksum { file, .. } => assert_eq!(file, corrupt),
            other => panic!("{corrupt}: {other}"),
        }
        let repo = RepoCache::new(cache.path(), "org/model");
        let snapshot = repo.snapshot(COMMIT);
        assert!(!snapshot.join(corrupt).exists(), "{corrupt} was kept");
        let blobs: Vec<_> = std::fs::read_dir(repo.blob("x").parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(
            blobs
                .iter()
                .all(|b| !b.to_string_lossy().ends_with(".incomplete")),
            "{blobs:?}"
        );
        // Offline, the half-downloaded model is not taken for a whole one.
        assert!(resolve_model("org/model", &offline(cache.path()), Weights::All).is_err());
    }
}

#[test]
fn offline_the_network_is_never_asked() {
    let model = published();
    let mirror = Mirror::start(&[("org/model", model.path())]);
    let cache = tempfile::tempdir().unwrap();
    let mut env = online(cache.path(), &mirror);
    env.offline = true;
    let error = resolve_model("org/model", &env, Weights::All).unwrap_err();
    assert!(matches!(error, HubError::NotCached { .. }), "{error}");
    assert!(error.to_string().contains("HF_HUB_OFFLINE"), "{error}");
    env.offline = false;
    resolve_model("org/model", &env, Weights::All).unwrap();
    mirror.clear();
    env.offline = true;
    let found = resolve_model("org/model", &env, Weights::All).unwrap();
    assert_same(&found.dir, model.path(), NEEDED);
    assert!(mirror.requests().is_empty(), "{:?}", mirror.requests());
    // A name the hub does not know, online: refused with what to do.
    env.offline = false;
    let error = resolve_model("org/unknown", &env, Weights::All).unwrap_err();
    assert!(error.to_string().contains("HF_TOKEN"), "{error}");
}

/// A cache filled by `huggingface_hub` itself (from the same mirror) is found, online
/// without a download, offline without a request.
#[test]
fn a_cache_filled_by_huggingface_hub_is_used_without_a_download() {
    let importable = Command::new("python3")
        .args(["-c", "import huggingface_hub"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !importable {
        assert!(
            std::env::var_os("MOE_TEST_REQUIRE_HUGGINGFACE_HUB").is_none(),
            "MOE_TEST_REQUIRE_HUGGINGFACE_HUB is set but `import huggingface_hub` fails"
        );
        common::skipped("python3 cannot import huggingface_hub (pip install huggingface_hub)");
        return;
    }
    let model = published();
    let mirror = Mirror::start(&[("org/model", model.path())]);
    let cache = tempfile::tempdir().unwrap();
    let script = format!(
        "import sys\nfrom huggingface_hub import hf_hub_download\n\
         for f in sys.argv[1:]:\n    hf_hub_download('org/model', f, cache_dir={:?})\n",
        cache.path().to_str().unwrap()
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(&script)
        .args(NEEDED)
        .env("HF_ENDPOINT", &mirror.base)
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\nrequests: {:?}",
        String::from_utf8_lossy(&out.stderr),
        mirror.requests()
    );
    mirror.clear();
    let found = resolve_model("org/model", &offline(cache.path()), Weights::All).unwrap();
    assert_same(&found.dir, model.path(), NEEDED);
    let found = resolve_model("org/model", &online(cache.path(), &mirror), Weights::All).unwrap();
    assert_same(&found.dir, model.path(), NEEDED);
    assert!(mirror.downloads().is_empty(), "{:?}", mirror.requests());
}

#[test]
fn serve_takes_a_model_by_name_from_an_empty_cache_then_offline() {
    let demo = serve::demo_model();
    let mirror = Mirror::start(&[("test-org/demo", demo)]);
    let cache = tempfile::tempdir().unwrap();
    let config = "[devices]\nbackend = \"cpu\"\n";
    let args = ["--model", "test-org/demo"];
    let hub_cache = cache.path().as_os_str();
    {
        let env = [
            ("HF_ENDPOINT", mirror.base.as_ref()),
            ("HF_HUB_CACHE", hub_cache),
        ];
        let server = serve::Server::start_with_env(config, &args, &env);
        server.wait_ready();
        let models = server.get("/v1/models").json::<Value>().unwrap();
        assert_eq!(models["data"][0]["id"], "test-org/demo", "{models}");
        assert!(server.log_contains("downloaded"));
    }
    mirror.clear();
    let env = [
        ("HF_ENDPOINT", mirror.base.as_ref()),
        ("HF_HUB_CACHE", hub_cache),
        ("HF_HUB_OFFLINE", "1".as_ref()),
    ];
    let server = serve::Server::start_with_env(config, &args, &env);
    server.wait_ready();
    let reply = server.post_ok(
        "/v1/completions",
        &serde_json::json!({"model": "test-org/demo", "prompt": "Hi", "max_tokens": 2}),
    );
    assert!(reply["choices"][0]["text"].is_string(), "{reply}");
    // `generate` and `plan` take the name too.
    let out = Command::new(serve::BIN)
        .args([
            "generate",
            "--model",
            "test-org/demo",
            "--prompt-ids",
            "1,2",
        ])
        .args(["--max-tokens", "2", "--json"])
        .env("HF_HUB_CACHE", hub_cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        generated["token_ids"].as_array().unwrap().len(),
        2,
        "{generated}"
    );
    let out = Command::new(serve::BIN)
        .args(["plan", "--model", "test-org/demo"])
        .env("HF_HUB_CACHE", hub_cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(mirror.requests().is_empty(), "{:?}", mirror.requests());
    // A name offline and not cached: exit 78, naming what to do.
    let out = Command::new(serve::BIN)
        .args(["generate", "--model", "test-org/other", "--prompt-ids", "1"])
        .args(["--max-tokens", "1"])
        .env("HF_HUB_CACHE", hub_cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("HF_HUB_OFFLINE is set"), "{stderr}");
}

/// The DeepSeek-V3 fixture in shards as a large model is published: `dense.safetensors`
/// with everything but the routed experts, and one shard per (layer, expert).
fn sharded_deepseek() -> tempfile::TempDir {
    use safetensors::tensor::TensorView;
    let fixture = cluster_harness::model();
    let bytes = std::fs::read(fixture.join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut shards: std::collections::BTreeMap<String, Vec<(String, TensorView)>> =
        Default::default();
    for (name, view) in tensors.tensors() {
        let parts: Vec<&str> = name.split('.').collect();
        let shard = match parts[..] {
            ["model", "layers", layer, "mlp", "experts", expert, ..] => {
                expert_shard(layer.parse().unwrap(), expert.parse().unwrap())
            }
            _ => "dense.safetensors".to_string(),
        };
        shards.entry(shard).or_default().push((name, view));
    }
    let dir = tempfile::tempdir().unwrap();
    let mut weight_map = serde_json::Map::new();
    for (shard, tensors) in &shards {
        for (name, _) in tensors {
            weight_map.insert(name.clone(), shard.clone().into());
        }
        let data = safetensors::serialize(tensors.iter().map(|(n, v)| (n, v)), None).unwrap();
        std::fs::write(dir.path().join(shard), data).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    std::fs::copy(fixture.join("config.json"), dir.path().join("config.json")).unwrap();
    dir
}

fn expert_shard(layer: usize, expert: usize) -> String {
    format!("experts-{layer}-{expert}.safetensors")
}

/// The shard files in the snapshot of `repo` in the cache `cache`.
fn shards_in(cache: &Path, repo: &str) -> std::collections::BTreeSet<String> {
    shards_in_dir(&RepoCache::new(cache, repo).snapshot(COMMIT))
}

/// The shards holding the experts `node`'s placement gives it, and the dense one.
fn shards_placed_on(node: &cluster_harness::Node) -> std::collections::BTreeSet<String> {
    let placement = node.placement();
    let mut shards: std::collections::BTreeSet<String> = ["dense.safetensors".to_string()].into();
    for layer in placement["layers"].as_array().unwrap() {
        let index = layer["layer"].as_u64().unwrap() as usize;
        for (expert, replicas) in layer["experts"].as_array().unwrap().iter().enumerate() {
            if replicas
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r["node"] == node.name.as_str())
            {
                shards.insert(expert_shard(index, expert));
            }
        }
    }
    shards
}

#[test]
fn the_nodes_of_a_cluster_download_the_shards_they_read_and_no_others() {
    use cluster_harness::{ClusterSpec, Node, Transport, completion, generate_alone};
    let model = sharded_deepseek();
    let all = shards_in_dir(model.path());
    let mirror = Mirror::start(&[("org/ds3", model.path())]);
    let mut spec = ClusterSpec::new(2, Transport::Tcp);
    // A dead node's experts are placed on the survivor after a second.
    spec.rereplicate_after_ms = 1000;
    let caches = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let mut nodes: Vec<Node> = (0..2)
        .map(|i| {
            // Two nodes, one copy of each expert: each holds half.
            let (name, config) = spec.one_copy_config(i, "");
            let env = [
                ("HF_ENDPOINT", mirror.base.as_ref()),
                ("HF_HUB_CACHE", caches[i].path().as_os_str()),
            ];
            Node::start_with_env(&name, config, PathBuf::from("org/ds3"), &env)
        })
        .collect();
    for node in &nodes {
        node.wait_ready();
    }
    let prompt = [5u32, 17, 42, 9, 77, 3];
    let alone = generate_alone(&prompt, 8);
    for node in &nodes {
        assert_eq!(completion(node, &prompt, 8), alone, "{}", node.name);
    }
    // Each node fetched the dense shard and the shards of its experts, and no others.
    for (node, cache) in nodes.iter().zip(&caches) {
        let placed = shards_placed_on(node);
        let fetched = shards_in(cache.path(), "org/ds3");
        assert_eq!(fetched, placed, "{}", node.name);
        assert!(
            fetched.len() * 3 < all.len() * 2,
            "{} fetched {} of {} shards",
            node.name,
            fetched.len(),
            all.len()
        );
        // Every shard's header, to open the checkpoint (and fingerprint it as its peers do).
        let headers = RepoCache::new(cache.path(), "org/ds3")
            .header(COMMIT, "dense.safetensors")
            .parent()
            .unwrap()
            .read_dir()
            .unwrap()
            .count();
        assert!(headers + fetched.len() >= all.len(), "{headers} headers");
    }

    // node2 dies: its experts are placed on node1, which downloads their shards then.
    nodes[1].kill();
    let survivor = &nodes[0];
    survivor.wait_until(
        std::time::Duration::from_secs(60),
        "node1 holds every expert",
        || {
            survivor.placement()["layers"]
                .as_array()
                .unwrap()
                .iter()
                .all(|l| {
                    l["experts"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .all(|r| r.as_array().unwrap().iter().any(|r| r["node"] == "node1"))
                })
        },
    );
    survivor.wait_holds_its_share(std::time::Duration::from_secs(60));
    assert_eq!(completion(survivor, &prompt, 8), alone);
    assert_eq!(
        shards_in(caches[0].path(), "org/ds3"),
        shards_placed_on(survivor)
    );
    assert!(
        survivor
            .process
            .log_contains("fetching a shard this node reads")
    );
}

fn shards_in_dir(dir: &Path) -> std::collections::BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".safetensors"))
        .collect()
}
