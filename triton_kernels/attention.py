"""Flash-style attention with fused softmax and dropout (GPU path; also runs interpreted on CPU).

Forward: online softmax over key blocks in base 2 (the softmax scale times log2(e) is folded into
the logits), causal blocks past the diagonal skipped, dropout applied to P after the row
statistics, o normalised at the end, natural-log logsumexp stored (+inf for an empty row, so
backward's exp(s - lse) is 0 there). Backward: one kernel per key block for dK/dV and one per
query block for dQ, each rebuilding P from lse and the mask from the seed; no atomics, so results
are deterministic. The mask is a function of (seed, b*H + h, i, j) only, so tilings may differ.
"""

import torch
import triton
import triton.language as tl

from .philox import attention_keep, key_words
from .rounding import INTERPRETED, to_storage

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; the interpreter gets fp32 operands (its 16-bit dot is wrong)."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _valid(rows, cols, mask_row, Sk, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr):
    """Which (row, col) pairs attend: in range, causal (j <= i) and not padded."""
    ok = (cols < Sk) & (rows >= 0)
    if CAUSAL:
        ok = ok & (cols <= rows)
    if HAS_MASK:
        pad = tl.load(mask_row + cols, mask=cols < Sk, other=0)
        ok = ok & (pad != 0)
    return ok


@triton.jit(do_not_specialize=["k0", "k1", "t16"])
def _fwd_kernel(Q, K, V, Out, LSE, MASK, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
                H, Sq, Sk, D, scale_log2, k0, k1, t16, keep_scale,
                CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < Sq
    dim_ok = dims < D
    q = tl.load(Q + b * sqb + h * sqh + rows.to(tl.int64)[:, None] * sqs + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    mask_row = MASK + b * Sk

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, (pid_m + 1) * BLOCK_M)  # later key blocks are all above the diagonal
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < Sk
        kt = tl.load(k_base + cols.to(tl.int64)[None, :] * sks + dims[:, None],
                     mask=col_ok[None, :] & dim_ok[:, None], other=0.0)
        s = _dot(q, kt, IEEE) * scale_log2
        ok = _valid(rows[:, None], cols[None, :], mask_row, Sk, CAUSAL, HAS_MASK)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet stay at 0
        alpha = tl.exp2(m_i - base)
        p = tl.exp2(s - base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = attention_keep(k0, k1, rows[:, None], cols[None, :], bh, t16)
            p = tl.where(keep, p * keep_scale, 0.0)
        vb = tl.load(v_base + cols.to(tl.int64)[:, None] * svs + dims[None, :],
                     mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(to_storage(p, vb.dtype), vb, IEEE)
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(Out + b * sob + h * soh + rows.to(tl.int64)[:, None] * sos + dims[None, :],
             to_storage(o, Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(LSE + bh.to(tl.int64) * Sq + rows, lse, mask=row_ok)


@triton.jit(do_not_specialize=["k0", "k1", "t16"])
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, MASK, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
                     H, Sq, Sk, D, scale, scale_log2, k0, k1, t16, keep_scale,
                     CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # DO, DQ, DK, DV are contiguous [B, H, S, D]; LSE and DELTA contiguous [B, H, Sq].
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < Sk
    dim_ok = dims < D
    tile_ok = col_ok[:, None] & dim_ok[None, :]
    kb = tl.load(K + b * skb + h * skh + cols.to(tl.int64)[:, None] * sks + dims[None, :], mask=tile_ok, other=0.0)
    vb = tl.load(V + b * svb + h * svh + cols.to(tl.int64)[:, None] * svs + dims[None, :], mask=tile_ok, other=0.0)
    q_base = Q + b * sqb + h * sqh
    do_base = DO + bh.to(tl.int64) * Sq * D
    stat_base = bh.to(tl.int64) * Sq
    mask_row = MASK + b * Sk
    ks = 1.0
    if DROPOUT:
        ks = keep_scale

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # earlier query rows attend none of these keys
    for start in range(lo, Sq, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < Sq
        rtile = row_ok[:, None] & dim_ok[None, :]
        q = tl.load(q_base + rows.to(tl.int64)[:, None] * sqs + dims[None, :], mask=rtile, other=0.0)
        do = tl.load(do_base + rows.to(tl.int64)[:, None] * D + dims[None, :], mask=rtile, other=0.0)
        lse = tl.load(LSE + stat_base + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + stat_base + rows, mask=row_ok, other=0.0)
        # Transposed tiles [BLOCK_N, BLOCK_M]: key j down, query i across.
        st = _dot(kb, tl.trans(q), IEEE)
        ok = _valid(rows[None, :], cols[:, None], mask_row, Sk, CAUSAL, HAS_MASK) & row_ok[None, :]
        pt = tl.where(ok, tl.exp2(st * scale_log2 - (lse * 1.4426950408889634)[None, :]), 0.0)
        kept = tl.zeros_like(pt) + ks
        if DROPOUT:
            keep = attention_keep(k0, k1, rows[None, :], cols[:, None], bh, t16)
            kept = tl.where(keep, kept, 0.0)
        dv += _dot(to_storage(pt * kept, do.dtype), do, IEEE)
        dpt = _dot(vb, tl.trans(do), IEEE)
        dst = pt * (dpt * kept - delta[None, :])
        dk += _dot(to_storage(dst, q.dtype), q, IEEE)
    out = bh.to(tl.int64) * Sk * D + cols.to(tl.int64)[:, None] * D + dims[None, :]
    tl.store(DK + out, to_storage(dk * scale, DK.dtype.element_ty), mask=tile_ok)
    tl.store(DV + out, to_storage(dv, DV.dtype.element_ty), mask=tile_ok)


@triton.jit(do_not_specialize=["k0", "k1", "t16"])
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, MASK, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
                   H, Sq, Sk, D, scale, scale_log2, k0, k1, t16, keep_scale,
                   CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < Sq
    dim_ok = dims < D
    rtile = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows.to(tl.int64)[:, None] * sqs + dims[None, :], mask=rtile, other=0.0)
    do = tl.load(DO + bh.to(tl.int64) * Sq * D + rows.to(tl.int64)[:, None] * D + dims[None, :], mask=rtile,
                 other=0.0)
    stat_base = bh.to(tl.int64) * Sq
    lse = tl.load(LSE + stat_base + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + stat_base + rows, mask=row_ok, other=0.0)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    mask_row = MASK + b * Sk
    ks = 1.0
    if DROPOUT:
        ks = keep_scale

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, (pid_m + 1) * BLOCK_M)
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < Sk
        ctile = col_ok[:, None] & dim_ok[None, :]
        kb = tl.load(k_base + cols.to(tl.int64)[:, None] * sks + dims[None, :], mask=ctile, other=0.0)
        vb = tl.load(v_base + cols.to(tl.int64)[:, None] * svs + dims[None, :], mask=ctile, other=0.0)
        s = _dot(q, tl.trans(kb), IEEE)
        ok = _valid(rows[:, None], cols[None, :], mask_row, Sk, CAUSAL, HAS_MASK) & row_ok[:, None]
        p = tl.where(ok, tl.exp2(s * scale_log2 - (lse * 1.4426950408889634)[:, None]), 0.0)
        kept = tl.zeros_like(p) + ks
        if DROPOUT:
            keep = attention_keep(k0, k1, rows[:, None], cols[None, :], bh, t16)
            kept = tl.where(keep, kept, 0.0)
        dp = _dot(do, tl.trans(vb), IEEE)
        ds = p * (dp * kept - delta[:, None])
        dq += _dot(to_storage(ds, kb.dtype), kb, IEEE)
    tl.store(DQ + bh.to(tl.int64) * Sq * D + rows.to(tl.int64)[:, None] * D + dims[None, :],
             to_storage(dq * scale, DQ.dtype.element_ty), mask=rtile)


# Block sizes: small tiles in the interpreter (cost grows with tile area); on the GPU by head dim
# and dtype so q, k, v tiles and the fp32 accumulators fit in registers and shared memory.
INTERPRETER_BLOCKS = (16, 16)


def _blocks(D, dtype, kernel="fwd"):
    """(BLOCK_M query rows, BLOCK_N keys, BLOCK_D, warps, stages) for one kernel.

    Forward and dQ keep a tall query block resident and stream keys; dK/dV keeps a tall key block
    (its two fp32 accumulators) and streams queries.
    """
    block_d = max(16, triton.next_power_of_2(D))
    if INTERPRETED:
        return INTERPRETER_BLOCKS + (block_d, 4, 1)
    wide = dtype.itemsize == 4
    tall = 32 if block_d > 128 else 64 if wide or block_d > 64 else 128
    if kernel == "fwd":
        if wide:
            bm, bn = (64, 32) if block_d <= 128 else (32, 32)
        else:
            bm, bn = (128, 64) if block_d <= 128 else (64, 32)
    elif kernel == "dq":
        bm, bn = tall, 32
    else:  # dkdv
        bm, bn = 32, tall
    # Eight warps for big tiles and for D > 128, whose fp32 accumulators would spill with four.
    warps = 8 if max(bm, bn) * block_d >= 128 * 128 or block_d > 128 else 4
    return bm, bn, block_d, warps, 2 if block_d > 128 else 3


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _common(mask, q, seed, t16, ks):
    has_mask = mask is not None
    mask_arg = mask.view(torch.uint8) if has_mask else q
    k0, k1 = key_words(seed) if t16 > 0 else (0, 0)
    return has_mask, mask_arg, k0, k1, t16, float(ks), t16 > 0


def _check_supported(cu_seqlens, window, q, k):
    if cu_seqlens is not None or window or k.shape[1] != q.shape[1]:
        raise NotImplementedError("the Triton attention kernels take neither cu_seqlens, windows nor grouped k/v")


def forward(q, k, v, o, lse, mask, cu_seqlens, causal, window, scale, seed, t16, ks):
    """o [B, H, Sq, D] (any strides, last dim contiguous) and lse fp32 [B, H, Sq] contiguous."""
    _check_supported(cu_seqlens, window, q, k)
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    bm, bn, bd, warps, stages = _blocks(D, q.dtype, "fwd")
    has_mask, mask_arg, k0, k1, t16, ks, drop = _common(mask, q, seed, t16, ks)
    grid = (triton.cdiv(Sq, bm), B * H)
    _fwd_kernel[grid](q, k, v, o, lse, mask_arg, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                      H, Sq, Sk, D, scale * LOG2E, k0, k1, t16, ks,
                      CAUSAL=causal, HAS_MASK=has_mask, DROPOUT=drop, IEEE=q.dtype.itemsize == 4,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, num_stages=stages)


def backward(do, q, k, v, o, lse, mask, cu_seqlens, causal, window, scale, seed, t16, ks, dq, dk, dv):
    """dq, dk, dv and do contiguous [B, H, S, D]; lse fp32 contiguous [B, H, Sq]."""
    _check_supported(cu_seqlens, window, q, k)
    # delta_i = sum_j P_ij dP_ij = rowsum(dO * O), in fp32 (it includes the dropout).
    delta = (do.float() * o.float()).sum(-1)
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    has_mask, mask_arg, k0, k1, t16, ks, drop = _common(mask, q, seed, t16, ks)
    lse = lse.contiguous()
    args = (H, Sq, Sk, D, scale, scale * LOG2E, k0, k1, t16, ks)
    flags = dict(CAUSAL=causal, HAS_MASK=has_mask, DROPOUT=drop, IEEE=q.dtype.itemsize == 4)

    def meta(kernel):
        bm, bn, bd, warps, stages = _blocks(D, q.dtype, kernel)
        return dict(flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, num_stages=stages)

    m = meta("dkdv")
    _bwd_dkdv_kernel[(triton.cdiv(Sk, m["BLOCK_N"]), B * H)](q, k, v, do, lse, delta, dk, dv, mask_arg,
                                                             *_strides(q), *_strides(k), *_strides(v), *args, **m)
    m = meta("dq")
    _bwd_dq_kernel[(triton.cdiv(Sq, m["BLOCK_M"]), B * H)](q, k, v, do, lse, delta, dq, mask_arg, *_strides(q),
                                                           *_strides(k), *_strides(v), *args, **m)
