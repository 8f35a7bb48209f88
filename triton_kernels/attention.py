"""Flash-style attention with fused softmax and dropout (GPU path; also runs interpreted on CPU).

Entry points and semantics: the attention kernel contract shared with the C++ backend (docs/DESIGN.md,
"Attention semantics"; forward/backward argument lists as selective_ckpt/ops/attention.py calls them).

Forward: online softmax over key blocks in base 2 (scale * log2(e) folded into the logits), dropout
on P after the row statistics, o normalised at the end, natural-log logsumexp stored (+inf for an
empty row, so backward's exp(s - lse) is 0 there). Backward: a delta = rowsum(dO * O) pre-pass,
one program per (key block, kv head) for dK/dV that loops over the query heads of its group (so
GQA needs no atomics and no expanded k, v), and one per query block for dQ.

Each program first works out which key (or query) blocks can matter at all: causal, sliding
window and per-document (cu_seqlens) limits are turned into a block range, so work grows with the
attended area only. Inside that range the blocks that every row attends completely are run
without any masking; only the blocks at the edges (diagonal, window edge, document edges, ragged
last block) pay for the element masks. The dropout mask is a function of (seed, b*H + h, i, j)
only, so tilings may differ between kernels and the results are deterministic.
"""

import torch
import triton
import triton.language as tl

from .philox import (
    apply_keep,
    apply_keep_bit,
    attention_keep_bits_t,
    attention_keep_words,
    key_order,
    key_order_t,
    load_key,
)
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
def _load_rows(base, idx, stride, lim, dims, D: tl.constexpr, CHECK: tl.constexpr, EVEN_D: tl.constexpr):
    """Tile [len(idx), BLOCK_D] of rows idx (stride apart, last dim contiguous); masks only what can be out."""
    ptrs = base + idx.to(tl.int64)[:, None] * stride + dims[None, :]
    if CHECK:
        if EVEN_D:
            return tl.load(ptrs, mask=(idx < lim)[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=(idx < lim)[:, None] & (dims < D)[None, :], other=0.0)
    else:
        if EVEN_D:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=(dims < D)[None, :], other=0.0)


@triton.jit
def _store_rows(base, idx, stride, lim, dims, val, D: tl.constexpr, CHECK: tl.constexpr, EVEN_D: tl.constexpr):
    ptrs = base + idx.to(tl.int64)[:, None] * stride + dims[None, :]
    val = to_storage(val, base.dtype.element_ty)
    if CHECK:
        if EVEN_D:
            tl.store(ptrs, val, mask=(idx < lim)[:, None])
        else:
            tl.store(ptrs, val, mask=(idx < lim)[:, None] & (dims < D)[None, :])
    else:
        if EVEN_D:
            tl.store(ptrs, val)
        else:
            tl.store(ptrs, val, mask=(dims < D)[None, :])


@triton.jit
def _doc_bounds(CU, pos, n_docs, doc_bits):
    """[start, end) of the document holding each position: binary search of cu_seqlens."""
    d = pos * 0
    for it in range(doc_bits):
        cand = d + (1 << (doc_bits - 1 - it))
        inside = cand < n_docs
        start = tl.load(CU + cand, mask=inside, other=0)
        d = tl.where(inside & (start <= pos), cand, d)
    return tl.load(CU + d), tl.load(CU + d + 1)


@triton.jit
def _allowed(rows, cols, Sq, Sk, window, ds, de, pad,
             MASKED: tl.constexpr, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr,
             CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, HAS_PAD: tl.constexpr):
    """Which (row, col) pairs attend. rows, cols, ds/de (rows' document bounds) and pad (the key
    padding flags) broadcast to the tile. Outside MASKED blocks only the key padding can apply."""
    ok = (rows >= 0) & (cols >= 0)
    if MASKED:
        if CHECK_ROWS:
            ok = ok & (rows < Sq)
        if CHECK_COLS:
            ok = ok & (cols < Sk)
        if CAUSAL:
            ok = ok & (cols <= rows)
        if WINDOW:
            ok = ok & (cols > rows - window)
        if VARLEN:
            ok = ok & (cols >= ds) & (cols < de)
    if HAS_PAD:
        ok = ok & (pad != 0)
    return ok


@triton.jit
def _ranges(first, last, lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Block ranges [b0, b1) masked, [b1, b2) unmasked, [b2, b3) masked of the position range
    [lo, hi), where positions in [full_lo, full_hi) need no mask for any of first..last."""
    b0 = lo // BLOCK
    b3 = tl.maximum(tl.cdiv(hi, BLOCK), b0)
    b1 = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK), b0), b3)
    b2 = tl.minimum(tl.maximum(full_hi // BLOCK, b1), b3)
    return b0, b1, b2, b3


@triton.jit
def _key_ranges(r0, r1, Sk, window, dsq, deq, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Key block ranges for query rows r0..r1 (real rows only); dsq/deq their document bounds."""
    lo = 0
    hi = Sk
    full_lo = 0
    full_hi = Sk
    if VARLEN:
        lo = tl.min(dsq, 0)
        hi = tl.max(deq, 0)
        full_lo = tl.max(dsq, 0)
        full_hi = tl.minimum(full_hi, tl.min(deq, 0))
    if CAUSAL:
        hi = tl.minimum(hi, r1 + 1)
        full_hi = tl.minimum(full_hi, r0 + 1)
    if WINDOW:
        lo = tl.maximum(lo, r0 - window + 1)
        full_lo = tl.maximum(full_lo, r1 - window + 1)
    return _ranges(r0, r1, lo, hi, full_lo, full_hi, BLOCK_N)


@triton.jit
def _fwd_blocks(acc, m_i, l_i, q, k_base, v_base, skn, svn, b_lo, b_hi, r0, rows, ds, de, pad_base,
                Sq, Sk, window, k0, k1, bh, t16, keep_scale, scale_log2,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_N: tl.constexpr):
    EVEN_D: tl.constexpr = BLOCK_D == D
    CHECK: tl.constexpr = MASKED and not EVEN_N
    dims = tl.arange(0, BLOCK_D)
    for blk in range(b_lo, b_hi):
        start = blk * BLOCK_N
        if DROPOUT:
            cols = key_order(start, BLOCK_N)
        else:
            cols = start + tl.arange(0, BLOCK_N)
        kb = _load_rows(k_base, cols, skn, Sk, dims, D, CHECK, EVEN_D)
        s = _dot(q, tl.trans(kb), IEEE) * scale_log2
        if MASKED or HAS_PAD:
            pad = 1
            if HAS_PAD:
                pad = tl.load(pad_base + cols, mask=cols < Sk, other=0)[None, :]
            ok = _allowed(rows[:, None], cols[None, :], Sq, Sk, window, ds[:, None], de[:, None], pad,
                          MASKED, False, CHECK, CAUSAL, WINDOW, VARLEN, HAS_PAD)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet stay at 0
        alpha = tl.exp2(m_i - base)
        p = tl.exp2(s - base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            words = attention_keep_words(k0, k1, r0, start, bh, BLOCK_M, BLOCK_N)
            p = apply_keep(p, words, t16)  # keep_scale is applied once, to the output
        vb = _load_rows(v_base, cols, svn, Sk, dims, D, CHECK, EVEN_D)
        acc = acc * alpha[:, None] + _dot(to_storage(p, vb.dtype), vb, IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["window", "n_docs", "doc_bits", "t16"])
def _fwd_kernel(Q, K, V, OUT, LSE, PAD, CU, SEED, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                H, G, Sq, Sk, window, n_docs, doc_bits, scale_log2, t16, keep_scale,
                D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    EVEN_D: tl.constexpr = BLOCK_D == D
    n_m = tl.cdiv(Sq, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_m
    pid_m = n_m - 1 - pid % n_m  # the longest causal rows of a head start first
    b = (bh // H).to(tl.int64)
    h = bh % H
    kvh = (h // G).to(tl.int64)
    h = h.to(tl.int64)
    r0 = pid_m * BLOCK_M
    r1 = tl.minimum(r0 + BLOCK_M, Sq) - 1
    rows = r0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b * sqb + h * sqh, rows, sqm, Sq, dims, D, not EVEN_M, EVEN_D)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    pad_base = 0  # PAD is None (a constexpr) without padding
    if HAS_PAD:
        pad_base = PAD + b * Sk
    k0 = 0
    k1 = 0
    if DROPOUT:
        k0, k1 = load_key(SEED)
    ds = rows
    de = rows
    if VARLEN:
        ds, de = _doc_bounds(CU, tl.minimum(rows, Sq - 1), n_docs, doc_bits)
    b0, b1, b2, b3 = _key_ranges(r0, r1, Sk, window, ds, de, CAUSAL, WINDOW, VARLEN, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    args = (q, k_base, v_base, skn, svn)
    rest = (r0, rows, ds, de, pad_base, Sq, Sk, window, k0, k1, bh, t16, keep_scale, scale_log2)
    if CAUSAL or WINDOW or VARLEN or not EVEN_N:
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, b0, b1, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                                    DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N)
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, b1, b2, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                                    DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N)
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, b2, b3, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                                    DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N)
    else:
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, b0, b3, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                                    DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N)
    empty = l_i == 0.0
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    if DROPOUT:
        inv = inv * keep_scale
    o = acc * inv[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    _store_rows(OUT + b * sob + h * soh, rows, som, Sq, dims, o, D, not EVEN_M, EVEN_D)
    lse_ptr = LSE + bh.to(tl.int64) * Sq + rows
    if EVEN_M:
        tl.store(lse_ptr, lse)
    else:
        tl.store(lse_ptr, lse, mask=rows < Sq)


@triton.jit
def _delta_kernel(OUT, DO, DELTA, sob, soh, som, sdb, sdh, sdm, H, Sq, D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """delta[b, h, i] = sum_d dO * O in fp32 (equal to sum_j P_ij dP_ij, dropout included)."""
    n_m = tl.cdiv(Sq, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_m
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = (pid % n_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    o = _load_rows(OUT + b * sob + h * soh, rows, som, Sq, dims, D, True, BLOCK_D == D).to(tl.float32)
    do = _load_rows(DO + b * sdb + h * sdh, rows, sdm, Sq, dims, D, True, BLOCK_D == D).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * Sq + rows, tl.sum(o * do, 1), mask=rows < Sq)


@triton.jit
def _dkdv_blocks(dk, dv, kb, vb, q_head, do_head, stat_head, DELTA, LSE, sqh, sdh, sqm, sdm, G, b_lo, b_hi, c0, cols,
                 dsk, dek, pad, Sq, Sk, window, k0, k1, bh_head, t16, keep_scale, scale_log2,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                 HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr):
    # Transposed tiles [BLOCK_N, BLOCK_M]: key j down, query i across.
    EVEN_D: tl.constexpr = BLOCK_D == D
    CHECK: tl.constexpr = MASKED and not EVEN_M
    dims = tl.arange(0, BLOCK_D)
    # One flat loop over (query head of the group, query block), heads in order: a nested head loop
    # around the block loop kept more live across iterations and spilled; this is the G == 1 loop.
    n_blk = b_hi - b_lo
    for it in range(0, G * n_blk):
        hh = it // n_blk
        start = (b_lo + it - hh * n_blk) * BLOCK_M
        q_base = q_head + hh * sqh
        do_base = do_head + hh * sdh
        lse_base = LSE + stat_head + hh * Sq
        delta_base = DELTA + stat_head + hh * Sq
        bh = bh_head + hh
        rows = start + tl.arange(0, BLOCK_M)
        q = _load_rows(q_base, rows, sqm, Sq, dims, D, CHECK, EVEN_D)
        do = _load_rows(do_base, rows, sdm, Sq, dims, D, CHECK, EVEN_D)
        if CHECK:
            lse = tl.load(lse_base + rows, mask=rows < Sq, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=rows < Sq, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        st = _dot(kb, tl.trans(q), IEEE) * scale_log2
        pt = tl.exp2(st - (lse * 1.4426950408889634)[None, :])
        if MASKED or HAS_PAD:
            # dsk/dek are the keys' document bounds: i shares j's document iff dsk <= i < dek.
            ok = _allowed(rows[None, :], cols[:, None], Sq, Sk, window, 0, 0, pad, MASKED, CHECK, False, CAUSAL,
                          WINDOW, False, HAS_PAD)
            if MASKED and VARLEN:
                ok = ok & (rows[None, :] >= dsk[:, None]) & (rows[None, :] < dek[:, None])
            pt = tl.where(ok, pt, 0.0)
        dpt = _dot(vb, tl.trans(do), IEEE)
        if DROPOUT:
            bits = attention_keep_bits_t(k0, k1, start, c0, bh, t16, BLOCK_M, BLOCK_N)
            dv += _dot(to_storage(apply_keep_bit(pt * keep_scale, bits), do.dtype), do, IEEE)
            dpt = apply_keep_bit(dpt, bits) * keep_scale
        else:
            dv += _dot(to_storage(pt, do.dtype), do, IEEE)
        dst = pt * (dpt - delta[None, :])
        dk += _dot(to_storage(dst, q.dtype), q, IEEE)
    return dk, dv


@triton.jit(do_not_specialize=["window", "n_docs", "doc_bits", "t16"])
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, PAD, CU, SEED,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm,
                     sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
                     H, G, Sq, Sk, window, n_docs, doc_bits, scale, scale_log2, t16, keep_scale,
                     D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                     HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    EVEN_D: tl.constexpr = BLOCK_D == D
    n_n = tl.cdiv(Sk, BLOCK_N)
    pid = tl.program_id(0)
    bg = pid // n_n
    pid_n = pid % n_n
    Hkv = H // G
    b = (bg // Hkv).to(tl.int64)
    kvh = (bg % Hkv).to(tl.int64)
    c0 = pid_n * BLOCK_N
    c1 = tl.minimum(c0 + BLOCK_N, Sk) - 1
    if DROPOUT:  # the keys in the order of the dropout tiles (the stores follow it)
        cols = key_order_t(c0, BLOCK_N)
    else:
        cols = c0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    kb = _load_rows(K + b * skb + kvh * skh, cols, skn, Sk, dims, D, not EVEN_N, EVEN_D)
    vb = _load_rows(V + b * svb + kvh * svh, cols, svn, Sk, dims, D, not EVEN_N, EVEN_D)
    pad = 1
    if HAS_PAD:
        pad = tl.load(PAD + b * Sk + cols, mask=cols < Sk, other=0)[:, None]
    k0 = 0
    k1 = 0
    if DROPOUT:
        k0, k1 = load_key(SEED)
    dsk = cols
    dek = cols
    # Query range attending these keys; full_* is where no query needs an element mask.
    lo = 0
    hi = Sq
    full_lo = 0
    full_hi = Sq
    if VARLEN:
        dsk, dek = _doc_bounds(CU, tl.minimum(cols, Sk - 1), n_docs, doc_bits)
        lo = tl.min(dsk, 0)
        hi = tl.max(dek, 0)
        full_lo = tl.max(dsk, 0)
        full_hi = tl.min(dek, 0)
    if CAUSAL:
        lo = tl.maximum(lo, c0)
        full_lo = tl.maximum(full_lo, c1)
    if WINDOW:
        hi = tl.minimum(hi, c1 + window)
        full_hi = tl.minimum(full_hi, c0 + window)
    b0, b1, b2, b3 = _ranges(c0, c1, lo, hi, full_lo, full_hi, BLOCK_M)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    h0 = kvh * G  # the group's first query head; its G heads are reduced in order (deterministic)
    args = (Q + b * sqb + h0 * sqh, DO + b * sdb + h0 * sdh, (b * H + h0) * Sq, DELTA, LSE, sqh, sdh, sqm, sdm, G)
    rest = (c0, cols, dsk, dek, pad, Sq, Sk, window, k0, k1, b * H + h0, t16, keep_scale, scale_log2)
    if CAUSAL or WINDOW or VARLEN or not EVEN_M:
        dk, dv = _dkdv_blocks(dk, dv, kb, vb, *args, b0, b1, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                              DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_M)
        dk, dv = _dkdv_blocks(dk, dv, kb, vb, *args, b1, b2, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                              DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_M)
        dk, dv = _dkdv_blocks(dk, dv, kb, vb, *args, b2, b3, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                              DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_M)
    else:
        dk, dv = _dkdv_blocks(dk, dv, kb, vb, *args, b0, b3, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                              DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_M)
    _store_rows(DK + b * sdkb + kvh * sdkh, cols, sdkn, Sk, dims, dk * scale, D, not EVEN_N, EVEN_D)
    _store_rows(DV + b * sdvb + kvh * sdvh, cols, sdvn, Sk, dims, dv, D, not EVEN_N, EVEN_D)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_base, v_base, skn, svn, b_lo, b_hi, r0, rows, ds, de, pad_base,
               Sq, Sk, window, k0, k1, bh, t16, keep_scale, scale_log2,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
               HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_N: tl.constexpr):
    EVEN_D: tl.constexpr = BLOCK_D == D
    CHECK: tl.constexpr = MASKED and not EVEN_N
    dims = tl.arange(0, BLOCK_D)
    for blk in range(b_lo, b_hi):
        start = blk * BLOCK_N
        if DROPOUT:
            cols = key_order(start, BLOCK_N)
        else:
            cols = start + tl.arange(0, BLOCK_N)
        kb = _load_rows(k_base, cols, skn, Sk, dims, D, CHECK, EVEN_D)
        vb = _load_rows(v_base, cols, svn, Sk, dims, D, CHECK, EVEN_D)
        s = _dot(q, tl.trans(kb), IEEE) * scale_log2
        p = tl.exp2(s - lse2[:, None])
        if MASKED or HAS_PAD:
            pad = 1
            if HAS_PAD:
                pad = tl.load(pad_base + cols, mask=cols < Sk, other=0)[None, :]
            ok = _allowed(rows[:, None], cols[None, :], Sq, Sk, window, ds[:, None], de[:, None], pad,
                          MASKED, False, CHECK, CAUSAL, WINDOW, VARLEN, HAS_PAD)
            p = tl.where(ok, p, 0.0)
        dp = _dot(do, tl.trans(vb), IEEE)
        if DROPOUT:
            # zeroed before the scale, so that dp * keep_scale - delta fuses into one FMA
            words = attention_keep_words(k0, k1, r0, start, bh, BLOCK_M, BLOCK_N)
            dp = apply_keep(dp, words, t16) * keep_scale
        ds_ = p * (dp - delta[:, None])
        dq += _dot(to_storage(ds_, kb.dtype), kb, IEEE)
    return dq


@triton.jit(do_not_specialize=["window", "n_docs", "doc_bits", "t16"])
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, PAD, CU, SEED,
                   sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sdqb, sdqh, sdqm,
                   H, G, Sq, Sk, window, n_docs, doc_bits, scale, scale_log2, t16, keep_scale,
                   D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                   HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    EVEN_D: tl.constexpr = BLOCK_D == D
    n_m = tl.cdiv(Sq, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_m
    pid_m = n_m - 1 - pid % n_m
    b = (bh // H).to(tl.int64)
    h = bh % H
    kvh = (h // G).to(tl.int64)
    h = h.to(tl.int64)
    r0 = pid_m * BLOCK_M
    r1 = tl.minimum(r0 + BLOCK_M, Sq) - 1
    rows = r0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b * sqb + h * sqh, rows, sqm, Sq, dims, D, not EVEN_M, EVEN_D)
    do = _load_rows(DO + b * sdb + h * sdh, rows, sdm, Sq, dims, D, not EVEN_M, EVEN_D)
    stat = bh.to(tl.int64) * Sq + rows
    if EVEN_M:
        lse2 = tl.load(LSE + stat) * 1.4426950408889634
        delta = tl.load(DELTA + stat)
    else:
        lse2 = tl.load(LSE + stat, mask=rows < Sq, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA + stat, mask=rows < Sq, other=0.0)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh
    pad_base = 0  # PAD is None (a constexpr) without padding
    if HAS_PAD:
        pad_base = PAD + b * Sk
    k0 = 0
    k1 = 0
    if DROPOUT:
        k0, k1 = load_key(SEED)
    ds = rows
    de = rows
    if VARLEN:
        ds, de = _doc_bounds(CU, tl.minimum(rows, Sq - 1), n_docs, doc_bits)
    b0, b1, b2, b3 = _key_ranges(r0, r1, Sk, window, ds, de, CAUSAL, WINDOW, VARLEN, BLOCK_N)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    args = (q, do, lse2, delta, k_base, v_base, skn, svn)
    rest = (r0, rows, ds, de, pad_base, Sq, Sk, window, k0, k1, bh, t16, keep_scale, scale_log2)
    if CAUSAL or WINDOW or VARLEN or not EVEN_N:
        dq = _dq_blocks(dq, *args, b0, b1, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD, DROPOUT, IEEE, D,
                        BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N)
        dq = _dq_blocks(dq, *args, b1, b2, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD, DROPOUT, IEEE, D,
                        BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N)
        dq = _dq_blocks(dq, *args, b2, b3, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD, DROPOUT, IEEE, D,
                        BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N)
    else:
        dq = _dq_blocks(dq, *args, b0, b3, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD, DROPOUT, IEEE, D,
                        BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N)
    _store_rows(DQ + b * sdqb + h * sdqh, rows, sdqm, Sq, dims, dq * scale, D, not EVEN_M, EVEN_D)


# ---------------------------------------------------------------------------------------------
# Tiles. Small ones in the interpreter (its cost grows with tile area). On sm_90 a fixed table per
# (kernel, head dim, element size, causal, dropout), chosen from compile metadata (registers,
# spills, shared memory: tests/gpu_compile_check.py --json) so that no 16-bit configuration
# spills; no run-time autotuning. Values: (BLOCK_M, BLOCK_N, num_warps, num_stages).
INTERPRETER_BLOCKS = (16, 16)


def _tiles(kernel, block_d, wide, causal, dropout):
    # Measured (tests/gpu_compile_check.py): dropout's Philox adds registers, so dK/dV's dropout
    # variants take 16/32-row query blocks (the plain tile spills in the GQA, window, document and
    # ragged variants); the forward takes 8 warps (with 4 the D=64 causal and document variants spilled).
    # fp32 uses IEEE dots, which Hopper runs on FMA units with whole operand rows per thread: only
    # small tiles stay out of local memory there.
    if wide:
        return (16, 32, 4, 1) if kernel == "dkdv" else (16, 16, 4, 1)
    if kernel == "fwd":
        return (128, 64, 8, 3) if block_d <= 128 else (64, 32, 8, 2)
    if kernel == "dq":
        if block_d <= 64:
            return (128, 64, 8, 3)
        return (128, 32, 8, 2) if block_d <= 128 else (64, 32, 8, 2)
    # dkdv: a tall key block (two fp32 accumulators) resident, query blocks streamed
    if block_d <= 64:
        return (32, 128, 8, 3) if dropout else (64, 128, 8, 3)
    if block_d <= 128:
        return (16, 128, 8, 2) if dropout else (32, 128, 8, 2)
    return (16, 64, 8, 2) if dropout else (32, 64, 8, 2)


def config(kernel, D, dtype, causal=False, dropout=False):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) of one kernel."""
    block_d = max(16, triton.next_power_of_2(D))
    if INTERPRETED:
        return INTERPRETER_BLOCKS + (block_d, 4, 1)
    bm, bn, warps, stages = _tiles(kernel, block_d, dtype.itemsize == 4, causal, dropout)
    return bm, bn, block_d, warps, stages


def _s3(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _flags(q, Sq, Sk, causal, window, pad, cu_seqlens, t16, kernel):
    bm, bn, bd, warps, stages = config(kernel, q.shape[3], q.dtype, causal, t16 > 0)
    return dict(D=q.shape[3], CAUSAL=bool(causal), WINDOW=window > 0, VARLEN=cu_seqlens is not None,
                HAS_PAD=pad is not None, DROPOUT=t16 > 0, IEEE=q.dtype.itemsize == 4, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_D=bd, EVEN_M=Sq % bm == 0, EVEN_N=Sk % bn == 0, num_warps=warps, num_stages=stages)


def _common(q, k, key_padding_mask, cu_seqlens, window, seed, t16):
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {Hkv}")
    pad = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else None
    n_docs = cu_seqlens.numel() - 1 if cu_seqlens is not None else 0
    if cu_seqlens is not None and (B != 1 or Sq != Sk):
        raise ValueError("cu_seqlens needs B == 1 and Sq == Sk")
    seed = seed if t16 > 0 else None  # dropout off: the seed is never read
    return B, H, Hkv, Sq, Sk, pad, n_docs, max(n_docs, 1).bit_length(), int(window), seed


def forward(q, k, v, o, lse, key_padding_mask, cu_seqlens, causal, window, scale, seed, t16, keep_scale):
    """o [B, H, Sq, D] (any strides, last dim contiguous), lse fp32 [B, H, Sq] contiguous."""
    B, H, Hkv, Sq, Sk, pad, n_docs, doc_bits, window, seed = _common(q, k, key_padding_mask, cu_seqlens, window,
                                                                    seed, t16)
    if B * H * Sq == 0:
        return
    f = _flags(q, Sq, Sk, causal, window, pad, cu_seqlens, t16, "fwd")
    grid = (triton.cdiv(Sq, f["BLOCK_M"]) * B * H,)
    _fwd_kernel[grid](q, k, v, o, lse, pad, cu_seqlens, seed, *_s3(q), *_s3(k), *_s3(v), *_s3(o),
                      H, H // Hkv, Sq, Sk, window, n_docs, doc_bits, scale * LOG2E, t16, float(keep_scale), **f)


def delta(o, do, out):
    """out [B, H, Sq] fp32 contiguous = rowsum(dO * O) in fp32."""
    B, H, Sq, D = o.shape
    block_d = max(16, triton.next_power_of_2(D))
    bm = 16 if INTERPRETED else max(1, min(128, 8192 // block_d))
    _delta_kernel[(triton.cdiv(Sq, bm) * B * H,)](o, do, out, *_s3(o), *_s3(do), H, Sq, D=D, BLOCK_M=bm,
                                                  BLOCK_D=block_d, num_warps=4)
    return out


def backward(do, q, k, v, o, lse, key_padding_mask, cu_seqlens, causal, window, scale, seed, t16, keep_scale,
             dq, dk, dv):
    """dq, dk, dv: outputs shaped like q, k, v (any strides with the last dim contiguous)."""
    B, H, Sq = q.shape[:3]
    if B * H == 0:
        return
    if Sq == 0 or k.shape[2] == 0:  # nothing attends: zero gradients
        for t in (dq, dk, dv):
            t.zero_()
        return
    dl = delta(o, do, torch.empty(B, H, Sq, dtype=torch.float32, device=q.device))
    args = (do, q, k, v, lse, dl, key_padding_mask, cu_seqlens, causal, window, scale, seed, t16, keep_scale)
    backward_dkdv(*args, dk, dv)
    backward_dq(*args, dq)


def _bwd_args(q, k, key_padding_mask, cu_seqlens, causal, window, scale, seed, t16, keep_scale, kernel):
    B, H, Hkv, Sq, Sk, pad, n_docs, doc_bits, window, seed = _common(q, k, key_padding_mask, cu_seqlens, window,
                                                                    seed, t16)
    tail = (H, H // Hkv, Sq, Sk, window, n_docs, doc_bits, scale, scale * LOG2E, t16, float(keep_scale))
    return B, H, Hkv, Sq, Sk, pad, seed, tail, _flags(q, Sq, Sk, causal, window, pad, cu_seqlens, t16, kernel)


def backward_dkdv(do, q, k, v, lse, dl, key_padding_mask, cu_seqlens, causal, window, scale, seed, t16, keep_scale,
                  dk, dv):
    """dK, dV (reduced over each kv head's query group) given delta dl [B, H, Sq] fp32."""
    B, H, Hkv, Sq, Sk, pad, seed, tail, f = _bwd_args(q, k, key_padding_mask, cu_seqlens, causal, window, scale,
                                                      seed, t16, keep_scale, "dkdv")
    _bwd_dkdv_kernel[(triton.cdiv(Sk, f["BLOCK_N"]) * B * Hkv,)](
        q, k, v, do, lse, dl, dk, dv, pad, cu_seqlens, seed, *_s3(q), *_s3(k), *_s3(v), *_s3(do), *_s3(dk),
        *_s3(dv), *tail, **f)


def backward_dq(do, q, k, v, lse, dl, key_padding_mask, cu_seqlens, causal, window, scale, seed, t16, keep_scale,
                dq):
    """dQ given delta dl [B, H, Sq] fp32."""
    B, H, Hkv, Sq, Sk, pad, seed, tail, f = _bwd_args(q, k, key_padding_mask, cu_seqlens, causal, window, scale,
                                                      seed, t16, keep_scale, "dq")
    _bwd_dq_kernel[(triton.cdiv(Sq, f["BLOCK_M"]) * B * H,)](
        q, k, v, do, lse, dl, dq, pad, cu_seqlens, seed, *_s3(q), *_s3(k), *_s3(v), *_s3(do), *_s3(dq), *tail, **f)
