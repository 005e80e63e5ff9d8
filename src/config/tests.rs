use super::*;

fn load(file: &str, env: &[(&str, &str)]) -> Result<NodeConfig, ConfigError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("moe-node.toml");
    std::fs::write(&path, file).unwrap();
    NodeConfig::load(ConfigSources {
        file: Some(&path),
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        overrides: Vec::new(),
    })
}

#[test]
fn credentials_replace_the_secrets_of_the_file() {
    let credentials = tempfile::tempdir().unwrap();
    std::fs::write(
        credentials.path().join("api_keys"),
        "# rotated 2026-12-01\nkey-one\n\n  key-two  \n",
    )
    .unwrap();
    // No values: the file's secrets stay.
    std::fs::write(credentials.path().join("cluster_secrets"), "# none yet\n").unwrap();
    let dir = credentials.path().to_str().unwrap();
    let config = load(
        "[server]\napi_keys = [\"from-file\"]\n[cluster]\nsecrets = [\"0123456789abcdef\"]\n",
        &[("CREDENTIALS_DIRECTORY", dir)],
    )
    .unwrap();
    assert_eq!(config.server.api_keys, vec!["key-one", "key-two"]);
    assert_eq!(config.cluster.secrets, vec!["0123456789abcdef"]);

    // The control-plane token: one value, replacing the file's.
    let token_file = credentials.path().join("control_plane_token");
    std::fs::write(
        &token_file,
        "# for cp.example.com\ncredential-token-0123456789\n",
    )
    .unwrap();
    let peering = "[control_plane]\nurl = \"http://10.0.0.9:9090\"\n\
                   token = \"file-token-0123456789\"\n";
    let config = load(peering, &[("CREDENTIALS_DIRECTORY", dir)]).unwrap();
    assert_eq!(config.control_plane.token, "credential-token-0123456789");
    // Two tokens are a mistake that is named.
    std::fs::write(&token_file, "token-one-0123456789\ntoken-two-0123456789\n").unwrap();
    let problems = load(peering, &[("CREDENTIALS_DIRECTORY", dir)])
        .unwrap_err()
        .problems;
    assert!(
        problems[0].starts_with("control_plane.token: the credential")
            && problems[0].ends_with("holds 2 values; give one"),
        "{problems:?}"
    );
    std::fs::remove_file(&token_file).unwrap();

    // A credential that cannot be read is an error that names it.
    std::fs::remove_file(credentials.path().join("api_keys")).unwrap();
    std::fs::create_dir(credentials.path().join("api_keys")).unwrap();
    let problems = load("", &[("CREDENTIALS_DIRECTORY", dir)])
        .unwrap_err()
        .problems;
    assert!(
        problems[0].starts_with("server.api_keys: cannot read the credential"),
        "{problems:?}"
    );
}

#[test]
fn layers_apply_in_order() {
    let config = load(
        "[server]\nlisten = \"0.0.0.0:9000\"\n[devices]\ncpu_slots = 4\n",
        &[
            ("MOE_NODE_DEVICES__CPU_SLOTS", "3"),
            ("MOE_NODE_DEVICES__CPU_AMX", "false"),
            ("MOE_NODE_SERVER__API_KEYS", "a,b"),
        ],
    )
    .unwrap();
    assert_eq!(config.server.listen, "0.0.0.0:9000");
    assert_eq!(config.devices.cpu_slots, 3);
    assert!(!config.devices.cpu_amx, "a typed bool from the environment");
    assert_eq!(config.server.api_keys, vec!["a", "b"]);
    assert_eq!(config.batching, BatchingConfig::default());

    let dir = tempfile::tempdir().unwrap();
    let overridden = NodeConfig::load(ConfigSources {
        file: None,
        env: [(
            "MOE_NODE_SERVER__LISTEN".to_string(),
            "1.2.3.4:1".to_string(),
        )]
        .into(),
        overrides: vec![("server.listen", "127.0.0.1:0".into())],
    })
    .unwrap();
    assert_eq!(overridden.server.listen, "127.0.0.1:0");
    drop(dir);
}

#[test]
fn every_problem_is_reported_at_once() {
    let err = load(
        "[server]\nlisten = \"nowhere\"\nlisen = 1\n[devices]\nbackend = \"cpu\"\ncpu_slots = 0\nreplication = 2\n\
         gpu_memory_fraction = 1.5\n\
         [batching]\nmax_sequences = \"many\"\n[gpus]\nx = 1\n",
        &[],
    )
    .unwrap_err();
    let text = err.to_string();
    for expected in [
        "server.lisen: unknown key",
        "gpus: unknown key",
        "server.listen: `nowhere`",
        "devices.cpu_slots",
        "devices.replication",
        "devices.gpu_memory_fraction: 1.5 is not in (0, 1]",
        "batching.max_sequences: invalid type: string \"many\"",
    ] {
        assert!(
            text.contains(expected),
            "{expected:?} missing from:\n{text}"
        );
    }
}

#[test]
fn sizes_from_outside_are_bounded_naming_the_key() {
    let err = load(
        "[server]\ndrain_seconds = 9223372036854775807\nbody_read_timeout_seconds = 0\n\
         [devices]\ncpu_slots = 100000000\n[batching]\nmax_tokens_per_step = 1099511627776\n\
         [placement]\nmax_move_mib = -1\n",
        &[],
    )
    .unwrap_err();
    let text = err.to_string();
    for expected in [
        "server.drain_seconds: 9223372036854775807 is more than a day",
        "server.body_read_timeout_seconds: 0 is not between 1 and 3600",
        "devices.cpu_slots: 100000000 is more than 1024",
        "batching.max_tokens_per_step: 1099511627776 is more than 1048576",
        "placement.max_move_mib: a number of MiB at least 0",
    ] {
        assert!(
            text.contains(expected),
            "{expected:?} missing from:\n{text}"
        );
    }
}

#[test]
fn an_open_listen_address_without_keys_is_warned_about() {
    let open = load(
        "[server]\nlisten = \"0.0.0.0:8080\"\nadmin_actions = true\n",
        &[],
    )
    .unwrap();
    let warnings = open.warnings().join("\n");
    assert!(
        warnings.contains("server.listen: `0.0.0.0:8080` is reachable"),
        "{warnings}"
    );
    assert!(warnings.contains("server.admin_actions"), "{warnings}");
    let keyed = load(
        "[server]\nlisten = \"0.0.0.0:8080\"\napi_keys = [\"k\"]\n",
        &[],
    )
    .unwrap();
    assert!(keyed.warnings().is_empty());
    assert!(NodeConfig::default().warnings().is_empty());
}

#[test]
fn local_cluster_example_is_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("etc/examples/local-cluster");
    let mut gossip = Vec::new();
    for i in 1..=3 {
        let file = dir.join(format!("node{i}.toml"));
        let config = NodeConfig::load(ConfigSources {
            file: Some(&file),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert!(config.cluster.enabled());
        assert_eq!(config.cluster.seeds.len(), 2);
        gossip.push(config.cluster.gossip_listen);
    }
    gossip.dedup();
    assert_eq!(gossip.len(), 3, "distinct gossip ports");
}

#[test]
fn cluster_problems_are_reported() {
    let err = load(
        "[cluster]\nnode_id = \"a b\"\nsecrets = [\"short\"]\ngossip_listen = \"0.0.0.0:7946\"\n\
         peer_listen = \"nowhere\"\nseeds = [\"x\"]\nexpect_nodes = 1\nreplication = 2\n\
         request_timeout_ms = 5\non_expert_unavailable = \"panic\"\n",
        &[],
    )
    .unwrap_err();
    let text = err.to_string();
    for expected in [
        "cluster.node_id",
        "cluster.secrets: secret 1 of 1 has 5 characters: it needs 128 bits of entropy",
        "cluster.gossip_listen: `0.0.0.0:7946` listens everywhere",
        "cluster.peer_listen: `nowhere`",
        "cluster.seeds: `x`",
        "cluster.replication (2) needs as many nodes",
        "cluster.request_timeout_ms: must be at least 10",
        "cluster.on_expert_unavailable",
    ] {
        assert!(
            text.contains(expected),
            "{expected:?} missing from:\n{text}"
        );
    }
    // Alone (no node_id), the section is not checked.
    assert!(load("[cluster]\nreplication = 5\n", &[]).is_ok());
}

#[test]
fn cluster_secrets_need_128_bits() {
    use super::sections::weak_secret;
    let hex = "0123456789abcdef0123456789abcdef";
    assert_eq!(weak_secret(hex), None);
    assert_eq!(weak_secret(&hex[..31]).as_deref(), Some("has 31 hex"));
    let base64 = "q3J0bXlzZWNyZXRrZXkx+/";
    assert_eq!(weak_secret(base64), None);
    assert_eq!(
        weak_secret(&base64[..21]).as_deref(),
        Some("has 21 characters")
    );
    assert_eq!(
        weak_secret(&"ab".repeat(20)).as_deref(),
        Some("repeats 2 characters only")
    );
    let config = |secret: &str| {
        format!(
            "[cluster]\nnode_id = \"a\"\nsecrets = [\"{hex}\", \"{secret}\"]\nexpect_nodes = 2\n"
        )
    };
    let err = load(&config("0123456789abcdef"), &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("secret 2 of 2 has 16 hex"), "{err}");
    assert!(!err.contains(hex), "a secret is never printed: {err}");
    assert!(load(&config(base64), &[]).is_ok());
}

#[test]
fn peer_transport_is_read_from_file_and_env_and_checked() {
    let config = load(
        "[peer]\ntransport = \"ucx\"\nucx_lib_dir = \"/opt/ucx/lib\"\n",
        &[("MOE_NODE_PEER__UCX_SYSTEM_SEARCH", "false")],
    )
    .unwrap();
    assert_eq!(config.peer.transport, PeerTransport::Ucx);
    assert_eq!(config.peer.ucx_lib_path(), Some(Path::new("/opt/ucx/lib")));
    assert!(!config.peer.ucx_system_search);

    let problems = load("[peer]\ntransport = \"rdma\"\nucx_dir = \"x\"\n", &[])
        .unwrap_err()
        .problems;
    let text = problems.join("\n");
    assert!(text.contains("peer.ucx_dir: unknown key"), "{text}");
    assert!(text.contains("peer.transport"), "{text}");

    let problems = load(
        "[peer]\ntransport = \"auto\"\nucx_system_search = false\n",
        &[],
    )
    .unwrap_err()
    .problems;
    assert!(
        problems[0].contains("nowhere to look for UCX"),
        "{problems:?}"
    );
    assert!(
        load(
            "[peer]\ntransport = \"tcp\"\nucx_system_search = false\n",
            &[]
        )
        .is_ok()
    );
}

#[test]
fn shipped_file_is_valid_and_equals_the_defaults() {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("etc/moe-node.toml");
    let config = NodeConfig::load(ConfigSources {
        file: Some(&shipped),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(config, NodeConfig::default());
}

#[test]
fn every_section_is_read_from_the_file() {
    // One key changed in each section: a section the loader forgets keeps its default, and
    // the comparison names it.
    let file = "[server]\ndrain_seconds = 7\n[model]\nnum_layers = 2\n[devices]\ncpu_slots = 3\n\
                [batching]\nmax_sequences = 5\n[metrics]\nper_expert = true\n\
                [logging]\nformat = \"json\"\n[telemetry]\nsample_ratio = 0.5\n\
                [cluster]\nexpect_nodes = 4\n[peer]\ntransport = \"tcp\"\n\
                [placement]\nwindow_seconds = 61\n[control_plane]\nheartbeat_seconds = 11\n\
                [gateway]\nstall_seconds = 13\n";
    let config = load(file, &[]).unwrap();
    let loaded = serde_json::to_value(&config).unwrap();
    let defaults = serde_json::to_value(NodeConfig::default()).unwrap();
    let sections = defaults.as_object().unwrap();
    for (name, default) in sections {
        assert_ne!(&loaded[name], default, "[{name}] in the file was not read");
    }
}
