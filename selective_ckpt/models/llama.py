"""Hugging Face Llama: RMSNorm and SwiGLU patched in place, attention through the registry (grouped k/v)."""

from .hf import plan_swiglu

MODEL_TYPES = ("llama",)


def plan(root, model_type):
    return plan_swiglu(root, model_type, "Llama")
