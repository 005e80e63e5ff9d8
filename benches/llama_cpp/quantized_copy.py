"""What make_fp8.py and make_int4.py share: writing a quantized copy of the bench model."""

import json
import shutil

from safetensors.torch import save_file


def write_model(src, dst, tensors, cfg):
    """`tensors` as dst/model.safetensors (written aside, then renamed), `cfg` as its
    config.json, and the tokenizer and generation files copied from `src`."""
    save_file(tensors, str(dst / "model.safetensors.part"), metadata={"format": "pt"})
    (dst / "model.safetensors.part").rename(dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
