"""Train a byte-level BPE tokenizer of 32000 ids (offline, on the Python standard library's
sources) and save it next to a model as tokenizer.json + tokenizer_config.json that
transformers' AutoTokenizer (and so llama.cpp's convert_hf_to_gguf.py) can load.

    python3 make_tokenizer.py OUT_DIR [vocab_size]
"""

import json
import os
import sys
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

out = sys.argv[1]
vocab_size = int(sys.argv[2]) if len(sys.argv) > 2 else 32000
EOS = "<|endoftext|>"


def corpus(limit=12 * 1024 * 1024):
    """Up to `limit` bytes of the standard library's .py files, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            seen += len(text)
            yield text
            if seen >= limit:
                return


tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=[EOS],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tok.train_from_iterator(corpus(), trainer=trainer)
size = tok.get_vocab_size()
assert size <= vocab_size, (size, vocab_size)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
fast.save_pretrained(out)
# The model's config names the same end-of-sequence id (random_qwen3_moe.py leaves it unset).
eos_id = tok.token_to_id(EOS)
for name in ("config.json", "generation_config.json"):
    path = os.path.join(out, name)
    if os.path.exists(path):
        with open(path) as f:
            cfg = json.load(f)
        cfg["eos_token_id"] = eos_id
        if name == "config.json":
            assert cfg["vocab_size"] >= size, (cfg["vocab_size"], size)
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
print(f"tokenizer: {size} ids (eos {EOS!r} = {tok.token_to_id(EOS)}) -> {out}")
