"""The "selective_ckpt" entry of transformers' attention-function registry.

Converted models run attention through `selective_ckpt.attention`: causal, key padding, grouped
k/v (never expanded), Mistral/Qwen sliding windows, attention dropout by seed, packed documents and
gpt-oss's attention sinks (the `s_aux` the attention module passes, a per-head logit in the softmax
denominator).
The mask Hugging Face builds for it is its SDPA mask (a [B, 1, S, S] bool mask, or None for plain
causal); `describe_mask` turns it into key padding or document offsets and checks that this
reproduces the mask exactly, never taking anything else for padding.

Three kinds of call run transformers' own attention instead, for that call only:
- a call that asks for the attention weights (`output_attentions=True`, passed down or recorded by
  transformers' output-capturing hooks): the model family's eager attention with the eager mask,
  so weights and their gradients are computed exactly as transformers' eager attention computes
  them; warned once, as such calls keep what eager attention keeps;
- a mask that is neither causal + key padding nor causal packed documents (a tree mask, an
  additive bias, one that differs between heads): transformers' SDPA attention with that mask;
  warned once;
- queries against earlier keys (Sq != Sk: generate's kv cache, a decoding loop with gradients, PEFT's
  prefix tuning): transformers' SDPA attention with the same mask (soft-capped scores: the family's eager
  attention); warned once when gradients are on, as such calls keep what SDPA keeps.

Rows with nothing to attend (left padding's pad rows) give 0 in our kernel, as in SDPA; transformers' eager
attention gives them a uniform softmax over all keys (the mean of v), and the first real token's prediction
reads such a row. Where the unconverted model ran eager attention (recorded at convert by
`record_reference`; Gemma2's only attention), those rows are recomputed as eager computes them, forward and
backward (`_RowsAttendingNothing`); such a batch keeps the attention output a second time (the
out-projection's input), a batch without such rows keeps the floor.
"""

import inspect
import sys
import types
import warnings
import weakref

import torch

from .. import compat, rng
from ..keeping import layer_tiles, pipeline
from ..ops.attention import attention
from ..storages import is_fake, storage_bytes, storage_id
from . import chunked_attention
from .errors import ConversionError
from .patching import PATCHED

NAME = "selective_ckpt"


def register(root=None):
    """Registers the attention function and its mask builder with transformers (idempotent). With `root` (a
    model about to be converted), first records the attention it runs (record_reference)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if root is not None:
        record_reference(root)
    AttentionInterface.register(NAME, selective_attention)
    AttentionMaskInterface.register(NAME, build_mask)


_REFERENCE = "_selective_ckpt_reference_attention"


def record_reference(root):
    """Notes on every module of `root` that has a config the attention implementation that config names now
    (before convert switches it to "selective_ckpt"): the unconverted model's own attention, which the
    converted one follows where our kernel's contract differs from it (rows that attend nothing). A module
    attribute, so it is neither in the state dict nor in a saved config; deepcopy and pickling keep it."""
    for m in root.modules():
        config = getattr(m, "config", None)
        impl = None if config is None else compat.attention_implementation(config)
        if isinstance(impl, str) and impl != NAME:
            m.__dict__[_REFERENCE] = impl


_FAMILY_SDPA = {}


def reference_attention(module):
    """The attention the unconverted model ran for this attention module: the one recorded at convert, else
    the family's default (transformers' SDPA where the family supports it, eager where it does not, as Gemma2)."""
    impl = module.__dict__.get(_REFERENCE)
    if impl is not None:
        return impl
    name = type(module).__module__
    if name not in _FAMILY_SDPA:
        from transformers import PreTrainedModel

        owners = [c for c in vars(sys.modules.get(name, object)).values()
                  if isinstance(c, type) and issubclass(c, PreTrainedModel) and c is not PreTrainedModel]
        _FAMILY_SDPA[name] = all(compat.family_supports_sdpa(c) for c in owners)
    return "sdpa" if _FAMILY_SDPA[name] else "eager"


_MASK_DTYPE = [None]  # dtype of the model's latest mask: the eager mask's fill value is that dtype's min


def build_mask(*args, **kwargs):
    """transformers' SDPA mask (None for plain causal, else [B, 1, Sq, Sk] bool); notes the model's dtype."""
    from transformers.masking_utils import sdpa_mask

    if not torch.compiler.is_compiling():
        _MASK_DTYPE[0] = kwargs.get("dtype")
    return sdpa_mask(*args, **kwargs)


class Inexpressible(ConversionError):
    """A valid mask that selective_ckpt.attention cannot express; the call runs transformers' SDPA."""


_WARNED = set()


def _warn_once(kind, message):
    if kind not in _WARNED:
        _WARNED.add(kind)
        warnings.warn(message, UserWarning, stacklevel=3)


def _allowed(mask, name):
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ConversionError(f"{name}: attention_mask must be bool or additive float, got {mask.dtype}")
    allowed = mask == 0
    if not bool((allowed | (mask < torch.finfo(mask.dtype).min / 2)).all()):
        raise Inexpressible(f"{name}: attention_mask carries an additive bias (values other than 0 and -inf/min), "
                            "which selective_ckpt.attention cannot express")
    return allowed


def allowed_mask(mask, batch, seq, name, heads=1):
    """[B, S, S] bool (True = attend) of a [B or 1, 1 or H, S, S] mask the same for every head; ConversionError for
    another shape or type, Inexpressible for one that differs between heads."""
    if (mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] not in (1, heads)
            or tuple(mask.shape[-2:]) != (seq, seq)):
        raise ConversionError(f"{name}: attention_mask of shape {list(mask.shape)} is not [B, 1, S, S] for B={batch}, "
                              f"S={seq}")
    allowed = _allowed(mask, name).expand(batch, -1, -1, -1)
    if not bool((allowed == allowed[:, :1]).all()):
        raise Inexpressible(f"{name}: attention_mask differs between heads; only causal + key padding or packed "
                            "documents are supported")
    return allowed[:, 0]


def describe_mask(mask, batch, seq, window, name, heads=1):
    """(key_padding_mask [B, S] bool or None, cu_seqlens int32 or None) reproducing a causal 4-D mask.

    Rows with nothing to attend (padded queries) may hold anything: their outputs feed nothing real.
    A mask of the wrong shape or type is a ConversionError; a valid one that is neither causal + key
    padding nor causal packed documents raises Inexpressible (a ConversionError).
    """
    allowed = allowed_mask(mask, batch, seq, name, heads)
    # every unpadded query attends itself; a copy, so that the [B, S] result does not hold the [B, S, S] mask
    pad = allowed.diagonal(dim1=-2, dim2=-1).contiguous()
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
        raise Inexpressible(f"{name}: attention_mask is neither causal + key padding nor causal packed documents"
                            f"{f' with sliding window {window}' if window else ''}; selective_ckpt cannot express it")
    has_docs, has_pad = bool(starts.any()), not bool(pad.all())
    if has_docs and (batch != 1 or has_pad):
        raise Inexpressible(f"{name}: packed documents need one row (B = 1) without padding, got B={batch}"
                            f"{' with padding' if has_pad else ''}")
    cu = None
    if has_docs:
        cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=mask.device),
                        idx[starts[0]].to(torch.int32), torch.tensor([seq], dtype=torch.int32, device=mask.device)])
    return (pad if has_pad else None), cu


# describe function -> (weakref to mask, (version, B, S, window, heads), result): a model hands every layer of a
# kind one mask (Llama 4's chunked and full layers two, each described by its own function)
_LAST = {}


def _forget(ref):
    """The cached description dies with its mask: nothing of one forward is held into the next."""
    for describe, last in list(_LAST.items()):
        if last[0] is ref:
            del _LAST[describe]


def _traced_describe(mask, batch, seq, window, name, heads):
    """describe_mask while dynamo traces, without a branch on the mask's values (each would break the graph at
    every layer): the key padding is always given (all True without padding, the same result), and a mask that
    is not causal + key padding (packed documents, which eager describes by offsets; anything eager hands to
    SDPA) fails an assertion in the graph, naming it."""
    if (mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] not in (1, heads)
            or tuple(mask.shape[-2:]) != (seq, seq)):
        raise ConversionError(f"{name}: attention_mask of shape {list(mask.shape)} is not [B, 1, S, S] for B={batch}, "
                              f"S={seq}")
    allowed = (mask if mask.dtype == torch.bool else mask == 0).expand(batch, -1, -1, -1)
    same_heads = (allowed == allowed[:, :1]).all()
    allowed = allowed[:, 0]
    pad = allowed.diagonal(dim1=-2, dim2=-1).contiguous()
    idx = torch.arange(seq, device=mask.device)
    expected = (idx[None, :, None] >= idx[None, None, :]) & pad[:, None, :]
    if window:
        expected &= idx[None, :, None] - idx[None, None, :] < window
    live = expected.any(-1, keepdim=True)
    torch._assert_async(same_heads & ((allowed == expected) | ~live).all(),
                        f"{name}: under torch.compile attention_mask must be causal + key padding"
                        f"{f' with sliding window {window}' if window else ''} (packed documents: pass cu_seq_lens_q "
                        "and cu_seq_lens_k; other masks run eager)")
    return pad, None


def _cached_describe(mask, batch, seq, window, name, heads, describe=describe_mask):
    """describe(mask, batch, seq, window, name, heads) (describe_mask, or a chunked layer's segments with the chunk
    as its window), once per mask for all layers; an Inexpressible mask stays so for every layer."""
    if torch.compiler.is_compiling():
        return _traced_describe(mask, batch, seq, window, name, heads)
    if mask.is_inference():
        return describe(mask, batch, seq, window, name, heads)
    last = _LAST.get(describe)
    key = (mask._version, batch, seq, window, heads)
    if last is None or last[0]() is not mask or last[1] != key:
        try:
            result = describe(mask, batch, seq, window, name, heads)
        except Inexpressible as e:
            result = _Refused(str(e))  # the message only: a traceback would keep this forward's tensors
        last = _LAST[describe] = (weakref.ref(mask, _forget), key, result)
    if isinstance(last[2], _Refused):
        raise Inexpressible(last[2].message)
    return last[2]


class _Refused:
    __slots__ = ("message",)

    def __init__(self, message):
        self.message = message


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
    kind = "cpu" if query.is_cpu else query.device.type
    if torch.is_autocast_enabled(kind) and query.dtype in (torch.float32, torch.float64):
        return torch.get_autocast_dtype(kind)
    return query.dtype


def in_compute_dtype(query, key, value):
    """q, k, v cast to _compute_dtype(query) (themselves where they have it)."""
    dtype = _compute_dtype(query)
    if query.dtype == dtype and key.dtype == dtype and value.dtype == dtype:
        return query, key, value
    return query.to(dtype), key.to(dtype), value.to(dtype)


def weights_requested(module, kwargs):
    """Whether this call must hand back attention weights.

    Llama-family models pass `output_attentions` down to the attention function; GPT-2 removes it,
    and transformers collects weights through output-capturing hooks whose collector (active during
    the model's forward) names "attentions" when they are asked for, by argument or by config. Outside
    any model forward, the module's config decides, as the attention module returns weights then.
    """
    if kwargs.get("output_attentions"):
        return True
    # None outside a model forward, under a transformers without output capturing (it passes the flag down), and
    # for a layer traced by dynamo on its own (an eager model around it): the module's config decides then
    collected = compat.active_output_collector()
    if collected is not None:
        return "attentions" in collected
    return bool(getattr(getattr(module, "config", None), "output_attentions", False))


def eager_mask(attention_mask, query, key, window):
    """The additive mask transformers' eager attention gets for this call (None: nothing masked).

    A bool mask becomes 0 / the model dtype's min, as transformers' eager mask builder makes it; None
    (plain causal, the SDPA builder's shortcut) becomes the causal mask, aligned bottom-right when a
    cache holds earlier keys; a float mask is already additive.
    """
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return attention_mask
    dtype = _MASK_DTYPE[0] or query.dtype
    Sq, Sk = query.shape[2], key.shape[2]
    if attention_mask is None:
        if Sq == 1:
            return None
        i = torch.arange(Sq, device=query.device)[:, None] + (Sk - Sq)
        j = torch.arange(Sk, device=query.device)[None, :]
        allowed = j <= i
        if window:
            allowed &= i - j < window
        attention_mask = allowed[None, None]
    zero = torch.zeros((), device=attention_mask.device, dtype=dtype)
    return torch.where(attention_mask, zero, torch.finfo(dtype).min)


def _eager_attention(module, name, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """The model family's own eager attention, for a call that asks for the attention weights."""
    _warn_once("weights", f"{name}: a call asks for the attention weights; it runs transformers' eager attention, "
                          "which keeps the full attention probabilities (this call only; other calls keep the floor)")
    return _family_eager(module, name, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _family_eager(module, name, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """The model family's own eager attention (GPT-2: also its upcast-and-reorder variant when configured)."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ConversionError(f"{name}: this call needs transformers' eager attention (attention weights asked for, "
                              f"or soft-capped scores outside our kernels), but {type(module).__module__} defines no "
                              "eager_attention_forward")
    mask = eager_mask(attention_mask, query, key, kwargs.get("sliding_window"))
    upcast = compat.upcast_reordered_attention(module) if getattr(module, "reorder_and_upcast_attn", False) else None
    if upcast is not None:
        return upcast(query, key, value, mask)
    kwargs.pop("output_attentions", None)
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _sinks(kwargs):
    """The attention sinks a family passes (gpt-oss: s_aux, the module's sinks parameter), or None."""
    sinks = kwargs.get("s_aux")
    return kwargs.get("sinks") if sinks is None else sinks


def _sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    """transformers' SDPA attention for the calls our kernels leave to it; soft-capped scores and attention
    sinks (which SDPA does not take) go to the family's eager attention instead, as the model defines them."""
    if kwargs.get("softcap") is not None or _sinks(kwargs) is not None:
        name = f"{type(module).__name__} (selective_ckpt attention)"
        return _family_eager(module, name, query, key, value, attention_mask, dropout, scaling, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _uniform(n, dtype):
    """1 / n as eager's softmax output of a constant row after its cast to `dtype` (a Python float)."""
    return float(torch.tensor(1.0 / n, dtype=torch.float32).to(dtype))


class _RowsAttendingNothing(torch.autograd.Function):
    """The rows of a query that attend no key, as transformers' eager attention computes them: every score is
    the mask's minimum (a score plus min rounds to min), so the softmax is uniform over all Sk keys and the
    row's output is the mean of v; eager's autograd still differentiates through the softmax and the
    soft-cap at the unmasked scores, so q and k get gradients from such rows too, which backward computes
    the same way (the scores of these rows recomputed). Keeps q, k, v (the ones attention keeps) and the
    row positions.

    q [B, H, S, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], rows [B, P] positions (the first `valid` of each row
    are real, the rest filler whose output is discarded). Returns [B, H, P, Dv]."""

    @staticmethod
    def forward(ctx, q, k, v, rows, valid, scaling, softcap):
        B, H = q.shape[:2]
        Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
        mean = (v.float().sum(dim=2) * _uniform(Sk, v.dtype)).to(v.dtype)  # [B, Hkv, Dv]
        out = mean.repeat_interleave(H // Hkv, dim=1)[:, :, None, :].expand(B, H, rows.shape[1], Dv).contiguous()
        ctx.scaling, ctx.softcap = scaling, softcap
        ctx.save_for_backward(q, k, v, rows, valid)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, rows, valid = ctx.saved_tensors
        B, H, _, D = q.shape
        Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
        G, P = H // Hkv, rows.shape[1]
        p = 1.0 / Sk  # the softmax output, float32 as eager's softmax computes it
        dout = (dout.float() * valid[:, None, :, None]).reshape(B, Hkv, G * P, Dv)  # head h = kv head h // G
        kf, vf = k.float(), v.float()
        dv = (dout.sum(dim=2) * _uniform(Sk, v.dtype))[:, :, None, :]
        dp = dout @ vf.transpose(-1, -2)  # [B, Hkv, G*P, Sk]
        ds = p * (dp - p * dp.sum(dim=-1, keepdim=True))
        index = rows[:, None, :, None].expand(B, H, P, D)
        q_rows = q.gather(2, index).float().reshape(B, Hkv, G * P, D)
        if ctx.softcap is not None:
            t = torch.tanh(q_rows @ kf.transpose(-1, -2) * (ctx.scaling / ctx.softcap))
            ds = ds * (1 - t * t)
        ds = ds * ctx.scaling
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dq.scatter_add_(2, index, (ds @ kf).reshape(B, H, P, D))
        dk = ds.transpose(-1, -2) @ q_rows
        return (dq.to(q.dtype), dk.to(k.dtype), dv.expand(B, Hkv, Sk, Dv).to(v.dtype), None, None, None, None)


def rows_attending_nothing(pad, window=None):
    """[B, S] bool: the causal rows with no unpadded key among the keys they may see (left padding's pad
    rows), from the key padding mask `pad` [B, S] (True = a real token) and the sliding window."""
    seen = pad.to(torch.int32).cumsum(-1)
    if window and window < pad.shape[1]:
        before = torch.zeros_like(seen)
        before[:, window:] = seen[:, :-window]
        seen = seen - before
    return seen == 0


def _as_eager_on_rows_attending_nothing(o, query, key, value, dead, scaling, softcap):
    """o [B, H, S, D] from our kernel (0 on rows attending nothing) with those rows as transformers' eager
    attention computes them. A new tensor: the layer keeps it (its out-projection's input) besides the
    kernel's o, one more h per token, while a batch has such rows."""
    counts = dead.sum(-1)
    P = int(counts.max())  # a host read: the padded batch's mask description has read the mask already
    rows = torch.argsort((~dead).to(torch.int8), dim=-1, stable=True)[:, :P]  # each row's dead positions, in order
    valid = torch.arange(P, device=dead.device)[None, :] < counts[:, None]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = _RowsAttendingNothing.apply(query, key, value, rows, valid, scale, softcap)
    b, r = valid.nonzero(as_tuple=True)
    o = o.clone()
    o[b, :, rows[b, r]] = out[b, :, r]
    return o


# A keyword an attention module's forward passes when its v is a view into a buffer the layer keeps anyway (MLA's
# kv_b_proj output, from which k is rebuilt): attention keeps the view, never a copy. Taken out of the call's kwargs.
VALUE_BUFFER_KEPT = "selective_ckpt_value_buffer_kept"


def _own_buffers(query, key, value, value_buffer_kept=False):
    """q, k, v as attention keeps them: one that is a view into a larger buffer none of the others keeps
    alive (GPT-NeoX's packed query_key_value output, of which RoPE made new q and k and only v is still a
    view) is copied, so the buffer is freed; views into one buffer the three share (GPT-2's c_attn) stay, as does
    a v whose buffer the layer keeps for another reason (`value_buffer_kept`)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():  # compiled: the partitioner picks what is kept
        return query, key, value
    out = (query, key, value)
    # only a view into a larger buffer may be copied: storages are told apart only when there is one
    larger = [storage_bytes(t) > t.nbytes for t in out]
    if not any(larger):
        return out
    out = list(out)
    ids = [storage_id(t) for t in out]
    for i, t in enumerate(out):
        shared = any(ids[j] == ids[i] for j in range(3) if j != i) or (i == 2 and value_buffer_kept)
        if larger[i] and not shared:
            out[i] = t.contiguous() if not t.is_contiguous() else t.clone()
    return tuple(out)


def _name(module):
    """How messages name the attention module (made only for one: a string per call costs)."""
    return f"{type(module).__name__} (selective_ckpt attention)"


def selective_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """transformers attention function: (o [B, S, H, D], weights or None). query [B, H, Sq, D], key/value [B, Hkv,
    Sk, D]. Weights come back only from a call that asks for them (computed by transformers' eager attention)."""
    if kwargs.get("position_bias") is not None:
        raise ConversionError(f"{_name(module)}: position_bias is not supported by selective_ckpt.attention")
    value_buffer_kept = kwargs.pop(VALUE_BUFFER_KEPT, False)
    tile = layer_tiles.current()
    if tile is not None:
        return _tile_attention(module, _name(module), tile, query, key, value, attention_mask, dropout, scaling,
                               is_causal, kwargs)
    if weights_requested(module, kwargs):
        return _eager_attention(module, _name(module), query, key, value, attention_mask, dropout, scaling, **kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    B, H, Sq, _ = query.shape
    Sk = key.shape[2]
    if Sq != Sk:
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            _warn_once("cache", f"{_name(module)}: a call with earlier keys (a kv cache or prefix, Sq={Sq} != "
                                f"Sk={Sk}) and gradients runs transformers' SDPA attention, keeping what SDPA keeps "
                                "(this call only; other calls keep the floor)")
        return _sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if not causal:
        raise ConversionError(f"{_name(module)}: only causal self-attention is supported")
    chunk = chunked_attention.chunk_size(module)
    if chunk is not None:
        chunked = _chunked(module, _name(module), chunk, query, key, value, attention_mask, dropout, scaling, kwargs)
        if chunked is not None:
            return chunked
    window = kwargs.get("sliding_window") or None
    pad = cu = None
    # a fake mask (selective_ckpt.fit's simulated step, whose batch has no padding) has no values to describe;
    # it is taken as the causal mask it is there (what attention keeps does not depend on it)
    fake = is_fake(attention_mask) and not torch.compiler.is_compiling()
    if attention_mask is not None and not fake:
        try:
            pad, cu = _cached_describe(attention_mask, B, Sq, window, _name(module), H)
        except Inexpressible as e:
            _warn_once("mask", f"{e}: such calls run transformers' SDPA attention with the mask as given, keeping "
                               "what SDPA keeps (warned once)")
            return _sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    cu_kw = _cu_seqlens(kwargs, _name(module))
    if cu_kw is not None:
        if cu is not None and not torch.equal(cu, cu_kw):
            raise ConversionError(f"{_name(module)}: cu_seq_lens_q disagrees with the documents of the attention mask")
        if pad is not None:
            raise ConversionError(f"{_name(module)}: cu_seq_lens_q cannot be combined with padding")
        cu = cu_kw
    query, key, value = _own_buffers(*in_compute_dtype(query, key, value), value_buffer_kept)
    seed = rng.draw_seed_tensor(query.device) if dropout > 0 else None
    sinks = _sinks(kwargs)
    o = attention(query, key, value, True, float(dropout), scaling, pad, seed, sliding_window=window, cu_seqlens=cu,
                  softcap=kwargs.get("softcap"), sinks=sinks)
    if pad is not None and sinks is None and reference_attention(module).startswith("eager"):
        # rows with nothing to attend give 0 in our kernel; the unconverted model's eager attention gives them
        # a uniform softmax over all keys, and its first real token's prediction reads such a row (with sinks the
        # sink takes all of such a row's mass in eager too: 0 there as well)
        dead = rows_attending_nothing(pad, window)
        if bool(dead.any()):
            o = _as_eager_on_rows_attending_nothing(o, query, key, value, dead, scaling, kwargs.get("softcap"))
    return o.transpose(1, 2), None


def _chunk_segments(mask, batch, seq, chunk, name, heads):
    """chunked_attention.segments of a mask (the rows' segments as cu_seqlens, or None); Inexpressible for a mask
    of another pattern."""
    try:
        return chunked_attention.segments(allowed_mask(mask, batch, seq, name, heads), batch, seq, chunk, name)
    except chunked_attention.NotChunked as e:
        raise Inexpressible(str(e)) from None


def _chunked(module, name, chunk, query, key, value, attention_mask, dropout, scaling, kwargs):
    """A chunked-attention layer's call (models/chunked_attention.py): (o, None), or None where it is plain causal
    attention, which the caller runs as an unchunked layer's (a fake mask: the same bytes kept)."""
    if dropout > 0:
        raise ValueError(f"{name}: attention dropout ({dropout}) on a chunked attention layer is not supported; set "
                         "attention_dropout=0")
    B, H, S, _ = query.shape
    documents = _cu_seqlens(kwargs, name)
    if torch.compiler.is_compiling():
        _warn_once("chunked-compile", f"{name}: under torch.compile a chunked attention layer runs transformers' SDPA "
                                      "attention, keeping what SDPA keeps (warned once)")
        return _sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, None, **kwargs)
    if attention_mask is not None and is_fake(attention_mask):
        return None
    if attention_mask is None:
        cu = chunked_attention.segments(None, B, S, chunk, name, documents, query.device)
    else:
        try:
            cu = _cached_describe(attention_mask, B, S, chunk, name, H, describe=_chunk_segments)
        except Inexpressible as e:
            _warn_once("mask", f"{e}: such calls run transformers' SDPA attention with the mask as given, keeping "
                               "what SDPA keeps (warned once)")
            return _sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, None, **kwargs)
        if documents is not None and (cu is None or not bool(torch.isin(documents, cu).all())):
            raise ConversionError(f"{name}: cu_seq_lens_q disagrees with the documents of the attention mask")
    if cu is None:
        return None
    query, key, value = _own_buffers(*in_compute_dtype(query, key, value))
    return chunked_attention.attend(query, key, value, cu, scaling), None


def _documents_before(cu, end):
    """cu_seqlens of the keys [0, end): the document offsets below `end`, then `end`."""
    return torch.cat([cu[cu < end], torch.tensor([end], dtype=cu.dtype, device=cu.device)])


def _tile_attention(module, name, tile, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    """Attention inside a layer run over query tiles (keeping.layer_tiles): in pass 1 hands back the tile's k, v in
    attention's dtype and stops the layer's forward; in pass 2 attends the tile's queries to the keys up to the
    tile's end (the layer's K, V), query row i at key position start + i. Masks are the whole sequence's, described
    once; what cannot run in tiles is a ValueError naming it (there is no other attention to fall back on here)."""
    if weights_requested(module, kwargs):
        raise ValueError(f"{name}: a layer run in tiles (layer_tiles) cannot return attention weights; use a policy "
                         "without layer_tiles for calls that ask for them")
    if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        raise ValueError(f"{name}: layer_tiles needs causal self-attention")
    if chunked_attention.chunk_size(module) is not None:
        raise ValueError(f"{name}: a chunked attention layer (attention_chunk_size="
                         f"{chunked_attention.chunk_size(module)}) cannot run in query tiles (layer_tiles); use a "
                         "policy without layer_tiles for this model")
    B, H, Sq, _ = query.shape
    if Sq != tile.end - tile.start or key.shape[2] != Sq:
        raise ValueError(f"{name}: layer_tiles needs self-attention over the tile's own tokens (Sq = Sk = "
                         f"{tile.end - tile.start}), got Sq={Sq}, Sk={key.shape[2]} (a kv cache or a prefix)")
    dtype = _compute_dtype(query)
    if tile.mode == "capture":
        tile.captured = (key.to(dtype), value.to(dtype))
        raise layer_tiles.Captured()
    window = kwargs.get("sliding_window") or None
    pad = cu = None
    if attention_mask is not None and not (is_fake(attention_mask) and not torch.compiler.is_compiling()):
        try:
            pad, cu = _cached_describe(attention_mask, B, tile.length, window, name, H)
        except Inexpressible as e:
            raise ValueError(f"{e}; layer_tiles runs only masks our kernel expresses") from None
    cu_kw = _cu_seqlens(kwargs, name)
    if cu_kw is not None:
        if pad is not None:
            raise ConversionError(f"{name}: cu_seq_lens_q cannot be combined with padding")
        cu = cu_kw
    end = tile.end
    sinks = _sinks(kwargs)
    if pad is not None:
        if (sinks is None and reference_attention(module).startswith("eager")
                and bool(rows_attending_nothing(pad, window).any())):
            raise ValueError(f"{name}: this padded batch has rows that attend nothing, which the unconverted model's "
                             "eager attention fills with the mean of v; layer_tiles does not reproduce that (pad on "
                             "the right, or use a policy without layer_tiles)")
        pad = pad[:, :end]
    if cu is not None:
        cu = _documents_before(cu, end)
    seed = tile.attention_seed(lambda: rng.draw_seed_tensor(query.device)) if dropout > 0 else None
    o = attention(query.to(dtype), tile.keys, tile.values, True, float(dropout), scaling, pad, seed,
                  sliding_window=window, cu_seqlens=cu, softcap=kwargs.get("softcap"), q_offset=tile.start,
                  sinks=sinks)
    return o.transpose(1, 2), None


# --- q/k norms before RoPE (ModelSpec.qk_norm True, per head: Qwen3, Gemma3; "projection": OLMo2/3). The norms keep
# their inputs (the q_proj / k_proj outputs) and statistics, and their outputs are rebuilt; RoPE's outputs, which
# attention keeps, are rebuilt from those (elementwise, one layer's worth at a time) by the family's own
# apply_rotary_pos_emb on the rebuilt norm outputs: the same function on the same bits. So such a layer keeps
# Llama's q/k/v bytes (the projection outputs and v) plus the norms' statistics.

_ROPE = "apply_rotary_pos_emb"
_REBUILDING_FORWARDS = {}  # (attention class, wrap) -> its transformers forward with RoPE's outputs registered


def forward_with_rope(cls, wrap):
    """cls.forward as transformers defines it (its deprecation wrapper unwrapped), with its module's
    apply_rotary_pos_emb replaced by wrap(apply_rotary_pos_emb) (one whose outputs are registered to be rebuilt);
    ConversionError where the forward calls no such function."""
    key = (cls, wrap)
    forward = _REBUILDING_FORWARDS.get(key)
    if forward is None:
        raw = inspect.unwrap(cls.forward)
        rope = getattr(raw, "__globals__", {}).get(_ROPE)
        if rope is None or _ROPE not in raw.__code__.co_names:
            raise ConversionError(f"{cls.__name__}.forward does not rotate q and k by its module's {_ROPE}; its q/k "
                                  "norms' outputs cannot be rebuilt through RoPE")
        namespace = dict(raw.__globals__)
        namespace[_ROPE] = wrap(rope)
        forward = types.FunctionType(raw.__code__, namespace, raw.__name__, raw.__defaults__, raw.__closure__)
        forward.__kwdefaults__ = raw.__kwdefaults__
        _REBUILDING_FORWARDS[key] = forward
    return forward


def _forward_rebuilding_rope(cls):
    return forward_with_rope(cls, _Rotated)


def check_rope_rebuild(module, name):
    """ConversionError when `module`'s forward does not rotate q and k by its module's apply_rotary_pos_emb."""
    try:
        _forward_rebuilding_rope(type(module))
    except ConversionError as e:
        raise ConversionError(f"{name}: {e}") from None


def qk_normed_forward(self, *args, **kwargs):
    """The patched forward of an attention module whose q/k norms run before RoPE: transformers' own, with RoPE's
    outputs rebuilt in backward from the norms' (themselves rebuilt) outputs."""
    if torch.compiler.is_compiling():  # no pipeline while dynamo traces (the compiled graph decides what it keeps)
        return getattr(self, PATCHED)(*args, **kwargs)
    if "past_key_values" in kwargs and "cache" not in kwargs:  # the name its deprecation wrapper still takes
        kwargs["cache"] = kwargs.pop("past_key_values")
    return _forward_rebuilding_rope(type(self))(self, *args, **kwargs)


class _Rotated:
    """A family's apply_rotary_pos_emb(q, k, ...) whose outputs are registered to be rebuilt when q and k are
    (views of) rebuilt norm outputs; else (a norm that keeps its output, no rebuilding pipeline) as it is."""

    def __init__(self, rope):
        self.rope = rope

    def __call__(self, q, k, *args, **kwargs):
        q_out, k_out = self.rope(q, k, *args, **kwargs)
        if pipeline.active():
            qs, ks = pipeline.source(q), pipeline.source(k)
            if qs is not q and ks is not k:
                pair = _RotatedPair(self.rope, args, kwargs)
                pipeline.discardable(q_out, pair.output, 0, qs, ks)
                pipeline.discardable(k_out, pair.output, 1, qs, ks)
        return q_out, k_out


class _RotatedPair:
    """One RoPE call rebuilt once for both of its outputs; the pair is let go once both are taken."""

    __slots__ = ("rope", "args", "kwargs", "value", "left")

    def __init__(self, rope, args, kwargs):
        self.rope, self.args, self.kwargs, self.value, self.left = rope, args, kwargs, None, 2

    def output(self, i, q, k):
        value = self.value
        if value is None:
            value = self.value = self.rope(q, k, *self.args, **self.kwargs)
        self.left -= 1
        if self.left == 0:
            self.value = None
        return value[i]
