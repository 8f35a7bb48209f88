"""Gated-MLP kernels: the product a = act(gate) * up (forward, and backward's rebuild for down's
weight gradient) and the fused backward dgate = g * up * act'(gate), dup = g * act(gate), where
dgate may be g's own buffer (written in place). act is SiLU (SwiGLU, 0) or tanh-GELU (GeGLU, 1),
the latter shared with the GELU-MLP (triton_kernels/gelu_mlp.py).
"""

import triton
import triton.language as tl

from .gelu_mlp import gelu_grad, gelu_value
from .rounding import to_compute, to_storage

# exp(-x) overflows float32 below x = -88.7228, where eager's sigmoid (and so SiLU and its
# gradient) is exactly 0: the argument is clamped first so nothing overflows, and those lanes are 0.


@triton.jit
def _sigmoid(x):
    s = tl.sigmoid(tl.maximum(x, -88.0))
    return tl.where(x < -88.72283935546875, 0.0, s)


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:
        return x * _sigmoid(x)
    else:
        return gelu_value(x, ACT == 1)


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    if ACT == 0:
        s = _sigmoid(x)
        return s * (x * (1.0 - s) + 1.0)
    else:
        return gelu_grad(x, ACT == 1)


@triton.jit
def _product_kernel(g_ptr, u_ptr, a_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    g = to_compute(tl.load(g_ptr + offs, mask=live, other=0.0))
    u = to_compute(tl.load(u_ptr + offs, mask=live, other=0.0))
    tl.store(a_ptr + offs, to_storage(_act(g, ACT) * u, a_ptr.dtype.element_ty), mask=live)


@triton.jit
def _backward_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    d = to_compute(tl.load(dy_ptr + offs, mask=live, other=0.0))
    g = to_compute(tl.load(g_ptr + offs, mask=live, other=0.0))
    u = to_compute(tl.load(u_ptr + offs, mask=live, other=0.0))
    tl.store(du_ptr + offs, to_storage(d * _act(g, ACT), du_ptr.dtype.element_ty), mask=live)
    tl.store(dg_ptr + offs, to_storage(d * u * _act_grad(g, ACT), dg_ptr.dtype.element_ty), mask=live)


def _block(n):
    return min(4096, triton.next_power_of_2(max(n, 16)))


def forward(gate, up, a, n, act):
    """a = act(gate) * up over n contiguous elements; act 0 = SiLU, 1 = tanh-GELU, 2 = erf GELU."""
    block = _block(n)
    _product_kernel[(triton.cdiv(n, block),)](gate, up, a, n, ACT=act, BLOCK=block)
    return a


def backward(dy, gate, up, dgate, dup, n, act):
    """dgate = dy * up * act'(gate), dup = dy * act(gate); dgate may be dy itself."""
    block = _block(n)
    _backward_kernel[(triton.cdiv(n, block),)](dy, gate, up, dgate, dup, n, ACT=act, BLOCK=block)
