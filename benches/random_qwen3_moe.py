"""A Qwen3-MoE with random bf16 weights, saved in the published layout, for timing the CPU
engine at real dense shapes: issue 17's model (hidden 1024, 8 layers, 32k vocabulary, experts
of 384, top-8) with fewer experts by default, to keep the file small (32: 820 MB; 128: 2.8 GB).

    pip install torch transformers
    python3 benches/random_qwen3_moe.py /tmp/qwen3moe32 [experts]
    MOE_STEP_MODEL=/tmp/qwen3moe32 MOE_STEP_ITERS=100 MOE_STEP_BATCHES=1,8 \\
        cargo bench --bench engine_step
"""

import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

out = sys.argv[1]
experts = int(sys.argv[2]) if len(sys.argv) > 2 else 32
torch.manual_seed(0)
config = Qwen3MoeConfig(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3072,
    moe_intermediate_size=384,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=experts,
    num_experts_per_tok=8,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
