"""Converting a Hugging Face model in place: checks first, then patches (nothing is swapped).

A family module (models/<family>.py) gives `MODEL_TYPES` and `plan(root, model_type)`, which
checks every block and returns (decoder layers, [(module, new forward), ...]) or raises
ConversionError. `apply` then registers the attention function, points the config at it, patches
the forwards and wraps each decoder layer in its recompute scope. A failed check changes nothing.
"""

import functools

from . import attention, loss_head
from .common import ConversionError, convert_decoder_layer
from .patches import patch_forward, rms_norm_forward, swiglu_mlp_forward

SWIGLU_ACTIVATIONS = ("silu", "swish")


def hf_root(model):
    """The outermost transformers PreTrainedModel in `model` (itself, or inside a PEFT wrapper), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers missing: nothing of it can be in the model
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def modules_named(root, class_name):
    return [(n, m) for n, m in root.named_modules() if type(m).__name__ == class_name]


def check_children(module, name, allowed, model_type):
    extra = sorted(set(dict(module.named_children())) - set(allowed))
    if extra:
        raise ConversionError(f"{name} ({type(module).__name__}, model type {model_type!r}): unexpected submodules "
                              f"{extra}; a converted block may hold only {sorted(allowed)}")


def plan_swiglu(root, model_type, prefix, attention_children=("q_proj", "k_proj", "v_proj", "o_proj")):
    """Plan for a Llama-shaped family: <prefix>DecoderLayer, <prefix>RMSNorm, <prefix>MLP, <prefix>Attention."""
    config = root.config
    act = getattr(config, "hidden_act", None)
    if act not in SWIGLU_ACTIVATIONS:
        raise ConversionError(f"{type(root).__name__} (model type {model_type!r}): hidden_act {act!r} is not "
                              f"supported (only {', '.join(SWIGLU_ACTIVATIONS)})")
    layers = modules_named(root, f"{prefix}DecoderLayer")
    if not layers:
        raise ConversionError(f"{type(root).__name__} (model type {model_type!r}) holds no {prefix}DecoderLayer")
    norm, mlp, attn = f"{prefix}RMSNorm", f"{prefix}MLP", f"{prefix}Attention"
    for name, layer in layers:
        check_children(layer, name, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"), model_type)
        expected = {"self_attn": attn, "mlp": mlp, "input_layernorm": norm, "post_attention_layernorm": norm}
        for child, cls in expected.items():
            if type(getattr(layer, child)).__name__ != cls:
                raise ConversionError(f"{name}.{child} (model type {model_type!r}) is a "
                                      f"{type(getattr(layer, child)).__name__}, not {cls}; it cannot be converted")
        check_children(layer.self_attn, f"{name}.self_attn", attention_children, model_type)
        check_children(layer.mlp, f"{name}.mlp", ("gate_proj", "up_proj", "down_proj", "act_fn"), model_type)
    patches = [(m, rms_norm_forward) for _, m in modules_named(root, norm)]
    patches += [(m, swiglu_mlp_forward) for _, m in modules_named(root, mlp)]
    return [m for _, m in layers], patches


def swiglu_layer_shape(layer, config):
    """LayerShape fields (memory.planner) of a Llama-shaped decoder layer, from the model's config."""
    attn = layer.self_attn
    heads = config.num_attention_heads
    head_dim = getattr(attn, "head_dim", config.hidden_size // heads)
    if head_dim * heads != config.hidden_size:
        raise ValueError(f"{type(layer).__name__}: head_dim {head_dim} x {heads} heads != hidden_size "
                         f"{config.hidden_size}; memory estimates cover layers with head_dim = hidden / heads only")
    kv = getattr(config, "num_key_value_heads", None) or heads
    return dict(hidden_dim=config.hidden_size, num_heads=heads, num_kv_heads=kv, ffn_dim=config.intermediate_size,
                mlp_ratio=config.intermediate_size / config.hidden_size, norm="rmsnorm", activation="swiglu",
                sliding_window=getattr(attn, "sliding_window", None) or None)


def apply(root, layers, patches, mode, layer_shape):
    """Registers attention, patches the forwards, gives each decoder layer its recompute mode and
    `layer_shape(layer, config)` (its LayerShape fields for the memory planner), and installs the fused
    loss head on a causal LM (models/loss_head.py)."""
    attention.register()
    root.config._attn_implementation = attention.NAME
    for module, forward in patches:
        patch_forward(module, forward)
    for layer in layers:
        convert_decoder_layer(layer, mode, functools.partial(layer_shape, config=root.config))
    loss_head.install(root)


def converted_layers(model):
    """The converted Hugging Face decoder layers of `model`, in module order."""
    from .common import STATE
    return [m for m in model.modules() if hasattr(m, STATE)]


__all__ = ["ConversionError", "apply", "converted_layers", "hf_root", "plan_swiglu", "swiglu_layer_shape"]
