"""Model integrations: a model spec per model family, one driver, consulted by convert().

A Hugging Face model family is a module models/<family>.py defining `SPEC` (a spec.ModelSpec); every
such module is found here, so a new family is that one file. A Hugging Face model of any of these families
(`model_specs()`; README lists them) is chosen by `config.model_type` and converted in place by patching
(hf.plan and hf.apply): every module, name and parameter stays. The eager
benchmark layer (models/eager.py) is swapped for a SelectiveDecoderLayer. Every block is checked
before anything is changed, so a failed convert leaves the model as it was.
"""

import functools
import importlib
import pkgutil

from torch import nn

from .. import compat
from ..keeping.policy import resolve
from ..layers import SelectiveDecoderLayer, set_recompute
from ..registry import recomputable_layers, state_of
from . import eager, hf
from .errors import ConversionError
from .patches import runs_in_tiles
from .peft import plan_adapters
from .spec import ModelSpec

__all__ = ["ConversionError", "convert", "model_specs"]


@functools.cache
def model_specs():
    """{model_type: ModelSpec} from every module of this package that defines SPEC."""
    specs = {}
    for info in pkgutil.iter_modules(__path__):
        spec = getattr(importlib.import_module(f"{__name__}.{info.name}"), "SPEC", None)
        if isinstance(spec, ModelSpec):
            for t in spec.model_types:
                if t in specs:
                    raise ValueError(f"model type {t!r} has two model specs ({info.name} and another)")
                specs[t] = spec
    return specs


def _supported():
    return f"Hugging Face model types {', '.join(sorted(model_specs()))} and EagerDecoderLayer-shaped modules"


def convert(model, recompute="selective", plan=None):
    """Makes `model` compute with selective_ckpt's kernels and recompute; returns the model.

    Hugging Face models (also inside a PEFT wrapper) keep every module, parameter and state-dict
    key: attention goes through transformers' attention registry ("selective_ckpt"), norms,
    activations and dropouts are patched in place, and each decoder layer gets a recompute mode
    (`recompute`; see set_recompute). EagerDecoderLayer-shaped modules are replaced by
    SelectiveDecoderLayers (the returned model is the new layer when `model` itself is one).
    Raises ConversionError naming the module, the model type and what is supported, before any change.
    Layers under transformers' gradient checkpointing before convert stay "full" (models/converted_layer.py).
    `recompute` is a mode or a keeping.LayerPolicy (what a layer keeps, offloads and rebuilds). `plan`: a
    selective_ckpt.plan(...) result (a policy per decoder layer, and the offload engine's prefetch), applied with
    set_recompute after the conversion instead of `recompute`.
    """
    if plan is not None:
        if recompute != "selective":
            raise ValueError("pass either recompute or plan, not both")
        if not isinstance(plan, (list, tuple)):
            raise TypeError(f"plan must be a selective_ckpt.plan(...) result or a list of policies, got "
                            f"{type(plan).__name__}")
        model = convert(model)
        set_recompute(model, plan)
        return model
    layer_policy = resolve(recompute, "recompute")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    root = hf.hf_root(model)
    if root is not None:
        unsupported = compat.unsupported_transformers()  # before anything is read or changed
        if unsupported is not None:
            raise ConversionError(f"{type(root).__name__}: {unsupported}")
        model_type = getattr(root.config, "model_type", None)
        spec = model_specs().get(model_type)
        if spec is None:
            raise ConversionError(f"{type(root).__name__}: model type {model_type!r} is not supported; supported: "
                                  f"{_supported()}")
        layers, patches = hf.plan(root, spec, model_type)
        patches = patches + plan_adapters(model)
        _check_tiles(layers, patches, spec, layer_policy)
        hf.apply(root, layers, patches, layer_policy, spec)
        return _with_engine(model, layer_policy)
    return _with_engine(_convert_eager(model, layer_policy), layer_policy)


def _check_tiles(layers, patches, spec, layer_policy):
    """A policy that runs the MLP in tiles needs every layer's MLP forward to tile: else the error, before any
    change."""
    child = spec.child("mlp")
    if layer_policy.layer_tiles > 1 and spec.mixer is not None:
        mixer = spec.child("mixer")
        held = [type(layer).__name__ for layer in layers if mixer in layer._modules]
        if held:
            raise ConversionError(f"{held[0]}.{mixer} ({spec.mixer.cls}) is a recurrent token mixer kept as "
                                  f"transformers' own: recompute={str(layer_policy)!r} cannot run its layers in "
                                  f"{layer_policy.layer_tiles} query tiles (each tile would start its recurrence "
                                  "anew); use layer_tiles=1 for this model")
    if layer_policy.layer_tiles > 1:
        for layer in layers:
            mlp = getattr(layer, child, None)
            if mlp is not None and hasattr(mlp, "experts"):
                raise ConversionError(f"{type(layer).__name__}.{child} ({type(mlp).__name__}) is a mixture of experts: "
                                      f"recompute={str(layer_policy)!r} cannot run its layers in "
                                      f"{layer_policy.layer_tiles} tiles; use mlp_tiles for this model")
    if layer_policy.mlp_tiles == 1:
        return
    planned = {id(module): forward for module, forward in patches}
    for layer in layers:
        mlp = getattr(layer, child)
        if not runs_in_tiles(planned.get(id(mlp))):
            kind = "a mixture of experts" if hasattr(mlp, "experts") else "an MLP whose forward does not run in tiles"
            raise ConversionError(f"{type(layer).__name__}.{child} ({type(mlp).__name__}) is {kind}: recompute="
                                  f"{str(layer_policy)!r} cannot run it in {layer_policy.mlp_tiles} tiles; use "
                                  "mlp_tiles=1 for this model")


def _with_engine(model, layer_policy):
    """A policy that offloads gets the model's one offload engine (set_recompute makes it)."""
    if layer_policy.offloaded:
        set_recompute(model, [state_of(m).policy for m in recomputable_layers(model)])
    return model


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
