"""Hugging Face Qwen3: as Llama, plus RMSNorm on q and k per head (q_norm, k_norm), patched the same way."""

from .hf import plan_swiglu
from .hf import swiglu_layer_shape as layer_shape  # noqa: F401 (the family's shape reader)

MODEL_TYPES = ("qwen3",)


def plan(root, model_type):
    return plan_swiglu(root, model_type, "Qwen3",
                       attention_children=("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))
