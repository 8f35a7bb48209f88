"""Which kernel runs one attention call: ours, or a PyTorch fused attention kernel that keeps what ours keeps.

Without dropout and soft-capping (and any argument added after those: ours), PyTorch's FlashAttention, its
memory-efficient kernel and its CPU flash kernel keep exactly what ours keeps for backward: q, k, v, the output and
the row logsumexp. Such a call may run on whichever is fastest, with the same saved bytes: the output lands in the
op's [B, Sq, H, D] buffer and the logsumexp in its fp32 [B, H, Sq] (+inf where a row attends nothing); a kernel that
pads or lays out its logsumexp differently is converted on the way in and out (docs/kernels/attention.md,
"Backends"). Both ops call `choose_for` with the same arguments, so backward runs the backward of the kernel that ran
forward; the saved tensors mean the same thing for every kernel, so even a setting changed between forward and
backward gives right gradients.

`choose(call, setting)` is the whole rule, a pure function of a `Call` (device, capability, dtype, shapes, mask kind)
and the setting (`backend.attention_setting()`): tested on CPU branch by branch, whatever the machine.
"""

import contextlib
import functools
import logging
import math
from typing import NamedTuple

import torch

from .. import backend

OURS = "ours"
CPU_FLASH = "sdpa_cpu_flash"  # aten._scaled_dot_product_flash_attention_for_cpu
FLASH = "sdpa_flash"  # aten._flash_attention_forward: FlashAttention-2, dense or varlen (PyTorch's varlen_attn)
EFFICIENT = "sdpa_efficient"  # aten._efficient_attention_forward: the memory-efficient (cutlass) kernel

# Measured ours against the CPU flash kernel, fwd+bwd (bench.attention --backends; docs/kernels/attention.md,
# "Backends"): on an AMD EPYC ours was faster in bf16 at every length (1.9-2.5x) and in fp32 from 256 keys on
# (1.13-1.64x); below 256 keys in fp32 the CPU flash kernel was, run under its own autograd node (0.83-0.95 of our
# time in 8 of 9 rows). So "auto" on CPU runs the CPU flash kernel for fp32 calls with fewer keys than
# CPU_FLASH_BELOW that it expresses, ours for the rest; "sdpa" forces the CPU flash kernel wherever it expresses
# the call.
CPU_FLASH_BELOW = 256

_log = logging.getLogger("selective_ckpt")


class Call(NamedTuple):
    """What the choice depends on, nothing else. capability: (major, minor) of a CUDA device, () on CPU;
    flash / efficient: whether the installed torch has that CUDA kernel."""
    device: str
    capability: tuple
    dtype: torch.dtype
    head_dim: int
    heads: int
    kv_heads: int
    sq: int
    sk: int
    causal: bool
    padding: bool
    documents: bool
    window: int
    dropout: bool
    softcap: bool
    q_offset: int
    extra: bool = False
    flash: bool = True
    efficient: bool = True


def _bottom_right(c):
    """Whether the query rows are the last Sq key positions: FlashAttention's causal and window alignment."""
    return c.q_offset + c.sq == c.sk


def cpu_auto_flash(dtype, sk):
    """Whether "auto" on CPU prefers the CPU flash kernel for a call of `dtype` over `sk` keys (CPU_FLASH_BELOW)."""
    return dtype == torch.float32 and sk < CPU_FLASH_BELOW


def cpu_flash_expresses(c):
    """The CPU flash kernel: top-left causal (so q_offset only without causal), padding as an additive mask, GQA;
    no windows or documents."""
    if c.window or c.documents:
        return False
    return not (c.causal and c.q_offset)


def flash_expresses(c):
    """FlashAttention-2 on CUDA (sm80+, fp16/bf16, D % 8 == 0, D <= 256; D > 192 backward only on sm80 and sm90):
    no padding mask; causal and windows bottom-right aligned, i.e. query row i at key Sk - Sq + i, which is
    q_offset = Sk - Sq (Sq = Sk without offset); documents as varlen (one packed row, no offset); GQA native."""
    if not c.flash or c.capability < (8, 0) or c.dtype not in (torch.float16, torch.bfloat16):
        return False
    if c.head_dim % 8 or c.head_dim > 256 or (c.head_dim > 192 and c.capability not in ((8, 0), (9, 0))):
        return False
    if c.padding:
        return False
    if c.documents:
        return c.q_offset == 0
    if (c.causal or c.window) and not _bottom_right(c):
        return False
    return True


def efficient_expresses(c):
    """The memory-efficient kernel on CUDA (sm50+, fp32/fp16/bf16, D % 8 == 0, D <= 128): padding as an additive
    bias, causal top-left (q_offset 0) or bottom-right (q_offset = Sk - Sq); no GQA, windows or documents."""
    if not c.efficient or c.capability < (5, 0) or c.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    if c.head_dim % 8 or c.head_dim > 128 or c.kv_heads != c.heads or c.window or c.documents:
        return False
    return not (c.causal and c.q_offset and not _bottom_right(c))


_CUDA_ORDER = ((FLASH, flash_expresses), (EFFICIENT, efficient_expresses))


def choose(c, setting="auto"):
    """The kernel for call `c` under `setting` ("auto", "ours", "sdpa", or one kernel's name forced where it
    expresses the call). Dropout (the contract's mask), soft-capping and any further argument are ours alone."""
    if setting == OURS or c.dropout or c.softcap or c.extra or c.sq == 0:
        return OURS
    if c.device == "cpu":
        if setting == "auto" and not cpu_auto_flash(c.dtype, c.sk):
            return OURS
        if setting in ("auto", "sdpa", CPU_FLASH) and cpu_flash_expresses(c):
            return CPU_FLASH
        return OURS
    if c.device == "cuda":
        for name, expresses in _CUDA_ORDER:
            if setting in ("auto", "sdpa", name) and expresses(c):
                return name
    return OURS


@functools.cache
def _capability(index):
    return torch.cuda.get_device_capability(index)


@functools.cache
def _cuda_kernels():
    """(flash, efficient): whether this torch build has each CUDA kernel (ROCm's differ: ours there)."""
    if torch.version.hip is not None:
        return False, False
    cuda = torch.backends.cuda
    return cuda.is_flash_attention_available(), True


_logged = set()


def choose_for(q, k, mask, cu_seqlens, causal, window, dropout_p, softcap, q_offset, extra=False):
    """choose() for the op's arguments under the current setting; the first call of each kind logs its choice."""
    setting = backend.attention_setting()
    if setting == OURS or (q.is_cpu and setting == "auto" and not cpu_auto_flash(q.dtype, k.shape[2])):  # ours
        if not _log.isEnabledFor(logging.DEBUG):
            return OURS
    device = q.device.type
    if device == "cuda":
        capability = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
        flash, efficient = _cuda_kernels()
    else:
        capability, flash, efficient = (), False, False
    B, H, Sq, D = q.shape
    call = Call(device, capability, q.dtype, D, H, k.shape[1], Sq if B else 0, k.shape[2], bool(causal),
                mask is not None, cu_seqlens is not None, int(window or 0), dropout_p > 0, bool(softcap), int(q_offset),
                bool(extra), flash, efficient)
    name = choose(call, setting)
    if _log.isEnabledFor(logging.DEBUG):
        kind = (name, setting, device, q.dtype, call.causal, call.padding, call.documents, call.window > 0,
                call.q_offset > 0, call.kv_heads != H)
        if kind not in _logged:  # one line per kind of call, not per call
            _logged.add(kind)
            _log.debug("selective_ckpt.attention runs %s (setting %r): %s q %s k %s causal=%s padding=%s "
                       "documents=%s window=%s q_offset=%s", name, setting, q.dtype, list(q.shape), list(k.shape),
                       causal, mask is not None, cu_seqlens is not None, window, q_offset)
    return name


_PLAIN_CPU = {}  # (setting, dtype, q shape, k shape, causal) -> choose_for's kernel for a plain CPU call
_PLAIN_CPU_MAX = 1024  # distinct shapes remembered (a run with varying lengths starts over past this)


def choose_plain_cpu(q, k, causal, setting):
    """choose_for(q, k) for a CPU call without padding, documents, window, dropout, soft-cap, offset or extra
    argument, under `setting` (backend.attention_setting(), read by the caller): the same kernel, remembered per
    shape and setting (choose is a pure function of its Call, and for such a call the Call is made of these), as
    building the Call costs as much as a small call's kernel. While choices are logged, choose_for itself, which
    logs them."""
    if _log.isEnabledFor(logging.DEBUG):
        return choose_for(q, k, None, None, causal, 0, 0.0, 0.0, 0)
    key = (setting, q.dtype, q.shape, k.shape, causal)
    name = _PLAIN_CPU.get(key)
    if name is None:
        name = choose_for(q, k, None, None, causal, 0, 0.0, 0.0, 0)
        if len(_PLAIN_CPU) >= _PLAIN_CPU_MAX:
            _PLAIN_CPU.clear()
        _PLAIN_CPU[key] = name
    return name


# ---------------------------------------------------------------------------------------------
# The PyTorch kernels, adapted to the op's buffers

def _additive_mask(mask, dtype, pad_to=1):
    """Bool key padding [B, Sk] (True = attend) -> additive [B, 1, 1, Sk] of `dtype` (0 / -inf); `pad_to` rounds
    the allocation of the last dim up (an aligned row stride) and the view keeps Sk."""
    B, Sk = mask.shape
    bias = torch.zeros(B, 1, 1, -(-Sk // pad_to) * pad_to, dtype=dtype, device=mask.device)[..., :Sk]
    return bias.masked_fill_(~mask[:, None, None, :], -math.inf)


def _empty_rows(lse, mask):
    """lse = +inf on the rows of batches whose padding mask attends nothing (the op's convention)."""
    if mask is not None:
        lse.masked_fill_(~mask.any(-1)[:, None, None], math.inf)


def _buffer(out):
    """A kernel's output as the op's contiguous [B, Sq, H, D] buffer: itself where it is laid out so, else a copy.
    `out` is given as [B, Sq, H, D] (a view of whatever the kernel allocated)."""
    return out if out.is_contiguous() else out.contiguous()


def _lse(ls, shape):
    """A kernel's logsumexp (any layout, rows Sq of the last dim kept) as the op's contiguous fp32 [B, H, Sq]."""
    ls = ls[..., :shape[2]]
    return ls if ls.is_contiguous() and tuple(ls.shape) == shape else ls.reshape(shape).contiguous()


def _flash_window(causal, window):
    """Our window w (keys j > i - w) as FlashAttention's (left, right): left = w - 1, right 0 causal, else none."""
    return (window - 1 if window else -1), (0 if causal else -1)


def forward(name, q, k, v, mask, cu_seqlens, causal, window, scale, q_offset):
    """Kernel `name`'s forward: (o, lse) as the op returns them, o its contiguous [B, Sq, H, D] buffer and lse fp32
    [B, H, Sq] with +inf where a row attends nothing."""
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    if name == CPU_FLASH:
        bias = None if mask is None else _additive_mask(mask, q.dtype)
        out, ls = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                             scale=scale)
        lse = _lse(ls, (B, H, Sq))  # its logsumexp is laid out [B, Sq, H]: one copy
        _empty_rows(lse, mask)
        return _buffer(out.transpose(1, 2)), lse  # it allocates [B, Sq, H, D]: no copy
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, S, H, D]: the CUDA kernels' layout
    if name == FLASH:
        left, right = _flash_window(causal, window)
        if cu_seqlens is not None:  # one packed row: varlen over [S, H, D]; max lengths bounded by S (no sync)
            out, ls, *_ = torch.ops.aten._flash_attention_forward(
                qt[0], kt[0], vt[0], cu_seqlens, cu_seqlens, Sq, Sk, 0.0, causal, False, scale=scale,
                window_size_left=left, window_size_right=right)
            out = out[None]  # its lse is [H, S]
        else:
            out, ls, *_ = torch.ops.aten._flash_attention_forward(
                qt, kt, vt, None, None, Sq, Sk, 0.0, causal, False, scale=scale, window_size_left=left,
                window_size_right=right)
        return _buffer(out), _lse(ls, (B, H, Sq))
    if name == EFFICIENT:
        bias = None if mask is None else _additive_mask(mask, q.dtype, 16).expand(B, H, Sq, Sk)
        out, ls, *_ = torch.ops.aten._efficient_attention_forward(
            qt, kt, vt, bias, None, None, Sq, Sk, 0.0, _efficient_mask_type(causal, q_offset), True, scale=scale)
        lse = _lse(ls, (B, H, Sq))  # its logsumexp is padded to a multiple of 32 rows: one copy
        if mask is not None:  # rows attending nothing: 0, whatever the kernel leaves there
            _empty_rows(lse, mask)
            out.masked_fill_(~mask.any(-1)[:, None, None, None], 0)
        return _buffer(out), lse
    raise ValueError(f"unknown attention kernel {name!r}")


def cpu_flash_as_itself(q, k, v, causal, scale):
    """(o, lse) of the CPU flash kernel called as the aten op it is, under its own autograd node (no padding mask,
    no offset): o [B, H, Sq, D] over the [B, Sq, H, D] buffer it allocates, lse in its own [B, Sq, H] layout."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


@contextlib.contextmanager
def deterministic():
    """PyTorch's CUDA attention backwards split the keys and add up dQ (or dK, dV) atomically unless deterministic
    algorithms are on (warn-only is not on): on for the call, so the same inputs give the same bits, as ours do.
    The flag is the process's; the backward of one device runs on one autograd thread, so no other op of it
    runs meanwhile."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if was and not warn_only:
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _efficient_mask_type(causal, q_offset):
    return 0 if not causal else (1 if q_offset == 0 else 2)  # none, causal from top-left, from bottom-right


def backward(name, do, q, k, v, o, lse, mask, cu_seqlens, causal, window, scale, q_offset):
    """Kernel `name`'s backward from the saved tensors: dq, dk, dv, contiguous [B, H(kv), S, D] as the op returns."""
    if name == CPU_FLASH:
        bias = None if mask is None else _additive_mask(mask, q.dtype)
        g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse, 0.0, causal, attn_mask=bias, scale=scale)
    elif name == FLASH:
        left, right = _flash_window(causal, window)
        qt, kt, vt, ot, dot = (t.transpose(1, 2) for t in (q, k, v, o, do))
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # unused without dropout
        unused = torch.empty(0, device=q.device)
        Sq, Sk = q.shape[2], k.shape[2]
        if cu_seqlens is not None:
            with deterministic():
                g = torch.ops.aten._flash_attention_backward(
                    dot[0], qt[0], kt[0], vt[0], ot[0], lse[0], cu_seqlens, cu_seqlens, Sq, Sk, 0.0, causal,
                    rng_state, unused, scale=scale, window_size_left=left, window_size_right=right)
            g = [t[None] for t in g]
        else:
            with deterministic():
                g = torch.ops.aten._flash_attention_backward(
                    dot, qt, kt, vt, ot, lse, None, None, Sq, Sk, 0.0, causal, rng_state, unused, scale=scale,
                    window_size_left=left, window_size_right=right)
        g = [t.transpose(1, 2) for t in g]
    elif name == EFFICIENT:
        B, H, Sq, _ = q.shape
        Sk = k.shape[2]
        qt, kt, vt, ot, dot = (t.transpose(1, 2) for t in (q, k, v, o, do))
        bias = None if mask is None else _additive_mask(mask, q.dtype, 16).expand(B, H, Sq, Sk)
        padded = lse.new_full((B, H, -(-Sq // 32) * 32), math.inf)  # the kernel's own lse layout
        padded[:, :, :Sq] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # unused without dropout
        with deterministic():
            g = torch.ops.aten._efficient_attention_backward(
                dot, qt, kt, vt, bias, ot, None, None, Sq, Sk, padded, 0.0, seed, seed,
                _efficient_mask_type(causal, q_offset), False, scale=scale)[:3]
        g = [t.transpose(1, 2) for t in g]
    else:
        raise ValueError(f"unknown attention kernel {name!r}")
    return tuple(t if t.is_contiguous() else t.contiguous() for t in g)  # the op's layout: [B, H(kv), S, D]
