"""Cross-entropy over the rows of a chunk of logits [rows, V], one row per program (the kernel of
selective_ckpt/ops/cross_entropy.py; csrc/cross_entropy.cpp is the same contract on CPU).

Per row: lse = log sum_j exp(c_j) with c = softcap * tanh(z / softcap) (or c = z), the loss
lse - (1 - eps) c_y - (eps / V) sum_j c_j and, with WRITE_GRAD, the gradient
g * (softmax(c)_j - eps / V - (1 - eps) [j == y]) * (1 - (c_j / softcap)^2) stored over the logits in
their dtype. A first sweep over the row keeps a running max and sum per lane (online softmax), a
second writes the gradient. Rows whose label is ignore_index get loss 0, lse 0 and a zero gradient.
Compute is float32 (float64 for float64 logits).
"""

import triton
import triton.language as tl

from .rounding import to_compute, to_storage


@triton.jit
def _capped(z, cap, CAP: tl.constexpr):
    if CAP:
        # tanh as 2 sigmoid(2x) - 1: libdevice's tanh does not run under the interpreter.
        return cap * (2.0 * tl.sigmoid(2.0 * z / cap) - 1.0)
    else:
        return z


@triton.jit
def _rows_kernel(z_ptr, row_stride, labels_ptr, scale_ptr, scale_stride, lse_ptr, loss_ptr, V, ignore_index, eps,
                 cap, WRITE_GRAD: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * row_stride
    acc_ty = lse_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    y = tl.load(labels_ptr + row)
    if y == ignore_index:
        tl.store(lse_ptr + row, 0.0)
        tl.store(loss_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, V, BLOCK):
                cols = start + offs
                tl.store(base + cols, to_storage(tl.zeros([BLOCK], acc_ty), z_ptr.dtype.element_ty), mask=cols < V)
    else:
        m = tl.full([BLOCK], float("-inf"), acc_ty)
        s = tl.zeros([BLOCK], acc_ty)
        sc = tl.zeros([BLOCK], acc_ty)
        for start in range(0, V, BLOCK):
            cols = start + offs
            live = cols < V
            c = _capped(to_compute(tl.load(base + cols, mask=live, other=0.0)), cap, CAP)
            m_new = tl.where(live, tl.maximum(m, c), m)
            stuck = m_new == float("-inf")  # nothing but -inf so far in this lane
            top = tl.where(stuck, 0.0, m_new)
            alpha = tl.exp(tl.where(stuck, 0.0, m) - top)
            term = tl.where(live & ~stuck, tl.exp(tl.where(stuck, 0.0, c) - top), 0.0)
            s = s * alpha + term
            sc += tl.where(live, c, 0.0)
            m = m_new
        mx = tl.max(m, axis=0)
        empty = m == float("-inf")
        total = tl.sum(tl.where(empty, 0.0, s * tl.exp(tl.where(empty, mx, m) - mx)), axis=0)
        sum_c = tl.sum(sc, axis=0)
        lse = mx + tl.log(total)
        lse = tl.where(sum_c != sum_c, sum_c, lse)  # a NaN logit makes the row NaN
        c_y = _capped(to_compute(tl.load(base + y)), cap, CAP)
        loss = lse - (1.0 - eps) * c_y
        if eps != 0.0:  # (0 * -inf would be NaN for a row holding a -inf logit)
            loss -= eps / V * sum_c
        tl.store(lse_ptr + row, lse.to(acc_ty))
        tl.store(loss_ptr + row, loss.to(acc_ty))
        if WRITE_GRAD:
            g = tl.load(scale_ptr + row * scale_stride).to(acc_ty)
            floor = eps / V
            for start in range(0, V, BLOCK):
                cols = start + offs
                live = cols < V
                c = _capped(to_compute(tl.load(base + cols, mask=live, other=0.0)), cap, CAP)
                d = tl.exp(c - lse) - floor - tl.where(cols == y, 1.0 - eps, 0.0)
                if CAP:
                    t = c / cap
                    d = d * (1.0 - t * t)
                tl.store(base + cols, to_storage(g * d, z_ptr.dtype.element_ty), mask=live)


def rows(logits, row_stride, labels, scale, scale_stride, lse, loss, n_rows, vocab, ignore_index, label_smoothing,
         softcap, write_grad):
    """Writes lse and loss [n_rows] and, with write_grad, the scaled gradient over logits."""
    block = min(triton.next_power_of_2(max(vocab, 16)), 4096)
    _rows_kernel[(n_rows,)](logits, row_stride, labels, scale, scale_stride, lse, loss, vocab, ignore_index,
                            label_smoothing, softcap if softcap else 1.0, WRITE_GRAD=bool(write_grad),
                            CAP=bool(softcap), BLOCK=block, num_warps=min(16, max(1, block // 256)))
