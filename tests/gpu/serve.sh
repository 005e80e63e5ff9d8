#!/usr/bin/env bash
# End-to-end serving on a GPU at Kimi K2's published shape, with random weights made from its
# config.json (benches/configs/kimi_k2) and the first $LAYERS layers (default 3: one dense,
# two MoE, 31.5 GiB of experts): on binaries built by tests/gpu/build.sh, from the repository
# root of a GPU machine. Writes logs under OUT.
#
#   tests/gpu/serve.sh OUT
#
# 1. `moe-node generate --gpu 0` on the dummy K2, two layers (does the GPU path take the real
#    shapes);
# 2. benches/load.rs against `moe-node serve` of the same: decode at concurrency 1, 8, 64
#    and 256 (tokens/s, time to first token, time per token, bytes a step reads against the
#    copy bandwidth moe_layer_gpu measured on an H200, 4261 GB/s), then prefill of 4096
#    prompt tokens; once per layout, one after the other (two servers would share the GPUs'
#    memory): the dense part on GPU 0 alone (devices.dense_replicas = 1, the layout before
#    data-parallel attention) and a dense replica on every GPU (0), then each level's
#    tokens/s ratio every-GPU / GPU-0-alone. On one GPU both layouts are the same. Then the
#    every-GPU layout again with CUDA graphs off (devices.cuda_graphs = false), and each
#    level's ratio graphs on / off.
set -uo pipefail
out=${1:?usage: tests/gpu/serve.sh OUT}
layers=${LAYERS:-3}
bin=gpu-bin
mkdir -p "$out"
here=$(pwd)
src=$(cat "$bin/source-dir")
if [ "$src" != "$here" ] && [ ! -e "$src" ]; then
    mkdir -p "$(dirname "$src")" && ln -s "$here" "$src"
fi
mkdir -p target/release
cp "$bin/moe-node" target/release/moe-node
model=${MODEL:-benches/configs/kimi_k2}
# BACKEND=cpu tries the script on a machine without a GPU (with MODEL a small config).
backend=${BACKEND:-cuda}
gpu_flag=$([ "$backend" = cuda ] && echo "--gpu 0")
status=0

echo "=== generate, $model, dummy weights, $((layers > 2 ? 2 : layers)) layers, backend $backend"
timeout 150 env RUST_LOG=info "$bin/moe-node" generate --model $model --load-format dummy \
    --num-layers "$((layers > 2 ? 2 : layers))" $gpu_flag --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 8 --json \
    > "$out/generate.log" 2>&1 || status=1
grep -v last_logits "$out/generate.log" | tail -n 5
grep -o '"token_ids":\[[0-9,]*\]' "$out/generate.log"

# Layouts: dense replicas, CUDA graphs (the last with graphs off, for their ratio).
for layout in "1 true" "0 true" "0 false"; do
    read -r replicas graphs <<< "$layout"
    name=$replicas$([ "$graphs" = true ] || echo -nographs)
    echo "=== serve + load bench, devices.dense_replicas = $replicas, cuda_graphs = $graphs"
    MOE_NODE_DEVICES__BACKEND=$backend MOE_NODE_BATCHING__MAX_SEQUENCES=256 \
    MOE_NODE_DEVICES__DENSE_REPLICAS=$replicas MOE_NODE_DEVICES__CUDA_GRAPHS=$graphs \
    MOE_LOAD_MODEL=$model MOE_LOAD_SERVE_ARGS="--load-format dummy --num-layers $layers" \
    MOE_LOAD_SECONDS=${SECONDS_PER_LEVEL:-8} MOE_LOAD_LEVELS=${LEVELS:-1,8,64,256} \
    MOE_LOAD_MAX_TOKENS=32 MOE_LOAD_PREFILL_TOKENS=4096 MOE_LOAD_COPY_GBPS=4261 \
    MOE_LOAD_READY_SECONDS=300 MOE_LOAD_SERVER_LOG=1 \
        timeout "${BENCH_LIMIT:-420}" "$bin/load" > "$out/load-replicas-$name.log" 2>&1 \
        || status=1
    grep -v "^server: " "$out/load-replicas-$name.log" | tail -n 20
    grep "^server: " "$out/load-replicas-$name.log" | grep -i "loaded\|error\|warn" | tail -n 8
done
echo "=== tokens/s, a dense replica on every GPU / on GPU 0 alone"
# The table rows: concurrency, requests, tokens/s, ...
rows() { grep -E '^ +[0-9]+ +[0-9]+ +[0-9.]+ ' "$out/load-replicas-$1.log" | awk '{print $1, $3}'; }
join <(rows 0) <(rows 1) | awk '{printf "concurrency %s: %.1f / %.1f tokens/s = %.2fx\n", $1, $2, $3, ($3 > 0 ? $2 / $3 : 0)}'
echo "=== tokens/s, CUDA graphs on / off (a dense replica on every GPU)"
join <(rows 0) <(rows 0-nographs) | awk '{printf "concurrency %s: %.1f / %.1f tokens/s = %.2fx\n", $1, $2, $3, ($3 > 0 ? $2 / $3 : 0)}'
echo "=== overall: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
