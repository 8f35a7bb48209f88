"""Swap the decoder layers of existing models for SelectiveDecoderLayers carrying the same weights.

Handled, in place:
- Hugging Face transformers' GPT2Block (GPT-2's Conv1D keeps weights as [in, out]: transposed here;
  gelu_new / gelu_pytorch_tanh -> "gelu_tanh", gelu -> "gelu"; attn_pdrop and resid_pdrop; causal).
  The replacement accepts GPT2Block's call signature (hidden_states, cache, attention_mask,
  encoder_hidden_states, encoder_attention_mask, use_cache, **kwargs) and GPT-2's 2-D or 4-D masks
  when they are causal-plus-key-padding. The model's config.use_cache is switched off, since the
  replacement does not fill a kv cache.
- modules shaped like selective_ckpt.baseline.EagerDecoderLayer: pre-LN ln1 -> nn.MultiheadAttention
  -> dropout, ln2 -> mlp = Sequential(Linear, GELU, Linear[, Dropout]).

Anything that cannot be reproduced faithfully (cross-attention, kv-cache use, other activations,
masks beyond causal + key padding, mismatched dropout rates) raises a ValueError naming the module;
every layer is checked before any is replaced, so a failed convert changes nothing.
"""

import weakref

import torch
from torch import nn

from .layers import SelectiveDecoderLayer, check_mode

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


class ConversionError(ValueError):
    """A module that convert() cannot replace without changing what it computes."""


def _factory(module):
    p = next(module.parameters())
    return {"device": p.device, "dtype": p.dtype}


@torch.no_grad()
def _copy(dst, src, transpose=False):
    dst.copy_(src.t() if transpose else src)
    dst.requires_grad_(src.requires_grad)


def _gpt2_block_class():
    try:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    except Exception:  # transformers missing or broken: nothing of it can be in the model
        return None
    return GPT2Block


def _mask_to_padding(mask, batch, seq, name):
    """GPT-2's attention mask -> key padding mask [B, S] bool (True = attend) or None.

    Accepts None, a 2-D [B, S] mask (1/True = attend) and a 4-D [B, 1 or H, S, S] mask (bool, or
    additive float with 0 = attend) that equals causal & key padding on every query row that can
    attend at all (rows of padded queries may be all masked or all open).
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ConversionError(f"{name}: attention_mask must be a tensor or None, got {type(mask).__name__}")
    if mask.dim() == 2:
        if mask.shape != (batch, seq):
            raise ConversionError(f"{name}: 2-D attention_mask must be [B={batch}, S={seq}], got {list(mask.shape)}")
        pad = mask.bool() if mask.dtype == torch.bool else mask != 0
        return None if bool(pad.all()) else pad
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[-2:] != (seq, seq):
        raise ConversionError(f"{name}: attention_mask of shape {list(mask.shape)} is not [B, 1, S, S] for "
                              f"B={batch}, S={seq} (kv-cache masks are not supported)")
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        if not mask.is_floating_point():
            raise ConversionError(f"{name}: 4-D attention_mask must be bool or additive float, got {mask.dtype}")
        allowed = mask == 0
        blocked = mask < torch.finfo(mask.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise ConversionError(f"{name}: attention_mask carries an additive bias (values other than 0 and "
                                  "-inf/min), which a key padding mask cannot express")
    allowed = allowed.expand(batch, -1, -1, -1)
    if not bool((allowed == allowed[:, :1]).all()):
        raise ConversionError(f"{name}: attention_mask differs between heads; only [B, S] key padding is supported")
    allowed = allowed[:, 0]
    pad = allowed[:, -1, :]  # the last query sees every unpadded key under a causal mask
    causal = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).tril()
    expected = causal & pad[:, None, :]
    live_rows = expected.any(-1)  # rows with nothing to attend: HF may leave them open or closed
    same = (allowed == expected).all(-1) | ~live_rows
    if not bool(same.all()):
        raise ConversionError(f"{name}: attention_mask is not causal + key padding; it cannot be expressed "
                              "by SelectiveDecoderLayer")
    return None if bool(pad.all()) else pad


class GPT2SelectiveBlock(SelectiveDecoderLayer):
    """A SelectiveDecoderLayer that takes GPT2Block's call signature (transformers 5.x)."""

    module_name = "GPT2Block"

    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, **kwargs):
        name = self.module_name
        if encoder_hidden_states is not None or encoder_attention_mask is not None:
            raise ConversionError(f"{name}: cross-attention inputs (encoder_hidden_states) are not supported")
        past = [kwargs.pop(k, None) for k in ("past_key_values", "layer_past")]
        if use_cache or cache is not None or any(p is not None for p in past):
            raise ConversionError(f"{name}: kv-cache use (use_cache=True, a cache or layer_past) is not supported; "
                                  "call the model with use_cache=False")
        if kwargs.pop("output_attentions", False):
            raise ConversionError(f"{name}: output_attentions=True is not supported (attention weights are never "
                                  "materialised)")
        pad = _cached_padding(attention_mask, hidden_states.shape[0], hidden_states.shape[1], name)
        return super().forward(hidden_states, pad)


_LAST_MASK = [None]  # (weakref to mask, its version, B, S, padding): GPT2Model hands every block one mask


def _cached_padding(mask, batch, seq, name):
    """_mask_to_padding, checked once per mask tensor rather than once per block."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.is_inference():  # no version counter
        return _mask_to_padding(mask, batch, seq, name)
    last = _LAST_MASK[0]
    if last is not None and last[0]() is mask and last[1:4] == (mask._version, batch, seq):
        return last[4]
    pad = _mask_to_padding(mask, batch, seq, name)
    _LAST_MASK[0] = (weakref.ref(mask), mask._version, batch, seq, pad)
    return pad


def _from_gpt2(block, name, recompute):
    attn, mlp = block.attn, block.mlp
    config = attn.config
    if hasattr(block, "crossattention") or getattr(config, "add_cross_attention", False):
        raise ConversionError(f"{name}: GPT2Block with cross-attention cannot be converted")
    act = config.activation_function
    if act not in _GPT2_ACTIVATIONS:
        raise ConversionError(f"{name}: activation {act!r} is not supported (only {', '.join(_GPT2_ACTIVATIONS)})")
    hidden, heads = attn.embed_dim, attn.num_heads
    inner = mlp.c_fc.weight.shape[1]
    eps1, eps2 = block.ln_1.eps, block.ln_2.eps
    if eps1 != eps2:
        raise ConversionError(f"{name}: ln_1 and ln_2 have different eps ({eps1}, {eps2})")
    if attn.attn_dropout.p != config.attn_pdrop or attn.resid_dropout.p != mlp.dropout.p:
        raise ConversionError(f"{name}: the two residual dropouts differ ({attn.resid_dropout.p}, {mlp.dropout.p})")
    layer = GPT2SelectiveBlock(hidden, heads, mlp_ratio=inner / hidden, dropout=float(mlp.dropout.p),
                               attn_dropout=float(attn.attn_dropout.p), causal=True,
                               activation=_GPT2_ACTIVATIONS[act], norm_eps=eps1, bias=True, recompute=recompute,
                               **_factory(block))
    layer.module_name = f"{name} (GPT2Block)"
    head_dim = hidden // heads
    if abs(attn.scaling - head_dim**-0.5) > 1e-12 * head_dim**-0.5:
        layer.softmax_scale = float(attn.scaling)  # scale_attn_weights=False or scale by 1/(layer_idx+1)
    _copy(layer.ln1.weight, block.ln_1.weight)
    _copy(layer.ln1.bias, block.ln_1.bias)
    _copy(layer.qkv.weight, attn.c_attn.weight, transpose=True)  # Conv1D: [in, out]
    _copy(layer.qkv.bias, attn.c_attn.bias)
    _copy(layer.proj.weight, attn.c_proj.weight, transpose=True)
    _copy(layer.proj.bias, attn.c_proj.bias)
    _copy(layer.ln2.weight, block.ln_2.weight)
    _copy(layer.ln2.bias, block.ln_2.bias)
    _copy(layer.fc1.weight, mlp.c_fc.weight, transpose=True)
    _copy(layer.fc1.bias, mlp.c_fc.bias)
    _copy(layer.fc2.weight, mlp.c_proj.weight, transpose=True)
    _copy(layer.fc2.bias, mlp.c_proj.bias)
    return layer


def _is_eager_shaped(module):
    mlp = getattr(module, "mlp", None)
    return (isinstance(getattr(module, "attn", None), nn.MultiheadAttention)
            and isinstance(getattr(module, "ln1", None), nn.LayerNorm)
            and isinstance(getattr(module, "ln2", None), nn.LayerNorm)
            and isinstance(mlp, nn.Sequential) and len(mlp) >= 3 and isinstance(mlp[0], nn.Linear)
            and isinstance(mlp[2], nn.Linear))


def _from_eager(module, name, recompute):
    attn, mlp = module.attn, module.mlp
    if not isinstance(mlp[1], nn.GELU):
        raise ConversionError(f"{name}: activation {type(mlp[1]).__name__} is not supported (only nn.GELU)")
    extra = list(mlp)[3:]
    if len(extra) > 1 or (extra and not isinstance(extra[0], nn.Dropout)):
        raise ConversionError(f"{name}: mlp must be Linear, GELU, Linear[, Dropout], got {list(map(type, mlp))}")
    if not attn.batch_first:
        raise ConversionError(f"{name}: nn.MultiheadAttention must be batch_first=True")
    if not attn._qkv_same_embed_dim or attn.bias_k is not None or attn.add_zero_attn or attn.in_proj_weight is None:
        raise ConversionError(f"{name}: nn.MultiheadAttention with kdim/vdim, add_bias_kv or add_zero_attn is not "
                              "self-attention as SelectiveDecoderLayer computes it")
    resid = module.dropout.p if isinstance(getattr(module, "dropout", None), nn.Dropout) else 0.0
    mlp_p = extra[0].p if extra else 0.0
    if resid != mlp_p:
        raise ConversionError(f"{name}: attention and MLP residual dropouts differ ({resid}, {mlp_p})")
    lns = (module.ln1, module.ln2)
    if any(ln.weight is None for ln in lns) or module.ln1.eps != module.ln2.eps:
        raise ConversionError(f"{name}: LayerNorms must be affine with one eps")
    biases = {attn.in_proj_bias is not None, attn.out_proj.bias is not None, mlp[0].bias is not None,
              mlp[2].bias is not None, module.ln1.bias is not None, module.ln2.bias is not None}
    if len(biases) != 1:
        raise ConversionError(f"{name}: either every projection and LayerNorm has a bias or none does")
    bias = biases.pop()
    hidden, heads = attn.embed_dim, attn.num_heads
    inner = mlp[0].out_features
    layer = SelectiveDecoderLayer(hidden, heads, mlp_ratio=inner / hidden, dropout=float(resid),
                                  attn_dropout=float(attn.dropout), causal=bool(getattr(module, "causal", True)),
                                  activation="gelu_tanh" if mlp[1].approximate == "tanh" else "gelu",
                                  norm_eps=module.ln1.eps, bias=bias, recompute=recompute, **_factory(module))
    pairs = [(layer.ln1.weight, module.ln1.weight), (layer.ln2.weight, module.ln2.weight),
             (layer.qkv.weight, attn.in_proj_weight), (layer.proj.weight, attn.out_proj.weight),
             (layer.fc1.weight, mlp[0].weight), (layer.fc2.weight, mlp[2].weight)]
    if bias:
        pairs += [(layer.ln1.bias, module.ln1.bias), (layer.ln2.bias, module.ln2.bias),
                  (layer.qkv.bias, attn.in_proj_bias), (layer.proj.bias, attn.out_proj.bias),
                  (layer.fc1.bias, mlp[0].bias), (layer.fc2.bias, mlp[2].bias)]
    for dst, src in pairs:
        _copy(dst, src)
    return layer


def convert(model, recompute="selective"):
    """Replaces every GPT2Block and EagerDecoderLayer-shaped module of `model` in place.

    Returns (model, replaced): `replaced` lists the qualified names of the swapped modules ("" for
    the root, in which case the returned model is the new layer). Raises ConversionError (a
    ValueError) naming the module when a layer cannot be converted faithfully; then nothing changes.
    """
    check_mode(recompute)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    gpt2_block = _gpt2_block_class()
    plan = []
    for name, module in model.named_modules():
        if isinstance(module, SelectiveDecoderLayer) or any(name.startswith(p + ".") for p, _ in plan if p):
            continue
        label = name or type(module).__name__
        if gpt2_block is not None and isinstance(module, gpt2_block):
            new = _from_gpt2(module, label, recompute)
        elif _is_eager_shaped(module):
            new = _from_eager(module, label, recompute)
        else:
            continue
        new.train(module.training)
        plan.append((name, new))
    for name, new in plan:
        if not name:
            return new, [""]
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    if plan and gpt2_block is not None and getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False
    return model, [name for name, _ in plan]
