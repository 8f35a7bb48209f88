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
def _gate(x, sign):
    """sigmoid(sign * 2u) with u = sqrt(2/pi) (x + 0.044715 x^3): (1 + tanh(u)) / 2 for sign = 1 and
    its complement 1 - that for sign = -1, each without cancellation. Clamped so exp cannot overflow."""
    v = (x + x * x * x * TANH_CUBIC) * SQRT_2_OVER_PI * (2.0 * sign)
    return tl.sigmoid(tl.minimum(tl.maximum(v, -80.0), 80.0))


@triton.jit
def gelu_value(x, TANH: tl.constexpr):
    if TANH:
        return x * _gate(x, 1.0)
    else:
        return x * 0.5 * (1.0 + tl.erf(x * INV_SQRT_2))


@triton.jit
def gelu_grad(x, TANH: tl.constexpr):
    if TANH:
        # d/dx x s(x), s = sigmoid(2u): s + x * 2 s (1 - s) u'
        s = _gate(x, 1.0)
        du = (x * x * (3.0 * TANH_CUBIC) + 1.0) * SQRT_2_OVER_PI
        return s + x * 2.0 * s * _gate(x, -1.0) * du
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
