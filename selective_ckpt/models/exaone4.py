"""Hugging Face EXAONE 4.0: post-norm layers as OLMo2's (RMSNorm on the attention and MLP outputs before each
residual add, the layer input feeding the projections directly), with Llama's RMSNorm rounding (the fused
kernel, keeping input and rstd) and Qwen3's per-head q/k RMSNorms (q_norm, k_norm on each head before RoPE),
sliding-window layers by config.layer_types.

With a window configured, transformers runs its global layers without RoPE: attention then saves the q/k norm
outputs themselves, which are rebuilt from the norms' inputs, so such a layer keeps (H + Hkv)·D elements per
token fewer than memory.estimate counts for a per-head q/k-normed layer. Those configurations are refused
(`_check`) until the estimate has that form; a model with every layer sliding, or without a window, converts.
"""

from .errors import ConversionError
from .layer_shape import config_shape
from .spec import llama_shaped


def _check(root, name):
    config = root.config
    types = list(getattr(config, "layer_types", None) or ())
    nope = [i for i, t in enumerate(types) if t != "sliding_attention"]
    if getattr(config, "sliding_window", None) is not None and nope:
        raise ConversionError(
            f"{name}: config.sliding_window={config.sliding_window} with config.layer_types {nope} not "
            "'sliding_attention': Exaone4Attention runs those layers without RoPE, whose q/k norm outputs attention "
            "keeps as rebuilt outputs, a form memory.estimate does not count; convert supports EXAONE 4.0 with every "
            "layer sliding or with sliding_window=None (RoPE on every layer)")


def shape(layer, config, spec):
    """config_shape with the window only on sliding layers (every Exaone4Attention holds config.sliding_window,
    used where its layer type is sliding)."""
    attn = getattr(layer, spec.child("attention"))
    return dict(config_shape(layer, config, spec),
                sliding_window=(attn.sliding_window or None) if getattr(attn, "is_sliding", False) else None)


SPEC = llama_shaped("exaone4", "Exaone4", children=(("self_attn", "attention"), ("post_attention_layernorm", "norm"),
                                                    ("mlp", "mlp"), ("post_feedforward_layernorm", "norm")),
                    residual="post-norm", qk_norm=True, shape=shape, check=_check)
