"""Elementwise dropout by the contract's elementwise stream: saves only its seed.

The mask of x viewed as [rows, cols] (cols = the last dim) is a function of (seed, row, col), so
backward regenerates it instead of keeping it (docs/kernels/dropout.md).
"""

import torch

from .. import backend, rng
from ..validation import check_floating
from .eager import fast_eager


def rows_cols(t: torch.Tensor):
    """A tensor viewed as [rows, cols] with cols its last dim (the elementwise dropout stream)."""
    cols = t.shape[-1] if t.dim() else 1
    return (t.numel() // cols if cols else 0), cols


@torch.library.custom_op("selective_ckpt::dropout", mutates_args=())
def dropout_op(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        rows, cols = rows_cols(x)
        t16, scale = rng.kernel_constants(p)
        backend.call("dropout", "forward", x, y, rows, cols, seed, t16, scale)
    return y


@dropout_op.register_fake
def _(x, p, seed):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    _, ctx.p, seed = inputs
    ctx.save_for_backward(seed)


def _backward(ctx, grad):
    (seed,) = ctx.saved_tensors
    return dropout_op(grad.contiguous(), ctx.p, seed), None, None


dropout_op.register_autograd(_backward, setup_context=_setup_context)
fast_eager(dropout_op)


def dropout(x: torch.Tensor, p: float, seed=None) -> torch.Tensor:
    """Elementwise dropout with the contract's mask over x viewed as [rows, last dim].

    Kept values are scaled by rng.keep_scale(p). Dropped values are multiplied by 0, as F.dropout
    does, so a NaN or inf input stays NaN there (a NaN is never hidden by the mask); the same holds
    for gradients. Autograd saves only the seed; `seed=None` draws one from torch's generator for
    x's device.
    """
    check_floating(x, "x")
    rng.threshold(p)
    if p == 0:
        return x
    return dropout_op(x, float(p), rng.seed_arg(seed, x.device))
