"""LayerNorm over the last dim with statistics kept for backward, never the output.

`layer_norm_fwd` returns (y, mean, rstd) with statistics in float32 (float64 for float64 inputs);
`layer_norm_apply` rebuilds y from (x, mean, rstd) bit-identically, which is what lets the fused
norm -> Linear and norm -> MLP pieces (selective_ckpt/norm_fusion.py) drop the output after forward.
"""

from typing import Optional

import torch

from .. import backend
from ..double_backward import first_order_only
from ..validation import check_norm_args
from .eager import fast_eager


def stat_dtype(dtype):
    """The dtype of the saved mean and rstd for inputs of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(x):
    n = x.shape[-1]
    return (x.numel() // n if n else 0), n


def _contiguous(*ts):
    return tuple(None if t is None else t.contiguous() for t in ts)


def _check_operands(x, weight, bias, mean=None, rstd=None):
    """The kernels read weight, bias and the statistics by x's row length and dtype: anything else
    would read past them, so every op checks before launching (callers inside the package included)."""
    n = x.shape[-1] if x.dim() else 0
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.shape != (n,) or t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"layer norm {name} must be [{n}] {x.dtype} on {x.device} like x's last dim, got "
                             f"{list(t.shape)} {t.dtype} on {t.device}")
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t is not None and (t.shape != x.shape[:-1] or t.dtype != stat_dtype(x.dtype)):
            raise ValueError(f"layer norm {name} must be {list(x.shape[:-1])} {stat_dtype(x.dtype)}, got "
                             f"{list(t.shape)} {t.dtype}")


@torch.library.custom_op("selective_ckpt::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_operands(x, weight, bias)
    x, weight, bias = _contiguous(x, weight, bias)
    rows, n = _rows(x)
    y = torch.empty_like(x)
    mean = torch.empty(x.shape[:-1], dtype=stat_dtype(x.dtype), device=x.device)
    rstd = torch.empty_like(mean)
    if rows:
        backend.call("layer_norm", "forward", x, weight, bias, y, mean, rstd, rows, n, eps)
    return y, mean, rstd


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=stat_dtype(x.dtype))
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@torch.library.custom_op("selective_ckpt::layer_norm_apply", mutates_args=())
def layer_norm_apply(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], mean: torch.Tensor,
                     rstd: torch.Tensor) -> torch.Tensor:
    _check_operands(x, weight, bias, mean, rstd)
    x, weight, bias, mean, rstd = _contiguous(x, weight, bias, mean, rstd)
    rows, n = _rows(x)
    y = torch.empty_like(x)
    if rows:
        backend.call("layer_norm", "apply", x, weight, bias, y, mean, rstd, rows, n)
    return y


@layer_norm_apply.register_fake
def _(x, weight, bias, mean, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("selective_ckpt::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) of y = LayerNorm(x) * weight + bias."""
    _check_operands(x, weight, None, mean, rstd)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"layer norm dy must match x {list(x.shape)} {x.dtype}, got {list(dy.shape)} {dy.dtype}")
    dy, x, weight, mean, rstd = _contiguous(dy, x, weight, mean, rstd)
    rows, n = _rows(x)
    dx = torch.empty_like(x)
    if not rows:
        return dx, torch.zeros_like(weight), torch.zeros_like(weight)
    dw, db = torch.empty_like(weight), torch.empty_like(weight)
    backend.call("layer_norm", "backward", dy, x, mean, rstd, weight, dx, dw, db, rows, n)
    return dx, dw, db


@layer_norm_bwd.register_fake
def _(dy, x, mean, rstd, weight):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
            torch.empty_like(weight))


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, mean, rstd)


@first_order_only("selective_ckpt.layer_norm")
def _backward(ctx, gy, gmean, grstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd(gy.contiguous(), x, mean, rstd, weight)
    return dx, dw, (db if ctx.has_bias else None), None


layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
for _op in (layer_norm_fwd, layer_norm_apply, layer_norm_bwd):
    fast_eager(_op)


def layer_norm(x, weight, bias=None, eps=1e-5):
    """LayerNorm over x's last dim with a fused kernel; weight/bias are cast to x's dtype.

    Autograd keeps x, mean and rstd (float32 per row; float64 for float64 x), not the output.
    """
    check_norm_args(x, weight, bias, eps)
    weight = weight.to(x.dtype)
    bias = bias.to(x.dtype) if bias is not None else None
    y, _, _ = layer_norm_fwd(x, weight, bias, float(eps))
    return y
