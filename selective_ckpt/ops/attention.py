"""Fused attention-softmax-dropout that keeps only q, k, v, o, the row logsumexp and a seed.

Neither forward nor backward stores anything of size Sq x Sk: backward rebuilds the softmax from
the logsumexp and the dropout mask from the seed (docs/DESIGN.md, "Attention" and "The dropout
contract"). The forward op returns o, a [B, H, Sq, D] view of a contiguous [B, Sq, H, D] buffer,
and the row logsumexp (fp32 [B, H, Sq], +inf where a row attends nothing).
"""

import math
from typing import Optional

import torch

from .. import backend, rng
from ..validation import MAX_HEAD_DIM, SUPPORTED_DTYPES, check_bool


def _output(q):
    B, H, Sq, D = q.shape
    return torch.empty(B, Sq, H, D, dtype=q.dtype, device=q.device).permute(0, 2, 1, 3)


@torch.library.custom_op("selective_ckpt::attention_fwd", mutates_args=())
def attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                     causal: bool, dropout_p: float, softmax_scale: float, seed: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, Sq, _ = q.shape
    o = _output(q)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    t16, ks = rng.kernel_constants(dropout_p)
    backend.call("attention", "forward", q, k, v, o, lse, mask, None, causal, 0, softmax_scale, seed, t16, ks)
    return o, lse


@attention_fwd_op.register_fake
def _(q, k, v, key_padding_mask, causal, dropout_p, softmax_scale, seed):
    B, H, Sq, _ = q.shape
    return _output(q), q.new_empty(B, H, Sq, dtype=torch.float32)


@torch.library.custom_op("selective_ckpt::attention_bwd", mutates_args=())
def attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     lse: torch.Tensor, key_padding_mask: Optional[torch.Tensor], causal: bool, dropout_p: float,
                     softmax_scale: float, seed: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    do = do.contiguous()  # a grad from .sum().backward() has stride 0
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    t16, ks = rng.kernel_constants(dropout_p)
    backend.call("attention", "backward", do, q, k, v, o, lse.contiguous(), mask, None, causal, 0, softmax_scale,
                 seed, t16, ks, dq, dk, dv)
    return dq, dk, dv


@attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, key_padding_mask, causal, dropout_p, softmax_scale, seed):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, mask, ctx.causal, ctx.dropout_p, ctx.softmax_scale, seed = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, mask, seed)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, mask, seed = ctx.saved_tensors
    dq, dk, dv = attention_bwd_op(do, q, k, v, o, lse, mask, ctx.causal, ctx.dropout_p, ctx.softmax_scale, seed)
    return dq, dk, dv, None, None, None, None, None


attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 ([B, H, S, D]), got shape {list(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"q, k and v must share one dtype: q is {q.dtype}, {name} is {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"q, k and v must be on one device: q is on {q.device}, {name} on {t.device}")
    B, H, Sq, D = q.shape
    if k.shape[0] != B or k.shape[1] != H or k.shape[3] != D:
        raise ValueError(f"k must have shape [B={B}, H={H}, Sk, D={D}] like q, got {list(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {list(k.shape)}, got {list(v.shape)}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D (the last dim of q, k, v) must be in [1, {MAX_HEAD_DIM}], got {D}")
    if Sq < 1 or k.shape[2] < 1 or B < 1 or H < 1:
        raise ValueError(f"B, H, Sq and Sk must be at least 1, got q {list(q.shape)} and k {list(k.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")


def _check_mask(mask, q, k):
    if mask is None:
        return None
    B, Sk = q.shape[0], k.shape[2]
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a bool torch.Tensor [B, Sk] or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = attend), got {mask.dtype}")
    if tuple(mask.shape) != (B, Sk):
        raise ValueError(f"key_padding_mask must have shape [B={B}, Sk={Sk}], got {list(mask.shape)}")
    if mask.device != q.device:
        raise ValueError(f"key_padding_mask must be on q's device {q.device}, got {mask.device}")
    return mask


def _check_scale(softmax_scale, D):
    if softmax_scale is None:
        return D**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return float(softmax_scale)


def attention(q, k, v, causal=False, dropout_p=0.0, softmax_scale=None, key_padding_mask=None, seed=None):
    """softmax(q k^T * softmax_scale + masks), dropped out, times v: o [B, H, Sq, D].

    q [B, H, Sq, D], k and v [B, H, Sk, D] of one dtype (fp32, fp16, bf16), any strides with a
    contiguous last dim. `causal` lets query i attend keys j <= i (top-left, like PyTorch's
    is_causal); `key_padding_mask` [B, Sk] bool, True = attend. Rows with nothing to attend give 0.
    `dropout_p` drops normalised probabilities with the contract's mask; `seed=None` draws one from
    torch's generator when dropout_p > 0. The result is a view of a contiguous [B, Sq, H, D] buffer.
    """
    _check_qkv(q, k, v)
    check_bool(causal, "causal")
    rng.threshold(dropout_p, "dropout_p")
    mask = _check_mask(key_padding_mask, q, k)
    scale = _check_scale(softmax_scale, q.shape[-1])
    if dropout_p > 0:
        seed = rng.seed_arg(seed, q.device)
    else:
        if seed is not None:
            rng.seed_arg(seed)  # validated all the same
        seed = None  # no mask is drawn; torch's generator is left untouched
    o, _ = attention_fwd_op(q, k, v, mask, causal, float(dropout_p), scale, seed)
    return o
