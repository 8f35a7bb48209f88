"""The "selective_ckpt" entry of transformers' attention-function registry.

Converted models run attention through `selective_ckpt.attention`: causal, key padding, grouped
k/v (never expanded), Mistral/Qwen sliding windows, attention dropout by seed and packed documents.
The mask Hugging Face builds for it is its SDPA mask (a [B, 1, S, S] bool mask, or None for plain
causal); `describe_mask` turns it into key padding or document offsets and checks that this
reproduces the mask exactly — anything else is a ConversionError, never taken for padding.

Without gradients and with a kv cache (generate: Sq != Sk) the call goes to transformers' own SDPA
function with the same mask; a training call that cannot be expressed is refused.
"""

import weakref

import torch

from .. import rng
from ..ops.attention import attention
from .common import ConversionError

NAME = "selective_ckpt"


def register():
    """Registers the attention function and its mask builder with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, selective_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def _allowed(mask, name):
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ConversionError(f"{name}: attention_mask must be bool or additive float, got {mask.dtype}")
    allowed = mask == 0
    if not bool((allowed | (mask < torch.finfo(mask.dtype).min / 2)).all()):
        raise ConversionError(f"{name}: attention_mask carries an additive bias (values other than 0 and -inf/min), "
                              "which selective_ckpt.attention cannot express")
    return allowed


def describe_mask(mask, batch, seq, window, name):
    """(key_padding_mask [B, S] bool or None, cu_seqlens int32 or None) reproducing a causal 4-D mask.

    Rows with nothing to attend (padded queries) may hold anything: their outputs feed nothing real.
    """
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or tuple(mask.shape[-2:]) != (seq, seq):
        raise ConversionError(f"{name}: attention_mask of shape {list(mask.shape)} is not [B, 1, S, S] for B={batch}, "
                              f"S={seq}")
    allowed = _allowed(mask, name).expand(batch, -1, -1, -1)
    if not bool((allowed == allowed[:, :1]).all()):
        raise ConversionError(f"{name}: attention_mask differs between heads; only causal + key padding or packed "
                              "documents are supported")
    allowed = allowed[:, 0]
    pad = allowed.diagonal(dim1=-2, dim2=-1)  # every unpadded query attends itself
    idx = torch.arange(seq, device=mask.device)
    starts = torch.zeros(batch, seq, dtype=torch.bool, device=mask.device)
    if seq > 1 and window != 1:  # a document starts where a query cannot see its unpadded left neighbour
        starts[:, 1:] = pad[:, 1:] & pad[:, :-1] & ~allowed[:, idx[1:], idx[:-1]]
    doc = starts.cumsum(-1)
    expected = (idx[None, :, None] >= idx[None, None, :]) & pad[:, None, :] & (doc[:, :, None] == doc[:, None, :])
    if window:
        expected &= idx[None, :, None] - idx[None, None, :] < window
    live = expected.any(-1, keepdim=True)
    if not bool(((allowed == expected) | ~live).all()):
        raise ConversionError(f"{name}: attention_mask is neither causal + key padding nor causal packed documents"
                              f"{f' with sliding window {window}' if window else ''}; selective_ckpt cannot express it")
    has_docs, has_pad = bool(starts.any()), not bool(pad.all())
    if has_docs and (batch != 1 or has_pad):
        raise ConversionError(f"{name}: packed documents need one row (B = 1) without padding, got B={batch}"
                              f"{' with padding' if has_pad else ''}")
    cu = None
    if has_docs:
        cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=mask.device),
                        idx[starts[0]].to(torch.int32), torch.tensor([seq], dtype=torch.int32, device=mask.device)])
    return (pad if has_pad else None), cu


_LAST = [None]  # (weakref to mask, version, B, S, window, result): a model hands every layer one mask


def _cached_describe(mask, batch, seq, window, name):
    if mask.is_inference() or torch.compiler.is_compiling():
        return describe_mask(mask, batch, seq, window, name)
    last = _LAST[0]
    key = (mask._version, batch, seq, window)
    if last is not None and last[0]() is mask and last[1] == key:
        return last[2]
    result = describe_mask(mask, batch, seq, window, name)
    _LAST[0] = (weakref.ref(mask), key, result)
    return result


def _cu_seqlens(kwargs, name):
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None or not torch.equal(cu_q, cu_k):
        raise ConversionError(f"{name}: cu_seq_lens_q and cu_seq_lens_k must both be given and equal (packed "
                              "self-attention)")
    return cu_q.to(torch.int32)


def _compute_dtype(query):
    """The dtype SDPA runs in for `query`: autocast's lower precision when autocast is on (it casts
    q, k, v there, whatever RoPE promoted them to), else query's own."""
    kind = query.device.type
    if torch.is_autocast_enabled(kind) and query.dtype in (torch.float32, torch.float64):
        return torch.get_autocast_dtype(kind)
    return query.dtype


def selective_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """transformers attention function: (o [B, S, H, D], None). query [B, H, Sq, D], key/value [B, Hkv, Sk, D]."""
    name = f"{type(module).__name__} (selective_ckpt attention)"
    if kwargs.get("output_attentions") or getattr(getattr(module, "config", None), "output_attentions", False):
        raise ConversionError(f"{name}: output_attentions=True is not supported: attention weights are never "
                              "materialised")
    for unsupported in ("softcap", "position_bias", "s_aux", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise ConversionError(f"{name}: {unsupported} is not supported by selective_ckpt.attention")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    B, _, Sq, _ = query.shape
    Sk = key.shape[2]
    if Sq != Sk:
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            raise ConversionError(f"{name}: a kv cache (Sq={Sq} != Sk={Sk}) is supported without gradients only")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if not causal:
        raise ConversionError(f"{name}: only causal self-attention is supported")
    window = kwargs.get("sliding_window") or None
    pad = cu = None
    if attention_mask is not None:
        pad, cu = _cached_describe(attention_mask, B, Sq, window, name)
    cu_kw = _cu_seqlens(kwargs, name)
    if cu_kw is not None:
        if cu is not None and not torch.equal(cu, cu_kw):
            raise ConversionError(f"{name}: cu_seq_lens_q disagrees with the documents of the attention mask")
        if pad is not None:
            raise ConversionError(f"{name}: cu_seq_lens_q cannot be combined with padding")
        cu = cu_kw
    dtype = _compute_dtype(query)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    seed = rng.draw_seed_tensor(query.device) if dropout > 0 else None
    o = attention(query, key, value, True, float(dropout), scaling, pad, seed, sliding_window=window, cu_seqlens=cu)
    return o.transpose(1, 2), None
