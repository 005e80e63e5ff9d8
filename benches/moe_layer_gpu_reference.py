"""The reference side of benches/moe_layer_gpu.rs: the same MoE layer (Kimi shapes, bf16, no
shared expert) in Hugging Face transformers on the same GPU, with its experts run as written
("eager": one expert at a time) and through torch's grouped matmul ("grouped_mm", where this
torch has it). Reads the Rust benchmark's JSON lines and prints both side by side with ratios.

    python3 benches/moe_layer_gpu_reference.py RUST.jsonl [--out TORCH.jsonl]
    python3 benches/moe_layer_gpu_reference.py --smoke      # tiny shapes on the CPU

Ratios are torch time / moe-node time (its faster path at each size): above 1, moe-node is
faster.
"""

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE


def block(experts, top_k, hidden, intermediate, device):
    config = DeepseekV3Config(
        hidden_size=hidden,
        moe_intermediate_size=intermediate,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.827,
        n_shared_experts=1,
    )
    torch.manual_seed(0)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            moe = DeepseekV3MoE(config)
        finally:
            torch.set_default_dtype(previous)
    scale = hidden**-0.5
    with torch.no_grad():
        for p in moe.parameters():
            p.uniform_(-scale, scale)
    # moe-node's layer has no shared expert: leave it out here too.
    del moe.shared_experts
    moe.shared_experts = lambda x: 0
    return moe.eval()


def timed(fn, device, budget_s=1.5, max_iters=50):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    times, started = [], time.perf_counter()
    while len(times) < 5 or (len(times) < max_iters and time.perf_counter() - started < budget_s):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def implementations(moe):
    """The experts implementations this transformers offers: older ones (a ModuleList of
    experts) have only their loop."""
    switchable = hasattr(getattr(moe.experts, "config", None), "_experts_implementation")
    yield "eager"
    if switchable and hasattr(torch, "_grouped_mm"):
        yield "grouped_mm"


def run(shapes, device, hidden, intermediate, out):
    results = []
    for name, experts, top_k, token_counts in shapes:
        moe = block(experts, top_k, hidden, intermediate, device)
        x_all = torch.empty(max(token_counts), hidden, dtype=torch.bfloat16, device=device)
        x_all.uniform_(-1, 1)
        for impl in implementations(moe):
            if hasattr(getattr(moe.experts, "config", None), "_experts_implementation"):
                moe.experts.config._experts_implementation = impl
            for tokens in token_counts:
                x = x_all[:tokens].unsqueeze(0)
                try:
                    with torch.no_grad():
                        seconds = timed(lambda: moe(x), device)
                except Exception as e:  # an implementation this torch or device lacks
                    print(f"{name} {impl} {tokens}: not run ({type(e).__name__}: {e})", file=sys.stderr)
                    break
                row = {"kind": "torch", "shape": name, "impl": impl, "tokens": tokens, "seconds": seconds}
                results.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
        del moe, x_all
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("rust", nargs="?", help="JSON lines written by benches/moe_layer_gpu.rs")
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    out = open(args.out, "w") if args.out else None

    if args.smoke:
        results = run([("tiny", 16, 4, [1, 8])], "cpu", 64, 32, out)
        for r in results:
            print(f"{r['shape']} {r['impl']:>10} {r['tokens']:>5} tokens: {r['seconds'] * 1e3:.3f} ms")
        return

    rust = [json.loads(line) for line in open(args.rust)]
    layers = [r for r in rust if r["kind"] == "layer"]
    shapes = []
    for name in dict.fromkeys(r["shape"] for r in layers):
        rows = [r for r in layers if r["shape"] == name]
        shapes.append((name, rows[0]["experts"], rows[0]["top_k"], [r["tokens"] for r in rows]))
    print(f"torch {torch.__version__}, transformers DeepseekV3MoE, {torch.cuda.get_device_name()}")
    results = run(shapes, "cuda", 7168, 2048, out)
    torch_time = {(r["shape"], r["impl"], r["tokens"]): r["seconds"] for r in results}

    print(f"\n{'shape':>5} {'tokens':>6} {'moe-node ms':>12} {'eager ms':>10} {'ratio':>7} {'grouped_mm ms':>14} {'ratio':>7}")
    for r in layers:
        # moe-node's faster path at this size: cuBLAS grouped GEMM, or the GEMV kernel.
        ours = min(r["seconds"], r.get("gemv_seconds") or float("inf"))
        cells = []
        for impl in ("eager", "grouped_mm"):
            t = torch_time.get((r["shape"], impl, r["tokens"]))
            cells.append(f"{t * 1e3:>10.3f} {t / ours:>6.2f}x" if t else f"{'-':>10} {'-':>7}")
        print(f"{r['shape']:>5} {r['tokens']:>6} {ours * 1e3:>12.3f} {cells[0]} {cells[1]:>22}")


if __name__ == "__main__":
    main()
