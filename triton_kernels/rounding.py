"""Element conversions shared by the kernels.

Compute happens in float32 (float64 stays float64). Stores round to nearest even like torch. The
Triton interpreter truncates float32 -> bfloat16 instead of rounding, so under it the rounding
is done here by integer arithmetic; compiled kernels use the hardware conversion.
"""

import os

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def to_compute(v):
    """v in its compute type: float64 unchanged, every other float type widened to float32."""
    if v.dtype == tl.float64:
        return v
    else:
        return v.to(tl.float32)


@triton.jit
def to_storage(v, dtype: tl.constexpr):
    """v (float32 or float64) rounded to nearest even into dtype."""
    if INTERPRETED and dtype == tl.bfloat16:
        u = v.to(tl.float32).to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)  # keep NaN a NaN
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)
