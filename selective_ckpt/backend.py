"""The one place that picks the C++ or the Triton kernels for a tensor and adapts the call.

Op code (selective_ckpt/ops/) calls `call(op_family, fn, *args)` and never branches on the backend:

- Triton (CUDA tensors, or CPU tensors with SELECTIVE_CKPT_BACKEND=triton and TRITON_INTERPRET=1):
  `selective_ckpt.triton_kernels.<op_family>.<fn>(*args)`, tensors as they are.
- C++ (CPU tensors): `_C.<op_family>_<fn>(dtype code of the first tensor, *args)` with every tensor
  replaced by its data pointer and None by 0, unless the op family registers an adapter below
  (`_CPP_ADAPTERS`) for calls that need shapes, strides or a different split of the work.

Attention has one more choice, per call: PyTorch's fused kernels run the calls they express exactly
(ops/attention_dispatch.py); SELECTIVE_CKPT_ATTENTION (or `set_attention_backend`) says which may:
"auto" (the fastest measured), "ours", "sdpa" (PyTorch's wherever it expresses the call), or one PyTorch kernel.

An op family is csrc/<op_family>.cpp, triton_kernels/<op_family>.py, selective_ckpt/ops/<op_family>.py
and tests/ops/test_<op_family>.py; its name is the first argument of `call`.
"""

import importlib
import os

import torch

from ._extension import load as _load_extension

_C = _load_extension()

BACKEND_ENV = "SELECTIVE_CKPT_BACKEND"
_CHOICES = ("auto", "cpp", "triton")

# Element type codes shared with csrc/dtypes.h.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


_choice = [None, None]  # (the variable's value as last read, the choice it gave): read once, parsed again on change


# The process environment as os.environ keeps it: on CPython a plain dict of encoded names and values, read directly
# (the backend is asked at every kernel call, and os.environ's mapping methods, which encode the name, look it up and
# decode the value, cost about a microsecond there); elsewhere os.environ itself. Values are compared as stored.
_ENVIRON = getattr(os.environ, "_data", None)
if type(_ENVIRON) is not dict or not hasattr(os.environ, "encodekey") or not hasattr(os.environ, "decodevalue"):
    _ENVIRON = os.environ


def _environ_key(name):
    return name if _ENVIRON is os.environ else os.environ.encodekey(name)


def _environ_text(raw):
    return raw if raw is None or isinstance(raw, str) else os.environ.decodevalue(raw)


_BACKEND_KEY = _environ_key(BACKEND_ENV)


def _backend_choice():
    raw = _ENVIRON.get(_BACKEND_KEY)
    if raw == _choice[0] and _choice[1] is not None:  # the value the choice was parsed from
        return _choice[1]
    choice = (_environ_text(raw) or "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{BACKEND_ENV} must be one of {', '.join(_CHOICES)}, got {choice!r}")
    _choice[:] = raw, choice
    return choice


ATTENTION_ENV = "SELECTIVE_CKPT_ATTENTION"
ATTENTION_CHOICES = ("auto", "ours", "sdpa", "sdpa_cpu_flash", "sdpa_flash", "sdpa_efficient")
_attention = [None, None]  # as _choice, for ATTENTION_ENV
_ATTENTION_KEY = _environ_key(ATTENTION_ENV)


def _parse_attention(value, name):
    choice = (value or "auto").strip().lower() or "auto"
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"{name} must be one of {', '.join(ATTENTION_CHOICES)}, got {value!r}")
    return choice


def attention_setting() -> str:
    """Which attention kernels calls may run (ATTENTION_CHOICES): read once, parsed again on change."""
    raw = _ENVIRON.get(_ATTENTION_KEY)
    if raw == _attention[0] and _attention[1] is not None:
        return _attention[1]
    choice = _parse_attention(_environ_text(raw), ATTENTION_ENV)
    _attention[:] = raw, choice
    return choice


def set_attention_backend(name: str = "auto") -> None:
    """Sets SELECTIVE_CKPT_ATTENTION for this process: "auto" (per call, the fastest measured on the device),
    "ours" (always our kernels), "sdpa" (PyTorch's fused attention wherever it expresses the call exactly, ours
    for the rest: dropout, soft-capping, masks it cannot express), or one PyTorch kernel ("sdpa_cpu_flash",
    "sdpa_flash", "sdpa_efficient") where it expresses the call. Calls made after it follow it."""
    if not isinstance(name, str):
        raise TypeError(f"set_attention_backend's name must be a str, got {type(name).__name__}")
    os.environ[ATTENTION_ENV] = _parse_attention(name, "set_attention_backend's name")


def backend_for(t: torch.Tensor) -> str:
    """'cpp' or 'triton' for tensor t: CUDA -> Triton, CPU -> C++ unless SELECTIVE_CKPT_BACKEND=triton."""
    choice = _backend_choice()
    device = t.device.type
    if device == "cpu":
        return "triton" if choice == "triton" else "cpp"
    if device == "cuda":
        if choice == "cpp":
            raise ValueError(f"{BACKEND_ENV}=cpp cannot run CUDA tensors; unset it or use 'triton'")
        return "triton"
    raise ValueError(f"selective_ckpt runs on CPU and CUDA tensors, got device {t.device}")


TRITON_MISSING = ("the Triton backend (CUDA tensors, or CPU tensors with SELECTIVE_CKPT_BACKEND=triton) needs "
                  "the triton package, which is not installed: pip install 'selective_ckpt[triton]'")


def _triton_module(op_family):
    # Triton is an optional dependency: it is imported here, on first use, never when the package loads.
    try:
        return importlib.import_module(f"{__package__}.triton_kernels.{op_family}")
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != "triton":
            raise
        raise ImportError(TRITON_MISSING) from err


def _pointer(a):
    if isinstance(a, torch.Tensor):
        return a.data_ptr()
    return 0 if a is None else a


def _first_tensor(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    raise TypeError("backend.call needs a tensor argument")


_cpp_kernels = {}  # (op family, fn) -> (its C++ adapter, None) or (None, _C.<op_family>_<fn>)


def call(op_family: str, fn: str, *args):
    """Runs kernel `fn` of `op_family` on the backend of its first tensor argument."""
    like = args[0] if args and isinstance(args[0], torch.Tensor) else _first_tensor(args)
    # else C++: backend_for's rule, its fast path (the variable unset: "auto", nothing to parse)
    if not like.is_cpu or (_ENVIRON.get(_BACKEND_KEY) is not None and _backend_choice() == "triton"):
        if backend_for(like) == "triton":
            return getattr(_triton_module(op_family), fn)(*args)
    key = (op_family, fn)
    entry = _cpp_kernels.get(key)
    if entry is None:
        adapter = _CPP_ADAPTERS.get(key)
        entry = _cpp_kernels[key] = (adapter, None if adapter is not None else getattr(_C, f"{op_family}_{fn}"))
    adapter, kernel = entry
    if adapter is not None:
        return adapter(*args)
    return kernel(DTYPE_CODES[like.dtype],
                  *[a.data_ptr() if isinstance(a, torch.Tensor) else 0 if a is None else a for a in args])


def cpu_label_count(labels, vocab, ignore_index):
    """Contiguous int64 CPU labels, in one C++ pass: how many count (are not ignore_index) when each is in [0, vocab) or
    ignore_index, else -(1 + the position of the first that is neither). A host check, the same on any backend."""
    return _C.cross_entropy_labels(labels.data_ptr(), labels.numel(), vocab, ignore_index)


# ---------------------------------------------------------------------------------------------
# C++ adapters

def _cpp_attention_problem(q, k, v, mask, cu_seqlens, causal, window, scale, softcap, seed, t16, ks):
    """The arguments both C++ attention kernels share after the tensors and their strides, in the kernels'
    order (key_padding_mask ... keep_scale), and the sizes (v's head dim may differ from q and k's). Passed by
    position: pybind matches a keyword call's names one by one, a few microseconds a call."""
    B, H, Sq, D = q.shape
    n_docs = 0 if cu_seqlens is None else cu_seqlens.numel() - 1
    return ((B, H, k.shape[1], Sq, k.shape[2], D, v.shape[3]),
            (_pointer(mask), _pointer(cu_seqlens), n_docs, causal, int(window or 0), scale, float(softcap),
             _pointer(seed), t16, ks))


def _strides(t):
    return t.stride()[:3]  # (batch, head, row); the last dim is contiguous


def _cpp_attention_forward(q, k, v, o, lse, mask, cu_seqlens, causal, window, scale, softcap, seed, t16, ks,
                           q_offset=0, sinks=None):
    """Blocked fp32 attention (csrc/attention.cpp): q, k, v, o by pointer and strides, any GQA group;
    sinks fp32 [H] contiguous or None."""
    sizes, problem = _cpp_attention_problem(q, k, v, mask, cu_seqlens, causal, window, scale, softcap, seed, t16,
                                            ks)
    _C.attention_forward(DTYPE_CODES[q.dtype], sizes, q.data_ptr(), _strides(q), k.data_ptr(), _strides(k),
                         v.data_ptr(), _strides(v), o.data_ptr(), _strides(o), lse.data_ptr(), *problem,
                         int(q_offset), _pointer(sinks))


def _cpp_attention_backward(do, q, k, v, o, lse, mask, cu_seqlens, causal, window, scale, softcap, seed, t16, ks, dq,
                            dk, dv, q_offset=0, sinks=None, dsinks=None):
    """dq, dk, dv (contiguous) from do (contiguous); delta = rowsum(dO * O) is taken inside. With sinks
    (fp32 [H]) also dsinks (fp32 [H], summed over the batch)."""
    sizes, problem = _cpp_attention_problem(q, k, v, mask, cu_seqlens, causal, window, scale, softcap, seed, t16,
                                            ks)
    _C.attention_backward(DTYPE_CODES[q.dtype], sizes, do.data_ptr(), q.data_ptr(), _strides(q), k.data_ptr(),
                          _strides(k), v.data_ptr(), _strides(v), o.data_ptr(), _strides(o), lse.data_ptr(), *problem,
                          dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), int(q_offset), _pointer(sinks),
                          _pointer(dsinks))


_CPP_ADAPTERS = {
    ("attention", "forward"): _cpp_attention_forward,
    ("attention", "backward"): _cpp_attention_backward,
}
