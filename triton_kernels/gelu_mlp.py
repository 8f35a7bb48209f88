"""GELU kernels of the GELU-MLP: a = gelu(h) (forward, and the backward's recompute) and the
in-place g *= gelu'(h). Both GELU forms; the tanh form uses 0.5 (1 + tanh(u)) = sigmoid(2u), so
no libdevice tanh is needed, and the erf is tl.erf: both run under the interpreter.
"""

import triton
import triton.language as tl

from .rounding import to_compute, to_storage

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
TANH_CUBIC = tl.constexpr(0.044715)


# Tensors stay on the left of the constexpr constants: the interpreter mishandles constexpr * tensor.
@triton.jit
def _gate(x):
    """(s, s (1 - s)) with s = sigmoid(v), v = 2u, u = sqrt(2/pi) (x + 0.044715 x^3): s = (1 + tanh(u)) / 2.

    Both come from e = exp(-|v|), so neither cancels, and once the gate saturates e underflows to 0
    and s is exactly 0 or 1, s (1 - s) exactly 0: no clamp lets a tiny s meet the derivative's cubic
    term (a clamp at |v| = 80 gave gelu'(-1e15) = -3.9e9 instead of 0)."""
    v = (x + x * x * x * TANH_CUBIC) * (2.0 * SQRT_2_OVER_PI)
    e = tl.exp(-tl.abs(v))
    r = 1.0 / (1.0 + e)
    return tl.where(v < 0.0, e * r, r), e * r * r


@triton.jit
def gelu_value(x, TANH: tl.constexpr):
    if TANH:
        s, _ = _gate(x)
        return x * s
    else:
        return x * 0.5 * (1.0 + tl.erf(x * INV_SQRT_2))


@triton.jit
def gelu_grad(x, TANH: tl.constexpr):
    if TANH:
        # d/dx x s(x), s = sigmoid(2u): s + x * 2 s (1 - s) u'. u' is only needed where the gate is not
        # saturated (|x| < 20), so x is clamped there to keep x^2 finite; x multiplies last, so
        # x = +-inf gives NaN as eager does and a finite x in a saturated tail gives exactly s.
        s, s_1ms = _gate(x)
        xc = tl.minimum(tl.maximum(x, -20.0), 20.0)
        du = (xc * xc * (3.0 * TANH_CUBIC) + 1.0) * SQRT_2_OVER_PI
        return s + x * (s_1ms * du * 2.0)
    else:
        cdf = (1.0 + tl.erf(x * INV_SQRT_2)) * 0.5
        return cdf + x * tl.exp(x * x * -0.5) * INV_SQRT_2PI


@triton.jit
def _gelu_kernel(h, a, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    x = to_compute(tl.load(h + offs, mask=live, other=0.0))
    tl.store(a + offs, to_storage(gelu_value(x, TANH), a.dtype.element_ty), mask=live)


@triton.jit
def _gelu_backward_kernel(g, h, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    x = to_compute(tl.load(h + offs, mask=live, other=0.0))
    dy = to_compute(tl.load(g + offs, mask=live, other=0.0))
    tl.store(g + offs, to_storage(dy * gelu_grad(x, TANH), g.dtype.element_ty), mask=live)


def _block(n):
    return min(4096, triton.next_power_of_2(max(n, 16)))


def forward(h, a, n, approximate):
    """a = gelu(h) over n contiguous elements; approximate 0 = erf, 1 = tanh."""
    block = _block(n)
    _gelu_kernel[(triton.cdiv(n, block),)](h, a, n, TANH=approximate == 1, BLOCK=block)
    return a


def backward_(g, h, n, approximate):
    """g *= gelu'(h) in place over n contiguous elements."""
    block = _block(n)
    _gelu_backward_kernel[(triton.cdiv(n, block),)](g, h, n, TANH=approximate == 1, BLOCK=block)
    return g
