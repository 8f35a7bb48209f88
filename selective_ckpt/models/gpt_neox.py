"""Hugging Face GPT-NeoX: both LayerNorms, the dense_h_to_4h -> GELU -> dense_4h_to_h MLP and every dropout
(by seed) patched in place; attention through the registry from the packed query_key_value.

A layer with use_parallel_residual (x + attn(ln1(x)) + mlp(ln2(x))) keeps x and two norms' statistics and no
x1; without it the layer is pre-norm. Partial rotary (rotary_pct / partial_rotary_factor) stays in
transformers' own attention forward: the kernel receives q and k after it. v, a view into the packed
projection's output, is kept as its own copy (models/attention.py), so that output is not kept whole.
"""

from torch import nn

from ..memory.parts import Residual
from .layer_shape import config_shape, with_parts
from .spec import MLPSpec, ModelSpec, NormSpec


def _shape(layer, config, spec):
    """config_shape, the residual form by the layer's own use_parallel_residual (its two norms either way)."""
    form = "parallel" if layer.use_parallel_residual else "pre-norm"
    return with_parts(config_shape(layer, config, spec), Residual(form, spec.count("norm")))


SPEC = ModelSpec(
    model_types=("gpt_neox",), layer="GPTNeoXLayer",
    children=(("input_layernorm", "norm"), ("post_attention_layernorm", "norm"),
              ("post_attention_dropout", "dropout"), ("post_mlp_dropout", "dropout"),
              ("attention", "attention"), ("mlp", "mlp")),
    norm=NormSpec("layernorm", nn.LayerNorm), attention="GPTNeoXAttention",
    attention_children=("query_key_value", "dense"),
    mlp=MLPSpec("GPTNeoXMLP", "fc", ("dense_h_to_4h", "act", "dense_4h_to_h")),
    residual="parallel", dropout=True, shape=_shape)
