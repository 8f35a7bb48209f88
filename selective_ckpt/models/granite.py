"""Hugging Face Granite: Llama-shaped (RMSNorm, gated MLP, grouped k/v); its embedding, residual, attention
and logit multipliers stay in transformers' own forwards, the attention scale reaches the kernel as `scaling`.
Each of its two `branch * residual_multiplier` products keeps the Python float as a 0-dim float64 tensor."""

from .layer_shape import config_shape
from .spec import llama_shaped


def shape(layer, config, spec):
    """config_shape plus the layer's two residual-multiplier scalars (memory.estimate's scalar_multipliers)."""
    return dict(config_shape(layer, config, spec), scalar_multipliers=2)


SPEC = llama_shaped("granite", "Granite", shape=shape)
