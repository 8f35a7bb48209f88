"""Hugging Face GPT-2: LayerNorm, GELU and every dropout patched in place; attention through the registry.

GPT2Block, its Conv1D projections and parameter names stay. ln_1/ln_2/ln_f run the fused LayerNorm
kernel (keeps x, mean, rstd; the output is rebuilt for c_attn / c_fc / lm_head), GPT2MLP's GELU
keeps its input (c_fc's output) and its output is rebuilt for c_proj, and resid_pdrop/embd_pdrop
dropouts keep a seed instead of a mask. attn_pdrop goes to the attention kernel by seed.
"""

from torch import nn

from .common import ConversionError
from .hf import check_children, modules_named
from .patches import dropout_forward, gelu_mlp_forward_factory, layer_norm_forward

MODEL_TYPES = ("gpt2",)
ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}  # -> GELU approximation


def layer_shape(layer, config):
    """LayerShape fields (memory.planner) of a GPT2Block."""
    h = config.hidden_size
    ffn = config.n_inner if config.n_inner is not None else 4 * h
    act = "gelu_tanh" if ACTIVATIONS[config.activation_function] == "tanh" else "gelu"
    return dict(hidden_dim=h, num_heads=config.num_attention_heads, mlp_ratio=ffn / h, ffn_dim=ffn,
                norm="layernorm", activation=act)


def plan(root, model_type):
    config = root.config
    name = f"{type(root).__name__} (model type {model_type!r})"
    if getattr(config, "add_cross_attention", False):
        raise ConversionError(f"{name}: GPT2Block with cross-attention cannot be converted (self-attention only)")
    act = config.activation_function
    if act not in ACTIVATIONS:
        raise ConversionError(f"{name}: activation {act!r} is not supported (only {', '.join(ACTIVATIONS)})")
    layers = modules_named(root, "GPT2Block")
    if not layers:
        raise ConversionError(f"{name} holds no GPT2Block")
    for lname, layer in layers:
        check_children(layer, lname, ("ln_1", "attn", "ln_2", "mlp"), model_type)
        for ln in (layer.ln_1, layer.ln_2):
            if type(ln) is not nn.LayerNorm or not ln.elementwise_affine:
                raise ConversionError(f"{lname}: {type(ln).__name__} is not an affine nn.LayerNorm")
        check_children(layer.attn, f"{lname}.attn", ("c_attn", "c_proj", "attn_dropout", "resid_dropout"), model_type)
        check_children(layer.mlp, f"{lname}.mlp", ("c_fc", "c_proj", "act", "dropout"), model_type)
    norms = [m for m in root.modules() if type(m) is nn.LayerNorm]
    dropouts = [m for m in root.modules() if type(m) is nn.Dropout]
    for d in dropouts:
        if d.inplace:
            raise ConversionError(f"{name}: in-place nn.Dropout cannot be converted")
    patches = [(m, layer_norm_forward) for m in norms] + [(m, dropout_forward) for m in dropouts]
    mlp_forward = gelu_mlp_forward_factory(ACTIVATIONS[act])
    patches += [(m, mlp_forward) for _, m in modules_named(root, "GPT2MLP")]
    return [m for _, m in layers], patches
