"""Hugging Face Qwen3: as Llama, plus RMSNorm on q and k per head before RoPE (q_norm, k_norm), patched the same way;
the rotated q and k attention reads are rebuilt from the norms' inputs (attention.qk_normed_forward), so a layer
keeps Llama's floor plus the norms' fp32 rstd per head."""

from .spec import llama_shaped

SPEC = llama_shaped("qwen3", "Qwen3", qk_norm=True)
