"""Hugging Face Qwen2: as Llama (RMSNorm, gated MLP, grouped k/v, q/k/v biases), sliding layers by layer_types."""

from .spec import llama_shaped

SPEC = llama_shaped("qwen2", "Qwen2")
