"""Hugging Face Mistral: as Llama (RMSNorm, gated MLP, grouped k/v), plus config.sliding_window."""

from .spec import llama_shaped

SPEC = llama_shaped("mistral", "Mistral")
