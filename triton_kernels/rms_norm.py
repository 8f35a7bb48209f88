"""RMSNorm over the last dim of a contiguous [rows, n] tensor, one row per program.

Forward writes the output and the per-row rstd (float32, float64 for float64 inputs); `apply`
rebuilds the output from saved (x, rstd) through the same `_apply_row`, so a stored and a rebuilt
output agree bit for bit. Rounding order (docs/kernels/rms_norm.md): offset 0 (Llama) rounds
x * rstd to the input dtype and then multiplies by w; otherwise (Gemma) x * rstd * (offset + w) is
rounded once. Backward writes dx and per-program partial sums of dw that the host adds up in order.
"""

import torch
import triton
import triton.language as tl

from .rounding import to_compute, to_storage


@triton.jit
def _apply_row(x_ptr, w_ptr, y_ptr, row, n, rstd, offset, LLAMA: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    live = offs < n
    x = to_compute(tl.load(x_ptr + row * n + offs, mask=live, other=0.0))
    w = to_compute(tl.load(w_ptr + offs, mask=live, other=0.0))
    if LLAMA:
        xn = to_compute(to_storage(x * rstd, y_ptr.dtype.element_ty))
        v = w * xn
    else:
        v = x * rstd * (w + offset)
    tl.store(y_ptr + row * n + offs, to_storage(v, y_ptr.dtype.element_ty), mask=live)


@triton.jit
def _forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n, eps, offset, LLAMA: tl.constexpr, WRITE_Y: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    live = offs < n
    x = to_compute(tl.load(x_ptr + row * n + offs, mask=live, other=0.0))
    ms = tl.sum(x * x, axis=0) / n
    if ms.dtype == tl.float64:
        rstd = 1.0 / tl.sqrt(ms + eps)
    else:
        rstd = 1.0 / tl.sqrt_rn(ms + eps)  # IEEE-rounded: plain sqrt is approximate on GPU
    rstd = rstd.to(rstd_ptr.dtype.element_ty)
    tl.store(rstd_ptr + row, rstd)
    if WRITE_Y:
        _apply_row(x_ptr, w_ptr, y_ptr, row, n, rstd, offset, LLAMA, BLOCK)


@triton.jit
def _apply_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n, offset, LLAMA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _apply_row(x_ptr, w_ptr, y_ptr, row, n, tl.load(rstd_ptr + row), offset, LLAMA, BLOCK)


@triton.jit
def _backward_kernel(dy_ptr, x_ptr, rstd_ptr, w_ptr, dx_ptr, pw_ptr, rows, n, offset, ROWS_PER_PROG: tl.constexpr,
                     WRITE_DX: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    live = offs < n
    s = to_compute(tl.load(w_ptr + offs, mask=live, other=0.0)) + offset
    acc_w = tl.zeros([BLOCK], dtype=pw_ptr.dtype.element_ty)
    for i in range(ROWS_PER_PROG):
        row = pid * ROWS_PER_PROG + i
        if row < rows:
            x = to_compute(tl.load(x_ptr + row * n + offs, mask=live, other=0.0))
            g = to_compute(tl.load(dy_ptr + row * n + offs, mask=live, other=0.0))
            rstd = tl.load(rstd_ptr + row)
            xhat = x * rstd
            acc_w += g * xhat
            if WRITE_DX:
                gs = g * s
                c = tl.sum(gs * xhat, axis=0) / n
                dx = rstd * (gs - xhat * c)
                tl.store(dx_ptr + row * n + offs, to_storage(dx, dx_ptr.dtype.element_ty), mask=live)
    tl.store(pw_ptr + pid * n + offs, acc_w, mask=live)


def _block(n):
    return triton.next_power_of_2(max(n, 16))


def _warps(n):
    """One row per program: enough warps that a thread holds at most ~8 elements of the row."""
    return min(16, max(1, _block(n) // 256))


def forward(x, w, y, rstd, rows, n, eps, offset):
    """Writes rstd [rows] and, when y is not None, y = RMSNorm(x)."""
    _forward_kernel[(rows,)](x, w, y if y is not None else x, rstd, n, eps, offset, LLAMA=offset == 0.0,
                             WRITE_Y=y is not None, BLOCK=_block(n), num_warps=_warps(n))


def apply(x, w, y, rstd, rows, n, offset):
    """y = RMSNorm(x) from the saved rstd."""
    _apply_kernel[(rows,)](x, w, y, rstd, n, offset, LLAMA=offset == 0.0, BLOCK=_block(n), num_warps=_warps(n))


ROWS_PER_PROG = 16


def backward(dy, x, rstd, w, dx, dw, rows, n, offset):
    """Writes dx (if not None) and dw: each program sums ROWS_PER_PROG rows into a partial row (fp32,
    float64 for float64), and the partials are summed in a fixed order, so runs repeat bit for bit."""
    progs = triton.cdiv(rows, ROWS_PER_PROG)
    pw = torch.empty(progs, n, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=x.device)
    _backward_kernel[(progs,)](dy, x, rstd, w, dx if dx is not None else x, pw, rows, n, offset,
                               ROWS_PER_PROG=ROWS_PER_PROG, WRITE_DX=dx is not None, BLOCK=_block(n),
                               num_warps=_warps(n))
    dw.copy_(pw.sum(0))
