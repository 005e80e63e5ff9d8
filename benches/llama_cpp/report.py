"""Print the comparison table from client.py's results, and the bytes of weights each engine
reads per decode token.

    python3 report.py MODEL_DIR moe-node.json llama.cpp-BF16.json:GGUF [llama.cpp-Q8_0.json:GGUF ...]

Bytes per decode token (batch 1): every dense weight is read once per token (attention
q/k/v/o, the per-layer router, the output head, the norms), one row of the embedding, and the
top-k active experts of each layer (3 matrices of hidden x moe_intermediate each). moe-node
holds a bf16 checkpoint's dense and expert matrices in bf16 (2 bytes), norms in f32; for
llama.cpp the bytes come from the GGUF's own tensor types (a BF16 file keeps norms and, for
this architecture, the router in f32; Q8_0 is 34 bytes per 32 weights, ~1.06 per weight).
"""

import json
import re
import statistics
import sys


def moe_node_bytes(cfg, weight_bytes=2, norm_bytes=4):
    h = cfg["hidden_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * hd
    kv = cfg["num_key_value_heads"] * hd
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    k = cfg["num_experts_per_tok"]
    inter = cfg["moe_intermediate_size"]
    layers = cfg["num_hidden_layers"]
    vocab = cfg["vocab_size"]
    attn = h * q + 2 * h * kv + q * h
    router = h * experts
    active = k * 3 * h * inter
    norms = 2 * h + 2 * hd  # input/post-attention norms, q/k norms
    per_layer = (attn + router + active) * weight_bytes + norms * norm_bytes
    dense = layers * (attn + router) * weight_bytes + vocab * h * weight_bytes
    total = layers * per_layer + vocab * h * weight_bytes + h * weight_bytes + h * norm_bytes
    return {
        "total": total,
        "dense": dense,
        "experts": layers * active * weight_bytes,
        "formula": (
            f"{layers} layers x [attention {attn:,} + router {router:,} + {k} experts x 3 x "
            f"{h} x {inter} = {active:,}] x {weight_bytes} B + lm_head {vocab} x {h} x "
            f"{weight_bytes} B + norms x {norm_bytes} B + 1 embedding row"
        ),
    }


def gguf_bytes(path, cfg):
    """Bytes read per decode token from a GGUF: every tensor, but expert tensors scaled by
    k/experts and the token embedding by 1/vocab (one row)."""
    from gguf import GGUFReader

    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    k = cfg["num_experts_per_tok"]
    total = dense = exp = 0
    types = {}
    for t in GGUFReader(path).tensors:
        n = int(t.n_bytes)
        types.setdefault(t.tensor_type.name, 0)
        types[t.tensor_type.name] += 1
        if re.search(r"_exps\.weight$", t.name):
            part = n * k / experts
            exp += part
        elif t.name == "token_embd.weight":
            part = n / cfg["vocab_size"]
        else:
            part = n
            dense += n
        total += part
    return {"total": total, "dense": dense, "experts": exp, "types": types}


def main():
    model_dir = sys.argv[1]
    cfg = json.load(open(f"{model_dir}/config.json"))
    moe = json.load(open(sys.argv[2]))
    others = []
    for arg in sys.argv[3:]:
        path, gguf = arg.split(":", 1)
        others.append((json.load(open(path)), gguf))

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
    for other, _ in others:
        name = other["label"]
        print(f"{'':36} {'':6} {'moe-node':>10} {name:>16} {'moe-node / ' + name:>26}")
        for title, key in rows:
            for stat, f in (("median", statistics.median), ("best", max)):
                a, b = f(moe[key + "_all"]), f(other[key + "_all"])
                print(f"{title:36} {stat:6} {a:10.2f} {b:16.2f} {a / b:26.2f}")
        print()
    print("all repetitions (tok/s):")
    for r in [moe] + [o for o, _ in others]:
        print(f"  {r['label']:16} " + "; ".join(
            f"{key} " + ", ".join(f"{x:.1f}" for x in r[key + "_all"]) for _, key in rows))
    print()

    # Same greedy output? (bf16 rounding differs between the engines, so a late divergence is
    # expected; an early one would point at a wrong model.)
    for other, _ in others:
        a, b = moe["decode_text"], other["decode_text"]
        same = 0
        while same < min(len(a), len(b)) and a[same] == b[same]:
            same += 1
        print(f"greedy text of the first decode request, moe-node vs {other['label']}: "
              f"identical for the first {same} of {len(a)} / {len(b)} characters")
    print()

    m = moe_node_bytes(cfg)
    print("Weight bytes read per decode token (batch 1):")
    print(f"  moe-node (bf16 dense + experts): {m['total'] / 2**20:8.1f} MiB "
          f"(dense {m['dense'] / 2**20:.1f} MiB incl. lm_head, active experts "
          f"{m['experts'] / 2**20:.1f} MiB)")
    print(f"    = {m['formula']}")
    for other, gguf in others:
        g = gguf_bytes(gguf, cfg)
        print(f"  {other['label']:31}: {g['total'] / 2**20:8.1f} MiB "
              f"(dense {g['dense'] / 2**20:.1f} MiB, active experts {g['experts'] / 2**20:.1f} MiB;"
              f" tensor types {g['types']})")
    print()
    print("Decode bandwidth implied (bytes per token x decode tok/s, median / best):")
    bw = lambda b, r: f"{b * statistics.median(r['decode_all']) / 1e9:.2f} / {b * max(r['decode_all']) / 1e9:.2f} GB/s"
    print(f"  moe-node: {bw(m['total'], moe)}")
    for other, gguf in others:
        g = gguf_bytes(gguf, cfg)
        print(f"  {other['label']}: {bw(g['total'], other)}")


if __name__ == "__main__":
    main()
