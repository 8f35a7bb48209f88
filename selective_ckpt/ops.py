"""torch.library custom ops: one schema each; CPU tensors run the C++ kernels (_C), CUDA tensors
the Triton kernels. `backend_for` is the one place that decides, so nothing above this module
knows which backend runs.

Seeds cross op schemas as seed tensors (int32 [2], see rng.seed_arg).
"""

import os
from typing import Optional

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
def dropout_op(x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    rows, cols = rows_cols(x)
    if x.numel() == 0:
        return y
    t16, scale, seed = rng.threshold(p), rng.keep_scale(p), rng.seed_from_tensor(seed)
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
    _, ctx.p, seed = inputs
    ctx.save_for_backward(seed)


def _dropout_backward(ctx, grad):
    (seed,) = ctx.saved_tensors
    return dropout_op(grad.contiguous(), ctx.p, seed), None, None


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
    return dropout_op(x, float(p), rng.seed_arg(seed, x.device))


# ---- layernorm ----
# LayerNorm over the last dim. Forward returns (y, mean, rstd) with statistics in float32 (float64
# for float64 inputs); `layer_norm_apply` rebuilds y from (x, mean, rstd) bit-identically, which is
# what lets the fused LN->Linear and LN->MLP pieces drop the LayerNorm output after forward.

def ln_stat_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _ln_rows(x):
    n = x.shape[-1]
    return (x.numel() // n if n else 0), n


@torch.library.custom_op("selective_ckpt::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, weight = x.contiguous(), weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    rows, n = _ln_rows(x)
    y = torch.empty_like(x)
    mean = torch.empty(x.shape[:-1], dtype=ln_stat_dtype(x.dtype), device=x.device)
    rstd = torch.empty_like(mean)
    if rows == 0:
        return y, mean, rstd
    if backend_for(x) == "cpp":
        _C.layer_norm_forward(dtype_code(x), ptr(x), ptr(weight), ptr(bias) if bias is not None else 0, ptr(y),
                              ptr(mean), ptr(rstd), rows, n, eps)
    else:
        from .triton_kernels import layernorm as tk

        tk.forward(x, weight, bias, y, mean, rstd, rows, n, eps)
    return y, mean, rstd


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=ln_stat_dtype(x.dtype))
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@torch.library.custom_op("selective_ckpt::layer_norm_apply", mutates_args=())
def layer_norm_apply(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], mean: torch.Tensor,
                     rstd: torch.Tensor) -> torch.Tensor:
    x, weight = x.contiguous(), weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    mean, rstd = mean.contiguous(), rstd.contiguous()
    rows, n = _ln_rows(x)
    y = torch.empty_like(x)
    if rows == 0:
        return y
    if backend_for(x) == "cpp":
        _C.layer_norm_apply(dtype_code(x), ptr(x), ptr(weight), ptr(bias) if bias is not None else 0, ptr(y),
                            ptr(mean), ptr(rstd), rows, n)
    else:
        from .triton_kernels import layernorm as tk

        tk.apply(x, weight, bias, y, mean, rstd, rows, n)
    return y


@layer_norm_apply.register_fake
def _(x, weight, bias, mean, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("selective_ckpt::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) of y = LayerNorm(x) * weight + bias."""
    dy, x, weight = dy.contiguous(), x.contiguous(), weight.contiguous()
    mean, rstd = mean.contiguous(), rstd.contiguous()
    rows, n = _ln_rows(x)
    dx = torch.empty_like(x)
    if rows == 0:
        return dx, torch.zeros_like(weight), torch.zeros_like(weight)
    if backend_for(x) == "cpp":
        dw, db = torch.empty_like(weight), torch.empty_like(weight)
        _C.layer_norm_backward(dtype_code(x), ptr(dy), ptr(x), ptr(mean), ptr(rstd), ptr(weight), ptr(dx), ptr(dw),
                               ptr(db), rows, n)
    else:
        from .triton_kernels import layernorm as tk

        progs = -(-rows // tk.ROWS_PER_PROG)
        pw = torch.empty(progs, n, dtype=ln_stat_dtype(x.dtype), device=x.device)
        pb = torch.empty_like(pw)
        tk.backward(dy, x, mean, rstd, weight, dx, pw, pb, rows, n)
        dw, db = pw.sum(0).to(weight.dtype), pb.sum(0).to(weight.dtype)
    return dx, dw, db


@layer_norm_bwd.register_fake
def _(dy, x, mean, rstd, weight):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight),
            torch.empty_like(weight))


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, mean, rstd)


def _layer_norm_backward(ctx, gy, gmean, grstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd(gy.contiguous(), x, mean, rstd, weight)
    return dx, dw, (db if ctx.has_bias else None), None


layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


# ---- attention ----
# Fused attention-softmax-dropout. The forward op returns o, a [B, H, Sq, D] view of a contiguous
# [B, Sq, H, D] buffer, and the row logsumexp (fp32 [B, H, Sq], +inf where a row attends nothing).
# Autograd saves q, k, v as given, o, lse and the seed; P is rebuilt from lse in backward.


def _attention_out(q):
    B, H, Sq, D = q.shape
    return torch.empty(B, Sq, H, D, dtype=q.dtype, device=q.device).permute(0, 2, 1, 3)


def _attention_cpp_args(q, k, mask, causal, scale, seed, t16, ks):
    """The C++ kernels' problem arguments: sizes, padding mask, no documents, no window, the seed."""
    B, H, Sq, D = q.shape
    seed_t = rng.seed_arg(seed) if t16 > 0 else None
    return ((B, H, k.shape[1], Sq, k.shape[2], D), 0 if mask is None else ptr(mask), 0, 0, causal, 0, scale,
            0 if seed_t is None else ptr(seed_t), t16, ks), seed_t


def _attention_fwd_cpp(q, k, v, o, lse, mask, causal, scale, seed, t16, ks):
    (sizes, *rest), _seed_t = _attention_cpp_args(q, k, mask, causal, scale, seed, t16, ks)
    _C.attention_forward(dtype_code(q), sizes, ptr(q), q.stride()[:3], ptr(k), k.stride()[:3], ptr(v),
                         v.stride()[:3], ptr(o), o.stride()[:3], ptr(lse), *rest)


def _attention_bwd_cpp(do, q, k, v, o, lse, dq, dk, dv, mask, causal, scale, seed, t16, ks):
    (sizes, *rest), _seed_t = _attention_cpp_args(q, k, mask, causal, scale, seed, t16, ks)
    _C.attention_backward(dtype_code(q), sizes, ptr(do), ptr(q), q.stride()[:3], ptr(k), k.stride()[:3], ptr(v),
                          v.stride()[:3], ptr(o), o.stride()[:3], ptr(lse), *rest, ptr(dq), ptr(dk), ptr(dv))


@torch.library.custom_op("selective_ckpt::attention_fwd", mutates_args=())
def attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                     causal: bool, dropout_p: float, softmax_scale: float, seed: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, Sq, _ = q.shape
    o = _attention_out(q)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    t16, ks = rng.threshold(dropout_p), rng.keep_scale(dropout_p)
    seed = rng.seed_from_tensor(seed) if dropout_p > 0 else 0
    if backend_for(q) == "cpp":
        _attention_fwd_cpp(q, k, v, o, lse, mask, causal, softmax_scale, seed, t16, ks)
    else:
        from .triton_kernels import attention as tk

        tk.forward(q, k, v, o, lse, mask, causal, softmax_scale, seed, t16, ks)
    return o, lse


@attention_fwd_op.register_fake
def _(q, k, v, key_padding_mask, causal, dropout_p, softmax_scale, seed):
    B, H, Sq, _ = q.shape
    return _attention_out(q), q.new_empty(B, H, Sq, dtype=torch.float32)


@torch.library.custom_op("selective_ckpt::attention_bwd", mutates_args=())
def attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     lse: torch.Tensor, key_padding_mask: Optional[torch.Tensor], causal: bool, dropout_p: float,
                     softmax_scale: float, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    do = do.contiguous()  # a grad from .sum().backward() has stride 0
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    t16, ks = rng.threshold(dropout_p), rng.keep_scale(dropout_p)
    seed = rng.seed_from_tensor(seed) if dropout_p > 0 else 0
    if backend_for(q) == "cpp":  # the kernel takes delta = rowsum(dO * O) itself
        _attention_bwd_cpp(do, q, k, v, o, lse.contiguous(), dq, dk, dv, mask, causal, softmax_scale, seed, t16, ks)
    else:
        from .triton_kernels import attention as tk

        # delta_i = sum_j P_ij dP_ij = rowsum(dO * O), in fp32 (it includes the dropout).
        delta = (do.float() * o.float()).sum(-1)
        tk.backward(do, q, k, v, lse, delta, dq, dk, dv, mask, causal, softmax_scale, seed, t16, ks)
    return dq, dk, dv


@attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, key_padding_mask, causal, dropout_p, softmax_scale, seed):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _attention_setup(ctx, inputs, output):
    q, k, v, mask, ctx.causal, ctx.dropout_p, ctx.softmax_scale, seed = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, mask, seed if ctx.dropout_p > 0 else None)


def _attention_backward(ctx, do, _dlse):
    q, k, v, o, lse, mask, seed = ctx.saved_tensors
    seed = rng.unused_seed() if seed is None else seed
    dq, dk, dv = attention_bwd_op(do, q, k, v, o, lse, mask, ctx.causal, ctx.dropout_p, ctx.softmax_scale, seed)
    return dq, dk, dv, None, None, None, None, None


attention_fwd_op.register_autograd(_attention_backward, setup_context=_attention_setup)


# ---- gelu mlp ----
# The MLP's elementwise passes (selective_ckpt/mlp.py): a = gelu(h) and, in backward, g *= gelu'(h)
# in place. The matmuls (with their biases) stay in torch.

GELU_APPROXIMATIONS = {"none": 0, "tanh": 1}


def gelu_approximation_code(approximate) -> int:
    """0 for "none" (erf GELU), 1 for "tanh" (GPT-2's gelu_new); anything else is refused."""
    if not isinstance(approximate, str):
        raise TypeError(f"approximate must be a str, 'none' or 'tanh', got {type(approximate).__name__}")
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return GELU_APPROXIMATIONS[approximate]


@torch.library.custom_op("selective_ckpt::mlp_gelu", mutates_args=())
def mlp_gelu_op(h: torch.Tensor, approximate: str) -> torch.Tensor:
    code = gelu_approximation_code(approximate)
    h = h.contiguous()
    a = torch.empty_like(h)
    if h.numel() == 0:
        return a
    if backend_for(h) == "cpp":
        _C.mlp_gelu(dtype_code(h), ptr(h), ptr(a), h.numel(), code)
    else:
        from .triton_kernels import mlp as tk

        tk.gelu(h, a, h.numel(), code)
    return a


@mlp_gelu_op.register_fake
def _(h, approximate):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


@torch.library.custom_op("selective_ckpt::mlp_gelu_backward_", mutates_args=("grad",))
def mlp_gelu_backward_op(grad: torch.Tensor, h: torch.Tensor, approximate: str) -> None:
    """grad *= gelu'(h), in place (grad is the buffer of dy @ w2, so dh costs no new memory)."""
    code = gelu_approximation_code(approximate)
    if grad.shape != h.shape or grad.dtype != h.dtype or grad.device != h.device:
        raise ValueError(f"grad {list(grad.shape)} {grad.dtype} {grad.device} must match h "
                         f"{list(h.shape)} {h.dtype} {h.device}")
    if grad.numel() == 0:
        return
    h = h.contiguous()
    work = grad if grad.is_contiguous() else grad.contiguous()
    if backend_for(h) == "cpp":
        _C.mlp_gelu_backward(dtype_code(h), ptr(work), ptr(h), h.numel(), code)
    else:
        from .triton_kernels import mlp as tk

        tk.gelu_backward_(work, h, h.numel(), code)
    if work is not grad:
        grad.copy_(work)


@mlp_gelu_backward_op.register_fake
def _(grad, h, approximate):
    return None
