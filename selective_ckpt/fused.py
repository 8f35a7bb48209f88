"""Pre-norm fusions of the decoder layer: a norm and the matmul that consumes it in one autograd node.

- `ln_linear(...)`: LayerNorm followed by a Linear. It keeps x, mean and rstd and rebuilds LN(x)
  in backward for the Linear's weight gradient (or keeps LN(x) when `store`).
- `ln_mlp(...)`: LayerNorm followed by the GELU-MLP (ops/gelu.py): keeps x, mean, rstd and the fc1
  output; LN(x) and the GELU output are rebuilt in backward unless `store`.
- `rms_linear(...)`, `rms_mlp(...)`: the same with RMSNorm (Llama form, ops/rms_norm.py; keeps x
  and rstd) and, for the MLP, the gated MLP (ops/swiglu.py; keeps the gate and up outputs).

Stored and recomputed LayerNorm outputs come from the same kernel and the same saved statistics,
so `store=True` and `store=False` give bit-identical gradients.

Mixed precision follows eager autocast: the LayerNorm runs in the input dtype (float32 under CUDA
autocast, which is what eager's layer_norm does there) and the matmuls in `compute_dtype`.
"""

import torch
import torch.nn.functional as F

from .double_backward import first_order_only
from .ops.gelu import mlp_backward, mlp_forward
from .ops.layer_norm import layer_norm_apply, layer_norm_bwd, layer_norm_fwd
from .ops.rms_norm import rms_norm_apply, rms_norm_bwd, rms_norm_fwd
from .ops.swiglu import gated_mlp_backward, gated_mlp_forward


def norm_dtype(x):
    """The dtype eager LayerNorm computes in for x: float32 under CUDA autocast, else x's dtype."""
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.float32
    return x.dtype


def compute_dtype(x):
    """The dtype eager matmuls run in for x: the autocast dtype when autocast is on, else x's."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


def _ln_forward(x, ln_w, ln_b, eps, nd):
    xn = x.to(nd)
    y, mean, rstd = layer_norm_fwd(xn, ln_w.to(nd), _cast(ln_b, nd), eps)
    return y, mean, rstd


def _ln_recompute(x, ln_w, ln_b, mean, rstd, nd):
    return layer_norm_apply(x.to(nd), ln_w.to(nd), _cast(ln_b, nd), mean, rstd)


def _ln_grads(ctx, dy_norm, x, ln_w, mean, rstd, nd, first):
    """(dx, dln_w, dln_b) in the dtypes of x and the LayerNorm parameters."""
    dx, dw, db = layer_norm_bwd(dy_norm.to(nd).contiguous(), x.to(nd), mean, rstd, ln_w.to(nd))
    need = ctx.needs_input_grad
    return (dx.to(x.dtype) if need[first] else None, dw.to(ln_w.dtype) if need[first + 1] else None,
            db.to(ln_w.dtype) if need[first + 2] and ctx.has_ln_bias else None)


class _LNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w, b, eps, store, cd):
        nd = x.dtype if cd == x.dtype else norm_dtype(x)
        y, mean, rstd = _ln_forward(x, ln_w, ln_b, eps, nd)
        u = y.to(cd)
        out = F.linear(u, w.to(cd), _cast(b, cd))
        ctx.eps, ctx.store, ctx.cd, ctx.nd = eps, store, cd, nd
        ctx.has_ln_bias, ctx.has_bias = ln_b is not None, b is not None
        ctx.save_for_backward(x, ln_w, ln_b, w, mean, rstd, u if store else None)
        return out

    @staticmethod
    @first_order_only("selective_ckpt.fused.ln_linear")
    def backward(ctx, dout):
        x, ln_w, ln_b, w, mean, rstd, u = ctx.saved_tensors
        need = ctx.needs_input_grad
        dout = dout.contiguous()
        d2 = dout.reshape(-1, dout.shape[-1])
        dw = db = None
        if need[3]:
            if u is None:
                u = _ln_recompute(x, ln_w, ln_b, mean, rstd, ctx.nd).to(ctx.cd)
            dw = (d2.t() @ u.reshape(-1, u.shape[-1])).to(w.dtype)
        if need[4] and ctx.has_bias:
            db = d2.sum(0).to(w.dtype)
        dx = dlw = dlb = None
        if need[0] or need[1] or need[2]:
            du = dout @ w.to(ctx.cd)
            dx, dlw, dlb = _ln_grads(ctx, du, x, ln_w, mean, rstd, ctx.nd, 0)
        return dx, dlw, dlb, dw, db, None, None, None


def ln_linear(x, ln_w, ln_b, w, b, eps=1e-5, store=False):
    """F.linear(layer_norm(x), w, b) in one autograd node keeping x, mean, rstd (+ LN(x) if store)."""
    return _LNLinear.apply(x, ln_w, ln_b, w, b, float(eps), bool(store), compute_dtype(x))


class _LNMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w1, b1, w2, b2, eps, p, approximate, seed, store, cd):
        nd = x.dtype if cd == x.dtype else norm_dtype(x)
        y, mean, rstd = _ln_forward(x, ln_w, ln_b, eps, nd)
        u = y.to(cd)
        w1c, b1c, w2c, b2c = w1.to(cd), _cast(b1, cd), w2.to(cd), _cast(b2, cd)
        out, h, a = mlp_forward(u, w1c, b1c, w2c, b2c, p, approximate, seed, store)
        ctx.eps, ctx.store, ctx.cd, ctx.nd = eps, store, cd, nd
        ctx.p, ctx.approximate = p, approximate
        ctx.has_ln_bias = ln_b is not None
        ctx.param_dtypes = (w1.dtype, None if b1 is None else b1.dtype, w2.dtype, None if b2 is None else b2.dtype)
        ctx.save_for_backward(x, ln_w, ln_b, w1c, b1c, w2c, b2c, mean, rstd, h, a, u if store else None,
                              seed if p else None)
        return out

    @staticmethod
    @first_order_only("selective_ckpt.fused.ln_mlp")
    def backward(ctx, dy):
        x, ln_w, ln_b, w1, b1, w2, b2, mean, rstd, h, a, u, seed = ctx.saved_tensors
        need = ctx.needs_input_grad
        if u is None:
            u = _ln_recompute(x, ln_w, ln_b, mean, rstd, ctx.nd).to(ctx.cd)
        need_u = need[0] or need[1] or need[2]
        mlp_need = (need_u, need[3], need[4], need[5], need[6])
        du, dw1, db1, dw2, db2 = mlp_backward(dy.contiguous(), u, h, a, w1, b1, w2, b2, ctx.p, ctx.approximate,
                                                 seed, mlp_need)
        grads = [g if (g is None or dt is None) else g.to(dt) for g, dt in zip((dw1, db1, dw2, db2), ctx.param_dtypes)]
        dx = dlw = dlb = None
        if need_u:
            dx, dlw, dlb = _ln_grads(ctx, du, x, ln_w, mean, rstd, ctx.nd, 0)
        return (dx, dlw, dlb, *grads, None, None, None, None, None, None)


def ln_mlp(x, ln_w, ln_b, w1, b1, w2, b2, eps=1e-5, dropout_p=0.0, approximate="none", seed=None, store=False):
    """gelu_mlp(layer_norm(x)) in one autograd node keeping x, mean, rstd and the fc1 output.

    `seed` is the seed tensor (rng.seed_arg) on x's device, required when dropout_p > 0.

    With `store`, LN(x) and the GELU output are kept too (nothing recomputed, same bits).
    """
    return _LNMLP.apply(x, ln_w, ln_b, w1, b1, w2, b2, float(eps), float(dropout_p), approximate, seed, bool(store),
                        compute_dtype(x))


# RMSNorm (Llama form: offset 0) runs in the input's dtype whatever autocast says, as Hugging Face's
# LlamaRMSNorm does (it upcasts to float32 itself and casts back to the input dtype).


def _rms_grads(dy_norm, x, norm_w, rstd, need_x, need_w):
    """(dx, dnorm_w) in the dtypes of x and the norm weight, None where not needed."""
    dx, dw = rms_norm_bwd(dy_norm.to(x.dtype).contiguous(), x, rstd, norm_w.to(x.dtype), 0.0)
    return (dx if need_x else None), (dw.to(norm_w.dtype) if need_w else None)


class _RMSLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_w, w, b, eps, store, cd):
        y, rstd = rms_norm_fwd(x, norm_w.to(x.dtype), eps, 0.0)
        u = y.to(cd)
        out = F.linear(u, w.to(cd), _cast(b, cd))
        ctx.cd, ctx.has_bias = cd, b is not None
        ctx.save_for_backward(x, norm_w, w, rstd, u if store else None)
        return out

    @staticmethod
    @first_order_only("selective_ckpt.fused.rms_linear")
    def backward(ctx, dout):
        x, norm_w, w, rstd, u = ctx.saved_tensors
        need = ctx.needs_input_grad
        d2 = dout.contiguous().reshape(-1, dout.shape[-1])
        dw = db = dx = dnw = None
        if need[2]:
            if u is None:
                u = rms_norm_apply(x, norm_w.to(x.dtype), rstd, 0.0).to(ctx.cd)
            dw = (d2.t() @ u.reshape(-1, u.shape[-1])).to(w.dtype)
            del u
        if need[3] and ctx.has_bias:
            db = d2.sum(0).to(w.dtype)
        if need[0] or need[1]:
            du = (d2 @ w.to(ctx.cd)).reshape(x.shape)
            dx, dnw = _rms_grads(du, x, norm_w, rstd, need[0], need[1])
        return dx, dnw, dw, db, None, None, None


def rms_linear(x, norm_w, w, b, eps=1e-6, store=False):
    """F.linear(rms_norm(x), w, b) in one autograd node keeping x and rstd (+ the norm output if store)."""
    return _RMSLinear.apply(x, norm_w, w, b, float(eps), bool(store), compute_dtype(x))


class _RMSMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_w, w_gate, b_gate, w_up, b_up, w_down, b_down, eps, p, activation, seed, store, cd):
        y, rstd = rms_norm_fwd(x, norm_w.to(x.dtype), eps, 0.0)
        u = y.to(cd)
        params = tuple(_cast(t, cd) for t in (w_gate, b_gate, w_up, b_up, w_down, b_down))
        out, gate, up, a = gated_mlp_forward(u, *params, p, activation, seed, store)
        ctx.cd, ctx.p, ctx.activation = cd, p, activation
        ctx.param_dtypes = tuple(None if t is None else t.dtype for t in (w_gate, b_gate, w_up, b_up, w_down, b_down))
        ctx.save_for_backward(x, norm_w, *params, rstd, gate, up, a, u if store else None, seed if p else None)
        return out

    @staticmethod
    @first_order_only("selective_ckpt.fused.rms_mlp")
    def backward(ctx, dy):
        x, norm_w, wg, bg, wu, bu, wd, bd, rstd, gate, up, a, u, seed = ctx.saved_tensors
        need = ctx.needs_input_grad
        if u is None:
            u = rms_norm_apply(x, norm_w.to(x.dtype), rstd, 0.0).to(ctx.cd)
        need_u = need[0] or need[1]
        grads = gated_mlp_backward(dy.contiguous(), u, gate, up, a, wg, bg, wu, bu, wd, bd, ctx.p, ctx.activation,
                                   seed, (need_u, *need[2:8]))
        del u
        params = [g if (g is None or dt is None) else g.to(dt) for g, dt in zip(grads[1:], ctx.param_dtypes)]
        dx = dnw = None
        if need_u:
            dx, dnw = _rms_grads(grads[0], x, norm_w, rstd, need[0], need[1])
        return (dx, dnw, *params, None, None, None, None, None, None)


def rms_mlp(x, norm_w, w_gate, b_gate, w_up, b_up, w_down, b_down, eps=1e-6, dropout_p=0.0, activation="silu",
            seed=None, store=False):
    """swiglu_mlp(rms_norm(x)) in one autograd node keeping x, rstd and the gate and up outputs.

    `seed` is the seed tensor (rng.seed_arg) on x's device, required when dropout_p > 0. With
    `store`, the norm output and the product act(gate) * up are kept too (nothing rebuilt, same bits).
    """
    return _RMSMLP.apply(x, norm_w, w_gate, b_gate, w_up, b_up, w_down, b_down, float(eps), float(dropout_p),
                         activation, seed, bool(store), compute_dtype(x))
