"""Hugging Face Granite: Llama-shaped (RMSNorm, gated MLP, grouped k/v); its embedding, residual, attention
and logit multipliers stay in transformers' own forwards, the attention scale reaches the kernel as `scaling`."""

from .hf import llama_shaped

SPEC = llama_shaped("granite", "Granite")
