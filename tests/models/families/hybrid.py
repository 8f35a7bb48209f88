"""Hybrid families: full-attention layers (gated attention, (1 + w) q/k norms per head, partial RoPE) and
linear-attention layers whose Gated DeltaNet stays transformers' own (its torch fallback: no fla or
causal-conv1d kernels on CPU), by config.layer_types.

The tiny configs alternate the two kinds (full_attention_interval=2: linear, full, linear, full); each kind is
also measured alone (layer_kinds). The shared packed check is not run: transformers' torch fallback of the gated
delta rule ignores document boundaries (its cu_seqlens), so the unconverted model's linear-attention layers carry
state from one document into the next; tests/models/test_hf_hybrid.py checks packed documents as transformers
packs them (the hybrid against float64, its full-attention layers keeping documents apart).
"""

import pytest

from tests.models.families import Family
from tests.models.hf_checks import VOCAB

transformers = pytest.importorskip("transformers")

# head_dim = hidden / heads (the estimate's shapes); the DeltaNet with 2 key heads serving 4 value heads
_HYBRID = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0,
               full_attention_interval=2, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4)
_KINDS = (("full_attention", dict(full_attention_interval=1)), ("linear_attention", dict(full_attention_interval=99)))
# Qwen3-Next's sparse blocks: 6 experts, 2 per token, a shared expert under its sigmoid gate; partial RoPE
QWEN3_NEXT = {**_HYBRID, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 48, "experts_implementation": "eager", "norm_topk_prob": True}

# 4 experts: with 6, one token's two best router scores tie within bf16 rounding in this initialisation, and
# any difference in rounding (converted or not) routes it to another expert (top-k is discontinuous)
QWEN3_5_MOE = {**_HYBRID, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 48, "experts_implementation": "eager"}

FAMILIES = [
    Family("qwen3_next", transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, QWEN3_NEXT, packed=False,
           lora_targets=("q_proj", "v_proj", "o_proj", "out_proj", "shared_expert_gate"), layer_kinds=_KINDS,
           dropout=dict(attention_dropout=0.17)),
    # a dense gated MLP in every layer
    Family("qwen3_5_text", transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, _HYBRID, packed=False,
           lora_targets=("q_proj", "v_proj", "out_proj", "down_proj"), layer_kinds=_KINDS),
    # a sparse block in every layer; PEFT takes down_proj for the experts' fused parameters
    Family("qwen3_5_moe_text", transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, QWEN3_5_MOE,
           packed=False, lora_targets=("q_proj", "v_proj", "o_proj", "out_proj", "shared_expert_gate"),
           layer_kinds=_KINDS),
]
