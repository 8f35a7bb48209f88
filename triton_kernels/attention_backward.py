"""Attention backward kernels: dK/dV per (key block, kv head) walking the query heads of its group
in one flat loop (deterministic GQA, no atomics), and dQ per query block; both rebuild P from the
logsumexp and the dropout mask from the seed. Entry points and tiles: triton_kernels/attention.py."""

import triton
import triton.language as tl

from .attention_common import (
    _allowed,
    _doc_bounds,
    _dot,
    _key_side,
    _load_rows,
    _query_block,
    _ranges,
    _scores,
    _store_rows,
)
from .philox import (
    apply_keep,
    apply_keep_bit,
    attention_keep_bits_t,
    attention_keep_words,
    key_order,
    key_order_t,
    load_key,
)
from .rounding import to_storage


@triton.jit
def _dkdv_blocks(dk, dv, kb, vb, q_head, do_head, stat_head, DELTA, LSE, sqh, sdh, sqm, sdm, G, b_lo, b_hi, c0, cols,
                 dsk, dek, pad, Sq, Sk, window, q_offset, k0, k1, bh_head, t16, keep_scale, logit_mult, tanh_in,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                 HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr,
                 SOFTCAP: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    # Transposed tiles [BLOCK_N, BLOCK_M]: key j down, query i across.
    EVEN_D: tl.constexpr = BLOCK_D == D
    EVEN_DV: tl.constexpr = BLOCK_DV == DV
    CHECK: tl.constexpr = MASKED and not EVEN_M
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    offs = tl.arange(0, BLOCK_M)
    # One flat loop over (query head of the group, query block), heads in order: a nested head loop
    # around the block loop kept more live across iterations and spilled; this is the G == 1 loop.
    n_blk = b_hi - b_lo  # at least 1: callers skip empty ranges (see _bwd_dkdv_kernel)
    for it in range(0, G * n_blk):
        hh = it // n_blk
        start = (b_lo + it - hh * n_blk) * BLOCK_M
        q_base = q_head + hh * sqh
        do_base = do_head + hh * sdh
        lse_base = LSE + stat_head + hh * Sq
        delta_base = DELTA + stat_head + hh * Sq
        bh = bh_head + hh
        rows = start + offs
        if DROPOUT:
            gstart = start + q_offset  # the block's first key position, for the masks and the dropout rows
        q = _load_rows(q_base + start.to(tl.int64) * sqm, offs, sqm, Sq - start, dims, D, CHECK, EVEN_D)
        do = _load_rows(do_base + start.to(tl.int64) * sdm, offs, sdm, Sq - start, vdims, DV, CHECK, EVEN_DV)
        if CHECK:
            lse = tl.load(lse_base + rows, mask=rows < Sq, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=rows < Sq, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        st, tt = _scores(_dot(kb, tl.trans(q), IEEE), logit_mult, tanh_in, SOFTCAP)
        pt = tl.exp2(st - (lse * 1.4426950408889634)[None, :])
        if MASKED or HAS_PAD:
            # Masks at the rows' key positions pos = rows + q_offset (rows < Sq iff pos < Sq + q_offset).
            # dsk/dek are the keys' document bounds: i shares j's document iff dsk <= pos < dek.
            # (with dropout from gstart, shared with the Philox rows: formed apart, it spilled registers; without,
            # from rows: from gstart it spilled under documents and a window at D = 128)
            if DROPOUT:
                pos = gstart + offs
            else:
                pos = rows + q_offset
            ok = _allowed(pos[None, :], cols[:, None], Sq + q_offset, Sk, window, 0, 0, pad, MASKED, CHECK, False,
                          CAUSAL, WINDOW, False, HAS_PAD)
            if MASKED and VARLEN:
                ok = ok & (pos[None, :] >= dsk[:, None]) & (pos[None, :] < dek[:, None])
            pt = tl.where(ok, pt, 0.0)
        dpt = _dot(vb, tl.trans(do), IEEE)
        if DROPOUT:
            bits = attention_keep_bits_t(k0, k1, gstart, c0, bh, t16, BLOCK_M, BLOCK_N)
            pt_kept, dpt = apply_keep_bit(bits, pt, dpt)
            dv += _dot(to_storage(pt_kept, do.dtype), do, IEEE)  # keep_scale: applied at the store
            dpt = dpt * keep_scale
        else:
            dv += _dot(to_storage(pt, do.dtype), do, IEEE)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:  # d(c tanh(s / c)) / ds
            dst = dst * (1.0 - tt * tt)
        dk += _dot(to_storage(dst, q.dtype), q, IEEE)
    return dk, dv


@triton.jit(do_not_specialize=["window", "q_offset", "n_docs", "doc_bits", "t16"])
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV_OUT, PAD, CU, SEED,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm,
                     sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
                     H, G, Sq, Sk, window, q_offset, n_docs, doc_bits, scale, logit_mult, tanh_in, t16, keep_scale,
                     D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                     HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                     SOFTCAP: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    EVEN_D: tl.constexpr = BLOCK_D == D
    EVEN_DV: tl.constexpr = BLOCK_DV == DV
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
    vdims = tl.arange(0, BLOCK_DV)
    vb = _load_rows(V + b * svb + kvh * svh, cols, svn, Sk, vdims, DV, not EVEN_N, EVEN_DV)
    pad = 1
    if HAS_PAD:
        pad = tl.load(PAD + b * Sk + cols, mask=cols < Sk, other=0)[:, None]
    k0 = 0
    k1 = 0
    if DROPOUT:
        k0, k1 = load_key(SEED)
    dsk = cols
    dek = cols
    # Query range (rows, local: key position - q_offset) attending these keys; full_* is where no
    # query needs an element mask. With q_offset = 0 every bound below is the plain one.
    lo = 0
    hi = Sq
    full_lo = 0
    full_hi = Sq
    if VARLEN:
        dsk, dek = _doc_bounds(CU, tl.minimum(cols, Sk - 1), n_docs, doc_bits)
        lo = tl.maximum(tl.min(dsk, 0) - q_offset, 0)
        hi = tl.minimum(tl.max(dek, 0) - q_offset, Sq)
        full_lo = tl.max(dsk, 0) - q_offset
        full_hi = tl.minimum(tl.min(dek, 0) - q_offset, Sq)
    if CAUSAL:
        lo = tl.maximum(lo, c0 - q_offset)
        full_lo = tl.maximum(full_lo, c1 - q_offset)
    if WINDOW:
        hi = tl.minimum(hi, c1 + window - q_offset)
        full_hi = tl.minimum(full_hi, c0 + window - q_offset)
    b0, b1, b2, b3 = _ranges(c0, c1, lo, hi, full_lo, full_hi, BLOCK_M)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    h0 = kvh * G  # the group's first query head; its G heads are reduced in order (deterministic)
    args = (Q + b * sqb + h0 * sqh, DO + b * sdb + h0 * sdh, (b * H + h0) * Sq, DELTA, LSE, sqh, sdh, sqm, sdm, G)
    rest = (c0, cols, dsk, dek, pad, Sq, Sk, window, q_offset, k0, k1, b * H + h0, t16, keep_scale, logit_mult,
            tanh_in)
    # With dropout the loop is always split too (its edge ranges are then empty): as one loop, with the
    # dK/dV dots in flight across iterations and the keep flags changing layout inside it, ptxas
    # serialises every wgmma (C7515; n_wgmma_serialized in tests/gpu_compile_check.py).
    # An empty range is skipped, not entered: the loop divides by the range's block count, and the software
    # pipeliner computes the first iteration's addresses ahead of the trip-count check (a division by zero,
    # then an illegal address on an H200 for non-causal ragged 16-bit inputs, whose first range is empty).
    if CAUSAL or WINDOW or VARLEN or not EVEN_M or DROPOUT:
        if b1 > b0:
            dk, dv = _dkdv_blocks(dk, dv, kb, vb, *args, b0, b1, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                                  DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_M, SOFTCAP, DV,
                                  BLOCK_DV)
        if b2 > b1:
            dk, dv = _dkdv_blocks(dk, dv, kb, vb, *args, b1, b2, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                                  DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_M, SOFTCAP, DV,
                                  BLOCK_DV)
        if b3 > b2:
            dk, dv = _dkdv_blocks(dk, dv, kb, vb, *args, b2, b3, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                                  DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_M, SOFTCAP, DV,
                                  BLOCK_DV)
    elif b3 > b0:
        dk, dv = _dkdv_blocks(dk, dv, kb, vb, *args, b0, b3, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                              DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_M, SOFTCAP, DV,
                                  BLOCK_DV)
    _store_rows(DK + b * sdkb + kvh * sdkh, cols, sdkn, Sk, dims, dk * scale, D, not EVEN_N, EVEN_D)
    if DROPOUT:
        dv = dv * keep_scale
    _store_rows(DV_OUT + b * sdvb + kvh * sdvh, cols, sdvn, Sk, vdims, dv, DV, not EVEN_N, EVEN_DV)


@triton.jit
def _dq_blocks(dq, dsum, q, do, lse2, delta, k_base, v_base, skn, svn, b_lo, b_hi, r0, rows, ds, de, pad_base,
               Sq, Sk, window, k0, k1, bh, t16, keep_scale, logit_mult, tanh_in,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
               HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_N: tl.constexpr,
               SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    EVEN_D: tl.constexpr = BLOCK_D == D
    CHECK: tl.constexpr = MASKED and not EVEN_N
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    for blk in range(b_lo, b_hi):
        start = blk * BLOCK_N
        if DROPOUT:
            cols = key_order(start, BLOCK_N)
        else:
            cols = start + tl.arange(0, BLOCK_N)
        kb = _load_rows(k_base, cols, skn, Sk, dims, D, CHECK, EVEN_D)
        vb = _load_rows(v_base, cols, svn, Sk, vdims, DV, CHECK, BLOCK_DV == DV)
        s, t = _scores(_dot(q, tl.trans(kb), IEEE), logit_mult, tanh_in, SOFTCAP)
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
        if HAS_SINKS:  # the rows' dS sums, for the sinks' gradient (see _delta_kernel)
            dsum += tl.sum(ds_, 1)
        if SOFTCAP:
            ds_ = ds_ * (1.0 - t * t)
        dq += _dot(to_storage(ds_, kb.dtype), kb, IEEE)
    return dq, dsum


@triton.jit(do_not_specialize=["window", "q_offset", "n_docs", "doc_bits", "t16"])
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, PAD, CU, SEED, SINKS, DSINK,
                   sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, sdqb, sdqh, sdqm,
                   H, G, Sq, Sk, window, q_offset, n_docs, doc_bits, scale, logit_mult, tanh_in, t16, keep_scale,
                   D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                   HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                   SOFTCAP: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    EVEN_D: tl.constexpr = BLOCK_D == D
    bh, b, h, kvh, r0, r1, rows = _query_block(Sq, H, G, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b * sqb + h * sqh, rows, sqm, Sq, dims, D, not EVEN_M, EVEN_D)
    do = _load_rows(DO + b * sdb + h * sdh, rows, sdm, Sq, tl.arange(0, BLOCK_DV), DV, not EVEN_M, BLOCK_DV == DV)
    stat = bh.to(tl.int64) * Sq + rows
    if EVEN_M:
        lse2 = tl.load(LSE + stat) * 1.4426950408889634
        delta = tl.load(DELTA + stat)
    else:
        lse2 = tl.load(LSE + stat, mask=rows < Sq, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA + stat, mask=rows < Sq, other=0.0)
    # Masks, block ranges and the dropout rows at the rows' key positions (rows + q_offset).
    k_base, v_base, pad_base, k0, k1, ds, de, b0, b1, b2, b3 = _key_side(
        K, V, PAD, CU, SEED, b, kvh, skb, skh, svb, svh, r0 + q_offset, r1 + q_offset, rows + q_offset, Sq + q_offset,
        Sk, window, n_docs, doc_bits, CAUSAL, WINDOW, VARLEN, HAS_PAD, DROPOUT, BLOCK_N)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dsum = tl.zeros([BLOCK_M], tl.float32)  # with sinks: rowsum of dS (unused and folded away without)
    args = (q, do, lse2, delta, k_base, v_base, skn, svn)
    rest = (r0 + q_offset, rows + q_offset, ds, de, pad_base, Sq, Sk, window, k0, k1, bh, t16, keep_scale, logit_mult,
            tanh_in)
    if CAUSAL or WINDOW or VARLEN or not EVEN_N:
        dq, dsum = _dq_blocks(dq, dsum, *args, b0, b1, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD, DROPOUT, IEEE, D,
                        BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N, SOFTCAP, HAS_SINKS, DV, BLOCK_DV)
        dq, dsum = _dq_blocks(dq, dsum, *args, b1, b2, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD, DROPOUT, IEEE, D,
                        BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N, SOFTCAP, HAS_SINKS, DV, BLOCK_DV)
        dq, dsum = _dq_blocks(dq, dsum, *args, b2, b3, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD, DROPOUT, IEEE, D,
                        BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N, SOFTCAP, HAS_SINKS, DV, BLOCK_DV)
    else:
        dq, dsum = _dq_blocks(dq, dsum, *args, b0, b3, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD, DROPOUT, IEEE, D,
                        BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N, SOFTCAP, HAS_SINKS, DV, BLOCK_DV)
    _store_rows(DQ + b * sdqb + h * sdqh, rows, sdqm, Sq, dims, dq * scale, D, not EVEN_M, EVEN_D)
    if HAS_SINKS:  # this block's share of the sinks' gradient, -sum_i P_sink_i rowsum_j dS_ij (rows past Sq: 0)
        p_sink = tl.exp2(tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634 - lse2)
        tl.store(DSINK + tl.program_id(0), -tl.sum(p_sink * dsum, 0))
