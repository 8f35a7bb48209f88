"""RMSNorm over the last dim with its rstd kept for backward, never the output.

`rms_norm_fwd` returns (y, rstd) with rstd in float32 (float64 for float64 inputs);
`rms_norm_apply` rebuilds y from (x, rstd) bit-identically, which is what lets the fused
norm -> Linear and norm -> gated MLP pieces (selective_ckpt/norm_fusion.py) drop the output after forward.

Rounding order follows the two Hugging Face forms (docs/kernels/rms_norm.md): offset 0 (Llama,
Mistral, Qwen) is `w * (x * rstd).to(dtype)`; offset 1 (Gemma) is `(x * rstd * (1 + w)).to(dtype)`.
"""

import torch

from .. import backend
from ..double_backward import first_order_only
from ..validation import check_norm_args
from .layer_norm import stat_dtype
from .eager import fast_eager


def _check_operands(x, weight, rstd=None, dy=None):
    """(rows, row length) of x. The kernels read weight and rstd by x's row length and dtype: anything else would
    read past them, so every op checks before launching (the fused pieces call the ops directly)."""
    n = x.shape[-1] if x.dim() else 0
    if weight.shape != (n,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"rms norm weight must be [{n}] {x.dtype} on {x.device} like x's last dim, got "
                         f"{list(weight.shape)} {weight.dtype} on {weight.device}")
    if rstd is not None and (rstd.shape != x.shape[:-1] or rstd.dtype != stat_dtype(x.dtype)):
        raise ValueError(f"rms norm rstd must be {list(x.shape[:-1])} {stat_dtype(x.dtype)}, got "
                         f"{list(rstd.shape)} {rstd.dtype}")
    if dy is not None and (dy.shape != x.shape or dy.dtype != x.dtype):
        raise ValueError(f"rms norm dy must match x {list(x.shape)} {x.dtype}, got {list(dy.shape)} {dy.dtype}")
    return (x.numel() // n if n else 0), n


@torch.library.custom_op("selective_ckpt::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = _check_operands(x, weight)
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=stat_dtype(x.dtype), device=x.device)
    if rows:
        backend.call("rms_norm", "forward", x, weight, y, rstd, rows, n, eps, offset)
    return y, rstd


@rms_norm_fwd.register_fake
def _(x, weight, eps, offset):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(x.shape[:-1], dtype=stat_dtype(x.dtype)))


@torch.library.custom_op("selective_ckpt::rms_norm_apply", mutates_args=())
def rms_norm_apply(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float) -> torch.Tensor:
    rows, n = _check_operands(x, weight, rstd)
    x, weight, rstd = x.contiguous(), weight.contiguous(), rstd.contiguous()
    y = torch.empty_like(x)
    if rows:
        backend.call("rms_norm", "apply", x, weight, y, rstd, rows, n, offset)
    return y


@rms_norm_apply.register_fake
def _(x, weight, rstd, offset):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("selective_ckpt::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, offset: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of y = RMSNorm(x) * (offset + weight)."""
    rows, n = _check_operands(x, weight, rstd, dy)
    dy, x, rstd, weight = dy.contiguous(), x.contiguous(), rstd.contiguous(), weight.contiguous()
    dx = torch.empty_like(x)
    if not rows:
        return dx, torch.zeros_like(weight)
    dw = torch.empty_like(weight)
    backend.call("rms_norm", "backward", dy, x, rstd, weight, dx, dw, rows, n, offset)
    return dx, dw


@rms_norm_bwd.register_fake
def _(dy, x, rstd, weight, offset):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, _, ctx.offset = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)


@first_order_only("selective_ckpt.rms_norm")
def _backward(ctx, gy, grstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd(gy.contiguous(), x, rstd, weight, ctx.offset)
    return dx, dw, None, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
for _op in (rms_norm_fwd, rms_norm_apply, rms_norm_bwd):
    fast_eager(_op)


def check_rms_norm_args(x, weight, eps, offset):
    check_norm_args(x, weight, None, eps)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise TypeError(f"offset must be a float (0.0 for Llama's w * x_hat, 1.0 for Gemma's (1 + w) * x_hat), "
                        f"got {type(offset).__name__}")


def rms_norm(x, weight, eps=1e-6, *, offset=0.0):
    """RMSNorm over x's last dim with a fused kernel: x * rsqrt(mean(x^2) + eps) scaled by (offset + weight).

    Statistics in float32 (float64 for float64 x); weight is cast to x's dtype. offset=0.0 is the
    Llama form (normalised row rounded to x's dtype, then times weight), offset=1.0 the Gemma form
    (times 1 + weight in float32, rounded once). Works over any last dim, e.g. a per-head norm over
    head_dim. Autograd keeps x and rstd (float32 per row), not the output.
    """
    check_rms_norm_args(x, weight, eps, offset)
    y, _ = rms_norm_fwd(x, weight.to(x.dtype), float(eps), float(offset))
    return y
