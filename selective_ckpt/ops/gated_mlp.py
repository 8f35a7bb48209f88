"""The gated MLP with selective recomputation: y = dropout(down(act(gate(x)) * up(x))).

act is a kernel activation (selective_ckpt/activations.py): SiLU (SwiGLU: Llama, Mistral, Qwen),
tanh-GELU (GeGLU: Gemma) or exact erf GELU (a Llama-shaped model with hidden_act="gelu"). gate and up are two
matmuls with nn.Linear weights, not one packed [2 * ffn, h] matmul (docs/kernels/gated_mlp.md):
the model's own gate_proj / up_proj modules and state-dict keys stay as they are, and no packed
weight is concatenated (and its gradient split) every step. Biases go inside the matmuls (addmm).

Backward keeps x, the gate and up outputs (2 * ffn per token) and the dropout seed. The product
a = act(gate) * up (down's input) is rebuilt once by a fused kernel for down's weight gradient and
freed; one fused pass then turns dL/da into dgate (in place, in dL/da's buffer) and dup.
`gated_mlp_forward` / `gated_mlp_backward` carry the computation so selective_ckpt/norm_fusion.py
(which keeps the norm input instead of x) reuses them; `gated_product` is the bare product as an
autograd building block that keeps gate and up only.
"""

import torch
import torch.nn.functional as F

from .. import backend, rng
from ..double_backward import first_order_only
from ..keeping import pipeline
from ..validation import check_choice, check_floating, check_linear, check_operands
from .dropout import dropout_op
from .eager import fast_eager

__all__ = ["gated_mlp_forward", "gated_mlp_backward", "gated_product", "swiglu_mlp", "check_gated_mlp_args"]

ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # kernel activation -> the kernels' code


def activation_code(activation) -> int:
    """0 for "silu" (SwiGLU), 1 for "gelu_tanh" (GeGLU), 2 for "gelu" (exact GeGLU); anything else is refused."""
    return check_choice(activation, "activation", ACTIVATION_CODES)


def _check_pair(gate, up):
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate {list(gate.shape)} {gate.dtype} {gate.device} and up {list(up.shape)} {up.dtype} "
                         f"{up.device} must match")


def _gated_product(gate, up, activation):
    code = activation_code(activation)
    _check_pair(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    a = torch.empty_like(gate)
    if gate.numel():
        backend.call("gated_mlp", "forward", gate, up, a, gate.numel(), code)
    return a


@torch.library.custom_op("selective_ckpt::gated_product", mutates_args=())
def gated_product_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """a = act(gate) * up."""
    return _gated_product(gate, up, activation)


# Backward's rebuild of a, under a name of its own for the reason of ops/gelu_mlp.py's gelu_rebuild_op
# (torch.compile would merge it with forward's product and keep a).
@torch.library.custom_op("selective_ckpt::gated_product_rebuild", mutates_args=())
def gated_product_rebuild_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return _gated_product(gate, up, activation)


@gated_product_op.register_fake
def _(gate, up, activation):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@gated_product_rebuild_op.register_fake
def _(gate, up, activation):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("selective_ckpt::gated_product_backward_", mutates_args=("grad",))
def gated_product_backward_op(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
                              ) -> torch.Tensor:
    """grad := grad * up * act'(gate) in place (dgate, in the buffer of dL/da); returns dup = grad * act(gate)."""
    code = activation_code(activation)
    _check_pair(gate, up)
    _check_pair(grad, gate)
    gate, up = gate.contiguous(), up.contiguous()
    dup = torch.empty_like(gate)
    if grad.numel() == 0:
        return dup
    work = grad if grad.is_contiguous() else grad.contiguous()
    backend.call("gated_mlp", "backward", work, gate, up, work, dup, gate.numel(), code)
    if work is not grad:
        grad.copy_(work)
    return dup


@gated_product_backward_op.register_fake
def _(grad, gate, up, activation):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


for _op in (gated_product_op, gated_product_rebuild_op, gated_product_backward_op):
    fast_eager(_op)


def _tag_kept(gate, up, product=None):
    """The classes of what the gated MLP keeps (keeping.policy): matmul outputs, and the product when stored."""
    pipeline.tag(gate, "mlp")
    pipeline.tag(up, "mlp")
    if product is not None:
        pipeline.tag(product, "norm_act")


class _GatedProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.activation = activation
        _tag_kept(gate, up)
        ctx.save_for_backward(gate, up)
        return gated_product_op(gate, up, activation)

    @staticmethod
    @first_order_only("selective_ckpt.ops.gated_mlp.gated_product")
    def backward(ctx, da):
        gate, up = ctx.saved_tensors
        dgate = da.clone(memory_format=torch.contiguous_format)  # autograd's da is not ours to overwrite
        dup = gated_product_backward_op(dgate, gate, up, ctx.activation)
        return dgate, dup, None


def gated_product(gate, up, activation="silu"):
    """act(gate) * up with one fused kernel each way; autograd keeps gate and up only.

    gate, up: tensors of one shape, dtype and device; activation "silu", "gelu_tanh" or "gelu".
    """
    check_floating(gate, "gate")
    check_floating(up, "up")
    activation_code(activation)
    _check_pair(gate, up)
    return _GatedProduct.apply(gate, up, activation)


def check_gated_mlp_args(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    """Validates the operands of swiglu_mlp (nn.Linear layout); returns (in, ffn, out)."""
    named = [("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down), ("b_gate", b_gate), ("b_up", b_up),
             ("b_down", b_down)]
    check_operands(x, [(n, t) for n, t in named if t is not None])
    if x.dim() < 1:
        raise ValueError("x must have shape [..., in], got a 0-dim tensor")
    n_in = x.shape[-1]
    ffn = check_linear(w_gate, b_gate, ("w_gate", "b_gate"), ("ffn", "in"), n_in, "x.shape[-1]")
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up must have w_gate's shape {list(w_gate.shape)}, got {list(w_up.shape)}")
    check_linear(w_up, b_up, ("w_up", "b_up"), ("ffn", "in"), n_in, "x.shape[-1]")
    out = check_linear(w_down, b_down, ("w_down", "b_down"), ("out", "ffn"), ffn, "w_gate.shape[0]")
    return n_in, ffn, out


def gated_mlp_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, dropout_p, activation, seed, store_product):
    """Forward without autograd; returns (y, gate, up, a_or_None).

    Operands as in swiglu_mlp (assumed valid); seed the seed tensor, ignored when dropout_p == 0.
    gate and up ([..., ffn]) are to be saved; the product a is returned only when store_product
    (else it is freed here and gated_mlp_backward rebuilds it with the same kernel: same bits).
    Dropout follows the contract's elementwise stream over y viewed as [rows, out].
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    gate = F.linear(x2, w_gate, b_gate)
    up = F.linear(x2, w_up, b_up)
    a = gated_product_op(gate, up, activation)
    y = F.linear(a, w_down, b_down)
    if dropout_p:
        y = dropout_op(y, float(dropout_p), seed)
    ffn, out = w_gate.shape[0], w_down.shape[0]
    kept = a.reshape(*lead, ffn) if store_product else None
    return y.reshape(*lead, out), gate.reshape(*lead, ffn), up.reshape(*lead, ffn), kept


def gated_mlp_backward(dy, x, gate, up, a_or_None, w_gate, b_gate, w_up, b_up, w_down, b_down, dropout_p,
                       activation, seed, needs_input_grad, dx_dtype=None):
    """Gradients (dx, dw_gate, db_gate, dw_up, db_up, dw_down, db_down) from what gated_mlp_forward left.

    needs_input_grad: seven bools in that order; a gradient not needed (or of a None bias) is None. `dx_dtype`:
    dx in that dtype, the up and gate projections' parts each cast to it and summed there (what autograd does with
    two Linears reading one input of that dtype under autocast); None: summed in x's dtype by one addmm.
    Order keeps peak memory under eager's: the dropout mask is regenerated into dz, the product is
    rebuilt only for dw_down and freed, then dL/da = dz @ w_down becomes dgate in place while the
    same pass writes dup, whose gradients are taken and which is freed before dgate's.
    """
    nx, nwg, nbg, nwu, nbu, nwd, nbd = needs_input_grad
    ffn, out = w_gate.shape[0], w_down.shape[0]
    dz = dy.reshape(-1, out)
    dz = dropout_op(dz, float(dropout_p), seed) if dropout_p else dz.contiguous()
    g2, u2 = gate.reshape(-1, ffn), up.reshape(-1, ffn)

    db_down = dz.sum(0) if nbd and b_down is not None else None
    dw_down = None
    if nwd:
        a = a_or_None.reshape(-1, ffn) if a_or_None is not None else gated_product_rebuild_op(g2, u2, activation)
        dw_down = dz.t() @ a
        del a

    dx = dwg = dbg = dwu = dbu = None
    if nx or nwg or nwu or (nbg and b_gate is not None) or (nbu and b_up is not None):
        dgate = dz @ w_down
        del dz
        dup = gated_product_backward_op(dgate, g2, u2, activation)
        x2 = x.reshape(-1, x.shape[-1])
        # dup's contributions first, then it is freed before dgate's weight gradient is allocated.
        dbu = dup.sum(0) if nbu and b_up is not None else None
        dwu = dup.t() @ x2 if nwu else None
        dx_up = dup @ w_up if nx else None
        del dup
        dbg = dgate.sum(0) if nbg and b_gate is not None else None
        dwg = dgate.t() @ x2 if nwg else None
        if nx and dx_dtype is not None:
            dx = dx_up.to(dx_dtype).add_((dgate @ w_gate).to(dx_dtype)).reshape(x.shape)
        elif nx:
            dx = torch.addmm(dx_up, dgate, w_gate).reshape(x.shape)
    return dx, dwg, dbg, dwu, dbu, dw_down, db_down


class _GatedMLP(torch.autograd.Function):
    """Saves x, gate, up (and the product in store mode), the weights and the seed."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down, dropout_p, activation, seed, store_product):
        y, gate, up, a = gated_mlp_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, dropout_p, activation,
                                           seed, store_product)
        _tag_kept(gate, up, a)
        ctx.save_for_backward(x, gate, up, a, w_gate, b_gate, w_up, b_up, w_down, b_down,
                              seed if dropout_p else None)
        ctx.dropout_p, ctx.activation = dropout_p, activation
        return y

    @staticmethod
    @first_order_only("selective_ckpt.swiglu_mlp")
    def backward(ctx, dy):
        x, gate, up, a, w_gate, b_gate, w_up, b_up, w_down, b_down, seed = ctx.saved_tensors
        n = ctx.needs_input_grad
        dx, dwg, dbg, dwu, dbu, dwd, dbd = gated_mlp_backward(
            dy, x, gate, up, a, w_gate, b_gate, w_up, b_up, w_down, b_down, ctx.dropout_p, ctx.activation, seed,
            (n[0], n[1], n[4], n[2], n[5], n[3], n[6]))
        return dx, dwg, dwu, dwd, dbg, dbu, dbd, None, None, None, None


def swiglu_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, dropout_p=0.0, activation="silu",
               seed=None, *, store_product=False):
    """y = dropout(down(act(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up))), rebuilding the product in backward.

    x [..., in]; w_gate, w_up [ffn, in], w_down [out, ffn] (nn.Linear layout); biases optional.
    activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU, tanh or exact). Dropout (p = dropout_p)
    uses the contract's elementwise mask over y viewed as [rows, out]; `seed=None` draws one from
    torch's generator for x's device. Autograd keeps x, the gate and up outputs and the seed; store_product=True (for
    comparisons) also keeps the product act(gate) * up; results are bit-identical either way.
    """
    check_gated_mlp_args(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    activation_code(activation)
    rng.threshold(dropout_p, "dropout_p")
    if not isinstance(store_product, bool):
        raise TypeError(f"store_product must be a bool, got {type(store_product).__name__}")
    dropout_p = float(dropout_p)
    seed = rng.site_seed(dropout_p, seed, x.device)
    return _GatedMLP.apply(x, w_gate, w_up, w_down, b_gate, b_up, b_down, dropout_p, activation, seed, store_product)
