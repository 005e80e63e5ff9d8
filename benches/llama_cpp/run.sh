#!/usr/bin/env bash
# moe-node serve vs llama.cpp's llama-server on the same random-weight Qwen3-MoE (issue 17).
#
#   benches/llama_cpp/run.sh            # everything under /tmp/llama_bench (LLAMA_BENCH_DIR)
#
# Steps (each skipped when its output exists): install cmake/g++ and the converter's Python
# packages; download llama-cpp-python's sdist from PyPI (llama.cpp is vendored in it) and build
# llama-server; make the model (random bf16 weights, transformers) and a trained 32k byte-level
# BPE tokenizer; convert it to GGUF (BF16, and Q8_0 unless QUANTS says otherwise; Q4_K_M and
# other k-quants through llama-quantize from the BF16 file); build moe-node (target/release/moe-node, reused if present). Then each server is started alone,
# timed by client.py, and stopped, one after the other, ROUNDS times over; report.py prints the table.
#
# Environment: LLAMA_BENCH_DIR (/tmp/llama_bench), EXPERTS (128), QUANTS ("bf16 q8_0"),
# MOE_FORMATS ("bf16 bf16native fp8": moe-node on the bf16 model, exact and with
# devices.cpu_precision = "bf16" (bf16native: inputs rounded, AVX512_BF16 products), and on
# its FP8 copy, make_fp8.py; also
# int4 and int4all: compressed-tensors INT4 copies, experts only as Kimi K2 Thinking publishes
# them, attention too, or attention and the output head too (int4head), make_int4.py; e.g.
# QUANTS="q4_k_m" MOE_FORMATS="int4 int4all int4head"),
# THREADS (2), ROUNDS (2), LLAMA_CPP_PYTHON_VERSION (0.3.36), MOE_NODE_PORT (18080), LLAMA_PORT (18081),
# SETUP_ONLY (1: stop after steps 1-4, before building moe-node and the timed runs; for preparing
# beside other work, then timing on a quiet machine).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
WORK="${LLAMA_BENCH_DIR:-/tmp/llama_bench}"
EXPERTS="${EXPERTS:-128}"
QUANTS="${QUANTS:-bf16 q8_0}"
MOE_FORMATS="${MOE_FORMATS:-bf16 bf16native fp8}"
THREADS="${THREADS:-2}"
ROUNDS="${ROUNDS:-2}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
MOE_PORT="${MOE_NODE_PORT:-18080}"
LLAMA_PORT="${LLAMA_PORT:-18081}"
READY_TIMEOUT=300
MODEL="$WORK/model"

die() { echo "run.sh: error: $*" >&2; exit 1; }
log() { echo "== $*"; }
mkdir -p "$WORK"

SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT INT TERM

# wait_ready URL LOG [may-exit]: until URL answers 200, the server dies, or READY_TIMEOUT passes.
# With may-exit, a server that died returns 1 instead of ending the run.
wait_ready() {
    local url="$1" logfile="$2" start=$SECONDS
    while true; do
        if [[ "$(curl -s -o /dev/null -w '%{http_code}' "$url" || true)" == 200 ]]; then
            return 0
        fi
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            [[ "${3:-}" == may-exit ]] && { wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""; return 1; }
            tail -20 "$logfile" >&2; die "server exited before $url answered 200 (log: $logfile)"
        fi
        (( SECONDS - start < READY_TIMEOUT )) || { tail -20 "$logfile" >&2; die "$url not ready after ${READY_TIMEOUT}s (log: $logfile)"; }
        sleep 1
    done
}

# --- 1. Tools -------------------------------------------------------------------------------
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
    log "installing cmake g++"
    apt-get install -y cmake g++ || { apt-get update && apt-get install -y cmake g++; }
fi
python3 -c "import gguf, numpy, sentencepiece, google.protobuf, tokenizers, transformers, torch, yaml" 2>/dev/null || {
    log "installing Python packages"
    pip install gguf numpy sentencepiece protobuf tokenizers pyyaml torch transformers
}

# --- 2. llama.cpp from llama-cpp-python's sdist ---------------------------------------------
SRC="$WORK/llama_cpp_python-$VERSION"
LLAMA="$SRC/vendor/llama.cpp"
if [[ ! -d "$LLAMA" ]]; then
    log "downloading llama-cpp-python $VERSION sdist"
    mkdir -p "$WORK/sdist"
    # --no-binary for this package only: with :all: pip would also build its build
    # dependencies (cmake, ninja) from source just to read the metadata.
    pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$WORK/sdist" \
        || die "llama-cpp-python==$VERSION not downloadable (set LLAMA_CPP_PYTHON_VERSION)"
    tar xzf "$WORK/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
fi
[[ -f "$LLAMA/CMakeLists.txt" ]] || die "no vendored llama.cpp in $SRC"
LLAMA_COMMIT="$(grep -m1 -o 'llama.cpp@[0-9a-f]*' "$SRC/CHANGELOG.md" || echo unknown)"
LLAMA_SERVER="$WORK/build/bin/llama-server"
if [[ ! -x "$LLAMA_SERVER" ]]; then
    log "building llama-server (2 cores: ~30-40 min)"
    cmake -S "$LLAMA" -B "$WORK/build" -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF
    cmake --build "$WORK/build" -j2 --target llama-server
fi
[[ -x "$LLAMA_SERVER" ]] || die "llama-server did not build"
LLAMA_QUANTIZE="$WORK/build/bin/llama-quantize"
if [[ " $QUANTS " == *" q"*"_k"* && ! -x "$LLAMA_QUANTIZE" ]]; then
    log "building llama-quantize"
    cmake --build "$WORK/build" -j2 --target llama-quantize
fi

# --- 3. The model ---------------------------------------------------------------------------
if [[ ! -f "$MODEL/model.safetensors" && ! -f "$MODEL/model.safetensors.index.json" ]]; then
    log "making the model ($EXPERTS experts)"
    python3 "$REPO/benches/random_qwen3_moe.py" "$MODEL" "$EXPERTS"
fi
if [[ ! -f "$MODEL/tokenizer.json" ]]; then
    log "training the tokenizer"
    python3 "$HERE/make_tokenizer.py" "$MODEL" 32000
fi

# --- 4. GGUF --------------------------------------------------------------------------------
# The converter does not know the fresh tokenizer's pre-tokenizer hash: patch_converter.py
# copies it to $WORK/convert with unknown hashes mapped to "gpt-2" (ByteLevel's regex).
python3 "$HERE/patch_converter.py" "$LLAMA" "$WORK/convert"
export PYTHONPATH="$LLAMA/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
gguf() {  # gguf QUANT: convert_hf_to_gguf.py writes f32/bf16/q8_0; k-quants come from BF16
    local q="$1" out="$WORK/model-$1.gguf"
    [[ -f "$out" ]] && return
    case "$q" in
        q*_k*)
            gguf bf16
            log "quantizing the BF16 GGUF to $q (llama-quantize)"
            "$LLAMA_QUANTIZE" "$WORK/model-bf16.gguf" "$out.part" "$(echo "$q" | tr a-z A-Z)" "$THREADS" ;;
        *)
            log "converting to GGUF $q"
            python3 "$WORK/convert/convert_hf_to_gguf.py" "$MODEL" --outtype "$q" --outfile "$out.part" ;;
    esac
    mv "$out.part" "$out"
}
for q in $QUANTS; do gguf "$q"; done

if [[ " $MOE_FORMATS " == *" fp8 "* && ! -f "$WORK/model-fp8/model.safetensors" ]]; then
    log "quantizing the model to FP8 (the Qwen3 -FP8 layout)"
    python3 "$HERE/make_fp8.py" "$MODEL" "$WORK/model-fp8"
fi
for layout in experts all head; do
    f=int4; [[ $layout == all ]] && f=int4all; [[ $layout == head ]] && f=int4head
    if [[ " $MOE_FORMATS " == *" $f "* && ! -f "$WORK/model-$f/model.safetensors" ]]; then
        python3 -c "import compressed_tensors" 2>/dev/null || pip install compressed-tensors
        log "quantizing the model to INT4 ($layout; compressed-tensors pack-quantized)"
        python3 "$HERE/make_int4.py" "$MODEL" "$WORK/model-$f" "$layout"
    fi
done
moe_model() { if [[ "$1" == bf16 || "$1" == bf16native ]]; then echo "$MODEL"; else echo "$WORK/model-$1"; fi; }
# The arithmetic of the CPU products: bf16native asks for native bf16 (issue 53).
moe_precision() { if [[ "$1" == bf16native ]]; then echo bf16; else echo exact; fi; }
if [[ "${SETUP_ONLY:-0}" == 1 ]]; then
    log "SETUP_ONLY=1: llama.cpp, the model and its GGUF and quantized copies are ready under $WORK"
    exit 0
fi

# --- 5. moe-node ----------------------------------------------------------------------------
MOE_NODE="$REPO/target/release/moe-node"
if [[ ! -x "$MOE_NODE" ]]; then
    log "building moe-node"
    (cd "$REPO" && cargo build --release --bin moe-node)
fi

# --- 6. The runs, one server at a time ------------------------------------------------------
RES="$WORK/results"
mkdir -p "$RES"
log "command: benches/llama_cpp/run.sh (EXPERTS=$EXPERTS QUANTS=\"$QUANTS\" MOE_FORMATS=\"$MOE_FORMATS\" THREADS=$THREADS ROUNDS=$ROUNDS)"
log "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
log "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB"
log "llama.cpp: llama-cpp-python $VERSION sdist, $LLAMA_COMMIT; $("$LLAMA_SERVER" --version 2>&1 | grep -m1 version || true)"
log "moe-node: $MOE_NODE built $(date -u -r "$MOE_NODE" '+%Y-%m-%d %H:%M:%S UTC'), repository at $(cd "$REPO" && git rev-parse --short HEAD)"

# The machine may be shared: say how busy it was before each server's run.
busy() { echo "load average $(cut -d' ' -f1-3 /proc/loadavg); other processes on the CPUs: $(ps -eo pcpu=,comm= --sort=-pcpu | awk '$1 > 20 {printf "%s(%s%%) ", $2, $1}')"; }
# ROUNDS rounds, each every server in turn, so a change in the machine's load reaches both
# sides; report.py takes the medians over all rounds' repetitions.
run_moe_node() {  # run_moe_node FORMAT ROUND
    log "moe-node serve $1, round $2; $(busy)"
    MOE_NODE_DEVICES__CPU_PRECISION="$(moe_precision "$1")" RUST_LOG=warn "$MOE_NODE" serve --listen "127.0.0.1:$MOE_PORT" --model "$(moe_model "$1")" > "$RES/moe-node-$1.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "http://127.0.0.1:$MOE_PORT/ready" "$RES/moe-node-$1.log"
    python3 "$HERE/client.py" --url "http://127.0.0.1:$MOE_PORT" --label "moe-node $1" --out "$RES/moe-node-$1.$2.json"
    stop_server
}
start_llama() {  # start_llama QUANT [ARGS...]
    local q="$1"
    shift
    # -np 8: 8 slots decode concurrently; --kv-unified: the slots share the 4096 context
    # (without it each slot gets 4096/8 = 512, too small for the 512-token prefill).
    "$LLAMA_SERVER" -m "$WORK/model-$q.gguf" -t "$THREADS" -tb "$THREADS" -c 4096 -np 8 --kv-unified \
        --host 127.0.0.1 --port "$LLAMA_PORT" "$@" > "$RES/llama-$q.log" 2>&1 &
    SERVER_PID=$!
}
run_llama() {  # run_llama QUANT ROUND
    local q="$1" Q
    Q="$(echo "$q" | tr a-z A-Z)"
    log "llama-server $Q, round $2; $(busy)"
    start_llama "$q"
    if ! wait_ready "http://127.0.0.1:$LLAMA_PORT/health" "$RES/llama-$q.log" may-exit; then
        # On the AMX Xeon of run 9, llama-server dies loading Q8_0 (SIGSEGV, "trap invalid
        # opcode in libggml-cpu.so": the repacking into its AMX-INT8 layout). Without the
        # repacking it runs its AVX-512 (VNNI) Q8_0 kernels.
        log "llama-server $Q exited while loading ($(dmesg 2>/dev/null | grep -c 'libggml-cpu' || true) ggml traps in dmesg); again with --no-repack"
        start_llama "$q" --no-repack
        wait_ready "http://127.0.0.1:$LLAMA_PORT/health" "$RES/llama-$q.log"
    fi
    python3 "$HERE/client.py" --url "http://127.0.0.1:$LLAMA_PORT" --label "llama.cpp $Q" --out "$RES/llama-$q.$2.json"
    stop_server
}
rm -f "$RES"/moe-node*.json "$RES"/llama-*.json
for round in $(seq "$ROUNDS"); do
    for f in $MOE_FORMATS; do run_moe_node "$f" "$round"; done
    for q in $QUANTS; do run_llama "$q" "$round"; done
done

# Each server's rounds as one comma-separated list.
join() { local IFS=,; echo "$*"; }
REPORT_ARGS=()
for f in $MOE_FORMATS; do
    REPORT_ARGS+=(--moe "$f" "$(moe_model "$f")" "$(join "$RES"/moe-node-$f.*.json)")
done
for q in $QUANTS; do
    REPORT_ARGS+=(--llama "$q" "$WORK/model-$q.gguf" "$(join "$RES"/llama-$q.*.json)")
done
python3 "$HERE/report.py" "${REPORT_ARGS[@]}"
