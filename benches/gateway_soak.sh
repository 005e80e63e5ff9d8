#!/bin/sh
# The gateway soak for 10 minutes (CI runs the same test for 60 s): three nodes and a gateway
# on this machine, 8 streaming clients, a node at a time killed and restarted or paused
# shorter and longer than the suspicion timeout. Prints and writes the report: requests,
# failures (goal 0), changed outputs (goal 0), the gateway's p99 latency against the steady
# part, and every process's memory at the start and the end.
#   benches/gateway_soak.sh [SECONDS]
set -eu
cd "$(dirname "$0")/.."
seconds="${1:-600}"
out="benches/results/gateway_soak.txt"
report="$(mktemp)"
MOE_GATEWAY_SOAK_SECONDS="$seconds" MOE_GATEWAY_SOAK_REPORT="$report" \
    cargo test --test gateway a_soak_through_the_gateway -- --nocapture
{
    echo "# benches/gateway_soak.sh $seconds"
    echo "# commit $(git rev-parse --short HEAD), $(date -u +%Y-%m-%d), $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
    cat "$report"
} > "$out"
rm -f "$report"
cat "$out"
