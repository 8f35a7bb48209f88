"""The one driver that converts a Hugging Face model in place from its model spec (models/spec.py).

`plan(root, spec)` checks every child of every decoder layer by the part of its role (models/layer_parts.py:
norm, attention, MLP or MoE block, kept mixer, dropout) and returns (decoder layers, [(module, new forward), ...])
from those parts' forwards, or raises ConversionError; `apply` then registers the attention function, points the
config at it, patches the forwards and wraps each decoder layer in its pipeline. A failed check changes nothing.
"""

import functools
import logging

from torch import nn

from ..memory.estimate import KEPT_MIXER
from . import attention, hub_kernels, loss_head
from .checks import check_children, class_name, is_class, modules_of
from .converted_layer import announce_modes, convert_decoder_layer
from .errors import ConversionError
from .layer_parts import AttentionPart, DropoutPart, MLPPart, NormPart, part_of
from .layer_shape import config_shape
from .patching import patch_forward
from .spec import ModelSpec, NormSpec


def hf_root(model):
    """The outermost transformers PreTrainedModel in `model` (itself, or inside a PEFT wrapper), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers missing: nothing of it can be in the model
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def text_path(root, spec):
    """Where `root` holds its text model: spec.text_model (in the composite's head class), else the longest dotted
    tail of it that names a submodule (in its base model: Mistral3Model's "language_model"); None for a
    whole-model spec or when none is there."""
    if spec.text_model is None:
        return None
    steps = spec.text_model.split(".")
    for i in range(len(steps)):
        path = ".".join(steps[i:])
        try:
            root.get_submodule(path)
        except AttributeError:
            continue
        return path
    return None


def text_part(root, spec, model_type=None):
    """The module `spec` converts in `root`: root itself, or a composite model's text decoder (text_path), a
    transformers model with a config of its own; ConversionError when `root` holds none there."""
    if spec.text_model is None:
        return root
    path = text_path(root, spec)
    part = root.get_submodule(path) if path is not None else None
    if getattr(part, "config", None) is None:
        raise ConversionError(f"{type(root).__name__} (model type {model_type!r}): no text model with a config at "
                              f"{spec.text_model!r} ({type(part).__name__ if part is not None else 'missing'}); "
                              "convert converts a composite model's text decoder there")
    return part


def left_as_is(root, spec):
    """[(name, module)] of a composite model's modules beside the path to its text model (text_path), in module
    order: what convert leaves transformers' own (the vision tower, the projector, the head). [] for a
    whole-model spec."""
    out, module, prefix = [], root, ""
    path = text_path(root, spec)
    for step in (path.split(".") if path else ()):
        out += [(prefix + n, m) for n, m in module.named_children() if n != step]
        module, prefix = getattr(module, step), f"{prefix}{step}."
    order = {n: i for i, (n, _) in enumerate(root.named_modules())}
    return sorted(out, key=lambda item: order[item[0]])


def plan(root, spec, model_type):
    """(decoder layers, [(module, forward), ...]) converting `root` by `spec`, or ConversionError. A composite
    model's spec (spec.text_model) plans its text model only (text_part)."""
    name = f"{type(root).__name__} (model type {model_type!r})"
    part = text_part(root, spec, model_type)
    if part is not root:
        name = (f"{type(root).__name__}.{text_path(root, spec)} ({type(part).__name__}, model type {model_type!r}, "
                f"text model type {getattr(part.config, 'model_type', None)!r})")
    root = part
    if spec.check is not None:
        spec.check(root, name)
    layers = modules_of(root, spec.layer)
    if not layers:
        raise ConversionError(f"{name} holds no {spec.layer}")
    mixers = ("attention", "mixer") if spec.mixer is not None else ()
    for lname, layer in layers:
        check_children(layer, lname, [c for c, _ in spec.children], model_type)
        held = [c for c, role in spec.children if role in mixers and c in layer._modules]
        if mixers and len(held) != (2 if spec.mixer.beside_attention else 1):
            names = [c for c, role in spec.children if role in mixers]
            raise ConversionError(f"{lname} ({type(layer).__name__}, model type {model_type!r}) holds {held or 'none'} "
                                  f"of its token mixers {names}; a converted layer holds "
                                  f"{'both' if spec.mixer.beside_attention else 'exactly one'}")
        for child, role in spec.children:
            if (role in mixers and child not in held) or (child in spec.optional and child not in layer._modules):
                continue
            module = getattr(layer, child)
            part = part_of(spec, role, module)
            if part is None:  # a child left as transformers' own, which the spec's check verifies
                continue
            if not is_class(module, part.cls):
                raise ConversionError(f"{lname}.{child} (model type {model_type!r}) is a {type(module).__name__}, not "
                                      f"{class_name(part.cls)}; it cannot be converted")
            part.check(module, f"{lname}.{child}", model_type)
    norm, attn, mlp = NormPart(spec), AttentionPart(spec), MLPPart(spec)
    attn_child = spec.child("attention")
    attentions = [(f"{lname}.{attn_child}", layer._modules[attn_child]) for lname, layer in layers
                  if layer._modules.get(attn_child) is not None]
    # a norm is patched by the class of what it reads: q/k norms read projections' outputs ("qkv")
    qk_norms = {id(m) for _, a in attentions if attn.q_norm(a) is not None
                for n in spec.qk_norm_children if (m := getattr(a, n, None)) is not None}
    patches = [(m, norm.forward(m, "qkv" if id(m) in qk_norms else "residual")) for _, m in modules_of(root, norm.cls)]
    if spec.dropout:  # every nn.Dropout of the model, the embeddings' and attention's included
        dropout = DropoutPart(spec)
        dropouts = [m for m in root.modules() if type(m) is nn.Dropout]
        for m in dropouts:
            dropout.check(m, name, model_type)
        patches += [(m, dropout.forward(m)) for m in dropouts]
    patches += [(m, mlp.forward(m)) for _, m in modules_of(root, mlp.cls)]
    own = spec.patches(root) if spec.patches is not None else []
    mine = {id(m) for m, _ in own}
    for aname, module in attentions:
        forward = attn.forward(module) if id(module) not in mine else None
        if forward is not None:
            attention.check_rope_rebuild(module, aname)
            patches.append((module, forward))
    patches += own
    if spec.moe is not None:
        patches += spec.moe.patches(root)
    return [m for _, m in layers], patches


def apply(root, layers, patches, mode, spec):
    """Registers attention, patches the forwards and gives each decoder layer its recompute mode ("full" for a
    layer under transformers' checkpointing already) and its shape reader (its LayerShape fields for the memory
    planner), and installs the fused loss head on a causal LM (models/loss_head.py). A composite model's spec
    (spec.text_model): attention and the shapes are its text model's (text_part), whose config alone names the
    attention; the modules left transformers' own are said once (one info line on the selective_ckpt logger)."""
    part = text_part(root, spec)
    attention.register(part)  # records the attention the model ran before, which fully masked rows follow
    part.config._attn_implementation = attention.NAME  # a composite's top config would set its vision config's too
    for module, forward in patches:
        patch_forward(module, forward)
    hub_kernels.keep_patches(root)
    names = {id(m): n for n, m in root.named_modules()}
    shape = spec.shape or config_shape
    for layer in layers:
        convert_decoder_layer(layer, mode, functools.partial(shape, config=part.config, spec=spec),
                              names.get(id(layer)), spec.child("mlp"))
    announce_modes(layers)
    if spec.mixer is not None:
        _say_mixers(root, spec, layers, names)
    loss_head.install(root)
    if part is not root:
        _say_left_as_is(root, spec, part)


def _say_mixers(root, spec, layers, names):
    """Marks each kept mixer (KEPT_MIXER) and says once which layers keep which module as transformers' own, and
    why: one info line on the selective_ckpt logger."""
    child = spec.child("mixer")
    held = [(i, getattr(layer, child)) for i, layer in enumerate(layers) if child in layer._modules]
    for _, mixer in held:
        setattr(mixer, KEPT_MIXER, spec.mixer.why)
    if held:
        logging.getLogger("selective_ckpt").info(
            f"selective_ckpt: {type(root).__name__} (model type {getattr(root.config, 'model_type', None)!r}): "
            f"decoder layers {', '.join(str(i) for i, _ in held)} of {len(layers)} keep their {child} "
            f"({spec.mixer.cls}) as transformers' own, and what it saves for backward: {spec.mixer.why}; their "
            f"{'attention, ' if spec.mixer.beside_attention else ''}norms and MLP convert")


def _say_left_as_is(root, spec, part):
    left = ", ".join(f"{n} ({type(m).__name__})" for n, m in left_as_is(root, spec))
    head = "" if loss_head.is_causal_lm(root) else "; its loss is transformers' own (lm_head's logits are made)"
    logging.getLogger("selective_ckpt").info(
        f"selective_ckpt: {type(root).__name__} (model type {getattr(root.config, 'model_type', None)!r}): converted "
        f"its text model {text_path(root, spec)} ({type(part).__name__}); left as transformers' own: {left}: the "
        f"model spec converts the text decoder's layers only{head}")


__all__ = ["ConversionError", "KEPT_MIXER", "ModelSpec", "NormSpec", "apply", "hf_root", "left_as_is", "plan",
           "text_part", "text_path"]
