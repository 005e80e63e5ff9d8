//! Holds the CPU kernels' files to their layers: each file may name only files of a lower
//! layer (the compiler would accept a circle; this test does not). A file added to `cpu/`,
//! `quant/` or `amx/` gets a line here, in the layer of what it imports.

use std::collections::HashMap;

/// The files, lowest first; a file may import from any earlier line's files.
const LAYERS: &[&[&str]] = &[
    &["cpu::element", "cpu::parallel", "cpu::simd"],
    &["cpu::decode", "cpu::gemm", "cpu::native_bf16"],
    &["cpu::tiles", "cpu::ops"],
    &["quant::e4m3", "quant::format", "quant::mxfp4"],
    &["quant::int4_rows"],
    &["amx::status"],
    &["amx::pack", "amx::to_bf16"],
    &["amx::session"],
    &["amx::int4"],
    &["amx"],
    &["cpu::linear", "quant::linear"],
    &["quant"],
    &["cpu"],
];

/// The file of module `module` (`cpu`, `cpu::tiles`), relative to `src/compute/`.
fn file_of(module: &str) -> String {
    match module.split_once("::") {
        Some((folder, file)) => format!("{folder}/{file}.rs"),
        None => format!("{module}/mod.rs"),
    }
}

/// The modules `source` (of module `module`) names, leaving out its unit tests.
fn imports(module: &str, source: &str, known: &HashMap<&str, usize>) -> Vec<String> {
    let code = source
        .split("#[cfg(test)]\nmod tests {")
        .next()
        .unwrap_or(source);
    let (folder, is_folder) = match module.split_once("::") {
        Some((folder, _)) => (folder, false),
        None => (module, true),
    };
    let mut found = Vec::new();
    for line in code.lines().map(str::trim_start) {
        if line.starts_with("//") {
            continue;
        }
        let mut paths: Vec<String> = Vec::new();
        for (at, _) in line.match_indices("crate::compute::") {
            let rest = &line[at + "crate::compute::".len()..];
            paths.push(rest.to_string());
        }
        for (at, _) in line.match_indices("super::") {
            // `super::` of a file names its folder's modules; of a folder, compute's.
            let before = &line[..at];
            if before.ends_with("crate::compute::") || before.ends_with("super::") {
                continue;
            }
            let rest = &line[at + "super::".len()..];
            paths.push(if is_folder {
                rest.to_string()
            } else {
                format!("{folder}::{rest}")
            });
        }
        if is_folder {
            // A folder's own `use child::...`.
            let bare = line
                .trim_start_matches("pub ")
                .trim_start_matches("pub(crate) ");
            if let Some(rest) = bare.strip_prefix("use ") {
                paths.push(format!("{module}::{rest}"));
            }
        }
        for path in paths {
            let segments: Vec<&str> = path
                .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .next()
                .unwrap_or("")
                .split("::")
                .take(2)
                .collect();
            let two = segments.join("::");
            let name = if known.contains_key(two.as_str()) {
                two
            } else {
                segments[0].to_string()
            };
            if known.contains_key(name.as_str()) && name != module {
                found.push(name);
            }
        }
    }
    found
}

#[test]
fn every_cpu_kernel_file_imports_only_from_lower_layers() {
    let layer: HashMap<&str, usize> = LAYERS
        .iter()
        .enumerate()
        .flat_map(|(i, files)| files.iter().map(move |f| (*f, i)))
        .collect();
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/src/compute/");
    let mut upward = Vec::new();
    for (module, at) in &layer {
        let path = format!("{root}{}", file_of(module));
        let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        for import in imports(module, &source, &layer) {
            if layer[import.as_str()] >= *at {
                upward.push(format!("{module} imports {import}"));
            }
        }
    }
    upward.sort();
    upward.dedup();
    assert!(
        upward.is_empty(),
        "imports not from a lower layer: {upward:#?}"
    );
}

#[test]
fn every_file_of_the_cpu_kernels_has_a_layer() {
    let listed: Vec<String> = LAYERS
        .iter()
        .flat_map(|l| l.iter())
        .map(|m| file_of(m))
        .collect();
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/src/compute/");
    for folder in ["cpu", "quant", "amx"] {
        for entry in std::fs::read_dir(format!("{root}{folder}")).expect("the folder") {
            let name = entry
                .expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned();
            let file = format!("{folder}/{name}");
            if name.ends_with(".rs") && name != "tests.rs" {
                assert!(listed.contains(&file), "{file} has no layer in LAYERS");
            }
        }
    }
}
