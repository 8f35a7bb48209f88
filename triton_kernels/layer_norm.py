"""LayerNorm over the last dim of a contiguous [rows, n] tensor, one row per program.

Forward writes the output and per-row mean/rstd (float32, float64 for float64 inputs); `apply`
recomputes the output from saved (x, mean, rstd) through the same `_apply_row` as forward, so a
stored and a recomputed output agree bit for bit. Backward writes dx and per-program partial sums
of dw/db that the host adds up in a fixed order.
"""

import torch
import triton
import triton.language as tl

from .rounding import to_compute, to_storage


@triton.jit
def _apply_row(x_ptr, w_ptr, b_ptr, y_ptr, row, n, mean, rstd, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    live = offs < n
    x = to_compute(tl.load(x_ptr + row * n + offs, mask=live, other=0.0))
    w = to_compute(tl.load(w_ptr + offs, mask=live, other=0.0))
    v = (x - mean) * rstd * w
    if HAS_BIAS:
        v = v + to_compute(tl.load(b_ptr + offs, mask=live, other=0.0))
    tl.store(y_ptr + row * n + offs, to_storage(v, y_ptr.dtype.element_ty), mask=live)


@triton.jit
def _forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n, eps, HAS_BIAS: tl.constexpr,
                    WRITE_Y: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    live = offs < n
    x = to_compute(tl.load(x_ptr + row * n + offs, mask=live, other=0.0))
    mean = tl.sum(x, axis=0) / n
    d = tl.where(live, x - mean, 0.0)
    var = tl.sum(d * d, axis=0) / n
    if var.dtype == tl.float64:
        rstd = 1.0 / tl.sqrt(var + eps)
    else:
        rstd = 1.0 / tl.sqrt_rn(var + eps)  # IEEE-rounded: plain sqrt is approximate on GPU
    mean = mean.to(mean_ptr.dtype.element_ty)
    rstd = rstd.to(rstd_ptr.dtype.element_ty)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    if WRITE_Y:
        _apply_row(x_ptr, w_ptr, b_ptr, y_ptr, row, n, mean, rstd, HAS_BIAS, BLOCK)


@triton.jit
def _apply_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _apply_row(x_ptr, w_ptr, b_ptr, y_ptr, row, n, tl.load(mean_ptr + row), tl.load(rstd_ptr + row), HAS_BIAS,
               BLOCK)


@triton.jit
def _backward_kernel(dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, dx_ptr, pw_ptr, pb_ptr, rows, n,
                     ROWS_PER_PROG: tl.constexpr, WRITE_DX: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    live = offs < n
    w = to_compute(tl.load(w_ptr + offs, mask=live, other=0.0))
    acc_w = tl.zeros([BLOCK], dtype=pw_ptr.dtype.element_ty)
    acc_b = tl.zeros([BLOCK], dtype=pw_ptr.dtype.element_ty)
    for i in range(ROWS_PER_PROG):
        row = pid * ROWS_PER_PROG + i
        if row < rows:
            x = to_compute(tl.load(x_ptr + row * n + offs, mask=live, other=0.0))
            g = to_compute(tl.load(dy_ptr + row * n + offs, mask=live, other=0.0))
            mean = tl.load(mean_ptr + row)
            rstd = tl.load(rstd_ptr + row)
            xhat = tl.where(live, (x - mean) * rstd, 0.0)
            acc_w += g * xhat
            acc_b += g
            if WRITE_DX:
                gw = g * w
                a = tl.sum(gw, axis=0) / n
                c = tl.sum(gw * xhat, axis=0) / n
                dx = rstd * (gw - a - xhat * c)
                tl.store(dx_ptr + row * n + offs, to_storage(dx, dx_ptr.dtype.element_ty), mask=live)
    tl.store(pw_ptr + pid * n + offs, acc_w, mask=live)
    tl.store(pb_ptr + pid * n + offs, acc_b, mask=live)


def _block(n):
    return triton.next_power_of_2(max(n, 16))


def _warps(n):
    """One row per program: enough warps that a thread holds at most ~8 elements of the row."""
    return min(16, max(1, _block(n) // 256))


def forward(x, w, b, y, mean, rstd, rows, n, eps):
    """Writes mean, rstd [rows] and, when y is not None, y = LayerNorm(x)."""
    _forward_kernel[(rows,)](x, w, b if b is not None else w, y if y is not None else x, mean, rstd, n, eps,
                             HAS_BIAS=b is not None, WRITE_Y=y is not None, BLOCK=_block(n), num_warps=_warps(n))


def apply(x, w, b, y, mean, rstd, rows, n):
    """y = (x - mean) * rstd * w (+ b) from saved statistics."""
    _apply_kernel[(rows,)](x, w, b if b is not None else w, y, mean, rstd, n, HAS_BIAS=b is not None,
                           BLOCK=_block(n), num_warps=_warps(n))


ROWS_PER_PROG = 16


def backward(dy, x, mean, rstd, w, dx, dw, db, rows, n):
    """Writes dx (if not None), dw and db: each program sums ROWS_PER_PROG rows into a partial row
    (fp32, float64 for float64), and the partials are summed in a fixed order, so runs repeat bit for bit."""
    progs = triton.cdiv(rows, ROWS_PER_PROG)
    pw = torch.empty(progs, n, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=x.device)
    pb = torch.empty_like(pw)
    _backward_kernel[(progs,)](dy, x, mean, rstd, w, dx if dx is not None else x, pw, pb, rows, n,
                               ROWS_PER_PROG=ROWS_PER_PROG, WRITE_DX=dx is not None, BLOCK=_block(n),
                               num_warps=_warps(n))
    dw.copy_(pw.sum(0))
    db.copy_(pb.sum(0))
