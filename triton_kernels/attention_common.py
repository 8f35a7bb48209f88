"""Device helpers shared by the attention kernels (triton_kernels/attention_forward.py and
attention_backward.py): fp32-accumulating dots, row loads and stores with the head-dim and length
masks a tile needs, document bounds from cu_seqlens, the attend test of one (row, key) pair, the
block ranges (masked edges, unmasked interior) a program visits, and the setup of a program that
owns one query block (forward, dQ)."""

import triton
import triton.language as tl

from .philox import load_key
from .rounding import INTERPRETED, to_storage


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
def _tanh(x):
    """tanh in float32, written out (the interpreter has no libdevice): csrc/fastmath.h's fast_tanhf,
    an odd polynomial below 0.625 and 1 - 2 / (e^(2|x|) + 1) above, so nothing cancels near 0."""
    ax = tl.abs(x)
    x2 = ax * ax
    p = -0.005709210581664607 * x2 + 0.0206414560233341
    p = p * x2 - 0.05373953800949115
    p = p * x2 + 0.13331413546093598
    p = p * x2 - 0.33333277349394497
    p = p * x2 + 0.9999999982827782
    r = tl.where(ax < 0.625, ax * p, 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0))
    return tl.where(x < 0, -r, r)


@triton.jit
def _scores(qk, logit_mult, tanh_in, SOFTCAP: tl.constexpr):
    """Base-2 logits of a tile of score products q.k, and with SOFTCAP the tanh they went through
    (backward's 1 - t^2). Plain: qk * scale * log2(e), logit_mult being scale * log2(e). Capped at c:
    c * tanh(qk * scale / c) * log2(e), logit_mult being c * log2(e) and tanh_in scale / c."""
    if SOFTCAP:
        t = _tanh(qk * tanh_in)
        return t * logit_mult, t
    else:
        return qk * logit_mult, qk


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
def _query_block(Sq, H, G, BLOCK_M: tl.constexpr):
    """The query block of this program: (b * H + h, b, h, kv head, first row, last real row, rows).
    A head's blocks run from the last, so the longest causal rows start first."""
    n_m = tl.cdiv(Sq, BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // n_m
    r0 = (n_m - 1 - pid % n_m) * BLOCK_M
    h = bh % H
    return (bh, (bh // H).to(tl.int64), h.to(tl.int64), (h // G).to(tl.int64), r0, tl.minimum(r0 + BLOCK_M, Sq) - 1,
            r0 + tl.arange(0, BLOCK_M))


@triton.jit
def _key_side(K, V, PAD, CU, SEED, b, kvh, skb, skh, svb, svh, r0, r1, rows, Sq, Sk, window, n_docs, doc_bits,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, HAS_PAD: tl.constexpr,
              DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """What a query block needs of the keys: k and v of its kv head, its key padding row, the Philox
    key, its rows' document bounds and the key block ranges (masked, unmasked, masked) it visits."""
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
    return K + b * skb + kvh * skh, V + b * svb + kvh * svh, pad_base, k0, k1, ds, de, b0, b1, b2, b3
