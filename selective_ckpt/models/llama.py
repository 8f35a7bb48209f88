"""Hugging Face Llama: RMSNorm and the gated MLP patched in place, attention through the registry (grouped k/v)."""

from .spec import llama_shaped

SPEC = llama_shaped("llama", "Llama")
