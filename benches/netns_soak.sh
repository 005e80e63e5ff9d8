#!/bin/sh
# The partition soak for 10 minutes (CI runs one round): three nodes each in a network
# namespace of its own and a gateway outside (root and `ip netns` needed), 4 streaming
# clients, rounds of: one node cut off past rereplicate_after_ms and healed, one killed
# (-9) and restarted, one paused 1 s and one 4 s (suspicion timeout 2 s). Prints and writes
# the report: rounds, streams (none may fail or change), the time to one table after each
# heal.
#   benches/netns_soak.sh [SECONDS]
set -eu
cd "$(dirname "$0")/.."
seconds="${1:-600}"
out="benches/results/netns_soak.txt"
report="$(mktemp)"
MOE_TEST_REQUIRE_NETNS=1 MOE_NETNS_SOAK_SECONDS="$seconds" MOE_NETNS_SOAK_REPORT="$report" \
    cargo test --release --test netns_partition -- --nocapture
{
    echo "# benches/netns_soak.sh $seconds"
    echo "# commit $(git rev-parse --short HEAD), $(date -u +%Y-%m-%d), $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
    cat "$report"
} > "$out"
rm -f "$report"
cat "$out"
