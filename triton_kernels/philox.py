"""The one Triton implementation of Philox4x32-10 and of the dropout-mask contract (docs/kernels/dropout.md).

Every GPU kernel that drops out calls `attention_keep_words`, `attention_keep_bits_t` or
`elementwise_keep`; nothing else in triton_kernels computes Philox. The high word of each 32x32
product comes from a widening 64-bit multiply, which the interpreter evaluates vectorised and the
GPU compiles to mul.wide.
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


# Key-permuted dropout tiles. The attention kernels load each key block in a permuted order chosen
# so that, in the MMA accumulator layout the scores have, each thread holds the Philox groups it
# needs: Philox then runs where its values are used and no keep flag changes layout. The
# accumulator layout of a [R, C] tile (per 16-row warp slice): row bits 0-2 across lanes (lane
# bits 2-4), row bit 3 in registers; column bit 0 in registers, column bits 1-2 across lanes
# (lane bits 0-1), the higher column bits in registers.

@triton.jit
def key_order(start, BN: tl.constexpr):
    """Keys of the columns of a [., BN] tile of attention_keep_words, from `start` (a multiple of 8).

    Column (t >> 1) * (BN / 4) + 2 * g + (t & 1) holds key start + 8 * g + t: the eight columns of
    a group are in one thread's registers (lanes own column bits 1-2, which are g's).
    """
    G: tl.constexpr = BN // 8
    c = tl.arange(0, BN)
    return start + 8 * ((c >> 1) % G) + (c & 1) + 2 * (c // (2 * G))


@triton.jit
def key_order_t(start, BN: tl.constexpr):
    """Keys of the rows of a [BN, .] tile of attention_keep_words_t (BN a multiple of 16).

    Row r holds key start + 8 * g + t with t = ((r >> 3) & 1) + 2 * (r & 3) and
    g = ((r >> 2) & 1) + 2 * (r >> 4). Rows have only bit 3 in registers, so the four lanes that
    share a query and a group (row bits 0-1) each make that Philox call; none is converted.
    """
    r = tl.arange(0, BN)
    return start + 8 * (((r >> 2) & 1) + 2 * (r >> 4)) + ((r >> 3) & 1) + 2 * (r & 3)


@triton.jit
def _spread(w0, w1, w2, w3):
    """[A, B, 8]: the value u[t] of each Philox call along a third axis, shifted into the high 16 bits
    (u >= t16 iff that word >= t16 << 16, so the high halves need no shift). With the axis in
    registers, the word and half each t takes are compile-time choices."""
    t = tl.arange(0, 8)[None, None, :]
    q = t & 3
    w = tl.where(q == 0, w0[:, :, None],
                 tl.where(q == 1, w1[:, :, None], tl.where(q == 2, w2[:, :, None], w3[:, :, None])))
    return tl.where(t < 4, w << 16, w)


@triton.jit
def attention_keep_words(k0, k1, row0, col0, batch_head, BM: tl.constexpr, BN: tl.constexpr):
    """Keep words of P[b, h, row0 + i, key_order(col0, BN)] as [BM, BN] (batch_head = b * H + h):
    the entry is kept iff its word >= t16 << 16 (apply_keep). Philox on a [BM, BN / 8] tile."""
    G: tl.constexpr = BN // 8
    groups = (col0 >> 3) + tl.arange(0, G)
    rows = row0 + tl.arange(0, BM)
    c0 = (groups[None, :] + rows[:, None] * 0).to(tl.uint32)
    c1 = (rows[:, None] + groups[None, :] * 0).to(tl.uint32)
    zero = c0 * 0
    w0, w1, w2, w3 = philox4x32_10(c0, c1, zero + batch_head.to(tl.uint32), zero, k0, k1)
    u = tl.reshape(_spread(w0, w1, w2, w3), [BM, G, 4, 2])  # t = 2 * (t >> 1) + (t & 1)
    return tl.reshape(tl.permute(u, 0, 2, 1, 3), [BM, BN])


@triton.jit
def _bits(w, thr):
    """Keep bits of a word's low (bit 0) and high (bit 4) 16-bit value."""
    return ((w << 16) >= thr).to(tl.int32) | ((w >= thr).to(tl.int32) << 4)


@triton.jit
def attention_keep_bits_t(k0, k1, col0, row0, batch_head, t16, BM: tl.constexpr, BN: tl.constexpr):
    """Keep flags of P[b, h, col0 + i, key_order_t(row0, BN)] transposed ([BN, BM], key down), as an
    int32 tile whose bit t (of key_order_t's decomposition) is the flag.

    Philox runs once per call on a [BN / 8, BM] tile and packs its eight flags into one byte; only
    that byte changes layout (to the four lanes that share the group), then each entry tests its bit.
    """
    G: tl.constexpr = BN // 8
    groups = (row0 >> 3) + tl.arange(0, G)
    cols = col0 + tl.arange(0, BM)
    c0 = (groups[:, None] + cols[None, :] * 0).to(tl.uint32)
    c1 = (cols[None, :] + groups[:, None] * 0).to(tl.uint32)
    zero = c0 * 0
    w0, w1, w2, w3 = philox4x32_10(c0, c1, zero + batch_head.to(tl.uint32), zero, k0, k1)
    thr = t16.to(tl.uint32) << 16
    bits = _bits(w0, thr) | (_bits(w1, thr) << 1) | (_bits(w2, thr) << 2) | (_bits(w3, thr) << 3)
    # A sum over a size-1 axis changes nothing but anchors the layout pass, which never recomputes
    # through a reduction: it would otherwise judge Philox four times per call in the accumulator
    # layout cheaper than moving this byte (an opaque inline-asm copy held in Triton 3.9, not 3.6).
    bits = tl.sum(bits[:, :, None], 2)
    # [g >> 1, g & 1, 8 (t), i] -> rows (g >> 1, t & 1, g & 1, t >> 2, (t >> 1) & 1)
    b = tl.broadcast_to(bits[:, None, :], [G, 8, BM])
    b = tl.reshape(b, [G // 2, 2, 2, 2, 2, BM])
    b = tl.reshape(tl.permute(b, 0, 4, 1, 2, 3, 5), [BN, BM])
    r = tl.arange(0, BN)
    t = ((r >> 3) & 1) + 2 * (r & 3)
    return b & (1 << t)[:, None]


@triton.jit
def apply_keep_bit(bit, x, y):
    """(x, y) (fp32) where `bit` (int32) is nonzero, else 0: one test serves both tiles."""
    if INTERPRETED:
        return tl.where(bit != 0, x, 0.0), tl.where(bit != 0, y, 0.0)
    else:  # as in apply_keep
        return tl.inline_asm_elementwise(
            "{ .reg .pred k; setp.ne.u32 k, $2, 0; selp.f32 $0, $3, 0f00000000, k; selp.f32 $1, $4, 0f00000000, k; }",
            "=r,=r,r,r,r", [bit, x, y], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def apply_keep(x, words, t16):
    """x (fp32) where its keep word says kept, else 0."""
    thr = t16.to(tl.uint32) << 16
    if INTERPRETED:
        return tl.where(words >= thr, x, 0.0)
    else:
        # fp32 select as inline asm: LLVM would move a plain select past the bf16 conversion of the
        # result and pay byte shuffles for it
        return tl.inline_asm_elementwise("{ .reg .pred k; setp.hs.u32 k, $1, $2; selp.f32 $0, $3, 0f00000000, k; }",
                                         "=r,r,r,r", [words, thr + words * 0, x], dtype=tl.float32, is_pure=True,
                                         pack=1)


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
                           TRANS: tl.constexpr):
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k0, k1 = load_key(SEED)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if TRANS:  # the dK/dV kernel's form: keys down (key_order_t), queries across
        bits = attention_keep_bits_t(k0, k1, pid_m * BLOCK_M, pid_n * BLOCK_N, bh, t16, BLOCK_M, BLOCK_N)
        one = tl.full([BLOCK_N, BLOCK_M], 1.0, tl.float32)
        keep = apply_keep_bit(bits, one, one)[0] != 0.0
        rows, cols = rows[None, :], key_order_t(pid_n * BLOCK_N, BLOCK_N)[:, None]
    else:  # the forward and dQ kernels' form: columns in key_order
        words = attention_keep_words(k0, k1, pid_m * BLOCK_M, pid_n * BLOCK_N, bh, BLOCK_M, BLOCK_N)
        keep = apply_keep(tl.full([BLOCK_M, BLOCK_N], 1.0, tl.float32), words, t16) != 0.0
        rows, cols = rows[:, None], key_order(pid_n * BLOCK_N, BLOCK_N)[None, :]
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


def attention_mask(seed, t16, out, block_m=16, block_n=16, trans=False):
    """Keep mask [B, H, Sq, Sk] (int8) through the attention kernels' tile helpers (the dK/dV kernel's
    transposed form when trans); block_n a multiple of 8 (of 16 when trans)."""
    B, H, Sq, Sk = out.shape
    grid = (triton.cdiv(Sq, block_m), triton.cdiv(Sk, block_n), B * H)
    _attention_mask_kernel[grid](out, H, Sq, Sk, seed_tensor(seed, out.device), t16, BLOCK_M=block_m,
                                 BLOCK_N=block_n, TRANS=trans)
    return out


def elementwise_mask(seed, t16, out, block_m=16, block_n=16):
    rows, cols = out.shape
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    _elementwise_mask_kernel[grid](out, rows, cols, seed_tensor(seed, out.device), t16, BLOCK_M=block_m,
                                   BLOCK_N=block_n)
    return out
