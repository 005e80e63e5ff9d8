"""A Qwen3.5-MoE with random bf16 weights, saved as transformers saves it, for timing the CPU
engine on the hybrid layers: Qwen3.5-35B-A3B's dense shapes (hidden 2048; gated DeltaNet with 16
key and 32 value heads of 128, a convolution of 4; full attention of 16 query and 2 KV heads of
256 with a quarter of each rotated and a gated output; a shared expert of 512) over 4 layers, three
linear and one full as published, with 32 experts of 512 (top-8) instead of 256 and a 32k
vocabulary, to keep the file small (about 1.1 GB).

    pip install torch transformers
    python3 benches/random_qwen3_5_moe.py /tmp/qwen35moe
    MOE_STEP_MODEL=/tmp/qwen35moe MOE_STEP_PREFILL=64,512 cargo bench --bench engine_step
"""

import sys

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

out = sys.argv[1]
experts = int(sys.argv[2]) if len(sys.argv) > 2 else 32
torch.manual_seed(0)
config = Qwen3_5MoeTextConfig(
    vocab_size=32000,
    hidden_size=2048,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=experts,
    num_experts_per_tok=8,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                     "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
    eos_token_id=2,
)
Qwen3_5MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
