"""Hugging Face Qwen3: as Llama, plus RMSNorm on q and k per head (q_norm, k_norm), patched the same way."""

from .hf import llama_shaped

SPEC = llama_shaped("qwen3", "Qwen3", qk_norm=True)
