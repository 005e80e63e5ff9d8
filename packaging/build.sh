#!/usr/bin/env bash
# Builds the .deb and .rpm packages into target/debian/ and target/generate-rpm/.
#
#   packaging/build.sh            # cargo build --release, then package
#   packaging/build.sh --no-build # package the binary already at $target_dir/release/moe-node
#
# Needs cargo-deb and cargo-generate-rpm (`cargo install cargo-deb cargo-generate-rpm`).
# What goes into each package is listed in Cargo.toml ([package.metadata.deb] and
# [package.metadata.generate-rpm]).
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"
if [ "${1:-}" != --no-build ]; then
    cargo build --release --locked
fi
binary="$target_dir/release/moe-node"
[ -x "$binary" ] || { echo "no binary at $binary" >&2; exit 1; }

# The manual page and shell completions, from the binary's own command-line definitions.
generated=target/packaging
mkdir -p "$generated"
"$binary" manual | gzip -9n >"$generated/moe-node.1.gz"
"$binary" completions bash >"$generated/moe-node.bash"
"$binary" completions zsh >"$generated/_moe-node"
"$binary" completions fish >"$generated/moe-node.fish"

cargo deb --no-build
# cargo-generate-rpm reads target/release/ under the directory it is given.
cargo generate-rpm --target-dir "$target_dir"
ls -l "$target_dir"/debian/*.deb "$target_dir"/generate-rpm/*.rpm
