"""Hugging Face Qwen2: as Llama (RMSNorm, SwiGLU, grouped k/v, q/k/v biases), sliding layers by layer_types."""

from .hf import plan_swiglu

MODEL_TYPES = ("qwen2",)


def plan(root, model_type):
    return plan_swiglu(root, model_type, "Qwen2")
