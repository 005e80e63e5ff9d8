//! The documentation against what it describes, so that it cannot drift unnoticed:
//! `docs/configuration.md` names every section and key of the shipped `etc/moe-node.toml`
//! (and no key the file lacks); README.md links every page under `docs/` and every link
//! between the pages leads to a page and heading that exist; and every repository path the
//! pages name in backticks (source files, tests, results files behind the figures) exists.
//! Each test lists everything it found wrong at once.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// `(section, key)` of every `key = value` line of a TOML file written as
/// `etc/moe-node.toml` is: `[section]` headers and one key per line.
fn toml_keys(text: &str) -> Vec<(String, String)> {
    let mut section = String::new();
    let mut keys = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.trim().to_string();
            continue;
        }
        if let Some((key, _)) = line.split_once('=') {
            let key = key.trim();
            let is_key = !key.is_empty()
                && key
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if is_key {
                keys.push((section.clone(), key.to_string()));
            }
        }
    }
    keys
}

/// The text under each `## [section]` heading of a page, up to the next `## ` heading.
fn sections_of(page: &str) -> BTreeMap<String, String> {
    let mut sections = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in page.lines() {
        if line.starts_with("## ") {
            if let Some((name, body)) = current.take() {
                sections.insert(name, body);
            }
            let heading = line.trim_start_matches('#').trim();
            if let Some(name) = heading.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
                current = Some((name.to_string(), String::new()));
            }
            continue;
        }
        if let Some((_, body)) = current.as_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    if let Some((name, body)) = current {
        sections.insert(name, body);
    }
    sections
}

/// The keys a section's table documents: the backticked names in the first cell of each
/// table row (`` | `a`, `b` | ... ``).
fn table_keys(body: &str) -> BTreeSet<String> {
    body.lines()
        .filter_map(|line| line.strip_prefix('|'))
        .filter_map(|row| row.split('|').next())
        .flat_map(|cell| {
            cell.split(',')
                .filter_map(|name| {
                    let name = name.trim();
                    name.strip_prefix('`')
                        .and_then(|n| n.strip_suffix('`'))
                        .map(str::to_string)
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn the_configuration_page_lists_every_section_and_key_of_the_shipped_config() {
    let shipped = toml_keys(&read(&root().join("etc/moe-node.toml")));
    let page = read(&root().join("docs/configuration.md"));
    let sections = sections_of(&page);
    // A parser that found nothing would pass anything: the file has ten sections, 58 keys.
    let shipped_sections: BTreeSet<&str> = shipped.iter().map(|(s, _)| s.as_str()).collect();
    assert!(
        shipped_sections.len() >= 10 && shipped.len() >= 50,
        "read {} sections and {} keys from etc/moe-node.toml: the parser is wrong",
        shipped_sections.len(),
        shipped.len()
    );

    let mut problems = Vec::new();
    for section in &shipped_sections {
        if !sections.contains_key(*section) {
            problems.push(format!("no `## [{section}]` heading"));
        }
    }
    for (section, key) in &shipped {
        if let Some(body) = sections.get(section)
            && !table_keys(body).contains(key)
        {
            problems.push(format!(
                "{section}.{key} is not in the table under ## [{section}]"
            ));
        }
    }
    // And the other way: a key documented that the file does not have.
    for (section, body) in &sections {
        for key in table_keys(body) {
            if !shipped.iter().any(|(s, k)| s == section && *k == key) {
                problems.push(format!(
                    "{section}.{key} is documented but not in etc/moe-node.toml"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "docs/configuration.md and etc/moe-node.toml disagree:\n  {}",
        problems.join("\n  ")
    );
}

/// The pages under `docs/`, by file name.
fn docs_pages() -> BTreeSet<String> {
    fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|entry| entry.expect("docs/ entry").file_name())
        .map(|name| name.to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .collect()
}

/// The targets of the Markdown links `](target)` in `text`.
fn link_targets(text: &str) -> Vec<String> {
    text.split("](")
        .skip(1)
        .filter_map(|rest| rest.split_once(')').map(|(target, _)| target.to_string()))
        .collect()
}

/// GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces
/// as `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors_of(page: &str) -> BTreeSet<String> {
    without_code_blocks(page)
        .lines()
        .filter(|line| line.starts_with('#'))
        .map(|line| anchor(line.trim_start_matches('#')))
        .collect()
}

/// Checks one link from `from` (a file in `dir`): a relative link to a `.md` file must lead
/// to a file that exists and, with `#anchor`, to a heading it has.
fn check_link(from: &str, dir: &Path, target: &str, problems: &mut Vec<String>) {
    if target.contains("://") || target.starts_with('#') || target.starts_with("mailto:") {
        return;
    }
    let (file, fragment) = match target.split_once('#') {
        Some((file, fragment)) => (file, Some(fragment)),
        None => (target, None),
    };
    let path = dir.join(file);
    if !path.exists() {
        problems.push(format!("{from} links {target}: {file} does not exist"));
        return;
    }
    if let Some(fragment) = fragment
        && !anchors_of(&read(&path)).contains(fragment)
    {
        problems.push(format!(
            "{from} links {target}: {file} has no heading #{fragment}"
        ));
    }
}

#[test]
fn the_readme_links_every_docs_page_and_every_link_leads_somewhere() {
    let readme = read(&root().join("README.md"));
    let mut problems = Vec::new();
    let linked: BTreeSet<String> = link_targets(&readme)
        .iter()
        .filter_map(|t| t.strip_prefix("docs/"))
        .map(|t| t.split('#').next().unwrap_or(t).to_string())
        .collect();
    for target in link_targets(&readme) {
        check_link("README.md", &root(), &target, &mut problems);
    }
    let pages = docs_pages();
    assert!(pages.len() >= 10, "found only {pages:?} under docs/");
    for page in &pages {
        if !linked.contains(page) {
            problems.push(format!("README.md does not link docs/{page}"));
        }
        let text = read(&root().join("docs").join(page));
        for target in link_targets(&text) {
            check_link(
                &format!("docs/{page}"),
                &root().join("docs"),
                &target,
                &mut problems,
            );
        }
    }
    assert!(
        problems.is_empty(),
        "broken or missing links:\n  {}",
        problems.join("\n  ")
    );
}

fn without_code_blocks(text: &str) -> String {
    let mut out = String::new();
    let mut in_block = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if !in_block {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Backticked spans outside code blocks that name a path in this repository: they start
/// with one of its top-level folders and hold no placeholder (`<target>`, `*`, `{id}`).
fn named_paths(text: &str) -> Vec<String> {
    const TOP: [&str; 11] = [
        "src/",
        "tests/",
        "benches/",
        "etc/",
        "kernels/",
        "packaging/",
        "systemd/",
        "fuzz/",
        ".ci/",
        "ucx-sys/",
        "docs/",
    ];
    without_code_blocks(text)
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|span| TOP.iter().any(|top| span.starts_with(top)))
        .filter(|span| !span.contains(['<', '*', '{', ' ', '$']) && !span.contains("..."))
        .map(str::to_string)
        .collect()
}

#[test]
fn every_path_the_pages_name_exists() {
    let mut pages = vec![("README.md".to_string(), read(&root().join("README.md")))];
    for page in docs_pages() {
        let text = read(&root().join("docs").join(&page));
        pages.push((format!("docs/{page}"), text));
    }
    let mut named = 0;
    let mut problems = Vec::new();
    for (name, text) in &pages {
        let paths: BTreeSet<String> = named_paths(text).into_iter().collect();
        for path in paths {
            named += 1;
            if !root().join(&path).exists() {
                problems.push(format!("{name} names `{path}`, which does not exist"));
            }
        }
    }
    assert!(named >= 20, "found only {named} paths: the reader is wrong");
    assert!(
        problems.is_empty(),
        "stale paths:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_readers_find_what_they_look_for() {
    let keys = toml_keys("# a = 1\n[one]\nkey_a = 1\n  # key_b = 2\n[two]\nkey_c = \"x = y\"\n");
    assert_eq!(
        keys,
        [
            ("one".into(), "key_a".into()),
            ("two".into(), "key_c".into())
        ]
    );
    let page = "## [one]\n\n| key | x |\n|---|---|\n| `key_a`, `key_b` | `not_a_key` |\n## Two\n| `no` |\n";
    let sections = sections_of(page);
    assert_eq!(sections.keys().collect::<Vec<_>>(), ["one"]);
    assert_eq!(
        table_keys(&sections["one"]),
        BTreeSet::from(["key_a".to_string(), "key_b".to_string()])
    );
    assert_eq!(
        anchor(" What has been checked on a GPU, and what has not"),
        "what-has-been-checked-on-a-gpu-and-what-has-not"
    );
    assert_eq!(anchor(" [control_plane]"), "control_plane");
    assert_eq!(
        named_paths(
            "`src/a.rs` and `fuzz/corpus/<t>/` and\n```\n`tests/x.rs`\n```\n`benches/results/x.txt`"
        ),
        ["src/a.rs", "benches/results/x.txt"]
    );
    assert_eq!(
        link_targets("[a](docs/x.md#y) and [b](http://z)"),
        ["docs/x.md#y", "http://z"]
    );
}
