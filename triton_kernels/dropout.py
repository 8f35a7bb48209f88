"""Elementwise dropout over a contiguous tensor viewed as [rows, cols], by the contract's stream."""

import triton
import triton.language as tl

from .philox import elementwise_keep, key_words
from .rounding import to_compute, to_storage


@triton.jit(do_not_specialize=["k0", "k1", "t16"])
def _dropout_kernel(x, y, cols, k0, k1, t16, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < cols
    v = to_compute(tl.load(x + row * cols + offs, mask=live, other=0.0))
    keep = elementwise_keep(k0, k1, row, offs, t16)
    # a product with 0, not a select, as F.dropout: NaN and inf stay non-finite where dropped
    tl.store(y + row * cols + offs, to_storage(tl.where(keep, v * scale, v * 0.0), y.dtype.element_ty), mask=live)


def forward(x, y, rows, cols, seed, t16, scale):
    """y = x * (keep ? scale : 0); x, y contiguous of rows*cols elements (y may be x); seed a seed tensor."""
    block = min(1024, triton.next_power_of_2(max(cols, 16)))
    k0, k1 = key_words(seed)
    _dropout_kernel[(rows, triton.cdiv(cols, block))](x, y, cols, k0, k1, t16, scale, BLOCK=block)
    return y
