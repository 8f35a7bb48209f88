"""A converted Llama-shaped decoder layer in five autograd nodes: the fast path of its training forward.

transformers' Llama layer records about forty autograd nodes a call (norm, three projections, their views, RoPE's
seven ops for q and for k, attention, o_proj, the MLP's five ops, two residual adds), and the converted layer adds
saved-tensor hooks to each save. On a small model that Python is the step. Where a layer is exactly that layout, its
forward here runs the same arithmetic as

- norm_fusion.norm_linear: input norm -> q, k, v projections (keeps x and the norm statistics);
- _Rope: HF's q * cos + rotate_half(q) * sin on q and k, op for op (keeps cos and sin);
- the registered attention function, called as transformers' attention module calls it (keeps q, k, v, o, lse;
  a plain causal call goes to the attention op directly: _plain_attention);
- o_proj (keeps o; a 16-bit cast of its weight made again in backward under autocast, as the pipeline does);
- norm_fusion.norm_mlp: post-attention norm -> gate/up -> act(gate) * up -> down (keeps h, statistics, gate, up);

so it keeps what the layer's pipeline keeps (the floor) and nothing is rebuilt by hooks: the norm outputs and the
product are rebuilt inside those nodes' backwards from the same kernels and statistics. Outputs and gradients are
the generic path's bits (norm_fusion sums the projections' input gradients as autograd's engine does).

A projection may be a PEFT LoRA layer over a plain Linear or over bitsandbytes' 4-bit Linear (QLoRA): its one
active adapter is then computed inside the same nodes (lora_fusion.py: lora_A's output and the dropout seed kept,
the dropped input rebuilt; a 4-bit base's matmul as its forward computes it), read at each call (disabled or merged
adapters run the base alone); several active adapters, variants, biases on the adapters or a 4-bit base, 8-bit
bases, or the "none" mode run PEFT's forward on the generic path.

The layout is recognised by what it is, never by a name alone: the decoder layer's and attention's forwards must be
token for token ones that were read and found to compute exactly this (`_VERIFIED_LAYERS`, `_VERIFIED_ATTENTION`;
a transformers release that changes them runs the generic path until they are read again); children, patches and
module types must be the converted Llama layer's; and at each call nothing may ask for the submodules' own calls
(hooks on them or global ones, a replaced forward), for attention weights, for a checkpointed mode or for another
attention implementation. Anything else runs the generic path (converted_layer.py), which handles every case.
"""

import functools
import hashlib
import inspect
import io
import textwrap
import tokenize

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules import module as _nn_module

from .. import compat, rng
from ..activations import kernel_activation
from ..double_backward import first_order_only
from ..keeping import pipeline
from ..lora_fusion import Adapter, FourBitBase, lora_linear
from ..memory.ledger import is_ledger_hook
from ..norm_fusion import compute_dtype, norm_linear, norm_mlp
from ..ops.attention import attention as attention_op
from ..storages import PLAIN_TENSOR_TYPES
from . import attention, chunked_attention
from .patches import gate_up_mlp_forward, rms_eps, rms_norm_forward
from .patching import PATCH
from .peft import adapter_linear_forward

_CHILDREN = frozenset(("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"))
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_MLP_CHILDREN = frozenset((*_MLP_PROJECTIONS, "act_fn"))

# sha256 of the token stream (comments, docstrings and decorators left out) of forwards read line by line and found
# to compute exactly what fused_forward computes. transformers 5.17-5.23 and 5.24-5.25 differ only in the kv
# cache's name (past_key_values, then cache) and whether its update is handed the attention's kwargs.
# The decoder layer's (Llama's, which Gemma, Mistral, Qwen2, Qwen3, Ministral and SmolLM3 share token for token) ->
# the keyword its kv cache arrives by.
_VERIFIED_LAYERS = {
    "437ab585baff4a300ddf5a772bfa993a79b344ca87eb627a1dd9de9b8cd8e658": "past_key_values",  # 5.17-5.23
    "8fa87485cb3a2cc75f5288a2bf8101c2c84be59f3b02e94df2481303bce775ad": "cache",  # 5.24-5.25
}


def _config_window(attn):
    return getattr(attn.config, "sliding_window", None)


def _own_window(attn):
    return attn.sliding_window


# The attention's -> (the sliding window it passes to the attention function, None for none; whether the cache's
# update is handed its kwargs)
_VERIFIED_ATTENTION = {
    # Llama, Gemma
    "4b578d7546dbc52269c38033ce35c79c88bccc7c8666ca407d863ef05937f645": (None, False),  # 5.17-5.23
    "c74233296df18484a41276ac19bbad022fe07c1d1cdc80cce505d40a5c7429bf": (None, True),  # 5.24-5.25
    # Qwen2, Ministral: the module's own window (set per layer type)
    "bba8e6dcedd7e27dec642dde89cf19fa5c9fee8af598a0a6cee604b17df1010d": (_own_window, False),
    "44f58bde59e6fd449ac4a9d050a90f9620c290e86bae02ad8f1ebcd3fd615771": (_own_window, True),
    # Mistral: the config's
    "b9cc6708771341514624a0506740b5831d9b556f2664ceb61e77ffe4f924886c": (_config_window, False),
    "74555a2c1d2b5627be0405f14be48c43c45467cf38ea0f5f6078b615e22e8f0d": (_config_window, True),
}


def fingerprint(function):
    """fingerprint_source of `function`'s source (None when it cannot be read)."""
    try:
        return fingerprint_source(inspect.getsource(function))
    except (OSError, TypeError, tokenize.TokenError, IndentationError):
        return None


def fingerprint_source(source):
    """sha256 of a function's source as tokens from `def` on: names, operators, numbers and strings, without
    decorators, comments, layout or its docstring."""
    source = textwrap.dedent(source)
    kept, started, docstring_next = [], False, False
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if not started:
            started = tok.type == tokenize.NAME and tok.string == "def"
            if not started:
                continue
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            if tok.type == tokenize.INDENT and kept[-1] == ":" and not docstring_next:
                docstring_next = True  # the body's first statement may be the docstring
            continue
        if docstring_next is True:
            docstring_next = "done"
            if tok.type == tokenize.STRING:
                continue
        kept.append(tok.string)
    return hashlib.sha256(" ".join(kept).encode()).hexdigest()


@functools.cache
def _verified_form(layer_cls, attention_cls):
    """(the cache keyword, the window reader, whether the cache's update takes kwargs) when both forwards were
    verified, else None."""
    cache_kw = _VERIFIED_LAYERS.get(fingerprint(layer_cls.forward))
    attention_form = _VERIFIED_ATTENTION.get(fingerprint(attention_cls.forward))
    if cache_kw is None or attention_form is None:
        return None
    return (cache_kw, *attention_form)


def _patched_with(module, function):
    """The keywords `module` was patched with when its patch is `function` (plain or a functools.partial); else
    None."""
    patch = vars(module).get(PATCH)
    func = getattr(patch, "__func__", None)
    if func is function:
        return {}
    if isinstance(func, functools.partial) and func.func is function and not func.args:
        return dict(func.keywords)
    return None


class Layout:
    """The modules of a converted layer of the fused layout, read once per change of its modules."""

    __slots__ = ("norm1", "attn", "q", "k", "v", "o", "norm2", "mlp", "gate", "up", "down", "activation",
                 "offset1", "offset2", "cache_kw", "window", "update_kwargs", "bypassed", "unpatched", "norm_params",
                 "qkv_params", "o_params", "mlp_params", "loras", "quantized", "plain_params", "plain")

    def __init__(self, layer, norm1, offset1, norm2, offset2, activation, form):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp
        children = [getattr(attn, n) for n in _PROJECTIONS] + [getattr(mlp, n) for n in _MLP_PROJECTIONS]
        # each projection's Linear (a LoRA layer's base layer) and, in projection order, its LoRA layer or None
        self.loras = tuple(m if _is_lora(m) else None for m in children)
        linears = [m if lora is None else m.base_layer for m, lora in zip(children, self.loras)]
        self.q, self.k, self.v, self.o, self.gate, self.up, self.down = linears
        # each projection's quantized base (a LoRA layer's 4-bit one) or None; the plain Linears' parameter dicts
        self.quantized = tuple(None if type(m) is torch.nn.Linear else m for m in linears)
        self.plain_params = tuple(m._parameters for m, q in zip(linears, self.quantized) if q is None)
        # plain Linears alone: no projection has a LoRA call (_lora_calls)
        self.plain = all(m is None for m in self.loras + self.quantized)
        self.offset1, self.offset2, self.activation = offset1, offset2, activation
        # the keyword the layer's kv cache arrives by; what reads the sliding window the attention module passes
        # (None: it passes none); whether it hands the cache's update its kwargs
        self.cache_kw, self.window, self.update_kwargs = form
        # the modules' own parameter dicts, read at every call (a parameter assigned anew lands in them; reading
        # them is what Module.__getattr__ does, without its Python)
        self.norm_params = (norm1._parameters, norm2._parameters)
        self.qkv_params = (self.q._parameters, self.k._parameters, self.v._parameters)
        self.o_params = self.o._parameters
        self.mlp_params = (self.gate._parameters, self.up._parameters, self.down._parameters)
        # the modules whose calls the fast path makes without __call__ (a LoRA layer's, all of them): none may carry
        # hooks
        adapters = [sub for lora in self.loras if lora is not None for sub in lora.modules()]
        self.bypassed = (norm1, attn, *linears, norm2, mlp, mlp.act_fn, *adapters)
        # those among them whose forward is their class's (the norms, the MLP and a LoRA layer's Linears and
        # dropouts carry our patch, which ConvertedLayerState.make_current puts back when replaced): a forward set on
        # one later is the user's
        self.unpatched = (attn, *children, mlp.act_fn, *(q for q in self.quantized if q is not None),
                          *(m for m in adapters if type(m) is torch.nn.Identity))


def layout_of(layer):
    """The layer's Layout when it is a converted layer of the fused layout (see the module doc), else None."""
    if layer._modules.keys() != _CHILDREN:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if attn._modules.keys() != set(_PROJECTIONS) or mlp._modules.keys() != _MLP_CHILDREN:
        return None
    form = _verified_form(type(layer), type(attn))
    # a chunked-attention layer (by the config's layer_types) runs the generic path: fused_forward's plain attention
    # call has no chunks
    if form is None or not getattr(attn, "is_causal", False) or chunked_attention.chunk_size(attn) is not None:
        return None
    if _patched_with(mlp, gate_up_mlp_forward) != {}:
        return None
    norms = [_patched_with(getattr(layer, name), rms_norm_forward)
             for name in ("input_layernorm", "post_attention_layernorm")]
    if any(kw is None or set(kw) - {"offset"} for kw in norms):
        return None
    linears = [getattr(attn, n) for n in _PROJECTIONS] + [getattr(mlp, n) for n in _MLP_PROJECTIONS]
    if not all(_plain_linear(m) or _fusable_lora(m) for m in linears):
        return None
    if "forward" in vars(attn) or "forward" in vars(mlp.act_fn):
        return None
    activation = kernel_activation(mlp.act_fn)
    if activation is None:
        return None
    return Layout(layer, layer.input_layernorm, float(norms[0].get("offset", 0.0)), layer.post_attention_layernorm,
                  float(norms[1].get("offset", 0.0)), activation, form)


def _plain_linear(m):
    """An nn.Linear with its class's forward, or, inside a LoRA layer, with its adapter patch (models/peft.py)."""
    return type(m) is torch.nn.Linear and ("forward" not in vars(m) or _patched_with(m, adapter_linear_forward) == {})


def _is_lora(m):
    return type(m) in _lora_classes()[:2]


@functools.cache
def _lora_classes():
    """(PEFT's LoRA layer over an nn.Linear, PEFT's over a 4-bit base, bitsandbytes' Linear4bit), None for what is
    not installed."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # without peft no module is one
        return None, None, None
    try:
        from bitsandbytes.nn import Linear4bit as base4
        from peft.tuners.lora.bnb import Linear4bit
    except ImportError:
        return Linear, None, None
    return Linear, Linear4bit, base4


def _fusable_lora(m):
    """A PEFT LoRA layer whose forward is its class's (its adapters are read at each call) over a plain Linear, or
    over a 4-bit base (the bitsandbytes one for PEFT's 4-bit layer; for its plain layer, a base that says how the
    fused nodes compute it: selective_ckpt.fit's stand-in)."""
    if not _is_lora(m) or "forward" in vars(m) or getattr(m, "fan_in_fan_out", False):
        return False
    base = m.base_layer
    if type(m) is _lora_classes()[0]:
        return _plain_linear(base) or (hasattr(type(base), "fused_base") and "forward" not in vars(base))
    return type(base) is _lora_classes()[2] and "forward" not in vars(base)


def _quantized_base(m):
    """lora_fusion's base for quantized Linear m as its forward would compute this call, or False where only its
    forward can (its state not settled yet, a bias, a weight that trains, weights packed for CPU inference)."""
    if hasattr(type(m), "fused_base"):
        return m.fused_base() or False
    w = m._parameters["weight"]
    state = getattr(w, "quant_state", None)
    if (not compat.is_4bit(w) or w.requires_grad or m._parameters.get("bias") is not None or state is None
            or not m.compute_type_is_set or m.compute_dtype is None or len(state.shape) != 2
            or getattr(state, "packing_format_for_cpu", False)):
        return False
    if m.in_features == state.shape[0] != state.shape[1]:  # a weight quantized transposed: bitsandbytes warns
        return False
    return FourBitBase(m)


def _lora_call(m, quantized, dtype, autocast):
    """How projection m (a LoRA layer or a plain Linear) computes this call: None for a plain Linear alone; else
    (lora_A weight, lora_B weight, scaling, dropout p, x cast to lora_A's dtype, base) as lora_fusion runs it (the
    weights None for a quantized base alone); False where only PEFT's forward computes it (several active adapters,
    a variant, a merged layer with adapters disabled, biases, another dropout)."""
    base = None
    if quantized is not None:
        base = _quantized_base(quantized)
        if base is False:
            return False
    alone = None if base is None else (None, None, 0.0, 0.0, False, base)
    if m is None:
        return alone
    if m.disable_adapters:
        return False if m.merged else alone
    if m.merged:
        return alone
    names = [n for n in m.active_adapters if n in m.lora_A]
    if not names:
        return alone
    if len(names) > 1 or names[0] in m.lora_variant:
        return False
    name = names[0]
    a, b, drop = m.lora_A[name], m.lora_B[name], m.lora_dropout[name]
    if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear:
        return False
    wa, wb = a._parameters["weight"], b._parameters["weight"]
    if a._parameters["bias"] is not None or b._parameters["bias"] is not None or type(wa) not in _PARAMETERS \
            or type(wb) not in _PARAMETERS or wa.dtype != wb.dtype:
        return False
    # PEFT's 4-bit layer casts x to lora_A's dtype only outside autocast, its plain one always (unless told not to)
    cast = not autocast if type(m) is not _lora_classes()[0] else getattr(m, "cast_input_dtype_enabled", True)
    if wa.dtype != dtype and (not autocast or not cast):
        return False
    if type(drop) is torch.nn.Dropout:
        p = drop.p if drop.training else 0.0
        if p == 1 or drop.inplace:
            return False
    elif type(drop) is torch.nn.Identity:
        p = 0.0
    else:
        return False
    return wa, wb, m.scaling[name], p, cast, base


def _lora_calls(layout, dtype, autocast):
    """_lora_call of each projection, or False where one needs PEFT's forward."""
    if layout.plain:
        return _PLAIN_CALLS
    calls = tuple([_lora_call(m, q, dtype, autocast) for m, q in zip(layout.loras, layout.quantized)])
    return False if False in calls else calls


_PLAIN_CALLS = (None,) * (len(_PROJECTIONS) + len(_MLP_PROJECTIONS))


def _hooked(modules):
    """Whether a hook would run on one of `modules` if it were called: global hooks but memory.ledger's (which
    only name the module running: the layer's own call names it), or any of its own but transformers' output
    capturing's (installed for good once a forward asks for attention weights, inert unless the running forward's
    collector asks: `applies` checks that)."""
    if _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks:
        return True
    for hooks in (_nn_module._global_forward_hooks, _nn_module._global_forward_pre_hooks):
        if hooks and not all(map(is_ledger_hook, hooks.values())):
            return True
    for m in modules:
        if m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return True
        if m._forward_hooks and not all(map(compat.is_output_capturing_hook, m._forward_hooks.values())):
            return True
    return False


def _parameters_fit(layout, x, autocast):
    """Whether every parameter is a plain Parameter the fused nodes compute with as transformers would: the norms'
    weights in x's dtype (the patched norm's kernel branch); without autocast every Linear in x's dtype too."""
    dtype = x.dtype
    for params in layout.norm_params:
        w = params["weight"]
        if type(w) not in _PARAMETERS or w.dtype != dtype:
            return False
    for params in layout.plain_params:  # a quantized base's: _quantized_base
        for t in params.values():
            if t is not None and (type(t) not in _PARAMETERS or (not autocast and t.dtype != dtype)):
                return False
    return True


# a plain Parameter; under selective_ckpt.fit's simulated step a FakeTensor (a Parameter of one keeps its type), so the
# simulation runs the path a real step runs
_PARAMETERS = (torch.nn.Parameter, FakeTensor)
_OTHER_CACHE_KW = {"cache": "past_key_values", "past_key_values": "cache"}


def applies(layout, x, kwargs, store=False):
    """The LoRA calls of the projections (_lora_calls) when this call can take the fast path (the per-call half of
    the module doc's conditions), else None. `store`: the policy keeps the norm outputs (not with LoRA)."""
    if type(x) not in PLAIN_TENSOR_TYPES or not x.is_floating_point() or x.dim() != 3:
        return None
    if _OTHER_CACHE_KW[layout.cache_kw] in kwargs:
        return None
    pe = kwargs.get("position_embeddings")
    if not isinstance(pe, tuple) or len(pe) != 2:
        return None
    for t in pe:  # loops, not generators: this runs at every training call
        if type(t) not in PLAIN_TENSOR_TYPES or t.requires_grad or t.dim() != 3:
            return None
    if compat.eager_attention_implementation(layout.attn.config) != attention.NAME or _hooked(layout.bypassed):
        return None
    for m in layout.unpatched:
        if "forward" in m.__dict__:  # a forward of its own set since: it must run
            return None
    if attention.weights_requested(layout.attn, kwargs):  # the generic path's attention call makes them
        return None
    autocast = torch.is_autocast_enabled("cpu" if x.is_cpu else x.device.type)  # is_cpu: no device object made
    if not _parameters_fit(layout, x, autocast):
        return None
    calls = _lora_calls(layout, x.dtype, autocast)
    if calls is False or (store and any(calls)):
        return None
    return calls


# --- RoPE as transformers' apply_rotary_pos_emb computes it, in one node that keeps cos and sin only.
# rotate_half(x) (the halves of x swapped, the new first half negated) is x rolled by D/2 times a sign, and a product's
# sign moves to the other factor exactly: rotate_half(x) * sin = roll(x, D/2) * signed(sin), signed(sin) being sin
# with its first half negated, bit for bit; the adjoint, unrotate_half(g * sin), is roll(g * signed(sin), D/2). So one
# roll and one product stand for four ops, and signed(sin) is made once for q and k. An odd D keeps the halves' form.

def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _unrotate_half(g):
    """The adjoint of _rotate_half: the gradient of its input from the gradient of its output (whose first block, from
    the input's second half, holds D - D // 2 entries)."""
    cut = g.shape[-1] - g.shape[-1] // 2
    return torch.cat((g[..., cut:], -g[..., :cut]), dim=-1)


_SIGNS = {}  # (D, dtype, device) -> [D] of -1 (first half) and 1: plain tensors only, made once


def _sign(like, D):
    key = (D, like.dtype, like.device)
    sign = _SIGNS.get(key)
    if sign is None:
        sign = torch.cat((like.new_full((D // 2,), -1), like.new_ones(D - D // 2)))
        # kept unless fake, traced, a mode's, or made while a CUDA graph is captured (the graph's pool owns it then)
        if type(sign) is torch.Tensor and not torch.compiler.is_compiling() and not (
                sign.is_cuda and torch.cuda.is_current_stream_capturing()):
            _SIGNS[key] = sign
    return sign


class _Rope(torch.autograd.Function):
    """q, k [B, S, heads, D] -> q * cos + rotate_half(q) * sin (and k's), cos and sin [B, S, D] broadcast over heads;
    dtypes promote as in transformers (bf16 q with fp32 tables under autocast gives fp32)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = q.dtype, k.dtype
        D = q.shape[-1]
        if D % 2:
            return (q * c) + (_rotate_half(q) * s), (k * c) + (_rotate_half(k) * s)
        s = s * _sign(s, D)
        return (q * c) + (q.roll(D // 2, -1) * s), (k * c) + (k.roll(D // 2, -1) * s)

    @staticmethod
    @first_order_only("selective_ckpt.models.fused_layer.rope")
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        need = ctx.needs_input_grad
        D = sin.shape[-1]
        odd = D % 2
        if not odd:
            s = s * _sign(s, D)
        grads = []
        # autograd's order: each product's gradient cast to the input's dtype, then summed in it
        for g, dtype, needed in ((dq, ctx.dtypes[0], need[0]), (dk, ctx.dtypes[1], need[1])):
            if not needed:
                grads.append(None)
            elif odd:
                grads.append((g * c).to(dtype) + _unrotate_half((g * s).to(dtype)))
            else:
                grads.append((g * c).to(dtype) + (g * s).to(dtype).roll(D // 2, -1))
        return grads[0], grads[1], None, None


# --- a Linear under autocast that keeps its fp32 weight, not autocast's 16-bit copy of it (made again in backward)

class _CastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, cd):
        ctx.cd, ctx.dtypes = cd, (x.dtype, w.dtype, None if b is None else b.dtype)
        ctx.save_for_backward(x, w)
        return F.linear(x.to(cd), w.to(cd), None if b is None else b.to(cd))

    @staticmethod
    @first_order_only("selective_ckpt.models.fused_layer.linear")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        cd, (xd, wd, bd) = ctx.cd, ctx.dtypes
        g2 = g.reshape(-1, g.shape[-1])
        dx = (g @ w.to(cd)).to(xd) if need[0] else None
        dw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(cd)).to(wd) if need[1] else None
        db = g2.sum(0).to(bd) if bd is not None and need[2] else None
        return dx, dw, db, None


# what a plain causal self-attention call (_plain_attention) may carry besides q, k, v
_PLAIN_ATTENTION_KWARGS = frozenset(("position_ids", "use_cache"))


def _plain_attention(q, k, v, scaling):
    """o [B, S, H, D] of attention.selective_attention for a call of this path with no mask, earlier keys, window,
    dropout or other argument (a training step without padding): the same attention call, without the general one's
    per-call questions, each of which has this path's answer: no layer tile (the fused modes have none), no weights
    (`applies`), causal and not chunked (`layout_of`), q, k, v their own buffers (RoPE's outputs and v's own
    projection output, never views into a larger one)."""
    q, k, v = attention.in_compute_dtype(q, k, v)
    return attention_op(q, k, v, True, 0.0, scaling).transpose(1, 2)


def _linear(x, params, cd):
    w, b = params["weight"], params.get("bias")
    if w.dtype == cd and (b is None or b.dtype == cd) and x.dtype == cd:
        return F.linear(x, w, b)
    return _CastLinear.apply(x, w, b, cd)


def _adapters(calls, x):
    """norm_fusion's adapters argument for these projections' LoRA calls (None when none has one), each dropout's
    seed drawn on x's device in projection order, as PEFT's forward draws them."""
    if not any(calls):
        return None
    device = x.device
    return [None if c is None else (c[0], c[1], Adapter(c[2], c[3], rng.draw_seed_tensor(device) if c[3] else None,
                                                        c[4], c[5]))
            for c in calls]


def fused_forward(layout, store, lora, hidden_states, attention_mask=None, position_ids=None, use_cache=False,
                  position_embeddings=None, **kwargs):
    """The layer's forward (transformers' LlamaDecoderLayer.forward with its attention's, same arguments and result)
    in the fused nodes; `store`: keep the norm outputs and the MLP's product too (policy "none"); `lora`: what
    `applies` gave (the projections' LoRA calls)."""
    cache = kwargs.pop(layout.cache_kw, None)
    x = hidden_states
    attn = layout.attn
    B, S, _ = x.shape
    D = attn.head_dim
    plain = lora is _PLAIN_CALLS  # plain Linears: no adapters to read
    # .get: a base may hold no bias entry at all (fit's 4-bit stand-in sets a plain None)
    linears = [(p["weight"], p.get("bias")) for p in layout.qkv_params]
    q, k, v = norm_linear(x, layout.norm_params[0]["weight"], None, linears, norm="rmsnorm", eps=rms_eps(layout.norm1),
                          offset=layout.offset1, store=store, adapters=None if plain else _adapters(lora[:3], x))
    cos, sin = position_embeddings
    q, k = _Rope.apply(q.view(B, S, -1, D), k.view(B, S, -1, D), cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, S, -1, D).transpose(1, 2)
    kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}
    if cache is not None:
        if layout.update_kwargs:
            k_all, v_all = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        else:
            k_all, v_all = cache.update(k, v, attn.layer_idx)
        # a cache that held nothing before returns copies of this call's k, v: attention reads (and keeps) the
        # originals, as the generic path's _attention_reads_own_kv has it
        if k_all.shape != k.shape or v_all.shape != v.shape:
            k, v = k_all, v_all
    dropout = 0.0 if not attn.training else attn.attention_dropout
    # a kv cache that held nothing before leaves this call's keys: attention is still plain self-attention
    if attention_mask is None and layout.window is None and not dropout and q.shape[2] == k.shape[2] and \
            kwargs.keys() <= _PLAIN_ATTENTION_KWARGS:
        o = _plain_attention(q, k, v, attn.scaling)
    else:
        if layout.window is not None:
            kwargs["sliding_window"] = layout.window(attn)
        o, _ = attention.selective_attention(attn, q, k, v, attention_mask, dropout=dropout, scaling=attn.scaling,
                                             **kwargs)
    o = o.reshape(B, S, -1).contiguous()
    if lora[3] is None:
        h = x + _linear(o, layout.o_params, compute_dtype(x))
    else:
        (a, bw, adapter), = _adapters(lora[3:4], x)
        h = x + lora_linear(o, layout.o_params["weight"], layout.o_params.get("bias"), a, bw, adapter)
    pipeline.tag(h, "residual", if_untagged=True)
    params = [t for p in layout.mlp_params for t in (p["weight"], p.get("bias"))]
    return h + norm_mlp(h, layout.norm_params[1]["weight"], None, params, norm="rmsnorm", eps=rms_eps(layout.norm2),
                        offset=layout.offset2, mlp="gated", activation=layout.activation, store=store,
                        adapters=None if plain else _adapters(lora[4:], x))
