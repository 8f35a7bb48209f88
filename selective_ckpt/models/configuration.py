"""What a converted decoder layer keeps under the configuration it trains in, from its modules.

Reads the dtypes the layer's tensors will have (the residual stream, attention and the MLP's
matmul outputs) and its LoRA adapters, and hands them to memory.estimate, so the floor a user
is promised is the one for the configuration they run: fp32 weights under autocast, a 16-bit
model, LoRA with or without dropout, 4-bit bases after prepare_model_for_kbit_training.
"""

import torch
from torch import nn

from .. import compat
from ..memory.estimate import LoRA, estimate
from ..registry import state_of


def _base(module):
    return getattr(module, "base_layer", module)


def _projections(layer):
    """(name, projection) for the Linear-like modules of the layer (LoRA wrappers unwrapped)."""
    out = []
    for name, m in layer.named_modules():
        if hasattr(m, "base_layer") or compat.is_quantized_linear(m) or type(m) in (nn.Linear,) or \
                compat.is_conv1d(m):
            if any(name.startswith(p + ".") for p, _ in out):
                continue
            out.append((name, m))
    return out


def _lora(layer, autocast_dtype):
    ranks, dtype, dropout = {}, None, 0.0
    for name, m in _projections(layer):
        if not hasattr(m, "lora_A") or getattr(m, "disable_adapters", False) or getattr(m, "merged", False):
            continue
        for adapter in m.active_adapters:
            if adapter not in m.lora_A:
                continue
            ranks[f"{name}/{adapter}"] = m.r[adapter]
            dtype = autocast_dtype or m.lora_A[adapter].weight.dtype
            drop = m.lora_dropout[adapter]
            dropout = max(dropout, float(drop.p) if isinstance(drop, nn.Dropout) else 0.0)
    return LoRA(ranks, dtype, dropout, scaling_kept=not _fused_lora(layer, autocast_dtype)) if ranks else None


def _fused_lora(layer, autocast_dtype):
    """Whether the layer's training forward computes its adapters in the fused layout's nodes (models/fused_layer.py)
    rather than in PEFT's forward."""
    from . import fused_layer

    state = state_of(layer)
    if state.policy.recompute != "selective":  # "none" runs PEFT's forward
        return False
    layout = fused_layer.layout_of(layer)
    if layout is None:
        return False
    dtype = layout.norm_params[0]["weight"].dtype
    calls = fused_layer._lora_calls(layout, dtype, autocast_dtype is not None)
    return calls is not False and any(calls)


def training_dtypes(layer, autocast_dtype=None):
    """{residual_dtype, dtype (attention), mlp_dtype} of a converted layer under the given autocast."""
    bases = [_base(m) for _, m in _projections(layer)]
    floating = [b.weight.dtype for b in bases if b.weight.is_floating_point()]
    norms = [p.dtype for n, p in layer.named_parameters() if "norm" in n and p.is_floating_point()]
    # the projections' dtype; with every base quantized, the norms' (or any floating parameter's: GPT-2's ln_1)
    others = norms or [p.dtype for p in layer.parameters() if p.is_floating_point()]
    residual = floating[0] if floating else others[0]
    if autocast_dtype is not None and residual == torch.float32:
        compute = autocast_dtype
    else:
        compute = floating[0] if floating else residual
    # a quantized base casts its output back to its input's dtype (the residual stream's)
    quantized = any(compat.is_quantized_linear(b) for b in bases)
    mlp = residual if quantized else compute
    return {"residual_dtype": residual, "dtype": compute, "mlp_dtype": mlp}


def layer_estimate(layer, seq_len, batch, autocast_dtype=None, breakdown=False):
    """memory.estimate for a converted Hugging Face decoder layer in its training configuration:
    its shape, recompute mode, dtypes under `autocast_dtype` (None: no autocast) and LoRA adapters."""
    state = state_of(layer)
    if state is None:
        raise TypeError(f"layer must be a converted decoder layer (selective_ckpt.convert), got {type(layer).__name__}")
    shape = state.shape()
    shape.pop("dtype", None)
    attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
    dropout = getattr(attn, "attention_dropout", 0.0) if attn is not None else 0.0
    return estimate(seq_len=seq_len, batch=batch, recompute=state.recompute, breakdown=breakdown,
                    attn_dropout=float(dropout or 0.0) if layer.training else 0.0,
                    dropout=_residual_dropout(layer, attn) if layer.training else 0.0,
                    lora=_lora(layer, autocast_dtype), **training_dtypes(layer, autocast_dtype), **shape)


def _residual_dropout(layer, attn):
    """The rate of the dropouts on the layer's residual branches (attention output and MLP output), which
    keep a seed each: the layer's own nn.Dropout children (GPT-NeoX) or its attention's functional
    `residual_dropout` (Starcoder2)."""
    rates = [m.p for m in layer.children() if type(m) is nn.Dropout]
    rates.append(getattr(attn, "residual_dropout", 0.0) if attn is not None else 0.0)
    return float(max(rates) or 0.0)
