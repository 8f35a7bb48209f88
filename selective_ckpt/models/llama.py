"""Hugging Face Llama: RMSNorm and SwiGLU patched in place, attention through the registry (grouped k/v)."""

from .hf import plan_swiglu
from .hf import swiglu_layer_shape as layer_shape  # noqa: F401 (the family's shape reader)

MODEL_TYPES = ("llama",)


def plan(root, model_type):
    return plan_swiglu(root, model_type, "Llama")
