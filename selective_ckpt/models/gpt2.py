"""Hugging Face GPT-2: GPT2Block -> a SelectiveDecoderLayer carrying the same weights.

GPT-2's Conv1D keeps weights as [in, out] (transposed here); gelu_new / gelu_pytorch_tanh ->
"gelu_tanh", gelu -> "gelu"; attn_pdrop and resid_pdrop; causal. The replacement accepts
GPT2Block's call signature (hidden_states, cache, attention_mask, encoder_hidden_states,
encoder_attention_mask, use_cache, **kwargs) and GPT-2's 2-D or 4-D masks when they are
causal-plus-key-padding. The model's config.use_cache is switched off by convert(), since the
replacement does not fill a kv cache.
"""

import weakref

import torch

from ..layers import SelectiveDecoderLayer
from .common import ConversionError, copy_param, factory

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
USES_KV_CACHE = True  # convert() turns config.use_cache off for models holding these blocks


def block_class():
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


def convert_block(block, name, recompute):
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
                               **factory(block))
    layer.module_name = f"{name} (GPT2Block)"
    head_dim = hidden // heads
    if abs(attn.scaling - head_dim**-0.5) > 1e-12 * head_dim**-0.5:
        layer.softmax_scale = float(attn.scaling)  # scale_attn_weights=False or scale by 1/(layer_idx+1)
    copy_param(layer.ln1.weight, block.ln_1.weight)
    copy_param(layer.ln1.bias, block.ln_1.bias)
    copy_param(layer.qkv.weight, attn.c_attn.weight, transpose=True)  # Conv1D: [in, out]
    copy_param(layer.qkv.bias, attn.c_attn.bias)
    copy_param(layer.proj.weight, attn.c_proj.weight, transpose=True)
    copy_param(layer.proj.bias, attn.c_proj.bias)
    copy_param(layer.ln2.weight, block.ln_2.weight)
    copy_param(layer.ln2.bias, block.ln_2.bias)
    copy_param(layer.fc1.weight, mlp.c_fc.weight, transpose=True)
    copy_param(layer.fc1.bias, mlp.c_fc.bias)
    copy_param(layer.fc2.weight, mlp.c_proj.weight, transpose=True)
    copy_param(layer.fc2.bias, mlp.c_proj.bias)
    return layer


def matches(module):
    cls = block_class()
    return cls is not None and isinstance(module, cls)
