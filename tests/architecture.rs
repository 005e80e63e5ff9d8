//! The crate's shape, as its `crate::` paths draw it: each top-level module stands on one
//! floor and imports only modules on the floors below, so no import runs upward and no
//! circle spans two folders. A change that needs an upward import moves code to where it
//! belongs, or moves a module between floors here, on purpose and in review.
//!
//! Read from the source text (comments left out): a `crate::name` path anywhere in a file of
//! module `name`'s folder counts as an import, `use` line or not.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The floors, bottom first, with what each module is for (docs/architecture.md walks them).
const FLOORS: &[&[(&str, &str)]] = &[
    &[
        ("progress", "start-up progress, for the log and systemd"),
        ("logging", "log output and its filter"),
    ],
    &[
        (
            "compute",
            "numeric kernels (CPU, CUDA) and the blocks they run",
        ),
        (
            "placement",
            "pure placement algorithms: which device holds which expert",
        ),
    ],
    &[(
        "model",
        "checkpoints: configs, tensors into compute blocks, tokenizer, templates",
    )],
    &[
        (
            "config",
            "the node's configuration as plain data, validated whole",
        ),
        (
            "hub",
            "models by Hugging Face name: the hub's cache layout, downloads, shards as read",
        ),
    ],
    &[
        ("cluster", "gossip membership"),
        ("transport", "peer links: wire format, TCP, UCX, in-memory"),
        ("moe", "the gate and the dispatch plan"),
        (
            "control_plane",
            "the control plane (server) and a node's client of it",
        ),
    ],
    &[(
        "telemetry",
        "OpenTelemetry traces: spans of requests, steps, dispatches and peer calls",
    )],
    &[(
        "experts",
        "the expert data plane: executor seam, dispatcher, device actors, remote half",
    )],
    &[(
        "engine",
        "the forward pass, its caches, batching and sampling",
    )],
    &[
        ("metrics", "the node's Prometheus registry"),
        ("plan", "the readiness report (`moe-node plan`)"),
        (
            "rollout",
            "placement versions over time: bootstrap, board, follow, rebalance",
        ),
    ],
    &[(
        "node",
        "the composition root: one node's actors and cluster part",
    )],
    &[("api", "the HTTP API")],
    &[
        (
            "server",
            "`moe-node serve`: binds the API, runs the node, drains on SIGTERM",
        ),
        (
            "gateway",
            "`moe-node gateway`: the API in front of a cluster; moves streams off failed nodes",
        ),
    ],
];

fn floor_of(module: &str) -> Option<usize> {
    FLOORS
        .iter()
        .position(|floor| floor.iter().any(|(name, _)| *name == module))
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The library's top-level modules, as `lib.rs` declares them.
fn library_modules() -> Vec<String> {
    let lib = std::fs::read_to_string(src().join("lib.rs")).expect("src/lib.rs");
    lib.lines()
        .filter_map(|line| {
            let line = line.trim();
            let rest = line
                .strip_prefix("pub mod ")
                .or_else(|| line.strip_prefix("mod "))?;
            Some(rest.trim_end_matches(';').trim().to_string())
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The files of top-level module `module`: `src/module.rs` and everything under `src/module/`.
fn files_of(module: &str) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let file = src().join(format!("{module}.rs"));
    if file.exists() {
        files.push(file);
    }
    rust_files(&src().join(module), &mut files);
    files.sort();
    files
}

/// Code without its comments (line comments, doc comments, block comments); string
/// literals are kept, which only ever adds imports, never hides one.
fn without_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut depth = 0usize;
    while let Some(c) = chars.next() {
        match (c, chars.peek().copied()) {
            ('/', Some('*')) => {
                chars.next();
                depth += 1;
            }
            ('*', Some('/')) if depth > 0 => {
                chars.next();
                depth -= 1;
            }
            ('/', Some('/')) if depth == 0 => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            _ if depth > 0 => {}
            _ => out.push(c),
        }
    }
    out
}

/// The top-level modules that `code` names through `crate::` (`crate::a::b`, and each path
/// of `crate::{a::b, c}`).
fn crate_paths(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (at, _) in code.match_indices("crate::") {
        // Not the tail of another path (`moe_node::crate::` does not exist, `$crate::` is a macro's).
        if at > 0 {
            let before = code.as_bytes()[at - 1];
            if before.is_ascii_alphanumeric() || before == b'_' || before == b'$' {
                continue;
            }
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0usize;
            let mut start = 0usize;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        found.push(ident(&group[start..i]));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        found.push(ident(&group[start..i]));
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            found.push(ident(rest));
        }
    }
    found.retain(|name| !name.is_empty());
    found
}

#[test]
fn every_library_module_stands_on_a_floor() {
    let modules = library_modules();
    assert!(
        modules.len() >= 10,
        "read too few modules from src/lib.rs: {modules:?}"
    );
    let missing: Vec<_> = modules.iter().filter(|m| floor_of(m).is_none()).collect();
    assert!(
        missing.is_empty(),
        "modules with no floor in tests/architecture.rs: {missing:?}"
    );
    let stale: Vec<_> = FLOORS
        .iter()
        .flat_map(|floor| floor.iter().map(|(name, _)| *name))
        .filter(|name| !modules.iter().any(|m| m == name))
        .collect();
    assert!(
        stale.is_empty(),
        "floors name modules that src/lib.rs does not declare: {stale:?}"
    );
}

#[test]
fn no_module_imports_from_its_own_floor_or_above() {
    let modules = library_modules();
    let mut upward: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut files_read = 0;
    for module in &modules {
        let Some(floor) = floor_of(module) else {
            continue;
        };
        for file in files_of(module) {
            files_read += 1;
            let text = std::fs::read_to_string(&file).expect("a source file");
            let relative = file
                .strip_prefix(src())
                .unwrap_or(&file)
                .display()
                .to_string();
            for target in crate_paths(&without_comments(&text)) {
                if &target == module {
                    continue;
                }
                let Some(target_floor) = floor_of(&target) else {
                    continue;
                };
                if target_floor >= floor {
                    upward
                        .entry(format!(
                            "{module} (floor {floor}) -> {target} (floor {target_floor})"
                        ))
                        .or_default()
                        .push(relative.clone());
                }
            }
        }
    }
    assert!(files_read > 100, "read only {files_read} files under src/");
    let report: Vec<String> = upward
        .into_iter()
        .map(|(arrow, mut files)| {
            files.sort();
            files.dedup();
            format!("  {arrow}: {}", files.join(", "))
        })
        .collect();
    assert!(
        report.is_empty(),
        "imports that run sideways or up (move the code, or the module between floors on \
         purpose):\n{}",
        report.join("\n")
    );
}

#[test]
fn the_reader_sees_paths_and_skips_comments() {
    let code = "use crate::engine::Engine;\n// crate::api is only mentioned\n/* crate::node */\n\
                let x = crate::{model::Tokenizer, config::{A, B}};\nlet y = $crate::z;";
    let paths = crate_paths(&without_comments(code));
    assert_eq!(paths, ["engine", "model", "config"]);
}

/// Lines a file of `src/` may have (tests moved to a `tests.rs` beside it count on their own).
const MAX_FILE_LINES: usize = 900;
/// Lines a function may have, from its `fn` line to its closing brace.
const MAX_FN_LINES: usize = 150;

/// `(name, lines)` of each function of `text` written in the usual shape: a `fn` line and a
/// closing brace alone on a line at the same indent (one-line and other shapes are skipped).
fn function_lengths(text: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        let indent = &line[..line.len() - code.len()];
        let mut words = code.split_whitespace().peekable();
        while words
            .peek()
            .is_some_and(|w| w.starts_with("pub") || ["async", "unsafe", "const"].contains(w))
        {
            words.next();
        }
        if words.next() != Some("fn") || code.ends_with(';') || code.ends_with('}') {
            continue;
        }
        let name: String = words
            .next()
            .unwrap_or("")
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let close = format!("{indent}}}");
        let end = lines[at + 1..].iter().position(|l| {
            *l == close || (!l.trim().is_empty() && !l.starts_with(indent) && !indent.is_empty())
        });
        if let Some(end) = end
            && lines[at + 1 + end] == close
        {
            out.push((name, end + 2));
        }
    }
    out
}

#[test]
fn files_and_functions_are_short_enough_to_hold_in_the_head() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    files.sort();
    let mut long = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read");
        let shown = file
            .strip_prefix(src())
            .unwrap_or(file)
            .display()
            .to_string();
        let lines = text.lines().count();
        if lines > MAX_FILE_LINES {
            long.push(format!("{shown}: {lines} lines (at most {MAX_FILE_LINES})"));
        }
        for (name, lines) in function_lengths(&text) {
            if lines > MAX_FN_LINES {
                long.push(format!(
                    "{shown}: fn {name} is {lines} lines (at most {MAX_FN_LINES})"
                ));
            }
        }
    }
    assert!(
        long.is_empty(),
        "split these (a file into modules, a function into steps):\n{}",
        long.join("\n")
    );
}

#[test]
fn function_lengths_are_read_from_fn_line_to_closing_brace() {
    let code = "fn a() {\n    x;\n}\n    pub(crate) async fn b(\n        y: u8,\n    ) -> u8 {\n        y\n    }\n\
                fn c();\nfn d() { 1 }\nimpl X {\n    fn e() {}\n}\n";
    assert_eq!(
        function_lengths(code),
        [("a".to_string(), 3), ("b".to_string(), 5)]
    );
}
