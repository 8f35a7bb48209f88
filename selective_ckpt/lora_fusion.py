"""LoRA-adapted Linears inside fused autograd nodes, in PEFT's arithmetic, the dropped input rebuilt from its seed.

PEFT's LoRA Linear computes `base(x) + lora_B(lora_A(dropout(x'))) * scaling`, x' being x cast to lora_A's dtype
when they differ. Here that runs inside one node (norm_fusion's consumers, `lora_linear` for a projection whose
input is kept anyway): it keeps lora_A's rank-wide output h and the dropout's 8-byte seed; the dropped input is
rebuilt in backward from the (itself rebuilt or kept) input. Each op is the one autograd records for PEFT's forward
under the same autocast, and backward takes their gradients in the order and dtypes of autograd's engine: the
adapter's share of the input gradient arrives before the base Linear's (its nodes were recorded later), so a
converted layer's fused path (models/fused_layer.py) gives the bits of its generic one. A 4-bit base (QLoRA) runs
bitsandbytes' 4-bit matmul as its Linear4bit forward does, and its input gradient as its autograd function does (the
weight dequantized); PEFT's 4-bit LoRA layer casts x to lora_A's dtype only outside autocast (Adapter.cast_input).
"""

import torch
import torch.nn.functional as F

from .double_backward import first_order_only
from .ops.dropout import dropout_op


class Adapter:
    """How a projection of a fused node computes: LoRA's scaling, dropout probability (0: none) and seed, whether
    x is cast to lora_A's dtype first (PEFT's Linear always, its 4-bit Linear outside autocast); `base`: None for an
    nn.Linear base, else one whose forward(x) and input_grad(g2, dtype) compute as a quantized Linear's forward and
    autograd do (FourBitBase). With no LoRA weights given only `base` is read."""

    __slots__ = ("scaling", "p", "seed", "cast_input", "base")

    def __init__(self, scaling, p, seed, cast_input=True, base=None):
        self.scaling, self.p, self.seed, self.cast_input, self.base = float(scaling), float(p), seed, cast_input, base

    def without_seed(self):
        return Adapter(self.scaling, self.p, None, self.cast_input, self.base)

    def with_seed(self, seed):
        return Adapter(self.scaling, self.p, seed, self.cast_input, self.base)


class FourBitBase:
    """bitsandbytes' Linear4bit as its forward computes: x in the layer's compute dtype, the 4-bit matmul, the
    product back in x's dtype; the input's gradient as its autograd function gives it (the weight dequantized)."""

    __slots__ = ("module",)

    def __init__(self, module):
        self.module = module

    def forward(self, x):
        import bitsandbytes as bnb

        w = self.module.weight
        return bnb.matmul_4bit(x.to(self.module.compute_dtype), w.t(), quant_state=w.quant_state).to(x.dtype)

    def input_grad(self, g2, dtype):
        from bitsandbytes.functional import dequantize_4bit

        w = self.module.weight
        g = g2.to(self.module.compute_dtype)
        return torch.matmul(g, dequantize_4bit(w.t().view(-1, 1), w.quant_state).to(g.dtype)).to(dtype)


def _input_dtype(x_dtype, a_dtype, adapter):
    """The dtype of what LoRA's dropout reads: x's, or lora_A's where PEFT casts x to it."""
    return a_dtype if adapter.cast_input else x_dtype


def _dropped(x, a_dtype, adapter):
    """PEFT's dropout(x, cast to lora_A's dtype where it casts), by seed."""
    xa = x.to(_input_dtype(x.dtype, a_dtype, adapter))
    return dropout_op(xa, adapter.p, adapter.seed) if adapter.p else xa


def project(x, u, w, b, a, bw, adapter, cd):
    """(out, h): the base's output (F.linear(u, w, b), or a quantized base's forward of x) plus, with LoRA weights,
    lora_B(lora_A(dropout(x))) * scaling, LoRA's matmuls in the compute dtype cd; u is x in cd (x itself when they
    agree). h: lora_A's output (None without LoRA)."""
    base = None if adapter is None else adapter.base
    out = F.linear(u, w.to(cd), None if b is None else b.to(cd)) if base is None else base.forward(x)
    if a is None:
        return out, None
    h = F.linear(_dropped(x, a.dtype, adapter).to(cd), a.to(cd))
    return out + F.linear(h, bw.to(cd)) * adapter.scaling, h


def project_backward(g2, x, u2, w, b, a, bw, h, adapter, cd, need, x_dtype):
    """Gradients of `project` from g2 (the output's gradient as [rows, out]): ([the input's gradient parts in the
    order autograd's engine adds them, each [rows, in] in x_dtype], (dw, db, da, dbw) or None where not needed).
    x: the input (rebuilt) as [rows, in], needed for the adapter's gradients; u2: x in cd, for the base weight's.
    need: (input, w, b, a, bw)."""
    parts = []
    base = None if adapter is None else adapter.base
    dw = (g2.t() @ u2).to(w.dtype) if need[1] and base is None else None
    db = g2.sum(0).to(b.dtype) if need[2] and b is not None and base is None else None
    da = dbw = None
    if a is not None:
        gz = g2.to(h.dtype) * adapter.scaling  # a sum promoted past LoRA's dtype hands it the gradient cast back
        h2 = h.reshape(-1, h.shape[-1])
        dbw = (gz.t() @ h2).to(bw.dtype) if need[4] else None
        dh = gz @ bw.to(cd)
        if need[3]:
            da = (dh.t() @ _dropped(x, a.dtype, adapter).to(cd)).to(a.dtype)
        if need[0]:
            dd = (dh @ a.to(cd)).to(_input_dtype(x_dtype, a.dtype, adapter))
            parts.append((dropout_op(dd, adapter.p, adapter.seed) if adapter.p else dd).to(x_dtype))
    if need[0]:
        parts.append((g2 @ w.to(cd)).to(x_dtype) if base is None else base.input_grad(g2, x_dtype))
    return parts, (dw, db, da, dbw)


def summed(parts):
    """The parts (fresh tensors) added one after another in their order, into the first."""
    total = parts[0]
    for p in parts[1:]:
        total.add_(p)
    return total


class _LoraLinear(torch.autograd.Function):
    """A LoRA-adapted Linear on an input that is kept anyway (attention's output before o_proj): keeps x, the
    weights, lora_A's output and the seed."""

    @staticmethod
    def forward(ctx, adapter, cd, x, w, b, a, bw):
        ctx.adapter, ctx.cd = adapter.without_seed(), cd
        out, h = project(x, x.to(cd), w, b, a, bw, adapter, cd)
        ctx.save_for_backward(x, w, b, a, bw, h, adapter.seed if a is not None and adapter.p else None)
        return out

    @staticmethod
    @first_order_only("selective_ckpt.lora_fusion.lora_linear")
    def backward(ctx, g):
        x, w, b, a, bw, h, seed = ctx.saved_tensors
        adapter, cd = ctx.adapter.with_seed(seed), ctx.cd
        x2 = x.reshape(-1, x.shape[-1])
        g2 = g.reshape(-1, g.shape[-1])
        need = ctx.needs_input_grad[2:]
        parts, grads = project_backward(g2, x2, x2.to(cd), w, b, a, bw, h, adapter, cd, need, x.dtype)
        dx = summed(parts).reshape(x.shape) if need[0] else None
        return (None, None, dx, *grads)


def lora_linear(x, w, b, a, bw, adapter):
    """PEFT's LoRA Linear forward (see the module doc; a and bw None: the base alone, a quantized one's as its
    forward computes) in one node that keeps x; matmuls in the autocast dtype when autocast is on for x's device."""
    kind = x.device.type
    cd = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    return _LoraLinear.apply(adapter, cd, x, w, b, a, bw)
