"""The one Triton implementation of Philox4x32-10 and of the dropout-mask contract (docs/DESIGN.md).

Every GPU kernel that drops out calls `attention_keep_tile` or `elementwise_keep`; nothing else in
triton_kernels computes Philox. The high word of each 32x32 product comes from a widening
64-bit multiply, which the interpreter evaluates vectorised and the GPU compiles to mul.wide.
"""

import torch
import triton
import triton.language as tl

from .rounding import INTERPRETED


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
def load_key(SEED):
    """The Philox key (k0, k1) from an int32[2] seed tensor (low word, high word) on the device."""
    return tl.load(SEED).to(tl.uint32, bitcast=True), tl.load(SEED + 1).to(tl.uint32, bitcast=True)


@triton.jit
def _flags(w, t16):
    """Keep flags (int32: as int8 the joins cost byte packing) of a Philox word's low and high 16-bit halves,
    joined on a new last axis."""
    return tl.join((w & 0xFFFF) >= t16, (w >> 16) >= t16).to(tl.int32)


@triton.jit
def attention_keep_tile(k0, k1, row0, col0, batch_head, t16, BM: tl.constexpr, BN: tl.constexpr,
                        TRANS: tl.constexpr):
    """Keep flags of P[b, h, row0 + i, col0 + j] for a [BM, BN] tile ([BN, BM] when TRANS).

    col0 is a multiple of 8, so the tile's columns are BN / 8 whole Philox groups: Philox runs once
    per group on a [BM, BN / 8] tile, and its eight 16-bit values are spread over the group's
    columns by joins (t = 4 * half + word, DESIGN.md) and a reshape.
    """
    G: tl.constexpr = BN // 8
    groups = (col0 >> 3) + tl.arange(0, G)
    rows = row0 + tl.arange(0, BM)
    if TRANS:
        c0 = groups[:, None] + rows[None, :] * 0
        c1 = rows[None, :] + groups[:, None] * 0
    else:
        c0 = groups[None, :] + rows[:, None] * 0
        c1 = rows[:, None] + groups[None, :] * 0
    c0 = c0.to(tl.uint32)
    zero = c0 * 0
    w0, w1, w2, w3 = philox4x32_10(c0, c1.to(tl.uint32), zero + batch_head.to(tl.uint32), zero, k0, k1)
    t = t16.to(tl.uint32)
    # [..., half, word >> 1, word & 1]: flattened, the last three axes are t = 4 * half + word.
    f = tl.join(tl.join(_flags(w0, t), _flags(w2, t)), tl.join(_flags(w1, t), _flags(w3, t)))
    if TRANS:
        f = tl.reshape(f, [G, BM, 8])
        f = tl.reshape(tl.permute(f, 0, 2, 1), [BN, BM])
    else:
        f = tl.reshape(f, [BM, BN])
    return f != 0


@triton.jit
def key_order(start, BN: tl.constexpr):
    """Key index of each column of a dropout tile (attention_dropout) starting at key `start`, a multiple of 8.

    Column (t >> 1) * (BN / 4) + 2 * g + (t & 1) holds key start + 8 * g + t. In the MMA accumulator
    layout (column bits 1 and 2 across a quad of lanes, the others in registers) every thread then
    holds whole Philox groups: each Philox call is made once, by the thread that uses its values.
    """
    G: tl.constexpr = BN // 8
    c = tl.arange(0, BN)
    return start + 8 * ((c >> 1) % G) + (c & 1) + 2 * (c // (2 * G))


@triton.jit
def attention_dropout(x, k0, k1, row0, col0, batch_head, t16, BM: tl.constexpr, BN: tl.constexpr):
    """x (fp32 [BM, BN]: rows row0 + i, keys key_order(col0, BN)) with the entries that the contract
    drops from P[b, h] (batch_head = b * H + h) set to 0.

    Philox runs on a [BM, BN / 8] tile; its eight 16-bit values per group are spread along a third
    axis of 8 that the layout keeps in registers, so the word and half each t takes are
    compile-time choices and the reshape to key_order needs no data movement.
    """
    G: tl.constexpr = BN // 8
    groups = (col0 >> 3) + tl.arange(0, G)
    rows = row0 + tl.arange(0, BM)
    c0 = (groups[None, :] + rows[:, None] * 0).to(tl.uint32)
    c1 = (rows[:, None] + groups[None, :] * 0).to(tl.uint32)
    zero = c0 * 0
    w0, w1, w2, w3 = philox4x32_10(c0, c1, zero + batch_head.to(tl.uint32), zero, k0, k1)
    t = tl.arange(0, 8)[None, None, :]
    q = t & 3
    w = tl.where(q == 0, w0[:, :, None],
                 tl.where(q == 1, w1[:, :, None], tl.where(q == 2, w2[:, :, None], w3[:, :, None])))
    # u[t] >= t16 compared in the high 16 bits: the high halves (t >= 4) need no shift
    u = tl.where(t < 4, w << 16, w)
    u = tl.reshape(tl.permute(tl.reshape(u, [BM, G, 4, 2]), 0, 2, 1, 3), [BM, BN])
    thr = t16.to(tl.uint32) << 16
    if INTERPRETED:
        return tl.where(u >= thr, x, 0.0)
    else:
        # fp32 select as inline asm: LLVM would move a plain select past the bf16 conversion of the
        # result and pay byte shuffles for it
        return tl.inline_asm_elementwise("{ .reg .pred k; setp.hs.u32 k, $1, $2; selp.f32 $0, $3, 0f00000000, k; }",
                                         "=r,r,r,r", [u, thr + u * 0, x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def elementwise_keep(k0, k1, rows, cols, t16):
    """Keep flags of x[rows, cols] viewed 2-D: counter (j >> 3, row lo, row hi, 1); rows int64."""
    rows = rows.to(tl.int64)
    return _keep(k0, k1, cols + rows * 0, (rows & 0xFFFFFFFF) + cols * 0, (rows >> 32) + cols * 0, 1, t16)


@triton.jit
def _philox_words_kernel(counters, out, n, SEED, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = idx < n
    c0 = tl.load(counters + idx * 4 + 0, mask=live, other=0).to(tl.uint32)
    c1 = tl.load(counters + idx * 4 + 1, mask=live, other=0).to(tl.uint32)
    c2 = tl.load(counters + idx * 4 + 2, mask=live, other=0).to(tl.uint32)
    c3 = tl.load(counters + idx * 4 + 3, mask=live, other=0).to(tl.uint32)
    k0, k1 = load_key(SEED)
    w0, w1, w2, w3 = philox4x32_10(c0, c1, c2, c3, k0, k1)
    tl.store(out + idx * 4 + 0, w0.to(tl.int64), mask=live)
    tl.store(out + idx * 4 + 1, w1.to(tl.int64), mask=live)
    tl.store(out + idx * 4 + 2, w2.to(tl.int64), mask=live)
    tl.store(out + idx * 4 + 3, w3.to(tl.int64), mask=live)


@triton.jit(do_not_specialize=["t16"])
def _attention_mask_kernel(out, H, Sq, Sk, SEED, t16, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           TRANS: tl.constexpr, KEY_ORDER: tl.constexpr):
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k0, k1 = load_key(SEED)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if KEY_ORDER:  # attention_dropout of ones, its columns in key_order
        ones = tl.full([BLOCK_M, BLOCK_N], 1.0, tl.float32)
        keep = attention_dropout(ones, k0, k1, pid_m * BLOCK_M, pid_n * BLOCK_N, bh, t16, BLOCK_M, BLOCK_N) != 0.0
        cols = key_order(pid_n * BLOCK_N, BLOCK_N)
    else:
        keep = attention_keep_tile(k0, k1, pid_m * BLOCK_M, pid_n * BLOCK_N, bh, t16, BLOCK_M, BLOCK_N, TRANS)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if TRANS:  # keep is [BLOCK_N, BLOCK_M]: key down, query across
        rows, cols = rows[None, :], cols[:, None]
    else:
        rows, cols = rows[:, None], cols[None, :]
    offs = bh.to(tl.int64) * Sq * Sk + rows * Sk + cols
    tl.store(out + offs, keep.to(tl.int8), mask=(rows < Sq) & (cols < Sk))


@triton.jit(do_not_specialize=["t16"])
def _elementwise_mask_kernel(out, rows_total, cols_total, SEED, t16, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    k0, k1 = load_key(SEED)
    keep = elementwise_keep(k0, k1, rows, cols, t16)
    tl.store(out + rows * cols_total + cols, keep.to(tl.int8), mask=(rows < rows_total) & (cols < cols_total))


# Host-side entry points, used by the tests to check the device helpers against the contract.

def seed_tensor(seed, device):
    """An int seed in [0, 2**64) as the kernels' int32[2] (low word, high word); a tensor passes through."""
    if isinstance(seed, torch.Tensor):
        return seed
    words = [(seed >> s) & 0xFFFFFFFF for s in (0, 32)]
    return torch.tensor([w - (1 << 32) if w >> 31 else w for w in words], dtype=torch.int32, device=device)


def philox_words(seed, counters, out):
    n = counters.shape[0]
    block = 64
    _philox_words_kernel[(triton.cdiv(n, block),)](counters, out, n, seed_tensor(seed, counters.device), BLOCK=block)
    return out


def attention_mask(seed, t16, out, block_m=16, block_n=16, trans=False, key_order=False):
    """Keep mask [B, H, Sq, Sk] (int8) through the attention kernels' tile helpers; block_n a multiple of 8.
    key_order: through attention_dropout (key-permuted tiles) instead of attention_keep_tile."""
    B, H, Sq, Sk = out.shape
    grid = (triton.cdiv(Sq, block_m), triton.cdiv(Sk, block_n), B * H)
    _attention_mask_kernel[grid](out, H, Sq, Sk, seed_tensor(seed, out.device), t16, BLOCK_M=block_m,
                                 BLOCK_N=block_n, TRANS=trans and not key_order, KEY_ORDER=key_order)
    return out


def elementwise_mask(seed, t16, out, block_m=16, block_n=16):
    rows, cols = out.shape
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    _elementwise_mask_kernel[grid](out, rows, cols, seed_tensor(seed, out.device), t16, BLOCK_M=block_m,
                                   BLOCK_N=block_n)
    return out
