"""A norm and what consumes its output, in one autograd node: the pre-norm fusion of the decoder layer.

The norm is LayerNorm (affine, with or without bias; keeps x, mean, rstd) or RMSNorm with an offset
(y = x * rstd * (offset + w), ops/rms_norm.py; keeps x and rstd). The consumer is

- `norm_linear(...)`: one or several Linears reading the norm output (q, k, v as one or three);
- `norm_mlp(...)`: an MLP of any kernel activation, plain (fc1 -> act -> fc2, ops/gelu_mlp.py; keeps
  the fc1 output) or gated (down(act(gate) * up), ops/gated_mlp.py; keeps the gate and up outputs).

The norm output (and the MLP's activation output) is rebuilt in backward unless `store`. Stored and
rebuilt outputs come from the same kernel and the same saved statistics, so `store=True` and
`store=False` give bit-identical gradients.

Mixed precision follows eager autocast: LayerNorm runs in the input dtype (float32 under CUDA
autocast, which is what eager's layer_norm does there), RMSNorm in the input dtype whatever
autocast says (Hugging Face's RMSNorm upcasts to float32 itself and casts back), and the matmuls
in `compute_dtype`.
"""

import torch
import torch.nn.functional as F

from . import lora_fusion
from .activations import GELU_APPROXIMATE, KERNEL_ACTIVATIONS
from .double_backward import first_order_only
from .keeping import pipeline
from .ops.gated_mlp import (
    gated_mlp_backward,
    gated_mlp_forward,
    gated_product_backward_op,
    gated_product_op,
    gated_product_rebuild_op,
)
from .ops.gelu_mlp import gelu_mlp_backward, gelu_mlp_forward
from .ops.layer_norm import layer_norm_apply, layer_norm_bwd, layer_norm_fwd
from .ops.rms_norm import rms_norm_apply, rms_norm_bwd, rms_norm_fwd
from .validation import NORMS, check_choice

MLP_KINDS = ("plain", "gated")
# check_choice's tables, made once (not per call)
_NORM_CHOICES, _MLP_CHOICES, _GATED_ACTIVATIONS = (dict.fromkeys(NORMS), dict.fromkeys(MLP_KINDS),
                                                   dict.fromkeys(KERNEL_ACTIVATIONS))
# _NormThen's inputs before x: the settings (op, norm, eps, offset, consumer, mlp, activation, p, store, cd, adapters:
# one tuple, as autograd.Function.apply does work per argument) and the seed (a tensor, so an input of its own)
_SETTINGS = 2


def norm_dtype(x):
    """The dtype eager LayerNorm computes in for x: float32 under CUDA autocast, else x's dtype."""
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.float32
    return x.dtype


def compute_dtype(x):
    """The dtype eager matmuls run in for x: the autocast dtype when autocast is on, else x's."""
    kind = "cpu" if x.is_cpu else x.device.type  # is_cpu: no device object made (a call per node)
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


# --- the norm: forward, rebuild from its statistics, gradients

def _norm_forward(norm, x, w, b, eps, offset, nd):
    """(y, statistics) with y in nd."""
    if norm == "rmsnorm":
        y, rstd = rms_norm_fwd(x, w.to(x.dtype), eps, offset)
        return y, (rstd,)
    y, mean, rstd = layer_norm_fwd(x.to(nd), w.to(nd), _cast(b, nd), eps)
    return y, (mean, rstd)


def _norm_rebuild(ctx, x, w, b, stats):
    if ctx.norm == "rmsnorm":
        return rms_norm_apply(x, w.to(x.dtype), stats[0], ctx.offset)
    nd = ctx.nd
    return layer_norm_apply(x.to(nd), w.to(nd), _cast(b, nd), *stats)


def _norm_grads(ctx, du, x, w, stats):
    """(dx, dw, db) in the dtypes of x and the norm parameters, None where not needed."""
    need = ctx.needs_input_grad[_SETTINGS:_SETTINGS + 3]  # x, weight, bias
    if ctx.norm == "rmsnorm":
        dx, dw = rms_norm_bwd(du.to(x.dtype).contiguous(), x, stats[0], w.to(x.dtype), ctx.offset)
        return (dx if need[0] else None), (dw.to(w.dtype) if need[1] else None), None
    nd = ctx.nd
    dx, dw, db = layer_norm_bwd(du.to(nd).contiguous(), x.to(nd), *stats, w.to(nd))
    return (dx.to(x.dtype) if need[0] else None, dw.to(w.dtype) if need[1] else None,
            db.to(w.dtype) if need[2] and ctx.has_norm_bias else None)


# --- the consumers. forward(ctx, y, u, params, seed) -> (outputs, tensors backward keeps), y the norm output, u
# it in the compute dtype; backward(ctx, douts, u, kept, seed, need_u, need_params, rebuild) -> (du, parameter
# grads in their dtypes), u None unless stored (not with adapters), rebuild() giving y again.

def _linears_forward(ctx, y, u, params, seed):
    cd, adapters = ctx.cd, ctx.adapters
    if adapters is None:
        outs = tuple([F.linear(u, w.to(cd), None if b is None else b.to(cd))
                      for w, b in zip(params[::2], params[1::2])])
        return outs, params
    outs, inner = [], []
    for i, adapter in enumerate(adapters):
        out, h = lora_fusion.project(y, u, *params[4 * i:4 * i + 4], adapter, cd)
        outs.append(out)
        inner.append(h)
    return tuple(outs), (*params, *inner, *_seeds(adapters))


def _linears_backward(ctx, douts, u, params, seed, need_u, need_params, rebuild):
    if ctx.adapters is not None:
        return _lora_linears_backward(ctx, douts, params, need_u, need_params, rebuild)
    cd = ctx.cd
    ws, bs = params[::2], params[1::2]
    d2s = [d.contiguous().reshape(-1, d.shape[-1]) for d in douts]
    grads = []
    if any(need_params[::2]) and u is None:
        u = rebuild().to(cd)
    for i, (w, b, d2) in enumerate(zip(ws, bs, d2s)):
        grads.append((d2.t() @ u.reshape(-1, u.shape[-1])).to(w.dtype) if need_params[2 * i] else None)
        grads.append(d2.sum(0).to(w.dtype) if need_params[2 * i + 1] and b is not None else None)
    del u
    du = None
    if need_u:
        # each Linear's input gradient cast to the norm's dtype, then summed there, the last Linear's first: the
        # order and rounding of autograd's engine, so a converted layer's fused path (models/fused_layer.py) gives
        # the bits of its generic one
        for w, d2 in zip(ws[::-1], d2s[::-1]):
            part = (d2 @ w.to(cd)).to(ctx.nd)
            du = part if du is None else du.add_(part)
        du = du.reshape(*douts[0].shape[:-1], du.shape[-1])
    return du, grads


def _lora_linears_backward(ctx, douts, kept, need_u, need_params, rebuild):
    cd, n = ctx.cd, len(ctx.adapters)
    params, inner, seeds = kept[:4 * n], kept[4 * n:5 * n], kept[5 * n:]
    y = rebuild()
    y2 = y.reshape(-1, y.shape[-1])
    u2 = y2.to(cd)
    parts, grads = [], []
    for i in range(n - 1, -1, -1):  # the last projection's gradients reach the input first (see _linears_backward)
        adapter = _with_seeds(ctx.adapters[i:i + 1], seeds[i:i + 1])[0]
        g2 = douts[i].contiguous().reshape(-1, douts[i].shape[-1])
        own, g = lora_fusion.project_backward(g2, y2, u2, *params[4 * i:4 * i + 4], inner[i], adapter, cd,
                                              (need_u, *need_params[4 * i:4 * i + 4]), ctx.nd)
        parts += own
        grads[:0] = g
    del y, y2, u2
    du = lora_fusion.summed(parts).reshape(*douts[0].shape[:-1], -1) if need_u else None
    return du, grads


def _mlp_forward(ctx, y, u, params, seed):
    cd = ctx.cd
    cast = [None if t is None else t.to(cd) for t in params]  # _cast, as a list comprehension (per call)
    if ctx.mlp == "gated":
        out, gate, up, a = gated_mlp_forward(u, *cast, ctx.p, ctx.activation, seed, ctx.store)
        inner = (gate, up)
    else:
        out, h, a = gelu_mlp_forward(u, *cast, ctx.p, GELU_APPROXIMATE[ctx.activation], seed, ctx.store)
        inner = (h,)
    for t in inner:
        pipeline.tag(t, "mlp")  # the matmul outputs (keeping.policy's classes)
    if a is not None:
        pipeline.tag(a, "norm_act")
    # the parameters themselves are kept, not their casts: under autocast a 16-bit copy of each weight would
    # be kept per layer, which backward makes again for the cost of a cast
    return (out,), (*params, *inner, a)


def _mlp_backward(ctx, douts, u, kept, seed, need_u, need_params, rebuild):
    if u is None:
        u = rebuild().to(ctx.cd)
    n = len(ctx.param_dtypes)
    cd = ctx.cd
    cast, inner = [None if t is None else t.to(cd) for t in kept[:n]], kept[n:]
    args = (douts[0].contiguous(), u, *inner, *cast, ctx.p)
    if ctx.mlp == "gated":
        grads = gated_mlp_backward(*args, ctx.activation, seed, (need_u, *need_params), dx_dtype=ctx.nd)
    else:
        grads = gelu_mlp_backward(*args, GELU_APPROXIMATE[ctx.activation], seed, (need_u, *need_params))
    del u, args
    return grads[0], [g if g is None or dt is None else g.to(dt) for g, dt in zip(grads[1:], ctx.param_dtypes)]


def _lora_mlp_forward(ctx, y, u, params, seed):
    """The gated MLP with LoRA-adapted projections (params: gate's, up's, down's (w, b, lora_A, lora_B)), in the
    ops of the generic path: projections, the product kernel, down on the product (rebuilt in backward)."""
    cd, (ag, au, ad) = ctx.cd, ctx.adapters
    gate, hg = lora_fusion.project(y, u, *params[0:4], ag, cd)
    up, hu = lora_fusion.project(y, u, *params[4:8], au, cd)
    pipeline.tag(gate, "mlp")  # the matmul outputs (keeping.policy's classes)
    pipeline.tag(up, "mlp")
    a = gated_product_op(gate, up, ctx.activation)
    out, hd = lora_fusion.project(a, a, *params[8:12], ad, cd)
    return (out,), (*params, gate, up, hg, hu, hd, *_seeds(ctx.adapters))


def _lora_mlp_backward(ctx, douts, u, kept, seed, need_u, need_params, rebuild):
    cd, act = ctx.cd, ctx.activation
    params, (gate, up, hg, hu, hd), seeds = kept[:12], kept[12:17], kept[17:]
    ag, au, ad = _with_seeds(ctx.adapters, seeds)
    ffn = gate.shape[-1]
    g2, up2 = gate.reshape(-1, ffn), up.reshape(-1, ffn)
    a2 = gated_product_rebuild_op(g2, up2, act)
    dy2 = douts[0].contiguous().reshape(-1, douts[0].shape[-1])
    parts, down = lora_fusion.project_backward(dy2, a2, a2, *params[8:12], hd, ad, cd, (True, *need_params[8:12]),
                                               a2.dtype)
    del a2
    dgate = lora_fusion.summed(parts)
    dup = gated_product_backward_op(dgate, g2, up2, act)  # dgate: written in place
    y = rebuild()
    y2 = y.reshape(-1, y.shape[-1])
    u2 = y2.to(cd)
    # up was recorded after gate: its gradients reach the input first
    parts, up_grads = lora_fusion.project_backward(dup, y2, u2, *params[4:8], hu, au, cd,
                                                   (need_u, *need_params[4:8]), ctx.nd)
    del dup
    more, gate_grads = lora_fusion.project_backward(dgate, y2, u2, *params[0:4], hg, ag, cd,
                                                    (need_u, *need_params[0:4]), ctx.nd)
    du = lora_fusion.summed(parts + more).reshape(*y.shape[:-1], -1) if need_u else None
    return du, [*gate_grads, *up_grads, *down]


def _seeds(adapters):
    return [a.seed if a is not None and a.p else None for a in adapters]


def _with_seeds(adapters, seeds):
    return [None if a is None else a.with_seed(s) for a, s in zip(adapters, seeds)]


_CONSUMERS = {"linear": (_linears_forward, _linears_backward), "mlp": (_mlp_forward, _mlp_backward),
              "lora_mlp": (_lora_mlp_forward, _lora_mlp_backward)}


class _NormThen(torch.autograd.Function):
    """x -> norm -> consumer. Inputs after the settings and the seed: x, the norm's weight and bias, then the
    consumer's (weight, bias) pairs. Keeps x, the norm statistics, what the consumer keeps, the
    dropout seed, and the norm output when `store`."""

    @staticmethod
    def forward(ctx, settings, seed, x, norm_w, norm_b, *params):
        op, norm, eps, offset, consumer, mlp, activation, p, store, cd, adapters = settings
        ctx.op, ctx.norm, ctx.offset, ctx.consumer, ctx.cd, ctx.adapters = op, norm, offset, consumer, cd, adapters
        ctx.mlp, ctx.activation, ctx.p, ctx.store = mlp, activation, p, store
        ctx.has_norm_bias = norm_b is not None
        ctx.param_dtypes = tuple([None if t is None else t.dtype for t in params])
        ctx.nd = x.dtype if norm == "rmsnorm" or cd == x.dtype else norm_dtype(x)
        y, stats = _norm_forward(norm, x, norm_w, norm_b, eps, offset, ctx.nd)
        u = y.to(cd)
        if store:
            pipeline.tag(u, "norm_act")
        outs, kept = _CONSUMERS[consumer][0](ctx, y, u, params, seed)
        if adapters is not None:  # the seeds are saved with the tensors
            ctx.adapters = tuple(None if a is None else a.without_seed() for a in adapters)
        ctx.n_stats = len(stats)
        ctx.save_for_backward(x, norm_w, norm_b, *stats, *kept, u if store else None, seed if p else None)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *douts):
        return _BACKWARD[ctx.op](ctx, *douts)


def _backward(ctx, *douts):
    x, norm_w, norm_b, *rest = ctx.saved_tensors
    stats, kept, (u, seed) = rest[:ctx.n_stats], rest[ctx.n_stats:-2], rest[-2:]
    need = ctx.needs_input_grad
    need_u = any(need[_SETTINGS:_SETTINGS + 3])

    def rebuild():
        return _norm_rebuild(ctx, x, norm_w, norm_b, stats)

    du, grads = _CONSUMERS[ctx.consumer][1](ctx, douts, u, kept, seed, need_u, need[_SETTINGS + 3:], rebuild)
    dx = dnw = dnb = None
    if need_u:
        dx, dnw, dnb = _norm_grads(ctx, du, x, norm_w, stats)
    return (None,) * _SETTINGS + (dx, dnw, dnb, *grads)


_BACKWARD = {op: first_order_only(f"selective_ckpt.norm_fusion.{op}")(_backward) for op in ("norm_linear", "norm_mlp")}


def _check_norm(norm, norm_b):
    check_choice(norm, "norm", _NORM_CHOICES)
    if norm == "rmsnorm" and norm_b is not None:
        raise ValueError("norm_b must be None for norm='rmsnorm' (RMSNorm has no bias)")


def norm_linear(x, norm_w, norm_b, linears, *, norm="layernorm", eps=1e-5, offset=0.0, store=False, adapters=None):
    """F.linear(norm(x), w, b) for each (w, b) in `linears`, in one autograd node keeping x and the
    norm statistics (+ the norm output if store). Returns one output per Linear (a tensor for one).

    norm: "layernorm" (norm_b optional) or "rmsnorm" (norm_b None; y = x * rstd * (offset + norm_w)).
    adapters: LoRA on the Linears (lora_fusion), one entry per Linear: None or (lora_A weight, lora_B weight,
    lora_fusion.Adapter), the weights None for a quantized base alone; not with `store`.
    """
    _check_norm(norm, norm_b)
    params = [t for wb in linears for t in wb]
    if not params or len(params) % 2:
        raise ValueError("linears must be a non-empty sequence of (weight, bias or None) pairs")
    settings = None
    if adapters is not None:
        params, settings = _with_adapters(linears, adapters, store)
    return _NormThen.apply(("norm_linear", norm, float(eps), float(offset), "linear", None, None, 0.0, bool(store),
                            compute_dtype(x), settings), None, x, norm_w, norm_b, *params)


def _with_adapters(linears, adapters, store):
    """(w, b, lora_A, lora_B) per Linear and the adapters' settings, from norm_linear/norm_mlp's arguments."""
    if store:
        raise ValueError("adapters cannot be combined with store=True")
    if len(adapters) != len(linears):
        raise ValueError(f"adapters must have one entry per Linear ({len(linears)}), got {len(adapters)}")
    params, settings = [], []
    for (w, b), entry in zip(linears, adapters):
        if entry is None:
            params += [w, b, None, None]
            settings.append(None)
            continue
        a, bw, adapter = entry  # a, bw None: a base of its own (adapter.base) without LoRA
        if not isinstance(adapter, lora_fusion.Adapter):
            raise TypeError(f"an adapter entry is (lora_A weight, lora_B weight, lora_fusion.Adapter), got "
                            f"{type(adapter).__name__} last")
        params += [w, b, a, bw]
        settings.append(adapter)
    return params, tuple(settings)


def norm_mlp(x, norm_w, norm_b, params, *, norm="layernorm", eps=1e-5, offset=0.0, mlp="plain", activation="gelu",
             dropout_p=0.0, seed=None, store=False, adapters=None):
    """mlp(norm(x)) in one autograd node keeping x, the norm statistics and the MLP's matmul outputs.

    params: (w1, b1, w2, b2) for mlp="plain" (fc2(act(fc1(.)))), (w_gate, b_gate, w_up, b_up, w_down,
    b_down) for mlp="gated" (down(act(gate(.)) * up(.))), nn.Linear layout, biases None or tensors.
    activation: a kernel activation ("silu", "gelu", "gelu_tanh"; the plain MLP takes the two GELUs).
    `seed` is the seed tensor (rng.seed_arg) on x's device, required when dropout_p > 0. With `store`,
    the norm output and the activation output (or product) are kept too (nothing rebuilt, same bits).
    adapters: LoRA on a gated MLP's gate, up and down (as norm_linear's; no MLP dropout, not with `store`).
    """
    _check_norm(norm, norm_b)
    check_choice(mlp, "mlp", _MLP_CHOICES)
    check_choice(activation, "activation", _GATED_ACTIVATIONS if mlp == "gated" else GELU_APPROXIMATE)
    if len(params) != (6 if mlp == "gated" else 4):
        raise ValueError(f"params of a {mlp} MLP are {'6' if mlp == 'gated' else '4'} tensors (weight, bias pairs), "
                         f"got {len(params)}")
    consumer, settings = "mlp", None
    if adapters is not None:
        if mlp != "gated" or dropout_p:
            raise ValueError("adapters apply to a gated MLP without dropout")
        params, settings = _with_adapters(list(zip(params[::2], params[1::2])), adapters, store)
        consumer = "lora_mlp"
    return _NormThen.apply(("norm_mlp", norm, float(eps), float(offset), consumer, mlp, activation, float(dropout_p),
                            bool(store), compute_dtype(x), settings), seed, x, norm_w, norm_b, *params)
