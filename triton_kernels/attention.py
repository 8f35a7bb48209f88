"""Flash-style attention with fused softmax and dropout (GPU path; also runs interpreted on CPU).

This file holds the entry points and the tile table; the kernels are in attention_forward.py
(forward, delta pre-pass), attention_backward.py (dK/dV, dQ) and attention_common.py (helpers).

Entry points and semantics: the attention kernel contract shared with the C++ backend
(docs/kernels/attention.md; forward/backward argument lists as selective_ckpt/ops/attention.py calls them).

Soft-capping (softcap = c > 0, Gemma 2) makes the logits c * tanh(scale * q.k / c) before any mask;
the backward kernels rebuild t = tanh(...) with P and multiply dS by 1 - t^2.

Forward: online softmax over key blocks in base 2 (scale * log2(e) folded into the logits), dropout
on P after the row statistics, o normalised at the end, natural-log logsumexp stored (+inf for an
empty row, so backward's exp(s - lse) is 0 there). Backward: a delta = rowsum(dO * O) pre-pass,
one program per (key block, kv head) for dK/dV that loops over the query heads of its group (so
GQA needs no atomics and no expanded k, v), and one per query block for dQ.

Each program first works out which key (or query) blocks can matter at all: causal, sliding
window and per-document (cu_seqlens) limits are turned into a block range, so work grows with the
attended area only. Inside that range the blocks that every row attends completely are run
without any masking; only the blocks at the edges (diagonal, window edge, document edges, ragged
last block) pay for the element masks. With q_offset, query row i stands at key position
i + q_offset: every mask, block range and dropout row is computed at that position. The dropout mask is a function of (seed, b*H + h, i, j)
only, so tilings may differ between kernels and the results are deterministic.
"""

import torch
import triton

from .attention_backward import _bwd_dkdv_kernel, _bwd_dq_kernel
from .attention_forward import LOG2E, _delta_kernel, _fwd_kernel
from .rounding import INTERPRETED

# ---------------------------------------------------------------------------------------------
# Tiles. Small ones in the interpreter (its cost grows with tile area). On sm_90 a fixed table per
# (kernel, head dim, element size, causal, dropout), chosen from compile metadata (registers,
# spills, shared memory: tests/gpu_compile_check.py --json) so that no 16-bit configuration
# spills; no run-time autotuning. Values: (BLOCK_M, BLOCK_N, num_warps, num_stages).
INTERPRETER_BLOCKS = (16, 16)


def _tiles(kernel, block_d, wide, dropout, lean, softcap, documents=False):
    # Measured (tests/gpu_compile_check.py): dropout's Philox adds registers, so dK/dV's dropout
    # variants take 32-row (D <= 64) or 16-row query blocks; only lean launches (one query head per
    # kv head, no window, no documents, whole 64-row blocks) keep the plain tile, which spilled with
    # the extra masking state of the others. Soft-capping's tanh tile, live until dS, spilled the plain
    # D <= 64 tile and the lean D = 128 dropout tile: capped launches take the small tiles there. The
    # forward takes 8 warps (with 4 the D=64 causal and document variants spilled). D = 256 (Gemma):
    # dK/dV's 64-key tiles spilled 70-200 instructions with or without dropout, 32 x 32 none; dQ with
    # dropout spilled at 64 x 32 and not at 64 x 16. fp32 uses IEEE dots, which Hopper runs on FMA
    # units with whole operand rows per thread: only small tiles stay out of local memory there. Packed documents at
    # D > 128 (MLA's 192 in 256-wide blocks): the forward with dropout spilled 243 at 64 x 32, dQ 2 and with
    # dropout 219: both take 32-row blocks there.
    if wide:
        return (16, 32, 4, 1) if kernel == "dkdv" else (16, 16, 4, 1)
    if kernel == "fwd":
        if block_d <= 128:
            return (128, 64, 8, 3)
        return (32, 32, 4, 2) if documents and dropout else (64, 32, 8, 2)
    if kernel == "dq":
        if block_d <= 64:
            return (128, 64, 8, 3)
        if block_d <= 128:
            return (128, 32, 8, 2)
        if documents:
            return (32, 16, 4, 2)
        return (64, 16, 8, 2) if dropout else (64, 32, 8, 2)
    # dkdv: a tall key block (two fp32 accumulators) resident, query blocks streamed
    small = dropout and not lean or softcap and (dropout or block_d <= 64)
    if block_d <= 64:
        return (32, 128, 8, 3) if small else (64, 128, 8, 3)
    if block_d <= 128:
        return (16, 128, 8, 2) if small else (32, 128, 8, 2)
    return (32, 32, 8, 2)


def _block_d(D):
    return max(16, triton.next_power_of_2(D))


def config(kernel, D, dtype, dropout=False, lean=False, softcap=False, documents=False):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) of one kernel; lean and documents: see _tiles."""
    block_d = _block_d(D)
    if INTERPRETED:
        return INTERPRETER_BLOCKS + (block_d, 4, 1)
    bm, bn, warps, stages = _tiles(kernel, block_d, dtype.itemsize == 4, dropout, lean, softcap, documents)
    return bm, bn, block_d, warps, stages


def _s3(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _logit_factors(scale, softcap):
    """(logit_mult, tanh_in) of attention_common._scores: scale * log2(e) and unused, or with a cap c
    c * log2(e) and scale / c."""
    if softcap:
        return softcap * LOG2E, scale / softcap
    return scale * LOG2E, 0.0


def _flags(q, k, v, Sq, Sk, causal, window, pad, cu_seqlens, softcap, t16, kernel):
    lean = q.shape[1] == k.shape[1] and window == 0 and cu_seqlens is None and Sq % 64 == 0
    D, Dv = q.shape[3], v.shape[3]
    # tiles by the wider head dim (a value head narrower than q's, as MLA's, runs in the tiles of q's)
    bm, bn, _, warps, stages = config(kernel, max(D, Dv), q.dtype, t16 > 0, lean, bool(softcap),
                                      cu_seqlens is not None)
    return dict(D=D, DV=Dv, BLOCK_D=_block_d(D), BLOCK_DV=_block_d(Dv), CAUSAL=bool(causal), WINDOW=window > 0, VARLEN=cu_seqlens is not None,
                HAS_PAD=pad is not None, DROPOUT=t16 > 0, SOFTCAP=bool(softcap), IEEE=q.dtype.itemsize == 4,
                BLOCK_M=bm, BLOCK_N=bn, EVEN_M=Sq % bm == 0, EVEN_N=Sk % bn == 0, num_warps=warps,
                num_stages=stages)


def _common(q, k, key_padding_mask, cu_seqlens, window, seed, t16, q_offset):
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {Hkv}")
    if q_offset < 0 or (q_offset > 0 and q_offset + Sq > Sk):
        raise ValueError(f"q_offset must be >= 0 with q_offset + Sq <= Sk, got q_offset={q_offset}, Sq={Sq}, Sk={Sk}")
    pad = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else None
    n_docs = cu_seqlens.numel() - 1 if cu_seqlens is not None else 0
    if cu_seqlens is not None and (B != 1 or (q_offset == 0 and Sq != Sk)):
        raise ValueError("cu_seqlens needs B == 1 and Sq == Sk (Sq + q_offset <= Sk with an offset)")
    seed = seed if t16 > 0 else None  # dropout off: the seed is never read
    return B, H, Hkv, Sq, Sk, pad, n_docs, max(n_docs, 1).bit_length(), int(window), seed


def forward(q, k, v, o, lse, key_padding_mask, cu_seqlens, causal, window, scale, softcap, seed, t16, keep_scale,
            q_offset=0, sinks=None):
    """o [B, H, Sq, D] (any strides, last dim contiguous), lse fp32 [B, H, Sq] contiguous. Query row i
    stands at key position i + q_offset (masks and the dropout stream's row). sinks: fp32 [H] or None;
    with them lse includes the sink's logit."""
    B, H, Hkv, Sq, Sk, pad, n_docs, doc_bits, window, seed = _common(q, k, key_padding_mask, cu_seqlens, window,
                                                                    seed, t16, q_offset)
    if B * H * Sq == 0:
        return
    f = _flags(q, k, v, Sq, Sk, causal, window, pad, cu_seqlens, softcap, t16, "fwd")
    grid = (triton.cdiv(Sq, f["BLOCK_M"]) * B * H,)
    _fwd_kernel[grid](q, k, v, o, lse, pad, cu_seqlens, seed, sinks, *_s3(q), *_s3(k), *_s3(v), *_s3(o),
                      H, H // Hkv, Sq, Sk, window, q_offset, n_docs, doc_bits, *_logit_factors(scale, softcap),
                      t16, float(keep_scale), HAS_SINKS=sinks is not None, **f)


def delta(o, do, out, lse=None, sinks=None):
    """out [B, H, Sq] fp32 contiguous = rowsum(dO * O) in fp32. With sinks (fp32 [H]) and the forward's
    lse, returns the delta part of the sinks' gradient per program, [B, H, query blocks] (else None)."""
    B, H, Sq, D = o.shape
    block_d = _block_d(D)
    bm = 16 if INTERPRETED else max(1, min(128, 8192 // block_d))
    n_m = triton.cdiv(Sq, bm)
    part = None if sinks is None else torch.empty(B, H, n_m, dtype=torch.float32, device=o.device)
    _delta_kernel[(n_m * B * H,)](o, do, out, lse, sinks, part, *_s3(o), *_s3(do), H, Sq, D=D, BLOCK_M=bm,
                                  BLOCK_D=block_d, HAS_SINKS=sinks is not None, num_warps=4)
    return part


def backward(do, q, k, v, o, lse, key_padding_mask, cu_seqlens, causal, window, scale, softcap, seed, t16, keep_scale,
             dq, dk, dv, q_offset=0, sinks=None, dsinks=None):
    """dq, dk, dv: outputs shaped like q, k, v (any strides with the last dim contiguous); with sinks
    (fp32 [H]) also dsinks (fp32 [H]). P is rebuilt from lse, which includes the sinks: dS is as without."""
    B, H, Sq = q.shape[:3]
    if B * H == 0:
        return
    if Sq == 0 or k.shape[2] == 0:  # nothing attends: zero gradients
        for t in (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks):
            t.zero_()
        return
    dl = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    delta_part = delta(o, do, dl, lse, sinks)
    args = (do, q, k, v, lse, dl, key_padding_mask, cu_seqlens, causal, window, scale, softcap, seed, t16, keep_scale)
    backward_dkdv(*args, dk, dv, q_offset)
    dq_part = backward_dq(*args, dq, q_offset, sinks)
    if sinks is not None:  # the per-program shares summed in a fixed order (no atomics)
        torch.add(delta_part.sum((0, 2)), dq_part.sum((0, 2)), out=dsinks)


def _bwd_args(q, k, v, key_padding_mask, cu_seqlens, causal, window, scale, softcap, seed, t16, keep_scale, kernel,
              q_offset):
    B, H, Hkv, Sq, Sk, pad, n_docs, doc_bits, window, seed = _common(q, k, key_padding_mask, cu_seqlens, window,
                                                                    seed, t16, q_offset)
    tail = (H, H // Hkv, Sq, Sk, window, q_offset, n_docs, doc_bits, scale, *_logit_factors(scale, softcap), t16,
            float(keep_scale))
    f = _flags(q, k, v, Sq, Sk, causal, window, pad, cu_seqlens, softcap, t16, kernel)
    return B, H, Hkv, Sq, Sk, pad, seed, tail, f


def backward_dkdv(do, q, k, v, lse, dl, key_padding_mask, cu_seqlens, causal, window, scale, softcap, seed, t16,
                  keep_scale, dk, dv, q_offset=0):
    """dK, dV (reduced over each kv head's query group) given delta dl [B, H, Sq] fp32."""
    B, H, Hkv, Sq, Sk, pad, seed, tail, f = _bwd_args(q, k, v, key_padding_mask, cu_seqlens, causal, window, scale,
                                                      softcap, seed, t16, keep_scale, "dkdv", q_offset)
    _bwd_dkdv_kernel[(triton.cdiv(Sk, f["BLOCK_N"]) * B * Hkv,)](
        q, k, v, do, lse, dl, dk, dv, pad, cu_seqlens, seed, *_s3(q), *_s3(k), *_s3(v), *_s3(do), *_s3(dk),
        *_s3(dv), *tail, **f)


def backward_dq(do, q, k, v, lse, dl, key_padding_mask, cu_seqlens, causal, window, scale, softcap, seed, t16,
                keep_scale, dq, q_offset=0, sinks=None):
    """dQ given delta dl [B, H, Sq] fp32. With sinks (fp32 [H]) returns the dS part of their gradient per
    program, [B, H, query blocks] (else None)."""
    B, H, Hkv, Sq, Sk, pad, seed, tail, f = _bwd_args(q, k, v, key_padding_mask, cu_seqlens, causal, window, scale,
                                                      softcap, seed, t16, keep_scale, "dq", q_offset)
    n_m = triton.cdiv(Sq, f["BLOCK_M"])
    part = None if sinks is None else torch.empty(B, H, n_m, dtype=torch.float32, device=q.device)
    _bwd_dq_kernel[(n_m * B * H,)](
        q, k, v, do, lse, dl, dq, pad, cu_seqlens, seed, sinks, part, *_s3(q), *_s3(k), *_s3(v), *_s3(do), *_s3(dq),
        *tail, HAS_SINKS=sinks is not None, **f)
    return part
