"""Hugging Face Gemma: Llama-shaped, its RMSNorm scaled by (1 + w) (offset 1) and a GeGLU MLP (tanh GELU)."""

from .spec import NormSpec, llama_shaped

SPEC = llama_shaped("gemma", "Gemma", norm=NormSpec("rmsnorm", "GemmaRMSNorm", offset=1.0))
