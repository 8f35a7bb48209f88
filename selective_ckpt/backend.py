"""The one place that picks the C++ or the Triton kernels for a tensor and adapts the call.

Op code (selective_ckpt/ops/) calls `call(family, fn, *args)` and never branches on the backend:

- Triton (CUDA tensors, or CPU tensors with SELECTIVE_CKPT_BACKEND=triton and TRITON_INTERPRET=1):
  `selective_ckpt.triton_kernels.<family>.<fn>(*args)`, tensors as they are.
- C++ (CPU tensors): `_C.<family>_<fn>(dtype code of the first tensor, *args)` with every tensor
  replaced by its data pointer and None by 0, unless the family registers an adapter below
  (`_CPP_ADAPTERS`) for calls that need shapes, strides or a different split of the work.

FAMILIES is the table of kernel families: a family is csrc/<family>.cpp, triton_kernels/<family>.py,
selective_ckpt/ops/<family>.py and tests/ops/test_<family>.py, and one entry here.
"""

import importlib
import os

import torch

from ._extension import load as _load_extension

_C = _load_extension()

FAMILIES = ("dropout", "layer_norm", "gelu", "attention")

BACKEND_ENV = "SELECTIVE_CKPT_BACKEND"
_CHOICES = ("auto", "cpp", "triton")

# Element type codes shared with csrc/dtypes.h.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def backend_for(t: torch.Tensor) -> str:
    """'cpp' or 'triton' for tensor t: CUDA -> Triton, CPU -> C++ unless SELECTIVE_CKPT_BACKEND=triton."""
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{BACKEND_ENV} must be one of {', '.join(_CHOICES)}, got {choice!r}")
    if t.device.type == "cuda":
        if choice == "cpp":
            raise ValueError(f"{BACKEND_ENV}=cpp cannot run CUDA tensors; unset it or use 'triton'")
        return "triton"
    if t.device.type != "cpu":
        raise ValueError(f"selective_ckpt runs on CPU and CUDA tensors, got device {t.device}")
    return "triton" if choice == "triton" else "cpp"


def _triton_module(family):
    return importlib.import_module(f"{__package__}.triton_kernels.{family}")


def _pointer(a):
    if isinstance(a, torch.Tensor):
        return a.data_ptr()
    return 0 if a is None else a


def _first_tensor(args):
    return next(a for a in args if isinstance(a, torch.Tensor))


def call(family: str, fn: str, *args):
    """Runs kernel `fn` of `family` on the backend of its first tensor argument."""
    like = _first_tensor(args)
    if backend_for(like) == "triton":
        return getattr(_triton_module(family), fn)(*args)
    adapter = _CPP_ADAPTERS.get((family, fn))
    if adapter is not None:
        return adapter(*args)
    return getattr(_C, f"{family}_{fn}")(DTYPE_CODES[like.dtype], *map(_pointer, args))


# ---------------------------------------------------------------------------------------------
# C++ adapters

# Score elements (heads x query rows x keys) one CPU attention chunk may hold; the chunk's two
# score-sized temporaries are the only memory that grows with Sk. Chunks of this size (2 MiB in
# fp32) ran as fast as whole-sequence ones in bench/attention.py, with less memory.
ATTENTION_CHUNK_ELEMS = 1 << 19
# Causal chunks are cut finer: a chunk's products stop at its last row's diagonal, so n chunks do
# (n + 1) / 2n of the full matmul work.
ATTENTION_CAUSAL_CHUNKS = 8
ATTENTION_MIN_CHUNK_ROWS = 64


def attention_chunk_rows(H, Sq, Sk, causal=False):
    rows = max(1, min(Sq, ATTENTION_CHUNK_ELEMS // max(1, H * Sk)))
    if causal:
        rows = min(rows, max(ATTENTION_MIN_CHUNK_ROWS, -(-Sq // ATTENTION_CAUSAL_CHUNKS)))
    return rows


def _bmm_into(dst, a, b):
    """dst = a @ b (batched); bmm's out= is slow on strided outputs, so those get a copy."""
    if dst.is_contiguous():
        torch.bmm(a, b, out=dst)
    else:
        dst.copy_(torch.bmm(a, b))


def _check_attention_supported(cu_seqlens, window, q, k):
    if cu_seqlens is not None or window or k.shape[1] != q.shape[1]:
        raise NotImplementedError("the C++ attention kernels take neither cu_seqlens, windows nor grouped k/v")


def _cpp_attention_forward(q, k, v, o, lse, mask, cu_seqlens, causal, window, scale, seed, t16, ks):
    """Query chunks: S = Q K^T by torch matmul, the C++ row kernel (mask, softmax, dropout), O = P V."""
    _check_attention_supported(cu_seqlens, window, q, k)
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    rows = attention_chunk_rows(H, Sq, Sk, causal)
    code = DTYPE_CODES[q.dtype]
    for b in range(B):
        pad = _pointer(None if mask is None else mask[b])
        for r0 in range(0, Sq, rows):
            r1 = min(Sq, r0 + rows)
            kc = min(Sk, r1) if causal else Sk  # keys past the chunk's last row are all masked
            s = torch.bmm(q[b, :, r0:r1], k[b, :, :kc].transpose(1, 2))
            _C.attention_softmax_fwd(code, s.data_ptr(), lse[b, :, r0].data_ptr(), H, r1 - r0, kc, r0, b * H, Sq,
                                     scale, causal, pad, _pointer(seed), t16, ks)
            _bmm_into(o[b, :, r0:r1], s, v[b, :, :kc])


def _cpp_attention_backward(do, q, k, v, o, lse, mask, cu_seqlens, causal, window, scale, seed, t16, ks, dq, dk, dv):
    """The forward's chunks again: the row kernel turns S, dP into P and dS (delta from each row)."""
    _check_attention_supported(cu_seqlens, window, q, k)
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    rows = attention_chunk_rows(H, Sq, Sk, causal)
    code = DTYPE_CODES[q.dtype]
    single = rows >= Sq
    # Several chunks add into dK, dV: in fp32 for 16-bit inputs so the sum is rounded once.
    acc_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) and not single else q.dtype
    for b in range(B):
        pad = _pointer(None if mask is None else mask[b])
        if single:
            dk_acc, dv_acc = dk[b], dv[b]
        else:
            dk_acc = torch.zeros(dk.shape[1:], dtype=acc_dtype, device=dk.device)
            dv_acc = torch.zeros(dv.shape[1:], dtype=acc_dtype, device=dv.device)
        for r0 in range(0, Sq, rows):
            r1 = min(Sq, r0 + rows)
            kc = min(Sk, r1) if causal else Sk
            qc, doc, kb, vb = q[b, :, r0:r1], do[b, :, r0:r1], k[b, :, :kc], v[b, :, :kc]
            s = torch.bmm(qc, kb.transpose(1, 2))
            dp = torch.bmm(doc, vb.transpose(1, 2))
            _C.attention_softmax_bwd(code, s.data_ptr(), dp.data_ptr(), lse[b, :, r0].data_ptr(), H, r1 - r0, kc, r0,
                                     b * H, Sq, scale, causal, pad, _pointer(seed), t16, ks)
            # s now holds the dropped P, dp the gradient of the raw scores.
            _bmm_into(dq[b, :, r0:r1], dp, kb)
            if single:
                _bmm_into(dv_acc[:, :kc], s.transpose(1, 2), doc)
                _bmm_into(dk_acc[:, :kc], dp.transpose(1, 2), qc)
                if kc < Sk:
                    dv_acc[:, kc:].zero_()
                    dk_acc[:, kc:].zero_()
            else:
                dv_acc[:, :kc] += torch.bmm(s.transpose(1, 2), doc)
                dk_acc[:, :kc] += torch.bmm(dp.transpose(1, 2), qc)
        if not single:
            dk[b].copy_(dk_acc)
            dv[b].copy_(dv_acc)


_CPP_ADAPTERS = {
    ("attention", "forward"): _cpp_attention_forward,
    ("attention", "backward"): _cpp_attention_backward,
}
