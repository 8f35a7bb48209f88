"""Hugging Face Ministral: Llama-shaped (RMSNorm, gated MLP, grouped k/v, no q/k/v biases), its sliding-window
layers by config.layer_types (each attention module's own sliding_window reaches the kernel)."""

from .spec import llama_shaped

SPEC = llama_shaped("ministral", "Ministral")
