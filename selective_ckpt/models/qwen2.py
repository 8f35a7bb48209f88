"""Hugging Face Qwen2: as Llama (RMSNorm, SwiGLU, grouped k/v, q/k/v biases), sliding layers by layer_types."""

from .hf import plan_swiglu
from .hf import swiglu_layer_shape as layer_shape  # noqa: F401 (the family's shape reader)

MODEL_TYPES = ("qwen2",)


def plan(root, model_type):
    return plan_swiglu(root, model_type, "Qwen2")
