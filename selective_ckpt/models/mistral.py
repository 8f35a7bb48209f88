"""Hugging Face Mistral: as Llama (RMSNorm, SwiGLU, grouped k/v), plus config.sliding_window."""

from .hf import plan_swiglu

MODEL_TYPES = ("mistral",)


def plan(root, model_type):
    return plan_swiglu(root, model_type, "Mistral")
