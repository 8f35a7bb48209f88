"""Hugging Face Hunyuan dense (HunYuanDenseV1ForCausalLM: Hunyuan-0.5B to 7B): Llama-shaped, with an RMSNorm per
head on q and k after RoPE (query_layernorm, key_layernorm). Attention reads those norms' outputs, which are
rebuilt from their inputs (the rotated q and k) and an fp32 rstd per head: such a layer keeps Llama's floor plus
the statistics (memory.estimate's qk_norm="rotated"). Its NTK-alpha RoPE is transformers' own rotary module."""

from .spec import llama_shaped

SPEC = llama_shaped("hunyuan_v1_dense", "HunYuanDenseV1", qk_norm="rotated",
                    qk_norm_children=("query_layernorm", "key_layernorm"))
