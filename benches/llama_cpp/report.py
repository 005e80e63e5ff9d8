"""Print the comparison table from client.py's results, and the bytes of weights each engine
reads per decode token.

    python3 report.py --moe bf16 MODEL_DIR JSONS [--moe fp8 FP8_DIR JSONS] \
                      --llama bf16 GGUF JSONS [--llama q8_0 GGUF JSONS ...]

JSONS: one server's client.py results, one file per round, comma-separated. Each llama.cpp
quantization is set beside the moe-node formats of about the same size: BF16 beside bf16, Q8_0
beside fp8, Q4_K_M beside int4, int4all and int4head (bf16 when moe-node ran none of them).

Bytes per decode token (batch 1): every tensor is read once per token (attention q/k/v/o, the
per-layer router, the output head, the norms, FP8 block scales), but the token embedding only
one row and the expert tensors only top-k of every layer's experts. For moe-node they come from
the safetensors header (it holds bf16 as bf16 and FP8 as FP8; norms, a few KiB, are counted as
stored though it widens them to f32); for llama.cpp from the GGUF's own tensor types (a BF16 file
keeps norms and, for this architecture, the router in f32; Q8_0 is 34 bytes per 32 weights).
"""


import json
import re
import statistics
import sys


# The moe-node formats each llama.cpp quantization is compared with.
PAIR = {"bf16": ["bf16", "bf16native"], "q8_0": ["fp8"], "q4_k_m": ["int4", "int4all", "int4head"],
        "q4_k_s": ["int4", "int4all", "int4head"]}


def per_token_bytes(tensors, cfg, is_expert, embedding):
    """Bytes read per decode token from `(name, bytes, type)` tensors: every tensor, but the
    expert tensors scaled by k/experts and the token embedding by 1/vocab (one row)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    k = cfg["num_experts_per_tok"]
    total = dense = exp = 0
    types = {}
    for name, size, kind in tensors:
        types[kind] = types.get(kind, 0) + 1
        if is_expert(name):
            part = size * k / experts
            exp += part
        elif name == embedding:
            part = size / cfg["vocab_size"]
        else:
            part = size
            dense += size
        total += part
    return {"total": total, "dense": dense, "experts": exp, "types": types}


def safetensors_bytes(model_dir, cfg):
    """Bytes read per decode token from a safetensors checkpoint (its files' headers)."""
    import struct
    from pathlib import Path

    def tensors():
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for name, t in header.items():
                if name != "__metadata__":
                    start, end = t["data_offsets"]
                    yield name, end - start, t["dtype"]

    return per_token_bytes(tensors(), cfg, lambda name: ".mlp.experts." in name,
                           "model.embed_tokens.weight")


def gguf_bytes(path, cfg):
    """Bytes read per decode token from a GGUF (its tensors' own types)."""
    from gguf import GGUFReader

    tensors = ((t.name, int(t.n_bytes), t.tensor_type.name) for t in GGUFReader(path).tensors)
    return per_token_bytes(tensors, cfg, lambda name: re.search(r"_exps\.weight$", name),
                           "token_embd.weight")


def load_rounds(paths):
    """One server's client.py results from one or more rounds (comma-separated paths): the
    repetitions of every round together, the first round's text."""
    runs = [json.load(open(p)) for p in paths.split(",")]
    merged = dict(runs[0])
    for key in ("decode_all", "prefill_all", "batch_all"):
        merged[key] = [x for r in runs for x in r[key]]
    merged["rounds"] = len(runs)
    return merged


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--moe", nargs=3, action="append", required=True,
                    metavar=("FORMAT", "MODEL_DIR", "JSONS"))
    ap.add_argument("--llama", nargs=3, action="append", default=[],
                    metavar=("QUANT", "GGUF", "JSONS"))
    args = ap.parse_args()
    moe = {}
    for fmt, model_dir, jsons in args.moe:
        r = load_rounds(jsons)
        r["label"] = {"bf16": "moe-node", "bf16native": "moe-node bf16x"}.get(fmt, f"moe-node {fmt.upper()}")
        moe[fmt] = (r, model_dir)
    cfg = json.load(open(f"{moe['bf16' if 'bf16' in moe else next(iter(moe))][1]}/config.json"))
    for fmt, (r, model_dir) in moe.items():
        r["bytes"] = safetensors_bytes(model_dir, cfg)
    pairs = []
    for quant, gguf, jsons in args.llama:
        other = load_rounds(jsons)
        other["bytes"] = gguf_bytes(gguf, cfg)
        mine = [moe[f][0] for f in PAIR.get(quant, ["bf16"]) if f in moe] or [moe.get("bf16", next(iter(moe.values())))[0]]
        pairs.extend((m, other) for m in mine)

    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    print()
    print(f"Model: Qwen3-MoE, random bf16 weights, hidden {cfg['hidden_size']}, "
          f"{cfg['num_hidden_layers']} layers, {experts} experts top-{cfg['num_experts_per_tok']}"
          f" of {cfg['moe_intermediate_size']}, vocab {cfg['vocab_size']}")
    print()
    rows = [
        ("decode, batch 1 (tok/s)", "decode"),
        ("prefill, 512-token prompt (tok/s)", "prefill"),
        ("8 concurrent x 64 tokens (tok/s)", "batch"),
    ]
    for mine, other in pairs:
        a_name, b_name = mine["label"], other["label"]
        print(f"{'':36} {'':6} {a_name:>14} {b_name:>16} {a_name + ' / ' + b_name:>32}")
        for title, key in rows:
            for stat, f in (("median", statistics.median), ("best", max)):
                a, b = f(mine[key + "_all"]), f(other[key + "_all"])
                print(f"{title:36} {stat:6} {a:14.2f} {b:16.2f} {a / b:32.2f}")
        ba, bb = mine["bytes"]["total"], other["bytes"]["total"]
        print(f"{'weight bytes per decode token (MiB)':36} {'':6} {ba / 2**20:14.1f} "
              f"{bb / 2**20:16.1f} {ba / bb:32.2f}")
        print()
    servers = [r for r, _ in moe.values()]
    servers += [o for i, (_, o) in enumerate(pairs) if all(o is not p for _, p in pairs[:i])]
    rounds = servers[0]["rounds"]
    print(f"all repetitions (tok/s), {rounds} round(s), each server in turn:")
    for r in servers:
        print(f"  {r['label']:16} " + "; ".join(
            f"{key} " + ", ".join(f"{x:.1f}" for x in r[key + "_all"]) for _, key in rows))
    print()

    # Same greedy output? (bf16 rounding differs between the engines, so a late divergence is
    # expected; an early one would point at a wrong model.)
    for mine, other in pairs:
        a, b = mine["decode_text"], other["decode_text"]
        same = 0
        while same < min(len(a), len(b)) and a[same] == b[same]:
            same += 1
        print(f"greedy text of the first decode request, {mine['label']} vs {other['label']}: "
              f"identical for the first {same} of {len(a)} / {len(b)} characters")
    print()

    print("Weight bytes read per decode token (batch 1):")
    for r in servers:
        g = r["bytes"]
        print(f"  {r['label']:16}: {g['total'] / 2**20:8.1f} MiB (dense {g['dense'] / 2**20:.1f} MiB"
              f" incl. the output head, active experts {g['experts'] / 2**20:.1f} MiB; "
              f"tensor types {g['types']})")
    print()
    print("Decode bandwidth implied (bytes per token x decode tok/s, median / best):")
    for r in servers:
        b = r["bytes"]["total"]
        print(f"  {r['label']:16}: {b * statistics.median(r['decode_all']) / 1e9:.2f} / "
              f"{b * max(r['decode_all']) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
