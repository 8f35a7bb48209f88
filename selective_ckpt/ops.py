"""torch.library custom ops: one schema each; CPU tensors run the C++ kernels (_C), CUDA tensors
the Triton kernels. `backend_for` is the one place that decides, so nothing above this module
knows which backend runs.

Seeds cross op schemas as signed int64 (two's complement of the 64-bit seed, see rng).
"""

import os

import torch

from . import rng
from ._extension import load as _load_extension

_C = _load_extension()

BACKEND_ENV = "SELECTIVE_CKPT_BACKEND"
_BACKENDS = ("auto", "cpp", "triton")

# Element type codes shared with csrc/dtypes.h.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def backend_for(t: torch.Tensor) -> str:
    """'cpp' or 'triton' for tensor t: CUDA -> Triton, CPU -> C++ unless SELECTIVE_CKPT_BACKEND=triton."""
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {', '.join(_BACKENDS)}, got {choice!r}")
    if t.device.type == "cuda":
        if choice == "cpp":
            raise ValueError(f"{BACKEND_ENV}=cpp cannot run CUDA tensors; unset it or use 'triton'")
        return "triton"
    if t.device.type != "cpu":
        raise ValueError(f"selective_ckpt runs on CPU and CUDA tensors, got device {t.device}")
    return "triton" if choice == "triton" else "cpp"


def dtype_code(t: torch.Tensor) -> int:
    return DTYPE_CODES[t.dtype]


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def rows_cols(t: torch.Tensor):
    """A tensor viewed as [rows, cols] with cols its last dim (the elementwise dropout stream)."""
    cols = t.shape[-1] if t.dim() else 1
    return (t.numel() // cols if cols else 0), cols


# ---------------------------------------------------------------------------------------------
# Elementwise dropout: saves only its seed; backward regenerates the same mask.

@torch.library.custom_op("selective_ckpt::dropout", mutates_args=())
def dropout_op(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    rows, cols = rows_cols(x)
    if x.numel() == 0:
        return y
    t16, scale, seed = rng.threshold(p), rng.keep_scale(p), rng.int64_to_seed(seed)
    if backend_for(x) == "cpp":
        _C.dropout(dtype_code(x), ptr(x), ptr(y), rows, cols, seed, t16, scale)
    else:
        from .triton_kernels import dropout as tk

        tk.dropout(x, y, rows, cols, seed, t16, scale)
    return y


@dropout_op.register_fake
def _(x, p, seed):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _dropout_setup(ctx, inputs, output):
    _, ctx.p, ctx.seed = inputs


def _dropout_backward(ctx, grad):
    return dropout_op(grad.contiguous(), ctx.p, ctx.seed), None, None


dropout_op.register_autograd(_dropout_backward, setup_context=_dropout_setup)


def check_floating(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_CODES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")


def dropout(x: torch.Tensor, p: float, seed=None) -> torch.Tensor:
    """Elementwise dropout with the contract's mask over x viewed as [rows, last dim].

    Kept values are scaled by rng.keep_scale(p). Autograd saves only the seed; `seed=None` draws
    one from torch's generator for x's device.
    """
    check_floating(x, "x")
    rng.threshold(p)
    if p == 0:
        return x
    seed = rng.resolve_seed(seed, x.device)
    return dropout_op(x, float(p), rng.seed_to_int64(seed))
