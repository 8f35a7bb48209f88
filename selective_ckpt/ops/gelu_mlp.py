"""GELU and the GELU-MLP with selective recomputation: y = dropout(gelu(x @ w1^T + b1) @ w2^T + b2).

The kernels are the elementwise passes: a = gelu(h) (forward, and the backward's recompute) and
g *= gelu'(h) in place. The matmuls stay in torch (MKL / cuBLAS) with the biases inside them
(addmm): adding a bias after the matmul's result has been rounded to bf16/fp16 rounds h twice,
which measured up to 5x eager's own error against float64 on small inner sizes.

Backward keeps x and the fc1 output h = x @ w1^T + b1 (the GELU input) and the dropout seed. The
GELU output is recomputed from h for fc2's weight gradient and the dropout mask is regenerated
from the seed, so neither is stored. `gelu_mlp_forward` and `gelu_mlp_backward` carry the computation so
other autograd code (selective_ckpt/norm_fusion.py, which saves the norm input instead of x) reuses them.
"""

import torch
import torch.nn.functional as F

from .. import backend, rng
from ..double_backward import first_order_only
from ..keeping import pipeline
from ..validation import check_choice, check_linear, check_operands
from .dropout import dropout_op
from .eager import fast_eager

__all__ = ["gelu_mlp", "gelu_mlp_forward", "gelu_mlp_backward", "check_gelu_mlp_args"]

GELU_APPROXIMATIONS = {"none": 0, "tanh": 1}


def gelu_approximation_code(approximate) -> int:
    """0 for "none" (erf GELU), 1 for "tanh" (GPT-2's gelu_new); anything else is refused."""
    return check_choice(approximate, "approximate", GELU_APPROXIMATIONS)


def _gelu(h, approximate):
    code = gelu_approximation_code(approximate)
    h = h.contiguous()
    a = torch.empty_like(h)
    if h.numel():
        backend.call("gelu_mlp", "forward", h, a, h.numel(), code)
    return a


@torch.library.custom_op("selective_ckpt::gelu", mutates_args=())
def gelu_op(h: torch.Tensor, approximate: str) -> torch.Tensor:
    return _gelu(h, approximate)


# Backward rebuilds the activation through an op of its own name: under torch.compile a second
# gelu_op(h) would be merged (CSE) with forward's, and the partitioner, which never recomputes a
# custom op, would then keep the activation for backward instead of h alone.
@torch.library.custom_op("selective_ckpt::gelu_rebuild", mutates_args=())
def gelu_rebuild_op(h: torch.Tensor, approximate: str) -> torch.Tensor:
    return _gelu(h, approximate)


@gelu_op.register_fake
def _(h, approximate):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


@gelu_rebuild_op.register_fake
def _(h, approximate):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


@torch.library.custom_op("selective_ckpt::gelu_backward_", mutates_args=("grad",))
def gelu_backward_op(grad: torch.Tensor, h: torch.Tensor, approximate: str) -> None:
    """grad *= gelu'(h), in place (grad is the buffer of dy @ w2, so dh costs no new memory)."""
    code = gelu_approximation_code(approximate)
    if grad.shape != h.shape or grad.dtype != h.dtype or grad.device != h.device:
        raise ValueError(f"grad {list(grad.shape)} {grad.dtype} {grad.device} must match h "
                         f"{list(h.shape)} {h.dtype} {h.device}")
    if grad.numel() == 0:
        return
    h = h.contiguous()
    work = grad if grad.is_contiguous() else grad.contiguous()
    backend.call("gelu_mlp", "backward_", work, h, h.numel(), code)
    if work is not grad:
        grad.copy_(work)


@gelu_backward_op.register_fake
def _(grad, h, approximate):
    return None


for _op in (gelu_op, gelu_rebuild_op, gelu_backward_op):
    fast_eager(_op)


def check_gelu_mlp_args(x, w1, b1, w2, b2):
    """Validates the operands of gelu_mlp (nn.Linear layout); returns (in, hidden, out)."""
    check_operands(x, [(n, t) for n, t in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2)) if t is not None])
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape [..., in] with in >= 1, got {list(x.shape)}")
    hidden = check_linear(w1, b1, ("w1", "b1"), ("hidden", "in"), x.shape[-1], "x.shape[-1]")
    out = check_linear(w2, b2, ("w2", "b2"), ("out", "hidden"), hidden, "w1.shape[0]")
    return x.shape[-1], hidden, out


def gelu_mlp_forward(x, w1, b1, w2, b2, dropout_p, approximate, seed, store_activation):
    """Forward of the GELU-MLP without autograd; returns (y, h, a_or_None).

    x [..., in]; w1 [hidden, in]; b1 [hidden] or None; w2 [out, hidden]; b2 [out] or None.
    dropout_p: float in [0, 1); approximate: "none" | "tanh"; seed: the seed tensor (rng.seed_arg)
    on x's device, ignored when dropout_p == 0. Operands are assumed valid (see check_gelu_mlp_args).

    Returns y [..., out], h = x @ w1^T + b1 [..., hidden] (the GELU input, to be saved), and the
    GELU output a [..., hidden] only when store_activation is True (else None: a is freed here
    and gelu_mlp_backward recomputes it from h with the same kernel, so both modes agree bit for bit).
    Dropout follows the contract's elementwise stream over y viewed as [rows, out].
    """
    lead = x.shape[:-1]
    h = F.linear(x.reshape(-1, x.shape[-1]), w1, b1)
    a = gelu_op(h, approximate)
    y = F.linear(a, w2, b2)
    if dropout_p:
        y = dropout_op(y, float(dropout_p), seed)
    hidden, out = w1.shape[0], w2.shape[0]
    kept = a.reshape(*lead, hidden) if store_activation else None
    return y.reshape(*lead, out), h.reshape(*lead, hidden), kept


def gelu_mlp_backward(dy, x, h, a_or_None, w1, b1, w2, b2, dropout_p, approximate, seed, needs_input_grad):
    """Backward of the GELU-MLP from what gelu_mlp_forward left; returns (dx, dw1, db1, dw2, db2).

    dy [..., out] (any strides, stride 0 included); x, h as given to / returned by gelu_mlp_forward;
    a_or_None the stored GELU output or None to recompute it; the other arguments as in
    gelu_mlp_forward. needs_input_grad: five bools for (x, w1, b1, w2, b2); a gradient not needed (or
    of a None bias) is returned as None and not computed.

    Order keeps peak memory at or below eager's: the dropout mask is regenerated into dz, a is
    recomputed only for dw2 = dz^T a and freed, then dh = (dz @ w2) * gelu'(h) is formed in
    place in the buffer of dz @ w2.
    """
    nx, nw1, nb1, nw2, nb2 = needs_input_grad
    hidden, out = w1.shape[0], w2.shape[0]
    dz = dy.reshape(-1, out)
    if dropout_p:
        dz = dropout_op(dz, float(dropout_p), seed)
    else:
        dz = dz.contiguous()
    h2 = h.reshape(-1, hidden)

    db2 = dz.sum(0) if nb2 and b2 is not None else None
    dw2 = None
    if nw2:
        act = a_or_None.reshape(-1, hidden) if a_or_None is not None else gelu_rebuild_op(h2, approximate)
        dw2 = dz.t() @ act
        del act

    dx = dw1 = db1 = None
    if nx or nw1 or (nb1 and b1 is not None):
        dh = dz @ w2
        del dz
        gelu_backward_op(dh, h2, approximate)
        if nb1 and b1 is not None:
            db1 = dh.sum(0)
        if nw1:
            dw1 = dh.t() @ x.reshape(-1, x.shape[-1])
        if nx:
            dx = (dh @ w1).reshape(x.shape)
    return dx, dw1, db1, dw2, db2


class _GeluMLP(torch.autograd.Function):
    """Saves x, h (and a in store mode), the weights and the seed; see gelu_mlp_forward/gelu_mlp_backward."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, dropout_p, approximate, seed, store_activation):
        y, h, a = gelu_mlp_forward(x, w1, b1, w2, b2, dropout_p, approximate, seed, store_activation)
        pipeline.tag(h, "mlp")
        if a is not None:
            pipeline.tag(a, "norm_act")
        ctx.save_for_backward(x, h, a, w1, b1, w2, b2, seed if dropout_p else None)
        ctx.dropout_p, ctx.approximate = dropout_p, approximate
        return y

    @staticmethod
    @first_order_only("selective_ckpt.gelu_mlp")
    def backward(ctx, dy):
        x, h, a, w1, b1, w2, b2, seed = ctx.saved_tensors
        grads = gelu_mlp_backward(dy, x, h, a, w1, b1, w2, b2, ctx.dropout_p, ctx.approximate, seed,
                             ctx.needs_input_grad[:5])
        return (*grads, None, None, None, None)


def gelu_mlp(x, w1, b1, w2, b2, dropout_p=0.0, approximate="none", seed=None, *, store_activation=False):
    """y = dropout(gelu(x @ w1^T + b1) @ w2^T + b2), recomputing GELU and the mask in backward.

    x [..., in] with any leading dims; w1 [hidden, in], w2 [out, hidden] (nn.Linear layout);
    b1, b2 optional (None). approximate: "none" (erf GELU) or "tanh" (GPT-2's gelu_new).
    Dropout (p = dropout_p) uses the contract's elementwise mask over y viewed as [rows, out];
    `seed=None` draws one from torch's generator for x's device. Autograd saves x, the fc1
    output h and the seed. store_activation=True (for comparisons) also saves the GELU output
    instead of recomputing it; outputs and gradients are bit-identical either way.
    """
    check_gelu_mlp_args(x, w1, b1, w2, b2)
    gelu_approximation_code(approximate)
    rng.threshold(dropout_p, "dropout_p")
    if not isinstance(store_activation, bool):
        raise TypeError(f"store_activation must be a bool, got {type(store_activation).__name__}")
    dropout_p = float(dropout_p)
    seed = rng.site_seed(dropout_p, seed, x.device)
    return _GeluMLP.apply(x, w1, b1, w2, b2, dropout_p, approximate, seed, store_activation)
