"""The one Triton implementation of Philox4x32-10 and of the dropout-mask contract (docs/DESIGN.md).

Every GPU kernel that drops out calls `attention_keep` or `elementwise_keep`; nothing else in
triton_kernels computes Philox. The high word of each 32x32 product comes from a widening
64-bit multiply, which the interpreter evaluates vectorised and the GPU compiles to mul.wide.
"""

import triton
import triton.language as tl


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten Philox rounds on uint32 counters with uint32 key (k0, k1); returns four uint32 words."""
    for _ in tl.static_range(10):
        p0 = c0.to(tl.uint64) * 0xD2511F53
        p1 = c2.to(tl.uint64) * 0xCD9E8D57
        n0 = (p1 >> 32).to(tl.uint32) ^ c1 ^ k0
        n2 = (p0 >> 32).to(tl.uint32) ^ c3 ^ k1
        c0 = n0
        c1 = p1.to(tl.uint32)
        c2 = n2
        c3 = p0.to(tl.uint32)
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _keep(k0, k1, cols, c1, c2, c3: tl.constexpr, t16):
    """Keep flag of column `cols` with counter (cols >> 3, c1, c2, c3): u[cols & 7] >= t16."""
    zero = tl.zeros_like(cols).to(tl.uint32)
    c0 = (cols >> 3).to(tl.uint32)
    w0, w1, w2, w3 = philox4x32_10(c0, c1.to(tl.uint32) + zero, c2.to(tl.uint32) + zero, zero + c3,
                                   k0.to(tl.uint32), k1.to(tl.uint32))
    t = (cols & 7).to(tl.uint32)
    q = t & 3
    w = tl.where(q == 0, w0, tl.where(q == 1, w1, tl.where(q == 2, w2, w3)))
    u = (w >> ((t >> 2) * 16)) & 0xFFFF
    return u >= t16.to(tl.uint32)


@triton.jit
def attention_keep(k0, k1, rows, cols, batch_head, t16):
    """Keep flags of P[b, h, rows, cols] (broadcastable int tensors): counter (j >> 3, i, b*H + h, 0)."""
    return _keep(k0, k1, cols + rows * 0, rows + cols * 0, batch_head, 0, t16)


@triton.jit
def elementwise_keep(k0, k1, rows, cols, t16):
    """Keep flags of x[rows, cols] viewed 2-D: counter (j >> 3, row lo, row hi, 1); rows int64."""
    rows = rows.to(tl.int64)
    return _keep(k0, k1, cols + rows * 0, (rows & 0xFFFFFFFF) + cols * 0, (rows >> 32) + cols * 0, 1, t16)


@triton.jit(do_not_specialize=["k0", "k1"])
def _philox_words_kernel(counters, out, n, k0, k1, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = idx < n
    c0 = tl.load(counters + idx * 4 + 0, mask=live, other=0).to(tl.uint32)
    c1 = tl.load(counters + idx * 4 + 1, mask=live, other=0).to(tl.uint32)
    c2 = tl.load(counters + idx * 4 + 2, mask=live, other=0).to(tl.uint32)
    c3 = tl.load(counters + idx * 4 + 3, mask=live, other=0).to(tl.uint32)
    w0, w1, w2, w3 = philox4x32_10(c0, c1, c2, c3, k0.to(tl.uint32), k1.to(tl.uint32))
    tl.store(out + idx * 4 + 0, w0.to(tl.int64), mask=live)
    tl.store(out + idx * 4 + 1, w1.to(tl.int64), mask=live)
    tl.store(out + idx * 4 + 2, w2.to(tl.int64), mask=live)
    tl.store(out + idx * 4 + 3, w3.to(tl.int64), mask=live)


@triton.jit(do_not_specialize=["k0", "k1", "t16"])
def _attention_mask_kernel(out, H, Sq, Sk, k0, k1, t16, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    keep = attention_keep(k0, k1, rows, cols, bh, t16)
    offs = bh.to(tl.int64) * Sq * Sk + rows * Sk + cols
    tl.store(out + offs, keep.to(tl.int8), mask=(rows < Sq) & (cols < Sk))


@triton.jit(do_not_specialize=["k0", "k1", "t16"])
def _elementwise_mask_kernel(out, rows_total, cols_total, k0, k1, t16, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    keep = elementwise_keep(k0, k1, rows, cols, t16)
    tl.store(out + rows * cols_total + cols, keep.to(tl.int8), mask=(rows < rows_total) & (cols < cols_total))


def key_words(seed):
    """(k0, k1) of a seed tensor (int32 [2]: the seed's low and high words) as Python ints."""
    lo, hi = seed.tolist()
    return lo & 0xFFFFFFFF, hi & 0xFFFFFFFF


# Host-side entry points, used by the tests to check the device helpers against the contract.

def philox_words(seed, counters, out):
    n = counters.shape[0]
    block = 64
    _philox_words_kernel[(triton.cdiv(n, block),)](counters, out, n, seed & 0xFFFFFFFF, seed >> 32, BLOCK=block)
    return out


def attention_mask(seed, t16, out, block_m=16, block_n=16):
    B, H, Sq, Sk = out.shape
    grid = (triton.cdiv(Sq, block_m), triton.cdiv(Sk, block_n), B * H)
    _attention_mask_kernel[grid](out, H, Sq, Sk, seed & 0xFFFFFFFF, seed >> 32, t16, BLOCK_M=block_m, BLOCK_N=block_n)
    return out


def elementwise_mask(seed, t16, out, block_m=16, block_n=16):
    rows, cols = out.shape
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    _elementwise_mask_kernel[grid](out, rows, cols, seed & 0xFFFFFFFF, seed >> 32, t16, BLOCK_M=block_m,
                                   BLOCK_N=block_n)
    return out
