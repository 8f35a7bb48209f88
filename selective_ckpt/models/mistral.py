"""Hugging Face Mistral: as Llama (RMSNorm, SwiGLU, grouped k/v), plus config.sliding_window."""

from .hf import plan_swiglu
from .hf import swiglu_layer_shape as layer_shape  # noqa: F401 (the family's shape reader)

MODEL_TYPES = ("mistral",)


def plan(root, model_type):
    return plan_swiglu(root, model_type, "Mistral")
