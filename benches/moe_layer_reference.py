#!/usr/bin/env python3
"""The reference side of benches/moe_layer.rs: transformers' DeepseekV3MoE block (the block
Kimi K2/K3 use) at the same shape, f32, timed for each experts implementation transformers
offers. Prints one JSON object per line: {"implementation", "tokens", "median_s"}.

Run by `cargo bench --bench moe_layer`; by hand:
    python3 benches/moe_layer_reference.py --threads 2 --tokens 1,16,256
"""
import argparse
import json
import statistics
import time

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--tokens", default="1,16,256")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--experts", type=int, default=896)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--seconds", type=float, default=3.0, help="time budget per point")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                   help="weights and activations (bf16 computes in bf16 too)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = DeepseekV3Config(hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                              n_routed_experts=args.experts, num_experts_per_tok=args.top_k,
                              n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
                              routed_scaling_factor=2.827)
    block = DeepseekV3MoE(config).float().eval()
    with torch.no_grad():
        for name, param in block.named_parameters():
            param.normal_(0.0, 0.02 if "gate.weight" not in name else 0.05)
    dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16
    # The router stays f32, as transformers keeps it (_keep_in_fp32_modules_strict).
    block.experts.to(dtype)
    block.shared_experts.to(dtype)

    for implementation in ("eager", "batched_mm", "grouped_mm"):
        config._experts_implementation = implementation
        for tokens in [int(t) for t in args.tokens.split(",")]:
            try:
                median = time_block(block, tokens, args.hidden, args.seconds, dtype)
            except Exception as e:  # an implementation this torch build lacks
                print(json.dumps({"implementation": implementation, "tokens": tokens,
                                  "error": str(e)[:200]}), flush=True)
                break
            print(json.dumps({"implementation": implementation, "tokens": tokens,
                              "median_s": median}), flush=True)


def time_block(block, tokens, hidden, budget, dtype):
    # Fresh inputs each iteration, so that each run routes to other experts and reads their
    # weights from memory, as decoding does.
    inputs = [torch.randn(1, tokens, hidden, dtype=dtype) for _ in range(64)]
    times = []
    start = time.perf_counter()
    with torch.inference_mode():
        block(inputs[0])
        i = 0
        while len(times) < 5 or (time.perf_counter() - start < budget and len(times) < 200):
            x = inputs[i % len(inputs)]
            t0 = time.perf_counter()
            block(x)
            times.append(time.perf_counter() - t0)
            i += 1
    return statistics.median(times)


if __name__ == "__main__":
    main()
