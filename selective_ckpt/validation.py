"""Argument checks shared by the ops, the layers, the memory tools and the model integrations.

Each check raises TypeError or ValueError naming the argument and what is expected.
"""

import torch

from .activations import ACTIVATIONS, GATED_LAYER_ACTIVATIONS, LAYER_ACTIVATIONS

# dtypes the public functions and layers accept; the kernels also take float64 (tests, references).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KERNEL_DTYPES = SUPPORTED_DTYPES + (torch.float64,)

RECOMPUTE_MODES = ("none", "selective", "full", "attention-kept")
MAX_HEAD_DIM = 256


def check_floating(t, name):
    """t is a tensor of a dtype the kernels run (float32, float16, bfloat16, float64)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")


def check_operands(x, named):
    """x and the (name, tensor) pairs are floating; every tensor shares x's dtype and device."""
    check_floating(x, "x")
    for name, t in named:
        check_floating(t, name)
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, expected x's dtype {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, expected x's device {x.device}")


def check_linear(w, b, names, dims, n_in, in_source):
    """An nn.Linear weight w [out, in] with in = n_in (in_source says where n_in comes from) and bias
    b [out] or None. names: (weight name, bias name); dims: (out symbol, in symbol). Returns out."""
    (w_name, b_name), (out_sym, in_sym) = names, dims
    if w.dim() != 2 or w.shape[1] != n_in:
        raise ValueError(f"{w_name} must have shape [{out_sym}, {in_sym}] with {in_sym} = {in_source} = {n_in}, "
                         f"got {list(w.shape)}")
    out = w.shape[0]
    if b is not None and tuple(b.shape) != (out,):
        raise ValueError(f"{b_name} must have shape [{out_sym}] = [{out}], got {list(b.shape)}")
    return out


def check_norm_args(x, weight, bias, eps):
    """Operands of a norm over x's last dim: weight (and bias, if any) of that length on x's device."""
    check_floating(x, "x")
    n = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or n == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {list(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        check_floating(t, name)
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape [{n}] (x's last dim), got {list(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, expected x's device {x.device}")
    check_positive_float(eps, "eps")


def check_choice(value, name, choices):
    """choices[value] for a str naming one of `choices` (a dict name -> kernel code)."""
    if isinstance(value, str) and value in choices:
        return choices[value]
    names = " or ".join(map(repr, choices))
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, {names}, got {type(value).__name__}")
    raise ValueError(f"{name} must be {names}, got {value!r}")


def check_bool(value, name):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_positive_float(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive float, got {value!r}")
    return float(value)


def check_mode(mode):
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(map(repr, RECOMPUTE_MODES))}, got {mode!r}")
    return mode


def check_heads(hidden_dim, num_heads):
    """head_dim of a layer with these sizes, or the error naming what does not fit."""
    check_positive_int(hidden_dim, "hidden_dim")
    check_positive_int(num_heads, "num_heads")
    if hidden_dim % num_heads:
        raise ValueError(f"hidden_dim ({hidden_dim}) must be divisible by num_heads ({num_heads})")
    head_dim = hidden_dim // num_heads
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head dim hidden_dim / num_heads = {head_dim} is not supported: at most {MAX_HEAD_DIM}")
    return head_dim


def ffn_dim(hidden_dim, mlp_ratio):
    """The MLP width a layer builds for `mlp_ratio` (rounded to the nearest int)."""
    if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or not mlp_ratio > 0:
        raise ValueError(f"mlp_ratio must be a positive number, got {mlp_ratio!r}")
    ffn = int(round(hidden_dim * mlp_ratio))
    if ffn < 1:
        raise ValueError(f"mlp_ratio={mlp_ratio} gives an empty MLP for hidden_dim={hidden_dim}")
    return ffn


_ffn_from_ratio = ffn_dim  # check_layer_shape's ffn_dim argument shadows the function's name

NORMS = ("layernorm", "rmsnorm")
# The gated layer activations and their kernel activation (what memory.estimate tells apart).
GATED_ACTIVATIONS = {name: ACTIVATIONS[name] for name in GATED_LAYER_ACTIVATIONS}


def check_layer_shape(hidden_dim, num_heads, mlp_ratio=4.0, *, num_kv_heads=None, ffn_dim=None, norm="layernorm",
                      activation="gelu", rope_theta=None, sliding_window=None, head_dim=None):
    """(head_dim, num_kv_heads, ffn) of a decoder layer with these settings, or the error naming what does not fit.

    Shared by the layer's constructor and memory.estimate/plan, so estimates exist exactly for
    layers that can be built. ffn_dim, when given, wins over mlp_ratio. head_dim, when given, is the
    attention's own head width (q is num_heads * head_dim wide, which need not be hidden_dim: gpt-oss,
    Gemma); None: hidden_dim / num_heads.
    """
    derived = head_dim is None
    if derived:
        head_dim = check_heads(hidden_dim, num_heads)
    else:
        check_positive_int(hidden_dim, "hidden_dim")
        check_positive_int(num_heads, "num_heads")
        check_positive_int(head_dim, "head_dim")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim {head_dim} is not supported: at most {MAX_HEAD_DIM}")
    if num_kv_heads is None:
        num_kv_heads = num_heads
    check_positive_int(num_kv_heads, "num_kv_heads")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}): grouped-query "
                         "attention shares each k/v head among num_heads / num_kv_heads query heads")
    ffn = check_positive_int(ffn_dim, "ffn_dim") if ffn_dim is not None else _ffn_from_ratio(hidden_dim, mlp_ratio)
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(map(repr, NORMS))}, got {norm!r}")
    if activation not in LAYER_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, LAYER_ACTIVATIONS))}, got {activation!r}")
    if rope_theta is not None:
        check_positive_float(rope_theta, "rope_theta")
        if head_dim % 2:
            got = f"hidden_dim / num_heads = {head_dim}" if derived else f"head_dim = {head_dim}"
            raise ValueError(f"rotary embeddings need an even head dim, got {got}")
    if sliding_window is not None:
        check_positive_int(sliding_window, "sliding_window")
    return head_dim, num_kv_heads, ffn
