"""Fused attention-softmax-dropout that keeps only q, k, v, o, the row logsumexp and a seed.

Neither forward nor backward stores anything of size Sq x Sk: backward rebuilds the softmax from
the logsumexp and the dropout mask from the seed (docs/kernels/attention.md and
docs/kernels/dropout.md). The forward op returns o, a [B, H, Sq, D] view of a contiguous [B, Sq, H, D]
buffer, and the row logsumexp (fp32 [B, H, Sq], +inf where a row attends nothing). k and v may have
fewer heads than q (grouped-query attention); they are never expanded. Optional attention sinks (a
per-head logit in the softmax denominator) enter the logsumexp, so backward rebuilds the sink-normalised
softmax from it as before and adds the sinks' gradient from the delta pre-pass.
"""

import math
import weakref
from typing import Optional

import torch

from .. import backend, rng
from ..double_backward import first_order_only
from ..keeping import pipeline
from ..validation import MAX_HEAD_DIM, SUPPORTED_DTYPES, check_bool
from . import attention_dispatch
from .eager import eager_ok, fast_eager


def _output(q, v):
    """The output buffer, contiguous [B, Sq, H, Dv] (v's head dim). The op returns it as it is and callers take the
    [B, H, Sq, Dv] view outside the op: an ordinary view, so in-place ops on it work as on eager
    outputs (a view made inside a custom op is refused by autograd for in-place use)."""
    B, H, Sq, _ = q.shape
    return torch.empty(B, Sq, H, v.shape[-1], dtype=q.dtype, device=q.device)


def _ours_only(q, v, sinks):
    """Arguments only our kernels take: sinks, and a value head dim other than q's (PyTorch's fused kernels are
    not dispatched to for it)."""
    return sinks is not None or v.shape[-1] != q.shape[-1]


def heads_view(o):
    """[B, Sq, H, D] -> the [B, H, Sq, D] view the kernels and the public function use."""
    return o.permute(0, 2, 1, 3)


@torch.library.custom_op("selective_ckpt::attention_fwd", mutates_args=())
def attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                     cu_seqlens: Optional[torch.Tensor], causal: bool, sliding_window: int, dropout_p: float,
                     softmax_scale: float, seed: Optional[torch.Tensor],
                     softcap: float = 0.0, q_offset: int = 0,
                     sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    kernel = attention_dispatch.choose_for(q, k, mask, cu_seqlens, causal, sliding_window, dropout_p, softcap, q_offset,
                                           extra=_ours_only(q, v, sinks))
    if kernel != attention_dispatch.OURS:  # PyTorch's kernel: the same o and lse (attention_dispatch)
        return attention_dispatch.forward(kernel, q, k, v, mask, cu_seqlens, causal, sliding_window, softmax_scale,
                                          q_offset)
    B, H, Sq, _ = q.shape
    o = _output(q, v)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    t16, ks = rng.kernel_constants(dropout_p)
    if o.numel():  # an empty batch or query length has nothing to compute
        backend.call("attention", "forward", q, k, v, heads_view(o), lse, mask, cu_seqlens, causal, sliding_window,
                     softmax_scale, softcap, seed, t16, ks, q_offset, _sinks32(sinks))
    return o, lse


def _sinks32(sinks):
    """The kernels' sinks: fp32 [H] contiguous (no copy when they are), or None."""
    return None if sinks is None else sinks.to(torch.float32).contiguous()


@attention_fwd_op.register_fake
def _(q, k, v, key_padding_mask, cu_seqlens, causal, sliding_window, dropout_p, softmax_scale, seed, softcap=0.0,
      q_offset=0, sinks=None):
    B, H, Sq, _ = q.shape
    return _output(q, v), q.new_empty(B, H, Sq, dtype=torch.float32)


@torch.library.custom_op("selective_ckpt::attention_bwd", mutates_args=())
def attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     lse: torch.Tensor, key_padding_mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                     causal: bool, sliding_window: int, dropout_p: float, softmax_scale: float,
                     seed: Optional[torch.Tensor], softcap: float = 0.0, q_offset: int = 0,
                     sinks: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and the sinks' gradient: fp32 [H] summed over the batch with sinks, else an empty [0]."""
    do = do.contiguous()  # a grad from .sum().backward() has stride 0
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    kernel = attention_dispatch.choose_for(q, k, mask, cu_seqlens, causal, sliding_window, dropout_p, softcap, q_offset,
                                           extra=_ours_only(q, v, sinks))
    if kernel != attention_dispatch.OURS:  # the backward of the kernel that ran forward (the same choice)
        return (*attention_dispatch.backward(kernel, do, q, k, v, o, lse, mask, cu_seqlens, causal, sliding_window,
                                             softmax_scale, q_offset), _dsinks(q, None))
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dsinks = _dsinks(q, sinks)
    t16, ks = rng.kernel_constants(dropout_p)
    if not do.numel():
        return dq, dk.zero_(), dv.zero_(), dsinks.zero_()
    backend.call("attention", "backward", do, q, k, v, o, lse.contiguous(), mask, cu_seqlens, causal, sliding_window,
                 softmax_scale, softcap, seed, t16, ks, dq, dk, dv, q_offset, _sinks32(sinks),
                 None if sinks is None else dsinks)
    return dq, dk, dv, dsinks


def _dsinks(q, sinks):
    return torch.empty(0 if sinks is None else q.shape[1], dtype=torch.float32, device=q.device)


@attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, key_padding_mask, cu_seqlens, causal, sliding_window, dropout_p, softmax_scale, seed,
      softcap=0.0, q_offset=0, sinks=None):
    return (*(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)), _dsinks(q, sinks))


def _setup_context(ctx, inputs, output):
    (q, k, v, mask, cu_seqlens, ctx.causal, ctx.window, ctx.dropout_p, ctx.softmax_scale, seed, ctx.softcap,
     ctx.q_offset, sinks) = inputs
    o, lse = output
    for t in (q, k, v):
        pipeline.tag(t, "qkv")
    pipeline.tag(o, "attention")
    pipeline.tag(lse, "attention")
    ctx.save_for_backward(q, k, v, o, lse, mask, cu_seqlens, seed, sinks)


@first_order_only("selective_ckpt.attention")
def _backward(ctx, do, _dlse):
    q, k, v, o, lse, mask, cu_seqlens, seed, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_bwd_op(heads_view(do), q, k, v, heads_view(o), lse, mask, cu_seqlens, ctx.causal,
                                          ctx.window, ctx.dropout_p, ctx.softmax_scale, seed, ctx.softcap,
                                          ctx.q_offset, sinks)
    dsinks = None if sinks is None else dsinks.to(sinks.dtype)  # summed in fp32, handed back in the sinks' dtype
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, dsinks


attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)
fast_eager(attention_fwd_op)
fast_eager(attention_bwd_op)


def _check_qkv(q, k, v):
    if _plain_qkv(q, k, v):
        return
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
        if not (t.is_cpu and q.is_cpu) and t.device != q.device:  # CPU tensors: one device, without making two
            raise ValueError(f"q, k and v must be on one device: q is on {q.device}, {name} on {t.device}")
    B, H, Sq, D = q.shape
    ks, vs = k.shape, v.shape
    if ks[0] != B or ks[3] != D:
        raise ValueError(f"k must have shape [B={B}, Hkv, Sk, D={D}] like q, got {list(ks)}")
    if ks[1] < 1 or H % ks[1]:
        raise ValueError(f"k and v must have a number of heads Hkv that divides q's H={H} (grouped-query "
                         f"attention: query head h reads kv head h // (H // Hkv)), got Hkv={ks[1]}")
    if vs[:3] != ks[:3]:
        raise ValueError(f"v must have shape [B, Hkv, Sk, Dv] with k's {list(ks[:3])}, got {list(vs)}")
    Dv = vs[3]
    for name, dim in (("head dim D (the last dim of q and k)", D), ("value head dim Dv (the last dim of v)", Dv)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in [1, {MAX_HEAD_DIM}], got {dim}")
    if H < 1 or (ks[2] < 1 and B * Sq > 0):
        raise ValueError(f"H and Sk must be at least 1 (B = 0 or Sq = 0 give an empty output), got q "
                         f"{list(q.shape)} and k {list(ks)}")
    for name, t, d in (("q", q, D), ("k", k, D), ("v", v, Dv)):
        if d > 1 and t.stride(-1) != 1:  # a size-1 dim's stride is never used
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")


def _plain_qkv(q, k, v):
    """Whether _check_qkv accepts q, k, v for the common case it is quick to see (one CPU dtype, heads grouped
    evenly, contiguous last dims), in fewer steps than its checks, which name what is wrong otherwise."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    dtype = q.dtype
    if dtype not in SUPPORTED_DTYPES or k.dtype != dtype or v.dtype != dtype:
        return False
    if not (q.is_cpu and k.is_cpu and v.is_cpu):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return False
    B, H, _, D = qs
    Bk, Hkv, Sk, Dk = ks
    return (Bk == B and Dk == D and vs[:3] == ks[:3] and 1 <= Hkv <= H and H % Hkv == 0 and Sk >= 1
            and 1 <= D <= MAX_HEAD_DIM and 1 <= vs[3] <= MAX_HEAD_DIM
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)


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


def _check_window(sliding_window):
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int (query i attends keys j > i - sliding_window) "
                         f"or None, got {sliding_window!r}")
    return sliding_window


_CHECKED_CU_SEQLENS = [None]  # (weakref, version, S) of the last cu_seqlens checked: models pass one per layer


def _check_cu_seqlens(cu_seqlens, q, k, mask, q_offset=0):
    """cu_seqlens as int32 [n + 1] offsets 0 = c0 <= ... <= cn = S on q's device, or the error naming it.
    S is the key length; the queries are all S positions, or with q_offset > 0 rows q_offset ... q_offset + Sq."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be an int32 torch.Tensor [n + 1] or None, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be an int32 (or int64) tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 offsets, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
    B, _, Sq, _ = q.shape
    S = k.shape[2]
    if B != 1:
        raise ValueError(f"cu_seqlens needs the documents packed into one row (B = 1), got B={B}")
    if q_offset == 0 and S != Sq:  # a query tile past the start says where it stands (q_offset, checked before)
        raise ValueError(f"cu_seqlens needs q, k and v of one length (packed self-attention) or a query tile's "
                         f"q_offset > 0, got Sq={Sq}, Sk={S}")
    if mask is not None:
        raise ValueError("key_padding_mask and cu_seqlens cannot be combined: packed documents carry no padding")
    last = _CHECKED_CU_SEQLENS[0]
    if not (last is not None and last[0]() is cu_seqlens and last[1:] == (cu_seqlens._version, S)):
        offsets = cu_seqlens.tolist()  # one read per distinct tensor (a model hands every layer the same one)
        if offsets[0] != 0 or offsets[-1] != S:
            raise ValueError(f"cu_seqlens must start at 0 and end at S={S}, got {offsets[0]} ... {offsets[-1]}")
        if any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
        if not cu_seqlens.is_inference():
            _CHECKED_CU_SEQLENS[0] = (weakref.ref(cu_seqlens), cu_seqlens._version, S)
    return cu_seqlens.to(torch.int32).contiguous()


def _check_q_offset(q_offset, Sq, Sk):
    """q_offset as an int: 0, or > 0 with q_offset + Sq <= Sk (the query rows are key positions q_offset ...).
    A SymInt (a tile bound from a dynamic shape under torch.compile) stays symbolic."""
    if isinstance(q_offset, bool) or not isinstance(q_offset, (int, torch.SymInt)):
        raise ValueError(f"q_offset must be an int >= 0 (query row i stands at key position i + q_offset), got "
                         f"{q_offset!r}")
    if q_offset < 0 or (q_offset > 0 and q_offset + Sq > Sk):
        raise ValueError(f"q_offset must be >= 0 with q_offset + Sq <= Sk (query row i stands at key position "
                         f"i + q_offset), got q_offset={q_offset}, Sq={Sq}, Sk={Sk}")
    return q_offset


def _check_scale(softmax_scale, D):
    if softmax_scale is None:
        return D**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return float(softmax_scale)


def check_softcap(softcap, name="softcap"):
    """A soft-cap as the kernels take it: None or 0 -> 0.0 (none), else a finite float > 0."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{name} must be a Python float or None, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"{name} must be a finite number > 0 (or None / 0 for none), got {softcap}")
    return float(softcap)


def check_sinks(sinks, q, name="sinks"):
    """sinks as the op takes them: None, or a floating-point tensor [H] on q's device."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [H] (one logit per query head) or None, got "
                        f"{type(sinks).__name__}")
    if not sinks.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {sinks.dtype}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"{name} must have shape [H={q.shape[1]}] (one logit per query head), got "
                         f"{list(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {sinks.device}")
    return sinks


def _tokens_major(q):
    """Whether q [B, H, S, D] is a [B, S, H, D] contiguous buffer viewed into heads (q.transpose(1, 2) contiguous);
    its strides are read first, as a projection's output viewed into heads has exactly those."""
    B, H, S, D = q.shape
    return q.stride() == (S * H * D, D, H * D, 1) or q.transpose(1, 2).is_contiguous()


def _cpu_flash_as_itself(q, k, v, causal, scale):
    """o from PyTorch's CPU flash kernel under its own autograd node, where "auto" picks that kernel for the call
    (attention_dispatch.CPU_FLASH_BELOW), or None. The node keeps q, k, v, o and the logsumexp, what the op keeps
    with that kernel (the same bytes; its backward is the kernel's own), without the op's Python, which at such
    lengths is most of a call. The kernel lays o out as q, so q must be [B, S, H, D] in memory (as a projection's
    output viewed into heads is) for o to be the op's buffer. The layer pipeline learns the classes as from the
    op: q, k, v are tagged before the call, and what the node saves untagged (o, lse) is "attention". Left to the
    op: other layouts, a forced "sdpa" (the op's path, which its tests hold), autocast, and wherever the op's direct
    path would not run (torch.compile, dispatch modes, subclasses). The choice reads only the call and the setting,
    so a checkpoint's re-run of the forward makes the same one."""
    if not attention_dispatch.cpu_auto_flash(q.dtype, k.shape[2]):
        return None
    setting = backend.attention_setting()
    if setting != "auto":
        return None
    if torch.is_autocast_enabled("cpu") or not eager_ok((q, k, v)):
        return None
    if not _tokens_major(q):  # the kernel lays o out as q: the op copies it into its buffer
        return None
    if attention_dispatch.choose_plain_cpu(q, k, causal, setting) != attention_dispatch.CPU_FLASH:
        return None
    if not pipeline.entered():  # nothing reads tags (a fused layer's call, or no policy around)
        return attention_dispatch.cpu_flash_as_itself(q, k, v, causal, scale)[0]
    for t in (q, k, v):
        pipeline.tag(t, "qkv")
    previous = pipeline.saving_as("attention")
    try:
        o, lse = attention_dispatch.cpu_flash_as_itself(q, k, v, causal, scale)
    finally:
        pipeline.saving_as(previous)
    pipeline.tag(o, "attention")  # a source a later cast is followed to (pipeline.scope's memo)
    return o  # [B, H, Sq, D] over the [B, Sq, H, D] buffer the kernel allocates, as the op's view


def attention(q, k, v, causal=False, dropout_p=0.0, softmax_scale=None, key_padding_mask=None, seed=None, *,
              sliding_window=None, cu_seqlens=None, softcap=None, q_offset=0, sinks=None):
    """softmax(q k^T * softmax_scale + masks), dropped out, times v: o [B, H, Sq, Dv].

    q [B, H, Sq, D], k [B, Hkv, Sk, D] and v [B, Hkv, Sk, Dv] with H % Hkv == 0 (query head h reads kv head
    h // (H // Hkv); k and v are never expanded); v's head dim Dv may differ from D (multi-head latent
    attention: the rotary part widens q and k only), one dtype (fp32, fp16, bf16), any strides with a
    contiguous last dim (any stride when D = 1); B = 0 or Sq = 0 give an empty output. `causal` lets
    query i attend keys j <= i (top-left, like PyTorch's is_causal); `sliding_window=w` also requires
    j > i - w (Mistral's convention);
    `key_padding_mask` [B, Sk] bool, True = attend; `cu_seqlens` int32 [n + 1] (0 ... S) packs n
    documents into one row (B = 1, Sq = Sk = S): queries attend only keys of their own document,
    causal and window measured inside it. Rows with nothing to attend give 0.
    `dropout_p` drops normalised probabilities with the contract's mask; `seed=None` draws one from
    torch's generator when dropout_p > 0. The result is an ordinary view of a contiguous [B, Sq, H, Dv]
    buffer (in-place ops on it work as on any tensor). `softcap=c` (Gemma 2's attention-logit
    soft-capping) makes the scores c * tanh(q k^T * softmax_scale / c) before masks and softmax;
    backward rebuilds them and their tanh from q and k.
    `q_offset=s` places query row i at key position i + s (0 <= s, s + Sq <= Sk): causal, window,
    documents and the dropout mask are those of row i + s of the whole problem, so query tiles
    q[:, :, s:e] against k[:, :, :e], v[:, :, :e] with q_offset=s reproduce rows s..e-1 of one call
    (outputs row for row, bit for bit on the C++ kernels; dK and dV as the tiles' shares of a sum).
    `sinks` [H] (gpt-oss's attention sinks; any float dtype, used in fp32) adds exp(sinks[h]) to the
    softmax denominator of every row of head h, a logit with no value: rows sum to less than 1, and a
    row with nothing to attend still gives 0. Its gradient is summed in fp32 over batch and rows.
    """
    _check_qkv(q, k, v)
    if (key_padding_mask is None and seed is None and sliding_window is None and cu_seqlens is None and softcap is None
            and sinks is None and type(q_offset) is int and q_offset == 0 and type(dropout_p) is float
            and dropout_p == 0.0 and type(causal) is bool):
        # nothing but causal and the scale (a model layer's common call): the checks below would find nothing else
        return _run(q, k, v, None, None, causal, 0, 0.0, _check_scale(softmax_scale, q.shape[-1]), None, 0.0, 0, None)
    check_bool(causal, "causal")
    rng.threshold(dropout_p, "dropout_p")
    mask = _check_mask(key_padding_mask, q, k)
    window = _check_window(sliding_window)
    offset = _check_q_offset(q_offset, q.shape[2], k.shape[2])
    cu_seqlens = _check_cu_seqlens(cu_seqlens, q, k, mask, offset)
    scale = _check_scale(softmax_scale, q.shape[-1])
    cap = check_softcap(softcap)
    sinks = check_sinks(sinks, q)
    return _run(q, k, v, mask, cu_seqlens, causal, window, dropout_p, scale, seed, cap, offset, sinks)


def _run(q, k, v, mask, cu_seqlens, causal, window, dropout_p, scale, seed, cap, offset, sinks):
    """attention's o from its checked arguments: PyTorch's CPU flash kernel under its own node where "auto" picks it
    for a call that needs nothing else (_cpu_flash_as_itself), else the op."""
    if (q.is_cpu and mask is None and cu_seqlens is None and not window and not offset and not dropout_p and not cap
            and sinks is None and v.shape[-1] == q.shape[-1]):
        o = _cpu_flash_as_itself(q, k, v, causal, scale)
        if o is not None:
            return o
    seed = rng.site_seed(dropout_p, seed, q.device)
    o, _ = attention_fwd_op(q, k, v, mask, cu_seqlens, causal, window, float(dropout_p), scale, seed, cap, offset,
                            sinks)
    return heads_view(o)
