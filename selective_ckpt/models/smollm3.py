"""Hugging Face SmolLM3: Llama-shaped; its layers without RoPE (config.no_rope_layers) and its sliding-window
layers are transformers' own attention forwards, which hand the kernel q and k as they are and the window."""

from .spec import llama_shaped

SPEC = llama_shaped("smollm3", "SmolLM3")
