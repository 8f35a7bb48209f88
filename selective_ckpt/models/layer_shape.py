"""What a converted decoder layer is for the memory planner: its LayerShape fields (memory.planner). The widths come
from the model's config, the layer's form from the model spec (residual form, norm count, float scalars), and what
each child keeps from its part (models/layer_parts.py: norms, attention, MLP or MoE block, kept mixer), as the
memory parts (memory/parts.py) that make up the layer's `parts`. A family's own shape reader adds only what its config
decides per layer, a part in place of the one of its role (`with_parts`)."""

import functools

from .. import compat
from ..memory.parts import Residual, Scalars, with_part
from .layer_parts import part_of


def config_shape(layer, config, spec):
    """LayerShape fields of a decoder layer under `spec`: hidden_size, num_attention_heads, num_key_value_heads and
    intermediate_size (or GPT-2's n_inner, 4 h by default) from the config (the config's head_dim where the layer
    holds no attention), its Residual from the spec, and each child's part's fields and memory part."""
    h, heads = config.hidden_size, config.num_attention_heads
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    kv = compat.global_config_value(config, "num_key_value_heads") or heads  # per layer: the shape reader's
    fields = dict(hidden_dim=h, num_heads=heads, num_kv_heads=kv, ffn_dim=ffn, mlp_ratio=ffn / h, sliding_window=None)
    parts = (spec_residual(spec),)
    if spec.scalar_multipliers:
        parts += (Scalars(spec.scalar_multipliers),)
    held = [(role, layer._modules.get(child)) for child, role in spec.children]
    for role, module in held:
        part = part_of(spec, role, module) if module is not None else None
        if part is not None:
            part_fields = part.shape(module, config)
            parts = functools.reduce(with_part, part_fields.pop("parts", ()), parts)
            fields.update(part_fields)
    if not any(role == "attention" and module is not None for role, module in held):
        head_dim = getattr(config, "head_dim", None) or h // heads  # a layer holding a mixer instead
        if head_dim * heads != h:
            fields["head_dim"] = head_dim
    return {**fields, "parts": parts}


def spec_residual(spec):
    """memory's Residual of the spec's residual form; "sandwich" is a pre-norm stream whose post-norms keep o_proj's
    and down_proj's outputs and their statistics, a "parallel" one counts the spec's norms (one shared, or two)."""
    if spec.residual == "sandwich":
        return Residual(post_norms=True)
    return Residual(spec.residual, spec.count("norm") if spec.residual == "parallel" else 2)


def with_parts(fields, *parts):
    """LayerShape `fields` whose layer holds `parts`, each in place of the part of its role (memory.parts.with_part:
    MLA for Attention, a MoE for the DenseMLP, a Residual for the spec's; Scalars add up)."""
    return {**fields, "parts": functools.reduce(with_part, parts, fields["parts"])}
