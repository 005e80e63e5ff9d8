#!/usr/bin/env bash
# Builds, on a machine with the Rust toolchain, everything tests/gpu/run.sh runs on a GPU
# machine (which has no toolchain): the moe-node binary, the test binaries that exercise the
# GPU backend, and the GPU benchmark, stripped, into gpu-bin/ (ignored by git). CUDA is not
# needed here: every CUDA library is opened at run time.
#
#   tests/gpu/build.sh            # then carry gpu-bin/ to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/../.."
out=gpu-bin
rm -rf "$out"
mkdir -p "$out"

executables() {
    # The executables cargo reports for a build, one per line: "name path".
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
'
}

cargo build --release --bin moe-node --message-format=json | executables > "$out/.list"
cargo test --release --no-run --test gpu_kernels --test gpu_served --test gpu_hybrid \
    --test gpu_graphs --test reference --test server \
    --message-format=json | executables >> "$out/.list"
cargo bench --no-run --bench moe_layer_gpu --bench load --bench engine_step --message-format=json \
    | executables >> "$out/.list"
while read -r name path; do
    strip -o "$out/$name" "$path"
done < "$out/.list"
rm "$out/.list"
# The test binaries find their fixtures (and the server tests the moe-node binary) through
# paths compiled into them: run.sh recreates this one on the GPU machine.
pwd > "$out/source-dir"
ls -l "$out"
du -sh "$out"
