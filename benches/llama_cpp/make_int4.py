"""Quantize the benchmark's bf16 Qwen3-MoE to INT4 in the compressed-tensors `pack-quantized`
format Kimi K2 Thinking publishes, for moe-node's side of the comparison with llama.cpp Q4_K_M:

- symmetric 4-bit integers in groups of 32 along the input (`weight_packed` int32 holding 8
  values each, `weight_scale` bf16 per group, `weight_shape`), quantized and packed by the
  `compressed-tensors` package itself;
- LAYOUT `experts` (as published): the routed experts only; attention, routers, norms,
  embeddings and the output head stay bf16;
- LAYOUT `all`: every projection of the decoder layers (attention too); routers, norms,
  embeddings and the output head stay bf16. Closer to Q4_K_M's bytes per token, which also
  quantizes attention (and the head, which no published INT4 checkpoint does);
- LAYOUT `head`: `all` and the output head too, for a comparison at fewer bytes per token
  than Q4_K_M (whose head is Q6_K).

    python3 make_int4.py BF16_MODEL_DIR INT4_MODEL_DIR experts|all|head

Tokenizer and generation files are copied. One tensor is quantized at a time.
"""

import json
import sys
from pathlib import Path

from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                             QuantizationScheme)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open

from quantized_copy import write_model

GROUP = 32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# compressed-tensors targets nn.Linear: the routers (`mlp.gate`) and the head are Linear too,
# so the ignore list names them, as published configs do.
IGNORE = {
    "experts": ["lm_head", "re:.*mlp\\.gate$", "re:.*self_attn.*"],
    "all": ["lm_head", "re:.*mlp\\.gate$"],
    "head": ["re:.*mlp\\.gate$"],
}


def quantized(name, layout):
    if name == "lm_head.weight":
        return layout == "head"
    parts = name.split(".")
    if not (name.startswith("model.layers.") and parts[-1] == "weight"
            and parts[-2] in PROJECTIONS):
        return False
    return layout != "experts" or ".mlp.experts." in name


def main():
    src, dst, layout = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if layout not in IGNORE:
        sys.exit(f"make_int4.py: layout must be one of {sorted(IGNORE)}, not {layout!r}")
    dst.mkdir(parents=True, exist_ok=True)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=GROUP)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                ignore=IGNORE[layout], quantization_status="compressed")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = config.model_dump()
    tensors = {}
    count = 0
    with safe_open(src / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if not quantized(name, layout):
                tensors[name] = t
                continue
            rows, cols = t.shape
            groups = t.view(rows, cols // GROUP, GROUP)
            scale, zero_point = calculate_qparams(groups.amin(dim=2), groups.amax(dim=2), args)
            compressed = PackedQuantizationCompressor.compress(
                {"weight": t, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
            module = name[: -len(".weight")]
            for key, value in compressed.items():
                tensors[f"{module}.{key}"] = value.contiguous()
            count += 1
    write_model(src, dst, tensors, cfg)
    print(f"make_int4.py: {count} projections ({layout}) as 4-bit groups of {GROUP} -> {dst}")


if __name__ == "__main__":
    main()
