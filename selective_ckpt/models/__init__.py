"""Model integrations: one module per family, consulted in order by convert().

Each family module provides `matches(module) -> bool`, `convert_block(module, name, recompute)`
(raising ConversionError naming the module when it cannot be reproduced faithfully) and
`USES_KV_CACHE`. Every block is checked before any is replaced, so a failed convert changes nothing.
"""

from torch import nn

from ..layers import SelectiveDecoderLayer
from ..validation import check_mode
from . import eager, gpt2
from .common import ConversionError

FAMILIES = (gpt2, eager)

__all__ = ["ConversionError", "FAMILIES", "convert"]


def convert(model, recompute="selective"):
    """Replaces every GPT2Block and EagerDecoderLayer-shaped module of `model` in place.

    Returns (model, replaced): `replaced` lists the qualified names of the swapped modules ("" for
    the root, in which case the returned model is the new layer). Raises ConversionError (a
    ValueError) naming the module when a layer cannot be converted faithfully; then nothing changes.
    """
    check_mode(recompute)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    plan = []
    for name, module in model.named_modules():
        if isinstance(module, SelectiveDecoderLayer) or any(name.startswith(p + ".") for p, _, _ in plan if p):
            continue
        family = next((f for f in FAMILIES if f.matches(module)), None)
        if family is None:
            continue
        new = family.convert_block(module, name or type(module).__name__, recompute)
        new.train(module.training)
        plan.append((name, new, family))
    for name, new, _ in plan:
        if not name:
            return new, [""]
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    if any(f.USES_KV_CACHE for _, _, f in plan) and getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False  # the replacements do not fill a kv cache
    return model, [name for name, _, _ in plan]
