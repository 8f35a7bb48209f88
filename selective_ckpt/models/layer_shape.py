"""What a converted decoder layer is for the memory planner: its LayerShape fields (memory.planner). The form is
read from the model spec (norm kind and statistics, residual form, q/k norms, gated attention, a kept mixer, the
MoE block and its router's scalars), the widths from the model's config and the layer's own modules. A family's
own shape reader adds only what its config decides per layer."""

import functools

from ..activations import kernel_activation
from ..memory.estimate import Mixer
from .checks import is_class
from .kept_mixer import mixer_saved_bytes


def mlp_activation(mlp, spec):
    """The LayerShape activation of a dense MLP: what memory.estimate counts for it.

    A gated MLP keeps gate and up whatever its activation ("swiglu" for SiLU, "geglu" for any
    other); a plain one keeps its fc_in output ("gelu_tanh" for tanh-GELU, "gelu" for any other).
    """
    kernel = kernel_activation(getattr(mlp, spec.mlp.activation))
    if spec.mlp.gated:
        return "swiglu" if kernel == "silu" else "geglu"
    return "gelu_tanh" if kernel == "gelu_tanh" else "gelu"


def _held(layer, child):
    return layer._modules.get(child) if child is not None else None


def config_shape(layer, config, spec):
    """LayerShape fields of a decoder layer under `spec`: hidden_size, num_attention_heads, num_key_value_heads and
    intermediate_size (or GPT-2's n_inner, 4 h by default) from the config; the attention's head_dim (given only
    where heads x head_dim is not hidden_size) and sliding_window from the layer's attention (the config's head_dim
    where the layer holds a mixer instead); the rest from the spec."""
    attn, mixer = _held(layer, spec.child("attention")), _held(layer, spec.child("mixer"))
    mlp = getattr(layer, spec.child("mlp"))
    h, heads = config.hidden_size, config.num_attention_heads
    if attn is None:  # a layer holding a mixer instead of attention
        head_dim = getattr(config, "head_dim", None) or h // heads
    else:
        head_dim = getattr(attn, "head_dim", h // heads)
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    kv = getattr(config, "num_key_value_heads", None) or heads
    fields = dict(hidden_dim=h, num_heads=heads, num_kv_heads=kv, ffn_dim=ffn, mlp_ratio=ffn / h, norm=spec.norm.kind,
                  sliding_window=getattr(attn, "sliding_window", None) or None)
    if head_dim * heads != h:
        fields["head_dim"] = head_dim
    if not spec.norm.keeps_stats:
        fields["norm_stats"] = False  # the norms run their own forward again in backward
    if spec.residual == "parallel":
        fields.update(residual="parallel", norms=spec.count("norm"))
    elif spec.residual == "post-norm":
        fields["residual"] = "post-norm"
    elif spec.residual == "sandwich":
        fields["post_norms"] = True  # the post-norms keep o_proj's and down_proj's outputs and statistics
    # the q/k norms keep their inputs (and statistics), where the attention holds them (optional by config in some
    # families); with v normed too, each projection's output is kept once as its norm's input and every norm and
    # RoPE output is rebuilt: the bytes of an attention without norms
    if spec.qk_norm and len(spec.qk_norm_children) == 2 and getattr(attn, spec.qk_norm_children[0], None) is not None:
        fields["qk_norm"] = spec.qk_norm
    if spec.attention_gate and attn is not None and mixer is None:
        fields["attn_gate"] = True
    if mixer is not None:
        saved = functools.partial(mixer_saved_bytes, mixer)
        fields["mixer"] = Mixer(type(mixer).__name__, saved, attention=spec.mixer.beside_attention)
    scalars = spec.scalar_multipliers
    if spec.moe is not None and is_class(mlp, spec.moe.block):
        moe = spec.moe.memory(mlp)
        fields.update(ffn_dim=moe.expert_dim, mlp_ratio=moe.expert_dim / h, moe=moe,
                      activation=spec.moe.activation(mlp))
        scalars += spec.moe.scalars
    else:
        fields["activation"] = mlp_activation(mlp, spec)
    if scalars:
        fields["scalar_multipliers"] = scalars
    return fields
