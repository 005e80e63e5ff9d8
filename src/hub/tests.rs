use std::collections::HashMap;

use super::*;

fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn names_are_org_slash_name_with_an_optional_revision() {
    let name = ModelName::parse("Qwen/Qwen3-30B-A3B").unwrap();
    assert_eq!(name.repo, "Qwen/Qwen3-30B-A3B");
    assert_eq!(name.revision, "main");
    let pinned = ModelName::parse("deepseek-ai/DeepSeek-V3@refs/pr/12").unwrap();
    assert_eq!(pinned.revision, "refs/pr/12");
    for not_a_name in [
        "/models/qwen",
        "./qwen/x",
        "qwen",
        "a/b/c",
        "../x",
        "org/..",
        "org/name@",
        "org/name@../../etc",
        "org/-x",
        "org/x--y",
        "org /x",
        "org/name@/abs",
    ] {
        assert_eq!(ModelName::parse(not_a_name), None, "{not_a_name}");
    }
}

#[test]
fn the_cache_and_endpoint_follow_the_hugging_face_variables() {
    let env = HubEnv::from_vars(&vars(&[("HOME", "/home/u")]));
    assert_eq!(env.cache, Path::new("/home/u/.cache/huggingface/hub"));
    assert_eq!(env.endpoint, "https://huggingface.co");
    assert!(!env.offline);
    let env = HubEnv::from_vars(&vars(&[
        ("HOME", "/home/u"),
        ("XDG_CACHE_HOME", "/xdg"),
        ("HF_ENDPOINT", "http://mirror:8080/"),
        ("HF_TOKEN", " hf_abc\n"),
        ("HF_HUB_OFFLINE", "1"),
    ]));
    assert_eq!(env.cache, Path::new("/xdg/huggingface/hub"));
    assert_eq!(env.endpoint, "http://mirror:8080");
    assert_eq!(env.token.as_deref(), Some("hf_abc"));
    assert!(env.offline);
    let env = HubEnv::from_vars(&vars(&[("HF_HOME", "/hf"), ("HF_HUB_OFFLINE", "0")]));
    assert_eq!(env.cache, Path::new("/hf/hub"));
    assert!(!env.offline);
    let env = HubEnv::from_vars(&vars(&[("HF_HOME", "/hf"), ("HF_HUB_CACHE", "/c")]));
    assert_eq!(env.cache, Path::new("/c"));
}

#[test]
fn the_token_file_is_read_when_hf_token_is_not_set() {
    let home = tempfile::tempdir().unwrap();
    std::fs::write(home.path().join("token"), "hf_from_file\n").unwrap();
    let home_text = home.path().to_str().unwrap();
    let env = HubEnv::from_vars(&vars(&[("HF_HOME", home_text)]));
    assert_eq!(env.token.as_deref(), Some("hf_from_file"));
}

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A snapshot laid out as `huggingface_hub` documents it, with `files`.
fn cached(root: &Path, files: &[(&str, &str)]) -> RepoCache {
    let cache = RepoCache::new(root, "org/model");
    for (file, content) in files {
        let etag = format!("etag{}", file.len());
        std::fs::create_dir_all(cache.blob("x").parent().unwrap()).unwrap();
        std::fs::write(cache.blob(&etag), content).unwrap();
        cache.link(COMMIT, file, &etag).unwrap();
    }
    cache.set_ref("main", COMMIT).unwrap();
    cache
}

fn offline(root: &Path) -> HubEnv {
    HubEnv {
        cache: root.to_path_buf(),
        endpoint: "http://127.0.0.1:9".into(),
        token: None,
        offline: true,
    }
}

#[test]
fn offline_a_complete_snapshot_is_found_through_its_ref() {
    let root = tempfile::tempdir().unwrap();
    let cache = cached(
        root.path(),
        &[("config.json", "{}"), ("model.safetensors", "weights")],
    );
    let found = resolve_model("org/model", &offline(root.path()), Weights::All).unwrap();
    assert_eq!(found.name, ModelName::parse("org/model"));
    let dir = found.dir;
    assert_eq!(dir, cache.snapshot(COMMIT));
    assert_eq!(
        std::fs::read_to_string(dir.join("config.json")).unwrap(),
        "{}"
    );
    assert!(
        std::fs::symlink_metadata(dir.join("config.json"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    // By commit too, and a path that exists is itself.
    let by_commit = format!("org/model@{COMMIT}");
    let found = resolve_model(&by_commit, &offline(root.path()), Weights::All).unwrap();
    assert_eq!(found.dir, dir);
    let here = root.path().to_str().unwrap();
    let found = resolve_model(here, &offline(root.path()), Weights::All).unwrap();
    assert_eq!((found.dir.as_path(), found.name), (root.path(), None));
}

#[test]
fn offline_a_missing_model_or_shard_is_an_error_that_names_it() {
    let root = tempfile::tempdir().unwrap();
    let error = resolve_model("org/other", &offline(root.path()), Weights::All).unwrap_err();
    assert!(matches!(error, HubError::NotCached { .. }), "{error}");
    assert!(error.to_string().contains("HF_HUB_OFFLINE"), "{error}");
    let index = r#"{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors",
                   "c": "model-1.safetensors"}}"#;
    cached(
        root.path(),
        &[
            ("config.json", "{}"),
            ("model.safetensors.index.json", index),
            ("model-1.safetensors", "one"),
        ],
    );
    let error = resolve_model("org/model", &offline(root.path()), Weights::All).unwrap_err();
    assert!(error.to_string().contains("model-2.safetensors"), "{error}");
    assert!(
        !error.to_string().contains("model-1.safetensors"),
        "{error}"
    );
    assert!(error.is_configuration());
    // Without weights (a dummy load) the config is enough.
    assert!(resolve_model("org/model", &offline(root.path()), Weights::None).is_ok());
}

#[test]
fn an_index_naming_a_file_outside_the_model_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let index = r#"{"weight_map": {"a": "../../../../etc/passwd"}}"#;
    cached(
        root.path(),
        &[
            ("config.json", "{}"),
            ("model.safetensors.index.json", index),
        ],
    );
    let error = resolve_model("org/model", &offline(root.path()), Weights::All).unwrap_err();
    assert!(matches!(error, HubError::BadIndex { .. }), "{error}");
}

#[test]
fn a_nested_file_links_back_to_its_blob() {
    let root = tempfile::tempdir().unwrap();
    let cache = cached(root.path(), &[("sub/dir/file.json", "nested")]);
    let linked = cache.snapshot(COMMIT).join("sub/dir/file.json");
    assert_eq!(std::fs::read_to_string(linked).unwrap(), "nested");
}
