"""Copy llama.cpp's convert_hf_to_gguf.py (and its conversion/ package) to DEST, patched so a
BPE tokenizer whose pre-tokenizer hash the converter does not know is converted with the
"gpt-2" pre-tokenizer instead of failing with "BPE pre-tokenizer was not recognized".

Why this is right here: make_tokenizer.py trains a fresh byte-level BPE (so its hash is new to
any converter) with tokenizers' ByteLevel pre-tokenizer, whose split regex is GPT-2's; llama.cpp's
"gpt-2" pre-tokenizer is that same regex. The benchmark sends token-id prompts anyway, so the
choice does not touch the timings.

The patch: in conversion/base.py (older llama.cpp: convert_hf_to_gguf.py itself), the line
`        if res is None:` that begins get_vocab_base_pre's failure branch becomes
`        if res is None: res = "gpt-2"  # patched` followed by the original `if res is None:`,
which is then never taken.

    python3 patch_converter.py LLAMA_CPP_DIR DEST
"""

import os
import shutil
import sys

src, dest = sys.argv[1], sys.argv[2]
if os.path.exists(dest):
    shutil.rmtree(dest)
os.makedirs(dest)
shutil.copy(os.path.join(src, "convert_hf_to_gguf.py"), dest)
if os.path.isdir(os.path.join(src, "conversion")):
    shutil.copytree(os.path.join(src, "conversion"), os.path.join(dest, "conversion"))
    target = os.path.join(dest, "conversion", "base.py")
else:
    target = os.path.join(dest, "convert_hf_to_gguf.py")
# The converter imports the gguf package next to it (gguf-py) unless NO_LOCAL_GGUF is set.
os.symlink(os.path.join(os.path.abspath(src), "gguf-py"), os.path.join(dest, "gguf-py"))

text = open(target).read()
start = text.index("def get_vocab_base_pre")
end = text.index("return res", start)
marker = "        if res is None:\n"
at = text.index(marker, start)
assert at < end, "get_vocab_base_pre has no `if res is None:` branch"
patched = '        if res is None: res = "gpt-2"  # patched by benches/llama_cpp/patch_converter.py\n'
text = text[:at] + patched + text[at:]
open(target, "w").write(text)
print(f"patched {target}: unknown BPE pre-tokenizer hashes -> 'gpt-2'")
