"""Hugging Face Granite: Llama-shaped (RMSNorm, gated MLP, grouped k/v); its embedding, residual, attention
and logit multipliers stay in transformers' own forwards, the attention scale reaches the kernel as `scaling`.
Each of its two `branch * residual_multiplier` products keeps the Python float as a 0-dim float64 tensor."""

from .spec import llama_shaped

SPEC = llama_shaped("granite", "Granite", scalar_multipliers=2)
