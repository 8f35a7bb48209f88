"""Model integrations: one module per family, one registry consulted by convert().

Hugging Face families (gpt2, llama, mistral, qwen2, qwen3) are chosen by `config.model_type` and
converted in place by patching (models/hf.py): every module, name and parameter stays. The eager
benchmark layer (models/eager.py) is swapped for a SelectiveDecoderLayer. Every block is checked
before anything is changed, so a failed convert leaves the model as it was.
"""

from torch import nn

from ..layers import SelectiveDecoderLayer
from ..validation import check_mode
from . import checkpointing, eager, gpt2, hf, llama, mistral, qwen2, qwen3
from .common import ConversionError

HF_FAMILIES = {t: family for family in (gpt2, llama, mistral, qwen2, qwen3) for t in family.MODEL_TYPES}

__all__ = ["ConversionError", "HF_FAMILIES", "convert"]


def _supported():
    return f"Hugging Face model types {', '.join(sorted(HF_FAMILIES))} and EagerDecoderLayer-shaped modules"


def convert(model, recompute="selective"):
    """Makes `model` compute with selective_ckpt's kernels and recompute; returns the model.

    Hugging Face models (also inside a PEFT wrapper) keep every module, parameter and state-dict
    key: attention goes through transformers' attention registry ("selective_ckpt"), norms,
    activations and dropouts are patched in place, and each decoder layer gets a recompute mode
    (`recompute`; see set_recompute). EagerDecoderLayer-shaped modules are replaced by
    SelectiveDecoderLayers (the returned model is the new layer when `model` itself is one).
    Raises ConversionError naming the module, the model type and what is supported, before any change.
    Layers under transformers' gradient checkpointing before convert stay "full" (models/checkpointing.py).
    """
    check_mode(recompute)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    root = hf.hf_root(model)
    if root is not None:
        model_type = getattr(root.config, "model_type", None)
        family = HF_FAMILIES.get(model_type)
        if family is None:
            raise ConversionError(f"{type(root).__name__}: model type {model_type!r} is not supported; supported: "
                                  f"{_supported()}")
        layers, patches = family.plan(root, model_type)
        checkpointed = checkpointing.checkpointed(layers)  # what the user enabled stays enabled: "full"
        hf.apply(root, layers, patches, recompute, family.layer_shape)
        checkpointing.keep_checkpointed(checkpointed)
        return model
    return _convert_eager(model, recompute)


def _convert_eager(model, recompute):
    plan = []
    for name, module in model.named_modules():
        if isinstance(module, SelectiveDecoderLayer) or any(name.startswith(p + ".") for p, _ in plan if p):
            continue
        if eager.matches(module):
            new = eager.convert_block(module, name or type(module).__name__, recompute)
            new.train(module.training)
            plan.append((name, new))
    if not plan:
        if any(isinstance(m, SelectiveDecoderLayer) for m in model.modules()):
            return model  # already converted
        raise ConversionError(f"{type(model).__name__}: nothing to convert; supported: {_supported()}")
    for name, new in plan:
        if not name:
            return new
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model
