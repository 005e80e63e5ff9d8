"""Quantize the benchmark's bf16 Qwen3-MoE to FP8 in the layout the Qwen3 "-FP8" releases publish,
for moe-node's side of the comparison with llama.cpp Q8_0:

- every projection of the decoder layers (attention q/k/v/o, the experts' gate/up/down) as
  `float8_e4m3fn`, with a `weight_scale_inv` (bf16) per [128, 128] block: the block's largest
  magnitude maps to 448, e4m3's largest finite value;
- the routers (`mlp.gate`), norms, embeddings and output head stay bf16;
- `quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
  weight_block_size: [128, 128]}` in config.json.

    python3 make_fp8.py BF16_MODEL_DIR FP8_MODEL_DIR

Tokenizer and generation files are copied. One tensor is quantized at a time.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from quantized_copy import write_model

BLOCK = 128
FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_projection(name):
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in PROJECTIONS


def quantize(weight):
    """(e4m3 weight, bf16 scale_inv [ceil(out/128), ceil(in/128)]) with weight ~ e4m3 x scale."""
    out, inp = weight.shape
    rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
    w = weight.float()
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[:out, :inp] = w
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    # The scale as stored (bf16) is the one the values are divided by, so that weight ~
    # stored x scale holds for the scale a loader reads.
    scale = (amax / FP8_MAX).to(torch.bfloat16)
    scaled = blocks / scale.float()[:, None, :, None]
    fp8 = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    fp8 = fp8.view(rows * BLOCK, cols * BLOCK)[:out, :inp].contiguous()
    return fp8, scale


def main():
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }
    tensors = {}
    quantized = 0
    with safe_open(src / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if is_projection(name):
                tensors[name], tensors[name + "_scale_inv"] = quantize(t)
                quantized += 1
            else:
                tensors[name] = t
    write_model(src, dst, tensors, cfg)
    print(f"make_fp8.py: {quantized} projections as e4m3 in [{BLOCK}, {BLOCK}] blocks -> {dst}")


if __name__ == "__main__":
    main()
