"""Attention forward kernel (online softmax over the key blocks a query block can attend, dropout
in the score tile's layout, +inf logsumexp for empty rows) and the delta = rowsum(dO * O)
pre-pass of backward. Entry points and tiles: triton_kernels/attention.py."""

import triton
import triton.language as tl

from .attention_common import _allowed, _dot, _key_side, _load_rows, _query_block, _scores, _store_rows
from .philox import apply_keep, attention_keep_words, key_order
from .rounding import to_storage

LOG2E = 1.4426950408889634


@triton.jit
def _fwd_blocks(acc, m_i, l_i, q, k_base, v_base, skn, svn, b_lo, b_hi, r0, rows, ds, de, pad_base,
                Sq, Sk, window, k0, k1, bh, t16, keep_scale, logit_mult, tanh_in,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_N: tl.constexpr,
                SOFTCAP: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    EVEN_D: tl.constexpr = BLOCK_D == D
    EVEN_DV: tl.constexpr = BLOCK_DV == DV
    CHECK: tl.constexpr = MASKED and not EVEN_N
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    if DROPOUT:
        offs = key_order(0, BLOCK_N)
    else:
        offs = tl.arange(0, BLOCK_N)
    for blk in range(b_lo, b_hi):
        start = blk * BLOCK_N
        cols = start + offs
        kb = _load_rows(k_base + start.to(tl.int64) * skn, offs, skn, Sk - start, dims, D, CHECK, EVEN_D)
        s, _ = _scores(_dot(q, tl.trans(kb), IEEE), logit_mult, tanh_in, SOFTCAP)
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
        vb = _load_rows(v_base + start.to(tl.int64) * svn, offs, svn, Sk - start, vdims, DV, CHECK, EVEN_DV)
        acc = acc * alpha[:, None] + _dot(to_storage(p, vb.dtype), vb, IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["window", "q_offset", "n_docs", "doc_bits", "t16"])
def _fwd_kernel(Q, K, V, OUT, LSE, PAD, CU, SEED, SINKS, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                H, G, Sq, Sk, window, q_offset, n_docs, doc_bits, logit_mult, tanh_in, t16, keep_scale,
                D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
                HAS_PAD: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                SOFTCAP: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    EVEN_D: tl.constexpr = BLOCK_D == D
    bh, b, h, kvh, r0, r1, rows = _query_block(Sq, H, G, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b * sqb + h * sqh, rows, sqm, Sq, dims, D, not EVEN_M, EVEN_D)
    # Masks, block ranges and the dropout rows at the rows' key positions (rows + q_offset).
    k_base, v_base, pad_base, k0, k1, ds, de, b0, b1, b2, b3 = _key_side(
        K, V, PAD, CU, SEED, b, kvh, skb, skh, svb, svh, r0 + q_offset, r1 + q_offset, rows + q_offset, Sq + q_offset,
        Sk, window, n_docs, doc_bits, CAUSAL, WINDOW, VARLEN, HAS_PAD, DROPOUT, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # o has v's head dim
    args = (q, k_base, v_base, skn, svn)
    rest = (r0 + q_offset, rows + q_offset, ds, de, pad_base, Sq, Sk, window, k0, k1, bh, t16, keep_scale, logit_mult,
            tanh_in)
    if CAUSAL or WINDOW or VARLEN or not EVEN_N:
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, b0, b1, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                                    DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N, SOFTCAP, DV,
                                    BLOCK_DV)
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, b1, b2, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                                    DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N, SOFTCAP, DV,
                                    BLOCK_DV)
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, b2, b3, *rest, True, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                                    DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N, SOFTCAP, DV,
                                    BLOCK_DV)
    else:
        acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, *args, b0, b3, *rest, False, CAUSAL, WINDOW, VARLEN, HAS_PAD,
                                    DROPOUT, IEEE, D, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_N, SOFTCAP, DV,
                                    BLOCK_DV)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if HAS_SINKS:  # the sink's 2^s2 joins the denominator, measured from max(m, s2) (m is finite where l > 0)
        s2 = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        top = tl.where(empty, 0.0, tl.maximum(m_i, s2))
        f = tl.exp2(tl.where(empty, 0.0, m_i) - top)
        l_safe = tl.where(empty, 1.0, l_i * f + tl.exp2(s2 - top))
        inv = f / l_safe
    else:
        top = m_i
        inv = 1.0 / l_safe
    if DROPOUT:
        inv = inv * keep_scale
    o = acc * inv[:, None]
    lse = tl.where(empty, float("inf"), (top + tl.log2(l_safe)) * 0.6931471805599453)
    _store_rows(OUT + b * sob + h * soh, rows, som, Sq, tl.arange(0, BLOCK_DV), o, DV, not EVEN_M, BLOCK_DV == DV)
    lse_ptr = LSE + bh.to(tl.int64) * Sq + rows
    if EVEN_M:
        tl.store(lse_ptr, lse)
    else:
        tl.store(lse_ptr, lse, mask=rows < Sq)


@triton.jit
def _delta_kernel(OUT, DO, DELTA, LSE, SINKS, DSINK, sob, soh, som, sdb, sdh, sdm, H, Sq, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    """delta[b, h, i] = sum_d dO * O in fp32 (equal to sum_j P_ij dP_ij, dropout included). With sinks
    also DSINK[program] = -sum over its rows of P_sink (1 - P_sink) delta, P_sink = exp(s_h - lse): the
    delta part of the sinks' gradient -sum_i P_sink_i D_i, D_i taken as rowsum_j dS_ij + delta_i (1 - P_sink_i)
    (the dQ kernel adds the dS part), since delta from O rounded to the input dtype is D only to that
    rounding. Empty rows (lse = +inf) add 0."""
    n_m = tl.cdiv(Sq, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_m
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = (pid % n_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    o = _load_rows(OUT + b * sob + h * soh, rows, som, Sq, dims, D, True, BLOCK_D == D).to(tl.float32)
    do = _load_rows(DO + b * sdb + h * sdh, rows, sdm, Sq, dims, D, True, BLOCK_D == D).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(DELTA + bh.to(tl.int64) * Sq + rows, delta, mask=rows < Sq)
    if HAS_SINKS:
        lse = tl.load(LSE + bh.to(tl.int64) * Sq + rows, mask=rows < Sq, other=float("inf"))
        p_sink = tl.exp(tl.load(SINKS + h).to(tl.float32) - lse)
        tl.store(DSINK + pid, -tl.sum(tl.where(rows < Sq, p_sink * (1.0 - p_sink) * delta, 0.0), 0))
