"""Hugging Face Gemma3 text models (Gemma3ForCausalLM and Gemma3TextForSequenceClassification on
Gemma3TextConfig, model type "gemma3_text"): Gemma2's layer (gemma2.gemma_spec) with (1 + w) RMSNorms on q
and k per head before RoPE (the rotated q, k rebuilt from the norms' inputs: attention.qk_normed_forward);
sliding and global layers take their two rope bases from transformers' own rotary module."""

from .gemma2 import gemma_spec

SPEC = gemma_spec("gemma3_text", "Gemma3", qk_norm=True)
