#!/usr/bin/env bash
# The GPU checks and the GPU benchmark, on a machine with an NVIDIA GPU, from the repository
# root, on binaries built elsewhere by tests/gpu/build.sh (in gpu-bin/). Writes every log and
# the benchmark's results under OUT; prints a summary. Exits non-zero when a check fails.
#
#   tests/gpu/run.sh OUT
#
# What runs (in this order, each with a time limit; the whole takes a few minutes):
#   1. nvidia-smi; `moe-node devices` (libraries loaded, GPUs, kernels compiled by NVRTC);
#      generate --gpu 0 on a fixture, with the whole model on the GPU and with only the
#      experts there;
#   2. tests/gpu_kernels.rs: the MoE layer and the dense kernels on the GPU against the CPU;
#      tests/gpu_served.rs: MoE rows kept on the GPU against routing on the host;
#      tests/gpu_hybrid.rs: a hybrid model's linear-attention states paged on the GPU;
#      tests/gpu_graphs.rs: decode steps replayed from CUDA graphs against kernel by kernel;
#   3. tests/reference.rs: every fixture on the CPU (against transformers) and on the GPU
#      against the CPU: experts on the GPU (same greedy tokens, logits within the bf16
#      tolerance), then the whole model (logits after the prompt within the bf16 tolerance
#      of the dense part; decoding through the GPU's KV cache equal to one prefill);
#   4. tests/server.rs: the node's HTTP tests, whose devices are now the GPU;
#   5. benches/moe_layer_gpu.rs (bf16 experts, then FP8 and INT4 held as stored), then
#      benches/moe_layer_gpu_reference.py (transformers on the same GPU), side by side;
#   6. benches/engine_step.rs with the whole of a Qwen3.5-shaped model on the GPU.
set -uo pipefail
out=${1:?usage: tests/gpu/run.sh OUT}
bin=gpu-bin
mkdir -p "$out"
here=$(pwd)

# Paths compiled into the test binaries point into the build machine's checkout: make that
# path lead here, and put moe-node where the server tests look for it.
src=$(cat "$bin/source-dir")
if [ "$src" != "$here" ]; then
    if [ -e "$src" ] && [ "$(cd "$src" && pwd -P)" != "$(pwd -P)" ]; then
        echo "warning: $src exists and is not this checkout; fixture paths may be wrong" >&2
    elif [ ! -e "$src" ]; then
        mkdir -p "$(dirname "$src")" && ln -s "$here" "$src"
    fi
fi
mkdir -p target/release target/tmp
cp "$bin/moe-node" target/release/moe-node

# Here a missing GPU is a failure, not a skip.
export MOE_TEST_REQUIRE_GPU=1
status=0
step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name"
    local started=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-25}" "$out/$name.log"
    echo "=== $name: exit $rc in $((SECONDS - started)) s"
    [ "$rc" -eq 0 ] || status=1
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1 && head -n 12 "$out/nvidia-smi.txt"
step devices 120 env MOE_NODE_DEVICES__BACKEND=cuda "$bin/moe-node" devices
step generate-gpu 120 env RUST_LOG=info "$bin/moe-node" generate --model tests/fixtures/kimi_k2 \
    --prompt-ids 1,2,3,4 --max-tokens 8 --gpu 0 --json
step generate-gpu-experts 120 env RUST_LOG=info "$bin/moe-node" generate \
    --model tests/fixtures/kimi_k2 --prompt-ids 1,2,3,4 --max-tokens 8 --gpu 0 --dense-on-cpu --json
step gpu-kernel-tests 180 "$bin/gpu_kernels" --test-threads=1 --nocapture
step gpu-served-tests 120 "$bin/gpu_served" --nocapture
step gpu-hybrid-tests 120 "$bin/gpu_hybrid" --nocapture
step gpu-graph-tests 120 "$bin/gpu_graphs" --nocapture
step reference-tests 180 "$bin/reference" --test-threads=1 --nocapture
step server-tests 240 "$bin/server" --test-threads=2
TAIL=40 step bench 300 env MOE_GPU_BENCH_FORMATS=bf16 MOE_GPU_BENCH_OUT="$out/moe_layer_gpu.jsonl" \
    "$bin/moe_layer_gpu"
# FP8 and INT4 experts held as stored (issue 16), at the K3 shape.
TAIL=40 step bench-quantized 240 env MOE_GPU_BENCH_FORMATS=fp8,int4 MOE_GPU_BENCH_SHAPES=k3 \
    MOE_GPU_BENCH_TOKENS=1,16,256 MOE_GPU_BENCH_OUT="$out/moe_layer_gpu_quantized.jsonl" \
    "$bin/moe_layer_gpu"
TAIL=40 step torch-reference 300 python3 benches/moe_layer_gpu_reference.py \
    "$out/moe_layer_gpu.jsonl" --out "$out/torch.jsonl"
# The hybrid models' gated DeltaNet on the GPU, on Qwen3.5-35B-A3B's dense shapes (random
# weights: needs torch and transformers here).
if python3 -c "import transformers" 2> /dev/null; then
    TAIL=20 step hybrid-model 300 python3 benches/random_qwen3_5_moe.py /tmp/qwen35moe
    TAIL=20 step hybrid-step 300 env MOE_STEP_GPU=0 MOE_STEP_MODEL=/tmp/qwen35moe \
        MOE_STEP_PREFILL=64,512 MOE_STEP_ITERS=50 "$bin/engine_step"
fi
echo "=== overall: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
